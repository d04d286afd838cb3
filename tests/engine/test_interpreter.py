"""The interpreter shim (kernels/interpreter.py): under TRITON_INTERPRET=1 a float tl.dot sums
each element in one fixed order, so a row's result does not depend on where the row sits in the
dot's M (numpy's BLAS made it depend on it, and the attention invariance checks at the engine's
shape failed under the interpreter while they held on the GPU)."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_rows_dot_does_not_depend_on_its_place_in_m(dtype):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("a property of the interpreter's tl.dot; compiled kernels run one mma order per element")
    import triton
    import triton.language as tl

    @triton.jit
    def _dot(a, b, c, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr):
        m = tl.arange(0, M)[:, None]
        k = tl.arange(0, K)
        n = tl.arange(0, N)[None, :]
        x = tl.load(a + m * K + k[None, :])  # [M, K] f16 or bf16
        y = tl.load(b + k[:, None] * N + n)  # [K, N]
        tl.store(c + m * N + n, tl.dot(x, y, tl.zeros([M, N], tl.float32)))

    g = torch.Generator().manual_seed(3)
    M, K, N = 64, 128, 32  # the f16 attention's dot at the engine's shape: 4 rows x 16 heads, head_dim 128
    a = torch.randn(M, K, generator=g).to(dtype)
    b = torch.randn(K, N, generator=g).to(dtype)
    moved = torch.zeros_like(a)
    moved[:16] = a[48:]  # the same 16 rows first, the rest zero (a group's idle rows)
    c1, c2 = torch.empty(M, N), torch.empty(M, N)
    _dot[(1,)](a, b, c1, M=M, K=K, N=N)
    _dot[(1,)](moved, b, c2, M=M, K=K, N=N)
    assert torch.equal(c1[48:].view(torch.int32), c2[:16].view(torch.int32))
    ref = a[48:].float() @ b.float()
    assert torch.allclose(c2[:16], ref, rtol=1e-5, atol=1e-4)
