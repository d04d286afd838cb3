"""expf / logf exactly as the pinned llama.cpp computes them: the C library's own functions.

The sampler's softmax, min-p and typical steps call libm's expf / logf (libllama is built for
baseline x86-64 without fast-math, so these are plain scalar calls). glibc's expf is not always
correctly rounded, and numpy's float32 exp differs from it often, so neither can stand in.
`expf` is therefore glibc's result for every element: values are computed in float64 and
rounded (which is glibc's answer whenever the true result is not within glibc's error of a
float32 rounding midpoint), and every element within 1/64 ulp of a midpoint, or outside the
normal range, is recomputed by calling glibc's expf. `logf` (error up to 0.82 ulp in glibc) is
always called directly.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import lru_cache

import numpy as np

from ..errors import SamplingError

_SMALL = 64  # below this many elements, call libm for all of them
_WINDOW = 2.0**-6  # fraction of an ulp around a rounding midpoint that goes to libm


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
        y64 = np.exp(x.astype(np.float64))
        y = y64.astype(np.float32)
        hi = np.nextafter(y, np.float32(np.inf)).astype(np.float64)
        lo = np.nextafter(y, np.float32(-np.inf)).astype(np.float64)
        yd = y.astype(np.float64)
        ulp = hi - yd
        d = np.minimum(np.abs(y64 - (yd + hi) * 0.5), np.abs(y64 - (yd + lo) * 0.5))
        suspect = ~(d > ulp * _WINDOW) | ~np.isfinite(y64) | (y < np.float32(1.1754944e-38)) | (x > 88.0)
        suspect &= x != -np.inf  # expf(-inf) = +0 exactly
        y[x == -np.inf] = 0.0
    idx = np.flatnonzero(suspect.ravel())
    if idx.size:
        flat = y.ravel()
        xf = x.ravel()
        for i in idx:
            flat[i] = f(float(xf[i]))
    return y


def logf(x: np.ndarray) -> np.ndarray:
    """Elementwise libm logf over a float32 array."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    f = _libm().logf
    return np.array([f(float(v)) for v in x.ravel()], dtype=np.float32).reshape(x.shape)
