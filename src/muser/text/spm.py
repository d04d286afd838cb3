"""SentencePiece-style tokenization (tokenizer.ggml.model "llama") as llm_tokenizer_spm_session
does it: the fragment's bytes are cut into UTF-8 characters (by lead byte), adjacent symbols whose
concatenation is a token are merged highest score first (leftmost on ties), and symbols that are
not tokens fall back to <0xXX> byte tokens.
"""

from __future__ import annotations

import heapq

from ..errors import TokenizerError
from .vocab import Vocab

_UTF8_LEN = bytes([1] * 12 + [2, 2, 3, 4])  # unicode_len_utf8: by the high nibble of the lead byte


class SPMSession:
    def __init__(self, vocab: Vocab):
        self.vocab = vocab
        self._byte_ids: list[int | None] = []
        for b in range(256):
            i = vocab.token_to_id.get(f"<0x{b:02X}>")
            if i is None and b < 0x80:
                i = vocab.token_to_id.get(chr(b))  # llama.cpp's fallback: the byte as a string
            self._byte_ids.append(i)

    def byte_token(self, b: int) -> int:
        i = self._byte_ids[b]
        if i is None:
            raise TokenizerError(f"SPM vocab has no token for byte 0x{b:02X} (no <0x{b:02X}> byte token)")
        return i

    def tokenize(self, text: bytes, out: list[int]) -> None:
        t2i = self.vocab.token_to_id
        scores = self.vocab.scores
        n_tokens = self.vocab.n_tokens
        # symbols: [start, length] into text; prev/next links
        starts: list[int] = []
        lens: list[int] = []
        off = 0
        while off < len(text):
            ln = min(_UTF8_LEN[text[off] >> 4], len(text) - off)
            starts.append(off)
            lens.append(ln)
            off += ln
        n = len(starts)
        if n == 0:
            return
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n)) + [-1]
        heap: list[tuple[float, int, int, int]] = []
        rev_merge: dict[bytes, tuple[int, int]] = {}

        def piece(i: int) -> bytes:
            return text[starts[i] : starts[i] + lens[i]]

        def try_add(left: int, right: int) -> None:
            if left == -1 or right == -1:
                return
            t = text[starts[left] : starts[left] + lens[left] + lens[right]]
            tid = t2i.get(_as_str(t))
            if tid is None or tid >= n_tokens:
                return
            # max-heap on score, then smaller left index
            heapq.heappush(heap, (-float(scores[tid]), left, right, len(t)))
            rev_merge[t] = (left, right)

        for i in range(1, n):
            try_add(i - 1, i)
        while heap:
            _, left, right, size = heapq.heappop(heap)
            if lens[left] == 0 or lens[right] == 0 or lens[left] + lens[right] != size:
                continue
            lens[left] += lens[right]
            lens[right] = 0
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            try_add(prev[left], left)
            try_add(left, nxt[left])

        def resegment(i: int, depth: int = 0) -> None:
            if depth > 64:
                raise TokenizerError("SPM resegmentation does not terminate for this input")
            t = piece(i)
            tid = t2i.get(_as_str(t))
            if tid is not None:
                out.append(tid)
                return
            p = rev_merge.get(t)
            if p is None:
                out.extend(self.byte_token(b) for b in t)
                return
            resegment(p[0], depth + 1)
            resegment(p[1], depth + 1)

        i = 0
        while i != -1:
            resegment(i)
            i = nxt[i]


def _as_str(b: bytes) -> str | None:
    """Token texts are UTF-8 strings; a byte string that is not valid UTF-8 is no token."""
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return None
