"""The integer-lane GEMM (kernels/qmatmul_i8.py) under the Triton interpreter: the activation
quantizers equal ggml's bitwise, every format's product equals muser.quant.dot.matmul_ggml
bitwise for 1..33 rows, and a row's bits do not depend on the rows beside it or on the tiling
(compiled for sm_90 by tools/triton_aot_check.py; run on the GPU by the lane's device checks)."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

from muser.engine.weights import random_bytes, repack
from muser.errors import LaneError
from muser.gguf.types import GgmlType as G
from muser.quant.activation import quantize_q8_0, quantize_q8_K
from muser.quant.dot import matmul_ggml

FORMATS = (G.Q8_0, G.Q4_0, G.Q4_K, G.Q5_K, G.Q6_K)
N_IN = {G.Q8_0: 96, G.Q4_0: 384, G.Q4_K: 512, G.Q5_K: 512, G.Q6_K: 512}
ROWS = (1, 2, 7, 16, 17, 33)
CONFIGS = ((16, 16, 4, 1), (64, 32, 4, 2))


@pytest.fixture(scope="module")
def i8(kernels):
    """qmatmul_i8 re-imported while the `kernels` fixture holds TRITON_INTERPRET=1."""
    from muser.engine.kernels import qmatmul_i8

    yield importlib.reload(qmatmul_i8)
    importlib.reload(qmatmul_i8)


def _x(T: int, K: int, seed: int = 0) -> np.ndarray:
    """[T, K] f32: row 0 all zero, row 1 a |max| tie of opposite signs in every 256-block (the
    negative first, then the positive first), rows 2/3 large and small magnitudes, one block of
    row 4 zero, row 5 rounding ties (half-integers at unit scale), the rest normal."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, K)).astype(np.float32)
    x[0] = 0.0
    if T > 1:
        x[1] = np.clip(x[1], -2.0, 2.0)
        for b in range(0, K, 256):
            s = 1.0 if (b // 256) % 2 else -1.0
            x[1, b + 3], x[1, b + min(9, K - b - 1)] = 2.5 * s, -2.5 * s
    if T > 2:
        x[2] *= 1e5
    if T > 3:
        x[3] *= 1e-7
    if T > 4:
        x[4, :32] = 0.0
    if T > 5:  # |max| 127 makes the scale 1 (Q8_K iscale, Q8_0 id): the .5 values are rounding ties
        x[5, :31] = np.arange(31, dtype=np.float32) - 15.5
        x[5, 31] = -127.0
    return x


def _weight(fmt: G, n_out: int = 40, seed: int = 0, n_in: int | None = None):
    n_in = N_IN[fmt] if n_in is None else n_in
    raw = random_bytes(fmt, n_out, n_in, seed)
    return raw, repack("t", fmt, n_out, n_in, torch.from_numpy(raw.copy()))


def _bits(a) -> np.ndarray:
    a = a.numpy() if isinstance(a, torch.Tensor) else a
    return np.ascontiguousarray(a, dtype=np.float32).view(np.int32)


@pytest.mark.parametrize("kind", (G.Q8_K, G.Q8_0), ids=lambda k: k.name)
def test_quantize_act_is_ggml_bitwise(i8, kind):
    K = 512
    x = _x(33, K, 1)
    a = i8.quantize_act(torch.from_numpy(x), kind)
    assert a.kind == kind and a.qs.dtype == torch.int8 and a.d.dtype == torch.float32
    if kind == G.Q8_K:
        ref = quantize_q8_K(x)
        assert np.array_equal(a.qs.numpy().reshape(ref.qs.shape), ref.qs)
        assert np.array_equal(_bits(a.d), _bits(ref.d))
        bs32 = ref.bsums.reshape(33, -1, 2).astype(np.int32).sum(-1)
        assert a.bsum32.dtype == torch.int32 and np.array_equal(a.bsum32.numpy(), bs32)
        assert a.qs[1].abs().max() == 127  # the tie row: first index's sign decides
    else:
        ref = quantize_q8_0(x)
        assert np.array_equal(a.qs.numpy().reshape(ref.qs.shape), ref.qs)
        assert np.array_equal(_bits(a.d), _bits(ref.d))
        assert a.bsum32 is None
    assert not a.qs[0].any() and not a.d[0].any()  # all-zero row: zero codes and scales
    assert a.qs[5, :31].tolist() == [-16, -14, -14, -12, -12, -10, -10, -8, -8, -6, -6, -4, -4, -2, -2, 0,
                                     0, 2, 2, 4, 4, 6, 6, 8, 8, 10, 10, 12, 12, 14, 14]  # half-to-even


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_matmul_i8_equals_matmul_ggml_bitwise(i8, fmt):
    raw, w = _weight(fmt, 40, 3)
    x = _x(max(ROWS), N_IN[fmt], 2)
    ref = matmul_ggml(raw, fmt, x)  # rows are independent in the reference
    for T in ROWS:
        got = i8.matmul_i8(w, torch.from_numpy(x[:T].copy()))
        assert got.shape == (T, 40)
        assert np.array_equal(_bits(got), _bits(ref[:T])), T


@pytest.mark.parametrize("fmt, n_in", [(G.Q8_0, 2080), (G.Q4_K, 2560), (G.Q6_K, 2304)], ids=lambda v: str(v))
def test_several_chunks_of_the_two_level_sum_equal_matmul_ggml_bitwise(i8, fmt, n_in):
    """Rows whose length spans several chunks (dot.CHUNK_ELEMS; the last one partial): one
    program per chunk plus the chunk-sum launch at <= 16 rows, one program walking the chunks
    above, both matmul_ggml's bits; every output of the <= 16-row path equals the wide path's."""
    from muser.quant.dot import CHUNK_ELEMS

    assert n_in > 2 * CHUNK_ELEMS and n_in % CHUNK_ELEMS
    raw, w = _weight(fmt, 24, 7, n_in)
    x = _x(17, n_in, 8)
    ref = matmul_ggml(raw, fmt, x)
    for T in (1, 5, 17):
        got = i8.matmul_i8(w, torch.from_numpy(x[:T].copy()))
        assert np.array_equal(_bits(got), _bits(ref[:T])), T


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_row_invariance_across_configs(i8, fmt):
    """Row r of a 33-row call == row r alone == row r of a 2-row call, bitwise, under two tilings
    (BM 16 vs 64, BN 16 vs 32); one shared quantization feeds stacked outputs (column slice)."""
    _, w = _weight(fmt, 40, 5)
    x = torch.from_numpy(_x(33, N_IN[fmt], 4))
    full = [i8.matmul_i8(w, x, config=c) for c in CONFIGS]
    assert torch.equal(_t(full[0]), _t(full[1]))
    for r in (0, 1, 17, 32):
        for c in CONFIGS:
            alone = i8.matmul_i8(w, x[r:r + 1], config=c)
            assert torch.equal(_t(alone), _t(full[0][r:r + 1])), (r, c)
    pair = i8.matmul_i8(w, x[16:18])
    assert torch.equal(_t(pair), _t(full[1][16:18]))
    # one quantization read by two weights, written into column slices of one output
    act = i8.quantize_act(x[:7], i8.VEC_DOT_TYPE[fmt])
    _, w2 = _weight(fmt, 24, 6)
    out = torch.full((7, 64), float("nan"))
    i8.matmul_i8_act(w, act, out[:, :40])
    i8.matmul_i8_act(w2, act, out[:, 40:])
    assert torch.equal(_t(out[:, :40]), _t(full[0][:7]))
    assert torch.equal(_t(out[:, 40:]), _t(i8.matmul_i8(w2, x[:7])))


def _t(a: torch.Tensor) -> torch.Tensor:
    return a.contiguous().view(torch.int32)


def test_bad_shapes_and_configs_refused(i8):
    raw, w = _weight(G.Q4_K, 40, 0)
    x = torch.zeros(3, 512)
    with pytest.raises(ValueError, match="float64"):
        i8.quantize_act(x.double(), G.Q8_K)
    with pytest.raises(ValueError, match=r"\[512\]"):
        i8.quantize_act(torch.zeros(512), G.Q8_K)
    with pytest.raises(ValueError, match="multiple of 256"):
        i8.quantize_act(torch.zeros(2, 480), G.Q8_K)
    with pytest.raises(ValueError, match="Q4_K"):
        i8.quantize_act(x, G.Q4_K)
    with pytest.raises(ValueError, match="Q8_0"):  # a Q4_K weight reads Q8_K activations
        i8.matmul_i8_act(w, i8.quantize_act(x, G.Q8_0))
    with pytest.raises(ValueError, match="n_in 512"):
        i8.matmul_i8(w, torch.zeros(3, 256))
    with pytest.raises(ValueError, match=r"\[3, 40\]"):
        i8.matmul_i8(w, x, out=torch.empty(3, 41))
    for bad in ((8, 16, 4, 1), (16, 24, 4, 1), (16, 16, 3, 1), (16, 16, 4, 0), (16, 16, 4), "fast"):
        with pytest.raises(ValueError, match="config"):
            i8.matmul_i8(w, x, config=bad)
    f16 = repack("h", G.F16, 4, 512, torch.from_numpy(random_bytes(G.F16, 4, 512, 0).copy()))
    with pytest.raises(LaneError, match="F16"):
        i8.matmul_i8(f16, x)
    assert i8.supports(G.Q6_K) and not i8.supports(G.F16)


@pytest.mark.parametrize("fmt", (G.Q4_K, G.Q6_K), ids=lambda f: f.name)
def test_shipped_tilings_are_valid_and_give_the_same_bits(i8, fmt):
    """Every tiling the tables ship (CONFIGS per row bucket, WIDE_BY_FORMAT for wide calls) passes
    check_config, config_for picks the format's wide entry only above 16 rows, and each gives the
    default call's bits."""
    assert i8.config_for(1, fmt) == i8.CONFIGS[16] == i8.config_for(16, fmt)
    assert i8.config_for(17, fmt) == i8.WIDE_BY_FORMAT.get(fmt, i8.CONFIGS[64])
    _, w = _weight(fmt, 40, 7)
    x = torch.from_numpy(_x(17, N_IN[fmt], 8))
    ref = i8.matmul_i8(w, x)
    for c in list(i8.CONFIGS.values()) + list(i8.WIDE_BY_FORMAT.values()):
        assert i8.check_config(c) == c
        assert torch.equal(_t(i8.matmul_i8(w, x, config=c)), _t(ref)), c
