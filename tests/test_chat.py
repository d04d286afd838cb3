"""`muser chat` driven through stdin in a subprocess: turns stream over the template with the
history, /save, /reset, /load, /stats, and bad commands are one line while the chat goes on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import muser
from muser.sample import greedy

SRC = Path(__file__).resolve().parents[1] / "src"


def _chat(tiny_gguf, stdin: str, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(SRC))
    return subprocess.run([sys.executable, "-m", "muser", "chat", "--model", str(tiny_gguf), "--temperature", "0",
                           "--max-tokens", "4", "--kv", "f32", *extra],
                          input=stdin, capture_output=True, text=True, env=env, timeout=240)


def test_chat_turns_history_and_commands(tiny_gguf, tmp_path):
    saved = tmp_path / "h.json"
    script = "\n".join(["/stats", "hello", "/stats", "again", f"/save {saved}", "/reset", "/bogus",
                        f"/load {tmp_path / 'missing.json'}", f"/load {saved}", "third", "/quit", "never"]) + "\n"
    r = _chat(tiny_gguf, script, "--system", "be brief")
    assert r.returncode == 0, r.stderr
    err = r.stderr
    assert "[no reply yet]" in err and "TTFT" in err and "tok/s" in err
    assert "unknown command '/bogus'" in err and "missing.json" in err and "[history cleared]" in err
    hist = json.loads(saved.read_text())
    assert [m["role"] for m in hist] == ["system", "user", "assistant", "user", "assistant"]
    assert hist[0]["content"] == "be brief" and [hist[1]["content"], hist[3]["content"]] == ["hello", "again"]
    # the same turns through the API: each reply continues the rendered history
    m = muser.load(tiny_gguf, kv="f32")
    msgs, replies = [{"role": "system", "content": "be brief"}], []
    for text in ("hello", "again", "third"):  # "third" follows the /load-ed history
        msgs.append({"role": "user", "content": text})
        g = m.stream_chat(msgs, 4, sampling=greedy())
        replies.append("".join(ev.text for ev in g))
        msgs.append({"role": "assistant", "content": g.text})
    assert r.stdout == "".join(t + "\n" for t in replies)
    assert hist[2]["content"] == replies[0] and hist[4]["content"] == replies[1]


def test_chat_with_penalties_starts_each_turn_fresh(tiny_gguf):
    """Penalties need the whole prompt in the sampler: no kept KV, same replies as the API."""
    from muser.sample import SamplingParams

    r = _chat(tiny_gguf, "hi\nmore\n", "--stats", "--repeat-penalty", "1.3")
    assert r.returncode == 0 and r.stderr.count("TTFT") == 2, r.stderr
    m = muser.load(tiny_gguf, kv="f32")
    p = SamplingParams(temperature=0.0, repeat_penalty=1.3)
    msgs, want = [], ""
    for text in ("hi", "more"):
        msgs.append({"role": "user", "content": text})
        g = m.stream_chat(msgs, 4, sampling=p)
        want += "".join(ev.text for ev in g) + "\n"
        msgs.append({"role": "assistant", "content": g.text})
    assert r.stdout == want
