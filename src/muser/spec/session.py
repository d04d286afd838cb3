"""Speculative decoding over a target Session and a DFlash drafter (book 10.6: draft, verify, accept).

`SpecSession` has the Session surface the generation loop drives (prefill, decode, n_past,
checkpoint, rollback), so plain and speculative generation are one loop:

  decode(token)   with no verified rows pending: a round. The drafter proposes k tokens from the
                  block [token, mask x 15]; the target verifies [token, d1..dk] in one forward
                  (<= 16 rows, capturing its layer inputs, which are injected into the drafter's
                  context); row 0's logits are returned and rows 1..k are held, each under its draft.
                  With rows pending: if `token` is the next draft, its held row is returned with no
                  forward (the proposal is accepted); otherwise the round ends there: target KV and
                  drafter context roll back to [last, accepted drafts] and a new round starts at `token`.

Whoever picks tokens from the returned logits decides acceptance: a greedy pick accepts the longest
matching prefix and the first mismatch is the target's bonus token (sample.speculative.greedy_prefix);
a sampled pick is the point-mass Leviathan rule (sample.speculative.verify_point_mass). Either way the
target's logits for every emitted token are those plain decoding computes (row invariance of the exact
lane), so the tokens are identical to plain decoding for the same sampler state.

The explicit round API (begin_round / commit) is what a server drives: it owns the pick.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import KvStateError, LaneError
from ..kv import DEFAULT_BLOCK
from .drafter import MAX_BLOCK, Drafter
from .format import VERIFY_LENGTHS
from .gate import AcceptanceGate


@dataclass(frozen=True)
class SpecCheckpoint:
    target: object
    ctx_n: int
    session: int


class SpecSession:
    def __init__(self, target, drafter: Drafter, verify_len: int = 7, gate: AcceptanceGate | None = None):
        if verify_len not in VERIFY_LENGTHS or verify_len > drafter.cfg.max_proposals:
            raise LaneError(f"verify length {verify_len!r} must be one of {VERIFY_LENGTHS} and <= the drafter's "
                            f"block_size - 1 = {drafter.cfg.max_proposals}")
        want = tuple(sorted(drafter.cfg.target_layers))
        if tuple(target.capture_layers) != want:
            raise LaneError(f"the target session captures layers {list(target.capture_layers)}, the drafter "
                            f"reads {list(drafter.cfg.target_layers)}")
        if target.n_past != 0:
            raise KvStateError(f"a speculative session starts empty, the target holds {target.n_past} tokens")
        self.t = target
        self.d = drafter
        self.k = verify_len
        self.ctx = drafter.context()
        self.gate = gate if gate is not None else AcceptanceGate()
        self._pending: list[tuple[int, np.ndarray]] = []
        self._round: tuple[Any, int, int, int] | None = None  # (checkpoint, n0, k, accepted so far)
        self.rounds = self.proposals = self.accepted = 0
        self.plain_tokens = 0
        self._emitted = 0  # tokens fed through decode (the gate's clock)
        self.accepted_lengths: list[int] = []

    # -- Session surface -----------------------------------------------------------------------
    @property
    def n_past(self) -> int:
        return self.t.n_past - len(self._pending)

    @property
    def cfg(self):
        return self.t.cfg

    @property
    def max_context(self) -> int:
        return self.t.max_context

    def _features(self) -> np.ndarray:
        cap = self.t.captured
        return np.concatenate([cap[il] for il in self.d.cfg.target_layers], axis=-1)  # [T, n_cap*H]

    def prefill(self, ids, **kw) -> np.ndarray:
        self._resolve_pending()
        p0 = self.t.n_past
        logits = self.t.prefill(ids, **kw)
        self.d.inject(self.ctx, self._features(), p0)
        return logits

    def decode(self, token) -> np.ndarray:
        token = int(token)
        self._emitted += 1
        if self._pending and self._round is not None:
            d, row = self._pending[0]
            if token == d:
                self._pending.pop(0)
                cp, n0, k, a = self._round
                self._round = (cp, n0, k, a + 1)
                if not self._pending:
                    self.commit(k)
                return row
            self.commit(self._round[3])
        if not self.gate.open:
            return self._plain(token)
        props, rows = self.begin_round(token)
        if not props:
            return rows[0]
        self._pending = list(zip(props, rows[1:]))
        return rows[0]

    def _plain(self, token: int) -> np.ndarray:
        p0 = self.t.n_past
        logits = self.t.decode(token)
        self.d.inject(self.ctx, self._features(), p0)
        self.plain_tokens += 1
        if not self.gate.open:
            self.gate.plain_token(self._emitted)
        return logits

    # -- the round API -------------------------------------------------------------------------
    def begin_round(self, token: int) -> tuple[list[int], np.ndarray]:
        """Propose after `token` and verify [token, proposals] in one target forward: (proposals,
        logits [k+1, vocab]). Near the context end the round shrinks to a verify length that fits
        (a plain decode when none does: proposals == [])."""
        if self._round is not None:
            raise KvStateError("a round is open: commit it first")
        n0 = self.t.n_past
        if self.ctx.n != n0:
            raise KvStateError(f"drafter context holds {self.ctx.n} rows, the target {n0}")
        fits = [k for k in VERIFY_LENGTHS if k <= self.k and n0 + k + 1 <= self.t.max_context]
        if not fits:
            return [], self._plain(token)[None]
        k = fits[-1]
        props = self.d.propose(self.ctx, token, k)
        cp = self.t.checkpoint(block=k + 1)
        rows = self.t.verify([token] + props)  # [k+1, vocab]
        self.d.inject(self.ctx, self._features(), n0)
        self._round = (cp, n0, k, 0)
        return props, rows

    def commit(self, accepted: int) -> None:
        """Close the open round keeping [token, first `accepted` proposals]; the rest of the
        verified rows leave the target KV and the drafter context."""
        if self._round is None:
            raise KvStateError("no round is open")
        cp, n0, k, _ = self._round
        if not 0 <= accepted <= k:
            raise LaneError(f"accepted {accepted} is outside [0, {k}]")
        if accepted < k:
            self.t.rollback(cp, keep=1 + accepted)
            self.ctx.truncate(n0 + 1 + accepted)
        self._round = None
        self._pending = []
        self.rounds += 1
        self.proposals += k
        self.accepted += accepted
        self.accepted_lengths.append(accepted)
        self.gate.record(k, accepted, self._emitted)

    def _resolve_pending(self) -> None:
        if self._round is not None:
            self.commit(self._round[3])

    # -- checkpoints ---------------------------------------------------------------------------
    def checkpoint(self, block: int = DEFAULT_BLOCK) -> SpecCheckpoint:
        """A rollback point for target and drafter (rows appended since: <= `block` <= 16)."""
        if block > MAX_BLOCK:
            raise KvStateError(f"a speculative checkpoint covers at most {MAX_BLOCK} later rows, asked {block}")
        self._resolve_pending()
        return SpecCheckpoint(self.t.checkpoint(block), self.ctx.n, id(self))

    def rollback(self, cp: SpecCheckpoint, keep: int = 0) -> None:
        if not isinstance(cp, SpecCheckpoint) or cp.session != id(self):
            raise KvStateError("this checkpoint belongs to another speculative session")
        self._resolve_pending()
        self.t.rollback(cp.target, keep)
        self.ctx.truncate(cp.ctx_n + keep)

    # -- record --------------------------------------------------------------------------------
    def stats(self) -> dict:
        return {
            "drafter_sha256": self.d.sha256, "verify_len": self.k, "block_size": self.d.cfg.block_size,
            "draft_sink_size": self.d.cfg.sink, "draft_sliding_window": self.d.cfg.window,
            "rounds": self.rounds, "proposals": self.proposals, "accepted": self.accepted,
            "acceptance_rate": self.accepted / self.proposals if self.proposals else None,
            "mean_accepted_length": self.accepted / self.rounds if self.rounds else None,
            "plain_tokens": self.plain_tokens, "gate_open": self.gate.open,
            "gate_transitions": list(self.gate.transitions),
        }


__all__ = ["SpecCheckpoint", "SpecSession"]
