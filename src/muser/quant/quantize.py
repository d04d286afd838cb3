"""Weight quantizers: float32 values -> stored bytes, byte-identical to llama.cpp's quantizer
without an importance matrix (ggml_quantize_chunk -> quantize_row_*_ref in ggml-quants.c).

Q8_0 and Q4_0 live here; the K-quants in kquant.py; ggml's NVFP4 (type 40) in nvfp4.py.
"""

from __future__ import annotations

import numpy as np

from ..errors import FormatError
from ..gguf.types import GgmlType as G
from ..gguf.types import type_info
from .common import F32, check_finite, f32_to_bf16, f32_to_f16, roundf
from .kquant import quantize_q4_k, quantize_q5_k, quantize_q6_k


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """quantize_row_q8_0_ref: [nb, 32] -> [nb, 34]. d = amax/127, id = 1/d, qs = roundf(x*id)
    (half away from zero). Note the activation path on AVX2 differs (activation.py)."""
    nb = x.shape[0]
    amax = np.abs(x).max(axis=1)
    d = (amax / F32(127)).astype(F32)
    with np.errstate(divide="ignore"):
        idv = np.where(d != 0, F32(1) / d, F32(0)).astype(F32)
    qs = roundf(x * idv[:, None]).astype(np.int8)
    out = np.empty((nb, 34), dtype=np.uint8)
    out[:, 0:2] = f32_to_f16(d).view(np.uint8).reshape(nb, 2)
    out[:, 2:] = qs.view(np.uint8)
    return out


def quantize_q4_0(x: np.ndarray) -> np.ndarray:
    """quantize_row_q4_0_ref: [nb, 32] -> [nb, 18]. d = max/-8 with max the signed first
    absolute maximum; xi = MIN(15, (int8_t)(x*id + 8.5f)) (truncation toward zero)."""
    nb = x.shape[0]
    ax = np.abs(x)
    j = ax.argmax(axis=1)
    # C keeps its initial max = 0.0 unless some |x| > 0 (so an all-zero block stores d = -0.0)
    mx = np.where(ax[np.arange(nb), j] > 0, x[np.arange(nb), j], F32(0)).astype(F32)
    d = (mx / F32(-8)).astype(F32)
    with np.errstate(divide="ignore"):
        idv = np.where(d != 0, F32(1) / d, F32(0)).astype(F32)
    v = (x * idv[:, None] + F32(8.5)).astype(F32)
    q = np.minimum(np.trunc(v), 15).astype(np.uint8)  # values lie in [0.5, 16.5]
    out = np.empty((nb, 18), dtype=np.uint8)
    out[:, 0:2] = f32_to_f16(d).view(np.uint8).reshape(nb, 2)
    out[:, 2:] = q[:, :16] | (q[:, 16:] << 4)
    return out


_BLOCK_QUANTIZERS = {
    G.Q8_0: quantize_q8_0,
    G.Q4_0: quantize_q4_0,
    G.Q4_K: quantize_q4_k,
    G.Q5_K: quantize_q5_k,
    G.Q6_K: quantize_q6_k,
}

QUANTIZE_TYPES = frozenset({G.F32, G.F16, G.BF16, G.NVFP4, *_BLOCK_QUANTIZERS})

# Rows per chunk: bounds the temporaries of the vectorized searches (~64 MB at 256-wide blocks).
_CHUNK_ELEMS = 1 << 20


def quantize(values: np.ndarray, t: G) -> np.ndarray:
    """float32 values in numpy order (rows contiguous; the last axis is ne0) -> the stored bytes
    of type `t`, uint8 [rows, row_bytes] (F32/F16/BF16 come back as their typed arrays in the
    input's shape, ready for GGUFWriter).

    Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, NVFP4 (type 40): byte-identical to llama.cpp's reference
    quantizers; F16: IEEE round-to-nearest-even; BF16: ggml_compute_fp32_to_bf16.
    Non-finite input and a row length that is not a multiple of the block are refused."""
    t = G(t)
    if t not in QUANTIZE_TYPES:
        raise FormatError(f"no quantizer for dtype {t.name}")
    v = np.asarray(values)
    if v.dtype != np.float32:
        raise FormatError(f"quantize takes float32 values, got dtype {v.dtype}")
    if v.ndim == 0:
        raise FormatError("quantize takes an array with at least one dimension")
    check_finite(v, f"quantize to {t.name}")
    if t == G.F32:
        return np.ascontiguousarray(v, dtype="<f4")
    if t == G.F16:
        return f32_to_f16(v).view("<f2").reshape(v.shape)
    if t == G.BF16:
        return f32_to_bf16(v).reshape(v.shape)
    ti = type_info(t)
    n = v.shape[-1]
    if n % ti.block_elems:
        raise FormatError(
            f"row length {n} is not a multiple of the {t.name} block of {ti.block_elems}"
        )
    rows = v.reshape(-1, n)
    blocks_per_row = n // ti.block_elems
    if t == G.NVFP4:
        from .nvfp4 import quantize_nvfp4_ggml as fn
    else:
        fn = _BLOCK_QUANTIZERS[t]
    out = np.empty((rows.shape[0], blocks_per_row * ti.block_bytes), dtype=np.uint8)
    step = max(1, _CHUNK_ELEMS // n)
    for r0 in range(0, rows.shape[0], step):
        x = np.ascontiguousarray(rows[r0 : r0 + step], dtype=F32).reshape(-1, ti.block_elems)
        out[r0 : r0 + step] = fn(x).reshape(-1, blocks_per_row * ti.block_bytes)
    return out
