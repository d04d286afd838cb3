"""The generation loop and `muser generate`.

Loop logic (stops, streaming, hold-back, feeding) runs against a scripted session whose logits
peak at a planned token sequence; the end-to-end tests run the real CPU engine from muser.load
on the tiny synthetic fixture, through the API and through the command line."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import muser
from muser.cli import main
from muser.errors import EmptyInput, SamplingError, TokenizerError
from muser.gguf.reader import read_gguf
from muser.generation import generate
from muser.sample import SamplingParams, log_softmax_at
from muser.text import Tokenizer

GREEDY = SamplingParams(temperature=0.0, seed=1)


class ScriptedSession:
    """prefill/decode return logits whose argmax is the next planned token; checks feeding."""

    def __init__(self, vocab: int, plan: list[int], base: np.ndarray | None = None):
        self.vocab, self.plan = vocab, plan
        self.base = base if base is not None else np.linspace(-1, 0, vocab, dtype=np.float32)
        self.fed: list[int] = []
        self.n_past = 0
        self.prefilled: list[int] | None = None

    def _row(self, i: int) -> np.ndarray:
        x = self.base.copy()
        if i < len(self.plan):
            x[self.plan[i]] = 10.0
        return x

    def prefill(self, ids):
        self.prefilled = list(ids)
        self.n_past = len(ids)
        return self._row(0)

    def decode(self, token):
        assert token == self.plan[len(self.fed)], "the loop fed back a token it did not sample"
        self.fed.append(token)
        self.n_past += 1
        return self._row(len(self.fed))


@pytest.fixture(scope="module")
def tok(tiny_gguf) -> Tokenizer:
    return Tokenizer.from_gguf(read_gguf(tiny_gguf))


def run(tok, plan, prompt="Hi", **kw):
    s = ScriptedSession(tok.vocab_size, plan)
    g = generate(s, tok, tok.encode(prompt, add_special=True), kw.pop("sampling", GREEDY), **kw)
    return g, list(g), s


def test_max_tokens(tok):
    plan = tok.encode("def fibonacci(n): return a")
    g, ev, s = run(tok, plan, max_tokens=5)
    assert [e.token for e in ev] == plan[:5] and g.tokens == plan[:5]
    assert ev[-1].finish_reason == "length" and all(e.finish_reason is None for e in ev[:-1])
    assert s.fed == plan[:4]  # the last token is not fed back
    assert g.text == "".join(e.text for e in ev) == tok.decode(plan[:5])
    assert g.ttft_s is not None and g.ttft_s > 0 and g.finish_reason == "length"


@pytest.mark.parametrize("which", ["eos", "eot"])
def test_stops_at_either_end_of_generation_token(tok, which):
    eog = tok.eos_id if which == "eos" else tok.eot_id
    body = tok.encode("Readability counts.")
    g, ev, s = run(tok, body + [eog] + tok.encode(" more"), max_tokens=50)
    assert [e.token for e in ev] == body + [eog]
    assert ev[-1].finish_reason == "eog" and ev[-1].text == ""
    assert g.text == "Readability counts." and eog not in s.fed


def test_stop_string_across_tokens(tok):
    plan = tok.encode("Flat is better STOP than nested")
    g, ev, s = run(tok, plan, max_tokens=40, stop=["STOP", "zzz"])
    assert g.finish_reason == "stop" and g.text == "Flat is better "
    assert "S" not in "".join(e.text for e in ev)  # the stop string's start was held back, never shown
    assert ev[-1].finish_reason == "stop"


def test_held_back_prefix_released_when_no_stop(tok):
    plan = tok.encode("Sparse is better than dense.")
    g, ev, _ = run(tok, plan, max_tokens=len(plan), stop=["dense!"])
    assert g.finish_reason == "length" and g.text == "Sparse is better than dense."


def test_streaming_is_incremental(tok):
    plan = tok.encode("one two three four")
    s = ScriptedSession(tok.vocab_size, plan)
    g = generate(s, tok, tok.encode("x"), GREEDY, max_tokens=len(plan))
    assert s.prefilled is None  # nothing runs before the first event is asked for
    for i, e in enumerate(g):
        assert len(s.fed) == i  # each event arrives before the next forward
    assert g.tokens == plan


def test_multibyte_characters_are_whole(tok):
    plan = tok.encode("é😀x")
    g, ev, _ = run(tok, plan, max_tokens=len(plan))
    assert all("\ufffd" not in e.text for e in ev) and g.text == "é😀x"
    assert any(e.text == "" for e in ev)  # bytes held back mid-character


def test_logprob_is_the_raw_log_softmax(tok):
    plan = tok.encode("abc")
    g, ev, s = run(tok, plan, max_tokens=2)
    row = s._row(0)
    assert ev[0].logprob == pytest.approx(log_softmax_at(row, plan[0]), abs=0)
    assert ev[0].logprob < 0


def test_prompt_tokens_count_for_repetition_penalties(tok):
    a, b = tok.encode("a")[0], tok.encode("b")[0]
    base = np.full(tok.vocab_size, -5.0, np.float32)
    base[a], base[b] = 2.0, 1.9
    s = ScriptedSession(tok.vocab_size, [], base)
    P = SamplingParams(temperature=0.0, repeat_penalty=2.0, seed=1)
    assert list(generate(s, tok, [a], P, max_tokens=1))[0].token == b  # a was in the prompt
    s = ScriptedSession(tok.vocab_size, [], base)
    assert list(generate(s, tok, [b], P, max_tokens=1))[0].token == a


def test_suppress_tokens_are_banned(tiny_gguf, tmp_path):
    from gguf import GGUFValueType as V

    from muser.gguf.writer import Typed
    from muser.model import synth as msynth
    from muser.text import synth as tsynth

    md = msynth.tokenizer_metadata(msynth.SynthSpec())
    md["tokenizer.ggml.suppress_tokens"] = Typed([40], V.ARRAY, V.INT32)
    t = Tokenizer.from_gguf(read_gguf(tsynth.write_vocab_gguf(tmp_path / "v.gguf", md)))
    s = ScriptedSession(t.vocab_size, [40, 41])
    ev = list(generate(s, t, [3], GREEDY, max_tokens=1))
    assert ev[0].token != 40


def test_refusals(tok):
    s = ScriptedSession(tok.vocab_size, [5])
    with pytest.raises(EmptyInput):
        generate(s, tok, [], GREEDY, max_tokens=3)
    with pytest.raises(SamplingError, match="max_tokens"):
        generate(s, tok, [1], GREEDY, max_tokens=0)
    with pytest.raises(TokenizerError, match="outside the vocab"):
        generate(s, tok, [99999], GREEDY, max_tokens=3)
    with pytest.raises(SamplingError, match="stop strings"):
        generate(s, tok, [1], GREEDY, max_tokens=3, stop=[""])
    wrong = ScriptedSession(tok.vocab_size + 1, [5])
    with pytest.raises(TokenizerError, match="vocab"):
        list(generate(wrong, tok, [1], GREEDY, max_tokens=3))


# -- end to end: the real engine on the tiny fixture --------------------------------------------


@pytest.fixture(scope="module")
def model(tiny_gguf):
    m = muser.load(tiny_gguf, device="cpu")
    yield m
    m.close()


def test_end_to_end_greedy_is_argmax(model):
    tok = model.tokenizer
    ids = tok.encode("Beautiful is better than", add_special=True)
    g = generate(model.session(max_context=64), tok, ids, GREEDY, max_tokens=12)
    events = list(g)
    assert len(events) >= 1 and g.finish_reason in ("length", "eog")
    # replay: each generated token is the first maximum of the logits it was drawn from
    s = model.session(max_context=64)
    logits = s.prefill(ids)
    for e in events:
        assert e.token == int(np.argmax(logits))
        assert math.isfinite(e.logprob) and e.logprob == pytest.approx(log_softmax_at(logits, e.token), abs=0)
        if e.finish_reason is None:
            logits = s.decode(e.token)
    assert g.text == tok.decode([e.token for e in events if e.token not in tok.eog_ids], render_special=False)


def test_cli_generate_json(tiny_gguf, model, capsys):
    rc = main(["generate", "--model", str(tiny_gguf), "--prompt", "Errors should never", "--max-tokens", "6",
               "--temperature", "0.9", "--seed", "17", "--json"])
    assert rc == 0
    out, err = capsys.readouterr()
    lines = [json.loads(x) for x in out.splitlines()]
    events, summary = lines[:-1], lines[-1]
    assert summary["summary"] and summary["seed"] == 17 and summary["ids"] == [e["token"] for e in events]
    assert summary["text"] == "".join(e["text"] for e in events)
    assert "TTFT" in err and "tok/s" in err
    # the same seed through the API gives the same tokens
    tok = model.tokenizer
    ids = tok.encode("Errors should never", add_special=True)
    assert summary["prompt_ids"] == ids
    P = SamplingParams(temperature=0.9, seed=17)
    g = generate(model.session(max_context=len(ids) + 6), tok, ids, P, max_tokens=6)
    assert [e.token for e in g] == summary["ids"]


def test_cli_generate_chat_streams_text(tiny_gguf, capsys):
    rc = main(["generate", "--model", str(tiny_gguf), "--chat", "hello", "--system", "be brief",
               "--max-tokens", "4", "--temperature", "0"])
    assert rc == 0
    out, err = capsys.readouterr()
    assert out.endswith("\n") and "finish" in err


def test_cli_bad_input_is_one_line(tiny_gguf, capsys):
    rc = main(["generate", "--model", str(tiny_gguf), "--prompt", "x", "--top-p", "1.5"])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "top_p must be in (0, 1], got 1.5" in err
    rc = main(["generate", "--model", str(tiny_gguf), "--messages", "{not json"])
    assert rc == 2 and "not valid JSON" in capsys.readouterr().err


def test_cli_generate_with_no_prompt_uses_the_default(tiny_gguf, capsys):
    from muser.commands.generate import DEFAULT_PROMPT

    rc = main(["generate", "--model", str(tiny_gguf), "--max-tokens", "2", "--json", "--seed", "5"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    tok = Tokenizer.from_gguf(read_gguf(tiny_gguf))
    assert summary["prompt_ids"] == tok.encode(DEFAULT_PROMPT, add_special=True)


def test_cli_generate_with_no_model_streams_from_the_default_model(capsys):
    """No --model: the embedded default (the shipped micro model when the repository has it)."""
    from muser.api import default_model_path

    argv = ["generate", "--prompt", "import os\n", "--max-tokens", "5", "--temperature", "0"]
    assert main(argv + ["--json"]) == 0
    out, err = capsys.readouterr()
    lines = [json.loads(x) for x in out.splitlines()]
    events, summary = lines[:-1], lines[-1]
    assert summary["model"] == str(default_model_path()) and summary["device"] == "cpu"
    assert 1 <= len(events) <= 5 and summary["finish_reason"] in ("length", "eog")
    assert all(isinstance(e["logprob"], float) and e["logprob"] <= 0 for e in events)
    assert "TTFT" in err and "tok/s" in err
    # the plain stream writes the same text (then a newline); the stats go to stderr only
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert out == summary["text"] + "\n" and "TTFT" in err and "TTFT" not in out


def test_cli_generate_device_cuda(tiny_gguf, capsys):
    """--device cuda is accepted; without a usable CUDA device it is one typed error line."""
    import torch

    from muser.engine.lanes import qgemm

    rc = main(["generate", "--model", str(tiny_gguf), "--device", "cuda", "--prompt", "x", "--max-tokens", "2",
               "--temperature", "0"])
    out, err = capsys.readouterr()
    if torch.cuda.is_available() and qgemm.HAVE_TRITON:
        assert rc == 0 and "TTFT" in err
    else:
        assert rc == 2 and err.strip().count("\n") == 0
        assert err.startswith("muser: error:") and "'cuda'" in err
    with pytest.raises(SystemExit) as e:  # argparse's choices: refused before anything loads
        main(["generate", "--model", str(tiny_gguf), "--device", "tpu", "--prompt", "x"])
    assert e.value.code == 2 and "invalid choice: 'tpu'" in capsys.readouterr().err
