"""Dequantizers (numpy, vectorized over blocks), bit-exact to ggml-quants.c dequantize_row_*.

Each decoder evaluates the same float32 expression, in the same order, as its ggml function;
numpy float32 ops round like the SSE scalar code of the pinned libggml-base.so (built without
FMA), so the results are identical bit for bit, not merely close (tests/quant compare against
both the `gguf` package and the compiled ggml).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..errors import FormatError, MuserError
from ..gguf.types import GgmlType as G
from .common import F32, as_blocks, bf16_to_f32, f16_to_f32
from .fp4 import E2M1_Q1, E2M1_VALUES, UE4M3_HALF_VALUES, e4m3fn_decode

QK_K = 256


def scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml-quants.c get_scale_min_k4 for all 8 sub-blocks at once (book 6.2, Figure 6.3).

    scales: uint8 [n, 12] -> (sc, m) uint8 [n, 8]. Sub-blocks 0..3 are the low 6 bits of bytes
    0..3 / 4..7; sub-blocks 4..7 take their low nibble from bytes 8..11 and their top two bits
    from the top of bytes 0..3 (sc) / 4..7 (m)."""
    q = scales
    sc = np.empty(q.shape[:-1] + (8,), dtype=np.uint8)
    m = np.empty_like(sc)
    sc[..., :4] = q[..., 0:4] & 63
    m[..., :4] = q[..., 4:8] & 63
    sc[..., 4:] = (q[..., 8:12] & 0xF) | ((q[..., 0:4] >> 6) << 4)
    m[..., 4:] = (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)
    return sc, m


def _q8_0(b: np.ndarray) -> np.ndarray:
    d = f16_to_f32(b[:, 0:2])  # [nb, 1]
    return b[:, 2:].view(np.int8).astype(F32) * d  # qs[j]*d


def _q4_0(b: np.ndarray) -> np.ndarray:
    d = f16_to_f32(b[:, 0:2])
    qs = b[:, 2:]  # [nb, 16]; low nibble -> j, high nibble -> j + 16
    q = np.concatenate([qs & 0xF, qs >> 4], axis=1).astype(np.int32) - 8
    return q.astype(F32) * d


def _q4_k(b: np.ndarray) -> np.ndarray:
    nb = b.shape[0]
    d = f16_to_f32(b[:, 0:2])  # [nb, 1]
    dmin = f16_to_f32(b[:, 2:4])
    sc, m = scale_min_k4(b[:, 4:16])
    d1 = (d * sc.astype(F32)).reshape(nb, 4, 2, 1)  # d * sc   [nb, 4 groups, lo/hi, 1]
    m1 = (dmin * m.astype(F32)).reshape(nb, 4, 2, 1)  # dmin * m
    qs = b[:, 16:144].reshape(nb, 4, 1, 32)
    q = np.concatenate([qs & 0xF, qs >> 4], axis=2).astype(F32)  # [nb, 4, 2, 32]
    return (d1 * q - m1).reshape(nb, QK_K)  # d1 * q - m1: two roundings, as in C


def _q5_k(b: np.ndarray) -> np.ndarray:
    nb = b.shape[0]
    d = f16_to_f32(b[:, 0:2])
    dmin = f16_to_f32(b[:, 2:4])
    sc, m = scale_min_k4(b[:, 4:16])
    d1 = (d * sc.astype(F32)).reshape(nb, 4, 2, 1)
    m1 = (dmin * m.astype(F32)).reshape(nb, 4, 2, 1)
    qh = b[:, 16:48].reshape(nb, 1, 1, 32)
    qs = b[:, 48:176].reshape(nb, 4, 1, 32)
    lo = np.concatenate([qs & 0xF, qs >> 4], axis=2)  # [nb, 4, 2, 32]
    bit = (np.arange(8, dtype=np.uint8).reshape(1, 4, 2, 1))  # group g, half h -> bit 2g + h
    hi = ((qh >> bit) & 1) << 4
    return (d1 * (lo + hi).astype(F32) - m1).reshape(nb, QK_K)


