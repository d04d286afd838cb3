#!/usr/bin/env python3
"""Gate 2 excess on CUDA, second cut: which op's f32 rounding on the GPU moves the micro model's
log-softmax past 1e-4? Each variant recomputes one class of ops in f64 (rounded once to f32)."""
import json, sys
from pathlib import Path
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
import torch
import muser.oracle as oracle
from muser.engine import Engine, forward as F, lanes as L
from muser.engine.gate import gate2, default_prompt

out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".")
orig = {k: getattr(F, k) for k in ("rms_norm", "sigmoid", "silu", "softcap_logits", "rope")}
orig_call = L.Linear.__call__

def d64(fn):
    return lambda x, *a: fn(x.double(), *a).float()

def linear64(self, w, x):
    return (x.double() @ w.decode().double().T).float()

variants = {
    "none": {},
    "norm64": {"rms_norm": d64(orig["rms_norm"])},
    "act64": {"sigmoid": d64(orig["sigmoid"]), "silu": d64(orig["silu"])},
    "softcap64": {"softcap_logits": d64(orig["softcap_logits"])},
    "all_elementwise64": {"rms_norm": d64(orig["rms_norm"]), "sigmoid": d64(orig["sigmoid"]),
                          "silu": d64(orig["silu"]), "softcap_logits": d64(orig["softcap_logits"])},
    "linear64": {"__linear": True},
    "everything64": {"rms_norm": d64(orig["rms_norm"]), "sigmoid": d64(orig["sigmoid"]),
                     "silu": d64(orig["silu"]), "softcap_logits": d64(orig["softcap_logits"]), "__linear": True},
}
res = {}
for model in ("muse-glimmer-micro-f16.gguf",):
    path = REPO / "models" / model
    orc = oracle.load(path, arithmetic="f32", kv="f32")
    for name, patch in variants.items():
        for k, v in orig.items():
            setattr(F, k, patch.get(k, v))
        L.Linear.__call__ = linear64 if patch.get("__linear") else orig_call
        try:
            eng = Engine.open(path, device="cuda", lane="exact", kv="f32")
            eng.session  # noqa
            r = gate2(path, eng, orc, "f32", n_gen=24, prompt=default_prompt(eng.cfg, 264), noise="always")
            r = {k: r[k] for k in ("max_dlsm", "median_dlsm", "worst_row", "noise_floor", "status")}
        except Exception as e:
            r = {"error": repr(e)[:300]}
        res[name] = r
        print(name, r, flush=True)
(out / "device_diag2.json").write_text(json.dumps(res, indent=1))
