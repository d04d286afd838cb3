"""Byte-level BPE words -> ids, as llm_tokenizer_bpe_session::tokenize does it.

Each pre-tokenized word is UTF-8 encoded, mapped byte by byte onto the byte-level alphabet, then
merged: repeatedly the adjacent pair with the lowest merge rank, leftmost first, until no pair
has a rank. `bpe_reference` is that loop written out (the spec); the fast path hands whole
batches of unseen words to `tokenizers`' BPE model (same rule, Rust) and caches word -> ids.
The load refuses vocabularies where the two could part: a merge whose parts or result are not
tokens, or a byte-level character missing from the vocab.
"""

from __future__ import annotations

import heapq
import itertools
import json
import threading

from ..errors import TokenizerError
from . import unicode as U
from .vocab import Vocab

_CACHE_MAX = 1 << 19

# latin-1 character of byte b -> byte-level BPE character of b
_LATIN1_TO_BYTELEVEL = {b: c for b, c in enumerate(U.byte_to_unicode())}


def to_byte_level(word: str) -> str:
    """A word's UTF-8 bytes in the byte-level alphabet (lone surrogates as llama.cpp encodes them)."""
    return U.encode_utf8(word).decode("latin-1").translate(_LATIN1_TO_BYTELEVEL)


def bpe_reference(word: str, ranks: dict[tuple[str, str], int]) -> list[str]:
    """The merge loop of llm_tokenizer_bpe_session on one byte-level word: symbols are the
    word's characters; a queue ordered by (rank, left index) yields the next merge; stale entries
    (a side already merged away or changed) are skipped."""
    sym = list(word)
    n = len(sym)
    nxt = list(range(1, n)) + [-1]
    prv = list(range(-1, n - 1))
    heap: list[tuple[int, int, int, str]] = []

    def add(left: int, right: int) -> None:
        if left == -1 or right == -1:
            return
        r = ranks.get((sym[left], sym[right]))
        if r is not None:
            heapq.heappush(heap, (r, left, right, sym[left] + sym[right]))

    for i in range(1, n):
        add(i - 1, i)
    while heap:
        _, left, right, text = heapq.heappop(heap)
        if not sym[left] or not sym[right] or sym[left] + sym[right] != text:
            continue
        sym[left] = text
        sym[right] = ""
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prv[nxt[right]] = left
        add(prv[left], left)
        add(left, nxt[left])
    return [s for s in sym if s]


class BPEWords:
    """word (str, as split) -> token ids, with a word cache in front of `tokenizers`' BPE."""

    def __init__(self, vocab: Vocab):
        from tokenizers import Tokenizer

        self.vocab = vocab
        missing = [c for c in U.byte_to_unicode() if c not in vocab.token_to_id]
        if missing:
            raise TokenizerError(
                f"byte-level BPE vocab lacks {len(missing)} of the 256 byte characters "
                f"(first {missing[0]!r}); llama.cpp would drop those bytes"
            )
        spec = {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
            "ignore_merges": False, "vocab": vocab.token_to_id, "merges": [list(m) for m in vocab.merges],
        }
        doc = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
               "normalizer": None, "pre_tokenizer": None, "post_processor": None, "decoder": None,
               "model": spec}
        self._hf = Tokenizer.from_str(json.dumps(doc))
        self._cache: dict[str, tuple[int, ...]] = {}
        self._lock = threading.Lock()

    def _fill(self, uniq: list[str]) -> None:
        """Merge each of `uniq` (distinct words not in the cache) and cache the ids."""
        if not uniq:
            return
        enc = self._hf.encode([to_byte_level(w) for w in uniq], is_pretokenized=True, add_special_tokens=False)
        groups: list[list[int]] = [[] for _ in uniq]
        for tid, wid in zip(enc.ids, enc.word_ids):
            groups[wid].append(tid)
        with self._lock:
            if len(self._cache) + len(uniq) > _CACHE_MAX:
                self._cache.clear()
            for w, g in zip(uniq, groups):
                self._cache[w] = tuple(g)

    def encode_words(self, words: list[str]) -> list[int]:
        cache = self._cache
        try:
            return list(itertools.chain.from_iterable(map(cache.__getitem__, words)))
        except KeyError:
            pass
        # set - dict runs in C; the order of the batch does not matter (each word on its own)
        self._fill(list(set(words).difference(cache)))
        try:
            return list(itertools.chain.from_iterable(map(self._cache.__getitem__, words)))
        except KeyError:
            pass
        get = self._cache.get
        out: list[int] = []
        for w in words:  # the cache was cleared while filling: recompute what went missing
            ids = get(w)
            if ids is None:
                self._fill([w])
                ids = self._cache[w]
            out.extend(ids)
        return out

    def encode_word_reference(self, word: str) -> list[int]:
        """`bpe_reference` on one word (tests compare it with the fast path)."""
        ranks = self._ranks()
        return [self.vocab.token_to_id[s] for s in bpe_reference(to_byte_level(word), ranks)]

    def _ranks(self) -> dict[tuple[str, str], int]:
        r = getattr(self, "_rank_cache", None)
        if r is None:
            r = {m: i for i, m in enumerate(self.vocab.merges)}
            self._rank_cache = r
        return r
