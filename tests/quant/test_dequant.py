"""Dequantizers: bit-exact against the `gguf` package and the compiled ggml on random blocks that
exercise every scale/min packing, and the hand-worked Q4_K block of book 6.3."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize

from muser.errors import FormatError, MuserError
from muser.gguf.types import GgmlType as G
from muser.gguf.types import type_info
from muser.gguf.writer import write_tensors
from muser.gguf.reader import read_gguf
from muser.quant import dequantize, dequantize_rows, dequantize_tensor, scale_min_k4, validate_data

from . import ggml_ref

BLOCK_TYPES = [G.Q8_0, G.Q4_0, G.Q4_K, G.Q5_K, G.Q6_K, G.NVFP4]
# byte offsets of the f16 d / dmin fields (ggml-common.h)
F16_FIELDS = {G.Q8_0: (0,), G.Q4_0: (0,), G.Q4_K: (0, 2), G.Q5_K: (0, 2), G.Q6_K: (208,), G.NVFP4: ()}


def random_blocks(t: G, nb: int, seed: int) -> np.ndarray:
    """Random bytes everywhere (every 6-bit scale/min pattern, every qh bit, every nibble), with
    finite f16 scale fields of mixed sign and magnitude."""
    rng = np.random.default_rng(seed)
    ti = type_info(t)
    b = np.frombuffer(rng.bytes(nb * ti.block_bytes), dtype=np.uint8).reshape(nb, ti.block_bytes).copy()
    for at in F16_FIELDS[t]:
        d = (rng.standard_normal(nb) * np.exp(rng.uniform(-8, 2, nb))).astype(np.float16)
        b[:, at : at + 2] = d.view(np.uint8).reshape(nb, 2)
    return b


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("t", BLOCK_TYPES, ids=lambda t: t.name)
def test_block_types_match_gguf_package_bit_exact(t):
    nb = 4096
    b = random_blocks(t, nb, seed=int(t))
    ours = dequantize(b.reshape(-1), t, nb * type_info(t).block_elems)
    ref = gguf_dequantize(b, Q(int(t))).reshape(-1).astype(np.float32)
    assert np.array_equal(bits(ours), bits(ref))


@pytest.mark.parametrize("t", [G.F16, G.BF16, *BLOCK_TYPES], ids=lambda t: t.name)
def test_match_compiled_ggml_even_on_garbage_bytes(t):
    """Fully random bytes (NaN/inf scales included) decode exactly as ggml's dequantize_row_*."""
    rng = np.random.default_rng(100 + int(t))
    ti = type_info(t)
    nb = 2048
    data = np.frombuffer(rng.bytes(nb * ti.block_bytes), dtype=np.uint8).copy()
    n = nb * ti.block_elems
    ours, ref = dequantize(data, t, n), ggml_ref.to_float(int(t), data, n)
    nan = np.isnan(ref)
    assert np.array_equal(np.isnan(ours), nan)
    assert np.array_equal(bits(ours[~nan]), bits(ref[~nan]))


def test_f32_roundtrip_and_bf16_f16_widening():
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    assert np.array_equal(dequantize(x.view(np.uint8), G.F32, 1000), x)
    assert np.array_equal(dequantize(x.astype(np.float16).view(np.uint8), G.F16, 1000),
                          x.astype(np.float16).astype(np.float32))
    hi = (x.view(np.uint32) >> 16).astype(np.uint16)
    assert np.array_equal(bits(dequantize(hi.view(np.uint8), G.BF16, 1000)),
                          hi.astype(np.uint32) << 16)


def _pack_k4(sc, m):
    """Figure 6.3 packing written out per byte, independently of the quantizer's packer."""
    s = [0] * 12
    for j in range(4):
        s[j] = sc[j] | ((sc[j + 4] >> 4) << 6)
        s[j + 4] = m[j] | ((m[j + 4] >> 4) << 6)
        s[j + 8] = (sc[j + 4] & 0x0F) | ((m[j + 4] & 0x0F) << 4)
    return s


