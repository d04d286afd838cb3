#!/usr/bin/env python3
"""Locate a Gate 2 excess on CUDA: the shipped micro model, f32 K/V, prefill of 264 rows then
greedy decode; the same gate under variants (prefill chunk 16 = the fused-matvec path; eager
attention by the torch reference instead of the Triton kernel; both) -> JSON on stdout/--out."""
import json, os, sys, time
from pathlib import Path
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
import numpy as np
import torch
import muser.oracle as oracle
from muser.engine import Engine
from muser.engine import session as S
from muser.engine.gate import gate2, default_prompt
from muser.model.synth import SynthSpec, write_fixture

out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".")
res = {"allow_tf32": torch.backends.cuda.matmul.allow_tf32,
       "fp32_precision": getattr(torch.backends.cuda.matmul, "fp32_precision", None)}
orig_session = Engine.session
orig_init = S._EagerKv.__init__

def variant(chunk=None, ref_attn=False):
    Engine.session = (lambda self, *a, **k: orig_session(self, *a, **{**k, "chunk": chunk})) if chunk else orig_session
    if ref_attn:
        def init(self, *a, **k):
            orig_init(self, *a, **k)
            self.cuda = False
        S._EagerKv.__init__ = init
    else:
        S._EagerKv.__init__ = orig_init

micro = REPO / "models" / "muse-glimmer-micro-f16.gguf"
tiny = Path("/tmp/muser-dev/tiny-Q4_K.gguf")
if not tiny.is_file():
    tiny.parent.mkdir(parents=True, exist_ok=True)
    write_fixture(tiny, SynthSpec(dtype="Q4_K"))
for name, path in (("micro_f16", micro), ("tiny_q4k", tiny)):
    orc = oracle.load(path, arithmetic="f32", kv="f32")
    for vname, kw in (("default", {}), ("chunk16", {"chunk": 16}), ("ref_attn", {"ref_attn": True}),
                      ("chunk16_ref_attn", {"chunk": 16, "ref_attn": True})):
        variant(**kw)
        t = time.time()
        try:
            eng = Engine.open(path, device="cuda", lane="exact", kv="f32")
            prompt = default_prompt(eng.cfg, 264)
            r = gate2(path, eng, orc, "f32", n_gen=24, prompt=prompt, noise="always")
            r = {k: r[k] for k in ("max_dlsm", "median_dlsm", "worst_row", "noise_floor", "status", "tokens_identical")}
        except Exception as e:
            r = {"error": repr(e)}
        r["s"] = round(time.time() - t, 1)
        res[f"{name}/{vname}"] = r
        print(name, vname, r, flush=True)
variant()
(out / "device_diag.json").write_text(json.dumps(res, indent=1, default=str))
