"""Every refusal leaves the live planes exactly as they were (no partial KV visible), names its
reason, and with fallback on the caller still gets the local answer, bit for bit."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from muser.errors import HandoffRefused
from muser.handoff import Certs, RemotePrefill
from muser.handoff.transport import Frame

from .conftest import ByteProxy, Relay, assert_unchanged, plane_state, prompt

HELD, NEW = 40, 100  # a held prefix (delta handoff) so "unchanged" covers real live rows
CHUNK = 64  # NoPE chunk tiles 0, 1, 2 (chunk 0 reaches into the held prefix)


@pytest.fixture(scope="module")
def reference(models):
    """Local prefill of HELD + NEW: the answer every fallback must deliver."""
    m = models["f16"]
    ids = prompt(HELD + NEW, seed=11)
    s = m.session(max_context=512, chunk=CHUNK)
    s.prefill(ids[:HELD])
    return ids, s.prefill(ids[HELD:])


def _attempt(models, addr, certs, tmp_path, ids, **kw):
    m = models[kw.pop("model", "f16")]
    s = m.session(max_context=512, chunk=CHUNK)
    s.prefill(ids[:HELD])
    before = plane_state(s)
    rp = RemotePrefill(addr, certs, ledger=tmp_path / "ledger.json", fallback=False, **kw)
    with pytest.raises(HandoffRefused) as err:
        rp.prefill(s, ids[HELD:], history=ids[:HELD])
    assert_unchanged(s, before)
    assert s.n_past == HELD
    return str(err.value), rp, s


def _fallback(rp, s, ids, want, caplog):
    rp.fallback = True
    with caplog.at_level(logging.WARNING, logger="muser.handoff"):
        got = rp.prefill(s, ids[HELD:], history=ids[:HELD])
    assert rp.last.path == "local" and rp.last.reason
    assert "prefilling locally" in caplog.text
    assert np.array_equal(got, want) and s.n_past == HELD + NEW


def _flip(fr: Frame, at: int) -> Frame:
    b = bytearray(fr.payload)
    b[at] ^= 0x40
    return Frame(fr.kind, fr.seq, bytes(b))


MUTATIONS = {
    "tile-byte": (lambda f: [f[0], _flip(f[1], len(f[1].payload) - 7)] + f[2:], "SHA-256 mismatch"),
    "manifest-byte": (lambda f: [_flip(f[0], 40)] + f[1:], "manifest .*HMAC"),
    "tile-descriptor-byte": (lambda f: [f[0], _flip(f[1], 40)] + f[2:], "tile seq 1 .*HMAC"),
    "reordered": (lambda f: [f[0], f[2], f[1]] + f[3:], "out of order"),
    "duplicated": (lambda f: [f[0], f[1], f[1]] + f[2:], "out of order"),
    "dropped-end": (lambda f: f[:-1], "closed the link|TLS|EOF"),
}


@pytest.mark.parametrize("case", sorted(MUTATIONS))
def test_tampered_stream(case, nodes, models, certs_dir, tmp_path, reference, caplog):
    ids, want = reference
    mutate, reason = MUTATIONS[case]
    relay = Relay(certs_dir, nodes["f16"].addr, mutate)
    msg, rp, s = _attempt(models, relay.addr, certs_dir, tmp_path, ids)
    relay.thread.join(10)
    assert relay.error is None, relay.error
    assert len(relay.recorded) == 1 + 3 + 1 + 1 + 1  # manifest, NoPE chunks 0-2, SWA tail, logits, end
    import re

    assert re.search(reason, msg), msg
    _fallback(rp, s, ids, want, caplog)


def test_replayed_stream(nodes, models, certs_dir, tmp_path, reference, caplog):
    ids, want = reference
    first = Relay(certs_dir, nodes["f16"].addr, lambda f: f)
    s = models["f16"].session(max_context=512, chunk=CHUNK)
    s.prefill(ids[:HELD])
    RemotePrefill(first.addr, certs_dir, ledger=tmp_path / "ledger.json", fallback=False).prefill(
        s, ids[HELD:], history=ids[:HELD])
    first.thread.join(10)
    recorded = first.recorded
    again = Relay(certs_dir, nodes["f16"].addr, lambda f: recorded)  # the same sealed frames again
    msg, rp, s = _attempt(models, again.addr, certs_dir, tmp_path, ids)
    assert "replayed" in msg
    _fallback(rp, s, ids, want, caplog)


def test_stale_timestamp(nodes, models, certs_dir, tmp_path, reference, caplog):
    ids, want = reference
    relay = Relay(certs_dir, nodes["f16"].addr, lambda f: f, hold_manifest_s=1.5)
    msg, rp, s = _attempt(models, relay.addr, certs_dir, tmp_path, ids, window_s=1.0)
    assert "stale manifest" in msg
    _fallback(rp, s, ids, want, caplog)


def test_no_client_certificate(nodes, models, certs_dir, tmp_path, reference, caplog):
    ids, want = reference
    msg, rp, s = _attempt(models, nodes["f16"].addr, Certs.load(certs_dir, None), tmp_path, ids)
    assert "TLS" in msg or "closed" in msg
    _fallback(rp, s, ids, want, caplog)


def test_certificate_from_another_ca(nodes, models, certs_dir, other_ca, tmp_path, reference, caplog):
    ids, want = reference
    msg, rp, s = _attempt(models, nodes["f16"].addr, other_ca, tmp_path, ids)
    assert "TLS handshake" in msg and "certificate verify failed" in msg
    _fallback(rp, s, ids, want, caplog)


def test_another_models_identity(nodes, models, certs_dir, tmp_path, caplog):
    other = models["other"]
    ids = prompt(HELD + NEW, seed=11)
    ref = other.session(max_context=512, chunk=CHUNK)
    ref.prefill(ids[:HELD])
    want = ref.prefill(ids[HELD:])
    msg, rp, s = _attempt(models, nodes["f16"].addr, certs_dir, tmp_path, ids, model="other")
    assert "model identity mismatch" in msg and "artifact_sha256" in msg
    _fallback(rp, s, ids, want, caplog)


def test_wrong_kv_type(nodes, models, certs_dir, tmp_path, reference):
    ids, _ = reference
    msg, _, _ = _attempt(models, nodes["f32"].addr, certs_dir, tmp_path, ids)
    assert "kv 'f16'" in msg


def test_stalled_link(nodes, models, certs_dir, tmp_path, reference, caplog):
    ids, want = reference
    proxy = ByteProxy(nodes["f16"].addr, limit=3000)  # past the handshake, then silence
    msg, rp, s = _attempt(models, proxy.addr, certs_dir, tmp_path, ids, stall_s=1.0)
    proxy.stop.set()
    assert "stalled" in msg
    _fallback(rp, s, ids, want, caplog)


def test_slow_link_deadline(nodes, models, certs_dir, tmp_path, reference, caplog):
    ids, want = reference
    proxy = ByteProxy(nodes["f16"].addr, limit=1 << 30, bytes_per_s=20_000)  # ~60 KB at 20 KB/s
    msg, rp, s = _attempt(models, proxy.addr, certs_dir, tmp_path, ids, deadline_s=1.0)
    proxy.stop.set()
    assert "deadline" in msg
    _fallback(rp, s, ids, want, caplog)


def test_dead_producer(models, certs_dir, tmp_path, reference, caplog):
    ids, want = reference
    msg, rp, s = _attempt(models, "127.0.0.1:1", certs_dir, tmp_path, ids)
    assert "cannot reach" in msg
    _fallback(rp, s, ids, want, caplog)


def test_producer_killed_mid_stream(nodes, models, certs_dir, tmp_path, reference, caplog):
    ids, want = reference
    node = nodes["f16-victim"]
    try:
        # past the handshake and the manifest, inside the tiles: the node dies (SIGKILL)
        proxy = ByteProxy(node.addr, limit=12_000, on_limit=node.proc.kill)
        msg, rp, s = _attempt(models, proxy.addr, certs_dir, tmp_path, ids)
        proxy.stop.set()
        assert node.proc.wait(10) != 0
    finally:
        node.stop()
    assert "closed the link" in msg or "TLS" in msg or "failed" in msg, msg
    _fallback(rp, s, ids, want, caplog)


def _reseal(key: bytes, edit):
    """A producer holding the sealing key that lies in its manifest: edit the parsed manifest,
    seal it again (the receiver's own checks must catch what the seal cannot)."""
    from muser.handoff import manifest as mf
    from muser.handoff.transport import MANIFEST

    def mutate(frames):
        doc, _ = mf.open_sealed(key, MANIFEST, 0, frames[0].payload, "manifest")
        edit(doc)
        return [Frame(MANIFEST, 0, mf.seal(key, MANIFEST, 0, doc))] + frames[1:]

    return mutate


def _set(path, value):
    def edit(doc):
        d = doc
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = value
    return edit


RESEALED = {
    "identity": (("identity", "artifact_sha256"), "0" * 64, "manifest identity"),
    "kv": (("kv",), "f32", "manifest kv"),
    "history": (("ids_sha256",), "0" * 64, "manifest ids_sha256"),
    "plan": (("tiles", 0, "range"), [0, 1], "tile plan differs"),
    "epoch": (("epoch",), "f" * 32, "epoch"),
    "nonce": (("nonce",), "not-hex", "nonce"),
}


@pytest.mark.parametrize("case", sorted(RESEALED))
def test_lying_manifest(case, nodes, models, certs_dir, tmp_path, reference, caplog):
    ids, want = reference
    path, value, reason = RESEALED[case]
    key = Certs.load(certs_dir, "decode").hmac_key
    relay = Relay(certs_dir, nodes["f16"].addr, _reseal(key, _set(path, value)))
    msg, rp, s = _attempt(models, relay.addr, certs_dir, tmp_path, ids)
    assert reason in msg, msg
    _fallback(rp, s, ids, want, caplog)


def test_history_differs_from_held_rows(nodes, models, certs_dir, tmp_path, reference):
    """The caller names a history the session does not hold: the tile that straddles the cut
    carries rows computed from that history, which differ from the held rows: refused."""
    ids, _ = reference
    s = models["f16"].session(max_context=512, chunk=CHUNK)
    s.prefill(ids[:HELD])
    before = plane_state(s)
    rp = RemotePrefill(nodes["f16"].addr, certs_dir, ledger=tmp_path / "ledger.json", fallback=False)
    wrong = [(t + 1) % 300 for t in ids[:HELD]]
    with pytest.raises(HandoffRefused, match="differ from the held prefix"):
        rp.prefill(s, ids[HELD:], history=wrong)
    assert_unchanged(s, before)


def test_caller_errors_are_not_fallbacks(nodes, models, certs_dir, tmp_path):
    """Bad input is the caller's typed error before any work; a capturing session falls back."""
    from muser.errors import KvStateError, TokenOutOfRange

    m = models["f16"]
    rp = RemotePrefill(nodes["f16"].addr, certs_dir, ledger=tmp_path / "ledger.json", fallback=False)
    s = m.session(max_context=512, chunk=CHUNK)
    with pytest.raises(TokenOutOfRange):
        rp.prefill(s, [m.config.vocab])
    s.prefill([7, 8, 9])
    with pytest.raises(KvStateError, match="history has 0 tokens but the session holds 3"):
        rp.prefill(s, [10])
    cap = m.session(max_context=512, chunk=CHUNK, capture=[1])
    with pytest.raises(HandoffRefused, match="captures layer inputs"):
        rp.prefill(cap, [7, 8, 9])
    assert cap.n_past == 0
