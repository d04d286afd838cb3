"""Quantizers: byte-identical to llama.cpp's reference quantizers (no importance matrix).

Two levels: (1) per format against the compiled ggml_quantize_chunk on adversarial rows (signed
zeros, constant and one-signed blocks, spikes, tiny and huge scales, heavy tails); (2) a whole
synthetic Muse Glimmer F32 fixture quantized by the pinned llama.cpp (llama_model_quantize,
pure) and by Muser, every tensor compared byte for byte."""

from __future__ import annotations

import numpy as np
import pytest

import llama_cpp

from muser.errors import FormatError
from muser.gguf.reader import read_gguf
from muser.gguf.types import GgmlType as G
from muser.quant import quantize

from . import ggml_ref

QUANT_TYPES = [G.Q8_0, G.Q4_0, G.Q4_K, G.Q5_K, G.Q6_K, G.NVFP4]


def adversarial_rows(seed: int, n: int = 1024) -> np.ndarray:
    rng = np.random.default_rng(seed)
    rows = [
        rng.standard_normal(n),
        rng.standard_t(1.5, n),  # heavy tail
        np.abs(rng.standard_normal(n)) + 3,  # one-signed: min > 0 clamps to 0
        -np.abs(rng.standard_normal(n)) - 3,
        np.zeros(n),
        np.where(rng.random(n) < 0.5, -0.0, 0.0),  # signed zeros (Q4_0 stores d = -0.0)
        np.full(n, 0.5),  # constant: max == min
        rng.integers(-3, 4, n).astype(float),  # many exact ties
        np.round(rng.standard_normal(n) * 8) / 8,
        rng.standard_normal(n) * 1e-6,
        rng.standard_normal(n) * 1e-20,  # below GROUP_MAX_EPS in places
        rng.standard_normal(n) * 1e4,
        np.repeat(rng.standard_normal(n // 16), 16),
        rng.standard_normal(n) * np.repeat(np.exp(rng.standard_normal(n // 16) * 3), 16),
        rng.uniform(-1, 1, n),
    ]
    spike = np.zeros(n)
    spike[rng.integers(0, n, 12)] = rng.standard_normal(12) * 10
    rows.append(spike)
    mixed = rng.standard_normal(n)
    mixed[::7] = 0
    rows.append(mixed)
    return np.array(rows, dtype=np.float32)


@pytest.mark.parametrize("t", QUANT_TYPES, ids=lambda t: t.name)
def test_byte_identical_to_ggml_quantize_chunk(t):
    for seed in range(6):
        x = adversarial_rows(seed)
        ours = quantize(x, t)
        ref = ggml_ref.quantize_chunk(int(t), x)
        diff = (ours != ref).any(axis=1)
        assert not diff.any(), f"{t.name}: rows {np.flatnonzero(diff).tolist()} differ (seed {seed})"


@pytest.mark.parametrize("t", [G.F16, G.BF16], ids=lambda t: t.name)
def test_float_conversions_match_ggml(t):
    rng = np.random.default_rng(11)
    bits = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    x = x[np.isfinite(x)]
    x = np.concatenate([x, np.float32([65504, 65519.99, 65520, 1e-8, -6e-8, 3.0e-5, 0.0, -0.0])])
    x = x[: x.size // 256 * 256].reshape(-1, 256)
    ours = np.ascontiguousarray(quantize(x, t)).view(np.uint8).reshape(x.shape[0], -1)
    assert np.array_equal(ours, ggml_ref.quantize_chunk(int(t), x))


def test_refusals():
    with pytest.raises(FormatError, match="not a multiple of the Q4_K block of 256"):
        quantize(np.zeros((2, 128), np.float32), G.Q4_K)
    x = np.zeros((2, 256), np.float32)
    x[1, 7] = np.inf
    with pytest.raises(FormatError, match="non-finite value inf at flat index 263"):
        quantize(x, G.Q8_0)
    with pytest.raises(FormatError, match="float32"):
        quantize(np.zeros((2, 256)), G.Q8_0)
    with pytest.raises(FormatError, match="no quantizer for dtype Q3_K"):
        quantize(np.zeros((2, 256), np.float32), G.Q3_K)


# llama.cpp ftype -> the type every 2-D tensor gets with pure=True
FTYPES = {
    llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0: G.Q8_0,
    llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0: G.Q4_0,
    llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_S: G.Q4_K,
    llama_cpp.LLAMA_FTYPE_MOSTLY_Q5_K_S: G.Q5_K,
    llama_cpp.LLAMA_FTYPE_MOSTLY_Q6_K: G.Q6_K,
    llama_cpp.LLAMA_FTYPE_MOSTLY_F16: G.F16,
    llama_cpp.LLAMA_FTYPE_MOSTLY_BF16: G.BF16,
}


@pytest.mark.comparator
@pytest.mark.parametrize("ftype", list(FTYPES), ids=lambda f: FTYPES[f].name)
def test_whole_fixture_byte_identical_to_llama_model_quantize(ftype, tiny_gguf, tmp_path):
    """F32 fixture (hidden 512, ffn 512, attn_dim 256: every row a multiple of 256, so llama.cpp
    never falls back). With pure=True llama.cpp gives every 2-D tensor -- token_embd and output
    included -- the ftype's type and leaves the 1-D tensors (norms, q/k norms) F32 untouched."""
    want = FTYPES[ftype]
    out = tmp_path / f"llama-{want.name}.gguf"
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = ftype
    p.pure = True
    p.nthread = 2
    assert llama_cpp.llama_model_quantize(str(tiny_gguf).encode(), str(out).encode(), p) == 0
    with read_gguf(tiny_gguf) as src, read_gguf(out) as q:
        assert set(q.tensors) == set(src.tensors)
        n_quant = 0
        for name, ti in q.tensors.items():
            s = src.tensors[name]
            if len(s.shape) == 1:
                assert ti.type.ggml_type == G.F32
                assert np.array_equal(q.raw(name), src.raw(name)), name
                continue
            assert ti.type.ggml_type == want, name
            ours = np.ascontiguousarray(quantize(np.ascontiguousarray(src.array(name)), want))
            ours = ours.view(np.uint8).reshape(q.raw(name).shape)
            differ = np.count_nonzero(ours != q.raw(name))
            assert differ == 0, f"{name}: {differ} of {ours.size} bytes differ ({differ / ours.size:.2e})"
            n_quant += 1
        assert n_quant == 2 + 8 * 4  # embedding, LM head, 8 projections x 4 layers
