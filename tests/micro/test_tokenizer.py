"""The micro tokenizer: byte-level BPE with the llama4 (GPT-4o) pre-tokenizer, token-for-token equal to
the pinned llama.cpp (`tokenizer.ggml.pre = "llama4"` -> LLAMA_VOCAB_PRE_TYPE_GPT4O)."""

from __future__ import annotations

from dataclasses import asdict

import pytest

import llama_cpp  # noqa: E402,F811

from muser.gguf.writer import write_gguf  # noqa: E402

STRESS = [
    "Ünïcödé wörds ÀÉÎ straße İstanbul ǅemal ǈ Ǌ",
    "日本語のテキスト 中文 한국어",
    "x\u00a0y\u2003z \u3000 a\u0085b",
    "e\u0301 a\u0308\u0308 ",
    "١٢٣٤ ²³ ⅷ 10000000 3.14159e-10",
    "I'M you'RE they'Ll DON'T can't",
    "\t\t\n\r\n  \n   x\x0b\x0c\x1c\x1f",
    "🙂🙃 a🙂b",
    "ǅǅǅ abcDEF ABCdef aBC HTTPServer getHTTPResponse",
    "\u200d\u200b\ufeff x",
    "$$$ +++ <=> ^^ `` | ~~ /// \\n\r\n/",
    "def f(x):\n    return x**2  # ok\n\n\n\tclass A: pass\n",
]


def _vocab_gguf(tmp_path, export_mod, train_mod, tokens, merges):
    g = asdict(train_mod.Geometry(vocab=len(tokens)))
    md = export_mod.metadata(g, tokens, merges, "F32", {"test": True})
    return write_gguf(tmp_path / "vocab.gguf", "muse-glimmer", md, [], lambda s: None)


@pytest.fixture(scope="module")
def small_tok(small_corpus):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(small_corpus / "tokenizer.json"))


@pytest.fixture(scope="module")
def vocab_llama(small_tok, corpus_mod, export_mod, train_mod, tmp_path_factory):
    tokens, merges = corpus_mod.vocab_and_merges(small_tok)
    p = _vocab_gguf(tmp_path_factory.mktemp("vocab"), export_mod, train_mod, tokens, merges)
    return llama_cpp.Llama(str(p), vocab_only=True, verbose=False)


def test_specials_and_alphabet(small_tok, corpus_mod):
    assert small_tok.get_vocab_size() == 512
    for i, s in enumerate(corpus_mod.SPECIALS):
        assert small_tok.token_to_id(s) == i
    from tokenizers import pre_tokenizers

    vocab = small_tok.get_vocab()
    assert all(c in vocab for c in pre_tokenizers.ByteLevel.alphabet())  # every byte encodable


def test_training_is_deterministic(corpus_mod, all_docs):
    docs = corpus_mod.split_docs(all_docs, "train")[:12]
    a = corpus_mod.train_tokenizer([d.text for d in docs], 400)
    b = corpus_mod.train_tokenizer([d.text for d in docs], 400)
    assert corpus_mod.vocab_and_merges(a) == corpus_mod.vocab_and_merges(b)


def test_rebuilt_from_gguf_vocab_is_the_same_tokenizer(small_tok, corpus_mod, heldout_docs):
    tokens, merges = corpus_mod.vocab_and_merges(small_tok)
    rebuilt = corpus_mod.tokenizer_from_vocab(tokens, merges)
    docs = heldout_docs[:20]
    for text in [d.text for d in docs] + STRESS:
        assert rebuilt.encode(text, add_special_tokens=False).ids == small_tok.encode(text, add_special_tokens=False).ids


def test_parity_with_llama_cpp_on_heldout(small_tok, vocab_llama, heldout_docs):
    docs = heldout_docs
    n = 0
    for d in docs:
        ours = small_tok.encode(d.text, add_special_tokens=False).ids
        theirs = vocab_llama.tokenize(d.data, add_bos=False, special=False)
        assert ours == theirs, d.relpath
        n += len(ours)
    assert n > 100_000
    for text in STRESS:
        assert small_tok.encode(text, add_special_tokens=False).ids == \
            vocab_llama.tokenize(text.encode(), add_bos=False, special=False), repr(text)
    # BOS handling: llama.cpp adds BOS (add_bos_token = true), the template's bos_token is id 0
    assert vocab_llama.tokenize(b"import os", add_bos=True, special=False)[0] == 0


def test_parity_check_can_fail(small_tok, vocab_llama, corpus_mod, heldout_docs):
    """The same vocab behind GPT-2's pre-tokenizer (llama.cpp pre "gpt-2") disagrees with llama.cpp's
    llama4 splitting on real files: the comparison above is able to fail."""
    from tokenizers import pre_tokenizers

    tokens, merges = corpus_mod.vocab_and_merges(small_tok)
    wrong = corpus_mod.tokenizer_from_vocab(tokens, merges)
    wrong.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    docs = heldout_docs[:10]
    differ = sum(wrong.encode(d.text, add_special_tokens=False).ids !=
                 vocab_llama.tokenize(d.data, add_bos=False, special=False) for d in docs)
    assert differ >= 5
