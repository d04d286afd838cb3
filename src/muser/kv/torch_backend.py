"""Device storage for the muser.kv planes: a torch `ArrayBackend` (book 15).

The ring arithmetic, checkpoints, snapshots and detached installs live once, in muser.kv; this
backend only allocates zero-filled torch tensors on the engine's device and moves rows (on the
CPU the tensors share numpy arrays, written by NumpyBackend's code on the calling thread). SWA
rings are token-major [capacity, kv_dim], views into one pool per K and V (zeros_pool); NoPE
planes head-major [n_kv, capacity, head_dim] (book 15.3). f32 -> f16 conversion rounds to nearest
even, like ggml_cpu_fp32_to_fp16 and numpy's astype, so the engine's f16 planes hold the oracle's
bits for the same f32 rows.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from . import KvCache
from .backend import NumpyBackend, ascending_run, check_kv_dtype, pool_stride

TORCH_KV = {"f16": torch.float16, "f32": torch.float32}
NP_KV = {"f16": np.float16, "f32": np.float32}
_HOST = NumpyBackend()  # CPU planes are numpy arrays under the tensors (see zeros)


_IDX_MEMO_ROWS = 64  # indices of at most this many slots are memoised (a checkpoint's block)
_IDX_MEMO_SIZE = 64  # distinct index sets kept


class TorchBackend:
    name = "torch"

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._memo: OrderedDict[bytes, torch.Tensor] = OrderedDict()

    def _idx(self, physical: np.ndarray) -> torch.Tensor:
        """Device int64 slot indices; a short recent set is reused (read-only tensors): the planes
        of one geometry share their next slots, so a checkpoint copies its index once, not once
        per plane and per K and V (each copy is a host-to-device round trip)."""
        a = np.ascontiguousarray(physical, dtype=np.int64)
        if a.size > _IDX_MEMO_ROWS:
            return torch.from_numpy(a).to(self.device)
        key = a.tobytes()
        t = self._memo.get(key)
        if t is None:
            t = self._memo[key] = torch.from_numpy(a.copy()).to(self.device)
            while len(self._memo) > _IDX_MEMO_SIZE:  # oldest first; another thread may pop too
                try:
                    self._memo.popitem(last=False)
                except KeyError:
                    break
        return t

    def zeros(self, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
        if self.device.type == "cpu":
            # calloc'd pages the kernel zeroes on first touch: no fill pass and no intra-op
            # parallel region (a 2-core machine under load stalled ~5 ms in each torch.zeros)
            return torch.from_numpy(np.zeros(shape, dtype=NP_KV[check_kv_dtype(dtype)]))
        return torch.zeros(shape, dtype=TORCH_KV[check_kv_dtype(dtype)], device=self.device)

    def zeros_pool(self, n: int, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
        numel = int(np.prod(shape))
        flat = self.zeros((n, pool_stride(numel, np.dtype(NP_KV[check_kv_dtype(dtype)]).itemsize)), dtype)
        return flat[:, :numel].view((n, *shape))

    def as_rows(self, rows: Any) -> torch.Tensor:
        if isinstance(rows, torch.Tensor):
            return rows.to(self.device)
        return torch.from_numpy(np.ascontiguousarray(rows)).to(self.device)

    def write_rows(self, plane: torch.Tensor, physical: np.ndarray, rows: Any, head_major: bool,
                   n_kv_heads: int, head_dim: int) -> None:
        if len(physical) == 0:
            return
        if plane.device.type == "cpu":
            # numpy's copy on this thread: torch's copy_ opens an intra-op parallel region per
            # write, which stalled as long as the zeros above on a loaded machine
            host = rows.detach().numpy() if isinstance(rows, torch.Tensor) else rows
            _HOST.write_rows(plane.numpy(), physical, host, head_major, n_kv_heads, head_dim)
            return
        # one ascending run of slots: a slice copy, no index tensor (whose host-to-device copy
        # would wait for the stream, once per write)
        a = ascending_run(physical)
        if a is not None:
            r = self.as_rows(rows).to(plane.dtype).reshape(-1, n_kv_heads, head_dim)
            if head_major:
                plane[:, a:a + len(physical)].copy_(r.transpose(0, 1))
            else:
                plane[a:a + len(physical)].copy_(r.view(-1, n_kv_heads * head_dim))
            return
        idx = self._idx(physical)
        self.write_rows_at(plane, idx, self.as_rows(rows), head_major, n_kv_heads, head_dim)

    @staticmethod
    def write_rows_at(plane: torch.Tensor, idx: torch.Tensor, rows: torch.Tensor, head_major: bool,
                      n_kv_heads: int, head_dim: int) -> None:
        """Store rows [n, kv_dim] at device slot indices idx [n] (graph-capturable)."""
        r = rows.to(plane.dtype)  # RNE f32 -> f16
        if head_major:
            plane.index_copy_(1, idx, r.reshape(-1, n_kv_heads, head_dim).transpose(0, 1))
        else:
            plane.index_copy_(0, idx, r.reshape(-1, n_kv_heads * head_dim))

    def read_rows(self, plane: torch.Tensor, physical: np.ndarray, head_major: bool,
                  n_kv_heads: int, head_dim: int) -> torch.Tensor:
        if len(physical) == 0:  # (a checkpoint of a ring that is not full yet): no device work
            return torch.empty((0, n_kv_heads * head_dim), dtype=plane.dtype, device=plane.device)
        a = ascending_run(physical) if plane.device.type == "cpu" else None
        if a is not None:  # CPU, one ascending run: a slice copy
            n = len(physical)
            if head_major:  # a fresh array: with one KV head a reshape would be a view of the plane
                out = torch.empty((n, n_kv_heads * head_dim), dtype=plane.dtype)
                out.view(n, n_kv_heads, head_dim).copy_(plane[:, a:a + n].transpose(0, 1))
                return out
            return plane[a:a + n].clone()
        idx = self._idx(physical)
        if head_major:
            return plane.index_select(1, idx).transpose(0, 1).reshape(len(physical), n_kv_heads * head_dim)
        return plane.index_select(0, idx)

    def read_pool_rows(self, pool: torch.Tensor, physical: np.ndarray, head_major: bool,
                       n_kv_heads: int, head_dim: int) -> torch.Tensor:
        if pool.device.type == "cpu":  # numpy on this thread, like write_rows
            return torch.from_numpy(_HOST.read_pool_rows(pool.numpy(), physical, head_major, n_kv_heads, head_dim))
        n, s = pool.shape[0], len(physical)
        a = ascending_run(physical)
        if a is not None:
            # one ascending run (every block-1 checkpoint): one copy, no index upload
            out = torch.empty((n, s, n_kv_heads * head_dim), dtype=pool.dtype, device=pool.device)
            if head_major:
                out.view(n, s, n_kv_heads, head_dim).copy_(pool[:, :, a:a + s].transpose(1, 2))
            else:
                out.copy_(pool[:, a:a + s])
            return out
        idx = self._idx(physical)
        if head_major:  # [n, H, s, D] -> [n, s, H*D]
            return pool.index_select(2, idx).transpose(1, 2).reshape(n, s, n_kv_heads * head_dim)
        return pool.index_select(1, idx)

    def rows_shape(self, rows: Any) -> tuple[int, ...]:
        return tuple(rows.shape)

    def round_to(self, rows: Any, dtype: str) -> torch.Tensor:
        r = self.as_rows(rows).to(torch.float32)
        return r.to(TORCH_KV[check_kv_dtype(dtype)]).to(torch.float32)


def device_cache(config, max_context: int, dtype: str, device: torch.device | str) -> KvCache:
    """KvCache for a MuseConfig with torch planes on `device` (exact capacity formula of muser.kv)."""
    return KvCache.for_config(config, max_context, dtype=dtype, backend=TorchBackend(device))


def resident_bytes(cache: KvCache) -> int:
    """Bytes the planes hold on the device (K and V of every layer)."""
    return sum(p.keys.numel() * p.keys.element_size() + p.values.numel() * p.values.element_size()
               for p in cache.planes)
