"""The split-activation integer GEMM (kernels/qgemm_split.py): the layout is a pure reordering of
the repacked fields, the digits represent each activation to within s (s = amax / A_MAX per
256-block), the reference meets the f32 dot of the decoded weights within f32 precision, and both
Triton kernels (run by the Triton interpreter here, compiled on the GPU machine by
tools/device_kernels.py) give the reference's bits at every row count and tile shape."""

from __future__ import annotations

import importlib

import numpy as np
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
    a = sg.digits(act)
    assert int(a.abs().max()) <= 127
    A = (a[:, 0] * 254 + a[:, 1]) * 254 + a[:, 2]  # [T, K]
    xb = (A.to(torch.float64).view(5, 4, 256) * act.s.to(torch.float64)[..., None]).view(5, 1024)
    err = (xb - x.to(torch.float64)).abs().view(5, 4, 256).amax(-1)
    # within one unit of A: s / 2 from the rounding plus the f32 rounding of x / s (< 2^23)
    assert bool((err <= act.s.to(torch.float64) * 1.0000001).all())
    assert torch.equal(act.bx16.to(torch.int64), A.view(5, 64, 16).sum(-1))
    assert torch.equal(act.bx32.to(torch.int64), A.view(5, 32, 32).sum(-1))
    assert torch.equal(act.a.to(torch.int64).sort(-1).values, a.sort(-1).values)  # a permutation
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
    b16 = torch.empty_like(ref.bx16)
    b32 = torch.empty_like(ref.bx32)
    sg._split_act_kernel[(3, 3)](x, a, s, b16, b32, 768, x.stride(0))
    assert torch.equal(a, ref.a) and torch.equal(s.view(torch.int32), ref.s.view(torch.int32))
    assert torch.equal(b16, ref.bx16) and torch.equal(b32, ref.bx32)


