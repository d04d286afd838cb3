"""Length-prefixed frames over a TLS 1.3 socket (book 10.7: one frame per tile).

    frame = header (16 bytes, big-endian) + payload
    header = magic b"MUH2" | kind u8 | flags u8 (0) | reserved u16 (0) | seq u32 | length u32

Payloads are raw bytes: a JSON document (request, manifest, refusal, seal) or a tile (a sealed
JSON descriptor followed by raw K/V bytes). Nothing is ever unpickled or evaluated. A reader
names the largest payload it will accept before reading it, and every read runs under a stall
timeout and an overall deadline, so a slow or stalled link ends in HandoffRefused, not a hang.
"""

from __future__ import annotations

import socket
import ssl
import struct
import time
from dataclasses import dataclass

from ..errors import HandoffRefused

MAGIC = b"MUH2"
HEADER = struct.Struct(">4sBBHII")

REQUEST, MANIFEST, TILE, END, REFUSE = 1, 2, 3, 4, 5
KIND_NAMES = {REQUEST: "request", MANIFEST: "manifest", TILE: "tile", END: "end", REFUSE: "refuse"}


@dataclass(frozen=True)
class Frame:
    kind: int
    seq: int
    payload: bytes | bytearray  # bytearray when read: serial's row views stay writable

    @property
    def wire_bytes(self) -> int:
        return HEADER.size + len(self.payload)


def frame_bytes(kind: int, seq: int, payload: bytes) -> bytes:
    if kind not in KIND_NAMES:
        raise ValueError(f"unknown frame kind {kind}")
    return HEADER.pack(MAGIC, kind, 0, 0, seq, len(payload)) + payload


def send_frame(sock: socket.socket, kind: int, seq: int, payload: bytes) -> int:
    """Write one frame; returns the bytes written."""
    data = frame_bytes(kind, seq, payload)
    sock.sendall(data)
    return len(data)


class Link:
    """The reading half of a connection: frames under a stall timeout and a deadline."""

    def __init__(self, sock: socket.socket, stall_s: float, deadline: float | None = None):
        self.sock = sock
        self.stall_s = float(stall_s)
        self.deadline = deadline  # time.monotonic() bound for the whole exchange, or None
        self.bytes_in = 0

    def _timeout(self) -> float:
        if self.deadline is None:
            return self.stall_s
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise HandoffRefused("link deadline passed")
        return min(self.stall_s, left)

    def _exact(self, n: int, what: str) -> bytearray:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            self.sock.settimeout(self._timeout())
            try:
                k = self.sock.recv_into(view[got:], n - got)
            except TimeoutError:
                if self.deadline is not None and time.monotonic() >= self.deadline:
                    raise HandoffRefused(f"link deadline passed while reading {what} ({got}/{n} bytes): "
                                         "the link is too slow") from None
                raise HandoffRefused(f"link stalled: no bytes for {self.sock.gettimeout():.3g} s while "
                                     f"reading {what} ({got}/{n} bytes)") from None
            except ssl.SSLError as e:
                raise HandoffRefused(f"TLS error while reading {what}: {e.reason or e}") from None
            except OSError as e:
                raise HandoffRefused(f"link failed while reading {what}: {e.strerror or e}") from None
            if k == 0:
                raise HandoffRefused(f"peer closed the link while sending {what} ({got}/{n} bytes)")
            got += k
        self.bytes_in += n
        return buf

    def read(self, max_len: int | dict[int, int], what: str) -> Frame:
        """One frame whose payload is at most `max_len` bytes (or max_len[kind])."""
        magic, kind, flags, reserved, seq, length = HEADER.unpack(self._exact(HEADER.size, f"{what} header"))
        if magic != MAGIC:
            raise HandoffRefused(f"bad frame magic {magic!r} while reading {what}")
        if kind not in KIND_NAMES or flags or reserved:
            raise HandoffRefused(f"bad frame header (kind {kind}, flags {flags}, reserved {reserved}) "
                                 f"while reading {what}")
        limit = max_len.get(kind, 0) if isinstance(max_len, dict) else max_len
        if length > limit:
            raise HandoffRefused(f"{KIND_NAMES[kind]} frame of {length} bytes exceeds the {limit} "
                                 f"bytes allowed while reading {what}")
        return Frame(kind, seq, self._exact(length, what))
