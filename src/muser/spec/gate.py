"""The acceptance gate (book 8.7 / 10.6): drafting pays only while proposals are accepted.

It judges recent evidence only: the last 8 rounds, after the first 2 rounds of a qualification
(the coldest, right after prefill or a cooldown) are skipped, and only once those 8 rounds hold at
least 32 proposals. It closes when the windowed acceptance (accepted / proposed) drops below 0.25.
A closed gate re-qualifies after a cooldown of plain-decoded tokens that doubles on each closing
(64, 128, 256, 512, then stays 512), so it is never a one-way latch; a qualification that passes a
full judgement resets the cooldown to 64. `close_below` is the closing threshold (0 holds the gate
open: every round drafts, the schedule of a driver without a gate, for measuring a drafter).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

WARMUP_ROUNDS = 2
WINDOW_ROUNDS = 8
MIN_PROPOSALS = 32
CLOSE_BELOW = 0.25
COOLDOWN_FIRST = 64
COOLDOWN_MAX = 512


@dataclass
class AcceptanceGate:
    open: bool = True
    cooldown: int = COOLDOWN_FIRST  # the next closing's cooldown
    _left: int = 0  # plain tokens still to decode while closed
    _rounds_since_open: int = 0
    _window: deque = field(default_factory=lambda: deque(maxlen=WINDOW_ROUNDS))
    transitions: list = field(default_factory=list)  # {"event", "token", "rate"|"cooldown"}
    close_below: float = CLOSE_BELOW

    def __post_init__(self) -> None:
        from ..errors import LaneError

        if not 0.0 <= self.close_below <= 1.0:
            raise LaneError(f"the gate's close_below must be in [0, 1], got {self.close_below!r}")

    def record(self, proposed: int, accepted: int, token_index: int) -> None:
        """One speculative round's outcome (called only while open)."""
        self._rounds_since_open += 1
        if self._rounds_since_open <= WARMUP_ROUNDS:
            return
        self._window.append((proposed, accepted))
        if len(self._window) < WINDOW_ROUNDS:
            return
        p = sum(x for x, _ in self._window)
        if p < MIN_PROPOSALS:
            return
        rate = sum(a for _, a in self._window) / p
        if rate < self.close_below:
            self.open = False
            self._left = self.cooldown
            self.transitions.append({"event": "close", "token": token_index, "rate": rate,
                                     "cooldown": self.cooldown})
            self.cooldown = min(COOLDOWN_MAX, self.cooldown * 2)
        elif self.cooldown != COOLDOWN_FIRST:
            self.cooldown = COOLDOWN_FIRST  # a full judgement passed: the next closing starts over

    def plain_token(self, token_index: int) -> None:
        """One token decoded without drafting (called only while closed)."""
        self._left -= 1
        if self._left <= 0:
            self.open = True
            self._rounds_since_open = 0
            self._window.clear()
            self.transitions.append({"event": "open", "token": token_index})


__all__ = [
    "CLOSE_BELOW",
    "COOLDOWN_FIRST",
    "COOLDOWN_MAX",
    "MIN_PROPOSALS",
    "WARMUP_ROUNDS",
    "WINDOW_ROUNDS",
    "AcceptanceGate",
]
