"""The per-token Emitter: the same events whether driven by Generation, token by token, or
k tokens at a time from one verify step; early stops (EOG, stop string, max_tokens) inside a
pushed block; top logprobs; refusals; several Emitters interleaved in one loop."""

from __future__ import annotations

import numpy as np
import pytest

from muser.errors import SamplingError, TokenizerError
from muser.generation import FINISH_EOG, FINISH_LENGTH, FINISH_STOP, emitter, generate
from muser.gguf.reader import read_gguf
from muser.sample import SamplingParams, log_softmax_at
from muser.text import Tokenizer

GREEDY = SamplingParams(temperature=0.0, seed=1)


@pytest.fixture(scope="module")
def tok(tiny_gguf) -> Tokenizer:
    return Tokenizer.from_gguf(read_gguf(tiny_gguf))


def rows_for(tok, plan, seed=0) -> list[np.ndarray]:
    """Logits whose argmax is plan[i] at row i, on a random (untied) background."""
    rng = np.random.default_rng(seed)
    out = []
    for t in plan:
        x = rng.standard_normal(tok.vocab_size).astype(np.float32)
        x[t] = 12.0
        out.append(x)
    return out


class Scripted:
    def __init__(self, rows):
        self.rows, self.i = rows, 0

    def prefill(self, ids):
        return self.rows[0]

    def decode(self, token):
        self.i += 1
        return self.rows[self.i]


def _ev(events):
    return [(e.index, e.token, e.text, e.logprob, e.finish_reason) for e in events]


@pytest.mark.parametrize("text,stop,max_tokens,reason", [
    ("Beautiful is better than ugly. Explicit", ["ugly"], 40, FINISH_STOP),
    ("Simple is better than complex.", [], 6, FINISH_LENGTH),
    ("Now is better than never.", ["never!"], 40, None),
])
def test_blocks_of_k_equal_token_by_token_and_generation(tok, text, stop, max_tokens, reason):
    plan = tok.encode(text)
    rows = rows_for(tok, plan + [tok.eos_id])
    prompt = tok.encode("Q:", add_special=True)
    gen = generate(Scripted(rows), tok, prompt, GREEDY, max_tokens=max_tokens, stop=stop)
    ref = list(gen)
    for k in (1, 3, 16):
        em = emitter(tok, prompt, GREEDY, max_tokens=max_tokens, stop=stop)
        got = []
        j = 0
        while not em.done:
            blk = rows[j:j + k]
            toks = [int(np.argmax(r)) for r in blk]  # a fully accepted verify block
            evs = em.push_many(toks, blk)
            got += evs
            j += len(evs)
            if not em.done:
                assert len(evs) == len(blk)
        assert _ev(got) == _ev(ref), k
        assert em.text == gen.text and em.tokens == gen.tokens
    assert gen.finish_reason == (reason or FINISH_EOG)
    if reason == FINISH_STOP:
        assert "ugly" not in gen.text and gen.text.endswith("than ")


def test_block_stops_at_the_first_finishing_token(tok):
    body = tok.encode("Errors should")
    rows = rows_for(tok, body + [tok.eot_id] + tok.encode(" never pass"))
    em = emitter(tok, [1], GREEDY, max_tokens=50)
    toks = [int(np.argmax(r)) for r in rows]
    evs = em.push_many(toks, rows)
    assert [e.token for e in evs] == body + [tok.eot_id]  # the rest of the block is not taken
    assert evs[-1].finish_reason == FINISH_EOG and em.done and em.text == "Errors should"
    with pytest.raises(SamplingError, match="finished"):
        em.push(toks[-1], rows[-1])
    with pytest.raises(SamplingError, match="finished"):
        em.step(rows[0])


def test_push_of_a_draft_token_that_is_not_the_argmax(tok):
    """push takes the verified token as given (the speculative driver decides acceptance) and
    reports its raw logprob under the logits it is verified against."""
    rows = rows_for(tok, tok.encode("ab"))
    em = emitter(tok, [1], GREEDY, max_tokens=5)
    t = int(np.argsort(rows[0])[-2])
    ev = em.push(t, rows[0])
    assert ev.token == t and ev.logprob == log_softmax_at(rows[0], t)


def test_top_logprobs(tok):
    x = np.full(tok.vocab_size, -3.0, np.float32)
    x[[40, 7, 90, 8]] = [5.0, 2.0, 2.0, 2.0]  # a three-way tie for second place
    em = emitter(tok, [1], GREEDY, max_tokens=3, top_logprobs=3)
    ev = em.step(x)
    assert ev.token == 40
    assert [t for t, _ in ev.top_logprobs] == [40, 7, 8]  # ties: the lower ids
    for t, lp in ev.top_logprobs:
        assert lp == log_softmax_at(x, t)
    assert ev.to_json()["top_logprobs"][0] == [40, ev.logprob]
    assert "top_logprobs" not in emitter(tok, [1], GREEDY, max_tokens=1).step(x).to_json()


def test_interleaved_emitters_are_independent(tok):
    """A server loop: two generations advanced alternately give what each gives alone."""
    plans = [tok.encode("Flat is better than nested."), tok.encode("Sparse is better than dense.")]
    rows = [rows_for(tok, p, seed=i) for i, p in enumerate(plans)]
    P = SamplingParams(temperature=0.7, seed=5)
    alone = [_ev(generate(Scripted(r), tok, [1, 2], P, max_tokens=8)) for r in rows]
    ems = [emitter(tok, [1, 2], P, max_tokens=8) for _ in rows]
    got: list[list] = [[], []]
    i = 0
    while not all(e.done for e in ems):
        for k, em in enumerate(ems):
            if not em.done:
                got[k].append(em.step(rows[k][i]))
        i += 1
    assert [_ev(g) for g in got] == alone


def test_refusals(tok):
    x = np.zeros(tok.vocab_size, np.float32)
    for bad in (-1, 21, True, 2.0):
        with pytest.raises(SamplingError, match="top_logprobs"):
            emitter(tok, [1], GREEDY, max_tokens=1, top_logprobs=bad)
    em = emitter(tok, [1], GREEDY, max_tokens=2)
    with pytest.raises(TokenizerError, match="shape"):
        em.push(3, x[:-1])
    with pytest.raises(TokenizerError, match=str(tok.vocab_size)):
        em.push(tok.vocab_size, x)
    with pytest.raises(SamplingError, match="2 tokens but 1"):
        em.push_many([3, 4], [x])
    assert em.tokens == [] and not em.done  # refused before any change
