"""The decode node's side (receiver): RemotePrefill asks a prefill node for a prompt's KV,
scatters each authenticated tile on arrival into a detached plane generation, validates it
complete and swaps it in atomically; decode then starts at n_past = prompt length (book 10.7,
Figure 10.4). On any refusal or a dead link it prefills locally, logs why, and still returns
the logits.

    rp = RemotePrefill("10.0.0.2:7070", certs_dir, name="decode", peer="prefill",
                       ledger="state/handoff-ledger.json")
    logits = rp.prefill(session, ids)                      # cold: the whole prompt remotely
    logits = rp.prefill(session, suffix, history=held)     # delta: the held prefix is not sent

Order of checks (each refusal leaves the live planes as they were): TLS 1.3 handshake against
the CA, the producer's name + fingerprint, the manifest's HMAC seal, its version, request,
session, identity, lane, KV type, range and tile plan (recomputed here, must match exactly),
then the replay ledger (epoch, timestamp window, nonce; durable before any byte is written);
each tile's frame order, seal, descriptor and SHA-256 before its rows are written; the end
seal's digest list before the commit.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import ssl
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import HandoffRefused, KvStateError
from ..kv.serial import KIND_NOPE, KIND_SWA, decode_tile
from . import manifest as mf
from . import tiles as codec
from .certs import Certs
from .ledger import DEFAULT_WINDOW_S, ReplayLedger
from .producer import parse_addr
from .transport import END, MANIFEST, REFUSE, REQUEST, TILE, Link, send_frame

log = logging.getLogger("muser.handoff")

MAX_DOC = 8 << 20  # manifest / end seal (the plan lists one entry per 512 tokens)
MAX_REFUSAL = 4096
TILE_OVERHEAD = 64 << 10  # seal + descriptor


@dataclass
class Outcome:
    """What the last prefill did: "remote" or "local" (with the refusal reason), and figures."""

    path: str
    reason: str | None = None
    n_tokens: int = 0
    cut: int = 0
    kv_bytes: int = 0  # K/V row bytes in the tiles received
    tile_bytes: int = 0  # tile bytes (serial headers, layer index and digests included) + logits
    wire_bytes: int = 0  # everything read from the link: frames, seals, descriptors
    ttft_s: float = 0.0
    producer_prefill_s: float | None = None
    compute_done_unix: float | None = None
    arrivals: list[tuple[int, str, int, float]] = field(default_factory=list)  # (seq, kind, bytes, unix)


class RemotePrefill:
    def __init__(self, addr: str, certs: Certs | str | os.PathLike, name: str | None = "decode",
                 peer: str = "prefill", ledger: ReplayLedger | str | os.PathLike | None = None,
                 stall_s: float = 30.0, deadline_s: float | None = None, connect_timeout_s: float = 5.0,
                 fallback: bool = True, window_s: float = DEFAULT_WINDOW_S):
        self.host, self.port = parse_addr(addr)
        self.certs = certs if isinstance(certs, Certs) else Certs.load(certs, name)
        self.peer = peer
        if ledger is None:
            ledger = self.certs.directory / f"ledger-{self.certs.name or 'anonymous'}.json"
        self.ledger = ledger if isinstance(ledger, ReplayLedger) else ReplayLedger(Path(ledger), window_s)
        self.stall_s, self.deadline_s = float(stall_s), deadline_s
        self.connect_timeout_s = float(connect_timeout_s)
        self.fallback = fallback
        self.ctx = self.certs.client_context()
        self.last: Outcome | None = None

    def prefill(self, session, ids, history=None) -> np.ndarray:
        """Logits [vocab] of the last of `ids`, with the session's KV holding history + ids.
        `history`: the tokens the session already holds (len == session.n_past), not sent as KV."""
        a = session.check(ids, "prefill")  # the session's own validation, before any work
        held = [] if history is None else [int(t) for t in np.asarray(history).reshape(-1)]
        if len(held) != session.n_past:
            raise KvStateError(f"history has {len(held)} tokens but the session holds {session.n_past}")
        t0 = time.perf_counter()
        try:
            logits = self._remote(session, held, [int(t) for t in a], t0)
            return logits
        except HandoffRefused as e:
            self.last = Outcome("local", str(e), n_tokens=len(held) + len(a), cut=len(held))
            if not self.fallback:
                raise
            log.warning("remote prefill from %s:%d refused, prefilling locally: %s", self.host, self.port, e)
        logits = session.prefill(a)
        self.last.ttft_s = time.perf_counter() - t0
        return logits

    # -- the exchange --------------------------------------------------------------------------
    def _connect(self) -> ssl.SSLSocket:
        try:
            raw = socket.create_connection((self.host, self.port), timeout=self.connect_timeout_s)
        except OSError as e:
            raise HandoffRefused(f"cannot reach the prefill node {self.host}:{self.port}: "
                                 f"{e.strerror or e}") from None
        raw.settimeout(self.stall_s)
        try:
            sock = self.ctx.wrap_socket(raw, server_hostname=self.peer)
        except (ssl.SSLError, OSError) as e:
            raw.close()
            raise HandoffRefused(f"TLS handshake with {self.host}:{self.port} failed: {e}") from None
        try:
            self.certs.check_peer(sock, [self.peer])
        except HandoffRefused:
            sock.close()
            raise
        return sock

    def _remote(self, session, history: list[int], ids: list[int], t0: float) -> np.ndarray:
        eng, cfg = session.engine, session.cfg
        if session.capture_layers:  # the drafter's hidden-state capture is computed, not shipped
            raise HandoffRefused(f"the session captures layer inputs {list(session.capture_layers)}, which a "
                                 "handoff does not carry")
        key = self.certs.hmac_key
        cut, n = len(history), len(history) + len(ids)
        plan = mf.plan_tiles(codec.layout_of(session), session.max_context, cut, n, cfg.vocab)
        ident = mf.model_identity(eng.model_file.identity)
        req = {"version": mf.VERSION, "request": secrets.token_hex(16), "epoch": self.ledger.epoch,
               "session": secrets.token_hex(16), "identity": ident, "lane": eng.lane.value, "kv": eng.kv,
               "device": eng.device.type,
               "max_context": session.max_context, "chunk": session.chunk, "history": history, "ids": ids}
        deadline = None if self.deadline_s is None else time.monotonic() + self.deadline_s
        out = Outcome("remote", n_tokens=n, cut=cut)
        sock = self._connect()
        try:
            link = Link(sock, self.stall_s, deadline)
            try:
                send_frame(sock, REQUEST, 0, mf.seal(key, REQUEST, 0, req))
            except ssl.SSLError as e:
                raise HandoffRefused(f"TLS error while sending the request: {e}") from None
            except OSError as e:
                raise HandoffRefused(f"sending the request failed: {e.strerror or e}") from None
            try:
                install, logits = self._receive(session, link, req, plan, out)
                session.commit(install)  # one swap; validate_complete ran already (muser.kv)
            except KvStateError as e:  # rows that do not fit the install: nothing was swapped in
                raise HandoffRefused(f"the streamed KV does not install: {e}") from None
            session.logits = logits.copy()
        finally:
            sock.close()
        out.wire_bytes = link.bytes_in
        out.ttft_s = time.perf_counter() - t0
        self.last = out
        return logits

    def _frame(self, link: Link, limit: int, what: str):
        fr = link.read({MANIFEST: limit, TILE: limit, END: limit, REFUSE: MAX_REFUSAL}, what)
        if fr.kind == REFUSE:
            raise HandoffRefused(f"the prefill node refused: {bytes(fr.payload).decode('utf-8', 'replace')}")
        return fr

    def _receive(self, session, link: Link, req: dict, plan: list[dict], out: Outcome):
        key, cfg = self.certs.hmac_key, session.cfg
        cut, n = len(req["history"]), len(req["history"]) + len(req["ids"])
        fr = self._frame(link, MAX_DOC, "manifest")
        if fr.kind != MANIFEST or fr.seq != 0:
            raise HandoffRefused(f"expected the manifest (seq 0) first, got kind {fr.kind} seq {fr.seq}")
        man, body = mf.open_sealed(key, MANIFEST, 0, fr.payload, "manifest")
        if man.get("version") != mf.VERSION:
            raise HandoffRefused(f"manifest version {man.get('version')!r}, this node speaks {mf.VERSION}")
        if man.get("request") != req["request"] or man.get("session") != req["session"]:
            raise HandoffRefused(f"manifest answers request {str(man.get('request'))[:32]!r}, not this one "
                                 f"({req['request']}): a replayed or misrouted stream")
        expect = {"identity": req["identity"], "lane": req["lane"], "kv": req["kv"], "device": req["device"],
                  "n_tokens": n, "cut": cut,
                  "chunk": req["chunk"], "max_context": req["max_context"],
                  "ids_sha256": mf.ids_sha256(req["history"] + req["ids"]), "producer": self.peer}
        for k, v in expect.items():
            if man.get(k) != v:
                raise HandoffRefused(f"manifest {k} is {str(man.get(k))[:200]!r}, expected {str(v)[:200]!r}")
        if man.get("tiles") != plan:
            raise HandoffRefused("manifest tile plan differs from the plan for this prompt and geometry")
        # replay: epoch, timestamp window, nonce -- durable before any byte is written
        self.ledger.admit(man.get("nonce"), man.get("timestamp"), man.get("epoch"))
        man_sha = mf.sha256(body)
        out.arrivals.append((0, "manifest", fr.wire_bytes, time.time()))

        install = session.begin_install(n)
        if cut:  # delta: the held span comes from the live planes at the exact ring mapping
            for il in range(cfg.n_layers):
                a, _ = install.expected(il)
                if a < cut:
                    k, v = codec.rows(session, il, a, cut)
                    install.put(il, a, k, v)
        layout = codec.layout_of(session)
        limit = max(t["nbytes"] for t in plan) + TILE_OVERHEAD
        digests: list[str] = []
        logits = None
        for t in plan:
            fr = self._frame(link, limit, f"tile seq {t['seq']}")
            if fr.kind != TILE or fr.seq != t["seq"]:
                raise HandoffRefused(f"frame out of order: expected tile seq {t['seq']}, got kind {fr.kind} "
                                     f"seq {fr.seq} (reordered, duplicated or dropped)")
            desc, data = mf.open_tile(key, TILE, t["seq"], fr.payload, f"tile seq {t['seq']}")
            if desc != dict(t, sha256=desc.get("sha256"), manifest=man_sha):
                raise HandoffRefused(f"tile seq {t['seq']}: descriptor does not match the manifest's plan")
            if len(data) != t["nbytes"] or mf.sha256(data) != desc["sha256"]:
                raise HandoffRefused(f"tile seq {t['seq']}: payload SHA-256 mismatch (tampered tile)")
            if t["kind"] == "logits":
                logits = codec.decode_logits(data, cfg.vocab)
                if not np.isfinite(logits).all():
                    raise HandoffRefused("the shipped logits are not finite (book 10.9)")
            else:
                out.kv_bytes += self._scatter(session, install, layout, t, data, cut)
            digests.append(desc["sha256"])
            out.tile_bytes += len(data)
            out.arrivals.append((t["seq"], t["kind"], fr.wire_bytes, time.time()))
        seq = len(plan) + 1
        fr = self._frame(link, MAX_DOC, "end seal")
        if fr.kind != END or fr.seq != seq:
            raise HandoffRefused(f"expected the end seal (seq {seq}), got kind {fr.kind} seq {fr.seq}")
        end, _ = mf.open_sealed(key, END, seq, fr.payload, "end seal")
        if end.get("seq") != seq or end.get("manifest") != man_sha or end.get("tiles") != digests:
            raise HandoffRefused("end seal does not list the tiles received under this manifest")
        stats = end.get("stats") if isinstance(end.get("stats"), dict) else {}
        out.producer_prefill_s = stats.get("prefill_s")
        out.compute_done_unix = stats.get("compute_done_unix")
        out.arrivals.append((seq, "end", fr.wire_bytes, time.time()))
        install.validate_complete()
        return install, logits

    @staticmethod
    def _scatter(session, install, layout, t: dict, data, cut: int) -> int:
        """Parse one serial tile (strict) and write its rows at or after `cut` into the detached
        install; rows below `cut` (the chunk or tail reaching into the held prefix) must equal
        the held rows bit for bit, else the producer computed another prefix. Returns K/V bytes."""
        try:
            tile = decode_tile(data, layout, KIND_NOPE if t["kind"] == "nope" else KIND_SWA)
        except KvStateError as e:
            raise HandoffRefused(f"tile seq {t['seq']}: {e}") from None
        a, b = t["range"]
        if (tile.start, tile.start + tile.rows, tile.n_tokens, list(tile.layers)) != (a, b, b, t["layers"]):
            raise HandoffRefused(f"tile seq {t['seq']}: rows [{tile.start}, {tile.start + tile.rows}) of "
                                 f"layers {list(tile.layers)} where the plan has [{a}, {b}) of {t['layers']}")
        lo = max(a, cut)
        for il, k, v in zip(tile.layers, tile.keys, tile.values):
            if a < cut:
                hk, hv = codec.rows(session, il, a, cut)
                if not (codec.same_bits(hk, k[:cut - a]) and codec.same_bits(hv, v[:cut - a])):
                    raise HandoffRefused(f"tile seq {t['seq']}: layer {il} rows [{a}, {cut}) differ from the held "
                                         "prefix: the producer computed another history")
            if lo < b:
                install.put(il, lo, k[lo - a:], v[lo - a:])
        return 2 * len(tile.layers) * tile.rows * layout.row_bytes
