"""The Sampler against llama.cpp's own sampler chain (llama-cpp-python low-level API), built in
common_sampler_init's order: logit-bias, penalties, top-k, typical, top-p, min-p, temperature,
dist. Same logits, same seed, every row: the same token. Each parameter set runs 1,000 rows,
half of them with heavily tied logits (where libstdc++'s sort order decides the pick)."""

from __future__ import annotations

import ctypes
import math

import llama_cpp as L
import numpy as np
import pytest

from muser.errors import NonFiniteLogits, SamplingError
from muser.sample import Sampler, SamplingParams

_TD = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])


class LlamaChain:
    def __init__(self, P: SamplingParams, vocab: int, seed: int):
        ch = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        add = lambda s: L.llama_sampler_chain_add(ch, s)  # noqa: E731
        if P.logit_bias:
            arr = (L.llama_logit_bias * len(P.logit_bias))(*[L.llama_logit_bias(t, b) for t, b in P.logit_bias.items()])
            add(L.llama_sampler_init_logit_bias(vocab, len(P.logit_bias), arr))
        add(L.llama_sampler_init_penalties(vocab, P.penalty_last_n, P.repeat_penalty, P.frequency_penalty,
                                           P.presence_penalty))
        add(L.llama_sampler_init_top_k(P.top_k))
        add(L.llama_sampler_init_typical(P.typical_p, P.min_keep))
        add(L.llama_sampler_init_top_p(P.top_p, P.min_keep))
        add(L.llama_sampler_init_min_p(P.min_p, P.min_keep))
        add(L.llama_sampler_init_temp_ext(P.temperature, 0.0, 1.0))
        add(L.llama_sampler_init_dist(seed))
        self.ch = ch

    def sample(self, logits: np.ndarray) -> int:
        n = logits.size
        buf = np.zeros(n, _TD)
        buf["id"] = np.arange(n)
        buf["logit"] = logits
        arr = L.llama_token_data_array(buf.ctypes.data_as(L.llama_token_data_p), n, -1, False)
        L.llama_sampler_apply(self.ch, ctypes.byref(arr))
        assert 0 <= arr.selected < arr.size
        return int(arr.data[arr.selected].id)

    def accept(self, t: int) -> None:
        L.llama_sampler_accept(self.ch, t)

    def __del__(self):
        L.llama_sampler_free(self.ch)


SETS = {
    "default": SamplingParams(),
    "greedy": SamplingParams(temperature=0.0),
    "greedy_no_filters": SamplingParams(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0),
    "pure_dist": SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    "top_p_large_vocab": SamplingParams(top_k=0, top_p=0.9, min_p=0.0, temperature=0.7),
    "min_p": SamplingParams(top_k=0, top_p=1.0, min_p=0.1, temperature=1.3),
    "typical": SamplingParams(top_k=0, typical_p=0.8, top_p=1.0, min_p=0.0),
    "penalties": SamplingParams(repeat_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3,
                                penalty_last_n=16, top_k=20),
    "bias_topk300": SamplingParams(logit_bias={1: 5.0, 2: -math.inf, 7: -2.5}, top_k=300, top_p=0.8),
    "k500_min_keep": SamplingParams(top_k=500, top_p=0.99, min_p=0.01, min_keep=3, temperature=0.5),
}
VOCAB = {"typical": 1024, "penalties": 384}  # else 4096


def _rows(V: int, n: int, seed: int):
    rng = np.random.default_rng(seed)
    for r in range(n):
        if r % 2:
            yield (np.round(rng.standard_normal(V) * 4) / 2).astype(np.float32)  # many ties
        else:
            yield (rng.standard_normal(V) * 3).astype(np.float32)


@pytest.mark.parametrize("name", sorted(SETS))
def test_same_picks_as_llama_cpp(name):
    P = SETS[name]
    V = VOCAB.get(name, 4096)
    seed = 1234 + len(name)
    ref = LlamaChain(P, V, seed)
    ours = Sampler(P.replace(seed=seed), V)
    rows = 1000
    for r, logits in enumerate(_rows(V, rows, seed)):
        a = ref.sample(logits)
        b = ours.sample(logits)
        assert a == b, f"{name}: row {r}: llama.cpp {a}, muser {b}"
        ref.accept(a)
        ours.accept(b)


@pytest.mark.parametrize("name", ["default", "greedy", "top_p_large_vocab"])
def test_full_vocab_rows(name):
    """Muse Glimmer's 202,048-token vocabulary (a few rows: the exact-tie replay is slow)."""
    P = SETS[name]
    V = 202048
    ref = LlamaChain(P, V, 99)
    ours = Sampler(P.replace(seed=99), V)
    for r, logits in enumerate(_rows(V, 6, 5)):
        a, b = ref.sample(logits), ours.sample(logits)
        assert a == b, f"{name}: row {r}: llama.cpp {a}, muser {b}"
        ref.accept(a)
        ours.accept(b)


def test_greedy_tie_rule():
    """Greedy keeps the first maximal candidate in the chain's order: without top-k that is the
    lowest id; after top-k it is the heap order llama.cpp leaves, reproduced."""
    V = 300
    x = np.zeros(V, np.float32)
    x[[17, 5, 250]] = 3.0
    assert Sampler(SamplingParams(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=1), V).sample(x) == 5
    for P in (SamplingParams(temperature=0.0, seed=1), SamplingParams(temperature=0.0, top_k=2, seed=1)):
        assert Sampler(P, V).sample(x) == LlamaChain(P, V, 1).sample(x)


def test_non_finite_logits_install_nothing():
    s = Sampler(SamplingParams(seed=3), 16)
    state = s.rng.getstate()
    for bad in (np.nan, np.inf, -np.inf):
        x = np.zeros(16, np.float32)
        x[4] = bad
        with pytest.raises(NonFiniteLogits, match="token 4"):
            s.sample(x)
    assert s.rng.getstate() == state  # no draw was consumed


def test_bad_input():
    s = Sampler(SamplingParams(seed=3), 16)
    with pytest.raises(SamplingError, match=r"float32\[16\]"):
        s.sample(np.zeros(16, np.float64))
    with pytest.raises(SamplingError, match=r"float32\[16\]"):
        s.sample(np.zeros(15, np.float32))
    with pytest.raises(SamplingError, match="outside the vocab"):
        s.accept(16)
    with pytest.raises(SamplingError, match="outside the vocab"):
        Sampler(SamplingParams(logit_bias={20: 1.0}), 16)
    x = np.zeros(16, np.float32)
    all_banned = Sampler(SamplingParams(logit_bias={i: -math.inf for i in range(16)}, seed=1), 16)
    with pytest.raises(SamplingError, match="-inf"):
        all_banned.sample(x)


def test_seed_and_checkpoint():
    P = SamplingParams(top_k=0, top_p=1.0, min_p=0.0, temperature=1.0, repeat_penalty=1.2)
    a = Sampler(P, 64)
    assert 0 <= a.seed < 0xFFFFFFFF  # drawn, reported
    rng = np.random.default_rng(0)
    rows = [rng.standard_normal(64).astype(np.float32) for _ in range(20)]
    cp = a.checkpoint()
    first = []
    for x in rows:
        t = a.sample(x)
        a.accept(t)
        first.append(t)
    a.restore(cp)
    again = []
    for x in rows:
        t = a.sample(x)
        a.accept(t)
        again.append(t)
    assert first == again
