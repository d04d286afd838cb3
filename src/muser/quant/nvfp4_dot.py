"""The native NVFP4 contractions of book 7.4.2 (W4A16) and 7.4.3 (W4A4), integer-exact.

Both decode weights as integers: E2M1 codes in units of 2^-1 (`e2m1_q1`, fp4.E2M1_Q1) and
E4M3FN scale bytes in units of 2^-9 (`e4m3_q9`, fp4.E4M3FN_Q9), so every block contraction is an
exact integer sum and only a short, pinned float32 epilogue rounds.

W4A16 (no input_scale_inv; 7.4.2), per activation row and 256-value super-block b:
    Q8-K-style grid: signed first absolute max, iscale = -127/max, nearest-even, clamp 127
    (activation.quantize_q8_K, the same grid ggml's Q8_K uses)
    I_b   = sum over the 16 groups g of b of (sum_k q1(w) * q8) * q9(scale_g)      (int64)
    c     = f32(I_b) * 2^-10          (2^-10 = Q1 x Q9; exact power-of-two scaling)
    c     = c * (1 / iscale_b)        (f32; the activation scale, = Q8_K d)
    c     = c * scale2                (f32)
    total = total + c                 (f32, super-blocks in order)
    y     = f32(f16(total))           (the producer's F16 output boundary)
W4A4 (input_scale_inv present; 7.4.3): activations are quantized per 16 to their own E2M1 +
E4M3FN pair against the activation scale2 = 1/input_scale_inv (quantize_act_nvfp4); then
    I     = sum over all groups of (sum_k q1(w) * q1(a)) * q9(w scale) * q9(a scale)   (int64)
    y     = f32(f16(((f32(I) * 2^-20) * scale2) * (1 / input_scale_inv)))
Every step is stated, so these references are bit-exact by definition; a kernel must match
them bit for bit.
"""

from __future__ import annotations

import numpy as np

from ..errors import FormatError
from .activation import quantize_q8_K
from .common import F32, check_finite, f16_round
from .fp4 import E2M1_Q1, E4M3FN_Q9, E4M3FN_VALUES
from .nvfp4 import GROUP, NVFP4Weight, quantize_groups

F64 = np.float64
QK_K = 256
_CHUNK = 32 << 20


def _check(w: NVFP4Weight, x: np.ndarray, block: int, what: str) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype != np.float32 or x.ndim != 2 or x.shape[1] != w.n_in:
        raise FormatError(f"{what}: activations must be float32 [T, {w.n_in}], got {x.dtype} {list(x.shape)}")
    if w.n_in % block:
        raise FormatError(f"{what}: n_in {w.n_in} is not a multiple of {block}")
    check_finite(x, what)
    if (w.scales & 0x7F == 0x7F).any():
        raise FormatError(f"{what}: weight holds a NaN E4M3FN scale byte")
    return x


def _group_dots(aq: np.ndarray, wq: np.ndarray) -> np.ndarray:
    """aq [T, G, 16], wq [O, G, 16] small ints -> exact int64 [T, O, G]."""
    a = np.ascontiguousarray(aq.transpose(1, 0, 2), dtype=F64)
    b = np.ascontiguousarray(wq.transpose(1, 2, 0), dtype=F64)
    return np.rint(np.matmul(a, b)).astype(np.int64).transpose(1, 2, 0)  # |sum| << 2^53


