"""One sequence protocol for the oracle and the engine (DESIGN.md "One session protocol").

A sequence is its KV cache (muser.kv) plus a position. Both session classes derive from
`Sequence`, which owns everything but the forward itself:

* validation, before any work: token ids flat, integer, inside the vocab, non-empty; an
  explicit `position` equal to n_past; positions inside max_context; decode takes one token,
  verify 1..MAX_VERIFY; capture layers inside [0, n_layers]. One function per rule, so the
  oracle and the engine raise the same error class with the same message.
* transactions: every call checkpoints the caches it touches and rolls all of them back on any
  failure, and a non-finite logit anywhere is such a failure (book 10.9: no distribution is
  installed, the session stays usable).
* checkpoint / rollback(keep) / snapshot / restore / begin_install / commit over the cache.

A subclass implements `_forward(ids, rows, capture) -> (logits | None, captured)` for one chunk
of at most `chunk` rows, and may implement `_rows_finite()`: True when the logits its last
`_forward` returned are known to be finite (the engine reduces them on the device before the copy),
so the host scan of every value is skipped; by default every value is scanned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence as Seq, TypeVar

import numpy as np

from .errors import (
    CacheDiscontinuity,
    ContextOverflow,
    EmptyInput,
    KvStateError,
    LaneError,
    NonFiniteLogits,
    TokenOutOfRange,
)
from .kv import DEFAULT_BLOCK, DetachedInstall, KvCache, KvCheckpoint, KvSnapshot

MAX_VERIFY = 16  # speculative verify width (book 10.1: MAX_DFLASH_BLOCK)
WAITING_CHUNK = 64  # MAX_TEACHER_FORCED_TOKENS: the prefill chunk while decoders are queued (10.10)

T_ = TypeVar("T_")


@dataclass(frozen=True)
class SessionCheckpoint:
    kv: KvCheckpoint
    n_past: int
    session: int  # id() of the session it belongs to


# ---------------------------------------------------------------------------------------------
# validation rules (shared by the sessions and by Engine.step)


def check_max_context(max_context: Any, context_length: int) -> int:
    if isinstance(max_context, bool) or not isinstance(max_context, (int, np.integer)) or \
            not 0 < max_context <= context_length:
        raise ContextOverflow(f"max_context {max_context!r} must be in [1, {context_length}] "
                              "(the model's context_length)")
    return int(max_context)


def check_chunk(chunk: Any) -> int:
    if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or chunk < 1:
        raise EmptyInput(f"prefill chunk must be >= 1 row, got {chunk!r}")
    return int(chunk)


def check_capture(layers: Iterable[Any], n_layers: int) -> tuple[int, ...]:
    """Layers whose input residual is recorded (n_layers = the residual leaving the last)."""
    out = []
    for il in layers:
        if isinstance(il, bool) or not isinstance(il, (int, np.integer)) or not 0 <= il <= n_layers:
            raise LaneError(f"capture layer {il!r} is outside [0, {n_layers}]")
        out.append(int(il))
    return tuple(sorted(set(out)))


def check_tokens(ids: Any, vocab: int, what: str) -> np.ndarray:
    """Token ids as int64 [T] (T >= 1), every id in [0, vocab)."""
    a = np.asarray(ids)
    if a.ndim == 0:
        a = a.reshape(1)
    if a.ndim != 1:
        raise TokenOutOfRange(f"{what}: token ids must be a flat sequence, got shape {list(a.shape)}")
    if a.size == 0:
        raise EmptyInput(f"{what}: no tokens to process (empty input)")
    if not np.issubdtype(a.dtype, np.integer):
        raise TokenOutOfRange(f"{what}: token ids must be integers, got dtype {a.dtype}")
    bad = np.flatnonzero((a < 0) | (a >= vocab))
    if bad.size:
        raise TokenOutOfRange(f"{what}: token id {int(a[bad[0]])} at index {int(bad[0])} is outside "
                              f"the vocab [0, {vocab})")
    return a.astype(np.int64)


def check_span(n_past: int, count: int, max_context: int, position: Any, what: str) -> None:
    """The rows [n_past, n_past + count) continue the cache and fit max_context."""
    if position is not None and position != n_past:
        raise CacheDiscontinuity(0, n_past, position)
    if n_past + count > max_context:
        raise ContextOverflow(f"{what}: positions [{n_past}, {n_past + count}) run past max_context "
                              f"{max_context}")


def check_count(a: np.ndarray, what: str) -> None:
    """The shape limits of decode (one token) and verify (1..MAX_VERIFY rows)."""
    if what == "decode" and a.size != 1:
        raise TokenOutOfRange(f"decode takes exactly one token, got {a.size} (use prefill or verify)")
    if what == "verify" and a.size > MAX_VERIFY:
        raise LaneError(f"the verify shape serves 1..{MAX_VERIFY} rows, got {a.size} (use prefill)")


def first_non_finite(logits: np.ndarray) -> tuple[int, int] | None:
    """(row, vocab index) of the first non-finite value of [R, vocab] logits, or None."""
    finite = np.isfinite(logits)
    if finite.all():
        return None
    r, c = np.argwhere(~finite)[0]
    return int(r), int(c)


def non_finite_error(logits: np.ndarray, where: tuple[int, int], item: int, row: int,
                     n_tokens: int) -> NonFiniteLogits:
    """The one NonFiniteLogits message: the offending value, step item, row, vocab index."""
    r, c = where
    return NonFiniteLogits(
        f"non-finite logit {float(logits[r, c])!r} at item {item}, row {row}, token {c}: no distribution "
        f"installed (book 10.9); KV rolled back to {n_tokens} tokens"
    )


def transaction(caches: Seq[KvCache], blocks: Seq[int], work: Callable[[], T_]) -> T_:
    """Run `work` with every cache checkpointed (each for `block` appends); on any failure every
    cache returns to its checkpoint before the error propagates (all-or-nothing)."""
    cps = [c.checkpoint(block=max(1, int(b))) for c, b in zip(caches, blocks)]
    try:
        return work()
    except BaseException:
        for c, cp in zip(caches, cps):
            c.rollback(cp)
        raise


# ---------------------------------------------------------------------------------------------
# the session base


class Sequence:
    """prefill / decode / verify / checkpoint / rollback / snapshot / restore / installs over a
    KvCache; subclasses provide `_forward` (see module doc) and set the fields in `_init_seq`."""

    cache: KvCache
    vocab: int
    n_layers: int
    max_context: int
    chunk: int
    capture_layers: tuple[int, ...]
    captured: dict[int, np.ndarray]
    logits: np.ndarray | None  # the installed distribution (last row of the last call)

    def _init_seq(self, cache: KvCache, vocab: int, n_layers: int, max_context: int, chunk: int,
                  capture: Iterable[Any]) -> None:
        self.vocab, self.n_layers = int(vocab), int(n_layers)
        self.max_context, self.chunk = max_context, chunk
        self.capture_layers = check_capture(capture, n_layers)
        self.cache = cache
        self.captured = {}
        self.logits = None

    def _forward(self, ids: np.ndarray, rows: str,
                 capture: tuple[int, ...]) -> tuple[np.ndarray | None, dict[int, np.ndarray]]:
        """One chunk (<= self.chunk rows): f32 logits [R, vocab] for rows 'last' (R = 1) or
        'all' (R = T), None for 'none'; captured layer inputs {layer: [T, hidden]}."""
        raise NotImplementedError

    def _rows_finite(self) -> bool:
        """Whether the logits the last `_forward` returned are known to be finite (then not
        scanned on the host); False: unknown, scan them."""
        return False

    # -- state ---------------------------------------------------------------------------------
    @property
    def n_past(self) -> int:
        return self.cache.n_tokens

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
    def check(self, ids: Any, what: str, position: Any = None) -> np.ndarray:
        """Validated int64 [T] ids for `what` ('prefill' | 'decode' | 'verify' | a step item)."""
        a = check_tokens(ids, self.vocab, what)
        check_count(a, what)
        check_span(self.n_past, a.size, self.max_context, position, what)
        return a

    # -- calls ---------------------------------------------------------------------------------
    def _call(self, ids: np.ndarray, chunk: int, all_logits: bool, capture: tuple[int, ...]) -> np.ndarray:
        """ids through chunks of <= chunk rows, as one transaction; [R, vocab] float32."""
        n0 = self.n_past
        parts: list[dict[int, np.ndarray]] = []

        def work() -> np.ndarray:
            outs, known = [], []
            for c0 in range(0, len(ids), chunk):
                c1 = min(len(ids), c0 + chunk)
                rows = "all" if all_logits else ("last" if c1 == len(ids) else "none")
                lg, cap = self._forward(ids[c0:c1], rows, capture)
                parts.append(cap)
                if lg is not None:
                    outs.append(lg)
                    known.append(self._rows_finite())
            logits = np.concatenate(outs, 0) if len(outs) > 1 else outs[0]
            bad = None if all(known) else first_non_finite(logits)
            if bad is not None:
                row = bad[0] if all_logits else len(ids) - 1
                raise non_finite_error(logits, bad, 0, row, n0)
            return logits

        logits = transaction([self.cache], [len(ids)], work)
        self.captured = {il: np.concatenate([p[il] for p in parts], 0) for il in capture}
        self.logits = logits[-1].copy()
        return logits

    def prefill(self, ids: Any, all_logits: bool = False, position: Any = None,
                capture: Iterable[Any] | None = None, decoders_waiting: bool = False) -> np.ndarray:
        """Process `ids` in chunks of `chunk` rows (64 while decoders wait, book 10.10); float32
        logits of the last token [vocab], or of every token [T, vocab] with all_logits.
        `position` (optional) must equal n_past."""
        a = self.check(ids, "prefill", position)
        cap = self.capture_layers if capture is None else check_capture(capture, self.n_layers)
        chunk = min(self.chunk, WAITING_CHUNK) if decoders_waiting else self.chunk
        logits = self._call(a, chunk, all_logits, cap)
        return logits if all_logits else logits[-1]

    def decode(self, token: Any, position: Any = None) -> np.ndarray:
        """One token in, next-token logits out (float32 [vocab])."""
        a = self.check(token, "decode", position)
        return self._call(a, 1, False, self.capture_layers)[-1]

    def verify(self, tokens: Any, position: Any = None) -> np.ndarray:
        """The speculative verify shape: 1..16 rows in one forward, every row's logits
        [T, vocab] (book 10.1)."""
        a = self.check(tokens, "verify", position)
        return self._call(a, MAX_VERIFY, True, self.capture_layers)

