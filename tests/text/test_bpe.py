"""The BPE fast path (`tokenizers` model + word cache) against `bpe_reference`, the merge loop of
llm_tokenizer_bpe_session written out."""

from __future__ import annotations

import random

from muser.text import stress
from muser.text.bpe import bpe_reference, to_byte_level

from .conftest import open_pair


def test_fast_path_equals_reference(llama4_gguf):
    tok, _ = open_pair(llama4_gguf)
    rng = random.Random(11)
    words = set()
    for t in stress.stress_texts([], n_random=60):
        words.update(tok.pretokenizer.split(t))
    words.update("".join(rng.choice("abcdefghijklmnopqrstuvwxyz_ ") for _ in range(rng.randint(1, 30)))
                 for _ in range(500))
    words.update(["a" * 50, "ab" * 40, "self.assertEqual", "__init__", "\n\n\n\n", "    "])
    words = sorted(words)
    fast = tok._bpe.encode_words(words)
    ref = [i for w in words for i in tok._bpe.encode_word_reference(w)]
    assert fast == ref


def test_reference_merge_order():
    # lowest rank first, leftmost on ties, stale pairs skipped
    ranks = {("a", "a"): 0, ("b", "c"): 1, ("aa", "a"): 2}
    assert bpe_reference("aaa", ranks) == ["aaa"]
    assert bpe_reference("aaaa", ranks) == ["aa", "aa"]
    assert bpe_reference("abc", ranks) == ["a", "bc"]


def test_byte_level_of_surrogates_matches_llama_cpp_encoding():
    assert to_byte_level("\ud800") == to_byte_level("\ud800")
    assert len(to_byte_level("\ud800")) == 3  # ED A0 80, as llama.cpp re-encodes it


def test_word_cache_overflow_gives_the_same_ids(llama4_gguf, monkeypatch):
    """A cache cleared while a batch is being filled (it is bounded) changes nothing."""
    import muser.text.bpe as bpe
    from muser.gguf.reader import read_gguf
    from muser.text import Tokenizer

    tok, llm = open_pair(llama4_gguf)
    text = "def tokenize(self, text):\n    return [self.vocab[w] for w in text.split()]  # 42 ünïcode\n" * 3
    more = text + "class Vocabulary:\n    merges = ranks = None\n"  # shares words with `text`
    monkeypatch.setattr(bpe, "_CACHE_MAX", 8)
    small = Tokenizer.from_gguf(read_gguf(llama4_gguf))
    for t in (text, more, text):  # `more` clears the cache, dropping words it then needs again
        assert small.encode(t) == llm.tokenize(t.encode(), add_bos=False, special=False)