def matmul_nvfp4_w4a16(w: NVFP4Weight, x: np.ndarray) -> np.ndarray:
    """Book 7.4.2: float32 [T, n_in] -> float32 [T, n_out] (f16-rounded values)."""
    x = _check(w, x, QK_K, "NVFP4 W4A16 matmul")
    T = x.shape[0]
    nsb = w.n_in // QK_K
    a = quantize_q8_K(x)  # d = 1/iscale per super-block
    aq = a.qs.reshape(T, w.n_in // GROUP, GROUP)
    out = np.empty((T, w.n_out), dtype=F32)
    step = max(1, _CHUNK // max(1, T * (w.n_in // GROUP) * 8))
    for o0 in range(0, w.n_out, step):
        codes = _codes(w, o0, step)  # [O, n_in]
        q9 = E4M3FN_Q9[w.scales[o0 : o0 + step]]  # [O, G]
        dots = _group_dots(aq, E2M1_Q1[codes].reshape(codes.shape[0], -1, GROUP))  # [T, O, G]
        I = (dots * q9[None]).reshape(T, -1, nsb, QK_K // GROUP).sum(axis=3)  # int64 [T, O, nsb]
        total = np.zeros(I.shape[:2], dtype=F32)
        for b in range(nsb):
            c = (I[:, :, b].astype(F32) * F32(2.0**-10)).astype(F32)
            c = (c * a.d[:, b, None]).astype(F32)
            c = (c * F32(w.scale2)).astype(F32)
            total = (total + c).astype(F32)
        out[:, o0 : o0 + step] = f16_round(total)
    return out


def _codes(w: NVFP4Weight, o0: int, step: int) -> np.ndarray:
    p = w.packed[o0 : o0 + step]
    return np.stack([p & 0xF, p >> 4], axis=-1).reshape(p.shape[0], -1)


def quantize_act_nvfp4(x: np.ndarray, input_scale_inv: float) -> tuple[np.ndarray, np.ndarray]:
    """W4A4 activation quantization in groups of 16: float32 [T, n] -> (E2M1 codes uint8 [T, n],
    E4M3FN scale bytes uint8 [T, n/16]), the weight recipe (nvfp4.quantize_groups) with
    scale2 = 1/input_scale_inv; per-group scales saturate at 448 (codes then at 6)."""
    isi = F32(input_scale_inv)
    if not (np.isfinite(isi) and isi > 0):
        raise FormatError(f"input_scale_inv must be finite and positive, got {input_scale_inv!r}")
    x = np.asarray(x)
    if x.dtype != np.float32 or x.ndim != 2 or x.shape[1] % GROUP:
        raise FormatError(f"FP4 activation quantization takes float32 [T, n % 16 == 0], got {x.dtype} {list(x.shape)}")
    check_finite(x, "FP4 activation quantization")
    return quantize_groups(x, F32(1.0) / isi)


def dequantize_act_nvfp4(codes: np.ndarray, scales: np.ndarray, input_scale_inv: float) -> np.ndarray:
    """(e2m1 * e4m3fn) * (1/input_scale_inv), float32 [T, n]."""
    from .fp4 import E2M1_VALUES

    T, n = codes.shape
    v = E2M1_VALUES[codes].reshape(T, n // GROUP, GROUP) * E4M3FN_VALUES[scales][..., None]
    return (v.astype(F32) * (F32(1.0) / F32(input_scale_inv))).reshape(T, n).astype(F32)


def matmul_nvfp4_w4a4(w: NVFP4Weight, x: np.ndarray) -> np.ndarray:
    """Book 7.4.3: float32 [T, n_in] -> float32 [T, n_out] (f16-rounded values)."""
    if w.input_scale_inv is None:
        raise FormatError("NVFP4 W4A4 matmul needs the weight's input_scale_inv (W4A16 weights have none)")
    x = _check(w, x, GROUP, "NVFP4 W4A4 matmul")
    T = x.shape[0]
    ac, asb = quantize_act_nvfp4(x, w.input_scale_inv)
    aq = E2M1_Q1[ac].reshape(T, -1, GROUP)
    aq9 = E4M3FN_Q9[asb]  # [T, G]
    out = np.empty((T, w.n_out), dtype=F32)
    step = max(1, _CHUNK // max(1, T * (w.n_in // GROUP) * 8))
    inv = (F32(1.0) / F32(w.input_scale_inv)).astype(F32)
    for o0 in range(0, w.n_out, step):
        codes = _codes(w, o0, step)
        dots = _group_dots(aq, E2M1_Q1[codes].reshape(codes.shape[0], -1, GROUP))  # [T, O, G]
        wq9 = E4M3FN_Q9[w.scales[o0 : o0 + step]]  # [O, G]
        I = (dots * wq9[None] * aq9[:, None]).sum(axis=2)  # int64 [T, O]; |I| < 2^63
        y = (I.astype(F32) * F32(2.0**-20)).astype(F32)
        y = (y * F32(w.scale2)).astype(F32)
        y = (y * inv).astype(F32)
        out[:, o0 : o0 + step] = f16_round(y)
    return out
