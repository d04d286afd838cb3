"""A sequence on the engine: chunked prefill, decode, verify, checkpoints, installs (book 10).

Every call validates its input before any work (token range, empty input, context overflow,
cache continuity) and is transactional: a forward whose logits are not finite is undone (KV
rolled back to the state before the call, no distribution installed, book 10.9) and raises
NonFiniteLogits, leaving the session usable.

Prefill streams the prompt through 512-row chunks, 64 when decoders are waiting (book 10.10);
results do not depend on the chunking beyond f32 summation order. On CUDA, decode (1 row) and
verify (<= 16 rows) run as captured CUDA graphs (engine/graphs.py); prefill runs eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np
import torch

from ..errors import (
    CacheDiscontinuity,
    ContextOverflow,
    EmptyInput,
    KvStateError,
    LaneError,
    NonFiniteLogits,
    TokenOutOfRange,
)
from ..kv import DEFAULT_BLOCK, DetachedInstall, KvCache, KvCheckpoint, KvSnapshot
from .forward import Forward
from .kernels.attention import AttnScratch, attend_ref, attend_triton, pick_splits
from ..kv.torch_backend import TORCH_KV, device_cache, resident_bytes

PREFILL_CHUNK = 512  # PREFILL_BATCH_TOKENS (book 10.10)
WAITING_CHUNK = 64  # MAX_TEACHER_FORCED_TOKENS: boundary while decoders are queued
MAX_VERIFY = 16  # speculative verify width (book 10.1)


@dataclass(frozen=True)
class SessionCheckpoint:
    kv: KvCheckpoint
    n_past: int
    session: int  # id() of the session it belongs to


class _EagerKv:
    """Attend over each plane with host metadata, then append the chunk's rows (muser.kv)."""

    def __init__(self, sess: "Session", p0: int, T: int):
        self.s, self.p0, self.T = sess, p0, T
        self.cuda = sess.device.type == "cuda"
        if self.cuda:
            meta = np.array([[p.origin_logical, p.origin_physical, p.len, p.capacity]
                             for p in sess.cache.planes], dtype=np.int64)
            self.meta = torch.from_numpy(meta).to(sess.device)
            self.pos = torch.tensor([p0], dtype=torch.int64, device=sess.device)
            self.scratch = sess._scratch(T)

    def attend(self, il: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        s, cfg = self.s, self.s.cfg
        plane = s.cache.planes[il]
        g = plane.geometry
        kq = k.to(s.kv_torch)  # rounded like the store (llama.cpp reads the cache back)
        vq = v.to(s.kv_torch)
        window = g.window if g.sliding else 0
        if self.cuda:
            splits = pick_splits(plane.capacity) if self.T <= MAX_VERIFY else 1
            out = attend_triton(q, kq, vq, plane.keys, plane.values, g.head_major, self.meta[il],
                                self.pos, window, cfg.attn_scale, self.scratch, splits=splits)
        elif s.device.type == "cpu":  # the C kernel: fixed order per row, any T (row-invariant)
            from .kernels import cpu_native

            out = cpu_native.attend(q, kq, vq, plane.keys, plane.values, g.head_major, plane.origin_logical,
                                    plane.origin_physical, plane.len, plane.capacity, self.p0, window,
                                    cfg.attn_scale)
        else:
            out = attend_ref(q, kq, vq, plane.keys, plane.values, g.head_major, plane.origin_logical,
                             plane.origin_physical, plane.len, plane.capacity, self.p0, window,
                             cfg.attn_scale)
        s.cache.append_batch(il, self.p0, kq.view(self.T, g.kv_dim), vq.view(self.T, g.kv_dim))
        return out


class Session:
    """Same surface as muser.oracle's session: prefill / decode / checkpoint / rollback /
    snapshot / restore / captured, plus verify and detached installs."""

    def __init__(self, engine, max_context: int, chunk: int = PREFILL_CHUNK, capture: Iterable[int] = (),
                 graphs: bool | None = None):
        cfg = engine.cfg
        if not isinstance(max_context, (int, np.integer)) or not 0 < max_context <= cfg.context_length:
            raise ContextOverflow(f"max_context {max_context!r} must be in [1, {cfg.context_length}] "
                                  "(the model's context_length)")
        if not isinstance(chunk, (int, np.integer)) or chunk < 1:
            raise EmptyInput(f"prefill chunk must be >= 1 row, got {chunk!r}")
        self.engine = engine
        self.cfg = cfg
        self.fwd: Forward = engine.forward
        self.device = engine.device
        self.kv_dtype = engine.kv
        self.kv_torch = TORCH_KV[engine.kv]
        self.max_context = int(max_context)
        self.chunk = int(chunk)
        self.capture_layers = self._check_capture(capture)
        self.cache: KvCache = device_cache(cfg, self.max_context, engine.kv, self.device)
        self.use_graphs = (self.device.type == "cuda") if graphs is None else bool(graphs)
        if self.use_graphs and self.device.type != "cuda":
            raise LaneError("CUDA graphs need device 'cuda'")
        self._graphs: dict = {}
        self._scratches: dict[bool, AttnScratch] = {}
        self.captured: dict[int, np.ndarray] = {}  # layer -> [T, hidden] inputs, last call
        self.logits: np.ndarray | None = None  # the installed distribution (last row)

    def _check_capture(self, layers: Iterable[int]) -> tuple[int, ...]:
        out = []
        for il in layers:
            if isinstance(il, bool) or not isinstance(il, (int, np.integer)) or \
                    not 0 <= il <= self.cfg.n_layers:
                raise LaneError(f"capture layer {il!r} is outside [0, {self.cfg.n_layers}]")
            out.append(int(il))
        return tuple(sorted(set(out)))

    # -- state ---------------------------------------------------------------------------------
    @property
    def n_past(self) -> int:
        return self.cache.n_tokens

    @property
    def kv_bytes(self) -> int:
        return resident_bytes(self.cache)

    def checkpoint(self, block: int = DEFAULT_BLOCK) -> SessionCheckpoint:
        """A rollback point covering up to `block` later tokens (book 10.6)."""
        return SessionCheckpoint(self.cache.checkpoint(block), self.n_past, id(self))

    def rollback(self, cp: SessionCheckpoint, keep: int = 0) -> None:
        """Return to `cp`, keeping the first `keep` tokens processed since (an accepted prefix)."""
        if not isinstance(cp, SessionCheckpoint) or cp.session != id(self):
            raise KvStateError("this checkpoint belongs to another session")
        self.cache.rollback(cp.kv, keep)
        self.logits = None

    def snapshot(self) -> KvSnapshot:
        return self.cache.snapshot()

    def restore(self, snap: KvSnapshot) -> None:
        self.cache.restore(snap)  # detached build + atomic swap (muser.kv)
        self.logits = None

    def begin_install(self, n_tokens: int) -> DetachedInstall:
        """Planes built beside the live ones (remote / restored KV); `commit` swaps them in."""
        return self.cache.begin_install(n_tokens)

    def commit(self, install: DetachedInstall) -> None:
        self.cache.commit(install)
        self.logits = None

    # -- validation ----------------------------------------------------------------------------
    def _tokens(self, ids, what: str, position: int | None = None) -> np.ndarray:
        a = np.asarray(ids)
        if a.ndim == 0:
            a = a.reshape(1)
        if a.ndim != 1:
            raise TokenOutOfRange(f"{what}: token ids must be a flat sequence, got shape {list(a.shape)}")
        if a.size == 0:
            raise EmptyInput(f"{what}: no tokens to process (empty input)")
        if not np.issubdtype(a.dtype, np.integer):
            raise TokenOutOfRange(f"{what}: token ids must be integers, got dtype {a.dtype}")
        bad = np.flatnonzero((a < 0) | (a >= self.cfg.vocab))
        if bad.size:
            raise TokenOutOfRange(f"{what}: token id {int(a[bad[0]])} at index {int(bad[0])} is outside "
                                  f"the vocab [0, {self.cfg.vocab})")
        n = self.n_past
        if position is not None and position != n:
            raise CacheDiscontinuity(0, n, position)
        if n + a.size > self.max_context:
            raise ContextOverflow(f"{what}: positions [{n}, {n + a.size}) run past max_context "
                                  f"{self.max_context}")
        return a.astype(np.int64)

    # -- forward -------------------------------------------------------------------------------
    def _scratch(self, T: int) -> AttnScratch:
        """Attention partials: one buffer for verify-shaped calls (<= 16 rows, split sequence)
        and one for prefill chunks (one split per row), each allocated once per session."""
        narrow = T <= MAX_VERIFY
        sc = self._scratches.get(narrow)
        if sc is None:
            if narrow:
                sc = AttnScratch(MAX_VERIFY, self.cfg.n_heads, self.cfg.head_dim,
                                 max(pick_splits(p.capacity) for p in self.cache.planes), self.device)
            else:
                sc = AttnScratch(max(self.chunk, MAX_VERIFY + 1), self.cfg.n_heads, self.cfg.head_dim, 1,
                                 self.device)
            self._scratches[narrow] = sc
        return sc

    def _eager(self, ids: np.ndarray, out_rows: str, capture: tuple[int, ...]) -> torch.Tensor | None:
        p0, T = self.n_past, len(ids)
        dev = self.device
        tokens = torch.from_numpy(ids).to(dev)
        positions = torch.arange(p0, p0 + T, dtype=torch.int64, device=dev)
        captured: dict = {}
        with torch.inference_mode():
            logits = self.fwd.run(tokens, positions, _EagerKv(self, p0, T), out_rows, capture, captured)
        self._parts.append(captured)
        return logits

    def _graph_ok(self, T: int, out_rows: str, capture: tuple[int, ...]) -> bool:
        return (self.use_graphs and T <= MAX_VERIFY and out_rows != "none"
                and capture == self.capture_layers
                and T <= min(p.capacity for p in self.cache.planes))

    def _graph(self, T: int, out_rows: str):
        from .graphs import StepGraph

        g = self._graphs.get((T, out_rows))
        if g is None:
            g = self._graphs[(T, out_rows)] = StepGraph(self, T, out_rows)
        return g

    def _rows(self, ids: np.ndarray, out_rows: str, capture: tuple[int, ...]) -> torch.Tensor | None:
        """One forward of <= one chunk: a captured graph where it applies, else eager."""
        if self._graph_ok(len(ids), out_rows, capture):
            g = self._graph(len(ids), out_rows)
            logits = g.run(ids)
            self._parts.append({il: b.clone() for il, b in g.captured.items()})
            return logits
        return self._eager(ids, out_rows, capture)

    def _transaction(self, ids: np.ndarray, chunk: int, out_rows: str,
                     capture: tuple[int, ...]) -> np.ndarray:
        """Run ids through chunks; all-or-nothing on non-finite logits (book 10.9)."""
        cp = self.cache.checkpoint(block=len(ids))
        self._parts: list[dict] = []
        outs = []
        try:
            for c0 in range(0, len(ids), chunk):
                c1 = min(len(ids), c0 + chunk)
                rows = out_rows if c1 == len(ids) else ("all" if out_rows == "all" else "none")
                lg = self._rows(ids[c0:c1], rows, capture)
                if lg is not None:
                    outs.append(lg.to("cpu", torch.float32))
            logits = (torch.cat(outs, 0) if len(outs) > 1 else outs[0]).numpy()
            finite = np.isfinite(logits)
            if not finite.all():
                r, c = np.argwhere(~finite)[0]
                raise NonFiniteLogits(
                    f"non-finite logit {logits[r, c]!r} at row {int(r)}, token {int(c)}: no distribution "
                    f"installed (book 10.9); KV rolled back to {cp.n_tokens} tokens"
                )
        except BaseException:
            self.cache.rollback(cp)
            raise
        finally:
            parts, self._parts = self._parts, []
        self.captured = {il: torch.cat([p[il] for p in parts], 0).to("cpu").numpy() for il in capture}
        self.logits = logits[-1].copy()
        return logits

    # -- public calls --------------------------------------------------------------------------
    def prefill(self, ids, all_logits: bool = False, position: int | None = None,
                capture: Iterable[int] | None = None, decoders_waiting: bool = False) -> np.ndarray:
        """Process `ids` in chunks of `chunk` rows (64 while decoders wait, book 10.10); float32
        logits of the last token [vocab], or of every token [T, vocab] with all_logits.
        `position` (optional) must equal n_past."""
        a = self._tokens(ids, "prefill", position)
        cap = self.capture_layers if capture is None else self._check_capture(capture)
        chunk = min(self.chunk, WAITING_CHUNK) if decoders_waiting else self.chunk
        logits = self._transaction(a, chunk, "all" if all_logits else "last", cap)
        return logits if all_logits else logits[-1]

    def decode(self, token, position: int | None = None) -> np.ndarray:
        """One token in, next-token logits out (float32 [vocab])."""
        a = self._tokens([token] if np.ndim(token) == 0 else token, "decode", position)
        if a.size != 1:
            raise LaneError(f"decode takes exactly one token, got {a.size} (use prefill or verify)")
        return self._transaction(a, 1, "last", self.capture_layers)[-1]

    def verify(self, tokens, position: int | None = None) -> np.ndarray:
        """The speculative verify shape: <= 16 rows in one forward, every row's logits
        [T, vocab] (book 10.1)."""
        a = self._tokens(tokens, "verify", position)
        if a.size > MAX_VERIFY:
            raise LaneError(f"the verify shape serves 1..{MAX_VERIFY} rows, got {a.size} (use prefill)")
        return self._transaction(a, MAX_VERIFY, "all", self.capture_layers)

    def decode_greedy(self, token, position: int | None = None) -> int:
        """decode(token) and its argmax (first maximal index). On CUDA graphs only the argmax
        and a finiteness flag are read back, not the vocabulary row."""
        a = self._tokens([token] if np.ndim(token) == 0 else token, "decode", position)
        if a.size != 1:
            raise LaneError(f"decode takes exactly one token, got {a.size}")
        if not self._graph_ok(1, "last", self.capture_layers):
            return int(np.argmax(self._transaction(a, 1, "last", self.capture_layers)[-1]))
        cp = self.cache.checkpoint(block=1)
        g = self._graph(1, "last")
        try:
            g.launch(a)
            top, ok = int(g.top[0]), bool(g.finite)  # the one readback
            if not ok:
                raise NonFiniteLogits(f"non-finite logits at position {cp.n_tokens}: no distribution "
                                      "installed (book 10.9)")
        except BaseException:
            self.cache.rollback(cp)
            raise
        self.captured = {il: b.to("cpu").numpy() for il, b in g.captured.items()}
        self.logits = None  # the row stayed on the device
        return top
