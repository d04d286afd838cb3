"""The greedy continuations quoted in README.md and models/README.md, regenerated here from the
prompts the READMEs state (file + first N lines of a held-out file, [BOS] first, greedy, stop at
EOG) on the shipped Q8_0 with the pinned llama.cpp and with Muser's oracle (ggml-cpu, f16 KV), and
compared in full: the quoted text is exactly llama.cpp's decoded continuation, and each claim about
Muser's tokens (equal to llama.cpp's, or parting at a stated token) holds. Nothing is read from the stored continuations file, so the test
stays valid when the micro model and its READMEs are regenerated together."""

from __future__ import annotations

import re

import pytest

from muser.gguf.reader import read_gguf
from muser.text import Tokenizer

from .conftest import REPO, SHIPPED

pytestmark = pytest.mark.comparator

CARD = re.compile(r"```python\n# (?P<file>\S+): first (?P<lines>\d+) lines \((?P<tokens>\d+) tokens with BOS\), "
                  r"ending\n(?:# \|[^\n]*\n)+# greedy continuation \((?P<new>\d+) tokens\):\n(?P<text>.*?)\n```", re.S)
TOP = re.compile(r"```python\n# (?P<file>\S+), first (?P<lines>\d+) lines; prompt ends with: [^\n]*\n"
                 r"(?P<text>.*?)\n```", re.S)
Q8_LINE = re.compile(r"^- `(?P<file>[^`]+)`: (?P<claim>.*)$", re.M)


def _card() -> tuple[str, list[dict]]:
    text = (SHIPPED / "README.md").read_text()
    blocks = [m.groupdict() for m in CARD.finditer(text)]
    assert len(blocks) >= 3, "models/README.md lost its continuation blocks"
    return text, blocks


@pytest.fixture(scope="module")
def regenerated(export_mod, shipped):
    """(file, lines) -> {"ids": (llama.cpp ids, oracle ids), ...} for the prompts models/README.md states."""
    _, blocks = _card()
    f = read_gguf(shipped["Q8_0"])
    try:
        tok = Tokenizer.from_gguf(f)
    finally:
        f.close()
    stop = {1, 2}
    out: dict = {}
    for b in blocks:
        ids = [0] + tok.encode(export_mod.prompt_text(b["file"], int(b["lines"])), add_special=False)
        assert len(ids) == int(b["tokens"]), (b["file"], len(ids), b["tokens"])
        n = int(b["new"])
        ll, _ = export_mod.greedy_llamacpp(shipped["Q8_0"], ids, n, stop)
        orc, _ = export_mod.greedy_oracle(shipped["Q8_0"], ids, n, stop)
        out[(b["file"], int(b["lines"]))] = {"ids": (ll, orc), "text": b["text"], "tok": tok}
    return out


def test_model_card_continuations_regenerate_in_full(regenerated):
    for (file, lines), row in regenerated.items():
        text = row["tok"].decode(row["ids"][0])
        assert text.rstrip() == row["text"].rstrip(), (file, text)


def test_model_card_oracle_claims_hold(regenerated):
    """Each `- file: claim` line under the oracle heading, checked against the regenerated tokens."""
    text, _ = _card()
    part = text[text.index("Muser's oracle on the same prompts"):]
    claims = {m["file"]: m["claim"] for m in Q8_LINE.finditer(part)}
    assert set(claims) == {f for f, _ in regenerated}, claims
    for (file, _), row in regenerated.items():
        ll, orc = row["ids"]
        claim = claims[file]
        if claim.startswith("llama.cpp and the oracle agree token for token"):
            assert orc == ll, file
        else:
            m = re.match(r"llama\.cpp and the oracle part at generated token (\d+)", claim)
            assert m, claim
            k = int(m[1])
            assert orc[:k] == ll[:k] and orc[k] != ll[k], (file, orc, ll)


def test_readme_quotes_the_regenerated_continuations(regenerated):
    """README.md shows the same prompts; each block is the decoded llama.cpp continuation (in full)."""
    text = (REPO / "README.md").read_text()
    blocks = [m.groupdict() for m in TOP.finditer(text)]
    assert len(blocks) >= 3
    for b in blocks:
        row = regenerated[(b["file"], int(b["lines"]))]
        assert row["tok"].decode(row["ids"][0]).rstrip() == b["text"].rstrip(), b["file"]
    assert "muse-glimmer-micro-q8_0.gguf" in text  # the quoted tokens are the shipped Q8_0's
