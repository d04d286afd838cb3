"""The prefill node (producer): authenticates a decode node over mutual TLS 1.3, prefills its
prompt chunk by chunk, and streams sealed KV tiles while it computes (book 10.7, Figure 10.4).

Per connection: handshake (the client must present a certificate from the CA), peer check by
name + fingerprint, one sealed request, then either a refusal (one line, unsealed: it can only
make the decode node fall back) or the sealed manifest, one sealed tile per plan entry and the
sealed end. NoPE tiles leave as soon as their chunk is computed (a sender thread writes while
the next chunk runs); the SWA tail and the logits follow the last chunk. The producer prefills
with the decode node's own max_context and chunk, so both sides run the same chunking and the
same plane capacities (Gate 3: identical bits by row invariance).
"""

from __future__ import annotations

import logging
import queue
import re
import secrets
import socket
import ssl
import threading
import time
from typing import Any

import numpy as np

from ..errors import HandoffRefused, MuserError
from . import manifest as mf
from . import tiles as codec
from .certs import Certs
from .transport import END, MANIFEST, REFUSE, REQUEST, TILE, Link, send_frame

log = logging.getLogger("muser.handoff")

HEX32 = re.compile(r"^[0-9a-f]{32}$")
MAX_REQUEST = 8 << 20  # a JSON request holds at most context_length token ids


def parse_addr(addr: str) -> tuple[str, int]:
    """HOST:PORT (IPv6 as [::1]:PORT); the host must be named: no wildcard bind by default."""
    m = re.fullmatch(r"\[([0-9a-fA-F:.]+)\]:(\d{1,5})|([^:\[\]]+):(\d{1,5})", addr or "")
    if not m:
        raise MuserError(f"address {addr!r} must be HOST:PORT")
    host, port = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
    if not 0 <= int(port) <= 65535:
        raise MuserError(f"port {port} in {addr!r} is outside [0, 65535]")
    return host, int(port)


def _field(doc: dict, key: str, kind, what: str = "request"):
    v = doc.get(key)
    if not isinstance(v, kind) or isinstance(v, bool) and kind is not bool:
        raise HandoffRefused(f"{what} field {key!r} is missing or not {getattr(kind, '__name__', kind)}: {v!r}")
    return v


def _id_list(v: Any, key: str, vocab: int) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise HandoffRefused(f"request field {key!r} must be a list of token ids")
    bad = [t for t in v if not 0 <= t < vocab]
    if bad:
        raise HandoffRefused(f"request field {key!r}: token id {bad[0]} is outside the vocab [0, {vocab})")
    return v


class _Sender(threading.Thread):
    """Writes queued frames so the next chunk computes while this one is on the wire."""

    def __init__(self, sock: ssl.SSLSocket):
        super().__init__(daemon=True, name="handoff-sender")
        self.sock, self.q = sock, queue.Queue()
        self.error: BaseException | None = None
        self.bytes_out = 0
        self.busy_s = 0.0

    def run(self) -> None:
        while True:
            item = self.q.get()
            if item is None:
                return
            if self.error is None:
                try:
                    t0 = time.perf_counter()
                    self.bytes_out += send_frame(self.sock, *item)
                    self.busy_s += time.perf_counter() - t0
                except (OSError, ssl.SSLError) as e:  # the compute loop sees it and stops
                    self.error = e

    def send(self, kind: int, seq: int, payload: bytes) -> None:
        if self.error is not None:
            raise HandoffRefused(f"link to the decode node failed: {self.error}")
        self.q.put((kind, seq, payload))

    def finish(self) -> None:
        self.q.put(None)
        self.join()
        if self.error is not None:
            raise HandoffRefused(f"link to the decode node failed: {self.error}")


