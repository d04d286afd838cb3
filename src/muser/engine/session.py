"""A sequence on the engine: chunked prefill, decode, verify, checkpoints, installs (book 10).

The protocol (validation before any work, transactions that roll the KV back on any failure,
non-finite logits refused: book 10.9) is muser.sequence's, shared with the oracle. Each chunk
is one Engine.step forward (engine/step.py) with this session as its only item.

Prefill streams the prompt through 512-row chunks, 64 when decoders are waiting (book 10.10);
in the exact and fast lanes results do not depend on the chunking at all (row invariance:
engine/lanes.py). On CUDA, decode (1 row), verify and prompts of <= 16 rows run as captured CUDA
graphs shared by every session of the engine (engine/graphs.py); longer prefill chunks run eagerly.
prefill_row / decode_row leave the next-token logits on the device (engine/rows.py) for the
sampler to reduce there (muser.sample.candidates).
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
import torch

from ..errors import LaneError, NonFiniteLogits
from ..kv.torch_backend import TORCH_KV, device_cache, resident_bytes
from ..sequence import (
    MAX_VERIFY,
    WAITING_CHUNK,
    Sequence,
    SessionCheckpoint,
    check_chunk,
    check_max_context,
    first_non_finite,
    non_finite_error,
)
from .forward import Forward
from .kernels.attention import AttnScratch, attend_ref, attend_triton, plane_meta_of, scratch_units
from .rows import DeviceRow

PREFILL_CHUNK = 512  # PREFILL_BATCH_TOKENS (book 10.10)

__all__ = ["MAX_VERIFY", "PREFILL_CHUNK", "WAITING_CHUNK", "Session", "SessionCheckpoint"]


class _EagerKv:
    """Attend over each plane with host metadata, then append the chunk's rows (muser.kv)."""

    def __init__(self, sess: "Session", p0: int, T: int):
        self.s, self.p0, self.T = sess, p0, T
        self.f16ops = sess.fwd.f16_attention and sess.kv_torch == torch.float16
        self.cuda = sess.device.type == "cuda"
        if self.cuda:
            meta = np.array([plane_meta_of(p) for p in sess.cache.planes], dtype=np.int64)
            self.meta = torch.from_numpy(meta).to(sess.device)
            self.pos = torch.tensor([p0], dtype=torch.int64, device=sess.device)
            self.scratch = sess._scratch()

    def attend(self, il: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        s, cfg = self.s, self.s.cfg
        plane = s.cache.planes[il]
        g = plane.geometry
        kq = k.to(s.kv_torch)  # rounded like the store (llama.cpp reads the cache back)
        vq = v.to(s.kv_torch).contiguous()  # v may be a row slice of a wider output (KvStep)
        window = g.window if g.sliding else 0
        if self.cuda:
            out = attend_triton(q, kq, vq, g.head_major, self.meta[il], self.pos, window, cfg.attn_scale,
                                self.scratch, rows_bound=plane.len, f16_operands=self.f16ops)
        elif s.device.type == "cpu":  # the C kernel: fixed order per row, any T (row-invariant)
            from .kernels import cpu_native

            out = cpu_native.attend(q, kq, vq, plane.keys, plane.values, g.head_major, plane.origin_logical,
                                    plane.origin_physical, plane.len, plane.capacity, self.p0, window,
                                    cfg.attn_scale, f16_operands=self.f16ops)
        else:
            out = attend_ref(q, kq, vq, plane.keys, plane.values, g.head_major, plane.origin_logical,
                             plane.origin_physical, plane.len, plane.capacity, self.p0, window,
                             cfg.attn_scale, f16_operands=self.f16ops)
        s.cache.append_batch(il, self.p0, kq.view(self.T, g.kv_dim), vq.view(self.T, g.kv_dim))
        return out


class Session(Sequence):
    """The oracle's session surface (muser.sequence): prefill / decode / verify / checkpoint /
    rollback / snapshot / restore / installs / captured, plus decode_greedy."""

    def __init__(self, engine, max_context: int, chunk: int = PREFILL_CHUNK, capture: Iterable[int] = (),
                 graphs: bool | None = None):
        cfg = engine.cfg
        max_context = check_max_context(max_context, cfg.context_length)
        chunk = check_chunk(chunk)
        self.engine = engine
        self.cfg = cfg
        self.fwd: Forward = engine.forward
        self.device = engine.device
        self.kv_dtype = engine.kv
        self.kv_torch = TORCH_KV[engine.kv]
        self._init_seq(device_cache(cfg, max_context, engine.kv, self.device), cfg.vocab, cfg.n_layers,
                       max_context, chunk, capture)
        self.use_graphs = (self.device.type == "cuda") if graphs is None else bool(graphs)
        if self.use_graphs and self.device.type != "cuda":
            raise LaneError("CUDA graphs need device 'cuda'")
        self._graphs: dict = {}  # (rows, output) -> the engine's StepGraph this session ran alone
        self._attn_scratch: AttnScratch | None = None
        # (planes tuple, int64 [L, 3] capacity and K/V addresses) for the step graphs (graphs.plane_storage)
        self._graph_storage: tuple | None = None
        self._finite: torch.Tensor | None = None  # [1] bool: the last forward's logits all finite (step.finite_flags)

    @property
    def kv_bytes(self) -> int:
        return resident_bytes(self.cache)

    # -- forward -------------------------------------------------------------------------------
    def _scratch(self) -> AttnScratch:
        """Attention partials for a verify block (MAX_VERIFY rows) at any position and for a prefill
        chunk over an empty cache in one launch a pass (kernels/attention.scratch_units), allocated
        once per session; chunks deeper in the context run through it in groups of rows
        (attention.row_groups). Why a chunk's worth: the eager step is launch-bound, and in groups
        of MAX_VERIFY-sized scratch a 512-row chunk took 5,356 attention launches (bench/NOTES.md,
        "... prefill's attention in one launch a pass"). Full geometry, 512 rows: 4,608 units, 78 MB."""
        if self._attn_scratch is None:
            chunk = min(self.chunk, self.max_context)
            units = max(scratch_units(MAX_VERIFY, chunk, p.capacity, p.geometry.window if p.geometry.sliding else 0)
                        for p in self.cache.planes)
            rows = max(MAX_VERIFY, chunk)
            self._attn_scratch = AttnScratch(rows, self.cfg.n_heads, self.cfg.head_dim, -(-units // rows),
                                             self.device)
        return self._attn_scratch

    def _graph_ok(self, T: int, out_rows: str, capture: tuple[int, ...]) -> bool:
        return (self.use_graphs and T <= MAX_VERIFY and out_rows in ("last", "all")
                and capture == self.capture_layers
                and T <= min(p.capacity for p in self.cache.planes))

    @property
    def graph_context(self) -> int:
        """The context bound of the step graphs this session's steps replay (graphs.graph_context)."""
        from .graphs import graph_context

        return graph_context(self.max_context, self.cfg.context_length)

    def _graph(self, T: int, out_rows: str):
        """The engine's graph for this session alone with T rows (recorded in `_graphs`)."""
        g = self.engine.graph(((T, out_rows, self.graph_context),), self.capture_layers)
        self._graphs[(T, out_rows)] = g
        return g

    def _forward(self, ids: np.ndarray, rows: str,
                 capture: tuple[int, ...]) -> tuple[np.ndarray | None, dict[int, np.ndarray]]:
        from .step import StepWork, finite_flags, host_rows, run_rows

        (lg, cap), = run_rows(self.engine, [StepWork(self, ids, rows, capture)])
        with torch.inference_mode():
            self._finite = finite_flags([lg])  # before the copy; read once it has synchronized
        return host_rows(lg), cap

    def _rows_finite(self) -> bool:
        """The last forward's finiteness flag (step.finite_flags); unknown before any forward."""
        return self._finite is not None and bool(self._finite)

    # -- public calls beyond the protocol ------------------------------------------------------
    def prefill_row(self, ids, decoders_waiting: bool = False) -> DeviceRow | np.ndarray:
        """prefill(ids) with the last row's logits left on the device when the session runs on
        CUDA (a DeviceRow, engine/rows.py); elsewhere prefill(ids) itself."""
        if self.device.type != "cuda":
            return self.prefill(ids, decoders_waiting=decoders_waiting)
        a = self.check(ids, "prefill")
        return self._row_call(a, min(self.chunk, WAITING_CHUNK) if decoders_waiting else self.chunk)

    def decode_row(self, token) -> DeviceRow | np.ndarray:
        """decode(token) with the logits left on the device when the session runs on CUDA (a
        DeviceRow); elsewhere decode(token) itself."""
        if self.device.type != "cuda":
            return self.decode(token)
        return self._row_call(self.check(token, "decode"), 1)

    def _row_call(self, ids: np.ndarray, chunk: int) -> DeviceRow:
        """ids through chunks of <= chunk rows as one transaction; the last row's logits copied
        on the device with their finiteness flag (read with the row's first readback, which
        rolls this call back when the row is not finite)."""
        from .step import StepWork, finite_flags, run_rows

        n0 = self.n_past
        lg = None
        cp = self.cache.checkpoint(block=max(1, len(ids)))
        parts: list[dict[int, np.ndarray]] = []
        try:
            for c0 in range(0, len(ids), chunk):
                c1 = min(len(ids), c0 + chunk)
                rows = "last" if c1 == len(ids) else "none"
                (lg, cap), = run_rows(self.engine, [StepWork(self, ids[c0:c1], rows, self.capture_layers)])
                parts.append(cap)
            assert lg is not None
            with torch.inference_mode():
                row = lg[-1].clone()  # [vocab]; a graph's buffer is overwritten by its next replay
                flag = finite_flags([row])
                assert flag is not None
                finite = flag[0]
        except BaseException:
            self.cache.rollback(cp)
            raise
        self.captured = {il: np.concatenate([p[il] for p in parts], 0) for il in self.capture_layers}
        self.logits = None  # the row stays on the device

        def fail(host: np.ndarray) -> NonFiniteLogits:
            self.cache.rollback(cp)
            self.logits = None
            bad = first_non_finite(host[None])
            assert bad is not None
            return non_finite_error(host[None], bad, 0, len(ids) - 1, n0)

        return DeviceRow(row, finite, fail)

    def decode_greedy(self, token, position: int | None = None) -> int:
        """decode(token) and its argmax (first maximal index). On CUDA graphs only the argmax
        and a finiteness flag are read back, not the vocabulary row."""
        a = self.check(token, "decode", position)
        if not self._graph_ok(1, "last", self.capture_layers):
            return int(np.argmax(self._call(a, 1, False, self.capture_layers)[-1]))
        cp = self.cache.checkpoint(block=1)
        g = self._graph(1, "last")
        try:
            g.launch([self], [a])
            top, ok = int(g.top[0]), bool(g.finite)  # the one readback
            if not ok:
                raise NonFiniteLogits(f"non-finite logits at item 0, row 0: no distribution installed "
                                      f"(book 10.9); KV rolled back to {cp.n_tokens} tokens")
        except BaseException:
            self.cache.rollback(cp)
            raise
        from .step import host_captures

        self.captured = host_captures(g.captured)
        self.logits = None  # the row stayed on the device
        return top
