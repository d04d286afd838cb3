"""Seals, strict parsing, the tile plan vs book 15.7's byte formula, the ledger, the codec."""

from __future__ import annotations

import time

import numpy as np
import pytest

from muser.errors import HandoffRefused
from muser.handoff import manifest as mf
from muser.handoff import tiles
from muser.handoff.ledger import ReplayLedger
from muser.handoff.transport import MANIFEST, TILE
from muser.kv.serial import KvLayout

KEY = bytes(range(32))


def test_seal_binds_bytes_kind_seq_and_key():
    sealed = mf.seal(KEY, MANIFEST, 0, {"a": 1, "b": [1, 2]})
    doc, body = mf.open_sealed(KEY, MANIFEST, 0, sealed, "m")
    assert doc == {"a": 1, "b": [1, 2]} and body == b'{"a":1,"b":[1,2]}'
    for i in (0, 31, 32, len(sealed) - 1):
        bad = bytearray(sealed)
        bad[i] ^= 1
        with pytest.raises(HandoffRefused, match="HMAC"):
            mf.open_sealed(KEY, MANIFEST, 0, bytes(bad), "m")
    for kind, seq, key in ((TILE, 0, KEY), (MANIFEST, 1, KEY), (MANIFEST, 0, bytes(32))):
        with pytest.raises(HandoffRefused, match="HMAC"):
            mf.open_sealed(key, kind, seq, sealed, "m")
    t = mf.seal_tile(KEY, TILE, 3, {"sha256": mf.sha256(b"xyz")}, b"xyz")
    desc, data = mf.open_tile(KEY, TILE, 3, t, "t")
    assert bytes(data) == b"xyz" and desc["sha256"] == mf.sha256(b"xyz")


def test_strict_parse():
    for body in (b'{"a":1,"a":2}', b'{"a":NaN}', b"[1]", b"\xff"):
        with pytest.raises(HandoffRefused):
            mf.parse(body, "doc")


@pytest.mark.parametrize("kv", ["f16", "f32"])
@pytest.mark.parametrize("cut,n", [(0, 1), (0, 1100), (600, 1100), (1024, 1025), (0, 40)])
def test_plan_matches_formula(kv, cut, n):
    layout = KvLayout((True, True, True, False) * 2, 64, 2, 32, kv)
    plan = mf.plan_tiles(layout, 2048, cut, n, 384)
    nope = [t for t in plan if t["kind"] == "nope"]
    assert [t["range"] for t in nope] == [[c * 512, min(c * 512 + 512, n)] for c in range(cut // 512, -(-n // 512))]
    swa = [t for t in plan if t["kind"] == "swa"]
    assert len(swa) == 1 and swa[0]["layers"] == [0, 1, 2, 4, 5, 6] and swa[0]["range"] == [max(0, n - 64), n]
    assert [t["seq"] for t in plan] == list(range(1, len(plan) + 1)) and plan[-1]["kind"] == "logits"
    # the plan's tile bytes are book 15.7's K/V bytes plus serial's fixed per-tile framing
    framing = sum(64 + 8 * -(-2 * len(t["layers"]) // 8) + 32 for t in plan[:-1])
    assert sum(t["nbytes"] for t in plan[:-1]) == mf.kv_rows_formula(layout, cut, n) + framing
    if cut == 0:
        assert mf.kv_rows_formula(layout, 0, n) == layout.state_bytes(n)
    with pytest.raises(HandoffRefused):
        mf.plan_tiles(layout, 2048, n, n, 384)


def test_ledger(tmp_path):
    p = tmp_path / "ledger.json"
    led = ReplayLedger(p, window_s=10)
    now = time.time()
    led.admit("a" * 32, now, led.epoch)
    with pytest.raises(HandoffRefused, match="replayed"):
        led.admit("a" * 32, now, led.epoch)
    again = ReplayLedger(p, window_s=10)  # persisted: a new process sees the same record
    assert again.epoch == led.epoch
    with pytest.raises(HandoffRefused, match="replayed"):
        again.admit("a" * 32, now + 1, led.epoch)
    with pytest.raises(HandoffRefused, match="stale"):
        again.admit("b" * 32, now - 11, led.epoch)
    with pytest.raises(HandoffRefused, match="stale"):
        again.admit("b" * 32, now + 11, led.epoch)
    with pytest.raises(HandoffRefused, match="epoch"):
        again.admit("b" * 32, now, "0" * 32)
    with pytest.raises(HandoffRefused, match="nonce"):
        again.admit("B" * 32, now, led.epoch)
    # entries older than the window are pruned (their timestamps are refused as stale anyway)
    again.admit("c" * 32, now + 20, led.epoch, now=now + 20)
    assert "a" * 32 not in p.read_text()
    old = again.epoch
    assert again.rotate() != old
    with pytest.raises(HandoffRefused, match="epoch"):
        again.admit("d" * 32, now, old)


def test_tiles_are_serial_bytes(models):
    """Tiles cut from live planes are byte for byte muser.kv.serial's tiles of the snapshot."""
    from muser.kv.serial import encode_tiles

    s = models["f16"].session(max_context=512, chunk=64)
    s.prefill(np.arange(6, 6 + 150) % 300)
    layout = tiles.layout_of(s)
    ours = [tiles.encode_nope(s, layout, c) for c in range(3)] + [tiles.encode_swa(s, layout)]
    assert ours == encode_tiles(s.cache.snapshot(), layout)
