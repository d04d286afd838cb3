"""Token-for-token parity with the pinned llama.cpp tokenizer (llama_tokenize / token_to_piece /
detokenize / EOG set) on four vocabularies: the synthetic fixture's byte-level BPE (pre gpt-2),
a GPT-4o-split BPE (pre llama4, Muse Glimmer's type), an SPM vocabulary with byte fallback, and
the fixture's vocabulary under pre "default" (llama.cpp's four-regex split).

Corpus here: a deterministic slice of the CPython stdlib (every Nth file, ASCII and non-ASCII,
plus every file that is not valid UTF-8, through the bytes API) and the stress inputs. The whole
stdlib runs in `muser bench tokenizer`.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import llama_cpp
import numpy as np
import pytest

from muser.text import stress
from muser.text.synth import stdlib_files

from .conftest import open_pair, specials_longest_first

BUDGET = {"gpt2": 1_200_000, "llama4": 1_000_000, "spm": 60_000, "default": 300_000}  # bytes of ordinary files per vocab


@pytest.fixture(scope="session")
def corpus_classes() -> dict[str, list[tuple[str, bytes]]]:
    """The stdlib split into ASCII, other UTF-8 and non-UTF-8 files (sorted order)."""
    out: dict[str, list] = {"ascii": [], "utf8": [], "bad": []}
    for f in stdlib_files():
        b = Path(f).read_bytes()
        if b.isascii():
            out["ascii"].append((f, b))
            continue
        try:
            b.decode("utf-8")
            out["utf8"].append((f, b))
        except UnicodeDecodeError:
            out["bad"].append((f, b))
    assert out["bad"], "the stdlib has files that are not UTF-8; the bytes path must see them"
    return out


def _slice(files, step: int, budget: int):
    got, total = [], 0
    for f, b in files[::step]:
        if total >= budget:
            break
        got.append((f, b))
        total += len(b)
    return got


def _diff(a, b) -> str:
    k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"first difference at {k}: llama.cpp {a[k:k + 6]} vs muser {b[k:k + 6]} (lengths {len(a)}, {len(b)})"


def test_stdlib_slice(kind, vocab_path, corpus_classes):
    tok, llm = open_pair(vocab_path)
    budget = BUDGET[kind]
    cases = _slice(corpus_classes["ascii"], 97, budget * 2 // 3) + _slice(corpus_classes["utf8"], 7, budget // 3)
    n_tokens = 0
    for name, data in cases:
        ref = llm.tokenize(data, add_bos=False, special=False)
        ours = tok.encode(data.decode("utf-8"))
        assert ours == ref, f"{name}: {_diff(ref, ours)}"
        n_tokens += len(ref)
    for name, data in corpus_classes["bad"]:
        ref = llm.tokenize(data, add_bos=False, special=False)
        assert tok.encode_bytes(data) == ref, f"{name} (bytes): {_diff(ref, tok.encode_bytes(data))}"
        n_tokens += len(ref)
    assert n_tokens > 1000


def test_stress_texts(pair):
    tok, llm = pair
    specials = specials_longest_first(tok)
    assert specials
    for text in stress.stress_texts(specials, n_random=120):
        for add in (False, True):
            for sp in (False, True):
                ref = llm.tokenize(text.encode("utf-8"), add_bos=add, special=sp)
                ours = tok.encode(text, add_special=add, parse_special=sp)
                assert ours == ref, f"{text[:60]!r} add_special={add} parse_special={sp}: {_diff(ref, ours)}"


def test_stress_bytes(pair):
    tok, llm = pair
    for data in stress.stress_bytes(n_random=80):
        for sp in (False, True):
            ref = llm.tokenize(data, add_bos=False, special=sp)
            assert tok.encode_bytes(data, parse_special=sp) == ref, f"{data!r} parse_special={sp}"


def test_special_text_is_text_unless_parsed(gpt2_gguf):
    tok, llm = open_pair(gpt2_gguf)
    s = "a<|eot|>b"
    plain, parsed = tok.encode(s), tok.encode(s, parse_special=True)
    assert tok.eot_id not in plain and tok.eot_id in parsed
    assert plain == llm.tokenize(s.encode(), add_bos=False, special=False)
    assert parsed == llm.tokenize(s.encode(), add_bos=False, special=True)


def test_user_defined_tokens_always_split(llama4_gguf):
    tok, llm = open_pair(llama4_gguf)
    ud = tok.vocab.token_to_id["<|tool_marker|>"]
    s = "call<|tool_marker|>now"
    assert ud in tok.encode(s)  # user-defined: partitioned without parse_special
    assert tok.encode(s) == llm.tokenize(s.encode(), add_bos=False, special=False)


def _piece(llm, tid: int, special: bool) -> bytes:
    buf = ctypes.create_string_buffer(512)
    n = llama_cpp.llama_token_to_piece(llm._model.vocab, tid, buf, 512, 0, special)
    assert n >= 0
    return buf.raw[:n]


def test_token_to_piece_every_id(pair):
    tok, llm = pair
    for tid in range(tok.vocab_size):
        for special in (True, False):
            assert tok.token_to_piece(tid, special=special) == _piece(llm, tid, special), (tid, special)


def _detok(llm, ids, remove_special, unparse_special) -> bytes:
    arr = (llama_cpp.llama_token * len(ids))(*ids)
    size = 8 * len(ids) + 64
    for _ in range(2):
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_detokenize(llm._model.vocab, arr, len(ids), buf, size, remove_special, unparse_special)
        if n >= 0:
            return buf.raw[:n]
        size = -n  # too small: llama.cpp reports the size it needs
    raise AssertionError(f"llama_detokenize kept asking for more room ({n})")


def test_detokenize(pair):
    tok, llm = pair
    rng = np.random.default_rng(3)
    texts = stress.stress_texts(specials_longest_first(tok), n_random=30)
    seqs = [tok.encode(t, add_special=True, parse_special=True) for t in texts]
    seqs += [list(map(int, rng.integers(0, tok.vocab_size, 40))) for _ in range(50)]
    seqs += [[tok.bos_id], [tok.eos_id, tok.bos_id], tok.encode(" ' s 're . , ? ! 'm 've 'll 't 'd ")]
    for ids in seqs:
        for rs in (False, True):
            for us in (False, True):
                assert tok.detokenize(ids, remove_special=rs, unparse_special=us) == _detok(llm, ids, rs, us), (ids[:10], rs, us)


def test_special_ids_and_eog_set(pair):
    tok, llm = pair
    v = llm._model.vocab
    assert tok.bos_id == llama_cpp.llama_vocab_bos(v)
    assert tok.eos_id == llama_cpp.llama_vocab_eos(v)
    assert (tok.eot_id if tok.eot_id is not None else -1) == llama_cpp.llama_vocab_eot(v)
    assert tok.add_bos == llama_cpp.llama_vocab_get_add_bos(v)
    assert tok.add_eos == llama_cpp.llama_vocab_get_add_eos(v)
    assert tok.vocab_size == llama_cpp.llama_vocab_n_tokens(v)
    eog = {t for t in range(tok.vocab_size) if llama_cpp.llama_vocab_is_eog(v, t)}
    assert eog == set(tok.eog_ids)


def test_dual_eos(gpt2_gguf, llama4_gguf):
    """Book 9.13: EOS and EOT are both end-of-generation."""
    for path in (gpt2_gguf, llama4_gguf):
        tok, _ = open_pair(path)
        assert {tok.eos_id, tok.eot_id} <= tok.eog_ids
        assert tok.eos_id != tok.eot_id


def test_overlapping_equal_length_specials(llama4_gguf):
    """"<|ab|ab|>" holds two equal-length control tokens; which one wins is llama.cpp's
    special-token cache order (std::sort's tie order), reproduced."""
    tok, llm = open_pair(llama4_gguf)
    for s in ("<|ab|ab|>", "x<|ab|ab|>y<|ab|ab", "ab|ab|><|ab|ab|>ab|ab|>"):
        ref = llm.tokenize(s.encode(), add_bos=False, special=True)
        assert tok.encode(s, parse_special=True) == ref, s
    assert tok.vocab._cache_order is not None  # the exact order was consulted
    first, second = tok.vocab.token_to_id["<|ab|ab"], tok.vocab.token_to_id["ab|ab|>"]
    # introsort's tie order puts the higher id first here: a by-length-then-id order would differ
    assert tok.encode("<|ab|ab|>", parse_special=True)[-1] == second and first < second


def test_default_model_tokenizer(corpus_classes):
    """The embedded default model's tokenizer (the shipped micro model when the repository has
    it, else the synthetic fixture): stress inputs and a stdlib slice."""
    from muser.api import default_model_path

    tok, llm = open_pair(default_model_path())
    for text in stress.stress_texts(specials_longest_first(tok), n_random=40):
        for sp in (False, True):
            ref = llm.tokenize(text.encode("utf-8"), add_bos=True, special=sp)
            assert tok.encode(text, add_special=True, parse_special=sp) == ref, text[:60]
    for name, data in _slice(corpus_classes["ascii"], 211, 300_000) + _slice(corpus_classes["utf8"], 41, 100_000):
        assert tok.encode(data.decode("utf-8")) == llm.tokenize(data, add_bos=False, special=False), name


def test_muse_glimmer_vocabulary_shape(glimmer_shape_gguf, corpus_classes):
    """202,048 ids under pre llama4 (llama.cpp's GPT4O split), as Muse Glimmer's vocabulary:
    the same ids, specials, end-of-generation set, pieces and token lists as llama.cpp."""
    from .conftest import MUSE_GLIMMER_VOCAB

    tok, llm = open_pair(glimmer_shape_gguf)
    v = llm._model.vocab
    assert tok.vocab_size == llama_cpp.llama_vocab_n_tokens(v) == MUSE_GLIMMER_VOCAB
    assert tok.vocab.pre == "llama4" and tok.pretokenizer.kind == "gpt4o"
    assert tok.bos_id == llama_cpp.llama_vocab_bos(v) and tok.eot_id == llama_cpp.llama_vocab_eot(v)
    last = MUSE_GLIMMER_VOCAB - 1
    for sp in (False, True):
        s = f"x<|reserved_special_token_{last - 200_000}|>y<|eot|>"
        assert tok.encode(s, parse_special=sp) == llm.tokenize(s.encode(), add_bos=False, special=sp)
    assert last in tok.encode(f"<|reserved_special_token_{last - 200_000}|>", parse_special=True)
    rng = np.random.default_rng(11)
    for tid in rng.integers(0, MUSE_GLIMMER_VOCAB, 300).tolist() + [last, 199_999, 200_000]:
        for special in (True, False):
            assert tok.token_to_piece(tid, special=special) == _piece(llm, tid, special), tid
    for text in stress.stress_texts(["<|eot|>", "<|begin_of_text|>"], n_random=20):
        for add, sp in ((False, False), (True, True)):
            ref = llm.tokenize(text.encode("utf-8"), add_bos=add, special=sp)
            assert tok.encode(text, add_special=add, parse_special=sp) == ref, text[:60]
    for name, data in _slice(corpus_classes["ascii"], 307, 150_000) + _slice(corpus_classes["utf8"], 53, 60_000):
        assert tok.encode(data.decode("utf-8")) == llm.tokenize(data, add_bos=False, special=False), name
