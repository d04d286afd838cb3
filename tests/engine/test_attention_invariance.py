"""Row invariance of the Triton attention kernel (kernels/attention.py; DESIGN.md "Exactness
contract", Gate 3), run by the Triton interpreter on tiny shapes: a row's output at position p is
bitwise the same computed (a) alone with everything before it in the plane, (b) as row j of a
block of T = 2..16 rows whose earlier rows are new rows, (c) over planes holding different
amounts of history, rotations and capacities (as long as the keys the row sees are the same),
and for any grouping of the rows into launches; across a sliding-window ring wrap, f16 and f32
planes, token-major and head-major layouts. Over f16 planes every check also runs with
f16_operands (the fast lane's f16 K·Q / V·P on tensor cores, two passes over the keys)."""

from __future__ import annotations

import pytest
import torch

H, N_KV, D = 4, 2, 16
SCALE = 0.21


class History:
    """K/V of positions [0, n) (plane dtype) and one query per position, from a seed."""

    def __init__(self, n: int, dtype: torch.dtype, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.k = torch.randn(n, N_KV, D, generator=g).to(dtype)
        self.v = torch.randn(n, N_KV, D, generator=g).to(dtype)
        self.q = torch.randn(n, H, D, generator=g)
        self.dtype = dtype

    def plane(self, head_major: bool, cap: int, ol: int, ln: int, op: int):
        """Planes holding positions [ol, ol + ln) at slots (op + pos - ol) % cap; every other slot
        is NaN, so a read outside the live rows poisons the result."""
        shape = (N_KV, cap, D) if head_major else (cap, N_KV * D)
        kp = torch.full(shape, float("nan"), dtype=self.dtype)
        vp = torch.full(shape, float("nan"), dtype=self.dtype)
        for pos in range(ol, ol + ln):
            s = (op + pos - ol) % cap
            if head_major:
                kp[:, s], vp[:, s] = self.k[pos], self.v[pos]
            else:
                kp[s], vp[s] = self.k[pos].reshape(-1), self.v[pos].reshape(-1)
        return kp, vp


def _attend(att, hist: History, head_major: bool, window: int, p0: int, T: int, cap: int, ol: int,
            op: int, scratch_rows: int | None = None, plane_len: bool = True, f16ops: bool = False):
    """Rows [p0, p0 + T) over a plane holding [ol, p0); K/V of the rows from the history."""
    ln = p0 - ol
    kp, vp = hist.plane(head_major, cap, ol, ln, op)
    meta = torch.tensor(att.plane_meta(kp, vp, head_major, N_KV, D, ol, op, ln), dtype=torch.int64)
    pos = torch.tensor([p0], dtype=torch.int64)
    rows = T if scratch_rows is None else scratch_rows
    sc = att.AttnScratch(rows, H, D, att.split_count(rows, cap, window), "cpu")
    q = hist.q[p0:p0 + T].clone()
    return att.attend_triton(q, hist.k[p0:p0 + T].clone(), hist.v[p0:p0 + T].clone(), head_major,
                             meta, pos, window, SCALE, sc, rows_bound=ln if plane_len else cap, f16_operands=f16ops)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def _ring_ol(p0: int, cap: int) -> int:
    return max(0, p0 - cap)  # a full ring keeps the last `cap` positions


# (window, head_major, dtype, target position p, ring capacity (sliding) or plane capacity)
SETUPS = [
    (48, False, torch.float16, 150, 48),  # sliding ring wrapped three times, f16
    (48, False, torch.float32, 131, 48),  # the same in f32, target at a split boundary + 3
    (40, True, torch.float16, 97, 40),  # head-major ring (the kernel takes either layout)
    (0, True, torch.float16, 75, 96),  # full plane, f16
    (0, False, torch.float32, 70, 80),  # full plane, token-major f32
]


def _with_f16ops(setups):
    """Each setup with f16_operands off, and on where the plane is f16 (the flag's only use)."""
    return [(s, f) for s in setups for f in (False, True) if not f or s[2] == torch.float16]


def _sid(s, f16ops: bool) -> str:
    return f"W{s[0]}-{'hm' if s[1] else 'tm'}-{str(s[2])[6:]}-p{s[3]}" + ("-f16ops" if f16ops else "")


@pytest.fixture
def small_splits(kernels, monkeypatch):
    """Splits of one and two f16 key blocks (32 / 64 positions) and reduce chunks of 2 splits,
    so tiny positions cross many splits and chunk boundaries."""
    _, att = kernels
    monkeypatch.setattr(att, "SPLIT_SLIDING", att.BLOCK)
    monkeypatch.setattr(att, "SPLIT_FULL", 2 * att.BLOCK)
    monkeypatch.setattr(att, "REDUCE_CHUNK", 2)
    return att


@pytest.mark.parametrize("setup, f16ops", _with_f16ops(SETUPS), ids=[_sid(*x) for x in _with_f16ops(SETUPS)])
def test_row_alone_equals_row_of_block(small_splits, setup, f16ops):
    """(a) vs (b): rows decoded alone vs the same rows inside blocks of T = 16, 5 and 2 (first,
    middle and last row of a block; the plane holds what precedes each call)."""
    att = small_splits
    window, hm, dt, p, cap = setup
    hist = History(p + 16, dt, seed=p)
    ol_at = (lambda p0: _ring_ol(p0, cap)) if window else (lambda p0: 0)
    alone = {x: _attend(att, hist, hm, window, x, 1, cap, ol_at(x), (7 * x) % cap, f16ops=f16ops)[0]
             for x in (p - 15, p - 7, p - 3, p)}
    for x, a in alone.items():
        assert torch.isfinite(a).all(), x
    for T, p0 in ((16, p - 15), (5, p - 4), (2, p - 1)):
        blk = _attend(att, hist, hm, window, p0, T, cap, ol_at(p0), (3 * T) % cap, f16ops=f16ops)
        for x, a in alone.items():
            if p0 <= x < p0 + T:
                assert torch.equal(_bits(blk[x - p0]), _bits(a)), f"T={T} row {x - p0} (position {x})"


_HIST = _with_f16ops(SETUPS[:2] + SETUPS[3:4])


@pytest.mark.parametrize("setup, f16ops", _HIST, ids=[_sid(*x) for x in _HIST])
def test_row_invariant_to_history_rotation_and_capacity(small_splits, setup, f16ops):
    """(c): the same visible keys held by planes of other capacities, rotations and amounts of
    history beyond the window, and the grid sized from the capacity (graph calls) or the length."""
    att = small_splits
    window, hm, dt, p, cap = setup
    hist = History(p + 16, dt, seed=p + 1)
    want = _attend(att, hist, hm, window, p, 1, cap, _ring_ol(p, cap) if window else 0, 0, f16ops=f16ops)
    variants = [(cap, 5, True), (cap, cap - 1, False), (cap + 37, 11, True), (2 * cap + 3, 0, False)]
    for c, op, plane_len in variants:
        ol = max(0, p - c) if window else 0  # a bigger ring holds more history than the window
        got = _attend(att, hist, hm, window, p, 1, c, ol, op % c, plane_len=plane_len, f16ops=f16ops)
        assert torch.equal(_bits(got), _bits(want)), f"cap={c} op={op} plane_len={plane_len}"


@pytest.mark.parametrize("setup, rows, f16ops", [(SETUPS[0], 1, False), (SETUPS[4], 3, False),
                                                 (SETUPS[0], 1, True), (SETUPS[3], 3, True)],
                         ids=["sliding", "full", "sliding-f16ops", "full-f16ops"])
def test_block_rows_invariant_to_launch_grouping(small_splits, setup, rows, f16ops):
    """An 8-row block through a scratch of 8 rows (one launch) and of 1 or 3 rows (launches of
    1 row each, or of 3, 3 and 2, as prefill chunks run): every row bitwise equal. One row of a
    sliding layer needs fewer splits than the block together: the 1-row scratch holds only that."""
    att = small_splits
    window, hm, dt, p, cap = setup
    hist = History(p + 16, dt, seed=p + 2)
    p0 = p - 7
    ol = _ring_ol(p0, cap) if window else 0
    one = _attend(att, hist, hm, window, p0, 8, cap, ol, 1, f16ops=f16ops)
    got = _attend(att, hist, hm, window, p0, 8, cap, ol, 1, scratch_rows=rows, f16ops=f16ops)
    assert torch.equal(_bits(got), _bits(one))


@pytest.mark.parametrize("setup, f16ops", _with_f16ops(SETUPS), ids=[_sid(*x) for x in _with_f16ops(SETUPS)])
def test_launch_config_does_not_depend_on_rows(kernels, monkeypatch, setup, f16ops):
    """What fixes a program's reduction order (constexprs and launch options, the integer
    specializations of every argument Triton specializes: == 1, % 16) is the same for a launch of
    1, 2, 7, 13 or 16 rows; only the grid and the unspecialized r0 / NSP / window change. The
    kernels are replaced by recorders (nothing runs), so the check costs nothing under the
    interpreter and reads the very values the compiled launch would get. With f16 operands each
    kernel runs once per pass: one configuration per (kernel, pass)."""
    _, att = kernels
    window, hm, dt, p, cap = setup
    seen: dict[str, dict[int, set]] = {}

    class Recorder:
        def __init__(self, real, T):
            self.real, self.T = real, T

        def __getitem__(self, grid):
            real, T = self.real, self.T

            def launch(*args, **kwargs):
                skip = set(real.kwargs.get("do_not_specialize") or ())
                ints = tuple((n, a == 1, a % 16 == 0) for n, a in zip(real.arg_names, args)
                             if isinstance(a, int) and not isinstance(a, bool) and n not in skip)
                key = (ints, tuple(sorted(kwargs.items())))
                seen.setdefault((real.fn.__name__, kwargs["PASS"]), {}).setdefault(T, set()).add(key)

            return launch

    partial, reduce_ = att._attn_partial, att._attn_reduce
    hist = History(p + 16, dt, seed=p)
    for T in (1, 2, 7, 13, 16):
        monkeypatch.setattr(att, "_attn_partial", Recorder(partial, T))
        monkeypatch.setattr(att, "_attn_reduce", Recorder(reduce_, T))
        p0 = p - T + 1
        for plane_len in (True, False):
            _attend(att, hist, hm, window, p0, T, cap, _ring_ol(p0, cap) if window else 0, 5, plane_len=plane_len,
                    f16ops=f16ops)
    passes = (1, 2) if f16ops else (0,)
    assert set(seen) == {(n, ps) for n in ("_attn_partial", "_attn_reduce") for ps in passes}
    for name, by_rows in seen.items():
        assert all(len(v) == 1 for v in by_rows.values()), (name, by_rows)
        assert len(set.union(*by_rows.values())) == 1, (name, by_rows)


def test_default_splits_invariance_and_reference(kernels):
    """With the shipped split lengths: a full-layer row past two 256-position splits and a
    sliding row over a wrapped 80-position ring (two 64-position splits), alone vs row j of a
    block; and both against attend_ref."""
    _, att = kernels
    for window, hm, dt, p, cap in ((0, True, torch.float16, 530, 600), (80, False, torch.float32, 200, 80)):
        hist = History(p + 4, dt, seed=p)
        ol = _ring_ol(p, cap) if window else 0
        alone = _attend(att, hist, hm, window, p, 1, cap, ol, 3)
        blk = _attend(att, hist, hm, window, p - 2, 4, cap, _ring_ol(p - 2, cap) if window else 0, 9)
        assert torch.equal(_bits(blk[2]), _bits(alone[0]))
        kp, vp = hist.plane(hm, cap, ol, p - ol, 3)
        ref = att.attend_ref(hist.q[p:p + 1], hist.k[p:p + 1], hist.v[p:p + 1], kp, vp, hm, ol, 3, p - ol, cap,
                             p, window, SCALE)
        assert (alone - ref).abs().max().item() < 2e-6


def test_scratch_too_small_is_refused(kernels):
    _, att = kernels
    hist = History(40, torch.float16, seed=0)
    kp, vp = hist.plane(False, 64, 0, 20, 0)
    sc = att.AttnScratch(1, H, D, 1, "cpu")
    with pytest.raises(AssertionError, match="too small"):
        att.attend_triton(hist.q[20:22], hist.k[20:22], hist.v[20:22], False,
                          torch.tensor(att.plane_meta(kp, vp, False, N_KV, D, 0, 0, 20)), torch.tensor([20]), 0, SCALE,
                          sc, rows_bound=64)


def test_graph_step_logits_row_invariant(tiny_gguf, kernels):
    """End to end through the graph step's path (device metadata, Triton attention; on the CPU
    its matvec and tails are the C kernels, which are row-invariant): tokens decoded one by one,
    the same tokens verified as one 5-row block, and that block stepped beside another session's
    rows give bitwise identical logits per position, across the 32-position ring wrap, f16 K/V."""
    import numpy as np

    from muser.engine import Engine

    eng = Engine.open(tiny_gguf, device="cpu", lane="exact", kv="f16")
    prompt = [6 + (i * 37) % 370 for i in range(28)]
    blk = np.array([11, 305, 42, 7, 199])
    mc = 64

    def fresh(toks):
        s = eng.session(max_context=mc)
        s.prefill(toks)
        return s

    one = fresh(prompt)
    alone = np.concatenate([eng.graph(((1, "all", mc),), ()).run([one], [blk[i:i + 1]]).numpy().copy()
                            for i in range(len(blk))])
    blocked = eng.graph(((5, "all", mc),), ()).run([fresh(prompt)], [blk]).numpy().copy()
    other = fresh(prompt[:20])
    g = eng.graph(((2, "all", mc), (5, "all", mc)), ())
    beside = g.split(g.run([other, fresh(prompt)], [np.array([9, 10]), blk]))[1].numpy().copy()
    assert np.array_equal(alone.view(np.int32), blocked.view(np.int32))
    assert np.array_equal(alone.view(np.int32), beside.view(np.int32))


@pytest.mark.parametrize("head_major", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_kv_round_and_store_equal_the_cast_and_index_copy(kernels, head_major, dtype):
    """The graph step's K/V tail: kv_round == torch's .to (RNE, NaN and inf kept, the f16 range's
    edges), kv_store == TorchBackend.write_rows_at on both planes, slots out of order (a ring
    wrap), the other slots untouched."""
    from muser.kv.torch_backend import TorchBackend

    _, att = kernels
    g = torch.Generator().manual_seed(3)
    T, cap = 5, 12
    k = torch.randn(T, N_KV, D, generator=g) * 3
    v = torch.randn(T, N_KV, D, generator=g)
    k.view(-1)[:6] = torch.tensor([float("nan"), float("inf"), -float("inf"), 65519.0, 65520.0, 2.0**-25])
    v.view(-1)[:3] = torch.tensor([1 + 2.0**-11, 1 + 3 * 2.0**-11, -(1 + 2.0**-11)])  # ties to even
    kq, vq = att.kv_round(k, v, dtype)
    assert kq.dtype == vq.dtype == dtype and kq.shape == (T, N_KV, D)
    bits = torch.int16 if dtype == torch.float16 else torch.int32
    for got, want in ((kq, k.to(dtype)), (vq, v.to(dtype))):
        assert torch.equal(got.view(bits), want.view(bits))
    shape = (N_KV, cap, D) if head_major else (cap, N_KV * D)
    base_k = torch.randn(shape, generator=g).to(dtype)
    base_v = torch.randn(shape, generator=g).to(dtype)
    widx = torch.tensor([10, 11, 0, 1, 2], dtype=torch.int64)
    kp, vp = base_k.clone(), base_v.clone()
    att.kv_store(kq, vq, torch.tensor(att.plane_meta(kp, vp, head_major, N_KV, D, 0, 0, 0)), widx, head_major)
    want_k, want_v = base_k.clone(), base_v.clone()
    TorchBackend.write_rows_at(want_k, widx, kq.reshape(T, N_KV * D), head_major, N_KV, D)
    TorchBackend.write_rows_at(want_v, widx, vq.reshape(T, N_KV * D), head_major, N_KV, D)
    assert torch.equal(kp.view(bits), want_k.view(bits)) and torch.equal(vp.view(bits), want_v.view(bits))
    untouched = [s for s in range(cap) if s not in widx.tolist()]
    sel = (slice(None), untouched) if head_major else (untouched,)
    assert torch.equal(kp[sel], base_k[sel]) and torch.equal(vp[sel], base_v[sel])


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_kv_round_reads_a_row_slice_of_a_wider_output_in_place(kernels, dtype):
    """v as the forward passes it: a column slice of the stacked q|k|v output (rows strided, each
    row's heads packed) rounds to the bits of its contiguous copy, into contiguous tensors; heads
    that are not packed are refused."""
    _, att = kernels
    g = torch.Generator().manual_seed(5)
    T = 3
    y = torch.randn(T, 5 * N_KV * D + 7, generator=g) * 100  # [T, q | k | v | gate]-like, an odd width
    v = y[:, 2 * N_KV * D + 3:3 * N_KV * D + 3].view(T, N_KV, D)
    k = torch.randn(T, N_KV, D, generator=g)
    assert not v.is_contiguous()
    kq, vq = att.kv_round(k, v, dtype)
    bits = torch.int16 if dtype == torch.float16 else torch.int32
    assert vq.is_contiguous() and kq.is_contiguous()
    assert torch.equal(vq.view(bits), v.contiguous().to(dtype).view(bits))
    assert torch.equal(kq.view(bits), k.to(dtype).view(bits))
    with pytest.raises(AssertionError, match="packed heads"):
        att.kv_round(k, k.transpose(0, 1).contiguous().transpose(0, 1), dtype)


def test_one_graph_serves_every_session_of_its_bound(tiny_gguf, small_splits):
    """A step graph reads each session's K/V storage from the step's metadata (graphs.py), so one
    graph serves sessions of any max_context up to its bound, a session whose planes an install
    swapped (restore), and sessions stepped one after another: every one gives the bits of the
    graph bound to its own max_context, across the 32-position ring wrap and several splits of
    every layer kind, f16 K/V. A session past the bound is refused before anything is reserved."""
    import numpy as np

    from muser.engine import Engine
    from muser.engine.graphs import graph_context
    from muser.errors import LaneError

    eng = Engine.open(tiny_gguf, device="cpu", lane="exact", kv="f16")
    prompt = [6 + (i * 37) % 370 for i in range(70)]  # 3 splits of the full layers, 5 of the rings
    tok = np.array([123])

    def fresh(mc, toks=prompt):
        s = eng.session(max_context=mc)
        s.prefill(toks)
        return s

    def bits(g, s):
        return g.run([s], [tok]).numpy().copy().view(np.int32)

    own = bits(eng.graph(((1, "all", 80),), ()), fresh(80))
    wide = eng.graph(((1, "all", 256),), ())
    assert np.array_equal(bits(wide, fresh(80)), own)  # a smaller session in a wider bound
    assert np.array_equal(bits(wide, fresh(200)), own)  # another session, larger planes, same graph
    other = fresh(80, prompt[:10])
    bits(wide, other)  # its planes' addresses are now this graph's last
    snap = fresh(80).snapshot()
    other.restore(snap)  # new planes swapped in
    assert np.array_equal(bits(wide, other), own)
    big = fresh(200)
    before = [p.state() for p in big.cache.planes]
    with pytest.raises(LaneError, match="max_context 200"):
        eng.graph(((1, "all", 80),), ()).run([big], [tok])
    assert [p.state() for p in big.cache.planes] == before
    assert graph_context(17, 131072) == 4096 and graph_context(4096, 131072) == 4096
    assert graph_context(4097, 131072) == 8192 and graph_context(100000, 131072) == 131072
    assert graph_context(40, 64) == 64 and graph_context(64, 64) == 64
