"""Pre-tokenizers: the word splits the pinned llama.cpp makes before BPE (src/llama-vocab.cpp
llm_tokenizer_bpe, src/unicode.cpp unicode_regex_split).

llama.cpp runs each pre-type's regex list in order, each one splitting every piece the previous
one produced. A regex is executed one of two ways, both reproduced here as Python `re` patterns
(leftmost-first backtracking, as ECMAScript std::regex and the hand-written splitter behave):

* a hand-written splitter (unicode_regex_split_custom_gpt2 for the GPT-2 regex), whose classes
  are llama.cpp's codepoint flags: letter, number, its own whitespace set;
* std::regex over a "collapsed" text in which every non-ASCII codepoint becomes one byte for its
  category (letter 0xD2, number 0xD1, punctuation 0xD3, mark 0xD4, symbol 0xD5, whitespace 0x0B,
  anything else 0xD0) and ASCII stays itself. So `\\p{L}` means A-Za-z plus every non-ASCII
  letter, `[^a-z]` holds for every non-ASCII letter (case is invisible there), and `\\s` is the
  C-locale set \\t\\n\\v\\f\\r and space plus llama.cpp's non-ASCII whitespace.

The fast path does what llama.cpp does: it collapses every non-ASCII codepoint to one of five
stand-ins (letter, number, whitespace, punctuation, other — all any of these patterns can tell
apart), matches small ASCII patterns, and cuts the original text at the same offsets.
`reference=True` builds the same patterns with explicit full-Unicode classes instead (the spec
the fast path is tested against). Pieces between matches are pieces of their own.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ..errors import TokenizerError
from . import unicode as U

# tokenizer.ggml.pre -> pre-type (llama-vocab.cpp, llama_vocab::impl::load). Only the types
# reproduced exactly here are listed; any other name is refused, never defaulted.
PRE_TYPES = {
    "default": "default",
    "gpt-2": "gpt2",
    "gpt-4o": "gpt4o",
    "llama4": "gpt4o",
    "kanana2": "gpt4o",
    "talkie": "gpt4o",
}
# clean_spaces (llama_detokenize's cleanup) per pre-type.
CLEAN_SPACES = {"default": True, "gpt2": True, "gpt4o": False}

_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"

# Stand-ins for non-ASCII codepoints in the collapsed text.
REP_L, REP_N, REP_W, REP_P, REP_O = 0x80, 0x81, 0x82, 0x83, 0x84
_GROUPS = ("L", "N", "W", "P", "O")
_REP = dict(zip(_GROUPS, (REP_L, REP_N, REP_W, REP_P, REP_O)))


@dataclass(frozen=True)
class _Stage:
    pattern: re.Pattern
    total: bool  # every character starts a match: no gap pieces, findall suffices


class _Sets:
    """Character sets as (ASCII members, non-ASCII groups) so either form can be emitted."""

    def __init__(self, ascii_chars: set[int], groups: set[str]):
        self.ascii = frozenset(ascii_chars)
        self.groups = frozenset(groups)

    def __or__(self, o: "_Sets") -> "_Sets":
        return _Sets(self.ascii | o.ascii, self.groups | o.groups)

    def __sub__(self, o: "_Sets") -> "_Sets":
        return _Sets(self.ascii - o.ascii, self.groups - o.groups)

    def inv(self) -> "_Sets":
        return _Sets(set(range(128)) - self.ascii, set(_GROUPS) - self.groups)


def _a(chars: str) -> _Sets:
    return _Sets({ord(c) for c in chars}, set())


@lru_cache(maxsize=None)
def _ascii_by_class() -> dict[str, set[int]]:
    cat = U.categories()
    W = U.whitespace_mask()
    out = {g: set() for g in _GROUPS}
    for cp in range(128):
        out[_group(int(cat[cp]), bool(W[cp]))].add(cp)
    return out


def _group(cat: int, ws: bool) -> str:
    if ws:
        return "W"
    return {U.LETTER: "L", U.NUMBER: "N", U.PUNCT: "P"}.get(cat, "O")


def _base() -> dict[str, _Sets]:
    a = _ascii_by_class()
    return {g: _Sets(a[g], {g}) for g in _GROUPS}


@lru_cache(maxsize=None)
def _group_masks() -> dict[str, np.ndarray]:
    cat = U.categories()
    W = U.whitespace_mask()
    nonascii = np.ones(U.MAX_CODEPOINTS, dtype=bool)
    nonascii[:128] = False
    L = (cat == U.LETTER) & ~W & nonascii
    N = (cat == U.NUMBER) & ~W & nonascii
    P = (cat == U.PUNCT) & ~W & nonascii
    Wn = W & nonascii
    O = nonascii & ~(L | N | P | Wn)
    return {"L": L, "N": N, "W": Wn, "P": P, "O": O}


def _cls(s: _Sets, reference: bool) -> str:
    """Render a set as a `re` class: collapsed (stand-ins) or full-Unicode (reference)."""
    mask = np.zeros(U.MAX_CODEPOINTS, dtype=bool)
    mask[sorted(s.ascii)] = True
    if reference:
        gm = _group_masks()
        for g in s.groups:
            mask |= gm[g]
    else:
        for g in s.groups:
            mask[_REP[g]] = True
    if not mask.any():
        raise AssertionError("empty character class")
    return U.char_class(mask)


def _gpt2(reference: bool) -> _Stage:
    """unicode_regex_split_custom_gpt2: 's|'t|'re|'ve|'m|'ll|'d| ?L+| ?N+| ?[^\\sLN]+|\\s+(?!\\S)|\\s+
    with L, N, \\s = llama.cpp's letter / number / whitespace flags."""
    b = _base()
    L, N, W = b["L"], b["N"], b["W"]
    O = (L | N | W).inv()
    c = lambda s: _cls(s, reference)  # noqa: E731
    pat = (
        "'s|'t|'re|'ve|'m|'ll|'d"
        f"| ?{c(L)}+| ?{c(N)}+| ?{c(O)}+"
        f"|{c(W)}+(?!{c(W.inv())})|{c(W)}+"
    )
    return _Stage(re.compile(pat), total=True)


