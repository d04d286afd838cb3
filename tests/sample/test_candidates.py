"""Candidates filtered on the device (muser.sample.candidates) against the full-vocabulary chain:
the same device code on CPU tensors, the same seed stream, every row the same token; ties,
-inf biases and a large vocabulary included. The filtered path must also actually be taken
(a test where every row fell back to the full row would prove nothing)."""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
import torch

from muser.engine.rows import DeviceRow
from muser.errors import NonFiniteLogits
from muser.generation import raw_logprobs
from muser.sample import Sampler, SamplingParams
from muser.sample.candidates import DeviceFilter, reduce_row, unpack

V = 5000

SETS = {
    "default": SamplingParams(),
    "greedy": SamplingParams(temperature=0.0),
    "greedy_no_filters": SamplingParams(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0),
    "greedy_min_p_only": SamplingParams(temperature=0.0, top_k=0, top_p=1.0, min_p=0.3),
    "top_k_1": SamplingParams(top_k=1),
    "top_k_5_hot": SamplingParams(top_k=5, top_p=1.0, min_p=0.0, temperature=1.7),
    "top_k_200_bucketed": SamplingParams(top_k=200, top_p=0.9, min_p=0.0, temperature=0.9),
    "typical": SamplingParams(top_k=60, typical_p=0.7, top_p=1.0, min_p=0.0),
    "min_keep": SamplingParams(top_k=30, top_p=0.3, min_p=0.5, min_keep=4),
    "bias": SamplingParams(top_k=20, logit_bias={7: -math.inf, 11: 3.5, 4999: -math.inf, 0: 1.25}),
    "greedy_bias": SamplingParams(temperature=0.0, logit_bias={3: 2.0, 5: -math.inf}),
}


