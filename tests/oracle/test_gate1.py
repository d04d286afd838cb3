"""Gate 1 (DESIGN.md "Exactness contract"): the oracle against the pinned llama.cpp on tiny
fixtures with window 32, prompts ending at positions 1, W-1, W, W+1, 2W+1 and one over 3
windows (prefill), the whole prompt token by token (decode), and prefill to W+1 then decode.

Gate 1a: F32 weights, F32 KV, oracle f32: max |d log-softmax| <= max(1e-4, 2 x noise floor) in
every run, identical top-1. Gate 1b: oracle ggml-cpu, f16 KV, every dtype: same max rule, top-1
>= 99%. Plus the well-conditioned family (noise floor <= 1e-5, max <= 1e-4 outright), and the
checks that the gates cannot pass by accident (a skipped rounding point or a semantic slip fails).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import muser.oracle.forward as oracle_graph
from muser.bench.kinds.parity import FLOOR, boundary_runs, default_tokens, run_suite
from muser.oracle import numerics as nm
from muser.oracle.numerics import log_softmax

from .conftest import DTYPES_1B, SEMANTIC, rounding_spec, well_spec

W = SEMANTIC.sliding_window


def suite(oracle, runner):
    toks = default_tokens(oracle.config.vocab, W)
    assert len(toks) > 3 * W
    runs = boundary_runs(len(toks), W)
    # the oracle is chunk-invariant bit for bit (test_session), so one prefill serves every feeding
    return run_suite(oracle, runner, toks, runs, oracle_feeding="prefill"), toks, runs


def describe(s) -> str:
    return "; ".join(f"{r.label}: max {r.max:.3g} thr {r.threshold:.3g} top1 {r.top1_agreement:.3f}" for r in s.runs)


def test_boundary_runs_cover_the_ring_edges():
    runs = boundary_runs(3 * W + 8, W)
    ends = {n - 1 for mode, n in runs if mode == "prefill"}
    assert {1, W - 1, W, W + 1, 2 * W + 1, 3 * W + 7} <= ends
    assert ("decode", 3 * W + 8) in runs and (W + 1, 3 * W + 8) in runs


_KQUANT = {"Q4_K", "Q5_K", "Q6_K"}


@pytest.mark.parametrize("dtype", DTYPES_1B)
def test_fixture_premises(dtype, make_gguf, oracle_cache):
    """What makes the gates meaningful: every 2-D weight is stored in the dtype under test (the
    mix holds Q4_K, Q5_K and Q6_K), every K-quant row length is a multiple of 256 (llama.cpp
    multiplies the stored type, no Q5_0/Q8_0 fallback), and the logits are peaky enough that
    top-1 is not a coin flip (median top-1 margin >= 0.3 nats, most positions >= 0.05)."""
    path = make_gguf(rounding_spec(dtype))
    m = oracle_cache(path, "ggml-cpu", "f16")
    f = m.file.gguf
    weights = {n: d for n, d in m.file.contract.dtypes.items() if len(f.tensor_info(n).shape) == 2}
    assert len(weights) == 2 + 8 * m.config.n_layers  # token_embd, output; 8 per layer
    kinds = set(weights.values())
    if dtype == "q4_k_xl":
        assert kinds == _KQUANT
    else:
        assert kinds == {dtype}
    for name, d in weights.items():
        if d in _KQUANT:
            assert f.tensor_info(name).shape[0] % 256 == 0, name
    ls = log_softmax(m.logits(default_tokens(m.config.vocab, W)))
    top2 = np.sort(ls, axis=-1)[:, -2:]
    margin = top2[:, 1] - top2[:, 0]
    assert np.median(margin) >= 0.3 and np.mean(margin >= 0.05) >= 0.9, np.percentile(margin, [5, 50])


@pytest.mark.parametrize("family", ["semantic", "rounding", "well"])
def test_gate_1a(family, make_gguf, oracle_cache, runner_cache):
    spec = {"semantic": SEMANTIC, "rounding": rounding_spec("F32"), "well": well_spec("F32")}[family]
    path = make_gguf(spec)
    s, _, _ = suite(oracle_cache(path, "f32", "f32"), runner_cache(path, "f32"))
    assert s.gate == "1a"
    assert s.status() == "pass", describe(s)
    assert s.top1 == 1.0
    assert all(r.max <= max(FLOOR, 2 * r.noise_floor) for r in s.runs)


@pytest.mark.parametrize("dtype", DTYPES_1B)
def test_gate_1b(dtype, make_gguf, oracle_cache, runner_cache):
    path = make_gguf(rounding_spec(dtype))
    s, _, _ = suite(oracle_cache(path, "ggml-cpu", "f16"), runner_cache(path, "f16"))
    assert s.gate == "1b"
    assert s.status() == "pass", describe(s)
    assert s.top1 >= 0.99


@pytest.mark.parametrize("dtype", DTYPES_1B)
def test_well_conditioned_outright(dtype, make_gguf, oracle_cache, runner_cache):
    path = make_gguf(well_spec(dtype))
    s, _, _ = suite(oracle_cache(path, "ggml-cpu", "f16"), runner_cache(path, "f16"))
    # well-conditioned: the 1-ulp part <= 1e-5; with the f32 summation-order part still <= 5e-5
    assert s.noise_jitter <= 1e-5 and s.noise_floor <= 5e-5, describe(s)
    assert s.max <= 1e-4, describe(s)
    assert s.status() == "pass" and s.top1 == 1.0


def _ablated(oracle, runner, toks, runs, **patches):
    """Run the suite with methods of the oracle's Arithmetic replaced; restore them after."""
    arith = oracle.forward.arith
    saved = {k: getattr(arith, k) for k in patches}
    try:
        for k, fn in patches.items():
            setattr(arith, k, fn)
        return run_suite(oracle, runner, toks, runs, oracle_feeding="prefill")
    finally:
        for k, fn in saved.items():
            setattr(arith, k, fn)


