"""`muser generate --kvpack DIR` and `muser.load(...).session(kvpack=...)`: the second run restores
the stored 512-token prefix and produces the same greedy text and logits as a cold run; the first
run's entries are stored when the command returns (it waits for the background writer)."""

from __future__ import annotations

import json
import time

import numpy as np

import muser
from muser.cli import main
from muser.kvpack import DirectoryBackend

PROMPT = "def f(x):\n    return x + 1\n" * 60  # > 512 tokens of the tiny fixture's BPE


def run(capsys, model, d):
    argv = ["generate", "--model", str(model), "--prompt", PROMPT, "--max-tokens", "6", "--temperature", "0",
            "--json", "--kvpack", str(d)]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    return json.loads(lines[-1])


def test_generate_and_session_kvpack(tiny_gguf, tmp_path, capsys, monkeypatch):
    from muser.kvpack import WarmSession

    persist = WarmSession._persist

    def slow(self, *a):  # the writer still running when the response is done: the command waits for it
        time.sleep(0.5)
        persist(self, *a)

    monkeypatch.setattr(WarmSession, "_persist", slow)
    d = tmp_path / "kv"
    first = run(capsys, tiny_gguf, d)
    ids = first["prompt_ids"]
    assert len(ids) > 512
    names = sorted(o.name.split(".")[1] for o in DirectoryBackend(d, create=False).list())
    assert names == ["nope", "swa"]  # chunk 0 and the SWA tail at 512, written after the response
    m = muser.load(tiny_gguf, device="cpu", lane="exact", kv="f16")
    try:
        cold = m.session(max_context=len(ids) + 4).prefill(ids)
        warm = m.session(max_context=len(ids) + 9, kvpack=d)  # another slot size
        got = warm.prefill(ids)
        assert warm.last["restored"] == 512 and np.array_equal(got, cold)
    finally:
        m.close()
    second = run(capsys, tiny_gguf, d)
    assert second["ids"] == first["ids"] and second["text"] == first["text"]
