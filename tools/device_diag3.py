#!/usr/bin/env python3
"""Is the oracle itself machine-dependent? Save the micro model's prefill logits (264-token gate
prompt, f32 K/V) from the oracle on this machine's CPU and from the engine on CUDA."""
import sys
from pathlib import Path
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
import numpy as np
import muser.oracle as oracle
from muser.engine.gate import default_prompt
out = Path(sys.argv[1])
path = REPO / "models" / "muse-glimmer-micro-f16.gguf"
orc = oracle.load(path, arithmetic="f32", kv="f32")
prompt = default_prompt(orc.cfg if hasattr(orc, "cfg") else None, 264) if hasattr(orc, "cfg") else None
from muser.engine import Engine
eng = Engine.open(path, device="cpu", lane="exact", kv="f32")
prompt = default_prompt(eng.cfg, 264)
o = orc.session(max_context=300).prefill(prompt, all_logits=True)
e = eng.session(max_context=300).prefill(prompt, all_logits=True)
res = {"oracle": o, "engine_cpu": e}
try:
    ec = Engine.open(path, device="cuda", lane="exact", kv="f32")
    res["engine_cuda"] = ec.session(max_context=300).prefill(prompt, all_logits=True)
except Exception as ex:
    print("cuda:", ex)
np.savez_compressed(out / "diag3.npz", **{k: v[-8:] for k, v in res.items()})
import subprocess
print(subprocess.run("grep -o -m1 'avx512[a-z_]*' /proc/cpuinfo | sort -u | head -3; lscpu | grep 'Model name'", shell=True,
                     capture_output=True, text=True).stdout)
np.show_config()
