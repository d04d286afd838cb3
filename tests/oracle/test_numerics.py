"""Each oracle op beside a scalar transcription of the ggml-cpu C code it mirrors (bit-exact),
and the dot products beside muser.quant's ggml-formulation reference (stated tolerance)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from muser.gguf.types import GgmlType as G
from muser.oracle import numerics as nm

F32, F64 = np.float32, np.float64
rng = np.random.default_rng(1234)


def test_rms_norm_is_ggml_expression_bit_for_bit():
    # ops.cpp ggml_compute_forward_rms_norm_f32 (fused MUL): double sum of float squares
    x = (rng.standard_normal((5, 96)) * 3).astype(F32)
    w = (1 + 0.1 * rng.standard_normal(96)).astype(F32)
    eps = F32(1e-5)
    got = nm.rms_norm(x, w, float(eps))
    for r in range(5):
        s = 0.0
        for v in x[r]:
            s += float(F32(v * v))  # (ggml_float)(x*x), sequential
        mean = F32(s / 96)
        scale = F32(1.0) / F32(math.sqrt(float(F32(mean + eps))))
        want = np.array([F32(F32(v * scale) * wi) for v, wi in zip(x[r], w)], dtype=F32)
        assert np.array_equal(got[r], want)
    # weightless entry norm and the 1e-8 post-norm epsilon
    assert np.array_equal(nm.rms_norm(x, None, 1e-8)[0], x[0] * (F32(1) / np.sqrt(F32(np.sum((x[0] * x[0]).astype(F64)) / 96) + F32(1e-8))))


def test_rope_cache_multiplies_theta_in_float():
    # ops.cpp ggml_rope_cache_init: theta = p; per pair cos/sin(theta); theta *= theta_scale
    base, hd = 10000.0, 32
    ts = F32(math.pow(float(F32(base)), float(F32(-2.0) / F32(hd))))
    assert nm.rope_theta_scale(base, hd) == ts
    pos = np.array([0, 1, 31, 32, 33, 4095])
    cos, sin = nm.rope_cache(pos, base, hd)
    for i, p in enumerate(pos):
        theta = F32(p)
        for j in range(hd // 2):
            assert cos[i, j] == F32(math.cos(float(theta))) and sin[i, j] == F32(math.sin(float(theta)))
            theta = F32(theta * ts)


def test_rope_norm_rotates_adjacent_pairs():
    x = rng.standard_normal((3, 2, 8)).astype(F32)
    cos, sin = nm.rope_cache(np.array([5, 6, 7]), 10000.0, 8)
    y = nm.rope_norm(x, cos, sin)
    for t in range(3):
        for h in range(2):
            for i in range(4):  # NORM convention: pair (2i, 2i+1), book 14.4
                x0, x1 = x[t, h, 2 * i], x[t, h, 2 * i + 1]
                assert y[t, h, 2 * i] == F32(F32(x0 * cos[t, i]) - F32(x1 * sin[t, i]))
                assert y[t, h, 2 * i + 1] == F32(F32(x0 * sin[t, i]) + F32(x1 * cos[t, i]))
    # the half-split (NEOX) pairing is a different rotation
    h = 4
    neox = np.concatenate([x[..., :h] * cos[:, None] - x[..., h:] * sin[:, None],
                           x[..., :h] * sin[:, None] + x[..., h:] * cos[:, None]], -1)
    assert not np.allclose(neox, y)


def test_softmax_is_ggml_soft_max_f32():
    scores = (rng.standard_normal((2, 3, 7)) * 4).astype(F32)
    mask = np.tril(np.ones((3, 7), bool), 4)[None]
    got = nm.softmax_rows(scores, 0.25, mask)
    for a in range(2):
        for r in range(3):
            wp = [F32(s * F32(0.25)) if mask[0, r, j] else F32(-np.inf) for j, s in enumerate(scores[a, r])]
            mx = max(wp)
            e = [F32(math.exp(float(F32(v - mx)))) if np.isfinite(v) else F32(0) for v in wp]
            total = sum(float(v) for v in e)  # ggml_float
            inv = F32(1.0 / total)
            assert np.array_equal(got[a, r], np.array([F32(v * inv) for v in e], dtype=F32))
    assert np.allclose(got.sum(-1), 1, atol=1e-6)


def test_activations_and_logit_tail_expression_order():
    x = (rng.standard_normal(64) * 6).astype(F32)
    g = rng.standard_normal(64).astype(F32)
    assert np.array_equal(nm.sigmoid(x), np.array([F32(F32(1) / F32(F32(1) + F32(math.exp(-float(v))))) for v in x]))
    assert np.array_equal(nm.swiglu(x, g), np.array(
        [F32(F32(v / F32(F32(1) + F32(math.exp(-float(v))))) * u) for v, u in zip(x, g)]))
    # book 9.10: x logit_scale first, then 20*tanh(l/20) through ggml_scale(1/softcap)
    z = (rng.standard_normal(64) * 40).astype(F32)
    s = F32(1 / math.sqrt(26))
    want = np.array([F32(F32(math.tanh(float(F32(F32(v * s) * F32(F32(1) / F32(20)))))) * F32(20)) for v in z])
    assert np.array_equal(nm.logit_tail(z, float(s), 20.0), want)
    assert np.abs(nm.logit_tail(z * 100, float(s), 20.0)).max() <= 20


@pytest.mark.parametrize("t", [G.F16, G.BF16, G.Q8_0, G.Q4_0, G.Q4_K, G.Q5_K, G.Q6_K])
def test_matmul_matches_ggml_formulation_reference(t):
    """The oracle's dot (dequantized weight x rounded activation, float64, one rounding) against
    muser.quant.dot.matmul_ggml (ggml's per-block scale products): a few f32 ulps apart."""
    from muser.quant import dequantize, quantize
    from muser.quant.dot import matmul_ggml

    n_in, n_out = 512, 48
    w = (rng.standard_normal((n_out, n_in)) / math.sqrt(n_in)).astype(F32)
    wb = np.ascontiguousarray(quantize(w, t)).view(np.uint8).reshape(n_out, -1)
    wd = dequantize(wb.reshape(-1), t, n_out * n_in).reshape(n_out, n_in).astype(F64)
    x = (rng.standard_normal((6, n_in)) * 2).astype(F32)
    arith = nm.Arithmetic("ggml-cpu", "f16")
    ours = nm.matmul(arith.activation(x, t), wd)
    ref = matmul_ggml(wb, t, x)
    scale = np.abs(np.abs(x).astype(F64) @ np.abs(wd).T).astype(F32)
    assert np.all(np.abs(ours - ref) <= 8 * np.spacing(scale))
    # and skipping the activation rounding is visibly different (the rounding point is real)
    plain = nm.matmul(x, wd)
    assert np.abs(plain - ref).max() > 100 * np.abs(ours - ref).max()


def test_activation_rounding_dispatch():
    x = (rng.standard_normal((3, 512)) * 3).astype(F32)
    a = nm.Arithmetic("ggml-cpu", "f16")
    assert a.activation(x, G.F32) is x
    assert np.array_equal(a.activation(x, G.F16), x.astype(np.float16).astype(F32))
    from muser.quant.activation import quantize_q8_0, quantize_q8_K
    from muser.quant.common import bf16_round

    assert np.array_equal(a.activation(x, G.BF16), bf16_round(x))
    assert np.array_equal(a.activation(x, G.Q8_0), quantize_q8_0(x).dequantize().astype(F64))
    q8k = quantize_q8_K(x)
    assert np.array_equal(a.activation(x, G.Q6_K), (q8k.d.astype(F64)[..., None] * q8k.qs).reshape(3, 512))
    # f32 arithmetic has no rounding point; K/V precision is the KV type's
    b = nm.Arithmetic("f32", "f16")
    assert b.activation(x, G.Q4_K) is x and b.attn_query(x) is x and b.attn_probs(x) is x
    assert np.array_equal(a.attn_query(x), x.astype(np.float16).astype(F32))
    assert nm.Arithmetic("ggml-cpu", "f32").attn_probs(x) is x
    # a non-finite activation passes through to the logits, where it is refused
    y = x.copy()
    y[0, 0] = np.nan
    assert np.isnan(a.activation(y, G.Q4_K)[0, 0])


def test_jitter_moves_exactly_one_ulp():
    x = rng.standard_normal(1000).astype(F32)
    a = nm.Arithmetic("f32", "f32")
    a.jitter = "up"
    up = a.site(x)
    a.jitter = "down"
    down = a.site(x)
    a.jitter = np.random.default_rng(0)
    rnd = a.site(x)
    assert np.array_equal(up, np.nextafter(x, F32(np.inf))) and np.array_equal(down, np.nextafter(x, F32(-np.inf)))
    assert np.all((rnd == up) | (rnd == down)) and (rnd == up).any() and (rnd == down).any()
    a.jitter = None
    assert a.site(x) is x