def rows(n: int, seed: int, vocab: int = V) -> list[np.ndarray]:
    """Half smooth rows, half heavily tied ones (values on a 0.25 grid: tied maxima, ties at
    and across the k-th value)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        x = rng.normal(0, 3, vocab).astype(np.float32)
        if i % 2:
            x = (np.round(x * 4) / 4).astype(np.float32)
        if i % 5 == 0:
            x[rng.integers(0, vocab, 3)] = x.max()  # a tied maximum
        out.append(x)
    return out


def cpu_row(x: np.ndarray) -> DeviceRow:
    t = torch.from_numpy(x.copy())
    return DeviceRow(t, torch.isfinite(t).all())


def filtered_sample(s: Sampler, f: DeviceFilter, x: np.ndarray, stats: dict) -> int:
    row = cpu_row(x)
    red = f.read(row)
    if red is not None:
        tok = s.sample_top(red.ids, red.logit)
        if tok is not None:
            stats["filtered"] += 1
            lp = red.logprob(tok)
            assert lp is not None and lp == pytest.approx(raw_logprobs(x, tok, 0)[0], abs=1e-9)
            return tok
    stats["full"] += 1
    return s.sample(row.host())


@pytest.mark.parametrize("name", sorted(SETS))
def test_filtered_path_gives_the_full_chains_tokens(name):
    P = SETS[name].replace(seed=1234)
    full, filt = Sampler(P, V), Sampler(P, V)
    f = DeviceFilter(filt)
    stats = {"filtered": 0, "full": 0}
    xs = rows(160, seed=zlib.crc32(name.encode()) % 1000)
    for i, x in enumerate(xs):
        a = full.sample(x)
        b = filtered_sample(filt, f, x, stats)
        assert a == b, f"{name}: row {i}: full chain {a}, filtered {b}"
        full.accept(a)
        filt.accept(b)
    assert full.rng.getstate() == filt.rng.getstate()  # the same stream position
    if filt.filter_width() is None:
        assert stats["filtered"] == 0
    else:
        assert stats["filtered"] >= len(xs) // 3, stats  # smooth rows take the filtered path
        assert stats["full"] >= 1, stats  # tied picks go to the whole row


def test_filter_width_per_parameter_set():
    w = lambda **kw: Sampler(SamplingParams(**kw), V).filter_width()  # noqa: E731
    assert w(temperature=0.0) == 2
    assert w(temperature=0.0, top_k=0, top_p=0.5) == 2
    assert w(temperature=0.0, typical_p=0.5, top_k=0) is None  # typical may drop the maximum
    assert w(temperature=0.0, typical_p=0.5, top_k=9) == 10
    assert w(top_k=40) == 41
    assert w(top_k=0) is None  # top-p's softmax over every id
    assert w(top_k=V) is None and w(top_k=V - 1) == V
    assert w(top_k=40, repeat_penalty=1.1) is None  # penalties rewrite seen tokens' logits
    assert w(top_k=40, repeat_penalty=1.1, penalty_last_n=0) == 41
    assert Sampler(SamplingParams(temperature=0.0), 1).filter_width() == 1


def test_greedy_ties_and_all_banned_go_to_the_full_row():
    s = Sampler(SamplingParams(temperature=0.0, seed=5), 8)
    st = s.rng.getstate()
    assert s.sample_top(np.array([3, 6]), np.array([2.0, 2.0], np.float32)) is None
    assert s.sample_top(np.array([3, 6]), np.array([-np.inf, -np.inf], np.float32)) is None
    assert s.rng.getstate() == st  # nothing drawn
    assert s.sample_top(np.array([6, 3]), np.array([2.5, 2.0], np.float32)) == 6
    assert s.rng.getstate() != st  # dist's one draw


@pytest.mark.parametrize("vocab,banned", [(150_000, 0), (3000, 2990)])
def test_large_vocab_and_banned_tail(vocab, banned):
    """A 150k vocabulary; and a vocabulary banned all but 10 ids (survivors at -inf past them)."""
    rng = np.random.default_rng(3)
    bias = {int(t): -math.inf for t in range(vocab - banned, vocab)}
    for P in (SamplingParams(top_k=40, logit_bias=bias, seed=9), SamplingParams(top_k=4, logit_bias=bias, seed=9),
              SamplingParams(temperature=0.0, logit_bias=bias, seed=9)):
        a, b = Sampler(P, vocab), Sampler(P, vocab)
        f = DeviceFilter(b)
        stats = {"filtered": 0, "full": 0}
        for _ in range(6):
            x = rng.normal(0, 2, vocab).astype(np.float32)
            assert a.sample(x) == filtered_sample(b, f, x, stats)
        assert stats["filtered"] == 6


def test_reduce_row_packs_the_largest_biased_logits():
    x = torch.tensor([1.0, 5.0, 3.0, 5.0, -2.0], dtype=torch.float32)
    bias = (torch.tensor([0, 3]), torch.tensor([10.0, -np.inf], dtype=torch.float32))
    red = unpack(reduce_row(x, 3, bias).numpy(), 3)
    assert red.ids.tolist() == [0, 1, 2]
    assert red.logit.tolist() == [11.0, 5.0, 3.0] and red.raw.tolist() == [1.0, 5.0, 3.0]
    assert red.max_raw == 5.0
    assert red.logprob(1) == pytest.approx(raw_logprobs(x.numpy(), 1, 0)[0], abs=1e-12)
    assert red.logprob(4) is None


def test_non_finite_row_is_refused_at_the_first_readback():
    x = np.zeros(16, np.float32)
    x[9] = np.nan
    called = []

    def fail(host):
        called.append(int(np.flatnonzero(~np.isfinite(host))[0]))
        return NonFiniteLogits("bad row")

    t = torch.from_numpy(x)
    row = DeviceRow(t, torch.isfinite(t).all(), fail)
    f = DeviceFilter(Sampler(SamplingParams(top_k=4, seed=1), 16))
    with pytest.raises(NonFiniteLogits):
        f.read(row)
    assert called == [9]
    row2 = DeviceRow(t, torch.isfinite(t).all(), fail)
    with pytest.raises(NonFiniteLogits):
        row2.host()


def test_survivors_alone_do_not_fix_the_tie_order():
    """Why a tied pick goes to the whole row: std::partial_sort's heap starts from the first k ids
    of the whole array, so even every id tied with the k-th value, sorted by the same algorithm,
    comes out in another order than in the full chain."""
    from muser.sample.sorting import partial_sort_desc

    x = np.array([2, 3, 2, 2, 3, 2, 2, 2, 2, 3], np.float32)
    assert partial_sort_desc(x, np.arange(10), 3, True).tolist() == [9, 1, 4]
    surv = np.flatnonzero(x >= 3)
    assert surv[partial_sort_desc(x[surv], np.arange(surv.size), 3, True)].tolist() == [1, 4, 9]
    for P in (SamplingParams(temperature=0.0, top_k=3, seed=2), SamplingParams(top_k=3, seed=2)):
        a, b = Sampler(P, 10), Sampler(P, 10)
        stats = {"filtered": 0, "full": 0}
        assert filtered_sample(b, DeviceFilter(b), x, stats) == a.sample(x)
        assert stats == {"filtered": 0, "full": 1}
    assert Sampler(SamplingParams(temperature=0.0, top_k=3, seed=2), 10).sample(x) == 9  # not the lowest id