class PrefillNode:
    """`model`: a muser.Model (engine session surface). Serves until close()."""

    def __init__(self, model, certs: Certs, listen: str, allow: list[str] | None = None,
                 stall_s: float = 30.0):
        if certs.name is None:
            raise MuserError("the prefill node needs its own certificate (--name)")
        self.model, self.certs, self.allow = model, certs, allow
        self.stall_s = float(stall_s)
        self.ctx = certs.server_context()
        host, port = parse_addr(listen)
        self.sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                         backlog=16, reuse_port=False)
        self.address = self.sock.getsockname()[:2]
        self._engine_lock = threading.Lock()
        self._closed = threading.Event()
        self.identity = mf.model_identity(model.identity)

    def serve_forever(self) -> None:
        while not self._closed.is_set():
            try:
                conn, peer = self.sock.accept()
            except OSError:
                if self._closed.is_set():
                    return
                raise
            threading.Thread(target=self._serve_one, args=(conn, peer), daemon=True,
                             name="handoff-conn").start()

    def close(self) -> None:
        self._closed.set()
        self.sock.close()

    # -- one connection ------------------------------------------------------------------------
    def _serve_one(self, raw: socket.socket, peer) -> None:
        raw.settimeout(self.stall_s)
        try:
            sock = self.ctx.wrap_socket(raw, server_side=True)
        except (ssl.SSLError, OSError) as e:
            log.warning("handoff from %s refused in the TLS handshake: %s", peer, e)
            raw.close()
            return
        try:
            try:
                name = self.certs.check_peer(sock, self.allow)
                self._stream(sock, name)
            except HandoffRefused as e:
                log.warning("handoff from %s refused: %s", peer, e)
                try:
                    send_frame(sock, REFUSE, 0, str(e).encode("utf-8", "replace")[:4096])
                except (OSError, ssl.SSLError):
                    pass
            except MuserError as e:
                log.warning("handoff from %s failed: %s", peer, e)
                try:
                    send_frame(sock, REFUSE, 0, f"producer failed: {e}".encode("utf-8", "replace")[:4096])
                except (OSError, ssl.SSLError):
                    pass
        except (OSError, ssl.SSLError) as e:
            log.warning("handoff link to %s failed: %s", peer, e)
        finally:
            try:
                sock.close()
            except OSError:
                pass

    def _request(self, link: Link) -> dict:
        fr = link.read(MAX_REQUEST, "request")
        if fr.kind != REQUEST or fr.seq != 0:
            raise HandoffRefused(f"expected the request (kind {REQUEST}, seq 0), got kind {fr.kind} seq {fr.seq}")
        req, _ = mf.open_sealed(self.certs.hmac_key, REQUEST, 0, fr.payload, "request")
        eng = self.model.engine
        cfg = eng.cfg
        if req.get("version") != mf.VERSION:
            raise HandoffRefused(f"request version {req.get('version')!r}, this node speaks {mf.VERSION}")
        for k in ("request", "epoch", "session"):
            if not HEX32.match(_field(req, k, str)):
                raise HandoffRefused(f"request field {k!r} must be 32 lowercase hex digits")
        want = _field(req, "identity", dict)
        if want != self.identity:
            diff = sorted(k for k in set(want) | set(self.identity) if want.get(k) != self.identity.get(k))
            raise HandoffRefused(f"model identity mismatch on {diff}: the decode node has "
                                 f"{ {k: want.get(k) for k in diff} }, this node serves "
                                 f"{ {k: self.identity.get(k) for k in diff} }")
        for k, have in (("lane", eng.lane.value), ("kv", eng.kv), ("device", eng.device.type)):
            if _field(req, k, str) != have:
                raise HandoffRefused(f"the decode node asks for {k} {req[k]!r}, this node serves {have!r}")
        max_context = _field(req, "max_context", int)
        if not 0 < max_context <= cfg.context_length:
            raise HandoffRefused(f"max_context {max_context} is outside [1, {cfg.context_length}]")
        if _field(req, "chunk", int) < 1:
            raise HandoffRefused(f"prefill chunk {req['chunk']} must be >= 1")
        req["history"] = _id_list(req.get("history"), "history", cfg.vocab)
        req["ids"] = _id_list(req.get("ids"), "ids", cfg.vocab)
        return req

    def _stream(self, sock: ssl.SSLSocket, peer_name: str) -> None:
        key = self.certs.hmac_key
        link = Link(sock, self.stall_s)
        req = self._request(link)
        eng = self.model.engine
        history, ids, C = req["history"], req["ids"], req["chunk"]
        cut, n = len(history), len(history) + len(ids)
        with self._engine_lock:
            s = self.model.session(max_context=req["max_context"], chunk=C)  # validates chunk
            layout = codec.layout_of(s)
            plan = mf.plan_tiles(layout, req["max_context"], cut, n, eng.cfg.vocab)
            man = {
                "version": mf.VERSION, "session": req["session"], "request": req["request"],
                "epoch": req["epoch"], "nonce": secrets.token_hex(16), "timestamp": time.time(),
                "identity": self.identity, "lane": eng.lane.value, "kv": eng.kv, "device": eng.device.type,
                "producer": self.certs.name, "consumer": peer_name, "n_tokens": n, "cut": cut,
                "chunk": C, "max_context": req["max_context"], "layout": layout.to_json(),
                "ids_sha256": mf.ids_sha256(history + ids), "tiles": plan,
            }
            sealed = mf.seal(key, MANIFEST, 0, man)
            man_sha = mf.sha256(sealed[mf.TAG_BYTES:])
            sender = _Sender(sock)
            sender.start()
            digests: list[str] = []

            def tile(t: dict, data: bytes) -> None:
                d = dict(t, sha256=mf.sha256(data), manifest=man_sha)
                digests.append(d["sha256"])
                sender.send(TILE, t["seq"], mf.seal_tile(key, TILE, t["seq"], d, data))

            try:
                sender.send(MANIFEST, 0, sealed)
                t0 = time.perf_counter()
                if cut:
                    s.prefill(np.asarray(history, dtype=np.int64))
                nope = [t for t in plan if t["kind"] == "nope"]
                logits = None
                for c in range(cut, n, C):  # the decode node's own chunking from n_past = cut
                    logits = s.prefill(np.asarray(ids[c - cut:min(c + C, n) - cut], dtype=np.int64))
                    while nope and nope[0]["range"][1] <= s.n_past:  # chunk complete: ship it now
                        t = nope.pop(0)
                        tile(t, codec.encode_nope(s, layout, t["chunk"]))
                prefill_s = time.perf_counter() - t0
                compute_done = time.time()
                for t in plan:
                    if t["kind"] == "swa":
                        tile(t, codec.encode_swa(s, layout))
                    elif t["kind"] == "logits":
                        tile(t, codec.encode_logits(logits))
                end = {"seq": len(plan) + 1, "manifest": man_sha, "tiles": digests,
                       "stats": {"prefill_s": prefill_s, "compute_done_unix": compute_done}}
                sender.send(END, len(plan) + 1, mf.seal(key, END, len(plan) + 1, end))
            finally:
                sender.finish()
        log.info("handoff to %s: %d tokens (%d held), %d tiles, %d bytes", peer_name, n, cut, len(plan),
                 sender.bytes_out)
