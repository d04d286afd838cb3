"""Per-format round trips (encode -> decode) for quality and throughput measurements.

FORMATS maps a format name to (encode, decode): encode(x f32 [rows, n]) -> payload,
decode(payload) -> f32 [rows, n]. Used by tests/quant/test_quality.py and `muser bench quant`.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..gguf.types import GgmlType as G
from ..gguf.types import type_info
from .dequant import dequantize
from .nvfp4 import quantize_nvfp4
from .quantize import quantize


def _ggml(t: G) -> tuple[Callable, Callable]:
    def enc(x: np.ndarray):
        return x.shape, np.ascontiguousarray(quantize(x, t)).view(np.uint8).reshape(-1)

    def dec(p):
        shape, b = p
        return dequantize(b, t, int(np.prod(shape))).reshape(shape)

    return enc, dec


FORMATS: dict[str, tuple[Callable, Callable]] = {
    "f16": _ggml(G.F16),
    "bf16": _ggml(G.BF16),
    "q8_0": _ggml(G.Q8_0),
    "q6_k": _ggml(G.Q6_K),
    "q5_k": _ggml(G.Q5_K),
    "q4_k": _ggml(G.Q4_K),
    "q4_0": _ggml(G.Q4_0),
    "nvfp4": (quantize_nvfp4, lambda w: w.dequantize()),
    "nvfp4-ggml": _ggml(G.NVFP4),
}

GGML_TYPE = {"f16": G.F16, "bf16": G.BF16, "q8_0": G.Q8_0, "q6_k": G.Q6_K, "q5_k": G.Q5_K,
             "q4_k": G.Q4_K, "q4_0": G.Q4_0, "nvfp4-ggml": G.NVFP4}


def bits_per_weight(fmt: str) -> float:
    if fmt == "nvfp4":
        return 4.5  # 4-bit payload + one E4M3FN byte per 16 (+ one f32 per tensor)
    return type_info(GGML_TYPE[fmt]).bits_per_element


def relative_rmse(fmt: str, x: np.ndarray) -> float:
    """RMS(decode(encode(x)) - x) / std(x), in float64."""
    enc, dec = FORMATS[fmt]
    y = dec(enc(x)).astype(np.float64)
    return float(np.sqrt(np.mean((y - x.astype(np.float64)) ** 2)) / np.std(x.astype(np.float64)))


def sample_data(kind: str, rows: int, n: int, seed: int = 0) -> np.ndarray:
    """'gaussian': N(0, 0.02^2); 'student_t3': Student-t with 3 degrees of freedom x 0.02
    (heavy tails, like real weight rows with outliers)."""
    rng = np.random.default_rng(seed)
    if kind == "gaussian":
        return (rng.standard_normal((rows, n)) * 0.02).astype(np.float32)
    if kind == "student_t3":
        return (rng.standard_t(3, (rows, n)) * 0.02).astype(np.float32)
    raise ValueError(f"unknown data kind {kind!r}")
