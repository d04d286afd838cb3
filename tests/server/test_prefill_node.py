"""`muser serve --prefill-node`: a real `muser prefill-node` process prefills the prompts of a real
`muser serve` process over mutual TLS; the openai client gets the same greedy text as from a
server that prefills locally, and still gets it (local fallback, logged and counted) once the
node is gone. Combinations that cannot work are refused at startup."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from muser.api import default_model_path
from muser.handoff.spawn import SRC, NodeProcess

from ..handoff.conftest import ca_with_nodes
from .conftest import Served

MESSAGES = [{"role": "user", "content": "Write a function that reverses a list."}]
OTHER = [{"role": "user", "content": "Parse the command line arguments."}]


@pytest.fixture(scope="module")
def certs_dir(tmp_path_factory) -> Path:
    return ca_with_nodes(tmp_path_factory.mktemp("serve-certs"))


@pytest.fixture(scope="module")
def node(certs_dir):
    n = NodeProcess(default_model_path(), certs_dir, kv="f16", stall_s=5.0, threads=1).wait()
    yield n
    n.stop()


@pytest.fixture(scope="module")
def servers(node, certs_dir):
    remote = Served(["--slots", "2", "--ctx", "512", "--prefill-node", node.addr, "--certs", str(certs_dir)])
    try:
        local = Served(["--slots", "2", "--ctx", "512"])
    except BaseException:
        remote.stop()
        raise
    yield remote, local
    remote.stop()
    local.stop()


def _greedy(served: Served, messages) -> tuple[str, int]:
    r = served.client().chat.completions.create(model=served.model, messages=messages, max_tokens=24,
                                                 temperature=0)
    return r.choices[0].message.content, r.usage.prompt_tokens


def _prefills(served: Served) -> dict[str, float]:
    text = httpx.get(served.root + "/metrics", timeout=10).text
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r'^muser_prefills_total\{path="(\w+)"\} (\S+)$', text, re.M)}


def test_remote_prefill_gives_the_local_text(servers):
    remote, local = servers
    got, want = _greedy(remote, MESSAGES), _greedy(local, MESSAGES)
    assert got == want and got[0]
    assert _prefills(remote) == {"remote": 1.0}
    assert _prefills(local) == {}  # no prefill node: prompts prefill in the engine steps
    streamed = remote.client().chat.completions.create(model=remote.model, messages=OTHER, max_tokens=24,
                                                        temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == _greedy(local, OTHER)[0]
    assert _prefills(remote) == {"remote": 2.0}


def _continue(served: Served, prompt: list[int], max_tokens: int) -> tuple[str, int]:
    r = httpx.post(served.base_url + "/completions", headers={"x-session-id": "conv"}, timeout=120,
                   json={"model": served.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"], r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_named_session_prefills_only_the_new_suffix_remotely(servers):
    """A named session's follow-up prefills remotely with the held prefix as history (delta)."""
    remote, local = servers
    ids = list(range(40, 80))
    more = ids + list(range(200, 230))
    for served in (remote, local):  # one token: the session holds exactly the prompt's K/V after
        assert _continue(served, ids, 1)[1] == 0
    assert _prefills(remote) == {"remote": 3.0}
    got, want = _continue(remote, more, 12), _continue(local, more, 12)
    assert got == want and got[1] == len(ids)  # the held prefix was not prefilled again
    assert _prefills(remote) == {"remote": 4.0}


def test_dead_node_falls_back_to_local_prefill(servers, node):
    remote, local = servers
    node.stop()
    got, want = _greedy(remote, MESSAGES), _greedy(local, MESSAGES)
    assert got == want
    assert _prefills(remote) == {"remote": 4.0, "local": 1.0}
    assert any("prefilled locally" in line and "cannot reach the prefill node" in line for line in remote.proc.log)
    assert remote.alive()


def _serve(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "muser", "serve", "--port", "0", *args], capture_output=True,
                          text=True, env=env, timeout=120)


@pytest.mark.parametrize("args, says", [
    (["--prefill-node", "127.0.0.1:9"], "--prefill-node 127.0.0.1:9 needs --certs DIR"),
    (["--certs", "CERTS"], "--certs CERTS is only used with --prefill-node"),
    (["--prefill-peer", "prefill"], "--prefill-peer prefill is only used with --prefill-node"),
    (["--prefill-node", "127.0.0.1:9", "--certs", "CERTS", "--prefill-peer", "nobody"],
     "--prefill-peer nobody is not in"),
    (["--prefill-node", "no-port", "--certs", "CERTS"], "must be HOST:PORT"),
    (["--prefill-node", "127.0.0.1:9", "--certs", "MISSING"], "is missing: run `muser certs init"),
    (["--prefill-node", "127.0.0.1:9", "--certs", "CERTS", "--kvpack", "MISSING"],
     "with --prefill-node 127.0.0.1:9 is not served"),
])
def test_startup_refuses_what_cannot_work(args, says, certs_dir, tmp_path):
    args = [str(certs_dir) if a == "CERTS" else str(tmp_path / "none") if a == "MISSING" else a for a in args]
    says = says.replace("CERTS", str(certs_dir))
    r = _serve(*args)
    assert r.returncode != 0
    assert says in r.stderr and "Traceback" not in r.stderr, r.stderr
