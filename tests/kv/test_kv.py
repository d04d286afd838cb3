"""muser.kv: ring arithmetic at the boundaries, batch == sequential, fail-closed appends,
checkpoint/rollback, rotation-preserving snapshot/restore, detached install (book 15)."""

from __future__ import annotations

import numpy as np
import pytest

from muser.errors import CacheDiscontinuity, ContextOverflow, EmptyInput, KvStateError
from muser.kv import KvCache, KvSnapshot, NumpyBackend, PlaneSnapshot, geometries

W, H, D = 8, 2, 4  # window, KV heads, head_dim
KV = H * D
KINDS = [True, True, True, False]  # one collar: [S, S, S, F]


def make(max_context: int = 64, dtype: str = "f32") -> KvCache:
    return KvCache(geometries(4, KINDS, W, max_context, H, D, dtype))


def rows(pos: int, n: int = 1, salt: float = 0.0) -> np.ndarray:
    # distinct, position-identifying values: row p holds p + j/64 + salt
    base = np.arange(pos, pos + n, dtype=np.float32)[:, None] + np.arange(KV, dtype=np.float32)[None, :] / 64
    return (base + salt).astype(np.float32)


def append_all(c: KvCache, pos: int, n: int = 1, salt: float = 0.0) -> None:
    for layer in range(c.n_layers):
        k = rows(pos, n, salt)
        c.append_batch(layer, pos, k, -k)


def planes_equal(a: KvCache, b: KvCache) -> bool:
    return all(
        pa.state() == pb.state() and np.array_equal(pa.keys, pb.keys) and np.array_equal(pa.values, pb.values)
        for pa, pb in zip(a.planes, b.planes)
    )


def test_allocation_zero_filled_two_layouts():
    c = make(max_context=40, dtype="f16")
    ring, full = c.plane(0), c.plane(3)
    assert ring.capacity == W and ring.keys.shape == (W, KV)  # token-major, min(max_context, W)
    assert full.capacity == 40 and full.keys.shape == (H, 40, D)  # head-major, max_context
    assert ring.keys.dtype == np.float16
    assert all(not p.keys.any() and not p.values.any() for p in c.planes)
    # a short session's ring is min(max_context, W)
    assert make(max_context=5).plane(0).capacity == 5


def test_ring_walk_fill_first_wrap_later_wraps():
    c = make()
    ring = c.plane(0)
    for pos in range(3 * W + 3):
        k = rows(pos)
        write = ring.append(pos, k, -k)
        if pos < W:  # fill
            assert write == pos and ring.state() == (pos + 1, 0, 0)
        else:  # every later append overwrites the oldest row; both origins slide by one
            assert write == (pos - W) % W
            assert ring.state() == (W, pos - W + 1, (pos - W + 1) % W)
        if pos == W - 1:
            assert ring.state() == (W, 0, 0)
        if pos == W:  # first wrap: slot 0 overwritten, window starts at token 1
            assert write == 0 and ring.state() == (W, 1, 1)
        if pos == 2 * W:  # second wrap
            assert write == 0 and ring.state() == (W, W + 1, 1)
        view = ring.view()
        lo = max(0, pos + 1 - W)
        assert np.array_equal(view.positions, np.arange(lo, pos + 1))
        assert np.array_equal(view.keys, rows(lo, pos + 1 - lo))  # logical order, exact rows
        assert np.array_equal(view.values, -rows(lo, pos + 1 - lo))
        phys = ring.view("physical")
        assert sorted(phys.positions.tolist()) == list(range(lo, pos + 1))
        assert np.array_equal(phys.keys, ring.keys[: ring.len])  # physical scan order


def test_head_major_placement_formula():
    c = make(max_context=16)
    full = c.plane(3)
    for pos in range(5):
        k = rows(pos)
        full.append(pos, k, -k)
    # index (kv_head * capacity + physical) * head_dim + dim (book 15.4)
    flat = full.keys.reshape(-1)
    for pos in range(5):
        for h in range(H):
            for d in range(D):
                assert flat[(h * full.capacity + pos) * D + d] == rows(pos)[0, h * D + d]


@pytest.mark.parametrize("splits", [[1] * 30, [3, 5, 7, 15], [30], [8, 8, 8, 6], [9, 1, 20], [2, 17, 11]])
def test_append_batch_equals_sequential(splits):
    seq, bat = make(), make()
    for pos in range(sum(splits)):
        append_all(seq, pos)
    pos = 0
    for n in splits:
        for layer in range(4):
            k = rows(pos, n)
            pl = bat.append_batch(layer, pos, k, -k)
            if layer == 0:  # only the rows still live after the chunk get a slot, each once
                assert pl.source_first == max(0, n - W)
                assert len(set(pl.physical.tolist())) == len(pl.physical)
        pos += n
    assert planes_equal(seq, bat)


