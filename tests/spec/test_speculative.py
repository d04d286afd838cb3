"""Exact verification rules (muser.sample.speculative)."""

from __future__ import annotations

import numpy as np
import pytest

from muser.errors import SamplingError
from muser.sample import Sampler, SamplingParams
from muser.sample.mt19937 import MT19937
from muser.sample.speculative import greedy_prefix, leviathan, verify_point_mass


def test_greedy_prefix():
    assert greedy_prefix([5, 6, 7], [5, 6, 7, 9]) == (3, 9)
    assert greedy_prefix([5, 6, 7], [5, 8, 7, 9]) == (1, 8)
    assert greedy_prefix([5, 6, 7], [4, 6, 7, 9]) == (0, 4)
    with pytest.raises(SamplingError):
        greedy_prefix([1, 2], [1, 2])


def test_leviathan_preserves_the_target_distribution():
    rng_np = np.random.default_rng(3)
    V = 6
    p = rng_np.dirichlet(np.ones(V))
    q = rng_np.dirichlet(np.ones(V) * 0.5)
    rng = MT19937(1234)
    n = 60000
    counts = np.zeros(V)
    acc = 0
    for _ in range(n):
        d = int(np.searchsorted(np.cumsum(q), rng.uniform()))  # d ~ q
        d = min(d, V - 1)
        a, t = leviathan(p, q, d, rng)
        acc += a
        counts[t] += 1
    emp = counts / n
    assert np.abs(emp - p).max() < 4 * np.sqrt(p.max() / n) + 1e-3, (emp, p)
    # acceptance probability of speculative sampling: sum_x min(p(x), q(x))
    assert abs(acc / n - np.minimum(p, q).sum()) < 0.01


def test_point_mass_is_leviathan_with_delta_q():
    """For q = delta_d, Leviathan accepts with p(d) and resamples from p without d: the coupled
    draw gives the same law, and the very tokens plain sampling gives for the same seed."""
    V = 16
    logits = np.random.default_rng(0).standard_normal(V).astype(np.float32) * 2
    params = SamplingParams(temperature=0.8, top_k=0, top_p=1.0, min_p=0.0, seed=42)
    s_plain, s_spec = Sampler(params, V), Sampler(params, V)
    draft = int(np.argmax(logits))
    n, acc = 4000, 0
    for _ in range(n):
        x = s_plain.sample(logits)
        a, y = verify_point_mass(s_spec, logits, draft)
        assert y == x and a == (x == draft)
        acc += a
    z = logits.astype(np.float64) / 0.8
    p = np.exp(z - z.max())
    p /= p.sum()
    assert abs(acc / n - p[draft]) < 4 * np.sqrt(p[draft] * (1 - p[draft]) / n)


def test_leviathan_refuses_bad_input():
    p = np.full(4, 0.25)
    with pytest.raises(SamplingError):
        leviathan(p, np.array([1.0, 0, 0, 0]), 2, MT19937(1))  # q(d) = 0
    with pytest.raises(SamplingError):
        leviathan(p, p, 7, MT19937(1))
