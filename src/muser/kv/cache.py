"""The two-class KV cache: one plane per layer, checkpoint/rollback, snapshot/restore, detached
install (book 9.7, 10.6, 10.7, 15).

- Capacity by layer kind: SWA rings min(max_context, W) token-major, NoPE planes max_context
  head-major, all zero-filled (book 15.2).
- `checkpoint(block)` / `rollback(cp, keep=0)`: NoPE planes rewind metadata only; SWA rings keep
  the <= block rows a speculative block may overwrite (book 10.6, decode.rs:208-212). A rollback
  after more than `block` appends on a ring is refused (the rows needed are gone). Rings of one
  shape and dtype are views into one K and one V pool, so a checkpoint saves the rows of all of
  them with one gather per K and V, however many rings there are.
- `snapshot(tokens)` / `restore()`: rows in logical order plus origins (and the token ids when
  known) under slot-size-independent layouts; restore installs them into any cache of the same
  layouts with room for n_tokens, at the rotation a sequentially built ring holds
  (origin_physical = origin_logical % capacity), because physical scan order is numerically
  observable (book 15.6). Byte form: muser.kv.serial.
- `begin_install(n_tokens)` / `commit(install)`: planes built beside the live ones and swapped in
  whole only when every expected row arrived (book 10.7).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import ContextOverflow, KvStateError
from .backend import ArrayBackend, NumpyBackend, check_kv_dtype
from .plane import (
    BatchPlacement,
    KvPlane,
    PlaneGeometry,
    PlaneLayout,
    PlaneView,
    fresh_epoch,
)

# Verify width of one speculative block (book 10.1: MAX_DFLASH_BLOCK = 16).
DEFAULT_BLOCK = 16


_NO_SLOTS = np.zeros(0, dtype=np.int64)  # a mark with nothing to restore (never written to)


@dataclass(slots=True)  # not frozen: a frozen __init__ costs ~4x, once per plane per decode step
class _PlaneMark:
    epoch: int
    appended: int
    state: tuple[int, int, int]  # (len, origin_logical, origin_physical)
    slots: np.ndarray  # int64: ring slots holding live rows the next `block` appends overwrite
    # saved rows at `slots` (token-major), None when `slots` is empty; with row >= 0 a pool gather
    # whose [row] they are (indexed on rollback only: a view per ring costs more than the gather)
    keys: Any
    values: Any
    row: int = -1

    def rows(self) -> tuple[Any, Any]:
        """The saved K and V rows at `slots`."""
        if self.row < 0:
            return self.keys, self.values
        return self.keys[self.row], self.values[self.row]


@dataclass(frozen=True, eq=False)
class _RingPool:
    """Rings of one shape and dtype whose K and V are views into one array each, [n, *shape]."""

    layers: tuple[int, ...]  # plane index of each pooled ring
    keys: Any
    values: Any
    key_views: tuple[Any, ...]  # the storage each ring was given: one replaced since is read alone
    value_views: tuple[Any, ...]


def _build_planes(geometry: Sequence[PlaneGeometry],
                  backend: ArrayBackend) -> tuple[tuple[KvPlane, ...], tuple[_RingPool, ...]]:
    """Zero-filled planes; rings of one shape and dtype share a pool (full planes, never read by a
    checkpoint, keep their own allocations)."""
    groups: dict[tuple, list[int]] = {}
    for i, g in enumerate(geometry):
        if g.sliding:
            groups.setdefault((g.shape, g.dtype, g.head_major), []).append(i)
    storage: dict[int, tuple[Any, Any]] = {}
    pools = []
    for (shape, dtype, _), idx in groups.items():
        k = backend.zeros_pool(len(idx), shape, dtype)
        v = backend.zeros_pool(len(idx), shape, dtype)
        kv = tuple(k[j] for j in range(len(idx)))
        vv = tuple(v[j] for j in range(len(idx)))
        pools.append(_RingPool(tuple(idx), k, v, kv, vv))
        storage.update((i, (kv[j], vv[j])) for j, i in enumerate(idx))
    planes = tuple(KvPlane(g, backend, *storage.get(i, (None, None))) for i, g in enumerate(geometry))
    return planes, tuple(pools)


def _overwritten_slots(state: tuple[int, int, int], cap: int, block: int) -> np.ndarray:
    """Ring slots holding live rows that the next `block` appends overwrite: the i-th next append
    writes slot (op + len + i) % cap, which holds a live row once len + i >= cap."""
    length, _, op = state
    i = np.arange(max(0, cap - length), min(block, cap), dtype=np.int64)
    return (op + length + i) % cap


@dataclass
class KvCheckpoint:
    """A rollback point. Valid while every plane is still in the history it was taken in and no
    ring took more than `block` appends since."""

    block: int
    marks: list[_PlaneMark]

    @property
    def n_tokens(self) -> int:
        length, ol, _ = self.marks[0].state
        return ol + length


@dataclass(frozen=True)
class PlaneSnapshot:
    """One plane's visible rows in logical order from `origin_logical` (explicit origin, book
    15.6), under a slot-size-independent layout."""

    layout: PlaneLayout
    origin_logical: int
    keys: Any  # [len, kv_dim] in logical order
    values: Any

    @property
    def len(self) -> int:
        return int(np.shape(self.keys)[0])

    @property
    def layer(self) -> int:
        return self.layout.layer


@dataclass(frozen=True)
class KvSnapshot:
    """Every plane's state after `n_tokens` tokens; `tokens` (the ids those rows were computed
    from) travels with it when the taker knows them. Restorable into any cache of the same
    layouts whose max_context holds n_tokens, whatever its slot size."""

    n_tokens: int
    planes: tuple[PlaneSnapshot, ...]
    tokens: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.tokens is not None and len(self.tokens) != self.n_tokens:
            raise KvStateError(f"snapshot of {self.n_tokens} tokens carries {len(self.tokens)} token ids")

    @property
    def layouts(self) -> tuple[PlaneLayout, ...]:
        return tuple(p.layout for p in self.planes)


def geometries(n_layers: int, sliding: Sequence[bool], window: int, max_context: int,
               n_kv_heads: int, head_dim: int, dtype: str) -> tuple[PlaneGeometry, ...]:
    if len(sliding) != n_layers:
        raise KvStateError(f"{len(sliding)} layer kinds for {n_layers} layers")
    return tuple(
        PlaneGeometry.build(il, bool(s), window, max_context, n_kv_heads, head_dim, dtype)
        for il, s in enumerate(sliding)
    )


class KvCache:
    """Per-layer KV planes for one sequence."""

    def __init__(self, geometry: Sequence[PlaneGeometry], backend: ArrayBackend | None = None):
        self.backend = backend if backend is not None else NumpyBackend()
        self.geometry = tuple(geometry)
        self._planes, self._pools = _build_planes(self.geometry, self.backend)

    @classmethod
    def for_config(cls, config: Any, max_context: int, dtype: str = "f16",
                   backend: ArrayBackend | None = None) -> KvCache:
        """Planes for a MuseConfig: SWA rings on sliding layers, NoPE planes on full ones."""
        if max_context > config.context_length:
            raise ContextOverflow(
                f"max_context {max_context} exceeds the model's context_length {config.context_length}"
            )
        return cls(geometries(config.n_layers, config.swa_pattern, config.sliding_window, max_context,
                              config.n_kv_heads, config.head_dim, check_kv_dtype(dtype)), backend)

    # -- access --------------------------------------------------------------------------------
    @property
    def planes(self) -> tuple[KvPlane, ...]:
        return self._planes

    @property
    def n_layers(self) -> int:
        return len(self._planes)

    @property
    def dtype(self) -> str:
        return self.geometry[0].dtype

    @property
    def max_context(self) -> int:
        return self.geometry[0].max_context

    def plane(self, layer: int) -> KvPlane:
        if not 0 <= layer < len(self._planes):
            raise KvStateError(f"layer {layer} is outside [0, {len(self._planes)})")
        return self._planes[layer]

    @property
    def n_tokens(self) -> int:
        """Tokens every plane holds (planes agree between forward passes)."""
        ns = {p.next_position for p in self._planes}
        if len(ns) != 1:
            raise KvStateError(f"planes disagree on their next position: {sorted(ns)}")
        return ns.pop()

    def append(self, layer: int, position: int, keys: Any, values: Any) -> int:
        return self.plane(layer).append(position, keys, values)

    def append_batch(self, layer: int, start: int, keys: Any, values: Any) -> BatchPlacement:
        return self.plane(layer).append_batch(start, keys, values)

    def check_batch_all(self, start: int, count: int) -> None:
        """Refuse (typed error, nothing reserved) unless every plane takes rows [start, start + count)
        next: a step that reserves its layers in two calls checks them all before the first."""
        for p in self._planes:
            p._check_next(start, count)

    def reserve_batch_all(self, start: int, count: int, layers: range | None = None) -> list[BatchPlacement]:
        """reserve_batch(start, count) on every plane of `layers` (all by default), in layer order.
        Planes of one capacity in one state (all sliding planes, all full ones) get the same
        placement, computed once: a graph step's host bookkeeping is part of its decode time.
        The planes of the call are all checked first (a refusal reserves none of them)."""
        planes = self._planes if layers is None else self._planes[layers.start:layers.stop]
        for p in planes:
            p._check_next(start, count)
        shared: dict[tuple, tuple[tuple[int, int, int], BatchPlacement]] = {}
        out = []
        for p in planes:
            before = p.state()
            key = (p.capacity,) + before
            hit = shared.get(key)
            if hit is None:
                pl = p.reserve_batch(start, count)
                shared[key] = (p.state(), pl)
            else:
                pl = p.reserve_batch_as(start, count, before, hit[0], hit[1])
            out.append(pl)
        return out

    def view(self, layer: int, order: str = "logical") -> PlaneView:
        return self.plane(layer).view(order)

    # -- speculation ---------------------------------------------------------------------------
    def checkpoint(self, block: int = DEFAULT_BLOCK) -> KvCheckpoint:
        """Mark the current state; a later rollback may undo up to `block` appended rows."""
        if block < 1:
            raise KvStateError(f"checkpoint block must be >= 1, got {block}")
        saved: dict[int, _PlaneMark] = {}
        for pool in self._pools:
            self._save_pool(pool, block, saved)
        marks = []
        for i, p in enumerate(self._planes):
            m = saved.get(i)
            marks.append(_PlaneMark(p.epoch, p.appended, p.state(), _NO_SLOTS, None, None) if m is None else m)
        return KvCheckpoint(block, marks)

    def _save_pool(self, pool: _RingPool, block: int, saved: dict[int, _PlaneMark]) -> None:
        """Into `saved` (plane index -> mark): the live rows the next `block` appends overwrite on
        the rings of `pool`. Only a ring whose len + block exceeds its capacity loses rows, so
        before the window fills this reads nothing (host bookkeeping only). Rings in the most
        common state (all of them after reserve_batch_all) whose storage is still the pool's are
        read with one gather per K and V; any other ring alone."""
        planes = [self._planes[i] for i in pool.layers]
        cap = planes[0].capacity
        full = [j for j, p in enumerate(planes) if p.len and p.len + block > cap]
        if not full:
            return
        states = [planes[j].state() for j in full]
        shared = states[0] if states.count(states[0]) == len(states) else Counter(states).most_common(1)[0][0]
        together = [j for j, st in zip(full, states)
                    if st == shared and planes[j].keys is pool.key_views[j] and planes[j].values is pool.value_views[j]]
        if together:
            slots = _overwritten_slots(shared, cap, block)
            g = planes[0].geometry
            k = self.backend.read_pool_rows(pool.keys, slots, g.head_major, g.n_kv_heads, g.head_dim)
            v = self.backend.read_pool_rows(pool.values, slots, g.head_major, g.n_kv_heads, g.head_dim)
            for j in together:
                p = planes[j]
                saved[pool.layers[j]] = _PlaneMark(p.epoch, p.appended, shared, slots, k, v, j)
        for j, st in zip(full, states):
            if pool.layers[j] not in saved:
                p = planes[j]
                slots = _overwritten_slots(st, cap, block)
                saved[pool.layers[j]] = _PlaneMark(p.epoch, p.appended, st, slots, *p.read(slots))

    def _check_rollback(self, cp: KvCheckpoint, keep: int) -> None:
        if len(cp.marks) != len(self._planes):
            raise KvStateError(f"checkpoint has {len(cp.marks)} planes, the cache {len(self._planes)}")
        for p, m in zip(self._planes, cp.marks):
            if p.epoch != m.epoch:
                raise KvStateError(
                    f"layer {p.layer}: checkpoint at {cp.n_tokens} tokens belongs to an earlier cache "
                    "history (a rollback, restore or install happened since)"
                )
            since = p.appended - m.appended
            if not 0 <= keep <= since:
                raise KvStateError(
                    f"layer {p.layer}: cannot keep {keep} rows, {since} were appended since the checkpoint"
                )
            if p.geometry.sliding and since > cp.block:
                raise KvStateError(
                    f"layer {p.layer}: {since} rows were appended since the checkpoint, more than its "
                    f"block of {cp.block}; the overwritten ring rows are gone"
                )
            if p.geometry.sliding and keep and since > p.capacity:
                raise KvStateError(
                    f"layer {p.layer}: cannot keep {keep} of {since} rows on a ring of capacity "
                    f"{p.capacity}: later rows overwrote kept ones"
                )

    def rollback(self, cp: KvCheckpoint, keep: int = 0) -> None:
        """Return to `cp`, keeping the first `keep` rows appended since (an accepted prefix,
        book 10.6). All planes are checked before any is touched."""
        self._check_rollback(cp, keep)
        for p, m in zip(self._planes, cp.marks):
            p.len, p.origin_logical, p.origin_physical = m.state
            if keep:
                p.reserve_batch(p.next_position, keep)  # kept rows stay where they were written
            if m.slots.size:
                # Restore live rows the discarded appends overwrote: append i (i >= keep) wrote
                # slot (op + len + i) % cap in the checkpoint's frame.
                length, _, op = m.state
                i = (m.slots - op - length) % p.capacity
                lost = i >= keep
                if lost.any():
                    g = p.geometry
                    sel = np.flatnonzero(lost)
                    k, v = m.rows()
                    if len(sel) != len(m.slots):
                        k, v = k[sel], v[sel]
                    self.backend.write_rows(p.keys, m.slots[sel], k, g.head_major, g.n_kv_heads, g.head_dim)
                    self.backend.write_rows(p.values, m.slots[sel], v, g.head_major, g.n_kv_heads, g.head_dim)
            p.epoch = fresh_epoch()
            p.appended = keep
        # The checkpoint now describes the new history (so it can be rolled back to again).
        cp.marks = [
            _PlaneMark(p.epoch, 0, m.state, m.slots, m.keys, m.values, m.row) for p, m in zip(self._planes, cp.marks)
        ]

    # -- snapshot / restore --------------------------------------------------------------------
    @property
    def layouts(self) -> tuple[PlaneLayout, ...]:
        return tuple(g.layout for g in self.geometry)

    def snapshot(self, tokens: Sequence[int] | None = None) -> KvSnapshot:
        """Visible rows of every plane in logical order, with the origins (book 15.6);
        `tokens`, if given, are the ids of the n_tokens positions."""
        n = self.n_tokens
        planes = []
        for p in self._planes:
            view = p.view("logical")
            planes.append(PlaneSnapshot(p.geometry.layout, p.origin_logical, view.keys, view.values))
        ids = None if tokens is None else tuple(int(t) for t in tokens)
        return KvSnapshot(n, tuple(planes), ids)

    def check_snapshot(self, snap: KvSnapshot) -> None:
        """Refuse a snapshot that cannot install here, naming the field: plane count, per-plane
        layout, n_tokens against max_context, rows/origins that do not describe n_tokens."""
        if len(snap.planes) != len(self.geometry):
            raise KvStateError(f"snapshot has {len(snap.planes)} planes, the cache {len(self.geometry)}")
        if not 0 <= snap.n_tokens <= self.max_context:
            raise ContextOverflow(f"snapshot of {snap.n_tokens} tokens does not fit max_context {self.max_context}")
        for g, ps in zip(self.geometry, snap.planes):
            if ps.layout != g.layout:
                raise KvStateError(f"layer {g.layer}: snapshot layout {ps.layout} != cache layout {g.layout}")
            need = g.layout.rows_for(snap.n_tokens)
            if ps.origin_logical + ps.len != snap.n_tokens or ps.len < need:
                raise KvStateError(
                    f"layer {g.layer}: snapshot rows [{ps.origin_logical}, {ps.origin_logical + ps.len}) do "
                    f"not cover the last {need} of {snap.n_tokens} tokens"
                )

    def restore(self, snap: KvSnapshot) -> None:
        """Replace the live planes with `snap`, at the rotation a sequential build holds; the live
        cache is untouched unless the whole snapshot fits (built detached, swapped atomically).
        The slot size may differ from the snapshot's source: only the layouts must match."""
        self.check_snapshot(snap)
        install = self.begin_install(snap.n_tokens)
        for g, ps in zip(self.geometry, snap.planes):
            a, _ = install.expected(g.layer)
            if a < snap.n_tokens:
                f = a - ps.origin_logical  # rows before the ring's live window are not needed
                keys = ps.keys[f:] if f else ps.keys
                values = ps.values[f:] if f else ps.values
                install.put(g.layer, a, keys, values)
        self.commit(install)

    # -- detached install ----------------------------------------------------------------------
    def begin_install(self, n_tokens: int) -> DetachedInstall:
        return DetachedInstall(self, n_tokens)

    def commit(self, install: DetachedInstall) -> None:
        """Swap the installed planes in (one assignment); refuses an incomplete install."""
        if install.cache is not self:
            raise KvStateError("this install was begun on a different cache")
        if install.committed:
            raise KvStateError("this install was already committed")
        install.validate_complete()
        for p in install.planes:
            p.epoch, p.appended = fresh_epoch(), 0
        self._planes, self._pools = install.planes, install.pools
        install.committed = True


