"""The engine's repacked weight layout decodes bit-exactly like the reference codecs
(muser.quant.dequantize, the `gguf` package), on random blocks of every served format."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gguf.quants as gq

from muser.errors import FormatError, LaneError
from muser.gguf.types import GgmlType as G
from muser.engine.weights import BASE_FORMATS, QWeight, random_bytes, repack, validate
from muser.quant import dequantize

def random_weight_bytes(fmt: G, n_out: int, n_in: int, seed: int = 0) -> np.ndarray:
    return random_bytes(fmt, n_out, n_in, seed)


def _qweight(fmt: G, n_out: int = 6, n_in: int = 512, seed: int = 0) -> tuple[QWeight, np.ndarray]:
    raw = random_weight_bytes(fmt, n_out, n_in, seed)
    return repack("t.weight", fmt, n_out, n_in, torch.from_numpy(raw.copy())), raw


@pytest.mark.parametrize("fmt", BASE_FORMATS, ids=lambda f: f.name)
def test_decode_bit_exact_vs_reference_codecs(fmt):
    for seed, n_in in ((0, 512), (1, 768)):
        w, raw = _qweight(fmt, 5, n_in, seed)
        got = w.decode().numpy()
        ref = dequantize(raw.reshape(-1), fmt, 5 * n_in).reshape(5, n_in)
        ref2 = gq.dequantize(raw.reshape(-1), fmt.value).reshape(5, n_in).astype(np.float32)
        assert got.dtype == np.float32
        assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), fmt.name
        assert np.array_equal(got.view(np.uint32), ref2.view(np.uint32)), fmt.name


@pytest.mark.parametrize("fmt", BASE_FORMATS, ids=lambda f: f.name)
def test_decode_rows_subset(fmt):
    w, _ = _qweight(fmt, 9, 512, 3)
    full = w.decode()
    rows = torch.tensor([7, 0, 7, 3])
    assert torch.equal(w.decode(rows).view(torch.int32), full[rows].view(torch.int32))


def test_k_quant_scale_packing_every_six_bit_value():
    # Scale bytes that walk all 64 values of every sub-block's 6-bit scale and min.
    raw = random_weight_bytes(G.Q4_K, 64, 256, 7).copy()
    for r in range(64):
        b = raw[r]
        b[4:16] = 0
        for j in range(8):
            v = (r + j) % 64
            if j < 4:
                b[4 + j] |= v & 63
                b[8 + j] |= (63 - v) & 63
            else:
                b[12 + j - 4] |= (v & 0xF) | (((63 - v) & 0xF) << 4)
                b[4 + j - 4] |= (v >> 4) << 6
                b[8 + j - 4] |= ((63 - v) >> 4) << 6
    w = repack("t", G.Q4_K, 64, 256, torch.from_numpy(raw.copy()))
    ref = dequantize(raw.reshape(-1), G.Q4_K, 64 * 256).reshape(64, 256)
    assert np.array_equal(w.decode().numpy().view(np.uint32), ref.view(np.uint32))
    sc = w.fields["sc"].numpy().reshape(64, 8)
    assert sorted(set(sc[:, 5].tolist())) == list(range(64))


def test_resident_bytes_stay_quantized():
    w, raw = _qweight(G.Q4_K, 8, 512)
    # repack: 128 qs + 2 x f16 + 8 sc + 8 m per 256 elements (vs 144 stored bytes)
    assert w.nbytes == 8 * 2 * (128 + 4 + 16)
    w6, _ = _qweight(G.Q6_K, 8, 512)
    assert w6.nbytes == raw.size // 144 * 210  # Q6_K repack moves bytes only


def test_unserved_format_is_refused():
    with pytest.raises(LaneError, match="Q5_0"):
        repack("blk.0.attn_q.weight", G.Q5_0, 4, 64, torch.zeros((4, 44), dtype=torch.uint8))


def test_non_finite_scale_is_refused():
    raw = random_weight_bytes(G.Q4_K, 3, 512, 2).copy()
    raw[2, 144:146] = np.array([np.inf], dtype="<f2").view(np.uint8)  # row 2, block 1, d
    w = repack("blk.0.ffn_up.weight", G.Q4_K, 3, 512, torch.from_numpy(raw))
    with pytest.raises(FormatError, match=r"ffn_up.*row 2, block 1"):
        validate(w)
    rawf = random_weight_bytes(G.F16, 2, 64, 2).copy()
    rawf[1, 10:12] = np.array([np.nan], dtype="<f2").view(np.uint8)
    with pytest.raises(FormatError, match=r"row 1, element 5"):
        validate(repack("x", G.F16, 2, 64, torch.from_numpy(rawf)))
