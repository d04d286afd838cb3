"""The GGUF tokenizer: token-for-token what the pinned llama.cpp's llama_tokenize produces.

Pipeline (llama_vocab::impl::tokenize):
1. special-token partition: the raw text is cut at every occurrence of a special token's text,
   tokens taken longest first (the special-token cache order); control and unknown tokens only
   when `parse_special`, user-defined tokens always;
2. each remaining text fragment is tokenized on its own: BPE = pre-tokenizer split + byte-level
   BPE per word; SPM = a space prefix when the fragment starts the text or follows a special
   token, spaces as U+2581, score-ordered merges with byte fallback;
3. `add_special` adds BOS / EOS as tokenizer.ggml.add_bos_token / add_eos_token say.

Input policy: `encode` takes `str`. A str holding a lone surrogate cannot be UTF-8 and is refused.
`encode_bytes` takes raw bytes and treats malformed UTF-8 exactly as llama.cpp does (BPE: each
malformed byte becomes U+FFFD, overlong and surrogate forms decode to their codepoint; SPM: bytes
pass through raw); a sequence above U+10FFFF, on which llama.cpp throws, is refused.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from ..errors import TokenizerError, TokenOutOfRange
from ..gguf.reader import GGUFFile
from . import unicode as U
from .vocab import (ATTR_BYTE, ATTR_CONTROL, ATTR_NORMAL, ATTR_UNKNOWN, ATTR_USER_DEFINED,
                    Vocab, load_vocab)

_SPECIAL_ATTRS = ATTR_CONTROL | ATTR_UNKNOWN  # hidden unless special rendering is asked for


def _hex_byte(text: str) -> int:
    """token_to_byte: strtol(text.substr(3, 2), 16) (leading hex digits; 0 if none)."""
    s = text[3:5]
    v = 0
    for ch in s:
        d = int(ch, 16) if ch in "0123456789abcdefABCDEF" else -1
        if d < 0:
            break
        v = v * 16 + d
    return v


class Tokenizer:
    """Tokenizer of a GGUF (tokenizer.ggml.model gpt2 = byte-level BPE, llama = SPM)."""

    def __init__(self, vocab: Vocab):
        self.vocab = vocab
        self._pieces: list[bytes | None] = [None] * vocab.n_tokens
        if vocab.kind == "bpe":
            from .bpe import BPEWords
            from .pretokenize import PreTokenizer

            self.pretokenizer = PreTokenizer(vocab.pre or "")
            self._bpe = BPEWords(vocab)
            self.clean_spaces = self.pretokenizer.clean_spaces
        else:
            from .spm import SPMSession

            self.pretokenizer = None
            self._spm = SPMSession(vocab)
            self.clean_spaces = False
        self._build_special_index()
        self.sha256: str | None = None

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> "Tokenizer":
        from ..gguf.identity import tokenizer_sha256

        tok = cls(load_vocab(f))
        tok.sha256 = tokenizer_sha256(f)  # 9.13: the tokenizer surface's identity
        return tok

    # -- facts ----------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.vocab.n_tokens

    @property
    def bos_id(self) -> int | None:
        return self.vocab.special["bos"]

    @property
    def eos_id(self) -> int | None:
        return self.vocab.special["eos"]

    @property
    def eot_id(self) -> int | None:
        return self.vocab.special["eot"]

    @property
    def eog_ids(self) -> frozenset[int]:
        return self.vocab.eog_ids

    @property
    def add_bos(self) -> bool:
        return self.vocab.add_bos

    @property
    def add_eos(self) -> bool:
        return self.vocab.add_eos

    def is_eog(self, token: int) -> bool:
        return token in self.vocab.eog_ids

    def is_special(self, token: int) -> bool:
        """Control, unknown or user-defined: matched as a whole in the partition step."""
        return bool(self.vocab.attrs[self._check(token)] & (ATTR_CONTROL | ATTR_UNKNOWN | ATTR_USER_DEFINED))

    def is_control(self, token: int) -> bool:
        return bool(self.vocab.attrs[self._check(token)] & _SPECIAL_ATTRS)

    def token_text(self, token: int) -> str:
        return self.vocab.tokens[self._check(token)]

    def _check(self, token: int) -> int:
        if isinstance(token, bool) or not isinstance(token, (int, np.integer)) or not 0 <= token < self.vocab.n_tokens:
            raise TokenOutOfRange(f"token id {token!r} is outside the vocab [0, {self.vocab.n_tokens})")
        return int(token)

    # -- special-token partition ----------------------------------------------------------------

    def _build_special_index(self) -> None:
        v = self.vocab
        ids = v.special_ids
        self._blen = {i: len(v.tokens[i].encode("utf-8")) for i in ids}
        self._special_str = {i: v.tokens[i] for i in ids}
        self._special_bytes = {i: v.tokens[i].encode("utf-8") for i in ids}
        self._id_of: dict[str | bytes, int] = {}
        # 2-character (2-byte) prefix -> the lengths of the special texts that start with it
        self._lengths: dict[str | bytes, tuple[int, ...]] = {}
        for table in (self._special_str, self._special_bytes):
            lengths: dict = {}
            for i, t in table.items():
                self._id_of[t] = i
                lengths.setdefault(t[:2], set()).add(len(t))
            self._lengths.update({k: tuple(sorted(ls)) for k, ls in lengths.items()})

    def _present(self, raw: str | bytes, parse_special: bool) -> list[int]:
        """The special tokens that occur in `raw`, in the order the partition applies them:
        longest text first (llama.cpp's cache order, whose tie order is consulted only when two
        equal-length specials overlap in this text)."""
        attrs = self.vocab.attrs
        is_str = isinstance(raw, str)
        found: dict[int, list[int]] = {}  # id -> start positions
        for prefix, lengths in self._lengths.items():
            if isinstance(prefix, str) != is_str:
                continue
            p = raw.find(prefix)
            while p >= 0:
                for n in lengths:
                    i = self._id_of.get(raw[p : p + n])
                    if i is not None and (parse_special or not attrs[i] & _SPECIAL_ATTRS):
                        found.setdefault(i, []).append(p)
                p = raw.find(prefix, p + 1)
        order = sorted(found, key=lambda i: (-self._blen[i], i))
        by_len: dict[int, list[int]] = {}
        for i in order:
            by_len.setdefault(self._blen[i], []).append(i)
        for group in by_len.values():
            if len(group) > 1 and self._overlap(group, found, raw):
                rank = {i: r for r, i in enumerate(self.vocab.special_cache)}
                return sorted(found, key=rank.__getitem__)
        return order

    def _overlap(self, group: list[int], found: dict[int, list[int]], raw: str | bytes) -> bool:
        texts = self._special_str if isinstance(raw, str) else self._special_bytes
        spans = sorted((p, p + len(texts[i])) for i in group for p in found[i])
        return any(b0 < a1 for (_, a1), (b0, _) in zip(spans, spans[1:]))

    def partition(self, raw: str | bytes, parse_special: bool) -> list[str | bytes | int]:
        """tokenizer_st_partition: text fragments and special-token ids, in order."""
        frags: list[str | bytes | int] = [raw] if raw else []
        texts = self._special_str if isinstance(raw, str) else self._special_bytes
        for sid in self._present(raw, parse_special):
            s = texts[sid]
            out: list[str | bytes | int] = []
            for fr in frags:
                if isinstance(fr, int):
                    out.append(fr)
                    continue
                parts = fr.split(s)
                if len(parts) == 1:
                    out.append(fr)
                    continue
                for j, part in enumerate(parts):
                    if j:
                        out.append(sid)
                    if part:
                        out.append(part)
            frags = out
        return frags

    # -- encode ---------------------------------------------------------------------------------

    def encode(self, text: str, add_special: bool = False, parse_special: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise TokenizerError(f"encode() takes str, got {type(text).__name__} (use encode_bytes for bytes)")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise TokenizerError(
                f"text holds a lone surrogate U+{ord(text[e.start]):04X} at index {e.start}; it is not UTF-8"
            ) from None
        if self.vocab.kind == "spm":
            return self._encode_frags(self.partition(text.encode("utf-8"), parse_special), add_special)
        return self._encode_frags(self.partition(text, parse_special), add_special)

    def encode_bytes(self, data: bytes, add_special: bool = False, parse_special: bool = False) -> list[int]:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TokenizerError(f"encode_bytes() takes bytes, got {type(data).__name__}")
        data = bytes(data)
        frags = self.partition(data, parse_special)
        if self.vocab.kind == "bpe":
            frags = [f if isinstance(f, int) else U.decode_utf8_lenient(f) for f in frags]
        return self._encode_frags(frags, add_special)

    def _encode_frags(self, frags: Sequence[str | bytes | int], add_special: bool) -> list[int]:
        v = self.vocab
        out: list[int] = []
        if add_special and v.add_bos:
            out.append(v.special["bos"])
        if v.kind == "bpe":
            split = self.pretokenizer.split
            enc = self._bpe.encode_words
            for fr in frags:
                if isinstance(fr, int):
                    out.append(fr)
                else:
                    out.extend(enc(split(fr)))
        else:
            prev_special = True  # the first fragment gets the space prefix too
            for fr in frags:
                if isinstance(fr, int):
                    out.append(fr)
                    prev_special = True
                    continue
                t = (b" " if v.add_space_prefix and prev_special else b"") + fr
                self._spm.tokenize(t.replace(b" ", "\u2581".encode()), out)
                prev_special = False
        if add_special and v.add_eos:
            out.append(v.special["eos"])
        return out

    # -- decode ---------------------------------------------------------------------------------

    def token_to_piece(self, token: int, special: bool = True) -> bytes:
        """llama_token_to_piece: the bytes a token stands for. Control and unknown tokens render
        their text only when `special`; unused and undefined tokens render nothing."""
        self._check(token)
        attr = int(self.vocab.attrs[token])
        if not special and attr & _SPECIAL_ATTRS:
            return b""
        p = self._pieces[token]
        if p is None:
            p = self._pieces[token] = self._piece(token, attr)
        return p

    def _piece(self, token: int, attr: int) -> bytes:
        text = self.vocab.tokens[token]
        if attr & (_SPECIAL_ATTRS | ATTR_USER_DEFINED):
            return text.encode("utf-8")
        if attr & ATTR_NORMAL:
            if self.vocab.kind == "spm":
                return text.replace("\u2581", " ").encode("utf-8")
            u2b = U.unicode_to_byte()
            out = bytearray()
            for ch in text:  # llama_decode_text
                b = u2b.get(ch)
                if b is None:
                    out += b"[UNK_BYTE_0x" + ch.encode("utf-8").hex().encode() + text.encode("utf-8") + b"]"
                else:
                    out.append(b)
            return bytes(out)
        if attr & ATTR_BYTE:
            return bytes([_hex_byte(text)])
        return b""

    def decode_bytes(self, ids: Iterable[int], render_special: bool = True) -> bytes:
        """The pieces of `ids` joined. For SPM the space the encoder put in front of a fragment
        (at the start and after each special token) is taken off again."""
        strip = self.vocab.kind == "spm" and self.vocab.add_space_prefix
        out = bytearray()
        at_fragment_start = True
        for t in ids:
            piece = self.token_to_piece(t, special=render_special)
            if self.is_special(t):
                at_fragment_start = True
            elif at_fragment_start:
                if strip and piece.startswith(b" "):
                    piece = piece[1:]
                at_fragment_start = False
            out += piece
        return bytes(out)

    def decode(self, ids: Iterable[int], render_special: bool = True) -> str:
        """Token ids -> text; malformed UTF-8 (a partial character) becomes U+FFFD."""
        return self.decode_bytes(ids, render_special).decode("utf-8", errors="replace")

    def detokenize(self, ids: Sequence[int], remove_special: bool = False, unparse_special: bool = False) -> bytes:
        """llama_detokenize exactly (including its clean_spaces pass for the pre-types that set it)."""
        v = self.vocab
        ids = [self._check(t) for t in ids]
        remove_space = v.add_space_prefix
        if remove_special and v.add_bos and ids and ids[0] == v.special["bos"]:
            remove_space = False
            ids = ids[1:]
        if remove_special and v.add_eos and ids and ids[-1] == v.special["eos"]:
            ids = ids[:-1]
        buf = bytearray()
        for t in ids:
            p = self.token_to_piece(t, special=unparse_special)
            if remove_space and p.startswith(b" "):
                p = p[1:]
            remove_space = False
            buf += p
        if not self.clean_spaces:
            return bytes(buf)
        # The three clean-up passes run in place over one buffer, as in llama_vocab::impl::detokenize.
        t = buf
        n = len(t)
        total = 1 if n else 0  # pass 1: drop the space before ? ! . ,
        for i in range(1, n):
            x = t[i]
            if t[i - 1] == 0x20 and x in b"?!.,":
                total -= 1
            t[total] = x
            total += 1
        n = total
        total = 1 if n else 0  # pass 2: " ' " -> "'"; the consumed space reads as NUL afterwards
        i = 1
        while i < n:
            x = t[i]
            if x == 0x27 and i + 1 < n and t[i - 1] == 0x20 and t[i + 1] == 0x20:
                total -= 1
                i += 1
                t[i] = 0
            t[total] = x
            total += 1
            i += 1
        n = total
        total = 1 if n else 0  # pass 3: " 's", " 'm", " 're", " 've" lose their space
        for i in range(1, n):
            x = t[i]
            if t[i - 1] == 0x20 and x == 0x27 and i + 1 < n:
                x1 = t[i + 1]
                if x1 in b"sm":
                    total -= 1
                elif x1 not in b"td" and i + 2 < n and (x1, t[i + 2]) in ((0x72, 0x65), (0x76, 0x65)):
                    total -= 1
            t[total] = x
            total += 1
        return bytes(t[:total])
