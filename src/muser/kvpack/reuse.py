"""Warm reuse: a session whose first prefill starts from the longest stored prefix.

    warm = WarmSession(session, store)     # any engine or oracle session (same protocol)
    logits = warm.prefill(ids)             # restore <= len(ids)-1 stored tokens, prefill the rest
    warm.last                              # {"restored": r, "prefilled": n - r, "restore_s": ..., ...}
    warm.wait()                            # background persistence of the new chunks finished

On a hit the stored tiles (verified on read, on several threads) are installed tile by tile into
detached planes as each one verifies (Store.restore), swapped in whole (book 10.7). The suffix
is prefilled from the restored chunk boundary, so its chunk boundaries are the ones a cold
prefill of the whole prompt uses; with row-invariant kernels the logits are bitwise the cold
ones (Gate 3). At L, the last chunk boundary before the final token, the SWA rings are copied
(the only copy on the TTFT path: they are overwritten by the rest of the prompt); the NoPE rows
of the new chunks are read after the response has started, by a background thread, and written
as entries with the SWA tail at L. Calls that could overwrite those rows (rollback, restore,
install) first wait for that thread. A failed write is logged and never reaches the caller.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import LaneError
from ..kv.serial import CHUNK_TOKENS, KIND_NOPE, KIND_SWA, encode_tile
from ..sequence import check_span, check_tokens
from .entry import encode_entry
from .store import Store

log = logging.getLogger("muser.kvpack")


class WarmSession:
    """Wraps a session (same surface, attributes forwarded) with kvpack reuse on its first prefill."""

    def __init__(self, session: Any, store: Store):
        ch = store.binding.layout.chunk_tokens
        if ch % session.chunk:
            raise LaneError(f"kvpack reuse needs a prefill chunk that divides {ch} (the stored chunk boundary), "
                            f"got {session.chunk}")
        self.session = session
        self.store = store
        self._job: threading.Thread | None = None
        self.last: dict = {}
        self.persisted: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.session, name)

    @property
    def n_past(self) -> int:
        return self.session.n_past

    # -- calls that may overwrite stored rows wait for the writer first ------------------------
    def wait(self) -> None:
        job, self._job = self._job, None
        if job is not None:
            job.join()

    close = wait

    def rollback(self, cp: Any, keep: int = 0) -> None:
        self.wait()
        self.session.rollback(cp, keep)

    def restore(self, snap: Any) -> None:
        self.wait()
        self.session.restore(snap)

    def begin_install(self, n_tokens: int) -> Any:
        self.wait()
        return self.session.begin_install(n_tokens)

    def commit(self, install: Any) -> None:
        self.wait()
        self.session.commit(install)

    # -- prefill -------------------------------------------------------------------------------
    def prefill(self, ids: Sequence[int], all_logits: bool = False, **kw: Any) -> np.ndarray:
        """Like session.prefill; on an empty session (and last-row logits) the longest stored
        prefix is restored first and the new complete chunks are persisted after it returns."""
        s = self.session
        if s.n_past != 0 or all_logits or kw:
            self.last = {"restored": 0, "prefilled": len(ids), "reuse": False}
            return s.prefill(ids, all_logits=all_logits, **kw)
        return self._warm_prefill(ids, s.prefill)

    def prefill_row(self, ids: Sequence[int], **kw: Any) -> Any:
        """Like session.prefill_row (the generation loop's call: on CUDA the last row stays on the
        device), with the same reuse as `prefill`."""
        s = self.session
        if s.n_past != 0 or kw:
            self.last = {"restored": 0, "prefilled": len(ids), "reuse": False}
            return s.prefill_row(ids, **kw)
        return self._warm_prefill(ids, s.prefill_row)

    def _warm_prefill(self, ids: Sequence[int], last_call: Any) -> Any:
        """Restore the longest stored prefix of `ids` into the empty session, prefill the rest
        (`last_call` runs the final part and returns its logits row), persist after returning."""
        s = self.session
        self.wait()
        # the session's own validation, before any restore (bad input: typed error, no work)
        arr = check_tokens(ids, s.vocab, "prefill")
        check_span(0, arr.size, s.max_context, None, "prefill")
        toks = [int(t) for t in arr]
        if len(toks) < 2:
            return last_call(toks)
        ch = self.store.binding.layout.chunk_tokens
        empty = s.snapshot()  # an empty state (no rows): the undo point if anything below fails
        try:
            # read + verify on the store's threads, each tile installed as it verifies (no assembled copy)
            t0 = time.perf_counter()
            hit = self.store.restore(s, toks)
            restore_s = time.perf_counter() - t0  # host side: device copies may still be queued
            r = hit.n_tokens if hit is not None else 0
            end = (len(toks) - 1) // ch * ch  # last chunk boundary that leaves a token to prefill
            tail = None
            if end > r:
                s.prefill(toks[r:end])
                tail = [p.view("logical") for p in s.cache.planes if p.geometry.sliding]  # copies
                logits = last_call(toks[end:])
            else:
                logits = last_call(toks[r:])
        except BaseException:
            s.restore(empty)
            raise
        self.last = {"restored": r, "prefilled": len(toks) - r, "reuse": True,
                     "hit_names": list(hit.names) if hit else [], "restore_s": restore_s}
        if tail is not None:
            planes = s.cache.planes  # the live planes: rows [0, end) stay put until a rollback
            self._job = threading.Thread(target=self._persist, args=(toks[:end], r, planes, tail),
                                         name="kvpack-persist", daemon=False)
            self._job.start()
        return logits

    def _persist(self, toks: list[int], restored: int, planes: Sequence[Any], tail: Sequence[Any]) -> None:
        """Write the NOPE entries of chunks [restored, end) that are absent, then the SWA tail
        at end. Runs off the TTFT path; failures are logged (the store stays consistent)."""
        try:
            store, layout = self.store, self.store.binding.layout
            ch = layout.chunk_tokens
            end = len(toks)
            addrs = store.binding.addresses(toks)
            full = [planes[i] for i in layout.full_layers]
            for c in range(restored // ch, end // ch):
                name = store.name(addrs[c], "nope")
                if not layout.full_layers or store.backend.exists(name):
                    continue
                phys = [p.physical_of(np.arange(c * ch, (c + 1) * ch, dtype=np.int64)) for p in full]
                rows = [p.read(ph) for p, ph in zip(full, phys)]
                tile = encode_tile(layout, KIND_NOPE, c * ch, (c + 1) * ch, [k for k, _ in rows], [v for _, v in rows])
                blob = encode_entry(store.binding, addrs[c], "nope", c, tile, toks[c * ch:(c + 1) * ch])
                if store.put(name, blob, addrs[c], "nope"):
                    self.persisted.append(name)
            if layout.sliding_layers:
                c = end // ch - 1
                name = store.name(addrs[c], "swa")
                if not store.backend.exists(name):
                    tile = encode_tile(layout, KIND_SWA, int(tail[0].positions[0]), end,
                                       [v.keys for v in tail], [v.values for v in tail])
                    blob = encode_entry(store.binding, addrs[c], "swa", c, tile)
                    if store.put(name, blob, addrs[c], "swa"):
                        self.persisted.append(name)
        except Exception as e:  # noqa: BLE001 - a thread's failure must not reach the response
            log.warning("kvpack persistence stopped: %s: %s", type(e).__name__, e)


def warm_session(session: Any, kvpack: Any, budget_bytes: int | None = None,
                 chunk_tokens: int = CHUNK_TOKENS) -> WarmSession:
    """`session` with kvpack reuse from `kvpack`: a Store (its binding must be this session's)
    or a directory path (opened, created if absent, for this session's binding). The tile size
    is part of the binding (512 tokens unless asked otherwise)."""
    from .entry import Binding

    binding = Binding.of_session(session, chunk_tokens)
    if isinstance(kvpack, Store):
        if kvpack.binding != binding:
            binding.check(kvpack.binding.to_json(), "kvpack store")
        return WarmSession(session, kvpack)
    return WarmSession(session, Store.open(kvpack, binding, budget_bytes))


__all__ = ["WarmSession", "warm_session"]
