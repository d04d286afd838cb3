"""matmul_ggml: the integer sums and rounding points of ggml-cpu's vec_dot kernels; the result
differs from the compiled kernels only by float32 reassociation (a few ulps of the row)."""

from __future__ import annotations

import numpy as np
import pytest

from muser.gguf.types import GgmlType as G
from muser.quant import VEC_DOT_TYPE, dequantize, matmul_ggml, quantize

from . import ggml_ref

TYPES = [G.F32, G.F16, G.BF16, G.Q8_0, G.Q4_0, G.NVFP4, G.Q4_K, G.Q5_K, G.Q6_K]


def ggml_matmul(wb: np.ndarray, t: G, x: np.ndarray) -> np.ndarray:
    """Row by row through the CPU backend: from_float(vec_dot_type) then vec_dot."""
    vt = int(VEC_DOT_TYPE[t])
    out = np.empty((x.shape[0], wb.shape[0]), np.float32)
    for i, row in enumerate(x):
        act = row.view(np.uint8) if t == G.F32 else ggml_ref.from_float(vt, row)
        for o in range(wb.shape[0]):
            out[i, o] = ggml_ref.vec_dot(int(t), wb[o], act, x.shape[1])
    return out


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_matches_ggml_vec_dot_to_reassociation(t):
    rng = np.random.default_rng(int(t))
    n, O, T = 1024, 40, 3
    W = (rng.standard_normal((O, n)) * 0.05).astype(np.float32)
    x = (rng.standard_normal((T, n)) * np.exp(rng.standard_normal((T, 1)))).astype(np.float32)
    wb = np.ascontiguousarray(quantize(W, t)).view(np.uint8).reshape(O, -1)
    ours, ref = matmul_ggml(wb, t, x), ggml_matmul(wb, t, x)
    scale = np.abs(ref).max(axis=1, keepdims=True)  # per token
    assert np.abs(ours - ref).max() <= 4 * np.spacing(scale).max(), t.name
    if t not in (G.F32,):
        # control: skipping ggml's activation rounding lands far outside that band
        plain = x @ dequantize(wb.reshape(-1), t, O * n).reshape(O, n).T
        assert np.abs(plain - ref).max() > 20 * np.abs(ours - ref).max()


def test_shape_refusal():
    from muser.errors import FormatError

    wb = np.zeros((4, 144), np.uint8)
    with pytest.raises(FormatError, match="do not fit n_in 512"):
        matmul_ggml(wb, G.Q4_K, np.zeros((1, 512), np.float32))
