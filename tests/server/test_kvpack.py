"""`muser serve --kvpack DIR`: a prompt persisted by one server process is restored by a second
process on the same DIR, which answers the same greedy text and prefills only the suffix."""

from __future__ import annotations

import re

import httpx

from .conftest import Served

PROMPT = [40 + (i * 37) % 900 for i in range(600)]  # one stored 512-token chunk, 88 to prefill


def _counters(served: Served) -> dict[str, float]:
    text = httpx.get(served.root + "/metrics", timeout=10).text
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r"^muser_(prefilled_tokens|restored_tokens)_total (\S+)$", text, re.MULTILINE)}


def _complete(served: Served) -> str:
    r = served.client().completions.create(model=served.model, prompt=PROMPT, max_tokens=16, temperature=0)
    assert r.usage.prompt_tokens == len(PROMPT)
    return r.choices[0].text


def test_second_server_restores_the_stored_prefix(tmp_path):
    store = tmp_path / "kvpack"
    args = ["--slots", "1", "--ctx", "1024", "--kvpack", str(store)]
    first = Served(args)
    try:
        cold = _complete(first)
        assert _counters(first) == {"prefilled_tokens": 600.0, "restored_tokens": 0.0}
    finally:
        first.stop()  # the process exits after its background writer finished
    assert any((store / "objects").rglob("*.nope")) and any((store / "objects").rglob("*.swa"))
    second = Served(args)
    try:
        assert _complete(second) == cold and cold
        assert _counters(second) == {"prefilled_tokens": 88.0, "restored_tokens": 512.0}
        again = _complete(second)  # the slot's session is emptied (new planes) and restores again
        assert again == cold
        assert _counters(second) == {"prefilled_tokens": 176.0, "restored_tokens": 1024.0}
    finally:
        second.stop()
