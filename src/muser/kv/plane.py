"""One layer's KV plane: a SWA ring (token-major) or a growing NoPE plane (head-major), book 15.

The plane never derives a physical row from an absolute position (book 15.2): it carries
`origin_logical` (the logical position at the front of the live window) and `origin_physical`
(the slot that position occupies), and every placement is

    physical = (origin_physical + logical - origin_logical) % capacity        (book 15.4)

`reserve` / `reserve_batch` are the metadata half of book 15.5's append / append_batch (what the
engine needs before launching its own store kernel); `append` / `append_batch` reserve and write.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import CacheDiscontinuity, ContextOverflow, EmptyInput, KvStateError
from .backend import ArrayBackend, check_kv_dtype

_EPOCHS = itertools.count(1)


def fresh_epoch() -> int:
    """A history id no plane has used: checkpoints are only valid inside their own history."""
    return next(_EPOCHS)


@dataclass(frozen=True)
class PlaneLayout:
    """What a plane's rows mean, independent of the slot size: a snapshot or a stored tile of
    this layout installs into any plane with the same layout and enough capacity."""

    layer: int
    sliding: bool  # SWA ring (RoPE layer, rows position-bound) vs NoPE plane (rows position-free)
    window: int  # sliding_window W; 0 for full planes
    n_kv_heads: int
    head_dim: int
    dtype: str  # "f16" | "f32"

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def rows_for(self, n_tokens: int) -> int:
        """Rows a plane of this layout holds after `n_tokens` sequential appends: the last
        min(n, W) on a ring, all n on a NoPE plane (in any slot size that fits n_tokens)."""
        return min(n_tokens, self.window) if self.sliding else n_tokens


@dataclass(frozen=True)
class PlaneGeometry:
    layer: int
    sliding: bool  # SWA ring (RoPE layer) vs growing NoPE plane
    window: int  # sliding_window W (attention rule p1 - p0 < W); unused for full planes
    max_context: int
    capacity: int  # min(max_context, W) for rings, max_context for full planes (book 15.2)
    n_kv_heads: int
    head_dim: int
    dtype: str  # "f16" | "f32"

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def layout(self) -> PlaneLayout:
        """The slot-size-independent part (everything but max_context and capacity)."""
        return PlaneLayout(self.layer, self.sliding, self.window if self.sliding else 0,
                           self.n_kv_heads, self.head_dim, self.dtype)

    @property
    def head_major(self) -> bool:
        # NoPE planes are head-major, SWA rings token-major (book 15.3)
        return not self.sliding

    @property
    def shape(self) -> tuple[int, ...]:
        if self.head_major:
            return (self.n_kv_heads, self.capacity, self.head_dim)  # [H, capacity, D]
        return (self.capacity, self.kv_dim)  # [capacity, H*D]

    @classmethod
    def build(cls, layer: int, sliding: bool, window: int, max_context: int, n_kv_heads: int,
              head_dim: int, dtype: str) -> PlaneGeometry:
        if max_context <= 0:
            raise ContextOverflow(f"max_context must be positive, got {max_context}")
        if sliding and window <= 0:
            raise KvStateError(f"layer {layer}: sliding window must be positive, got {window}")
        cap = min(max_context, window) if sliding else max_context
        return cls(layer, sliding, window, max_context, cap, n_kv_heads, head_dim, check_kv_dtype(dtype))


@dataclass(frozen=True)
class BatchPlacement:
    """Where an append_batch lands: source rows [source_first, count) survive, at `physical`."""

    start: int  # logical position of source row 0
    count: int  # rows in the batch
    source_first: int  # first source row still live after the batch (earlier ones were overwritten)
    physical: np.ndarray  # int64 [count - source_first] slots of the live source rows


@dataclass(frozen=True)
class PlaneView:
    """Visible rows of one plane with their logical positions (token-major, plane element type)."""

    keys: Any  # [n, kv_dim]
    values: Any  # [n, kv_dim]
    positions: np.ndarray  # int64 [n]


class KvPlane:
    def __init__(self, geometry: PlaneGeometry, backend: ArrayBackend, keys: Any = None, values: Any = None):
        """`keys` / `values`: zero-filled storage of `geometry.shape` to use (a view into a ring
        pool, KvCache); allocated here when not given."""
        self.geometry = geometry
        self.backend = backend
        # zero-filled on purpose (15.2)
        self.keys = backend.zeros(geometry.shape, geometry.dtype) if keys is None else keys
        self.values = backend.zeros(geometry.shape, geometry.dtype) if values is None else values
        self.len = 0
        self.origin_logical = 0
        self.origin_physical = 0
        self.epoch = fresh_epoch()  # history id (rollback/restore/install start a new one)
        self.appended = 0  # rows appended within this epoch

    # -- metadata ------------------------------------------------------------------------------
    @property
    def layer(self) -> int:
        return self.geometry.layer

    @property
    def capacity(self) -> int:
        return self.geometry.capacity

    @property
    def next_position(self) -> int:
        """The only position the next append accepts (book 15.5)."""
        return self.origin_logical + self.len

    def state(self) -> tuple[int, int, int]:
        return (self.len, self.origin_logical, self.origin_physical)

    def physical_of(self, logical: np.ndarray | int) -> np.ndarray:
        """Slots of visible logical positions (explicit-origin translation, book 15.4)."""
        lg = np.asarray(logical, dtype=np.int64)
        if lg.size and (lg.min() < self.origin_logical or lg.max() >= self.next_position):
            raise KvStateError(
                f"layer {self.layer}: positions [{int(lg.min())}, {int(lg.max())}] are outside the "
                f"visible range [{self.origin_logical}, {self.next_position})"
            )
        return (self.origin_physical + lg - self.origin_logical) % self.capacity

    def _check_next(self, position: int, count: int) -> None:
        if count <= 0:
            raise EmptyInput(f"layer {self.layer}: an append needs at least one row, got {count}")
        expected = self.next_position
        if position != expected:
            raise CacheDiscontinuity(self.layer, expected, position)
        if position + count > self.geometry.max_context:
            raise ContextOverflow(
                f"layer {self.layer}: positions [{position}, {position + count}) run past "
                f"max_context {self.geometry.max_context}"
            )

    def _check_rows(self, keys: Any, values: Any, count: int) -> None:
        want = (count, self.geometry.kv_dim)
        for what, rows in (("keys", keys), ("values", values)):
            got = self.backend.rows_shape(rows)
            if got != want:
                raise KvStateError(f"layer {self.layer}: {what} have shape {list(got)}, expected {list(want)}")

    def reserve(self, position: int) -> int:
        """Reserve the physical row for `position` and advance the explicit ring metadata
        (book 15.5 append): returns the slot the store writes."""
        self._check_next(position, 1)
        if self.len < self.capacity:
            write = (self.origin_physical + self.len) % self.capacity
            self.len += 1
        else:  # full ring: overwrite the oldest row, the window slides by one
            write = self.origin_physical
            self.origin_logical += 1
            self.origin_physical = (self.origin_physical + 1) % self.capacity
        self.appended += 1
        return write

    def reserve_batch(self, start: int, count: int) -> BatchPlacement:
        """Chunked reserve (book 15.5 append_batch): the state afterwards equals `count` single
        reserves; only the source rows still live afterwards get a slot (each slot once)."""
        self._check_next(start, count)
        cap = self.capacity
        # Placement uses the origins before the batch: (op - ol) mod cap is invariant as it slides.
        op, ol = self.origin_physical, self.origin_logical
        total = self.len + count
        if total <= cap:
            self.len = total
        else:
            advance = total - cap
            self.len = cap
            self.origin_logical = ol + advance
            self.origin_physical = (op + advance) % cap
        first = max(0, self.origin_logical - start)
        logical = np.arange(start + first, start + count, dtype=np.int64)
        self.appended += count
        return BatchPlacement(start, count, first, (op + logical - ol) % cap)

    def reserve_batch_as(self, start: int, count: int, before: tuple[int, int, int], after: tuple[int, int, int],
                         placement: BatchPlacement) -> BatchPlacement:
        """reserve_batch(start, count) for a plane in state `before` whose result another plane of
        the same capacity computed (`placement`, its state `after`): the same checks and state
        change without the arithmetic again (KvCache.reserve_batch_all)."""
        if self.state() != before:
            raise KvStateError(f"layer {self.layer}: state {self.state()} is not the shared reserve's {before}")
        self._check_next(start, count)
        self.len, self.origin_logical, self.origin_physical = after
        self.appended += count
        return placement

    # -- rows ----------------------------------------------------------------------------------
    def append(self, position: int, keys: Any, values: Any) -> int:
        """Reserve and store one token's K/V rows ([1, kv_dim] each)."""
        self._check_rows(keys, values, 1)
        write = self.reserve(position)
        slot = np.array([write], dtype=np.int64)
        self._write(slot, keys, values)
        return write

    def append_batch(self, start: int, keys: Any, values: Any) -> BatchPlacement:
        """Reserve and store a chunk of rows ([count, kv_dim] each) starting at `start`."""
        count = self.backend.rows_shape(keys)[0] if len(self.backend.rows_shape(keys)) == 2 else -1
        if count < 0:
            raise KvStateError(f"layer {self.layer}: keys must be 2-D [count, kv_dim]")
        self._check_next(start, count)
        self._check_rows(keys, values, count)
        placement = self.reserve_batch(start, count)
        if placement.physical.size:
            f = placement.source_first
            self._write(placement.physical, keys[f:], values[f:])
        return placement

    def _write(self, physical: np.ndarray, keys: Any, values: Any) -> None:
        g = self.geometry
        self.backend.write_rows(self.keys, physical, keys, g.head_major, g.n_kv_heads, g.head_dim)
        self.backend.write_rows(self.values, physical, values, g.head_major, g.n_kv_heads, g.head_dim)

    def read(self, physical: np.ndarray) -> tuple[Any, Any]:
        g = self.geometry
        return (self.backend.read_rows(self.keys, physical, g.head_major, g.n_kv_heads, g.head_dim),
                self.backend.read_rows(self.values, physical, g.head_major, g.n_kv_heads, g.head_dim))

    def view(self, order: str = "logical") -> PlaneView:
        """The visible K/V rows and their logical positions: in logical order, or in physical
        scan order (which is numerically observable for order-sensitive kernels, book 15.6)."""
        if order == "logical":
            positions = np.arange(self.origin_logical, self.next_position, dtype=np.int64)
            physical = self.physical_of(positions)
        elif order == "physical":
            # the live slots in ascending slot order (all of them once the ring is full)
            physical = np.sort((self.origin_physical + np.arange(self.len, dtype=np.int64)) % self.capacity)
            positions = self.origin_logical + (physical - self.origin_physical) % self.capacity
        else:
            raise KvStateError(f"view order must be 'logical' or 'physical', got {order!r}")
        k, v = self.read(physical)
        return PlaneView(k, v, positions)
