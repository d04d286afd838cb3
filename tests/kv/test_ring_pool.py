"""Ring pools: rings of one shape and dtype live in one K and one V array, a checkpoint saves the
rows of all of them with one gather per K and V, and rollback restores exactly the bytes the
rings held (token-major and head-major rings, f16 and f32, numpy and torch storage)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from muser.kv import KvCache, NumpyBackend, geometries
from muser.kv.backend import POOL_ALIGN
from muser.kv.plane import PlaneGeometry
from muser.kv.torch_backend import TorchBackend

W, H, D = 8, 2, 4
KV = H * D


class _HeadMajorRing(PlaneGeometry):
    """A ring stored head-major [H, cap, D] (the pool and checkpoint handle both layouts)."""

    @property
    def head_major(self) -> bool:
        return True


def _backends() -> list:
    out = [pytest.param(NumpyBackend, id="numpy"), pytest.param(lambda: TorchBackend("cpu"), id="torch-cpu")]
    if torch.cuda.is_available():
        out.append(pytest.param(lambda: TorchBackend("cuda"), id="torch-cuda"))
    return out


BACKENDS = _backends()


def make(backend, n_rings: int = 5, dtype: str = "f32", head_major: bool = False, max_context: int = 96,
         window: int = W) -> KvCache:
    kinds = [True] * n_rings + [False]  # the rings and one full plane
    geo = geometries(len(kinds), kinds, window, max_context, H, D, dtype)
    if head_major:
        geo = tuple(_HeadMajorRing(**dataclasses.asdict(g)) if g.sliding else g for g in geo)
    return KvCache(geo, backend)


def host(a) -> np.ndarray:
    return a.detach().cpu().numpy() if isinstance(a, torch.Tensor) else np.asarray(a)


def raw(a) -> bytes:
    return host(a).tobytes()


def rows(rng: np.random.Generator, n: int) -> np.ndarray:
    r = (rng.standard_normal((n, KV)) * 300).astype(np.float32)
    r[0, 0], r[-1, -1] = -0.0, np.nan  # bytes, not values, are compared
    return r


def append_all(c: KvCache, start: int, rng: np.random.Generator, n: int, layers=None) -> None:
    for il in range(c.n_layers) if layers is None else layers:
        k, v = rows(rng, n), rows(rng, n)
        c.append_batch(il, start, c.backend.as_rows(k), c.backend.as_rows(v))


def ring_bytes(c: KvCache) -> list[tuple]:
    return [(p.state(), raw(p.keys), raw(p.values)) for p in c.planes if p.geometry.sliding]


def count_reads(c: KvCache) -> dict[str, int]:
    """Count the backend's gathers: pool gathers and per-plane reads."""
    n = {"pool": 0, "plane": 0}
    b = c.backend
    pool_read, plane_read = b.read_pool_rows, b.read_rows

    def read_pool_rows(*a, **k):
        n["pool"] += 1
        return pool_read(*a, **k)

    def read_rows(*a, **k):
        n["plane"] += 1
        return plane_read(*a, **k)

    b.read_pool_rows, b.read_rows = read_pool_rows, read_rows
    return n


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["f16", "f32"])
def test_pool_layout_aligned_zeroed_views(backend, dtype):
    for head_major in (False, True):
        c = make(backend(), n_rings=3, dtype=dtype, head_major=head_major)
        (pool,) = c._pools
        rings = [p for p in c.planes if p.geometry.sliding]
        assert pool.layers == (0, 1, 2) and len(rings) == 3
        shape = (H, W, D) if head_major else (W, KV)
        for j, p in enumerate(rings):
            assert tuple(p.keys.shape) == shape and tuple(p.values.shape) == shape
            assert p.keys is pool.key_views[j] and p.values is pool.value_views[j]
            assert not host(p.keys).any() and not host(p.values).any()
        if isinstance(pool.keys, torch.Tensor):
            ptrs = [p.keys.data_ptr() for p in rings] + [p.values.data_ptr() for p in rings]
            bases = [pool.keys.data_ptr()] * len(rings) + [pool.values.data_ptr()] * len(rings)
            assert all((a - b) % POOL_ALIGN == 0 for a, b in zip(ptrs, bases))  # as aligned as the pool
            assert all(p.keys.is_contiguous() for p in rings)
            assert len(set(ptrs)) == len(ptrs)
        # a write through a plane lands in its row of the pool
        append_all(c, 0, np.random.default_rng(1), 1)
        for j, p in enumerate(rings):
            assert raw(pool.keys[j]) == raw(p.keys)
        assert all(c.plane(3).keys is not v for v in pool.key_views)  # the full plane is not pooled


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["f16", "f32"])
@pytest.mark.parametrize("head_major", [False, True], ids=["token-major", "head-major"])
@pytest.mark.parametrize("block", [1, 16])
def test_pooled_checkpoint_rolls_back_bitwise_over_wrapped_rings(backend, dtype, head_major, block):
    rng = np.random.default_rng(7)
    win = 24  # a block of 16 saves part of the ring
    c = make(backend(), dtype=dtype, head_major=head_major, window=win)
    append_all(c, 0, rng, 2 * win + 3)  # wrapped rings
    n = 2 * win + 3
    reads = count_reads(c)
    # every origin, so the saved slots wrap around the ring end as well as not
    for _ in range(win + 1):
        before = ring_bytes(c)
        full_view = raw(c.view(len(c.planes) - 1).keys)
        reads.update(pool=0, plane=0)
        cp = c.checkpoint(block)
        assert reads == {"pool": 2, "plane": 0}  # one gather per K and V for all five rings
        append_all(c, n, rng, block)  # overwrites `block` live rows of every ring
        assert ring_bytes(c) != before
        c.rollback(cp)
        assert ring_bytes(c) == before
        assert raw(c.view(len(c.planes) - 1).keys) == full_view
        # the same checkpoint again, after a shorter block (a second speculative round)
        append_all(c, n, rng, max(1, block // 2))
        c.rollback(cp)
        assert ring_bytes(c) == before
        append_all(c, n, rng, 1)  # move on by one token
        n += 1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_major", [False, True], ids=["token-major", "head-major"])
def test_pooled_rollback_keep_prefix_equals_sequential(backend, head_major):
    for keep in range(0, 7):
        rng = np.random.default_rng(keep)
        c, ref = make(backend(), dtype="f16", head_major=head_major), make(backend(), dtype="f16", head_major=head_major)
        append_all(c, 0, np.random.default_rng(99), W + 5)
        append_all(ref, 0, np.random.default_rng(99), W + 5)
        cp = c.checkpoint(block=6)
        state = rng.bit_generator.state
        append_all(c, W + 5, rng, 6)
        c.rollback(cp, keep=keep)  # accept `keep` of six drafted rows
        rng.bit_generator.state = state
        for il in range(ref.n_layers):  # the same rows as c got, only the kept ones
            k, v = rows(rng, 6), rows(rng, 6)
            if keep:
                ref.append_batch(il, W + 5, ref.backend.as_rows(k[:keep]), ref.backend.as_rows(v[:keep]))
        assert ring_bytes(c) == ring_bytes(ref)  # every ring slot is live: bitwise the same planes
        for p, q in zip(c.planes, ref.planes):
            assert p.state() == q.state() and raw(p.view().keys) == raw(q.view().keys)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_major", [False, True], ids=["token-major", "head-major"])
def test_replaced_storage_is_read_alone_and_rolls_back(backend, head_major):
    rng = np.random.default_rng(3)
    c = make(backend(), dtype="f16", head_major=head_major)
    append_all(c, 0, rng, 2 * W + 1)
    p1, p3 = c.plane(1), c.plane(3)
    copy = (lambda a: a.clone()) if isinstance(p1.keys, torch.Tensor) else (lambda a: a.copy())
    p1.keys = copy(p1.keys)  # storage no longer the pool's (K only)
    p3.keys, p3.values = copy(p3.keys), copy(p3.values)
    reads = count_reads(c)
    for block in (1, 4, 16):
        before = ring_bytes(c)
        cp = c.checkpoint(block)
        assert reads == {"pool": 2, "plane": 4}  # the three pooled rings together, two alone
        append_all(c, 2 * W + 1, rng, block)
        c.rollback(cp)
        assert ring_bytes(c) == before
        reads.update(pool=0, plane=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rings_in_different_states_roll_back(backend):
    rng = np.random.default_rng(5)
    c = make(backend(), dtype="f32")
    append_all(c, 0, rng, 2 * W)
    append_all(c, 2 * W, rng, 1, layers=[0, 2])  # rings 0 and 2 one row ahead of 1, 3, 4
    reads = count_reads(c)
    before = ring_bytes(c)
    cp = c.checkpoint(block=3)
    assert reads == {"pool": 2, "plane": 4}  # the three in the common state together
    append_all(c, 2 * W + 1, rng, 3, layers=[0, 2])
    append_all(c, 2 * W, rng, 3, layers=[1, 3, 4, 5])
    c.rollback(cp)
    assert ring_bytes(c) == before


@pytest.mark.parametrize("backend", BACKENDS)
def test_gathers_per_checkpoint_do_not_grow_with_rings(backend):
    for n_rings in (1, 4, 16, 39):
        c = make(backend(), n_rings=n_rings, dtype="f16")
        append_all(c, 0, np.random.default_rng(0), W + 2)
        reads = count_reads(c)
        for block in (1, 16):
            c.checkpoint(block)
            assert reads == {"pool": 2, "plane": 0}, n_rings
            reads.update(pool=0, plane=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_not_full_rings_read_nothing(backend):
    c = make(backend(), dtype="f16")
    append_all(c, 0, np.random.default_rng(0), W - 3)
    reads = count_reads(c)
    cp = c.checkpoint(block=3)  # room for the block: nothing to save
    assert reads == {"pool": 0, "plane": 0} and all(m.slots.size == 0 for m in cp.marks)
    c.checkpoint(block=4)  # one row would be overwritten
    assert reads == {"pool": 2, "plane": 0}


@pytest.mark.parametrize("backend", BACKENDS)
def test_restored_and_installed_caches_are_pooled(backend):
    rng = np.random.default_rng(11)
    c = make(backend(), dtype="f16")
    append_all(c, 0, rng, 2 * W + 5)
    snap = c.snapshot()
    d = make(backend(), dtype="f16", max_context=64)
    d.restore(snap)
    assert ring_bytes(d) == ring_bytes(c)  # restored into the pool views, at the sequential rotation
    for cache in (c, d):
        (pool,) = cache._pools
        assert all(cache.plane(i).keys is v for i, v in zip(pool.layers, pool.key_views))
        reads = count_reads(cache)
        before = ring_bytes(cache)
        cp = cache.checkpoint(block=16)
        assert reads == {"pool": 2, "plane": 0}
        append_all(cache, 2 * W + 5, rng, 16)
        cache.rollback(cp)
        assert ring_bytes(cache) == before


def test_plane_storage_is_stable_across_steps():
    """The CUDA-graph step keys its captures on each plane's data_ptr."""
    c = make(TorchBackend("cpu"), dtype="f16")
    ptrs = [(p.keys.data_ptr(), p.values.data_ptr()) for p in c.planes]
    rng = np.random.default_rng(2)
    for n in range(0, 3 * W):
        cp = c.checkpoint(block=4)
        append_all(c, n, rng, 4)
        c.rollback(cp, keep=1)
    assert [(p.keys.data_ptr(), p.values.data_ptr()) for p in c.planes] == ptrs


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n_planes", [1, 3])
def test_saved_rows_never_alias_the_planes(backend, n_planes):
    """One plane, one KV head, one slot: shapes where a reshape could hand back a view."""
    b = backend()
    for head_major in (False, True):
        shape = (1, W, D) if head_major else (W, D)
        pool = b.zeros_pool(n_planes, shape, "f32")
        slots = np.array([3], dtype=np.int64)
        got = b.read_pool_rows(pool, slots, head_major, 1, D)
        one = b.read_rows(pool[0], slots, head_major, 1, D)
        assert tuple(got.shape) == (n_planes, 1, D) and tuple(one.shape) == (1, D)
        b.write_rows(pool[0], slots, np.ones((1, D), np.float32), head_major, 1, D)
        assert not host(got).any() and not host(one).any()
