"""Activation quantizers exactly as the pinned ggml-cpu runs them on an x86 AVX2/FMA/F16C build.

Before a quantized matmul, ggml-cpu converts the f32 activations to the weight type's
`vec_dot_type` (ggml-cpu.c type_traits_cpu): Q4_K/Q5_K/Q6_K -> Q8_K, Q8_0/Q4_0/NVFP4 -> Q8_0,
F16 -> F16, BF16 -> BF16, F32 stays F32. The converters:

Q8_K  `quantize_row_q8_K` (ggml-cpu/arch/x86/quants.c) is a plain call of
      `quantize_row_q8_K_ref` (ggml-quants.c): signed first absolute maximum `max`,
      iscale = -127/max, qs = MIN(127, nearest_int(iscale*x)), d = 1/iscale, bsums over 16.
      The repacked-weight GEMM path (ggml_quantize_mat_q8_K_4x8, arch/x86/repack.cpp, used for
      >= 4 rows when Q4_K weights are repacked 8x8) picks iscale = -127/maxAbs when a positive
      element attains the maximum and +127/maxAbs otherwise: identical to the ref except when
      +a and -a both attain it, where the two negate qs and d together (same products).
Q8_0  `quantize_row_q8_0` AVX2 branch (and ggml_quantize_mat_q8_0_4x8) differs from the ref:
      d = maxAbs/127 stored as f16, but the multiplier is id = 127/maxAbs (not 1/d) and rounding
      is _mm256_round_ps(_MM_ROUND_NEAREST), i.e. half-to-even, not roundf.
F16   ggml_cpu_fp32_to_fp16: _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT), round-to-nearest-even.
BF16  ggml_cpu_fp32_to_bf16 -> ggml_compute_fp32_to_bf16 (common.f32_to_bf16).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import FormatError
from .common import F32, check_finite, f16_to_f32, f32_to_f16, nearest_int

QK_K = 256
QK8_0 = 32


def _rows(x: np.ndarray, block: int, what: str) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype != np.float32 or x.ndim != 2:
        raise FormatError(f"{what} takes float32 [T, n], got {x.dtype} {list(x.shape)}")
    if x.shape[1] % block:
        raise FormatError(f"{what}: row length {x.shape[1]} is not a multiple of {block}")
    check_finite(x, what)
    return x


@dataclass(frozen=True)
class Q8KActivation:
    """block_q8_K per 256 values of each activation row."""

    d: np.ndarray  # float32 [T, nb]   (= 1/iscale; 0 for an all-zero block)
    qs: np.ndarray  # int8 [T, nb, 256]
    bsums: np.ndarray  # int16 [T, nb, 16] (sums of 16 consecutive qs; 0 for an all-zero block)

    def to_bytes(self) -> np.ndarray:
        """ggml's block_q8_K layout (float d, int8 qs[256], int16 bsums[16] = 292 bytes)."""
        T, nb = self.d.shape
        out = np.empty((T, nb, 292), dtype=np.uint8)
        out[..., 0:4] = self.d.astype("<f4").view(np.uint8).reshape(T, nb, 4)
        out[..., 4:260] = self.qs.view(np.uint8)
        out[..., 260:292] = self.bsums.astype("<i2").view(np.uint8).reshape(T, nb, 32)
        return out.reshape(T, nb * 292)

    def dequantize(self) -> np.ndarray:
        """dequantize_row_q8_K: d * qs -> float32 [T, n]."""
        T, nb = self.d.shape
        return (self.d[..., None] * self.qs.astype(F32)).reshape(T, nb * QK_K)


def quantize_q8_K(x: np.ndarray) -> Q8KActivation:
    """float32 [T, n] (n % 256 == 0) -> Q8_K, bit-exact to ggml-cpu's quantize_row_q8_K."""
    x = _rows(x, QK_K, "Q8_K activation quantization")
    T, n = x.shape
    nb = n // QK_K
    b = x.reshape(T, nb, QK_K)
    ax = np.abs(b)
    j = ax.argmax(axis=-1)  # first index of the largest |x| (strict '>' scan)
    amax = np.take_along_axis(ax, j[..., None], -1)[..., 0]
    mx = np.take_along_axis(b, j[..., None], -1)[..., 0]  # signed
    zero = amax == 0
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = (F32(-127.0) / mx).astype(F32)
        q = np.minimum(nearest_int(iscale[..., None] * b), 127)
        d = (F32(1.0) / iscale).astype(F32)
    q = np.where(zero[..., None], 0, q).astype(np.int8)
    d = np.where(zero, F32(0), d).astype(F32)
    bsums = q.reshape(T, nb, 16, 16).astype(np.int32).sum(axis=-1).astype(np.int16)
    return Q8KActivation(d, q, bsums)


@dataclass(frozen=True)
class Q8_0Activation:
    """block_q8_0 per 32 values of each activation row."""

    d_bits: np.ndarray  # uint16 f16 bits [T, nb]
    qs: np.ndarray  # int8 [T, nb, 32]

    @property
    def d(self) -> np.ndarray:
        return f16_to_f32(self.d_bits)

    def to_bytes(self) -> np.ndarray:
        T, nb = self.d_bits.shape
        out = np.empty((T, nb, 34), dtype=np.uint8)
        out[..., 0:2] = self.d_bits.astype("<u2").view(np.uint8).reshape(T, nb, 2)
        out[..., 2:34] = self.qs.view(np.uint8)
        return out.reshape(T, nb * 34)

    def dequantize(self) -> np.ndarray:
        T, nb = self.d_bits.shape
        return (self.qs.astype(F32) * self.d[..., None]).reshape(T, nb * QK8_0)


def quantize_q8_0(x: np.ndarray) -> Q8_0Activation:
    """float32 [T, n] (n % 32 == 0) -> Q8_0, bit-exact to the AVX2 branch of ggml-cpu's
    quantize_row_q8_0 (id = 127/maxAbs, half-to-even rounding)."""
    x = _rows(x, QK8_0, "Q8_0 activation quantization")
    T, n = x.shape
    nb = n // QK8_0
    b = x.reshape(T, nb, QK8_0)
    amax = np.abs(b).max(axis=-1)
    d = (amax / F32(127.0)).astype(F32)
    with np.errstate(divide="ignore"):
        idv = np.where(amax != 0, F32(127.0) / amax, F32(0)).astype(F32)
    q = np.rint((b * idv[..., None]).astype(F32)).astype(np.int32)  # _mm256_round_ps nearest-even
    q = np.clip(q, -128, 127).astype(np.int8)  # _mm256_packs_epi32/epi16 saturate
    return Q8_0Activation(f32_to_f16(d), q)
