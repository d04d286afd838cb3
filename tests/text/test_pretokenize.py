"""The fast pre-tokenizer (collapsed text, small patterns) against its reference (the same
patterns with explicit full-Unicode classes), and the Unicode tables they rest on."""

from __future__ import annotations

import random
import unicodedata

import numpy as np
import pytest

from muser.errors import TokenizerError
from muser.text import stress
from muser.text import unicode as U
from muser.text.pretokenize import PreTokenizer


@pytest.mark.parametrize("pre", ["gpt-2", "llama4", "default"])
def test_fast_split_equals_reference(pre):
    fast, ref = PreTokenizer(pre), PreTokenizer(pre, reference=True)
    rng = random.Random(7)
    texts = stress.stress_texts(["<|eot|>"], n_random=150)
    texts += ["".join(chr(rng.randint(0x80, 0x2FFF)) for _ in range(200)) for _ in range(20)]
    for t in texts:
        pieces = fast.split(t)
        assert "".join(pieces) == t
        assert pieces == ref.split(t), t[:50]


def test_unknown_pre():
    with pytest.raises(TokenizerError, match="'not-a-pre'"):
        PreTokenizer("not-a-pre")


def test_overlay_is_unicode_15_1_additions():
    cat = U.categories()
    for lo, hi, c in U.UCD_15_1_ADDITIONS:
        assert unicodedata.category(chr(lo)) == "Cn"  # unassigned in Python's 14.0 tables
        assert (cat[lo : hi + 1] == {"L": U.LETTER, "N": U.NUMBER, "M": U.MARK, "P": U.PUNCT,
                                      "S": U.SYMBOL, "C": U.CONTROL}[c]).all()
    assert cat[ord("a")] == U.LETTER and cat[ord("5")] == U.NUMBER and cat[0x0301] == U.MARK
    assert cat[0x10FFFF] == U.UNDEF


def test_overlay_per_unicodedata_base(monkeypatch):
    """Python 3.12 ships Unicode 15.0 and 3.13 ships 15.1: each base gets exactly the ranges it
    lacks, and any other base is refused by name (its table would not be llama.cpp's)."""
    only = set(U.UCD_15_1_ONLY)
    assert only <= set(U.UCD_15_1_ADDITIONS)
    assert sum(hi - lo + 1 for lo, hi, _ in U.UCD_15_1_ONLY) == 627  # Unicode 15.1's new characters
    full = U.categories()
    # a 15.0 base = this 14.0 base plus the 15.0 additions; laying the 15.1-only ranges over it
    # must give the same table
    base15 = U.lay_over(U.base_table(), [r for r in U.UCD_15_1_ADDITIONS if r not in only])
    assert np.array_equal(U.lay_over(base15, U.UCD_15_1_ONLY), full)
    with pytest.raises(TokenizerError, match="already assigned"):
        U.lay_over(full.copy(), U.UCD_15_1_ONLY)  # a base that already has them is caught
    fake = type("UD", (), {"unidata_version": "16.0.0", "category": staticmethod(unicodedata.category)})
    monkeypatch.setattr(U, "unicodedata", fake)
    U.categories.cache_clear()
    try:
        with pytest.raises(TokenizerError, match="16.0.0"):
            U.categories()
    finally:
        monkeypatch.undo()
        U.categories.cache_clear()


def test_whitespace_set_is_llama_cpps():
    ws = U.whitespace_mask()
    assert ws[[9, 10, 11, 12, 13, 32, 0x85, 0xA0, 0x3000]].all()
    assert not ws[[0x1C, 0x1D, 0x1E, 0x1F, 0x200B]].any()  # Python calls 0x1C-0x1F space; llama.cpp does not


@pytest.mark.parametrize("data,text", [
    (b"\xc0\x80", "\x00"),  # overlong: decoded, not replaced
    (b"\xed\xa0\x80", "\ud800"),  # surrogate form: kept as its codepoint
    (b"\xff", "\ufffd"), (b"\xc3(", "\ufffd("), (b"\xe2\x82", "\ufffd\ufffd"),
    (b"ok \xf0\x9f\x98\x80", "ok \U0001f600"),
])
def test_lenient_utf8(data, text):
    assert U.decode_utf8_lenient(data) == text


def test_byte_level_alphabet():
    b2u = U.byte_to_unicode()
    assert len(set(b2u)) == 256 and b2u[ord(" ")] == "\u0120" and b2u[ord("a")] == "a"
    assert all(U.unicode_to_byte()[c] == b for b, c in enumerate(b2u))


def test_char_class_ranges():
    m = np.zeros(U.MAX_CODEPOINTS, dtype=bool)
    m[[1, 2, 3, 10, 0x10FFFF]] = True
    assert U.ranges(m) == [(1, 3), (10, 10), (0x10FFFF, 0x10FFFF)]
