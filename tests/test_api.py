"""The public surface: muser.load (fails closed), Model.config / identity / tokenizer / chat /
session, default_model_path."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import muser
from muser import api
from muser.errors import IdentityMismatch, LaneError, MuserError
from muser.model.config import MuseConfig


@pytest.fixture(scope="module")
def model(tiny_gguf):
    return muser.load(tiny_gguf, device="cpu", lane="exact", kv="f32")


def test_load_exposes_config_identity_and_sessions(model, tiny_gguf):
    assert isinstance(model.config, MuseConfig)
    assert model.config.n_layers == 4 and model.config.head_dim == 32
    ident = model.identity
    assert len(ident.artifact_sha256) == 64
    assert (model.device, model.lane, model.kv) == ("cpu", "exact", "f32")
    s = model.session(max_context=64)
    last = s.prefill([0, 10, 11, 12])
    assert last.dtype == np.float32 and last.shape == (model.config.vocab,)
    assert s.n_past == 4
    nxt = s.decode(int(np.argmax(last)))
    assert nxt.shape == (model.config.vocab,) and s.n_past == 5
    cp = s.checkpoint()
    s.decode(7)
    s.rollback(cp)
    assert s.n_past == 5


def test_load_refuses_unknown_choices_before_reading(tmp_path):
    missing = tmp_path / "nope.gguf"
    for kw, what in ((dict(lane="turbo"), "turbo"), (dict(device="tpu"), "tpu"), (dict(kv="bf16"), "bf16")):
        with pytest.raises(LaneError, match=what):
            muser.load(missing, **kw)
    with pytest.raises(MuserError):
        muser.load(missing)  # then the file itself is refused with a typed error


def test_pin_mismatch_is_refused(tiny_gguf, tmp_path):
    pin = tmp_path / "pin.json"
    pin.write_text(json.dumps({"artifact_sha256": "0" * 64}))
    with pytest.raises(IdentityMismatch, match="artifact_sha256"):
        muser.load(tiny_gguf, pin=pin)


def test_tokenizer_and_chat(model):
    ids = model.tokenizer.encode("Beautiful is better than ugly.")
    assert ids and all(0 <= i < model.config.vocab for i in ids)
    assert model.tokenizer.decode(ids) == "Beautiful is better than ugly."
    text = model.chat([{"role": "user", "content": "hi"}])
    assert text.startswith("<|begin_of_text|><|start_header|>user<|end_header|>")
    assert text.endswith("<|start_header|>assistant<|end_header|>\n\n")
    assert not model.chat([{"role": "user", "content": "hi"}], add_generation_prompt=False).endswith("\n\n")


def test_generate_refuses_a_draft(model):
    with pytest.raises(LaneError, match="draft"):
        next(model.generate("hi", 4, draft=object()))


def test_default_model_path_builds_the_synthetic_fixture(tmp_path, monkeypatch):
    monkeypatch.setenv("MUSER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(api, "model_search_path", lambda: [tmp_path / "no-models"])
    p = api.default_model_path()
    assert p.parent == tmp_path / "cache" and p.is_file()
    assert api.default_model_path() == p  # written once
    m = muser.load(None)
    assert m.path == p and m.config.n_layers == 4


def test_default_model_path_prefers_the_shipped_model(tmp_path, monkeypatch, tiny_gguf):
    d = tmp_path / "models"
    d.mkdir()
    shipped = d / "muse-glimmer-micro-q8_0.gguf"
    shipped.write_bytes(tiny_gguf.read_bytes())
    monkeypatch.setenv("MUSER_MODEL_PATH", str(d))  # the first entry of the search path
    assert api.model_search_path()[0] == d
    assert api.default_model_path() == shipped


def test_model_search_path_order(tmp_path, monkeypatch, tiny_gguf):
    a, b = tmp_path / "a", tmp_path / "b"
    monkeypatch.setenv("MUSER_MODEL_PATH", os.pathsep.join([str(a), str(b)]))
    path = api.model_search_path()
    root = api.source_checkout()
    assert root is not None and (root / "src" / "muser" / "api.py").is_file()  # the tests run from a checkout
    assert path == [a, b, root / "models", api.PACKAGE_DIR / "models"]
    b.mkdir()
    (b / "m-f16.gguf").write_bytes(tiny_gguf.read_bytes())
    monkeypatch.setattr(api, "model_search_path", lambda: [a, b, tmp_path / "none"])
    assert api.shipped_model() == b / "m-f16.gguf"  # missing folders are passed over
    a.mkdir()
    (a / "m-q8_0.gguf").write_bytes(tiny_gguf.read_bytes())
    (b / "m-q8_0.gguf").write_bytes(tiny_gguf.read_bytes())
    assert api.shipped_model() == a / "m-q8_0.gguf"  # the first folder wins


def test_generate_greedy_streams_the_oracle_tokens(model, tiny_gguf):
    """Greedy generation through the public path picks, token for token, what the oracle's
    f32 forward picks (Gate 2 on the whole stack: tokenizer -> engine -> sampler)."""
    import muser.oracle as oracle
    from muser.sample import greedy

    gen = model.stream("Beautiful is better", 24, sampling=greedy())
    text = "".join(ev.text for ev in gen)
    assert gen.finish_reason in ("eog", "length")
    ids = model.tokenizer.encode("Beautiful is better", add_special=True)
    s = oracle.load(tiny_gguf, arithmetic="f32", kv="f32").session(max_context=64)
    logits, want = s.prefill(ids), []
    for _ in range(len(gen.tokens)):
        want.append(int(np.argmax(logits)))
        if want[-1] in model.config.eog_ids:
            break
        logits = s.decode(want[-1])
    assert gen.tokens == want
    assert "".join(model.generate("Beautiful is better", 24, sampling=greedy())) == text
    assert gen.stats()["generated_tokens"] == len(gen.tokens)


def test_default_load_checks_the_shipped_pin(tmp_path, monkeypatch, tiny_gguf):
    d = tmp_path / "models"
    d.mkdir()
    shipped = d / "muse-glimmer-micro-q8_0.gguf"
    shipped.write_bytes(tiny_gguf.read_bytes())
    monkeypatch.setattr(api, "model_search_path", lambda: [d])
    (d / "muse-glimmer-micro-q8_0.pin.json").write_text(json.dumps({"artifact_sha256": "f" * 64}))
    with pytest.raises(IdentityMismatch, match="artifact_sha256"):
        muser.load()
    m = muser.load(tiny_gguf)  # an explicit path is not held to the shipped pin
    assert m.path == tiny_gguf
