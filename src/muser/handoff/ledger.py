"""The replay ledger: every accepted manifest's nonce, kept for a time window, under an epoch,
persisted with fsync before any byte of that stream may reach a plane (book 10.7).

A manifest is admitted once: its epoch must be the ledger's (the receiver names its epoch in
each request, so a stream sealed for another ledger incarnation is refused), its timestamp must
lie within +-window of the receiver's clock (older streams are stale; their nonces need not be
remembered), and its nonce must not be on record. Admission writes the nonce to disk (temp
file, fsync, rename, fsync of the folder) before returning; processes sharing one ledger
serialize on an flock.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import secrets
import time
from contextlib import contextmanager
from pathlib import Path

from ..errors import HandoffRefused, MuserError

FORMAT = "muser-handoff-ledger-1"
NONCE_RE = re.compile(r"^[0-9a-f]{32}$")
DEFAULT_WINDOW_S = 60.0


class ReplayLedger:
    def __init__(self, path: str | os.PathLike, window_s: float = DEFAULT_WINDOW_S):
        if not window_s > 0:
            raise MuserError(f"ledger window must be > 0 s, got {window_s!r}")
        self.path = Path(path)
        self.window_s = float(window_s)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._locked():
            if not self.path.exists():
                self._save({"format": FORMAT, "epoch": secrets.token_hex(16), "seen": {}})
            self.epoch = self._load()["epoch"]

    @contextmanager
    def _locked(self):
        fd = os.open(self.path.with_name(self.path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _load(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
        except ValueError as e:
            raise MuserError(f"replay ledger {self.path} is corrupt: {e}") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT or \
                not isinstance(data.get("epoch"), str) or not isinstance(data.get("seen"), dict):
            raise MuserError(f"replay ledger {self.path} is not a {FORMAT} file")
        return data

    def _save(self, data: dict) -> None:
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, (json.dumps(data, sort_keys=True) + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        dfd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def rotate(self) -> str:
        """Start a new epoch: every stream sealed for the old one is refused from now on."""
        with self._locked():
            self.epoch = secrets.token_hex(16)
            self._save({"format": FORMAT, "epoch": self.epoch, "seen": {}})
        return self.epoch

    def admit(self, nonce: str, timestamp: float, epoch: str, now: float | None = None) -> None:
        """Admit a manifest once (module doc) or raise HandoffRefused; durable on return."""
        if not isinstance(nonce, str) or not NONCE_RE.match(nonce):
            raise HandoffRefused(f"manifest nonce {nonce!r} is not 32 lowercase hex digits")
        if isinstance(timestamp, bool) or not isinstance(timestamp, (int, float)):
            raise HandoffRefused(f"manifest timestamp {timestamp!r} is not a number")
        now = time.time() if now is None else now
        with self._locked():
            data = self._load()
            if epoch != data["epoch"]:
                raise HandoffRefused(f"manifest epoch {str(epoch)[:16]} is not the ledger's epoch "
                                     f"{data['epoch'][:16]}")
            age = now - float(timestamp)
            if abs(age) > self.window_s:
                raise HandoffRefused(f"stale manifest: timestamp {timestamp:.3f} is {age:+.1f} s from now, "
                                     f"outside the +-{self.window_s:g} s window")
            seen = {k: v for k, v in data["seen"].items() if now - float(v) <= self.window_s}
            if nonce in seen:
                raise HandoffRefused(f"replayed manifest: nonce {nonce} was already admitted")
            seen[nonce] = float(timestamp)
            data["seen"] = seen
            self._save(data)