def _q6_k(b: np.ndarray) -> np.ndarray:
    nb = b.shape[0]
    ql = b[:, 0:128].reshape(nb, 2, 2, 32)  # [half n, ql offset 0/32, l]
    qh = b[:, 128:192].reshape(nb, 2, 1, 32)
    sc = b[:, 192:208].view(np.int8).reshape(nb, 2, 8)  # [half, 8 scales]
    d = f16_to_f32(b[:, 208:210]).reshape(nb, 1, 1)
    # Four code planes per 128-half: q1 (ql lo, qh bits 0-1), q2 (ql+32 lo, bits 2-3),
    # q3 (ql hi, bits 4-5), q4 (ql+32 hi, bits 6-7) -> elements l, l+32, l+64, l+96.
    q1 = (ql[:, :, 0] & 0xF) | (((qh[:, :, 0] >> 0) & 3) << 4)
    q2 = (ql[:, :, 1] & 0xF) | (((qh[:, :, 0] >> 2) & 3) << 4)
    q3 = (ql[:, :, 0] >> 4) | (((qh[:, :, 0] >> 4) & 3) << 4)
    q4 = (ql[:, :, 1] >> 4) | (((qh[:, :, 0] >> 6) & 3) << 4)
    q = np.stack([q1, q2, q3, q4], axis=2).astype(np.int32) - 32  # [nb, 2, 4, 32]
    # scale index for element 32*p + l of a half: is = l // 16 + 2 p
    scale = sc.reshape(nb, 2, 4, 2).astype(F32)  # [nb, half, p, l//16]
    ds = (d.reshape(nb, 1, 1, 1) * scale)  # d * sc[is]  [nb, 2, 4, 2]
    y = ds.reshape(nb, 2, 4, 2, 1) * q.reshape(nb, 2, 4, 2, 16).astype(F32)  # (d*sc)*q
    return y.reshape(nb, QK_K)


def _nvfp4_ggml(b: np.ndarray) -> np.ndarray:
    nb = b.shape[0]
    d = UE4M3_HALF_VALUES[b[:, 0:4]].reshape(nb, 4, 1)  # ggml_ue4m3_to_fp32 per 16-sub-block
    qs = b[:, 4:36].reshape(nb, 4, 8)  # low nibble -> j, high nibble -> j + 8 of the sub-block
    v = np.concatenate([E2M1_Q1[qs & 0xF], E2M1_Q1[qs >> 4]], axis=2).astype(F32)  # [nb, 4, 16]
    return (v * d).reshape(nb, 64)  # kvalues[q] * d


_BLOCK_DECODERS = {
    G.Q8_0: _q8_0,
    G.Q4_0: _q4_0,
    G.Q4_K: _q4_k,
    G.Q5_K: _q5_k,
    G.Q6_K: _q6_k,
    G.NVFP4: _nvfp4_ggml,
}

DEQUANT_TYPES = frozenset({G.F32, G.F16, G.BF16, G.F8_E4M3FN, *_BLOCK_DECODERS})

# Byte offsets of the f16 scale fields of each block (ggml-common.h block_* structs).
_F16_SCALE_FIELDS = {G.Q8_0: (0,), G.Q4_0: (0,), G.Q4_K: (0, 2), G.Q5_K: (0, 2), G.Q6_K: (208,)}


def validate_data(data: np.ndarray, t: G, n_elements: int, what: str) -> None:
    """ggml_validate_row_data's rule, failing closed with a FormatError naming `what` and the
    block (element) index: F32/F16/BF16 values and every f16 d/dmin scale field must be finite;
    an F8_E4M3FN scale byte must not be NaN. (ggml NVFP4's UE4M3 bytes are all valid.)"""
    t = G(t)
    b = as_blocks(data, t, n_elements)
    if t in (G.F32, G.F16, G.BF16):
        vals = dequantize(b.reshape(-1), t, n_elements)
        bad = ~np.isfinite(vals)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise FormatError(f"{what}: non-finite {t.name} value {float(vals[i])!r} at element {i}")
    elif t == G.F8_E4M3FN:
        e4m3fn_decode(b.reshape(-1), what)
    elif t in _F16_SCALE_FIELDS:
        for at in _F16_SCALE_FIELDS[t]:
            v = f16_to_f32(b[:, at : at + 2]).reshape(-1)
            bad = ~np.isfinite(v)
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise FormatError(f"{what}: non-finite {t.name} scale {float(v[i])!r} in block {i} (byte offset {at})")


