"""One set of prompt defaults (muser.prompt) across Model.stream/generate and `muser generate`:
BOS as the GGUF asks, special-token text literal unless asked, one BOS on a chat, max_tokens and
stop honoured or refused, one default temperature; and the messages that name what is wrong."""

from __future__ import annotations

import json

import pytest

import muser
from muser import prompt as P
from muser.cli import main
from muser.errors import ContextOverflow, SamplingError, TemplateError
from muser.sample import SamplingParams, greedy

INJECT = "x<|eot|>"


@pytest.fixture(scope="module")
def model(tiny_gguf):
    return muser.load(tiny_gguf, device="cpu", lane="exact", kv="f32")


def test_text_gets_bos_and_literal_special_text(model):
    tok = model.tokenizer
    ids = P.encode_text(tok, INJECT)
    assert ids[0] == tok.bos_id and tok.eot_id not in ids
    assert tok.decode(ids[1:]) == INJECT
    parsed = P.encode_text(tok, INJECT, parse_special=True)
    assert parsed[0] == tok.bos_id and parsed[-1] == tok.eot_id
    assert model.encode(INJECT) == ids


def test_api_and_cli_tokenize_a_prompt_alike(model, tiny_gguf, capsys):
    gen = model.stream(INJECT, 2, sampling=greedy())
    list(gen)
    assert gen.prompt_ids == P.encode_text(model.tokenizer, INJECT)
    assert main(["generate", "--model", str(tiny_gguf), "--prompt", INJECT, "--max-tokens", "2",
                 "--temperature", "0", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert summary["prompt_ids"] == gen.prompt_ids
    assert main(["generate", "--model", str(tiny_gguf), "--prompt", INJECT, "--max-tokens", "1",
                 "--temperature", "0", "--json", "--special"]) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert summary["prompt_ids"] == P.encode_text(model.tokenizer, INJECT, parse_special=True)
    opt_in = model.stream(INJECT, 1, sampling=greedy(), parse_special=True)
    list(opt_in)
    assert opt_in.prompt_ids == summary["prompt_ids"]


def test_a_rendered_chat_has_one_bos(model, tiny_gguf, capsys):
    tok = model.tokenizer
    msgs = [{"role": "user", "content": "hi"}]
    ids = model.encode_chat(msgs)
    assert ids[0] == tok.bos_id and ids[1] != tok.bos_id and ids.count(tok.bos_id) == 1
    gen = model.stream_chat(msgs, 1, sampling=greedy())
    list(gen)
    assert gen.prompt_ids == ids
    # a template that writes no BOS gets the GGUF's one
    from muser.text import ChatTemplate

    bare = ChatTemplate("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert P.encode_chat(tok, bare, msgs) == [tok.bos_id] + tok.encode("hi")
    assert main(["generate", "--model", str(tiny_gguf), "--chat", "hi", "--max-tokens", "1", "--temperature",
                 "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["prompt_ids"] == ids


def test_sampling_params_max_tokens_and_stop_are_honoured(model):
    gen = model.stream("Beautiful is", sampling=SamplingParams(temperature=0.0, max_tokens=3))
    list(gen)
    assert 1 <= len(gen.tokens) <= 3 and (gen.finish_reason == "eog" or len(gen.tokens) == 3)
    free = model.stream("Beautiful is", 8, sampling=greedy())
    pieces = [ev.text for ev in free]
    text = "".join(pieces)
    assert text, "the fixture produced no text to stop on"
    stop = text[len(text) // 2:]
    held = model.stream("Beautiful is", 8, sampling=SamplingParams(temperature=0.0, stop=(stop,)))
    out = "".join(ev.text for ev in held)
    assert held.finish_reason == "stop" and out == text[: text.index(stop)]
    # the call's value and the params' value may not disagree
    with pytest.raises(SamplingError, match="max_tokens=4 disagrees with SamplingParams.max_tokens=5"):
        model.stream("x", 4, sampling=SamplingParams(max_tokens=5))
    with pytest.raises(SamplingError, match="stop="):
        model.stream("x", 4, sampling=SamplingParams(stop=("a",)), stop=["b"])


def test_one_default_temperature(model, capsys):
    assert SamplingParams().temperature == P.DEFAULT_TEMPERATURE == 0.8
    gen = model.stream("x")
    em = gen.emitter
    assert em.sampler.params.temperature == 0.8 and em.max_tokens == P.DEFAULT_MAX_TOKENS
    params, n, stops = P.resolve_sampling()
    assert (params.temperature, n, stops) == (0.8, P.DEFAULT_MAX_TOKENS, ())
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "default 0.8" in " ".join(capsys.readouterr().out.split())


def test_context_arithmetic_names_the_right_numbers(tiny_gguf, capsys):
    rc = main(["generate", "--model", str(tiny_gguf), "--prompt", "x", "--max-context", "100000",
               "--max-tokens", "4"])
    err = capsys.readouterr().err
    assert rc == 2 and "--max-context 100000 exceeds the model's context_length" in err
    rc = main(["generate", "--model", str(tiny_gguf), "--prompt", "a b c d e f", "--max-context", "4",
               "--max-tokens", "4"])
    err = capsys.readouterr().err
    assert rc == 2 and "+ max tokens (4) needs" in err and "over --max-context 4" in err
    with pytest.raises(ContextOverflow, match=r"prompt \(3 tokens\) \+ max tokens \(10\) needs 12 positions"):
        P.context_size(3, 10, 8)
    assert P.context_size(3, 10, 100) == 13 and P.context_size(3, 10, 100, 12) == 12


def test_chat_roles_are_checked_against_the_template(model, tiny_gguf, capsys):
    with pytest.raises(TemplateError, match="role 'bogus'"):
        model.chat([{"role": "bogus", "content": "x"}])
    rc = main(["generate", "--model", str(tiny_gguf), "--messages", '[{"role": "bogus", "content": "x"}]'])
    err = capsys.readouterr().err
    assert rc == 2 and "role 'bogus'" in err and "assistant, system, user" in err
    from muser.text import ChatTemplate

    t = ChatTemplate("{% for m in messages %}{% if m['role'] == 'tool' %}T{% endif %}{% endfor %}")
    assert "tool" in t.roles and t.render([{"role": "tool", "content": "r"}]) == "T"


def test_inspect_a_directory_names_it(tmp_path, capsys):
    rc = main(["inspect", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and str(tmp_path) in err and "directory" in err
