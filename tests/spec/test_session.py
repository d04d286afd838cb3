"""Speculative decoding is exact: on/off identical tokens (greedy and seeded sampling), rollback of
target KV and drafter context across the SWA ring wrap, stats and the gate in the record."""

from __future__ import annotations

import numpy as np
import pytest

import muser
from muser.errors import LaneError
from muser.sample import SamplingParams

N_NEW = 48  # the target's window is 16 rows: the SWA ring wraps three times
GREEDY = SamplingParams(temperature=0.0)  # the API default samples at 0.8


@pytest.fixture(scope="module", params=["f16", "f32"])
def model(request, spec_target):
    m = muser.load(spec_target, kv=request.param)
    yield m
    m.close()


def _prompt(seed, n=21):
    return [int(x) for x in np.random.default_rng(seed).integers(6, 300, n)]


def _tokens(gen):
    return [ev.token for ev in gen]


def _oracle(drafter, truth, hit_every=2):
    """Proposals from the known plain continuation: right on every other round, partly wrong on the rest."""
    real = drafter.propose
    calls = {"n": 0}

    def propose(ctx, last, k):
        real(ctx, last, k)  # the real block forward still runs
        calls["n"] += 1
        pos = ctx.n + 1 - truth["p0"]  # index in the generated tokens of position ctx.n + 1
        want = truth["ids"][pos:pos + k] + [0] * k
        props = list(want[:k])
        if calls["n"] % hit_every:
            props[k // 2] = (props[k // 2] + 1) % 300  # a mismatch mid-block
        return props

    return propose


@pytest.mark.parametrize("k", [3, 15])
def test_greedy_identical_with_random_drafter(model, spec_target, make_drafter, k):
    d = make_drafter(spec_target)
    ids = _prompt(k)
    plain = [(e.token, e.logprob) for e in model.stream(ids, N_NEW, GREEDY)]
    gen = model.stream(ids, N_NEW, GREEDY, draft=d, verify_len=k)
    got = [(e.token, e.logprob) for e in gen]
    assert [t for t, _ in got] == [t for t, _ in plain]
    # the CPU exact lane is row-invariant: verify rows and decode rows are bitwise the same
    assert [lp for _, lp in got] == [lp for _, lp in plain]
    st = gen.spec.stats()
    assert st["rounds"] >= 1 and st["proposals"] == st["rounds"] * k


@pytest.mark.parametrize("k", [3, 15])
def test_greedy_identical_in_the_integer_lane(spec_target, make_drafter, k):
    # the integer lane (CUDA's default) is row-invariant by its integer sums: the same bits again
    m = muser.load(spec_target, lane="fast")
    try:
        d = make_drafter(spec_target)
        ids = _prompt(100 + k)
        plain = [(e.token, e.logprob) for e in m.stream(ids, N_NEW, GREEDY)]
        gen = m.stream(ids, N_NEW, GREEDY, draft=d, verify_len=k)
        assert [(e.token, e.logprob) for e in gen] == plain
        assert gen.spec.stats()["rounds"] >= 1
    finally:
        m.close()


def test_acceptance_paths_and_rollback_exact(model, spec_target, make_drafter):
    d = make_drafter(spec_target)
    ids = _prompt(5)
    plain = _tokens(model.stream(ids, N_NEW, GREEDY))
    drafter = model.drafter(d)
    truth = {"p0": len(ids), "ids": plain}
    drafter.propose = _oracle(drafter, truth)
    try:
        gen = model.stream(ids, N_NEW, GREEDY, draft=d, verify_len=7)
        got = _tokens(gen)
        spec = gen.spec
    finally:
        del drafter.propose
    assert got == plain
    st = spec.stats()
    assert st["accepted"] > 0 and st["accepted"] < st["proposals"]
    assert st["mean_accepted_length"] > 2 and st["gate_open"]
    # the drafter context after all the rollbacks holds what a cold build from the committed tokens
    # holds (same rows at the same positions; the target features differ only in f32 summation
    # order between one prefill and many verify chunks)
    ctx = spec.ctx
    cold = model.spec_session(d, len(ids) + N_NEW + 16, 7)
    cold.prefill(ids + plain[:ctx.n - len(ids)])
    assert cold.ctx.n == ctx.n
    pos = ctx.visible(ctx.n)
    s1, s2 = ctx._slots(pos), cold.ctx._slots(pos)
    for a, b in ((ctx.k, cold.ctx.k), (ctx.v, cold.ctx.v)):
        np.testing.assert_allclose(a[:, s1].numpy(), b[:, s2].numpy(), atol=2e-3, rtol=1e-3)


def test_sampled_same_tokens_for_the_same_seed(model, spec_target, make_drafter):
    d = make_drafter(spec_target)
    ids = _prompt(9)
    sp = SamplingParams(temperature=0.7, top_k=40, top_p=0.95, min_p=0.05, seed=1234)
    plain = _tokens(model.stream(ids, N_NEW, sampling=sp))
    drafter = model.drafter(d)
    drafter.propose = _oracle(drafter, {"p0": len(ids), "ids": plain}, hit_every=3)
    try:
        gen = model.stream(ids, N_NEW, sampling=sp, draft=d, verify_len=7)
        assert _tokens(gen) == plain
        assert gen.spec.stats()["accepted"] > 0
    finally:
        del drafter.propose


def test_bad_verify_length_refused(model, spec_target, make_drafter):
    with pytest.raises(LaneError, match="verify length 5"):
        model.stream(_prompt(1), 8, draft=make_drafter(spec_target), verify_len=5)


def test_a_gate_held_open_drafts_every_round_with_the_same_tokens(model, spec_target, make_drafter):
    from muser.spec.gate import AcceptanceGate

    d = make_drafter(spec_target)
    ids = _prompt(3)
    n = 16  # the book's gate judges after 2 + 8 rounds (one token each at zero acceptance)
    plain = _tokens(model.stream(ids, n, GREEDY))
    shipped = model.stream(ids, n, GREEDY, draft=d, verify_len=7)
    held = model.stream(ids, n, GREEDY, draft=d, verify_len=7, gate=AcceptanceGate(close_below=0.0))
    assert _tokens(shipped) == plain and _tokens(held) == plain
    st, st0 = held.spec.stats(), shipped.spec.stats()
    assert st0["gate_transitions"][0]["event"] == "close"  # a random drafter: the book's gate closes
    assert st["gate_transitions"] == [] and st["rounds"] > st0["rounds"]
    assert st["plain_tokens"] <= 7  # only where no verify length fits the context's end
    with pytest.raises(LaneError, match="gate is given without a draft"):
        model.stream(ids, 8, GREEDY, gate=AcceptanceGate())
