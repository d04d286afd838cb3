"""A progress bar on stderr for long file passes (`muser inspect --check`, `muser convert`).

    bar = Progress("check", total_bytes)
    bar.advance(n, label="blk.3.ffn_down.weight")
    bar.close()

On a terminal it redraws one line (at most every 0.1 s); otherwise (a pipe, a log) it writes a
line at each 10% step, so logs stay short. Nothing goes to stdout.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, what: str, total: int, stream: TextIO | None = None, enabled: bool = True):
        self.what, self.total = what, max(int(total), 1)
        self.stream = sys.stderr if stream is None else stream
        self.enabled = enabled
        self.done = 0
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._t0 = self._last = time.monotonic()
        self._step = -1

    def advance(self, n: int, label: str = "") -> None:
        self.done = min(self.total, self.done + int(n))
        if not self.enabled:
            return
        now = time.monotonic()
        pct = 100.0 * self.done / self.total
        if self._tty:
            if now - self._last < 0.1 and self.done < self.total:
                return
            filled = int(pct / 100 * 30)
            self.stream.write(f"\r{self.what} [{'#' * filled}{'.' * (30 - filled)}] {pct:5.1f}% {label[:48]:<48}")
        else:
            step = int(pct // 10)
            if step == self._step:
                return
            self._step = step
            self.stream.write(f"{self.what}: {pct:5.1f}% {label}\n")
        self._last = now
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self._tty:
            self.stream.write(f"\r{self.what}: done in {time.monotonic() - self._t0:.1f} s{' ' * 60}\n")
            self.stream.flush()
