"""Activation quantizers: bit-exact against the CPU backend's own from_float (the functions the
pinned x86 AVX2 ggml-cpu runs before every quantized matmul)."""

from __future__ import annotations

import numpy as np
import pytest

from muser.errors import FormatError
from muser.gguf.types import GgmlType as G
from muser.quant import quantize, quantize_q8_0, quantize_q8_K

from . import ggml_ref


def activations(seed: int, T: int = 24, n: int = 1024) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((T, n)) * np.exp(rng.standard_normal((T, 1)) * 3)).astype(np.float32)
    x[0] = 0
    x[1, :256] = 0
    x[2] = np.round(x[2] * 4) / 4  # exact .5 products
    x[3] = rng.integers(-3, 4, n)
    x[4] = np.tile(np.float32([1.0, -1.0]), n // 2)  # +max and -max both present
    x[5, :256] = np.linspace(-1, 1, 256)
    x[6] = rng.standard_t(1.2, n)
    return x


def test_vec_dot_types_are_as_documented():
    want = {G.Q4_K: G.Q8_K, G.Q5_K: G.Q8_K, G.Q6_K: G.Q8_K, G.Q8_0: G.Q8_0, G.Q4_0: G.Q8_0,
            G.NVFP4: G.Q8_0, G.F16: G.F16, G.BF16: G.BF16, G.F32: G.F32}
    from muser.quant import VEC_DOT_TYPE

    for w, a in want.items():
        assert ggml_ref.cpu_traits(int(w)).vec_dot_type == int(a)
        assert VEC_DOT_TYPE[w] == a


@pytest.mark.parametrize("seed", range(3))
def test_q8_K_bit_exact(seed):
    x = activations(seed)
    ours = quantize_q8_K(x)
    b = ours.to_bytes().reshape(x.shape[0], -1, 292)
    for r in range(x.shape[0]):
        ref = ggml_ref.from_float(int(G.Q8_K), x[r]).reshape(-1, 292)
        nz = ours.d[r] != 0  # ggml leaves bsums unwritten for an all-zero block
        assert np.array_equal(b[r, :, :260], ref[:, :260]), r
        assert np.array_equal(b[r, nz], ref[nz]), r
    # d * qs reproduces ggml's dequantize_row_q8_K
    assert np.array_equal(ours.dequantize()[5], ggml_ref.dequantize_row_q8_K(b[5].reshape(-1), 1024))


@pytest.mark.parametrize("seed", range(3))
def test_q8_0_bit_exact_to_the_avx2_branch(seed):
    x = activations(seed)
    ours = quantize_q8_0(x).to_bytes()
    for r in range(x.shape[0]):
        assert np.array_equal(ours[r], ggml_ref.from_float(int(G.Q8_0), x[r])), r


def test_q8_0_avx2_is_not_the_reference_quantizer():
    """The AVX2 activation path rounds half-to-even with id = 127/amax; the weight reference
    (quantize_row_q8_0_ref) rounds half away from zero with id = 1/d. A block with amax 127
    (id = 1 on both paths) and exact halves separates them: 0.5 -> 0 vs 1, 2.5 -> 2 vs 3."""
    x = np.zeros((1, 32), np.float32)
    x[0, :4] = [127.0, 0.5, 2.5, -1.5]
    act = quantize_q8_0(x)
    assert act.qs[0, 0, :4].tolist() == [127, 0, 2, -2]
    ref = quantize(x, G.Q8_0).view(np.int8)[0, 2:6]
    assert ref.tolist() == [127, 1, 3, -2]
    assert np.array_equal(act.to_bytes()[0], ggml_ref.from_float(int(G.Q8_0), x[0]))


def test_shapes_and_refusals():
    a = quantize_q8_K(np.ones((3, 512), np.float32))
    assert a.d.shape == (3, 2) and a.qs.shape == (3, 2, 256) and a.bsums.shape == (3, 2, 16)
    b = quantize_q8_0(np.ones((3, 64), np.float32))
    assert b.d_bits.shape == (3, 2) and b.qs.shape == (3, 2, 32)
    with pytest.raises(FormatError, match="multiple of 256"):
        quantize_q8_K(np.ones((1, 100), np.float32))
    x = np.ones((1, 256), np.float32)
    x[0, 3] = np.nan
    with pytest.raises(FormatError, match="non-finite value nan at flat index 3"):
        quantize_q8_K(x)