def test_book_6_3_hand_worked_q4_k_block():
    sc = [20, 12, 44, 8, 33, 25, 17, 9]
    m = [4, 16, 8, 24, 12, 20, 28, 36]
    scales = _pack_k4(sc, m)
    # the book's table of packed bytes
    assert scales == [0x94, 0x4C, 0x6C, 0x08, 0x04, 0x50, 0x48, 0x98, 0xC1, 0x49, 0xC1, 0x49]
    blk = np.zeros(144, dtype=np.uint8)
    blk[0:4] = [0x00, 0x28, 0x00, 0x20]  # d = 2^-5, dmin = 2^-7
    blk[4:16] = scales
    blk[16] = 0x5E  # qs[0]
    blk[48] = 0x3C  # qs[32]
    got_sc, got_m = scale_min_k4(blk[4:16][None])
    assert got_sc[0].tolist() == sc and got_m[0].tolist() == m  # sub-block 5: 25 / 20
    y = dequantize(blk, G.Q4_K, 256)
    assert y[0] == np.float32(8.71875)
    assert y[32] == np.float32(1.75)  # same byte, high nibble, sub-block 1
    assert y[64] == np.float32(16.4375)
    assert np.array_equal(bits(y), bits(gguf_dequantize(blk[None], Q.Q4_K).reshape(-1)))


def test_scale_min_k4_every_6_bit_value():
    """Each of the 64 values of every sc/m field survives the Figure 6.3 packing."""
    v = np.arange(64, dtype=np.uint8)
    sc = np.stack([np.roll(v, k) for k in range(8)], axis=1)  # [64, 8]
    m = np.stack([np.roll(v, 3 * k + 1) for k in range(8)], axis=1)
    packed = np.array([_pack_k4(a.tolist(), b.tolist()) for a, b in zip(sc, m)], dtype=np.uint8)
    got_sc, got_m = scale_min_k4(packed)
    assert np.array_equal(got_sc, sc) and np.array_equal(got_m, m)


def test_size_mismatch_and_unknown_type_refused():
    with pytest.raises(FormatError, match="143 bytes given"):
        dequantize(np.zeros(143, np.uint8), G.Q4_K, 256)
    with pytest.raises(FormatError, match="not a multiple"):
        dequantize(np.zeros(144, np.uint8), G.Q4_K, 255)
    with pytest.raises(FormatError, match="no dequantizer"):
        dequantize(np.zeros(110, np.uint8), G.Q3_K, 256)
    with pytest.raises(FormatError, match="companion"):
        dequantize(np.zeros(8, np.uint8), G.NVFP4_E2M1, 16)


def test_tensor_and_row_access(tmp_path):
    """dequantize_rows == the matching rows of dequantize_tensor, for every type; rows out of range
    and NaN scales are refused naming the tensor."""
    rng = np.random.default_rng(7)
    tensors = {}
    for t in BLOCK_TYPES:
        nb_row = 2 if t != G.NVFP4 else 8
        ne0 = nb_row * type_info(t).block_elems
        b = random_blocks(t, 6 * nb_row, seed=50 + int(t))
        tensors[f"w.{t.name}"] = (b, t, (ne0, 3, 2))  # 3-D: rows over the higher dims
    x = rng.standard_normal((5, 64)).astype(np.float32)
    tensors["w.F32"] = (x, G.F32, (64, 5))
    path = write_tensors(tmp_path / "t.gguf", "muse-glimmer", {}, tensors)
    with read_gguf(path) as f:
        for name in tensors:
            full = dequantize_tensor(f, name)
            t = f.tensor_info(name)
            assert full.shape == t.np_shape
            flat = full.reshape(t.n_rows, t.shape[0])
            rows = [t.n_rows - 1, 0, 2]
            assert np.array_equal(bits(dequantize_rows(f, name, rows)), bits(flat[rows]))
        with pytest.raises(MuserError, match=r"row 6 out of range \[0, 6\) for tensor 'w.Q8_0'"):
            dequantize_rows(f, "w.Q8_0", [0, 6])


def test_nonfinite_scale_refused_at_tensor_access(tmp_path):
    b = random_blocks(G.Q4_K, 4, seed=3)
    b[2, 2:4] = np.array([np.nan], dtype=np.float16).view(np.uint8)  # dmin of block 2
    with pytest.raises(FormatError, match=r"non-finite Q4_K scale nan in block 2 \(byte offset 2\)"):
        validate_data(b.reshape(-1), G.Q4_K, 4 * 256, "x")
    path = write_tensors(tmp_path / "n.gguf", "muse-glimmer", {}, {"w": (b, G.Q4_K, (512, 2))})
    with read_gguf(path) as f:
        with pytest.raises(FormatError, match="tensor 'w'"):
            dequantize_tensor(f, "w")
        assert dequantize_rows(f, "w", [0]).shape == (1, 512)  # row 0 holds blocks 0-1: fine
        with pytest.raises(FormatError, match="tensor 'w'"):
            dequantize_rows(f, "w", [1])