@dataclass
class DetachedInstall:
    """Planes holding `n_tokens` tokens, filled row range by row range beside the live cache."""

    cache: KvCache
    n_tokens: int
    planes: tuple[KvPlane, ...] = field(init=False)
    pools: tuple[_RingPool, ...] = field(init=False)
    committed: bool = field(default=False, init=False)
    _filled: list[np.ndarray] = field(init=False)

    def __post_init__(self) -> None:
        c = self.cache
        if not 0 <= self.n_tokens <= c.max_context:
            raise ContextOverflow(f"install of {self.n_tokens} tokens does not fit max_context {c.max_context}")
        self.planes, self.pools = _build_planes(c.geometry, c.backend)
        for p in self.planes:
            p.len = min(self.n_tokens, p.capacity)
            p.origin_logical = self.n_tokens - p.len
            p.origin_physical = p.origin_logical % p.capacity  # a sequential build's rotation
        self._filled = [np.zeros(p.len, dtype=bool) for p in self.planes]

    def stage(self, rows: Any) -> Any:
        """`rows` (any shape) on the planes' device in one copy, for put() to take views of."""
        return self.cache.backend.as_rows(rows)

    def expected(self, layer: int) -> tuple[int, int]:
        """The logical range [a, b) of rows layer `layer` must receive."""
        p = self.planes[layer]
        return p.origin_logical, p.next_position

    def put(self, layer: int, start: int, keys: Any, values: Any) -> None:
        """Write rows for logical positions [start, start + n) of one layer."""
        if self.committed:
            raise KvStateError("this install was already committed")
        if not 0 <= layer < len(self.planes):
            raise KvStateError(f"layer {layer} is outside [0, {len(self.planes)})")
        p = self.planes[layer]
        shape = self.cache.backend.rows_shape(keys)
        if len(shape) != 2 or shape[0] == 0:
            raise KvStateError(f"layer {layer}: install rows must be [n >= 1, kv_dim], got {list(shape)}")
        n = shape[0]
        a, b = self.expected(layer)
        if start < a or start + n > b:
            raise KvStateError(
                f"layer {layer}: rows [{start}, {start + n}) fall outside the expected range [{a}, {b})"
            )
        p._check_rows(keys, values, n)
        off = np.arange(start - a, start - a + n)
        if self._filled[layer][off].any():
            first = int(off[np.flatnonzero(self._filled[layer][off])[0]]) + a
            raise KvStateError(f"layer {layer}: position {first} was already installed")
        p._write(p.physical_of(np.arange(start, start + n, dtype=np.int64)), keys, values)
        self._filled[layer][off] = True

    def missing(self) -> dict[int, int]:
        return {p.layer: int((~f).sum()) for p, f in zip(self.planes, self._filled) if not f.all()}

    def validate_complete(self) -> None:
        miss = self.missing()
        if miss:
            layer = next(iter(miss))
            a, _ = self.expected(layer)
            first = a + int(np.flatnonzero(~self._filled[layer])[0])
            raise KvStateError(
                f"install incomplete: layer {layer} lacks {miss[layer]} rows (first missing position "
                f"{first}); {len(miss)} layer(s) incomplete"
            )