def _launch(sg, kind, p, act, **kw):
    out = torch.full((act.rows, p.n_out), float("nan"))
    f = p.fields
    ptrs = (f["q"], f.get("h", f["q"]), f["s"], f["dd"])
    if kind == "rows":
        sg._rows_kernel[(-(-p.n_out // kw["BN"]),)](act.a.view(torch.int32), act.s, act.bx16, act.bx32, out, *ptrs, p.n_out, p.n_in,
                                                    out.stride(0), FMT=sg._CODE[p.fmt], ASM=False, **kw)
    else:
        grid = (-(-act.rows // kw["BM"]), -(-p.n_out // kw["BN"]))
        kw.setdefault("DN", kw["BM"] <= sg.DIGITS_ON_N_MAX)
        sg._tile_kernel[grid](act.a, act.s, act.bx16, act.bx32, out, *ptrs, act.rows, p.n_out, p.n_in, out.stride(0),
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
    one = act.rows_slice(0, 1)
    two = act.rows_slice(0, 2)
    assert torch.equal(_launch(sg, "rows", p, one, ROWS=1, BN=8).view(torch.int32), ref[:1])
    assert torch.equal(_launch(sg, "rows", p, two, ROWS=2, BN=16).view(torch.int32), ref[:2])
    assert torch.equal(_launch(sg, "rows", p, one, ROWS=1, BN=32).view(torch.int32), ref[:1])  # BN > n_out
    assert torch.equal(_launch(sg, "tile", p, act, BM=16, BN=16).view(torch.int32), ref)
    assert torch.equal(_launch(sg, "tile", p, one, BM=16, BN=32).view(torch.int32), ref[:1])
    assert torch.equal(_launch(sg, "tile", p, act, BM=4, BN=16).view(torch.int32), ref)  # five row tiles
    assert torch.equal(_launch(sg, "tile", p, one, BM=2, BN=64).view(torch.int32), ref[:1])
    assert torch.equal(_launch(sg, "tile", p, act, BM=8, BN=32, DN=False).view(torch.int32), ref)  # digits apart
    assert torch.equal(_launch(sg, "tile", p, act, BM=16, BN=16, DN=True).view(torch.int32), ref)  # side by side


def test_split_lane_refused_on_the_cpu(make_gguf):
    from muser.engine import Engine
    from muser.errors import LaneError
    from muser.model.synth import SynthSpec

    with pytest.raises(LaneError, match="lane 'split' runs on cuda only"):
        Engine.open(make_gguf(SynthSpec(dtype="Q4_K")), device="cpu", lane="split")


def test_split_lane_refuses_other_formats(make_gguf):
    from muser.engine import Engine
    from muser.errors import LaneError
    from muser.model.synth import SynthSpec

    with pytest.raises(LaneError, match=r"lane 'split': tensor '.*' is Q8_0"):
        Engine.open(make_gguf(SynthSpec(dtype="Q8_0")), device="cpu", lane="split")


def test_split_forward_is_row_invariant(sg, make_gguf):
    """The CUDA forward of lane split on the CPU (the GEMM's reference in place of its kernels):
    K-quant matrices in the split layout (fields dropped), q|k|v|gate and gate|up stacked; a
    token's logits are bitwise the same decoded alone, verified in a block, and prefilled in one
    chunk of 20 rows or in chunks of 7, and they meet the CPU exact lane's within f32 reordering."""
    import numpy as np

    from muser.engine import Engine
    from muser.engine.lanes import Lane
    from muser.model.synth import SynthSpec

    path = make_gguf(SynthSpec(dtype="q4_k_xl", source="blocks"))
    ref = Engine.open(path, device="cpu", lane="exact", kv="f32")
    eng = Engine.open(path, device="cpu", lane="exact", kv="f32")
    eng.weights.pack_for_decode(drop_fields=True, split=True)
    assert all(isinstance(w.packed, sg.SplitPacked) for w in eng.weights.matrices() if w is not eng.weights.embd)
    assert all(L.ffn_in is not None and L.attn_in is not None for L in eng.weights.layers)
    lin = eng.forward.linear
    lin.cuda, lin.lane = True, Lane.SPLIT  # the CUDA lane's routing; the GEMM runs its reference here
    prompt = [6 + (i * 37) % 300 for i in range(20)]
    whole = eng.session(max_context=64, graphs=False).prefill(prompt, all_logits=True)
    chunked = eng.session(max_context=64, chunk=7, graphs=False).prefill(prompt, all_logits=True)
    s = eng.session(max_context=64, graphs=False)
    one = np.stack([s.decode(t) for t in prompt])
    s = eng.session(max_context=64, graphs=False)
    s.prefill(prompt[:4])
    block = s.verify(prompt[4:20])
    assert np.array_equal(whole.view(np.int32), chunked.view(np.int32))
    assert np.array_equal(whole.view(np.int32), one.view(np.int32))
    assert np.array_equal(whole[4:].view(np.int32), block.view(np.int32))
    base = ref.session(max_context=64, graphs=False).prefill(prompt, all_logits=True)
    assert np.max(np.abs(base - whole)) <= 2e-4 * max(1.0, float(np.max(np.abs(base))))


def _extreme(fmt, n_out, n_in, negative):
    """Blocks at the bounds the tiles' folded operands rely on: every K-quant scale and min at its
    largest (Q4_K/Q5_K sc = m = 63 with codes 15 / 31), Q6_K scales -128 or 127 with codes 0 and 63
    (its 16-bit lanes at 32 and 8192); d, dmin 1.0."""
    from muser.gguf.types import type_info

    ti = type_info(fmt)
    b = np.frombuffer(random_bytes(fmt, n_out, n_in, 9).tobytes(), dtype=np.uint8).copy().reshape(-1, ti.block_bytes)
    one = np.array([1.0], dtype="<f2").view(np.uint8)
    if fmt in (G.Q4_K, G.Q5_K):
        b[:, 0:2] = one
        b[:, 2:4] = one
        b[:, 4:16] = 0xFF  # every 6-bit scale and min 63
        b[:, 16:] = 0x00 if negative else 0xFF  # codes 0 (Q5_K high bits 0) or 15 / 31
    else:
        b[:, 0:192] = 0x00 if negative else 0xFF  # codes 0 or 63
        b[:, 192:208] = np.where(np.arange(16) % 2, 0x7F, 0x80).astype(np.uint8)  # scales 127, -128 alternating
        b[:, 208:210] = one
    return repack("t", fmt, n_out, n_in, torch.from_numpy(b.reshape(n_out, -1).copy()))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_kernels_exact_at_the_folding_bounds(sg, fmt):
    # every digit at +-126 / +-127: A = 126 * 254^2 + 127 * 254 + 127 beside one element at amax
    big = 7.5 * (126 * 64516 + 127 * 254 + 127) / (127 * 64516)
    x = torch.full((3, 512), big)
    x[:, ::256] = 7.5
    x[1] = -x[1]
    x[2, 1::2] = -big
    for negative in (False, True):
        p = sg.pack(_extreme(fmt, 32, 512, negative))
        act = sg.split_act_ref(x)
        assert int((act.a[:, 1:].abs() == 127).sum()) > 1000  # digits 2 and 3 at their bound
        ref = sg.matmul_ref(p, act).view(torch.int32)
        assert torch.equal(_launch(sg, "tile", p, act, BM=16, BN=32).view(torch.int32), ref)  # digits apart
        assert torch.equal(_launch(sg, "tile", p, act, BM=2, BN=16).view(torch.int32), ref)  # side by side
        one = act.rows_slice(0, 1)
        assert torch.equal(_launch(sg, "rows", p, one, ROWS=1, BN=16).view(torch.int32), ref[:1])