@pytest.mark.parametrize("dtype", ["Q8_0", "Q4_K"])
def test_skipping_activation_quantization_cannot_pass(dtype, make_gguf, oracle_cache, runner_cache):
    """Without the Q8_0 / Q8_K activation rounding the same fixture fails Gate 1b: its max is
    over the real gate's threshold, its median |d| is >= 1000x the real one, and top-1 drops.
    (The max margin is modest, ~2x: a single rounding flip at the LM-head input sets the noise
    floor of a quantized fixture, while the real oracle's median sits at ~5e-6.)"""
    path = make_gguf(rounding_spec(dtype))
    oracle, runner = oracle_cache(path, "ggml-cpu", "f16"), runner_cache(path, "f16")
    real, toks, runs = suite(oracle, runner)
    skip = _ablated(oracle, runner, toks, runs, activation=lambda x, t: x)
    assert skip.status() == "fail"
    assert skip.max >= 1.5 * max(r.threshold for r in real.runs), describe(skip)
    assert skip.median >= 1000 * real.median
    assert skip.top1 < 0.99 <= real.top1


@pytest.mark.parametrize("point", ["attn_query", "attn_probs"])
def test_skipping_f16_attention_rounding_fails(point, make_gguf, oracle_cache, runner_cache):
    """The f16 conversions of Q (K.Q against an f16 K) and of the probabilities (V.P against an
    f16 V) of llama.cpp's non-flash attention are visible on the rounding fixture."""
    path = make_gguf(rounding_spec("Q4_K"))
    oracle, runner = oracle_cache(path, "ggml-cpu", "f16"), runner_cache(path, "f16")
    real, toks, runs = suite(oracle, runner)
    abl = _ablated(oracle, runner, toks, runs, **{point: lambda x: x})
    assert abl.status() == "fail"
    over = [s.max / r.threshold for s, r in zip(abl.runs, real.runs)]
    assert max(over) >= 2, over
    assert abl.median >= 100 * real.median


def test_semantic_slips_fail_gate_1a(semantic_gguf, oracle_cache, runner_cache, monkeypatch):
    """Each trap of book 9.1 moves log-probs far past Gate 1a on the semantic fixture."""
    oracle, runner = oracle_cache(semantic_gguf, "f32", "f32"), runner_cache(semantic_gguf, "f32")
    real, toks, runs = suite(oracle, runner)
    cfg = oracle.forward.cfg

    def fails(by: float) -> None:
        s = run_suite(oracle, runner, toks, runs, oracle_feeding="prefill")
        assert s.status() == "fail"
        assert max(a.max / b.threshold for a, b in zip(s.runs, real.runs)) >= by

    # window rule p1 - p0 < W (LLAMA_SWA_TYPE_STANDARD), not <= W
    monkeypatch.setattr(oracle.forward, "cfg", dataclasses.replace(cfg, sliding_window=W + 1))
    fails(100)
    # theta from rope.freq_base_swa, not rope.freq_base
    monkeypatch.setattr(oracle.forward, "cfg", dataclasses.replace(cfg, rope_base_swa=cfg.rope_base))
    fails(100)
    monkeypatch.setattr(oracle.forward, "cfg", cfg)
    # the post-attention / post-FFN epsilon is llama.cpp's 1e-8, not the GGUF's 1e-5 (book 9.9)
    monkeypatch.setattr(oracle_graph, "POST_NORM_EPS", np.float32(1e-5))
    fails(5)
    monkeypatch.setattr(oracle_graph, "POST_NORM_EPS", nm.F32(1e-8))

    # interleaved (NORM) RoPE pairing, not half-split (book 14.4)
    def neox(x, c, s):
        h = x.shape[-1] // 2
        return np.concatenate([x[..., :h] * c[:, None] - x[..., h:] * s[:, None],
                               x[..., :h] * s[:, None] + x[..., h:] * c[:, None]], -1)

    monkeypatch.setattr(nm, "rope_norm", neox)
    fails(100)


def test_noise_floor_is_the_right_yardstick(semantic_gguf, oracle_cache):
    """Noise floor: moving every perturbation site by one ulp changes log-probs by a tiny
    but non-zero amount on the f32 semantic fixture (no rounding point), and up/down trials
    are deterministic."""
    m = oracle_cache(semantic_gguf, "f32", "f32")
    toks = default_tokens(m.config.vocab, W)[:48]
    nf = m.noise_floor(toks)
    assert 0 < nf.value < 1e-4 and len(nf.trials) == 2
    assert m.noise_floor(toks).trials == nf.trials
    base = log_softmax(m.logits(toks))
    up = log_softmax(m.logits(toks, jitter="up"))
    assert float(np.abs(up - base).max()) == nf.trials[0]
