"""Scalar rules shared by every codec: f16/bf16 conversion, ggml's nearest_int, C-order sums.

Every numeric rule here reproduces one C expression of the pinned ggml exactly, in float32:
numpy float32 arithmetic rounds each operation to nearest-even like SSE scalar code, and the
pinned libggml-base.so is compiled without FMA (no contraction), so `a*b + c` stays two
roundings on both sides.
"""

from __future__ import annotations

import numpy as np

from ..errors import FormatError
from ..gguf.types import GgmlType, type_info

F32 = np.float32
MAGIC_ROUND = F32(12582912.0)  # 1.5 * 2^23: ggml-quants.c nearest_int()


def nearest_int(x: np.ndarray) -> np.ndarray:
    """ggml-quants.c `nearest_int`: add 1.5*2^23 in f32 and read the low mantissa bits.

    Round-to-nearest-even for |x| < 2^22; reproduced bit for bit (including out-of-range
    garbage) rather than as np.rint, so no input can make the two disagree."""
    v = (np.asarray(x, dtype=F32) + MAGIC_ROUND).view(np.int32)
    return (v & np.int32(0x007FFFFF)) - np.int32(0x00400000)


def roundf(x: np.ndarray) -> np.ndarray:
    """C `roundf` (half away from zero) on float32, exact: trunc + compare the exact fraction."""
    x = np.asarray(x, dtype=F32)
    t = np.trunc(x)
    frac = np.abs(x - t)  # exact: x and trunc(x) share the exponent range
    return (t + np.where(frac >= F32(0.5), np.sign(x), F32(0))).astype(F32)


def seq_sum(a: np.ndarray, axis: int = -1) -> np.ndarray:
    """Left-to-right float32 sum along `axis` (a C `for` loop `s += a[i]` starting from a[0]).

    np.sum is pairwise and would round differently; cumulative add is strictly sequential."""
    return np.take(np.cumsum(a, axis=axis, dtype=F32), -1, axis=axis)


def seq_sum0(a: np.ndarray) -> np.ndarray:
    """seq_sum along axis 0 of a [n, S] array: n vector adds of length S (fast when S is large)."""
    s = a[0].astype(F32, copy=True)
    for i in range(1, a.shape[0]):
        s += a[i]
    return s


def f16_to_f32(bits: np.ndarray) -> np.ndarray:
    """IEEE half bits (uint16 or 2 little-endian bytes) -> float32 (exact)."""
    b = np.ascontiguousarray(bits)
    if b.dtype == np.uint8:
        b = b.view("<u2")
    return b.view("<f2").astype(F32)


def f32_to_f16(x: np.ndarray) -> np.ndarray:
    """float32 -> IEEE half bits, round-to-nearest-even (ggml_compute_fp32_to_fp16 / F16C
    _cvtss_sh with rounding 0 agree with this for every finite input)."""
    with np.errstate(over="ignore"):  # beyond 65504 rounds to inf, as in ggml
        return np.asarray(x, dtype=F32).astype("<f2").view("<u2")


def f16_round(x: np.ndarray) -> np.ndarray:
    """Round float32 values to the nearest f16 and back (the f16 rounding point)."""
    with np.errstate(over="ignore"):
        return np.asarray(x, dtype=F32).astype(np.float16).astype(F32)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    b = np.ascontiguousarray(bits)
    if b.dtype == np.uint8:
        b = b.view("<u2")
    return (b.astype(np.uint32) << np.uint32(16)).view(F32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """ggml-impl.h ggml_compute_fp32_to_bf16: round-to-nearest-even on the bits, NaN forced
    quiet (bit 6 of the bf16 set), no subnormal flush."""
    u = np.ascontiguousarray(x, dtype="<f4").view("<u4")
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    r = ((u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)).astype("<u2")
    if nan.any():
        r[nan] = ((u[nan] >> np.uint32(16)) | np.uint32(64)).astype("<u2")
    return r


def bf16_round(x: np.ndarray) -> np.ndarray:
    return bf16_to_f32(f32_to_bf16(x))


def as_blocks(data: np.ndarray, t: GgmlType, n_elements: int) -> np.ndarray:
    """Validate a flat byte buffer against (type, element count); return it as [n_blocks, block_bytes]."""
    ti = type_info(t)
    a = np.asarray(data)
    if a.dtype != np.uint8:
        raise FormatError(f"{ti.name} data must be uint8 bytes, got dtype {a.dtype}")
    if n_elements < 0 or n_elements % ti.block_elems:
        raise FormatError(
            f"{ti.name}: element count {n_elements} is not a multiple of the block of {ti.block_elems}"
        )
    need = n_elements // ti.block_elems * ti.block_bytes
    if a.size != need:
        raise FormatError(
            f"{ti.name}: {a.size} bytes given for {n_elements} elements, expected {need}"
        )
    return np.ascontiguousarray(a).reshape(-1, ti.block_bytes)


def check_finite(values: np.ndarray, what: str) -> None:
    """Refuse NaN/inf input before any work, naming the first offending flat index."""
    bad = ~np.isfinite(values)
    if bad.any():
        i = int(np.flatnonzero(bad.reshape(-1))[0])
        raise FormatError(f"{what}: non-finite value {float(values.reshape(-1)[i])!r} at flat index {i}")