def _gpt4o(reference: bool) -> _Stage:
    """LLAMA_VOCAB_PRE_TYPE_GPT4O's regex as std::regex runs it on the collapsed text."""
    b = _base()
    L, N, W = b["L"], b["N"], b["W"]
    up = L - _a("abcdefghijklmnopqrstuvwxyz")  # (?=\p{L})[^a-z]
    lo = L - _a("ABCDEFGHIJKLMNOPQRSTUVWXYZ")  # (?=\p{L})[^A-Z]
    o1 = (L | N | _a("\r\n")).inv()  # [^\r\n\p{L}\p{N}]
    o2 = (L | N | W).inv()  # [^\s\p{L}\p{N}]
    c = lambda s: _cls(s, reference)  # noqa: E731
    pat = (
        f"{c(o1)}?{c(up)}*{c(lo)}+{_CONTRACTIONS}?"
        f"|{c(o1)}?{c(up)}+{c(lo)}*{_CONTRACTIONS}?"
        f"|{c(N)}{{1,3}}"
        f"| ?{c(o2)}+[\\r\\n/]*"
        f"|{c(W)}*[\\r\\n]+"
        f"|{c(W)}+(?!{c(W.inv())})"
        f"|{c(W)}+"
    )
    return _Stage(re.compile(pat), total=True)


def _default(reference: bool) -> tuple[_Stage, ...]:
    """LLAMA_VOCAB_PRE_TYPE_DEFAULT: four regexes applied in sequence."""
    b = _base()
    c = lambda s: _cls(s, reference)  # noqa: E731
    # "[\p{P}\$\+<=>\^~\|]+" collapsed: non-ASCII punctuation, the ASCII characters llama.cpp
    # maps \p{P} to (!-# %-* ,-/ :-; ?-@ [-] _ { }) and $ + < = > ^ ~ |.
    punct = _Sets(set(), {"P"}) | _a('!"#%&\'()*,-./:;?@[\\]_{}') | _a("$+<=>^~|")
    return (
        _Stage(re.compile(f"{c(punct)}+"), total=False),
        _gpt2(reference),
        _Stage(re.compile(f"{c(b['N'])}+"), total=False),
        _Stage(re.compile("[0-9][0-9][0-9]"), total=False),
    )


@lru_cache(maxsize=None)
def _stages(kind: str, reference: bool) -> tuple[_Stage, ...]:
    if kind == "gpt2":
        return (_gpt2(reference),)
    if kind == "gpt4o":
        return (_gpt4o(reference),)
    return _default(reference)


class _Collapse(dict):
    """str.translate table: non-ASCII codepoint -> its stand-in, computed on first sight."""

    def __init__(self) -> None:
        super().__init__((cp, cp) for cp in range(128))  # ASCII stays itself

    def __missing__(self, cp: int):
        if cp >= U.MAX_CODEPOINTS:
            raise TokenizerError(f"codepoint U+{cp:X} is above U+10FFFF")
        g = _group(int(U.categories()[cp]), bool(U.whitespace_mask()[cp]))
        rep = chr(_REP[g])
        self[cp] = rep
        return rep


_COLLAPSE = _Collapse()


def collapse(text: str) -> str:
    return text if text.isascii() else text.translate(_COLLAPSE)


def _split_stage(stage: _Stage, piece: str, out: list[str]) -> None:
    if stage.total:
        out.extend(stage.pattern.findall(piece))
        return
    pos = 0
    for m in stage.pattern.finditer(piece):
        a, b = m.span()
        if a > pos:
            out.append(piece[pos:a])
        out.append(piece[a:b])
        pos = b
    if pos < len(piece):
        out.append(piece[pos:])


class PreTokenizer:
    """Splits a text fragment into the words BPE runs on, as the pinned llama.cpp does."""

    def __init__(self, pre: str, reference: bool = False):
        if pre not in PRE_TYPES:
            raise TokenizerError(
                f"unknown or unsupported tokenizer.ggml.pre {pre!r} "
                f"(supported: {', '.join(sorted(PRE_TYPES))})"
            )
        self.pre = pre
        self.kind = PRE_TYPES[pre]
        self.clean_spaces = CLEAN_SPACES[self.kind]
        self.reference = reference
        self._stages = _stages(self.kind, reference)

    def _run(self, text: str) -> list[str]:
        pieces = [text] if text else []
        for stage in self._stages:
            if len(pieces) == 1 and stage.total:
                pieces = stage.pattern.findall(pieces[0])
                continue
            out: list[str] = []
            for p in pieces:
                _split_stage(stage, p, out)
            pieces = out
        return pieces

    def split(self, text: str) -> list[str]:
        if self.reference or text.isascii():
            return self._run(text)
        pieces = self._run(text.translate(_COLLAPSE))
        ends = itertools.accumulate(map(len, pieces))
        out: list[str] = []
        start = 0
        for end in ends:
            out.append(text[start:end])
            start = end
        return out
