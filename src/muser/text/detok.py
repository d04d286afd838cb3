"""Streaming detokenizer: token ids in, text out as soon as it is whole.

Policy
* Text is emitted only in complete UTF-8 characters: a token that ends inside a multi-byte
  character holds those bytes back until the character completes. Bytes that can never form a
  character (a stray continuation byte, a truncated sequence followed by something else) become
  U+FFFD, one per maximal invalid subsequence (Python's "replace" policy); `flush()` turns a
  sequence still incomplete at the end into U+FFFD.
* Control and unknown tokens render as nothing by default — llama.cpp's token_to_piece with
  special=false, i.e. what the user is shown; `render_special=True` renders their literal text
  (e.g. "<|eot|>"). User-defined tokens always render their text. Unused tokens render nothing.
  End-of-generation tokens never reach the detokenizer in `muser.generation`: the loop stops there.
* SPM vocabularies: the space the encoder puts in front of a text fragment (at the start and after
  a special token) is dropped, so the stream of `encode(s)` reproduces `s`.

For valid text, `"".join(d.add(t) for t in tok.encode(s)) + d.flush() == s` (SPM vocabularies:
text without U+2581, the character SPM uses to spell a space).
"""

from __future__ import annotations

import codecs
from typing import Iterable

from .tokenizer import Tokenizer


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer, render_special: bool = False):
        self.tokenizer = tokenizer
        self.render_special = render_special
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._strip_space = tokenizer.vocab.kind == "spm" and tokenizer.vocab.add_space_prefix
        self._at_fragment_start = True
        self._parts: list[str] = []

    def add(self, token: int) -> str:
        """Feed one token id; returns the text completed by it (possibly "")."""
        tok = self.tokenizer
        piece = tok.token_to_piece(token, special=self.render_special)
        if tok.is_special(token):
            self._at_fragment_start = True
        elif self._at_fragment_start:
            if self._strip_space and piece.startswith(b" "):
                piece = piece[1:]
            self._at_fragment_start = False
        text = self._dec.decode(piece)
        if text:
            self._parts.append(text)
        return text

    def add_many(self, tokens: Iterable[int]) -> str:
        return "".join(self.add(t) for t in tokens)

    def flush(self) -> str:
        """End of stream: bytes of an unfinished character become U+FFFD."""
        text = self._dec.decode(b"", final=True)
        if text:
            self._parts.append(text)
        return text

    @property
    def pending_bytes(self) -> int:
        """Bytes held back waiting for the rest of a character."""
        return len(self._dec.getstate()[0])

    @property
    def text(self) -> str:
        return "".join(self._parts)
