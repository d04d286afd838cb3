"""Triton kernels against their torch references, run by the Triton interpreter on tiny shapes
(the same kernels run compiled on the GPU machine: tools/device_kernels.py)."""

from __future__ import annotations

import pytest
import torch

from muser.gguf.types import GgmlType as G
from muser.engine.weights import BASE_FORMATS, repack

from .test_weights import random_weight_bytes


def _w(fmt, n_out, n_in, seed=0):
    raw = random_weight_bytes(fmt, n_out, n_in, seed)
    return repack("t", fmt, n_out, n_in, torch.from_numpy(raw.copy()))


@pytest.mark.parametrize("fmt", BASE_FORMATS, ids=lambda f: f.name)
def test_triton_tile_decoder_bit_exact(kernels, fmt):
    qmv, _ = kernels
    n_in = 288 if fmt in (G.F32, G.F16, G.BF16, G.Q8_0, G.Q4_0) else 512  # partial last tile too
    w = _w(fmt, 5, n_in, 1)
    got = qmv.dequant_triton(w)
    assert torch.equal(got.view(torch.int32), w.decode().view(torch.int32))


@pytest.mark.parametrize("fmt", BASE_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("T", [1, 3, 16])
def test_triton_matvec_vs_reference(kernels, fmt, T):
    qmv, _ = kernels
    w = _w(fmt, 7, 512, 2)
    x = torch.randn(T, 512, generator=torch.Generator().manual_seed(T))
    got = qmv.matvec_triton(w, x)
    ref = qmv.matvec_ref(w, x)
    # f32 accumulation in a different order: bound relative to the sum of |products|
    scale = (x.abs() @ w.decode().abs().T)
    assert torch.all((got - ref).abs() <= 1e-6 * scale + 1e-30)


@pytest.mark.parametrize("fmt", BASE_FORMATS, ids=lambda f: f.name)
def test_triton_matvec_rows_are_bitwise_invariant(kernels, fmt):
    """A row's outputs are the same bits alone and inside every row bucket (row invariance)."""
    qmv, _ = kernels
    w = _w(fmt, 5, 512, 3)
    x = torch.randn(16, 512, generator=torch.Generator().manual_seed(4))
    alone = torch.cat([qmv.matvec_triton(w, x[i:i + 1]) for i in range(16)])
    for T in (2, 5, 16):
        assert torch.equal(qmv.matvec_triton(w, x[:T]).view(torch.int32), alone[:T].view(torch.int32)), T


def test_matvec_refuses_bad_shapes(kernels):
    qmv, _ = kernels
    w = _w(G.Q8_0, 4, 64)
    with pytest.raises(AssertionError):
        qmv.matvec_triton(w, torch.zeros(17, 64))
    with pytest.raises(AssertionError):
        qmv.matvec_triton(w, torch.zeros(1, 32))


def _planes(head_major, n_kv, cap, D, dtype, g):
    shape = (n_kv, cap, D) if head_major else (cap, n_kv * D)
    return (torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))


CASES = [
    # T, cap, len, origin_logical, origin_physical, p0, window, head_major, dtype
    (1, 32, 32, 10, 10, 42, 32, False, torch.float16),  # full wrapped ring, decode
    (5, 32, 20, 0, 0, 20, 32, False, torch.float16),  # filling ring, verify rows
    (4, 32, 32, 40, 8, 72, 32, False, torch.float32),  # wrapped ring, rows cross the window
    (9, 16, 16, 3, 3, 19, 16, False, torch.float16),  # 9 rows over a full ring
    (3, 100, 50, 0, 0, 50, 0, True, torch.float16),  # growing NoPE plane
    (1, 100, 0, 0, 0, 0, 0, True, torch.float32),  # first token: only itself
    (2, 64, 0, 0, 0, 0, 32, False, torch.float16),  # empty ring, two rows
    (1, 600, 530, 0, 0, 530, 0, True, torch.float16),  # full plane over three 256-position splits
    (5, 600, 510, 0, 0, 510, 0, True, torch.float32),  # rows on both sides of a split boundary
    (4, 80, 80, 174, 14, 254, 80, False, torch.float16),  # wrapped ring, rows cross position 256
    (16, 48, 48, 100, 4, 148, 48, False, torch.float32),  # 16 rows over a full wrapped ring
]


@pytest.mark.parametrize("case", CASES)
def test_triton_attention_vs_reference(kernels, case):
    _, att = kernels
    T, cap, ln, ol, op, p0, window, hm, dt = case
    H, n_kv, D = 4, 2, 16
    g = torch.Generator().manual_seed(cap + T)
    q = torch.randn(T, H, D, generator=g)
    kn = torch.randn(T, n_kv, D, generator=g).to(dt)
    vn = torch.randn(T, n_kv, D, generator=g).to(dt)
    kp, vp = _planes(hm, n_kv, cap, D, dt, g)
    ref = att.attend_ref(q, kn, vn, kp, vp, hm, ol, op, ln, cap, p0, window, 0.17)
    meta = torch.tensor(att.plane_meta(kp, vp, hm, n_kv, D, ol, op, ln), dtype=torch.int64)
    pos = torch.tensor([p0], dtype=torch.int64)
    sc = att.AttnScratch(T, H, D, att.split_count(T, cap, window), "cpu")
    got = att.attend_triton(q, kn, vn, hm, meta, pos, window, 0.17, sc, rows_bound=cap)
    assert (got - ref).abs().max().item() < 2e-6  # f32 summation order only


def test_attention_reference_window_rule():
    """attend_ref sees exactly the rows with p1 - p0 < W (llama.cpp SWA standard), causal."""
    from muser.engine.kernels.attention import attend_ref

    D, W = 16, 4
    T, p0 = 3, 6  # rows at positions 6, 7, 8; plane holds positions 2..5 (a ring of W)
    cap = W
    kp = torch.zeros(cap, D)
    vp = torch.zeros(cap, D)
    for pos in range(2, 6):
        vp[pos % cap, 0] = float(pos)  # value = its position; keys all zero -> uniform weights
    kn = torch.zeros(T, 1, D)
    vn = torch.zeros(T, 1, D)
    vn[:, 0, 0] = torch.tensor([6.0, 7.0, 8.0])
    q = torch.zeros(T, 1, D)
    out = attend_ref(q, kn, vn, kp, vp, False, 2, 2, 4, cap, p0, W, 1.0)
    # row at 6 sees 3..6, row at 7 sees 4..7, row at 8 sees 5..8: means 4.5, 5.5, 6.5
    assert torch.allclose(out[:, 0, 0], torch.tensor([4.5, 5.5, 6.5]))
