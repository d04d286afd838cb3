"""The compiled pinned ggml (from llama-cpp-python==0.3.36, portable AVX2/FMA/F16C build),
called through ctypes: the ground truth the numpy codecs are compared against.

- ggml_quantize_chunk (libggml-base): what llama.cpp's quantizer runs for each tensor
- ggml_get_type_traits(t)->to_float (libggml-base): dequantize_row_*
- ggml_get_type_traits_cpu(t)->from_float / vec_dot (libggml-cpu): the activation quantizers
  (quantize_row_q8_0 AVX2 variant, quantize_row_q8_K) and dot kernels the CPU backend runs.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

import numpy as np

import llama_cpp  # the pinned comparator; its absence is a failure, never a skip

LIB = Path(llama_cpp.__file__).parent / "lib"

_to_float_t = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
_from_float_t = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
_vec_dot_t = ctypes.CFUNCTYPE(
    None, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
    ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
)


class _Traits(ctypes.Structure):
    _fields_ = [
        ("type_name", ctypes.c_char_p),
        ("blck_size", ctypes.c_int64),
        ("blck_size_interleave", ctypes.c_int64),
        ("type_size", ctypes.c_size_t),
        ("is_quantized", ctypes.c_bool),
        ("to_float", ctypes.c_void_p),
        ("from_float_ref", ctypes.c_void_p),
    ]


class _CpuTraits(ctypes.Structure):
    _fields_ = [
        ("from_float", ctypes.c_void_p),
        ("vec_dot", ctypes.c_void_p),
        ("vec_dot_type", ctypes.c_int),
        ("nrows", ctypes.c_int64),
    ]


@lru_cache(maxsize=1)
def _libs():
    base = ctypes.CDLL(str(LIB / "libggml-base.so"))
    cpu = ctypes.CDLL(str(LIB / "libggml-cpu.so"))
    base.ggml_quantize_chunk.restype = ctypes.c_size_t
    base.ggml_quantize_chunk.argtypes = [
        ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
        ctypes.c_int64, ctypes.c_void_p,
    ]
    base.ggml_get_type_traits.restype = ctypes.POINTER(_Traits)
    base.ggml_get_type_traits.argtypes = [ctypes.c_int]
    base.ggml_row_size.restype = ctypes.c_size_t
    base.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
    cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(_CpuTraits)
    cpu.ggml_get_type_traits_cpu.argtypes = [ctypes.c_int]
    cpu.ggml_cpu_init.restype = None
    cpu.ggml_cpu_init()
    return base, cpu


def row_size(t: int, n: int) -> int:
    return int(_libs()[0].ggml_row_size(int(t), n))


def quantize_chunk(t: int, x: np.ndarray) -> np.ndarray:
    """llama.cpp's per-tensor quantization call (no imatrix): x f32 [rows, n] -> [rows, row_bytes]."""
    base, _ = _libs()
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, n = x.shape
    out = np.zeros((rows, row_size(t, n)), dtype=np.uint8)
    size = base.ggml_quantize_chunk(int(t), x.ctypes.data, out.ctypes.data, 0, rows, n, None)
    assert size == out.nbytes
    return out


def to_float(t: int, data: np.ndarray, n: int) -> np.ndarray:
    base, _ = _libs()
    fn = _to_float_t(base.ggml_get_type_traits(int(t)).contents.to_float)
    data = np.ascontiguousarray(data, dtype=np.uint8)
    y = np.empty(n, dtype=np.float32)
    fn(data.ctypes.data, y.ctypes.data, n)
    return y


def dequantize_row_q8_K(data: np.ndarray, n: int) -> np.ndarray:
    """ggml-quants.c dequantize_row_q8_K (Q8_K has no to_float in the type traits)."""
    base, _ = _libs()
    data = np.ascontiguousarray(data, dtype=np.uint8)
    y = np.empty(n, dtype=np.float32)
    base.dequantize_row_q8_K(ctypes.c_void_p(data.ctypes.data), ctypes.c_void_p(y.ctypes.data), ctypes.c_int64(n))
    return y


def cpu_traits(t: int) -> _CpuTraits:
    return _libs()[1].ggml_get_type_traits_cpu(int(t)).contents


def from_float(t: int, x: np.ndarray) -> np.ndarray:
    """The CPU backend's from_float for type t on one row (bytes of the quantized row)."""
    tr = cpu_traits(t)
    fn = _from_float_t(tr.from_float)
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    out = np.zeros(row_size(t, x.size), dtype=np.uint8)
    fn(x.ctypes.data, out.ctypes.data, x.size)
    return out


def vec_dot(t: int, w_row: np.ndarray, act_row: np.ndarray, n: int) -> float:
    """ggml_vec_dot_<t>_<vec_dot_type>(n, &s, 0, w, 0, act, 0, 1)."""
    fn = _vec_dot_t(cpu_traits(t).vec_dot)
    w = np.ascontiguousarray(w_row, dtype=np.uint8)
    a = np.ascontiguousarray(act_row, dtype=np.uint8)
    s = np.zeros(1, dtype=np.float32)
    fn(n, s.ctypes.data, 0, w.ctypes.data, 0, a.ctypes.data, 0, 1)
    return float(s[0])