@pytest.mark.parametrize("splits", [[1] * 12, [3, 5, 1, 7], [16], [7, 1, 1, 1, 9]])
def test_reserve_batch_all_equals_each_plane_reserving(splits):
    # across the ring wrap (W = 8): one shared placement per (capacity, state), the same slots
    # and states as each plane reserving alone
    each, all_ = make(), make()
    pos = 0
    for n in splits:
        want = [p.reserve_batch(pos, n) for p in each.planes]
        got = all_.reserve_batch_all(pos, n)
        assert [(w.source_first, w.physical.tolist()) for w in want] == \
            [(g.source_first, g.physical.tolist()) for g in got]
        assert [(p.state(), p.appended) for p in each.planes] == [(p.state(), p.appended) for p in all_.planes]
        pos += n


def test_reserve_batch_all_refusal_reserves_nothing():
    c = make(max_context=12)
    append_all(c, 0, 10)
    before = [(p.state(), p.appended) for p in c.planes]
    with pytest.raises(CacheDiscontinuity):
        c.reserve_batch_all(11, 1)
    with pytest.raises(ContextOverflow):
        c.reserve_batch_all(10, 3)
    assert [(p.state(), p.appended) for p in c.planes] == before
    with pytest.raises(KvStateError):  # a plane not in the state the shared reserve was made from
        c.planes[1].reserve_batch_as(10, 1, (0, 0, 0), c.planes[0].state(), c.planes[0].reserve_batch(10, 1))


def test_f16_storage_rounds_to_nearest_even():
    c = make(dtype="f16")
    k = (rows(0) * 1.0001).astype(np.float32)
    c.append(0, 0, k, k)
    assert np.array_equal(c.view(0).keys, k.astype(np.float16))
    assert np.array_equal(NumpyBackend().round_to(k, "f16"), k.astype(np.float16).astype(np.float32))


def test_append_refusals_leave_state_untouched():
    c = make(max_context=12)
    append_all(c, 0, 10)
    before = [(p.state(), p.keys.copy()) for p in c.planes]
    with pytest.raises(CacheDiscontinuity) as e:
        c.append(0, 11, rows(11), rows(11))
    assert (e.value.layer, e.value.expected, e.value.got) == (0, 10, 11)
    assert "expected position 10, got 11" in str(e.value)
    with pytest.raises(CacheDiscontinuity):
        c.append_batch(3, 9, rows(9, 2), rows(9, 2))  # a replayed position never aliases a row
    with pytest.raises(ContextOverflow):
        c.append_batch(0, 10, rows(10, 3), rows(10, 3))  # past max_context
    with pytest.raises(EmptyInput):
        c.append_batch(0, 10, np.zeros((0, KV), np.float32), np.zeros((0, KV), np.float32))
    with pytest.raises(KvStateError):
        c.append(0, 10, rows(10)[:, :3], rows(10)[:, :3])  # wrong row width
    with pytest.raises(KvStateError):
        c.plane(7)
    assert all(p.state() == s and np.array_equal(p.keys, k) for p, (s, k) in zip(c.planes, before))
    assert c.n_tokens == 10


def test_checkpoint_keeps_at_most_block_rows_and_rolls_back_bitwise():
    c = make()
    append_all(c, 0, 2 * W + 3)  # wrapped ring
    ref = make()
    append_all(ref, 0, 2 * W + 3)
    cp = c.checkpoint(block=4)
    assert all(m.slots.size == 0 for m, p in zip(cp.marks, c.planes) if not p.geometry.sliding)
    assert all(0 < m.slots.size <= 4 for m, p in zip(cp.marks, c.planes) if p.geometry.sliding)
    append_all(c, 2 * W + 3, 4, salt=0.5)  # a speculative block that overwrites live ring rows
    c.rollback(cp)
    # NoPE planes rewound metadata only (their stale rows sit past len); rings restored their rows:
    # visible rows and physical ring rows are the pre-block ones, bit for bit
    for p, q in zip(c.planes, ref.planes):
        assert p.state() == q.state()
        if p.geometry.sliding:
            assert np.array_equal(p.keys, q.keys) and np.array_equal(p.values, q.values)
        assert np.array_equal(p.view().keys, q.view().keys)
    # rolled back to again, after another block
    append_all(c, 2 * W + 3, 3, salt=0.25)
    c.rollback(cp)
    assert [p.state() for p in c.planes] == [q.state() for q in ref.planes]


def test_rollback_keep_prefix_equals_sequential():
    c, ref = make(), make()
    append_all(c, 0, W + 5)
    append_all(ref, 0, W + 5)
    cp = c.checkpoint(block=6)
    append_all(c, W + 5, 6, salt=0.5)
    c.rollback(cp, keep=2)  # accept two of six drafted rows
    append_all(ref, W + 5, 2, salt=0.5)
    for p, q in zip(c.planes, ref.planes):
        assert p.state() == q.state()
        assert np.array_equal(p.view().keys, q.view().keys)
        if p.geometry.sliding:
            assert np.array_equal(p.keys, q.keys)
    append_all(c, W + 7, 3)
    append_all(ref, W + 7, 3)
    assert all(np.array_equal(p.view().keys, q.view().keys) for p, q in zip(c.planes, ref.planes))


