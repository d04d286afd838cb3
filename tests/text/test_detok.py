"""Streaming detokenizer: complete characters only, lossless round trip, stated control-token
policy."""

from __future__ import annotations

from muser.text import Detokenizer, stress

from .conftest import open_pair, specials_longest_first


def test_round_trip(pair):
    tok, _ = pair
    for s in stress.stress_texts([], n_random=80):
        if tok.vocab.kind == "spm" and "\u2581" in s:
            continue  # SPM spells spaces as U+2581: that character cannot survive a round trip
        ids = tok.encode(s)
        assert tok.decode(ids) == s
        d = Detokenizer(tok)
        streamed = "".join(d.add(t) for t in ids) + d.flush()
        assert streamed == s
        assert d.text == s


def test_round_trip_with_specials(pair):
    tok, _ = pair
    specials = specials_longest_first(tok)[:4]
    s = f"{specials[0]}one {specials[-1]}two"
    ids = tok.encode(s, parse_special=True)
    assert tok.decode(ids, render_special=True) == s
    d = Detokenizer(tok, render_special=True)
    assert d.add_many(ids) + d.flush() == s


def test_never_emits_partial_utf8(gpt2_gguf):
    tok, _ = open_pair(gpt2_gguf)
    s = "é😀€中"
    ids = tok.encode(s)
    assert len(ids) > len(s)  # the tiny vocab splits these characters into byte tokens
    d = Detokenizer(tok)
    out = []
    for t in ids:
        piece = d.add(t)
        out.append(piece)
        assert "\ufffd" not in piece
        piece.encode("utf-8")  # a whole character or nothing
    assert "".join(out) == s and d.pending_bytes == 0


def test_incomplete_and_invalid_bytes_become_replacement(gpt2_gguf):
    from muser.text.unicode import byte_to_unicode

    tok, _ = open_pair(gpt2_gguf)
    byte_tok = lambda b: tok.vocab.token_to_id[byte_to_unicode()[b]]  # noqa: E731
    d = Detokenizer(tok)
    assert d.add(byte_tok(0xE2)) == "" and d.pending_bytes == 1  # first byte of a 3-byte character
    assert d.add(byte_tok(0x82)) == "" and d.pending_bytes == 2
    assert d.add(byte_tok(0xAC)) == "\u20ac"  # the euro sign, complete
    d = Detokenizer(tok)
    assert d.add(byte_tok(0xE2)) == ""
    assert d.flush() == "\ufffd"  # unfinished at the end
    d = Detokenizer(tok)
    assert d.add(byte_tok(0x80)) + d.add_many(tok.encode("x")) == "\ufffdx"  # a stray continuation byte


def test_control_token_policy(llama4_gguf):
    tok, _ = open_pair(llama4_gguf)
    eot = tok.eot_id
    ud = tok.vocab.token_to_id["<|tool_marker|>"]
    a = tok.encode("a")
    d = Detokenizer(tok)
    assert d.add_many(a + [eot] + a) == "aa"  # control tokens render nothing by default
    d = Detokenizer(tok, render_special=True)
    assert d.add_many(a + [eot] + a) == "a<|eot|>a"
    d = Detokenizer(tok)
    assert d.add_many([ud]) == "<|tool_marker|>"  # user-defined tokens are text
    unused = tok.vocab.token_to_id["[PAD_UNUSED]"]
    assert Detokenizer(tok, render_special=True).add(unused) == ""


def test_spm_space_prefix_is_removed(spm_gguf):
    tok, _ = open_pair(spm_gguf)
    ids = tok.encode("hello world")
    assert tok.token_to_piece(ids[0]).startswith(b" ")  # the encoder's prefix space
    assert tok.decode(ids) == "hello world"
    ids = tok.encode("x</s>  y", parse_special=True)
    assert tok.decode(ids) == "x</s>  y"