def dequantize(data: np.ndarray, t: G, n_elements: int) -> np.ndarray:
    """Stored bytes (flat uint8) of `n_elements` values of type `t` -> float32 [n_elements].

    F32/F16/BF16/Q8_0/Q4_0/Q4_K/Q5_K/Q6_K/NVFP4(40) match ggml's dequantize_row_* bit for bit;
    F8_E4M3FN decodes raw scale bytes (NaN bytes refused). NVFP4_E2M1 payloads need their
    companion scales: use `dequantize_nvfp4` or `dequantize_tensor`."""
    t = G(t)
    if t == G.NVFP4_E2M1:
        raise FormatError(
            "NVFP4_E2M1 payload bytes cannot be decoded alone: their scales live in the "
            "'.nvfp4_scale' / '.nvfp4_scale2' companions (use dequantize_nvfp4 or dequantize_tensor)"
        )
    if t not in DEQUANT_TYPES:
        raise FormatError(f"no dequantizer for dtype {t.name}")
    b = as_blocks(data, t, n_elements)
    if t == G.F32:
        return b.reshape(-1).view("<f4").astype(F32, copy=True)
    if t == G.F16:
        return f16_to_f32(b.reshape(-1))
    if t == G.BF16:
        return bf16_to_f32(b.reshape(-1))
    if t == G.F8_E4M3FN:
        return e4m3fn_decode(b.reshape(-1)).astype(F32)
    with np.errstate(invalid="ignore", over="ignore"):  # garbage scales decode as ggml does
        return _BLOCK_DECODERS[t](b).reshape(-1)


def dequantize_nvfp4(packed: np.ndarray, scales: np.ndarray, scale2: float, what: str = "NVFP4") -> np.ndarray:
    """Muser's native NVFP4 (book 7.1-7.2): packed uint8 [rows, n/2] (low nibble = even index),
    E4M3FN scale bytes [rows, n/16], f32 scale2 -> float32 [rows, n].

    Order pinned to `(e2m1 * e4m3fn) * scale2`, two float32 roundings, never regrouped."""
    packed = np.asarray(packed, dtype=np.uint8)
    scales = np.asarray(scales, dtype=np.uint8)
    rows, half = packed.shape
    n = 2 * half
    if n % 16 or scales.shape != (rows, n // 16):
        raise FormatError(
            f"{what}: scale shape {list(scales.shape)} does not match payload rows {rows} x {n} values"
        )
    s = e4m3fn_decode(scales, f"{what} scale").reshape(rows, n // 16, 1)
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(rows, n // 16, 16)
    e2m1 = E2M1_VALUES[codes]
    return ((e2m1 * s) * F32(scale2)).reshape(rows, n)


# --- tensors in a GGUF -----------------------------------------------------------------------


def _nvfp4_parts(f, name: str):
    from .nvfp4 import read_companions

    return read_companions(f, name)


def dequantize_tensor(f, name: str) -> np.ndarray:
    """Whole tensor -> float32 in numpy shape (ggml dims reversed). Non-finite scales or values
    and NaN scale bytes are refused (validate_data), naming the tensor and the block."""
    t = f.tensor_info(name)
    gt = t.type.ggml_type
    if gt == G.NVFP4_E2M1:
        scales, scale2 = _nvfp4_parts(f, name)
        out = dequantize_nvfp4(f.raw(name), scales, scale2, what=name)
        return out.reshape(t.np_shape)
    raw = f.raw(name).reshape(-1)
    validate_data(raw, gt, t.n_elements, f"tensor {name!r}")
    return dequantize(raw, gt, t.n_elements).reshape(t.np_shape)


def dequantize_rows(f, name: str, rows: Sequence[int] | np.ndarray) -> np.ndarray:
    """Rows of a tensor (rows over the flattened higher dims, ne0 values each) -> float32
    [len(rows), ne0], decoding only those rows' bytes."""
    t = f.tensor_info(name)
    idx = np.asarray(rows, dtype=np.int64).reshape(-1)
    if idx.size and (idx.min() < 0 or idx.max() >= t.n_rows):
        bad = int(idx[(idx < 0) | (idx >= t.n_rows)][0])
        raise MuserError(f"row {bad} out of range [0, {t.n_rows}) for tensor {name!r}")
    gt = t.type.ggml_type
    ne0 = t.shape[0]
    raw = f.raw(name)[idx]  # [len(rows), row_bytes]
    if gt == G.NVFP4_E2M1:
        scales, scale2 = _nvfp4_parts(f, name)
        return dequantize_nvfp4(raw, scales[idx], scale2, what=name)
    validate_data(raw.reshape(-1), gt, idx.size * ne0, f"tensor {name!r} rows {idx[:4].tolist()}")
    return dequantize(raw.reshape(-1), gt, idx.size * ne0).reshape(idx.size, ne0)