def test_rollback_refusals():
    c = make()
    append_all(c, 0, W + 1)
    cp = c.checkpoint(block=2)
    append_all(c, W + 1, 3)
    state = [p.state() for p in c.planes]
    with pytest.raises(KvStateError, match="more than its block of 2"):
        c.rollback(cp)
    assert [p.state() for p in c.planes] == state  # refused before any plane moved
    c2 = make()
    append_all(c2, 0, 4)
    early = c2.checkpoint(block=8)
    append_all(c2, 4, 2)
    late = c2.checkpoint(block=8)
    c2.rollback(early)
    append_all(c2, 4, 2, salt=0.5)
    with pytest.raises(KvStateError, match="earlier cache history"):
        c2.rollback(late)  # a checkpoint from a discarded branch
    with pytest.raises(KvStateError, match="cannot keep 5"):
        c2.rollback(early, keep=5)
    with pytest.raises(KvStateError):
        c2.checkpoint(block=0)


@pytest.mark.parametrize("n", [3, W, W + 1, 2 * W + 5, 3 * W + 7])
def test_snapshot_restore_preserves_rotation_and_replays(n):
    live = make(dtype="f16")
    append_all(live, 0, n)
    snap = live.snapshot()
    restored = make(dtype="f16")
    append_all(restored, 0, 2, salt=9.0)  # whatever was there is replaced whole
    restored.restore(snap)
    assert planes_equal(live, restored)  # same rows at the same physical slots (book 15.6)
    for pos in range(n, n + 2 * W + 1):  # replay past further wraps
        append_all(live, pos)
        append_all(restored, pos)
        assert planes_equal(live, restored)


def test_restore_into_other_slot_sizes_and_refusals_keep_live():
    n = 3 * W + 5  # rings wrapped several times
    a = make(max_context=64)
    append_all(a, 0, n)
    snap = a.snapshot(tokens=range(n))
    assert snap.tokens == tuple(range(n))
    for max_context in (n + 2, 40, 200):  # slot sizes other than the source's
        b = make(max_context=max_context)
        b.restore(snap)
        ref = make(max_context=max_context)
        append_all(ref, 0, n)
        assert planes_equal(b, ref)  # a sequential build's rows and rotation
        append_all(b, n, 2)
        append_all(ref, n, 2)
        assert planes_equal(b, ref)
    small = make(max_context=n - 1)
    append_all(small, 0, 3)
    with pytest.raises(ContextOverflow, match=f"snapshot of {n} tokens"):
        small.restore(snap)
    other = make(max_context=64, dtype="f16")
    with pytest.raises(KvStateError, match="layer 0: snapshot layout"):
        other.restore(snap)
    short = KvSnapshot(snap.n_tokens, (PlaneSnapshot(snap.planes[0].layout, n - 2, snap.planes[0].keys[-2:],
                                                     snap.planes[0].values[-2:]),) + snap.planes[1:])
    with pytest.raises(KvStateError, match="do not cover the last 8"):
        a.restore(short)
    assert small.n_tokens == 3 and a.n_tokens == n
    with pytest.raises(KvStateError, match="carries 2 token ids"):
        KvSnapshot(3, snap.planes, (1, 2))


def test_detached_install_commits_only_when_complete():
    n = 2 * W + 3
    ref = make()
    append_all(ref, 0, n)
    live = make()
    append_all(live, 0, 4, salt=7.0)
    inst = live.begin_install(n)
    for layer in range(4):
        a, b = inst.expected(layer)
        assert (a, b) == ((n - W, n) if KINDS[layer] else (0, n))
    # tiles arrive out of order; NoPE first (position-free, book 9.7), SWA tails last
    inst.put(3, 8, rows(8, n - 8), -rows(8, n - 8))
    inst.put(3, 0, rows(0, 8), -rows(0, 8))
    with pytest.raises(KvStateError, match="already installed"):
        inst.put(3, 5, rows(5), -rows(5))
    with pytest.raises(KvStateError, match="outside the expected range"):
        inst.put(0, 0, rows(0, 2), -rows(0, 2))  # rows the ring no longer holds
    with pytest.raises(KvStateError, match="install incomplete: layer 0"):
        live.commit(inst)
    assert live.n_tokens == 4 and live.plane(0).view().keys[0, 0] == 7.0  # live untouched
    for layer in range(3):
        inst.put(layer, n - W, rows(n - W, W), -rows(n - W, W))
    live.commit(inst)
    assert planes_equal(live, ref)  # the rotation a sequential build holds
    with pytest.raises(KvStateError, match="already committed"):
        live.commit(inst)
    with pytest.raises(ContextOverflow):
        live.begin_install(65)


def test_for_config_capacities(tiny_config):
    c = KvCache.for_config(tiny_config, max_context=100, dtype="f16")
    for il, p in enumerate(c.planes):
        if tiny_config.swa_pattern[il]:
            assert p.capacity == min(100, tiny_config.sliding_window) and not p.geometry.head_major
        else:
            assert p.capacity == 100 and p.geometry.head_major
    with pytest.raises(ContextOverflow):
        KvCache.for_config(tiny_config, max_context=tiny_config.context_length + 1)


@pytest.fixture(scope="module")
def tiny_config(tiny_gguf):
    from muser.model.loader import open_model

    m = open_model(tiny_gguf)
    try:
        return m.config
    finally:
        m.close()
