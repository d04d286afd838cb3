"""Engine.step on the CPU: 1..16 rows from up to 4 sequences in one forward give each sequence
what it gets alone; row selection, capture, validation before any work, and all-or-nothing
rollback on non-finite logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from muser.engine import Engine, StepItem
from muser.engine.graphs import part_bounds, plane_storage
from muser.engine.kernels.attention import META_FIELDS
from muser.errors import BatchError, ContextOverflow, EmptyInput, LaneError, NonFiniteLogits, TokenOutOfRange
from muser.gates import GATE_FLOOR, max_dlsm

PROMPT = [6 + (i * 37) % 370 for i in range(120)]

# The CPU exact lane is row-invariant (engine/kernels/cpu.c: every output element reduced in one
# fixed order whatever the row count), and so is the fast lane (integer block sums, one fixed
# block order: quant/dot.py), so a sequence stepped with others is bitwise the same as the
# sequence run alone.


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def eng(tiny_gguf):
    return Engine.open(tiny_gguf, device="cpu", lane="exact", kv="f32")


@pytest.fixture(scope="module", params=[("exact", "f32"), ("fast", "f32"), ("fast", "f16")])
def lane_eng(request, make_gguf):
    """Both lanes on a Q4_K fixture (the fast lane's integer path; F32 weights take the exact GEMM)."""
    from muser.model.synth import SynthSpec

    lane, kv = request.param
    return Engine.open(make_gguf(SynthSpec(dtype="Q4_K")), device="cpu", lane=lane, kv=kv)


def _session(eng, i: int, capture=()):
    """Sequence i: a prompt of its own length (rings wrapped for i >= 1, window 32)."""
    s = eng.session(max_context=128, capture=capture)
    s.prefill(PROMPT[i:i + 12 + 11 * i])
    return s


def _tokens(i: int, T: int) -> list[int]:
    return [PROMPT[(7 * i + 3 * j + 5) % len(PROMPT)] for j in range(T)]


def _equal(a: np.ndarray, b: np.ndarray) -> None:
    assert np.array_equal(a, b), f"max |d log-softmax| {max_dlsm(a, b):.3g}"


@pytest.mark.parametrize("shape", [(1,), (1, 1), (1, 1, 1, 1), (2, 7), (3, 5, 1, 7), (4, 4, 4, 4), (16,),
                                   (16, 16, 16, 16)])
def test_step_equals_each_sequence_alone(lane_eng, shape):
    eng = lane_eng
    batch = [_session(eng, i) for i in range(len(shape))]
    alone = [_session(eng, i) for i in range(len(shape))]
    toks = [_tokens(i, T) for i, T in enumerate(shape)]
    out = eng.step([StepItem(s, t, logits="all") for s, t in zip(batch, toks)])
    for s, a, t, r in zip(batch, alone, toks, out):
        want = a.verify(t)
        assert r.logits.shape == want.shape and r.logits.dtype == np.float32
        assert r.rows == tuple(range(len(t)))
        if len(shape) == 1:
            assert np.array_equal(r.logits, want)  # one item: the very path verify takes
        else:
            _equal(r.logits, want)
        assert s.n_past == a.n_past and np.array_equal(s.logits, r.logits[-1])
    # and the sequences go on as if stepped alone
    nxt = eng.step([StepItem(s, [5]) for s in batch])
    for r, a in zip(nxt, alone):
        _equal(r.logits, a.decode(5)[None])


def test_row_selection_runs_the_head_on_requested_rows(eng):
    ss = [_session(eng, i) for i in range(3)]
    ref = [_session(eng, i) for i in range(3)]
    toks = [_tokens(0, 5), _tokens(1, 3), _tokens(2, 4)]
    out = eng.step([StepItem(ss[0], toks[0], logits=[0, 2, 4]), StepItem(ss[1], toks[1], logits="none"),
                    StepItem(ss[2], toks[2], logits="last")])
    full = [r.verify(t) for r, t in zip(ref, toks)]
    assert out[0].rows == (0, 2, 4) and out[0].logits.shape == (3, eng.cfg.vocab)
    _equal(out[0].logits, full[0][[0, 2, 4]])
    assert out[1].logits is None and out[1].rows == () and ss[1].logits is None
    _equal(out[2].logits, full[2][-1:])
    assert [s.n_past for s in ss] == [r.n_past for r in ref]
    assert eng.step([StepItem(ss[1], [9], logits="none")])[0].logits is None
    assert ss[1].n_past == ref[1].n_past + 1


def test_capture_per_item(eng):
    L = eng.cfg.n_layers
    a, b = _session(eng, 1, capture=(1,)), _session(eng, 2)
    ra, rb = _session(eng, 1, capture=(1,)), _session(eng, 2, capture=(0, L))
    out = eng.step([StepItem(a, _tokens(1, 3)), StepItem(b, _tokens(2, 2), capture=(0, L))])
    ra.verify(_tokens(1, 3))
    rb.verify(_tokens(2, 2))
    assert set(out[0].captured) == {1} and set(out[1].captured) == {0, L}
    assert out[0].captured[1].shape == (3, eng.cfg.hidden)
    for got, ref in ((out[0].captured, ra.captured), (out[1].captured, rb.captured)):
        for il in got:
            assert np.abs(got[il] - ref[il]).max() <= 1e-5 * max(1.0, np.abs(ref[il]).max())
    assert a.captured is out[0].captured


def test_every_item_is_validated_before_any_work(eng, tiny_gguf):
    V = eng.cfg.vocab
    ss = [_session(eng, i) for i in range(3)]
    before = [s.n_past for s in ss]
    other = Engine.open(tiny_gguf, device="cpu", lane="exact", kv="f32").session(max_context=8)
    ok = StepItem(ss[0], [5])
    cases = [
        (BatchError, "list of StepItem", StepItem(ss[0], [5])),
        (BatchError, "at least one", []),
        (BatchError, "item 1: expected a StepItem", [ok, (ss[1], [5])]),
        (BatchError, "item 1: its session does not belong", [ok, StepItem(other, [5])]),
        (BatchError, "item 2: its session is already item 0", [ok, StepItem(ss[1], [5]), StepItem(ss[0], [6])]),
        (BatchError, "item 1: logits must be", [ok, StepItem(ss[1], [5], logits="first")]),
        (BatchError, r"item 1: logits rows must be strictly increasing .*\[2, 1\]",
         [ok, StepItem(ss[1], [5, 6, 7], logits=[2, 1])]),
        (BatchError, r"item 1: logits rows .*\[3\]", [ok, StepItem(ss[1], [5, 6, 7], logits=[3])]),
        (BatchError, "item 1: logits rows must be a flat list", [ok, StepItem(ss[1], [5], logits=[True])]),
        (BatchError, "item 1: 513 rows exceed", [ok, StepItem(ss[1], [5] * 513)]),
        (TokenOutOfRange, f"step item 2: token id {V} at index 1", [ok, StepItem(ss[1], [5]), StepItem(ss[2], [5, V])]),
        (EmptyInput, "step item 1", [ok, StepItem(ss[1], [])]),
        (ContextOverflow, "step item 1", [ok, StepItem(ss[1], [5] * 120)]),
        (LaneError, "capture layer", [ok, StepItem(ss[1], [5], capture=(99,))]),
    ]
    for err, msg, batch in cases:
        with pytest.raises(err, match=msg):
            eng.step(batch)
        assert [s.n_past for s in ss] == before


def test_non_finite_row_rolls_every_session_back(eng, monkeypatch):
    # the forward's last op: the C kernel's softcap on the CPU, the torch one elsewhere
    import muser.engine.forward as fw

    fw, name = (eng.forward.tails, "softcap") if eng.forward.native else (fw, "softcap_logits")
    ss = [_session(eng, i) for i in range(3)]  # rings wrapped: rollback must restore ring rows
    before = [s.n_past for s in ss]
    orig = getattr(fw, name)

    def poison_row_4(lg, a, b):
        out = orig(lg, a, b)
        out[4, 11] = float("inf")  # global row 4 = item 1, row 1 (3 rows per item)
        return out

    monkeypatch.setattr(fw, name, poison_row_4)
    with pytest.raises(NonFiniteLogits, match=r"non-finite logit inf at item 1, row 1, token 11"):
        eng.step([StepItem(s, _tokens(i, 3), logits="all") for i, s in enumerate(ss)])
    assert [s.n_past for s in ss] == before
    monkeypatch.setattr(fw, name, orig)
    out = eng.step([StepItem(s, _tokens(i, 3), logits="all") for i, s in enumerate(ss)])
    fresh = eng.step([StepItem(_session(eng, i), _tokens(i, 3), logits="all") for i in range(3)])
    for a, b in zip(out, fresh):
        assert np.array_equal(a.logits, b.logits)  # the same batch shape: bitwise


def test_only_items_flagged_non_finite_are_scanned_on_the_host(eng, monkeypatch):
    """The step reduces each item's logits' finiteness where they lie (finite_flags, before the
    copy) and scans on the host only an item whose flag is false, to name its row."""
    import muser.engine.step as st

    scanned = []
    orig = st.first_non_finite
    monkeypatch.setattr(st, "first_non_finite", lambda lg: scanned.append(lg.shape) or orig(lg))
    ss = [_session(eng, i) for i in range(3)]
    eng.step([StepItem(s, _tokens(i, 3), logits="all") for i, s in enumerate(ss)])
    assert scanned == []
    flags = st.finite_flags
    monkeypatch.setattr(st, "finite_flags", lambda lgs: flags(lgs) & torch.tensor([True, False, True]))
    eng.step([StepItem(s, _tokens(i, 2), logits="all") for i, s in enumerate(ss)])
    assert scanned == [(2, eng.cfg.vocab)]
    # the flags run over the items that return logits: an item without any takes no place
    monkeypatch.setattr(st, "finite_flags", lambda lgs: flags(lgs) & torch.tensor([True, False]))
    eng.step([StepItem(s, _tokens(i, 1), logits="none" if i == 1 else "all") for i, s in enumerate(ss)])
    assert scanned == [(2, eng.cfg.vocab), (1, eng.cfg.vocab)]


def test_graph_metadata_of_every_item_is_16_byte_aligned(tiny_gguf):
    """Each item's plane metadata and first position, which the attention kernels read by pointer,
    start on a 16-byte boundary whatever the items' row counts: Triton compiles one binary per
    pointer alignment, and warm-up runs single-item shapes, whose metadata are aligned."""
    eng = Engine.open(tiny_gguf, device="cpu", lane="exact", kv="f16")
    L = eng.cfg.n_layers
    ss = [eng.session(max_context=128) for _ in range(4)]
    for rows in ((1,), (1, 1), (1, 1, 1), (3, 1), (1, 2, 5, 1), (16, 1, 7, 2)):
        g = eng.graph(tuple((T, "last", s.max_context) for T, s in zip(rows, ss)), ())
        for i in range(len(rows)):
            assert g.pos0[i].data_ptr() % 16 == 0, (rows, i)
            assert all(g.meta[i][il].data_ptr() % 16 == 0 for il in range(L)), (rows, i)
            a, b = g.bounds[i]
            assert g.widx[i].shape == (L, b - a)


# f16 K/V: another summation order may move a K or V value across an f16 rounding boundary
# before the store (one f16 ulp, 2^-11 relative); on this fixture a +-1-ulp change of one
# attention output flips such a rounding and moves the logits by 5.7e-4 (measured). f32 K/V
# has no such step: summation order only.
SEVERAL_BOUND = {"f32": GATE_FLOOR, "f16": 5e-3}


@pytest.mark.parametrize("kv", ["f32", "f16"])
def test_graph_step_of_several_sessions_on_device_metadata(tiny_gguf, kernels, kv):
    """The CUDA-graph step of a batch shape (per-item plane metadata, write slots and attention
    partials in device buffers; Triton attention; one static row-index selection), run without
    capture on the CPU, against the eager batched step (SEVERAL_BOUND)."""
    eng = Engine.open(tiny_gguf, device="cpu", lane="exact", kv=kv)
    bound = SEVERAL_BOUND[kv]
    L = eng.cfg.n_layers
    shape = ((1, "last"), (3, "all"), (2, "last"))
    got_s = [_session(eng, i, capture=(L,)) for i in range(3)]
    ref_s = [_session(eng, i, capture=(L,)) for i in range(3)]
    toks = [np.array(_tokens(i, T)) for i, (T, _) in enumerate(shape)]
    g = eng.graph(tuple((T, m, s.max_context) for (T, m), s in zip(shape, got_s)), (L,))
    assert eng.graph(tuple((T, m, s.max_context) for (T, m), s in zip(shape, got_s)), (L,)) is g  # one per shape
    lg = g.run(got_s, toks)
    ref = eng.step([StepItem(s, t, logits=m) for s, t, (_, m) in zip(ref_s, toks, shape)])
    for part, r, s, rs in zip(g.split(lg), ref, got_s, ref_s):
        assert part.shape == r.logits.shape
        assert max_dlsm(part.numpy(), r.logits) <= bound
        assert s.n_past == rs.n_past
    assert [int(t) for t in g.top] == [int(np.argmax(r)) for x in ref for r in x.logits] and bool(g.finite)
    (a, b) = g.bounds[1]
    assert np.abs(g.captured[L][a:b].numpy() - ref[1].captured[L]).max() <= bound
    for s, rs in zip(got_s, ref_s):  # the same rows landed in the same slots
        for pa, pb in zip(s.snapshot().planes, rs.snapshot().planes):
            assert pa.origin_logical == pb.origin_logical and pa.len == pb.len
            assert (pa.keys.float() - pb.keys.float()).abs().max() <= 1e-2


@pytest.mark.parametrize("splits", [(1,), (3,), (1, 2), (1, 3), (2, 3, 9)])
def test_graph_inputs_prepared_in_layer_ranges_equal_one(tiny_gguf, splits):
    """A replayed graph step reserves each graph's layers, then launches it, before the next
    graph's (graphs.StepGraph.launch over graphs.part_bounds): the uploaded buffer and every
    plane's state afterwards are those of one reservation over all layers, rings wrapped or
    not, several items at once, and each upload holds its range's layers (and those before) final."""
    eng = Engine.open(tiny_gguf, device="cpu", lane="exact", kv="f32")
    L = eng.cfg.n_layers
    shape = ((1, "last"), (3, "all"), (2, "last"))
    one = [_session(eng, i) for i in range(3)]
    two = [_session(eng, i) for i in range(3)]
    toks = [np.array(_tokens(i, T)) for i, (T, _) in enumerate(shape)]
    ga = eng.graph(tuple((T, m, s.max_context) for (T, m), s in zip(shape, one)), ())
    gb = type(ga)(eng, ga.shape, ())
    ga._prepare(one, toks, range(0, L))
    want = ga.host.numpy().copy()
    M = META_FIELDS
    for (o, _), s in zip(ga.blocks, two):  # the storage addresses are the sessions' own
        want[o:o + M * L].reshape(L, M)[:, 3:] = plane_storage(s)
    ranges = part_bounds(splits, L)
    assert ranges[0][0] == 0 and ranges[-1][1] == L and len(ranges) == 1 + sum(0 < x < L for x in splits)
    for lo, hi in ranges:
        gb._prepare(two, toks, range(lo, hi))
        head = gb.dev.numpy().copy()
        for (a, b), (o, _), s in zip(gb.bounds, gb.blocks, two):
            T = b - a
            assert np.array_equal(head[a:b], want[a:b]) and np.array_equal(head[o:o + M * hi], want[o:o + M * hi])
            assert [list(r[3:]) for r in head[o:o + M * L].reshape(L, M)[:hi]] == \
                [[p.capacity, p.keys.data_ptr(), p.values.data_ptr()] for p in s.cache.planes[:hi]]
            w = o + M * L + 1
            assert np.array_equal(head[w:w + hi * T], want[w:w + hi * T])
    assert np.array_equal(gb.host.numpy(), want) and np.array_equal(gb.dev.numpy(), want)
    for sa, sb in zip(one, two):
        assert [(p.state(), p.appended) for p in sa.cache.planes] == [(p.state(), p.appended) for p in sb.cache.planes]


def test_graph_part_bounds():
    """The step's graphs cover the layers in consecutive ranges; splits outside (0, L) drop out,
    splits out of order are refused."""
    assert part_bounds((2, 12), 52) == [(0, 2), (2, 12), (12, 52)]
    assert part_bounds((2, 12), 8) == [(0, 2), (2, 8)]
    assert part_bounds((0, 52), 52) == [(0, 52)]
    assert part_bounds((), 4) == [(0, 4)]
    with pytest.raises(ValueError, match="not increasing"):
        part_bounds((12, 2), 52)
    with pytest.raises(ValueError, match="not increasing"):
        part_bounds((3, 3), 52)


def test_graph_inputs_refused_before_any_layer_is_reserved(tiny_gguf):
    """The first range checks every plane of every item: an item that cannot take its rows
    (past max_context) leaves every plane of every item as it was."""
    eng = Engine.open(tiny_gguf, device="cpu", lane="exact", kv="f32")
    ok = _session(eng, 0)
    full = eng.session(max_context=13)
    full.prefill(PROMPT[:12])
    g = eng.graph(((1, "last", ok.max_context), (2, "last", full.max_context)), ())
    before = [[(p.state(), p.appended) for p in s.cache.planes] for s in (ok, full)]
    with pytest.raises(ContextOverflow):
        g._prepare([ok, full], [np.array([5]), np.array([5, 6])], range(0, 1))
    assert [[(p.state(), p.appended) for p in s.cache.planes] for s in (ok, full)] == before


def test_only_prompt_shaped_steps_wait_for_a_second_use_to_be_captured(tiny_gguf):
    """On CUDA a step graph is recorded on its first call, except a prompt-shaped one (an item of
    several rows with only its last row out), which a session runs once: it runs eagerly and is
    recorded on its second call (graphs.StepGraph.launch)."""
    eng = Engine.open(tiny_gguf, device="cpu", lane="exact", kv="f32")
    mc = 128
    assert eng.graph(((16, "last", mc),), ()).prompt_like
    assert eng.graph(((1, "last", mc), (5, "last", mc)), ()).prompt_like  # a prompt beside a decoder
    assert not eng.graph(((1, "last", mc),), ()).prompt_like  # decode
    assert not eng.graph(((16, "all", mc),), ()).prompt_like  # verify
    assert not eng.graph(((1, "last", mc), (1, "last", mc)), ()).prompt_like  # batched decode


def test_no_cyclic_collection_runs_inside_a_capture():
    """A dropped engine's graphs are held by reference cycles; the collector must not free them
    while another step is being captured (graphs.collector_paused, around StepGraph._capture):
    inside the guard a dead cycle survives allocations that would each run a collection, the
    first allocations after it free the cycle, and the collector's state is restored, after an
    error too."""
    import gc
    import weakref

    from muser.engine.graphs import collector_paused

    class Held:  # stands for a CUDA graph an engine's cycle holds
        pass

    was, thresholds = gc.isenabled(), gc.get_threshold()
    freed: list[str] = []
    try:
        gc.collect()
        gc.enable()
        gc.set_threshold(1, 1, 1)  # a collection at (nearly) every allocation
        with collector_paused():
            assert not gc.isenabled()
            cycle: dict = {"graph": Held()}  # built and dropped young, in generation 0
            cycle["self"] = cycle
            weakref.finalize(cycle["graph"], freed.append, "graph")
            del cycle
            _junk = [[i] for i in range(1000)]
            assert freed == []  # not collected inside the guard
        assert gc.isenabled()
        _junk = [[i] for i in range(1000)]
        assert freed == ["graph"]  # the collector's next runs free it
        with pytest.raises(RuntimeError), collector_paused():
            raise RuntimeError("a capture that fails")
        assert gc.isenabled()
        gc.disable()
        with collector_paused():
            pass
        assert not gc.isenabled()  # a caller's disabled collector stays disabled
    finally:
        gc.set_threshold(*thresholds)
        (gc.enable if was else gc.disable)()
