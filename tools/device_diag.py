#!/usr/bin/env python3
"""Locate a Gate 2 excess on CUDA (bench/reports/gate2-micro-cuda.md): the shipped micro model,
f32 K/V, a 264-row prefill across the 256 window, then greedy decode.

    python3 tools/device_diag.py variants OUT   # the gate under engine variants: prefill chunk 16
                                                # (fused matvec everywhere), torch-reference
                                                # attention instead of the Triton kernel, both;
                                                # the tiny Q4_K fixture beside it
    python3 tools/device_diag.py f64 OUT        # the gate with element-wise ops and/or every
                                                # linear layer recomputed in f64 (rounded once)
    python3 tools/device_diag.py machines OUT   # last 8 prefill rows of the oracle, the CPU engine
                                                # and the CUDA engine -> OUT/diag3.npz, to compare
                                                # with the same file made on another machine

Each mode writes its JSON (or npz) into OUT and prints one line per variant.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import muser.oracle as oracle  # noqa: E402
from muser.engine import Engine  # noqa: E402
from muser.engine import forward as F  # noqa: E402
from muser.engine import lanes as L  # noqa: E402
from muser.engine import session as S  # noqa: E402
from muser.gates import default_prompt, gate2  # noqa: E402

MICRO = REPO / "models" / "muse-glimmer-micro-q8_0.gguf"
KEYS = ("max_dlsm", "median_dlsm", "worst_row", "noise_floor", "status", "tokens_identical")


def _gate(path: Path, orc) -> dict:
    t = time.time()
    try:
        eng = Engine.open(path, device="cuda", lane="exact", kv="f32")
        r = gate2(path, eng, orc, "f32", n_gen=24, prompt=default_prompt(eng.cfg, 264), noise="always")
        r = {k: r[k] for k in KEYS}
    except Exception as e:  # recorded, the other variants go on
        r = {"error": repr(e)[:300]}
    r["s"] = round(time.time() - t, 1)
    return r


def variants(out: Path) -> None:
    from muser.model.synth import SynthSpec, write_fixture

    res = {"allow_tf32": torch.backends.cuda.matmul.allow_tf32,
           "fp32_precision": getattr(torch.backends.cuda.matmul, "fp32_precision", None)}
    orig_session, orig_init = Engine.session, S._EagerKv.__init__

    def ref_init(self, *a, **k):
        orig_init(self, *a, **k)
        self.cuda = False  # eager steps attend with attend_ref (torch ops on the device)

    tiny = out / "tiny-Q4_K.gguf"
    write_fixture(tiny, SynthSpec(dtype="Q4_K"))
    try:
        for name, path in (("micro_q8_0", MICRO), ("tiny_q4k", tiny)):
            orc = oracle.load(path, arithmetic="f32", kv="f32")
            for vname, chunk, ref in (("default", None, False), ("chunk16", 16, False),
                                      ("ref_attn", None, True), ("chunk16_ref_attn", 16, True)):
                Engine.session = ((lambda self, *a, _c=chunk, **k: orig_session(self, *a, **{**k, "chunk": _c}))
                                  if chunk else orig_session)
                S._EagerKv.__init__ = ref_init if ref else orig_init
                res[f"{name}/{vname}"] = r = _gate(path, orc)
                print(name, vname, r, flush=True)
    finally:
        Engine.session, S._EagerKv.__init__ = orig_session, orig_init
        tiny.unlink(missing_ok=True)
    (out / "device_diag.json").write_text(json.dumps(res, indent=1, default=str))


def f64(out: Path) -> None:
    names = ("rms_norm", "sigmoid", "silu", "softcap_logits")
    orig = {k: getattr(F, k) for k in names}
    orig_call = L.Linear.__call__

    def d64(fn):
        return lambda x, *a: fn(x.double(), *a).float()

    def linear64(self, w, x):
        return (x.double() @ w.decode().double().T).float()

    cases = {"none": ((), False), "norm64": (("rms_norm",), False), "act64": (("sigmoid", "silu"), False),
             "softcap64": (("softcap_logits",), False), "all_elementwise64": (names, False),
             "linear64": ((), True), "everything64": (names, True)}
    orc = oracle.load(MICRO, arithmetic="f32", kv="f32")
    res = {}
    try:
        for name, (ops, lin) in cases.items():
            for k in names:
                setattr(F, k, d64(orig[k]) if k in ops else orig[k])
            L.Linear.__call__ = linear64 if lin else orig_call
            res[name] = r = _gate(MICRO, orc)
            print(name, r, flush=True)
    finally:
        for k in names:
            setattr(F, k, orig[k])
        L.Linear.__call__ = orig_call
    (out / "device_diag2.json").write_text(json.dumps(res, indent=1))


def machines(out: Path) -> None:
    orc = oracle.load(MICRO, arithmetic="f32", kv="f32")
    eng = Engine.open(MICRO, device="cpu", lane="exact", kv="f32")
    prompt = default_prompt(eng.cfg, 264)
    res = {"oracle": orc.session(max_context=300).prefill(prompt, all_logits=True),
           "engine_cpu": eng.session(max_context=300).prefill(prompt, all_logits=True)}
    if torch.cuda.is_available():
        ec = Engine.open(MICRO, device="cuda", lane="exact", kv="f32")
        res["engine_cuda"] = ec.session(max_context=300).prefill(prompt, all_logits=True)
    np.savez_compressed(out / "diag3.npz", **{k: v[-8:] for k, v in res.items()})
    print("saved", sorted(res), "last 8 rows ->", out / "diag3.npz")


if __name__ == "__main__":
    modes = {"variants": variants, "f64": f64, "machines": machines}
    if len(sys.argv) != 3 or sys.argv[1] not in modes:
        sys.exit(f"usage: device_diag.py {{{'|'.join(modes)}}} OUT")
    out_dir = Path(sys.argv[2])
    out_dir.mkdir(parents=True, exist_ok=True)
    modes[sys.argv[1]](out_dir)
