"""GGUF tokenizer metadata: what is refused (typed, naming the value) and what is derived."""

from __future__ import annotations

import pytest
from gguf import GGUFValueType as V

from muser.errors import TokenizerError
from muser.gguf.reader import read_gguf
from muser.gguf.writer import Typed
from muser.model import synth as msynth
from muser.text import Tokenizer
from muser.text import synth as tsynth
from muser.text.pretokenize import PRE_TYPES, PreTokenizer


def _tok(tmp_path, **changes):
    md = msynth.tokenizer_metadata(msynth.SynthSpec())
    for k, v in changes.items():
        key = "tokenizer." + k.replace("__", ".")
        if v is None:
            md.pop(key, None)
        else:
            md[key] = v
    path = tsynth.write_vocab_gguf(tmp_path / "v.gguf", md)
    return Tokenizer.from_gguf(read_gguf(path))


def test_loads(tmp_path):
    tok = _tok(tmp_path)
    assert tok.vocab.pre == "gpt-2" and tok.vocab_size == 384
    assert (tok.bos_id, tok.eos_id, tok.eot_id) == (0, 1, 2)
    assert tok.sha256 and len(tok.sha256) == 64


def test_unknown_pre_is_refused_by_name(tmp_path):
    with pytest.raises(TokenizerError, match="'qwen-ish-9'"):
        _tok(tmp_path, ggml__pre="qwen-ish-9")


def test_missing_pre_is_refused_not_defaulted(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer.ggml.pre"):
        _tok(tmp_path, ggml__pre=None)


def test_unknown_model_is_refused(tmp_path):
    with pytest.raises(TokenizerError, match="'bert'"):
        _tok(tmp_path, ggml__model="bert")


def test_token_type_length_mismatch(tmp_path):
    with pytest.raises(TokenizerError, match="vocab length mismatch: 384 tokens but 383 token types"):
        _tok(tmp_path, ggml__token_type=Typed([1] * 383, V.ARRAY, V.INT32))


def test_scores_length_mismatch(tmp_path):
    with pytest.raises(TokenizerError, match="vocab length mismatch: 384 tokens but 385 scores"):
        _tok(tmp_path, ggml__scores=Typed([0.0] * 385, V.ARRAY, V.FLOAT32))


def test_duplicate_token_text(tmp_path):
    toks = list(msynth.tokenizer_metadata(msynth.SynthSpec())["tokenizer.ggml.tokens"])
    toks[300] = toks[200]
    with pytest.raises(TokenizerError, match="appears twice"):
        _tok(tmp_path, ggml__tokens=toks)


def test_merge_outside_vocab(tmp_path):
    merges = list(msynth.tokenizer_metadata(msynth.SynthSpec())["tokenizer.ggml.merges"]) + ["zq xj"]
    with pytest.raises(TokenizerError, match="'zq xj'"):
        _tok(tmp_path, ggml__merges=merges)


def test_special_id_out_of_range(tmp_path):
    with pytest.raises(TokenizerError, match="eot_token_id' = 9999"):
        _tok(tmp_path, ggml__eot_token_id=Typed(9999, V.UINT32))


def test_strip_attribute_models_refused(tmp_path):
    md = msynth.tokenizer_metadata(msynth.SynthSpec())
    path = tsynth.write_vocab_gguf(tmp_path / "v.gguf", md)
    f = read_gguf(path)
    from muser.text.vocab import _check_name_rules

    _check_name_rules(f, "gpt-2")  # the synthetic name passes
    with pytest.raises(TokenizerError, match="strip"):
        _check_name_rules(f, "jina-v2-de")


def test_llama4_is_the_gpt4o_pre_type():
    # llama-vocab.cpp: tokenizer_pre == "llama4" -> LLAMA_VOCAB_PRE_TYPE_GPT4O, clean_spaces false
    assert PRE_TYPES["llama4"] == "gpt4o"
    p = PreTokenizer("llama4")
    assert p.kind == "gpt4o" and p.clean_spaces is False
    assert PreTokenizer("gpt-2").clean_spaces is True


def test_encode_refuses_non_str_and_lone_surrogates(tmp_path):
    tok = _tok(tmp_path)
    with pytest.raises(TokenizerError, match="takes str"):
        tok.encode(b"bytes")
    with pytest.raises(TokenizerError, match="U\\+D800"):
        tok.encode("a\ud800b")


def test_encode_bytes_refuses_above_max_codepoint(tmp_path):
    from muser.text.stress import OVER_MAX_BYTES

    tok = _tok(tmp_path)
    for data in OVER_MAX_BYTES:
        with pytest.raises(TokenizerError, match="above U\\+10FFFF"):
            tok.encode_bytes(data)


def test_add_special_follows_the_gguf(tmp_path):
    tok = _tok(tmp_path)
    assert tok.encode("hi", add_special=True)[0] == tok.bos_id
    tok2 = _tok(tmp_path, ggml__add_bos_token=False, ggml__add_eos_token=True)
    ids = tok2.encode("hi", add_special=True)
    assert ids[0] != tok2.bos_id and ids[-1] == tok2.eos_id


def test_suppress_tokens(tmp_path):
    tok = _tok(tmp_path, ggml__suppress_tokens=Typed([7, 9, 100000], V.ARRAY, V.INT32))
    assert tok.vocab.suppress_tokens == (7, 9)  # out-of-range ids dropped, as llama.cpp does
