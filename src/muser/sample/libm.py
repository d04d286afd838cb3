"""expf / logf exactly as the pinned llama.cpp computes them: the C library's own functions.

The sampler's softmax, min-p and typical steps call libm's expf / logf (libllama is built for
baseline x86-64 without fast-math, so these are plain scalar calls). glibc's expf is not always
correctly rounded, and numpy's float32 exp differs from it often, so neither can stand in.
`expf` is therefore glibc's result for every element: values are computed in float64 and
rounded (which is glibc's answer whenever the true result is not within glibc's error of a
float32 rounding midpoint: glibc's float64 value before its final rounding is within 1.69 * 2^-34
relative, under 1/600 ulp), and every element within 1/256 ulp of a midpoint, or whose result is
outside the normal range, is recomputed by calling glibc's expf. `logf` (error up to 0.82 ulp in
glibc) is always called directly.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import lru_cache

import numpy as np

from ..errors import SamplingError

_SMALL = 64  # below this many elements, call libm for all of them
# Half-width of the window around a float32 rounding midpoint that goes to libm: 2^-8 ulp, in
# units of the 29 low mantissa bits a float64 carries below a float32's (the midpoint is 2^28).
_WINDOW = 1 << 21
_MID_LO = np.uint64((1 << 28) - _WINDOW)


@lru_cache(maxsize=1)
def _libm():
    name = ctypes.util.find_library("m")
    if name is None:
        raise SamplingError("the C math library (libm) is not available: llama.cpp-exact sampling needs its expf/logf")
    lib = ctypes.CDLL(name)
    for fn in ("expf", "logf"):
        f = getattr(lib, fn)
        f.restype = ctypes.c_float
        f.argtypes = [ctypes.c_float]
    return lib


def expf_scalar(x: float) -> np.float32:
    return np.float32(_libm().expf(float(x)))


def logf_scalar(x: float) -> np.float32:
    return np.float32(_libm().logf(float(x)))


def expf(x: np.ndarray) -> np.ndarray:
    """Elementwise libm expf over a float32 array."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    f = _libm().expf
    if x.size <= _SMALL:
        return np.array([f(float(v)) for v in x.ravel()], dtype=np.float32).reshape(x.shape)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        y64 = np.exp(x, dtype=np.float64)
        y = y64.astype(np.float32)
        d = y64.view(np.uint64)
        d &= np.uint64(0x1FFFFFFF)  # the bits float32 rounding drops (y64 is not used after this)
        d -= _MID_LO  # wraps below the window
        suspect = d <= np.uint64(2 * _WINDOW)
        suspect |= ~((x >= np.float32(-87.0)) & (x <= np.float32(88.0)))  # subnormal or 0, overflow, NaN
        suspect &= x != -np.inf  # expf(-inf) = +0 exactly, as np.exp gives
    idx = np.flatnonzero(suspect.ravel())
    if idx.size:
        y.ravel()[idx] = [f(v) for v in x.ravel()[idx].tolist()]
    return y


def logf(x: np.ndarray) -> np.ndarray:
    """Elementwise libm logf over a float32 array."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    f = _libm().logf
    return np.array([f(float(v)) for v in x.ravel()], dtype=np.float32).reshape(x.shape)
