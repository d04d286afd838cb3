"""The split-activation integer GEMM (kernels/qgemm_split.py): the layout is a pure reordering of
the repacked fields, the digits represent each activation to within s (s = amax / A_MAX per
256-block), the reference meets the f32 dot of the decoded weights within f32 precision, and both
Triton kernels (run by the Triton interpreter here, compiled on the GPU machine by
tools/device_kernels.py) give the reference's bits at every row count and tile shape."""

from __future__ import annotations

import importlib

import pytest
import torch

from muser.engine.weights import random_bytes, repack
from muser.gguf.types import GgmlType as G

FORMATS = (G.Q4_K, G.Q5_K, G.Q6_K)


@pytest.fixture(scope="module")
def sg(kernels):
    """qgemm_split re-imported while the `kernels` fixture holds TRITON_INTERPRET=1."""
    from muser.engine.kernels import qgemm_split

    return importlib.reload(qgemm_split)


def _w(fmt, n_out, n_in, seed=0):
    raw = random_bytes(fmt, n_out, n_in, seed)
    return repack("t", fmt, n_out, n_in, torch.from_numpy(raw.copy()))


def _x(t, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((t, k), generator=g, dtype=torch.float32)
    x[0, 3] = 40.0  # an outlier in the first block
    if k >= 512:
        x[:, 256:512] = 0.0  # an all-zero block (s = 0)
    return x


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_pack_is_a_reordering(sg, fmt):
    w = _w(fmt, 6, 768, 4)
    p = sg.pack(w, chunk_elems=1024)
    back = sg.unpack(p)
    assert set(back) == set(w.fields)
    for k, v in w.fields.items():
        assert torch.equal(back[k].view(torch.uint8), v.contiguous().view(torch.uint8)), k
    assert torch.equal(sg.decode(p).view(torch.int32), w.decode().view(torch.int32))


def test_digits_represent_the_activations(sg):
    x = _x(5, 1024, 1)
    act = sg.split_act_ref(x)
    a = act.a.to(torch.int64)
    assert int(a.abs().max()) <= 127
    A = (a[:, 0] * 254 + a[:, 1]) * 254 + a[:, 2]  # [T, K]
    xb = (A.to(torch.float64).view(5, 4, 256) * act.s.to(torch.float64)[..., None]).view(5, 1024)
    err = (xb - x.to(torch.float64)).abs().view(5, 4, 256).amax(-1)
    # within one unit of A: s / 2 from the rounding plus the f32 rounding of x / s (< 2^23)
    assert bool((err <= act.s.to(torch.float64) * 1.0000001).all())
    assert torch.equal(act.bs.to(torch.int64), a.view(5, 3, 64, 16).sum(-1))
    assert bool((act.s[:, 1] == 0).all()) and bool((act.a.view(5, 3, 4, 256)[:, :, 1] == 0).all())


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_reference_meets_the_f32_dot(sg, fmt):
    w = _w(fmt, 24, 1280, 2)
    x = _x(3, 1280, 2)
    y = sg.matmul_ref(sg.pack(w), sg.split_act_ref(x))
    exact = x.to(torch.float64) @ w.decode().to(torch.float64).T
    mag = x.abs().to(torch.float64) @ w.decode().abs().to(torch.float64).T
    assert bool(((y.to(torch.float64) - exact).abs() <= 4e-7 * mag + 1e-30).all())


def test_split_act_kernel_bitwise(sg):
    x = _x(3, 768, 3)
    ref = sg.split_act_ref(x)
    a = torch.empty_like(ref.a)
    s = torch.empty_like(ref.s)
    bs = torch.empty_like(ref.bs)
    sg._split_act_kernel[(3, 3)](x, a, s, bs, 768, x.stride(0))
    assert torch.equal(a, ref.a) and torch.equal(s.view(torch.int32), ref.s.view(torch.int32))
    assert torch.equal(bs, ref.bs)


def _launch(sg, kind, p, act, **kw):
    out = torch.full((act.rows, p.n_out), float("nan"))
    f = p.fields
    ptrs = (f["q"], f.get("h", f["q"]), f["s"], f["dd"])
    if kind == "rows":
        sg._rows_kernel[(-(-p.n_out // kw["BN"]),)](act.a.view(torch.int32), act.s, act.bs, out, *ptrs, p.n_out, p.n_in,
                                                    out.stride(0), FMT=sg._CODE[p.fmt], ASM=False, **kw)
    else:
        grid = (-(-act.rows // kw["BM"]), -(-p.n_out // kw["BN"]))
        sg._tile_kernel[grid](act.a, act.s, act.bs, out, *ptrs, act.rows, p.n_out, p.n_in, out.stride(0),
                              FMT=sg._CODE[p.fmt], **kw)
    return out


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_kernels_give_the_reference_bits(sg, fmt):
    # K = 1280: 5 super-blocks, so the second chunk is partial; 20 outputs: a partial row tile
    w = _w(fmt, 20, 1280, 5)
    p = sg.pack(w)
    x = _x(18, 1280, 5)
    act = sg.split_act_ref(x)
    ref = sg.matmul_ref(p, act).view(torch.int32)
    one = sg.Act(act.a[:1], act.s[:1], act.bs[:1])
    two = sg.Act(act.a[:2], act.s[:2], act.bs[:2])
    assert torch.equal(_launch(sg, "rows", p, one, ROWS=1, BN=8).view(torch.int32), ref[:1])
    assert torch.equal(_launch(sg, "rows", p, two, ROWS=2, BN=16).view(torch.int32), ref[:2])
    assert torch.equal(_launch(sg, "tile", p, act, BM=16, BN=16).view(torch.int32), ref)
    assert torch.equal(_launch(sg, "tile", p, one, BM=16, BN=32).view(torch.int32), ref[:1])
