"""Codepoint classes exactly as the pinned llama.cpp sees them (src/unicode.cpp, unicode-data.cpp).

llama.cpp classifies every codepoint by one general-category flag (N, L, Z, M, P, S, C, or
"undefined" for unassigned) taken from UnicodeData.txt 15.1, plus its own whitespace set. Python
3.11's `unicodedata` is Unicode 14.0, so the codepoints assigned in 15.0/15.1 are laid over it
(`UCD_15_1_ADDITIONS`); with that overlay the two tables agree on all 0x110000 codepoints. Python
3.12 (15.0) takes only the 15.1 additions, 3.13 (15.1) none (`OVERLAYS`).

Also here: llama.cpp's lenient UTF-8 decoder (used only by the bytes API) and the GPT-2 byte <->
unicode map of byte-level BPE (unicode.cpp: unicode_byte_to_utf8_map).
"""

from __future__ import annotations

import unicodedata
from functools import lru_cache

import numpy as np

from ..errors import TokenizerError

MAX_CODEPOINTS = 0x110000

# Category codes (one per codepoint), mirroring unicode_cpt_flags' category bits.
UNDEF, NUMBER, LETTER, SEPARATOR, MARK, PUNCT, SYMBOL, CONTROL = range(8)
_CAT = {"N": NUMBER, "L": LETTER, "Z": SEPARATOR, "M": MARK, "P": PUNCT, "S": SYMBOL, "C": CONTROL}

# unicode-data.cpp: unicode_set_whitespace (PropList White_Space).
WHITESPACE = frozenset(
    [*range(0x09, 0x0E), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B),
     0x2028, 0x2029, 0x202F, 0x205F, 0x3000]
)

# Codepoints assigned in Unicode 15.0/15.1 (absent from Python 3.11's 14.0 tables) with the
# category llama.cpp's 15.1 table gives them: (first, last, category letter).
UCD_15_1_ADDITIONS = (
    (0x0CF3, 0x0CF3, "M"), (0x0ECE, 0x0ECE, "M"), (0x2FFC, 0x2FFF, "S"), (0x31EF, 0x31EF, "S"),
    (0x10EFD, 0x10EFF, "M"), (0x1123F, 0x11240, "L"), (0x11241, 0x11241, "M"),
    (0x11B00, 0x11B09, "P"), (0x11F00, 0x11F01, "M"), (0x11F02, 0x11F02, "L"),
    (0x11F03, 0x11F03, "M"), (0x11F04, 0x11F10, "L"), (0x11F12, 0x11F33, "L"),
    (0x11F34, 0x11F3A, "M"), (0x11F3E, 0x11F42, "M"), (0x11F43, 0x11F4F, "P"),
    (0x11F50, 0x11F59, "N"), (0x1342F, 0x1342F, "L"), (0x13439, 0x1343F, "C"),
    (0x13440, 0x13440, "M"), (0x13441, 0x13446, "L"), (0x13447, 0x13455, "M"),
    (0x1B132, 0x1B132, "L"), (0x1B155, 0x1B155, "L"), (0x1D2C0, 0x1D2D3, "N"),
    (0x1DF25, 0x1DF2A, "L"), (0x1E030, 0x1E06D, "L"), (0x1E08F, 0x1E08F, "M"),
    (0x1E4D0, 0x1E4EB, "L"), (0x1E4EC, 0x1E4EF, "M"), (0x1E4F0, 0x1E4F9, "N"),
    (0x1F6DC, 0x1F6DC, "S"), (0x1F774, 0x1F776, "S"), (0x1F77B, 0x1F77F, "S"),
    (0x1F7D9, 0x1F7D9, "S"), (0x1FA75, 0x1FA77, "S"), (0x1FA87, 0x1FA88, "S"),
    (0x1FAAD, 0x1FAAF, "S"), (0x1FABB, 0x1FABD, "S"), (0x1FABF, 0x1FABF, "S"),
    (0x1FACE, 0x1FACF, "S"), (0x1FADA, 0x1FADB, "S"), (0x1FAE8, 0x1FAE8, "S"),
    (0x1FAF7, 0x1FAF8, "S"), (0x2B739, 0x2B739, "L"), (0x2EBF0, 0x2EE5D, "L"),
    (0x31350, 0x323AF, "L"),
)


# The part of that overlay that Unicode 15.1 itself added (622 CJK Extension I ideographs, the
# ideographic description characters U+2FFC..U+2FFF and U+31EF: 627 codepoints, no general-category
# change to existing ones): what a 15.0 base (Python 3.12's unicodedata) still lacks.
UCD_15_1_ONLY = ((0x2FFC, 0x2FFF, "S"), (0x31EF, 0x31EF, "S"), (0x2EBF0, 0x2EE5D, "L"))

# unicodedata version of the running Python -> the ranges to lay over it to reach llama.cpp's 15.1
# table (unicode-data.cpp). Any other base is refused: its table would disagree with llama.cpp's.
OVERLAYS = {"14.0.0": UCD_15_1_ADDITIONS, "15.0.0": UCD_15_1_ONLY, "15.1.0": ()}


def base_table() -> np.ndarray:
    """uint8[0x110000]: categories from the running Python's unicodedata, unassigned = UNDEF."""
    cat = np.empty(MAX_CODEPOINTS, dtype=np.uint8)
    table = {"Cn": UNDEF}
    for cp in range(MAX_CODEPOINTS):
        c = unicodedata.category(chr(cp))
        v = table.get(c)
        if v is None:
            v = table[c] = _CAT[c[0]]
        cat[cp] = v
    return cat


