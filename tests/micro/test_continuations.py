"""The greedy continuations quoted in README.md and models/README.md, regenerated here from the
prompts the READMEs state (file + first N lines of a held-out file, [BOS] first, greedy, stop at
EOG) with the pinned llama.cpp and with Muser's oracle (ggml-cpu, f16 KV), and compared in full:
the quoted text is exactly llama.cpp's decoded continuation, and Muser's tokens are llama.cpp's
tokens, as the READMEs claim. Nothing is read from the stored continuations file, so the test
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
    """(file, lines) -> {dtype: (llama.cpp ids, oracle ids)} for the prompts models/README.md states."""
    _, blocks = _card()
    f = read_gguf(shipped["F16"])
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
        row = {}
        for dtype in ("F16", "Q8_0"):
            ll, _ = export_mod.greedy_llamacpp(shipped[dtype], ids, n, stop)
            orc, _ = export_mod.greedy_oracle(shipped[dtype], ids, n, stop)
            row[dtype] = (ll, orc)
        out[(b["file"], int(b["lines"]))] = row | {"text": b["text"], "tok": tok}
    return out


def test_model_card_continuations_regenerate_in_full(regenerated):
    for (file, lines), row in regenerated.items():
        ll, orc = row["F16"]
        text = row["tok"].decode(ll)
        assert text.rstrip() == row["text"].rstrip(), (file, text)
        assert orc == ll, f"{file}: the oracle parts from llama.cpp at token " \
                          f"{next(i for i, (a, b) in enumerate(zip(orc, ll)) if a != b)}"


def test_model_card_q8_0_claims_hold(regenerated):
    """Each `- file: claim` line under the Q8_0 heading, checked against the regenerated tokens."""
    text, _ = _card()
    q8 = text[text.index("On the Q8_0 file"):]
    claims = {m["file"]: m["claim"] for m in Q8_LINE.finditer(q8)}
    assert set(claims) == {f for f, _ in regenerated}, claims
    for (file, _), row in regenerated.items():
        ll, orc = row["Q8_0"]
        f16 = row["F16"][0]
        claim = claims[file]
        if claim.startswith("llama.cpp and the oracle agree token for token"):
            assert orc == ll, file
            if "same tokens as F16" in claim:
                assert ll == f16, file
        else:
            m = re.match(r"llama\.cpp and the oracle part at generated token (\d+)", claim)
            assert m, claim
            k = int(m[1])
            assert orc[:k] == ll[:k] and orc[k] != ll[k], (file, orc, ll)
            if "the oracle's Q8_0 tokens equal F16's" in claim:
                assert orc == f16, file


def test_readme_quotes_the_regenerated_continuations(regenerated):
    """README.md shows the same prompts; each block is the decoded llama.cpp continuation (in full)."""
    text = (REPO / "README.md").read_text()
    blocks = [m.groupdict() for m in TOP.finditer(text)]
    assert len(blocks) >= 3
    for b in blocks:
        row = regenerated[(b["file"], int(b["lines"]))]
        decoded = row["tok"].decode(row["F16"][0])
        assert decoded.rstrip() == b["text"].rstrip(), b["file"]
    assert "F16 master" in text  # the quoted tokens are the F16 master's
