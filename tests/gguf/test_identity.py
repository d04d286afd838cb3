"""Identity (book 9.13): artifact, tokenizer-surface and template SHA-256s, dual EOG, pins."""

from __future__ import annotations

import hashlib
import json

import pytest

from muser.errors import IdentityMismatch
from muser.gguf.identity import artifact_sha256, identity_of, tokenizer_sha256, write_pin
from muser.gguf.reader import read_gguf
from muser.model.loader import open_model
from muser.model.synth import CHAT_TEMPLATE, SynthSpec


def test_artifact_hash_is_the_file_sha256(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("MUSER_CACHE", str(tmp_path / "cache"))
    want = hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    assert artifact_sha256(tiny_gguf) == want
    assert (tmp_path / "cache" / "artifact-sha256.json").exists()
    assert artifact_sha256(tiny_gguf) == want  # from the cache


def test_identity_surfaces(make_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("MUSER_CACHE", str(tmp_path / "cache"))
    a, b = make_gguf(SynthSpec()), make_gguf(SynthSpec(dtype="F16"))
    with read_gguf(a) as fa, read_gguf(b) as fb:
        ia, ib = identity_of(fa, {1, 2}), identity_of(fb, {1, 2})
        # Same tokenizer and template, different artifact.
        assert ia.tokenizer_sha256 == ib.tokenizer_sha256 == tokenizer_sha256(fa)
        assert ia.template_sha256 == ib.template_sha256 == hashlib.sha256(CHAT_TEMPLATE.encode()).hexdigest()
        assert ia.template_bytes == len(CHAT_TEMPLATE.encode())
        assert ia.artifact_sha256 != ib.artifact_sha256
        assert ia.eog_ids == (1, 2)
        assert ia.dtype_mix == {"F32": 59} and ib.dtype_mix == {"F16": 34, "F32": 25}
    c = make_gguf(SynthSpec(vocab_target=300))
    with read_gguf(c) as fc:
        assert tokenizer_sha256(fc) != ia.tokenizer_sha256


def test_pin_accepts_and_refuses(tiny_gguf, make_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("MUSER_CACHE", str(tmp_path / "cache"))
    m = open_model(tiny_gguf)
    pin = write_pin(m.identity, tmp_path / "pin.json")
    m.close()
    open_model(tiny_gguf, pin=pin).close()
    open_model(tiny_gguf, pin={"tokenizer_sha256": json.loads(pin.read_text())["tokenizer_sha256"]}).close()
    other = make_gguf(SynthSpec(dtype="F16"))
    with pytest.raises(IdentityMismatch) as ei:
        open_model(other, pin=pin)
    msg = str(ei.value)
    assert "artifact_sha256" in msg and json.loads(pin.read_text())["artifact_sha256"] in msg
    with pytest.raises(IdentityMismatch, match="template_sha256"):
        open_model(tiny_gguf, pin={"template_sha256": "0" * 64})
    with pytest.raises(IdentityMismatch, match="unknown field"):
        open_model(tiny_gguf, pin={"artefact": "x"})
    with pytest.raises(IdentityMismatch, match="empty"):
        open_model(tiny_gguf, pin={})
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(IdentityMismatch, match="not valid JSON"):
        open_model(tiny_gguf, pin=bad)
