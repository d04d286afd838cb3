"""Storage backends for the KV planes: the only code that touches the arrays.

A plane keeps its metadata (capacity, len, explicit origins) as plain Python ints and hands every
array operation to an `ArrayBackend`. `NumpyBackend` serves the CPU oracle; the engine supplies a
torch backend with the same five methods, so the ring arithmetic (book 15.5) exists exactly once.

Physical row indices always arrive as host int64 numpy arrays (the metadata lives on the host);
a device backend converts them itself. Rows cross the boundary token-major, ``[n, kv_dim]`` with
each token row laid out head by head (KV head 0's head_dim values, then head 1's, ...), whatever
the plane's own layout (book 15.3, Figure 15.1).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..errors import KvStateError

# The K/V element types a plane may hold (book 15.8: f16 is the live type; f32 for exact lanes).
KV_DTYPES = ("f16", "f32")


def check_kv_dtype(dtype: str) -> str:
    if dtype not in KV_DTYPES:
        raise KvStateError(f"KV dtype {dtype!r} is not one of {', '.join(KV_DTYPES)}")
    return dtype


@runtime_checkable
class ArrayBackend(Protocol):
    """What a KV plane needs from an array library."""

    name: str

    def zeros(self, shape: tuple[int, ...], dtype: str) -> Any:
        """A zero-filled array (wrapped ring rows never expose stale storage, book 15.2)."""

    def zeros_pool(self, n: int, shape: tuple[int, ...], dtype: str) -> Any:
        """n zero-filled planes of `shape` in one allocation, as an array [n, *shape] whose
        [j] is plane j's storage (each plane starts on a POOL_ALIGN-byte boundary)."""

    def write_rows(self, plane: Any, physical: np.ndarray, rows: Any, head_major: bool,
                   n_kv_heads: int, head_dim: int) -> None:
        """Store token-major rows [n, kv_dim] at the given physical slots, converting to the plane's
        element type (f32 -> f16 rounds to nearest even, like ggml_cpu_fp32_to_fp16)."""

    def read_rows(self, plane: Any, physical: np.ndarray, head_major: bool,
                  n_kv_heads: int, head_dim: int) -> Any:
        """A token-major copy [n, kv_dim] of the rows at the given physical slots, in the plane's
        element type."""

    def read_pool_rows(self, pool: Any, physical: np.ndarray, head_major: bool,
                       n_kv_heads: int, head_dim: int) -> Any:
        """read_rows at the same slots of every plane of a zeros_pool array, in one gather: a
        token-major copy [n, len(physical), kv_dim]."""

    def rows_shape(self, rows: Any) -> tuple[int, ...]:
        """Shape of a rows argument (validated before any mutation)."""

    def as_rows(self, rows: Any) -> Any:
        """`rows` as an array of this backend on the planes' device (one copy when it is not
        there already; views of the result are rows write_rows takes without another copy)."""

    def round_to(self, rows: Any, dtype: str) -> Any:
        """The values `rows` would hold after a round trip through a plane of `dtype`."""


_NP_DTYPES = {"f16": np.float16, "f32": np.float32}

# Pooled planes start on this byte boundary, as separate allocations would (kernels specialise on
# pointer alignment).
POOL_ALIGN = 256


def pool_stride(numel: int, itemsize: int) -> int:
    """Elements between consecutive planes of a pool: numel rounded up to POOL_ALIGN bytes."""
    per = max(1, POOL_ALIGN // itemsize)
    return -(-numel // per) * per


def ascending_run(physical: np.ndarray) -> int | None:
    """First slot when `physical` (non-empty) is one ascending run of slots, else None: such a
    write or read is a slice copy, no gather or scatter by index."""
    a = int(physical[0])
    n = len(physical)
    if n > 1 and not (int(physical[-1]) == a + n - 1 and bool((np.diff(physical) == 1).all())):
        return None
    return a


class NumpyBackend:
    """Host numpy storage: token-major planes are [capacity, kv_dim], head-major planes
    [n_kv_heads, capacity, head_dim] (book 15.3)."""

    name = "numpy"

    def zeros(self, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        return np.zeros(shape, dtype=_NP_DTYPES[check_kv_dtype(dtype)])

    def zeros_pool(self, n: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        numel = int(np.prod(shape))
        dt = np.dtype(_NP_DTYPES[check_kv_dtype(dtype)])
        flat = np.zeros((n, pool_stride(numel, dt.itemsize)), dtype=dt)
        return flat[:, :numel].reshape((n, *shape), copy=False)

    def write_rows(self, plane: np.ndarray, physical: np.ndarray, rows: Any, head_major: bool,
                   n_kv_heads: int, head_dim: int) -> None:
        if len(physical) == 0:
            return
        r = np.asarray(rows).astype(plane.dtype, copy=False)  # [n, kv_dim]; astype rounds RNE
        a = ascending_run(physical)
        slots = physical if a is None else slice(a, a + len(physical))
        if head_major:
            # [n, H, D] -> [H, n, D]: each KV head's history is one contiguous span
            plane[:, slots, :] = r.reshape(len(physical), n_kv_heads, head_dim).transpose(1, 0, 2)
        else:
            plane[slots] = r

    def read_rows(self, plane: np.ndarray, physical: np.ndarray, head_major: bool,
                  n_kv_heads: int, head_dim: int) -> np.ndarray:
        if head_major:
            # [H, n, D] -> [n, H*D]
            return plane[:, physical, :].transpose(1, 0, 2).reshape(len(physical), n_kv_heads * head_dim)
        return plane[physical].copy()

    def read_pool_rows(self, pool: np.ndarray, physical: np.ndarray, head_major: bool,
                       n_kv_heads: int, head_dim: int) -> np.ndarray:
        # indexing by an array always copies: the saved rows never alias the live planes
        idx = np.asarray(physical, dtype=np.int64)
        if head_major:
            # [n, H, s, D] -> [n, s, H*D]
            return pool[:, :, idx, :].transpose(0, 2, 1, 3).reshape(pool.shape[0], len(idx), n_kv_heads * head_dim)
        return pool[:, idx]

    def rows_shape(self, rows: Any) -> tuple[int, ...]:
        return tuple(np.shape(rows))

    def as_rows(self, rows: Any) -> np.ndarray:
        return np.asarray(rows)

    def round_to(self, rows: Any, dtype: str) -> np.ndarray:
        r = np.asarray(rows, dtype=np.float32)
        if check_kv_dtype(dtype) == "f16":
            return r.astype(np.float16).astype(np.float32)
        return r