def lay_over(cat: np.ndarray, overlay) -> np.ndarray:
    """Assign the overlay's ranges; each must be unassigned in the base (else the base is not the
    version the overlay was derived for)."""
    for lo, hi, c in overlay:
        if cat[lo : hi + 1].any():
            raise TokenizerError(f"overlay range U+{lo:04X}..U+{hi:04X} is already assigned")
        cat[lo : hi + 1] = _CAT[c]
    return cat


@lru_cache(maxsize=1)
def categories() -> np.ndarray:
    """uint8[0x110000]: the llama.cpp category code of every codepoint."""
    overlay = OVERLAYS.get(unicodedata.unidata_version)
    if overlay is None:
        raise TokenizerError(
            f"unicodedata {unicodedata.unidata_version} has no overlay to llama.cpp's Unicode 15.1 table "
            f"(known bases: {', '.join(OVERLAYS)})"
        )
    return lay_over(base_table(), overlay)


@lru_cache(maxsize=1)
def whitespace_mask() -> np.ndarray:
    m = np.zeros(MAX_CODEPOINTS, dtype=bool)
    m[sorted(WHITESPACE)] = True
    return m


def ranges(mask: np.ndarray) -> list[tuple[int, int]]:
    """Runs of True in a codepoint mask as inclusive (first, last) pairs."""
    m = np.concatenate(([False], mask.astype(bool), [False]))
    d = np.flatnonzero(m[1:] != m[:-1])
    return [(int(a), int(b) - 1) for a, b in zip(d[0::2], d[1::2])]


def _esc(cp: int) -> str:
    return f"\\U{cp:08x}"


def char_class(mask: np.ndarray, negate: bool = False) -> str:
    """A Python `re` character class matching exactly the codepoints set in `mask`."""
    parts = [_esc(a) if a == b else f"{_esc(a)}-{_esc(b)}" for a, b in ranges(mask)]
    return "[" + ("^" if negate else "") + "".join(parts) + "]"


def mask_of(*cats: int) -> np.ndarray:
    return np.isin(categories(), np.array(cats, dtype=np.uint8))


def ascii_mask(chars: str) -> np.ndarray:
    m = np.zeros(MAX_CODEPOINTS, dtype=bool)
    m[[ord(c) for c in chars]] = True
    return m


# ---------------------------------------------------------------------------------------------
# UTF-8 as llama.cpp reads it (unicode_cpts_from_utf8 / unicode_cpt_from_utf8)


def decode_utf8_lenient(data: bytes) -> str:
    """Bytes -> str exactly as llama.cpp turns them into codepoints.

    A malformed lead or truncated sequence becomes U+FFFD and consumes one byte; overlong forms
    and surrogate encodings decode to their codepoint (only the continuation-byte tag is checked).
    A sequence that decodes above U+10FFFF is refused: llama.cpp throws on re-encoding it.
    """
    try:
        return data.decode("utf-8")  # the common case; identical when the input is valid
    except UnicodeDecodeError:
        pass
    out: list[str] = []
    n = len(data)
    i = 0
    while i < n:
        b0 = data[i]
        if b0 < 0x80:
            out.append(chr(b0))
            i += 1
            continue
        cp = -1
        if b0 & 0x40 == 0:
            cp = -1  # continuation byte in lead position
        elif b0 & 0x20 == 0:
            if i + 1 < n and data[i + 1] & 0xC0 == 0x80:
                cp, ln = ((b0 & 0x1F) << 6) | (data[i + 1] & 0x3F), 2
        elif b0 & 0x10 == 0:
            if i + 2 < n and data[i + 1] & 0xC0 == 0x80 and data[i + 2] & 0xC0 == 0x80:
                cp, ln = ((b0 & 0x0F) << 12) | ((data[i + 1] & 0x3F) << 6) | (data[i + 2] & 0x3F), 3
        elif b0 & 0x08 == 0:
            if (i + 3 < n and data[i + 1] & 0xC0 == 0x80 and data[i + 2] & 0xC0 == 0x80
                    and data[i + 3] & 0xC0 == 0x80):
                cp = (((b0 & 0x07) << 18) | ((data[i + 1] & 0x3F) << 12)
                      | ((data[i + 2] & 0x3F) << 6) | (data[i + 3] & 0x3F))
                ln = 4
        if cp < 0:
            out.append("\ufffd")
            i += 1
            continue
        if cp >= MAX_CODEPOINTS:
            raise TokenizerError(
                f"input bytes at offset {i} decode to U+{cp:X}, above U+10FFFF "
                "(the pinned llama.cpp cannot re-encode it)"
            )
        out.append(chr(cp))
        i += ln
    return "".join(out)


def encode_utf8(text: str) -> bytes:
    """str -> UTF-8 bytes; lone surrogates (only from the bytes API) encode as llama.cpp does."""
    return text.encode("utf-8", "surrogatepass")


# ---------------------------------------------------------------------------------------------
# byte-level BPE alphabet (unicode.cpp: unicode_byte_to_utf8_map)


@lru_cache(maxsize=1)
def byte_to_unicode() -> tuple[str, ...]:
    """byte -> the printable character byte-level BPE uses for it."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table: dict[int, str] = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return tuple(table[b] for b in range(256))


@lru_cache(maxsize=1)
def unicode_to_byte() -> dict[str, int]:
    return {c: b for b, c in enumerate(byte_to_unicode())}
