"""CUDA graphs for the decode and verify shapes: the whole step, embedding -> softcapped logits,
captured once per (rows, output) shape and replayed (book 10.3: record the tape once, press play).

Everything that changes from step to step lives in device tensors the graph reads: token ids,
positions, each plane's (origin_logical, origin_physical, len, capacity) before the append, and
the ring/plane write slots reserved by muser.kv on the host. They travel in one pinned int64
buffer, one host->device copy per step; the only synchronisation is reading back the logits
(or, for greedy decode, the argmax and a finiteness flag). All intermediates come from the
graph's private pool: nothing is allocated on the hot path.

The first call of a shape runs the step eagerly (that is its real result), then captures it.
A graph bakes in the planes' storage addresses; after a detached install or restore swapped
new planes in, the next call re-captures.
"""

from __future__ import annotations

import numpy as np
import torch

from .kernels.attention import AttnScratch, attend_triton, pick_splits
from ..kv.torch_backend import TorchBackend


class _GraphKv:
    def __init__(self, g: "StepGraph"):
        self.g = g

    def attend(self, il: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        g, s = self.g, self.g.sess
        plane = s.cache.planes[il]
        geo = plane.geometry
        kq = k.to(s.kv_torch)
        vq = v.to(s.kv_torch)
        out = attend_triton(q, kq, vq, plane.keys, plane.values, geo.head_major, g.meta[il], g.pos0,
                            geo.window if geo.sliding else 0, s.cfg.attn_scale, g.scratch,
                            splits=g.splits[il])
        T = q.shape[0]
        TorchBackend.write_rows_at(plane.keys, g.widx[il], kq.view(T, geo.kv_dim), geo.head_major,
                                   geo.n_kv_heads, geo.head_dim)
        TorchBackend.write_rows_at(plane.values, g.widx[il], vq.view(T, geo.kv_dim), geo.head_major,
                                   geo.n_kv_heads, geo.head_dim)
        return out


class _StaticCapture(dict):
    """Copies captured layer inputs into static buffers inside the graph."""

    def __init__(self, bufs: dict[int, torch.Tensor]):
        super().__init__()
        self.bufs = bufs

    def __setitem__(self, il: int, h: torch.Tensor) -> None:
        self.bufs[il].copy_(h)


class StepGraph:
    def __init__(self, sess, T: int, out_rows: str):
        cfg = sess.cfg
        dev = sess.device
        L = cfg.n_layers
        self.sess, self.T, self.out_rows = sess, T, out_rows
        n = 2 * T + 4 * L + 1 + L * T
        self.cuda = dev.type == "cuda"  # elsewhere the same step runs without capture (tests)
        self.host = torch.zeros(n, dtype=torch.int64)
        if self.cuda:
            self.host = self.host.pin_memory()
        self.dev = torch.zeros(n, dtype=torch.int64, device=dev)
        o = 0
        self.tokens = self.dev[o:o + T]
        o += T
        self.positions = self.dev[o:o + T]
        o += T
        self.meta = self.dev[o:o + 4 * L].view(L, 4)
        o += 4 * L
        self.pos0 = self.dev[o:o + 1]
        o += 1
        self.widx = self.dev[o:o + L * T].view(L, T)
        R = T if out_rows == "all" else 1
        self.logits = torch.empty((R, cfg.vocab), dtype=torch.float32, device=dev)
        self.top = torch.empty((R,), dtype=torch.int64, device=dev)
        self.finite = torch.empty((), dtype=torch.bool, device=dev)
        self.captured = {il: torch.empty((T, cfg.hidden), dtype=torch.float32, device=dev)
                         for il in sess.capture_layers}
        self.splits = [pick_splits(p.capacity) for p in sess.cache.planes]
        self.scratch = AttnScratch(T, cfg.n_heads, cfg.head_dim, max(self.splits), dev)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.key: tuple | None = None
        self.copied = torch.cuda.Event() if self.cuda else None
        self.captures = 0

    def _storage_key(self) -> tuple:
        return tuple((p.keys.data_ptr(), p.values.data_ptr()) for p in self.sess.cache.planes)

    def _prepare(self, ids: np.ndarray) -> None:
        """Reserve this step's rows in every plane (host metadata, muser.kv) and upload."""
        s, T = self.sess, self.T
        p0 = s.n_past
        if self.copied is not None:
            self.copied.synchronize()  # the previous upload has left the pinned buffer
        h = self.host.numpy()
        L = s.cfg.n_layers
        o = 0
        h[o:o + T] = ids
        o += T
        h[o:o + T] = np.arange(p0, p0 + T)
        o += T
        for il, p in enumerate(s.cache.planes):
            h[o + 4 * il:o + 4 * il + 4] = (p.origin_logical, p.origin_physical, p.len, p.capacity)
        o += 4 * L
        h[o] = p0
        o += 1
        for il, p in enumerate(s.cache.planes):
            placement = p.reserve_batch(p0, T)
            assert placement.source_first == 0 and len(placement.physical) == T
            h[o + il * T:o + (il + 1) * T] = placement.physical
        self.dev.copy_(self.host, non_blocking=self.cuda)
        if self.copied is not None:
            self.copied.record()

    def _step(self) -> None:
        s = self.sess
        cap = _StaticCapture(self.captured) if self.captured else None
        s.fwd.run(self.tokens, self.positions, _GraphKv(self), self.out_rows, s.capture_layers, cap,
                  logits_out=self.logits)
        torch.argmax(self.logits, -1, out=self.top)  # first maximal index, like greedy's tie rule
        torch.all(torch.isfinite(self.logits), out=self.finite)

    def launch(self, ids: np.ndarray) -> None:
        """Prepare inputs and run the step (replay, or eager + capture on first use)."""
        self._prepare(ids)
        if not self.cuda:
            with torch.inference_mode():
                self._step()
            return
        key = self._storage_key()
        if self.graph is not None and key == self.key:
            self.graph.replay()
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.inference_mode():
            self._step()  # the real step for this call (also compiles the kernels)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), torch.inference_mode():
            self._step()  # recorded, not executed
        self.graph, self.key = graph, key
        self.captures += 1

    def run(self, ids: np.ndarray) -> torch.Tensor:
        self.launch(ids)
        return self.logits
