"""Seals, strict parsing, the tile plan vs book 15.7's byte formula, the ledger, the codec."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

from muser.errors import HandoffRefused
from muser.handoff import manifest as mf
from muser.handoff import tiles
from muser.handoff.ledger import ReplayLedger
from muser.handoff.transport import MANIFEST, TILE

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
@pytest.mark.parametrize("cut,n", [(0, 1), (0, 1100), (600, 1100), (1000, 1001), (0, 40)])
def test_plan_matches_formula(kv, cut, n):
    cfg = SimpleNamespace(kv_dim=64, swa_pattern=(True, True, True, False) * 2, sliding_window=64, vocab=384,
                          n_full=2, n_swa=6)
    plan = mf.plan_tiles(cfg, 2048, cut, n, 512, kv)
    assert sum(t["nbytes"] for t in plan) == mf.payload_formula(cfg, 2048, cut, n, kv)
    nope = [t for t in plan if t["kind"] == "nope"]
    assert [t["range"] for t in nope] == [[c, min(c + 512, n)] for c in range(cut, n, 512)]
    swa = [t for t in plan if t["kind"] == "swa"]
    assert [t["layers"] for t in swa] == [[0, 4], [1, 5], [2, 6]]
    assert all(t["range"] == [max(cut, n - 64), n] for t in swa)
    assert [t["seq"] for t in plan] == list(range(1, len(plan) + 1)) and plan[-1]["kind"] == "logits"
    with pytest.raises(HandoffRefused):
        mf.plan_tiles(cfg, 2048, n, n, 512, kv)


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


@pytest.mark.parametrize("dtype", ["f16", "f32"])
def test_codec_roundtrip(dtype):
    rng = np.random.default_rng(0)
    npd = np.float16 if dtype == "f16" else np.float32
    rows = [(rng.standard_normal((5, 8)).astype(npd), rng.standard_normal((5, 8)).astype(npd)) for _ in range(3)]
    data = tiles.encode_rows(rows)
    back = tiles.decode_rows(memoryview(data), {"shape": [3, 2, 5, 8], "dtype": dtype, "seq": 1})
    for (k, v), (k2, v2) in zip(rows, back):
        assert np.array_equal(k, k2) and np.array_equal(v, v2)
    with pytest.raises(HandoffRefused, match="bytes, expected"):
        tiles.decode_rows(memoryview(data[:-1]), {"shape": [3, 2, 5, 8], "dtype": dtype, "seq": 1})
