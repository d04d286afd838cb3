"""Every rounding point of the oracle's ggml-cpu arithmetic is needed, one at a time: for each
point and each weight-type family, a fixture whose path through that point is well-conditioned
(its rounding flips stay isolated, so the fixture's noise floor is small where the point acts)
passes Gate 1b against the pinned llama.cpp with the point, and fails it with only that point
removed (muser.gates.judge: max, median and top-1 against the fixture's own floors).

Points (ggml-cpu.c ggml_compute_forward_mul_mat converts src1 to the weight's vec_dot_type;
llama-graph.cpp build_attn_mha runs K.Q and V.P against the f16 cache):
- attn_in: the normed input of Q/K/V/gate; attn_out: the gated attention output entering o_proj;
  ffn_in: the normed input of up/gate; ffn_down: the SwiGLU output entering ffn_down;
  lm_head: the final-normed row entering the LM head (F16/BF16 conversion, Q8_0 or Q8_K);
- kv_store: K and V stored as f16; attn_query: Q converted to f16; attn_probs: P converted to f16.

Not covered: attn_out (the o_proj input) on a quantized family, and the FFN points on F16 (see
CASES): no fixture found where removing the point stands above the floor there.

Fixtures (SynthSpec gains; the 1e-8 post-norms pass a sub-layer through only when its output
is well above 1e-4 RMS): every projection at gain 1e-3, LM head 3, and the path under test
raised: the FFN (gain 0.5 on up/gate/down) for ffn_*; attn_output (gain 1, F32 weights) for the
f16 attention points.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from muser.bench.kinds.parity import default_tokens
from muser.gates import judge
from muser.kv.backend import NumpyBackend
from muser.model.synth import SynthSpec
from muser.oracle import NoiseFloor
from muser.oracle import numerics as nm
from muser.oracle.numerics import log_softmax

pytestmark = pytest.mark.comparator

W = SynthSpec().sliding_window
ROLES = {"attn_in": ("attn_q", "attn_k", "attn_v", "attn_gate"), "attn_out": ("attn_output",),
         "ffn_in": ("ffn_up", "ffn_gate"), "ffn_down": ("ffn_down",), "lm_head": ("output",)}
BASE = dict(gain=1e-3, lm_gain=3.0)
PATHS = {
    "plain": (),  # attention and FFN outputs far below the post-norms' sqrt(1e-8): the main path
    "ffn": (("ffn_up", 0.5), ("ffn_gate", 0.5), ("ffn_down", 0.5)),  # the FFN passes its norm
    "attn": (("attn_output", 1.0),),  # the attention output passes its norm
}
ACTIVATION_FAMILIES = ("F16", "BF16", "Q8_0", "Q4_K")
CASES = [(pt, fam, "plain") for pt in ("attn_in", "lm_head") for fam in ACTIVATION_FAMILIES]
# F16 is left out of the FFN points: on an FFN strong enough to pass its post-norm, llama.cpp's
# f32 accumulation order flips the f16 rounding of the SwiGLU output at nearly every position,
# and that floor (median ~5e-4) is as large as removing either FFN point (measured 0.7-0.9x)
CASES += [(pt, fam, "ffn") for pt in ("ffn_in", "ffn_down") for fam in ("BF16", "Q8_0", "Q4_K")]
# the f16 attention points on F32 weights: no activation rounding beside them to hide them
CASES += [(pt, "F32", "attn") for pt in ("kv_store", "attn_query", "attn_probs")]


@contextlib.contextmanager
def without(oracle, point: str):
    """The oracle with one rounding point removed (restored after)."""
    fw, a = oracle.forward, oracle.forward.arith
    if point in ROLES:
        roles = ROLES[point]
        keep = fw._mm

        def mm(x, *lins):
            if any(lins[0].name.endswith(f"{r}.weight") for r in roles):
                return [nm.matmul(x, lin.w, a.reduction) for lin in lins]
            return keep(x, *lins)

        fw._mm = mm
        try:
            yield
        finally:
            del fw._mm
    elif point == "kv_store":
        keep = NumpyBackend.round_to
        NumpyBackend.round_to = lambda self, rows, dtype: np.asarray(rows, dtype=np.float32)
        try:
            yield
        finally:
            NumpyBackend.round_to = keep
    else:
        setattr(a, point, lambda x: x)
        try:
            yield
        finally:
            delattr(a, point)


@pytest.fixture(scope="module")
def measured(make_gguf, oracle_cache, runner_cache):
    """(path kind, family) -> (oracle, tokens, llama.cpp log-softmax, the fixture's NoiseFloor)."""
    cache: dict = {}

    def get(kind: str, family: str):
        key = (kind, family)
        if key not in cache:
            path = make_gguf(SynthSpec(dtype=family, gains=PATHS[kind], **BASE))
            oracle = oracle_cache(path, "ggml-cpu", "f16")
            toks = default_tokens(oracle.config.vocab, W)
            theirs = log_softmax(runner_cache(path, "f16").logits(toks, "prefill"))
            base, runs = oracle.noise_runs(toks)
            cache[key] = (oracle, toks, theirs, base, NoiseFloor.measure(base, runs))
        return cache[key]

    return get


def _verdict(ours: np.ndarray, theirs: np.ndarray, floor: NoiseFloor) -> dict:
    per_pos = np.abs(ours - theirs).max(axis=-1)  # [T]
    top1 = float(np.mean(ours.argmax(-1) == theirs.argmax(-1)))
    return judge(per_pos, top1, floor, top1_need=0.99)


@pytest.mark.parametrize("point, family, kind", CASES, ids=[f"{p}-{f}" for p, f, _ in CASES])
def test_removing_one_rounding_point_fails_gate_1b(point, family, kind, measured):
    oracle, toks, theirs, base, floor = measured(kind, family)
    real = _verdict(base, theirs, floor)
    assert real["ok"], real  # with every point: Gate 1b passes on this fixture
    with without(oracle, point):
        ablated = log_softmax(oracle.logits(toks))
    assert not np.array_equal(ablated, base), f"{point}: removing it changed nothing"
    v = _verdict(ablated, theirs, floor)
    assert not v["ok"], f"{point} ({family}): Gate 1b still passes without it: {v['values']} vs {v['bounds']}"
