"""Sampler parity where the rules are decided: constructed rows whose values sit exactly on each
step's boundary, against llama.cpp's own samplers (llama-cpp-python low-level API). Random rows
almost never land there, so a flipped comparison (top-p `>=` vs `>`, min-p `>=` vs `>`, typical
`>` vs `>=`), an off-by-one in min_keep, or the dist draw's tie side would pass random parity.

Each row states its boundary and the test checks that the boundary is really hit (the row's
cumulative sum equals top_p, a logit equals max + logf(min_p), the draw's target equals a running
sum): a row that misses its boundary is a broken test, not a pass. Then Muser's step and
llama.cpp's sampler (a chain holding that one sampler) must keep the same candidates, and the
full chain must pick the same token.
"""

from __future__ import annotations

import ctypes

import llama_cpp as L
import numpy as np
import pytest

from muser.sample import Sampler, SamplingParams, libm
from muser.sample import chain as C
from muser.sample.mt19937 import MT19937

F32 = np.float32
_TD = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
LOW = F32(-300.0)  # a logit whose expf(l - max) is exactly 0


def llama_apply(samplers, logits: np.ndarray) -> tuple[np.ndarray, int]:
    """Run llama.cpp samplers (a fresh chain) over `logits`; the kept ids in order and `selected`."""
    ch = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
    for s in samplers:
        L.llama_sampler_chain_add(ch, s)
    try:
        n = logits.size
        buf = np.zeros(n, _TD)
        buf["id"] = np.arange(n)
        buf["logit"] = logits
        arr = L.llama_token_data_array(buf.ctypes.data_as(L.llama_token_data_p), n, -1, False)
        L.llama_sampler_apply(ch, ctypes.byref(arr))
        ids = np.array([arr.data[i].id for i in range(arr.size)], dtype=np.int64)
        return ids, int(arr.selected)
    finally:
        L.llama_sampler_free(ch)


def muser_apply(step, logits: np.ndarray, *args) -> np.ndarray:
    c = C.Candidates(np.arange(logits.size, dtype=np.int32), logits.astype(F32).copy(), None)
    step(c, *args, True)
    return c.ids.astype(np.int64)


def same_kept(ours: np.ndarray, theirs: np.ndarray) -> None:
    assert ours.size == theirs.size, f"muser keeps {ours.size}, llama.cpp {theirs.size}"
    assert sorted(ours.tolist()) == sorted(theirs.tolist())


def ties(n_tied: int, vocab: int, lead: float = 0.0) -> np.ndarray:
    """n_tied equal logits (ids spread over the vocab), the rest at LOW: each tied p is 1/n_tied
    exactly, so running sums are exact multiples of it."""
    x = np.full(vocab, LOW, dtype=F32)
    x[np.random.default_rng(n_tied).permutation(vocab)[:n_tied]] = F32(lead)
    return x


def softmax_sorted(x: np.ndarray) -> np.ndarray:
    """The p's in sorted order as llama_sampler_softmax_impl computes them (float32)."""
    c = C.Candidates(np.arange(x.size, dtype=np.int32), x.copy(), None)
    C.softmax(c, True, True)
    return c.p


# --- top-p ---------------------------------------------------------------------------------------


TOP_P = [  # (tied candidates, vocab, top_p): cum[k-1] == top_p exactly for k = n * top_p
    (4, 64, 0.75),  # small array: full sort
    (8, 64, 0.5),
    (2048, 2048, 0.5),  # > 1024 candidates: the bucketed path, hit after the first 256 (re-sort)
    (2048, 2048, 0.0625),  # bucketed path, hit inside the first 256
    (1024, 4096, 0.25),  # bucketed, ties among zero-p filler, hit on the last of the first 256
]


@pytest.mark.parametrize("n, vocab, p", TOP_P)
def test_top_p_cumulative_sum_exactly_at_p(n, vocab, p):
    x = ties(n, vocab)
    k = int(n * p)
    cum = np.cumsum(softmax_sorted(x), dtype=F32)
    assert cum[k - 1] == F32(p) and cum[k - 2] < F32(p)  # the boundary is hit exactly
    ours = muser_apply(C.top_p, x, F32(p), 1)
    theirs, _ = llama_apply([L.llama_sampler_init_top_p(p, 1)], x)
    same_kept(ours, theirs)
    assert ours.size == k  # cum >= p stops at the candidate that reaches p


@pytest.mark.parametrize("min_keep", [2, 3, 5])
def test_top_p_min_keep_binds(min_keep):
    """One dominant candidate reaches top_p alone; min_keep decides how many stay."""
    x = np.full(256, F32(-4.0), dtype=F32)
    x[[9, 40, 41, 42, 100, 200]] = F32([8.0, 1.0, 1.0, 1.0, 0.5, 0.25])
    ours = muser_apply(C.top_p, x, F32(0.5), min_keep)
    theirs, _ = llama_apply([L.llama_sampler_init_top_p(0.5, min_keep)], x)
    same_kept(ours, theirs)
    assert ours.size == min_keep
    big = np.concatenate([x, np.full(2048, F32(-4.0), dtype=F32)])  # the bucketed path too
    same_kept(muser_apply(C.top_p, big, F32(0.5), min_keep),
              llama_apply([L.llama_sampler_init_top_p(0.5, min_keep)], big)[0])


# --- min-p ---------------------------------------------------------------------------------------


MIN_P = [0.5, 0.25, 0.1, 0.05]


def at_min_p(p: float, vocab: int = 128, above: int = 3, at: int = 4) -> tuple[np.ndarray, F32]:
    """Logits: max 0, `above` candidates strictly inside, `at` candidates exactly at
    max + logf(min_p) (llama.cpp's threshold, float32), the rest below."""
    lp = libm.logf_scalar(p)
    thr = F32(F32(0.0) + lp)
    x = np.full(vocab, F32(thr - F32(1.0)), dtype=F32)
    rng = np.random.default_rng(int(p * 1000))
    ids = rng.permutation(vocab)
    x[ids[0]] = F32(0.0)
    x[ids[1:1 + above]] = F32(thr * F32(0.5))
    x[ids[1 + above:1 + above + at]] = thr
    return x, thr


@pytest.mark.parametrize("p", MIN_P)
def test_min_p_exactly_at_threshold_unsorted_path(p):
    """Unsorted input: the fast path keeps logit >= max + logf(p) directly."""
    x, thr = at_min_p(p)
    assert np.count_nonzero(x == thr) == 4
    ours = muser_apply(C.min_p, x, F32(p), 1)
    theirs, _ = llama_apply([L.llama_sampler_init_min_p(p, 1)], x)
    same_kept(ours, theirs)
    assert ours.size == 1 + 3 + 4  # the candidates on the threshold stay


@pytest.mark.parametrize("p", MIN_P)
def test_min_p_exactly_at_threshold_sorted_path(p):
    """Sorted input (after top-k): the sorted path stops at the first logit < logit[0] + logf(p)."""
    x, thr = at_min_p(p)
    assert np.count_nonzero(x == thr) == 4
    k = 20
    ours_c = C.Candidates(np.arange(x.size, dtype=np.int32), x.copy(), None)
    C.top_k(ours_c, k, True)
    assert ours_c.sorted
    C.min_p(ours_c, F32(p), 1, True)
    theirs, _ = llama_apply([L.llama_sampler_init_top_k(k), L.llama_sampler_init_min_p(p, 1)], x)
    same_kept(ours_c.ids.astype(np.int64), theirs)
    assert ours_c.size == 1 + 3 + 4


@pytest.mark.parametrize("min_keep", [3, 6, 9, 12])
def test_min_p_min_keep_binds(min_keep):
    """Fewer candidates than min_keep pass min-p: the unsorted fast path gives way to the sorted
    one, which keeps min_keep."""
    x, _ = at_min_p(0.5, above=1, at=1)
    ours = muser_apply(C.min_p, x, F32(0.5), min_keep)
    theirs, _ = llama_apply([L.llama_sampler_init_min_p(0.5, min_keep)], x)
    same_kept(ours, theirs)
    assert ours.size == max(3, min_keep)


# --- typical -------------------------------------------------------------------------------------


TYPICAL = [(4, 0.5), (4, 0.25), (8, 0.75), (16, 0.5)]


@pytest.mark.parametrize("n, p", TYPICAL)
def test_typical_cumulative_sum_exactly_at_p(n, p):
    """Equal candidates: every shifted score ties, the cumulative mass hits typical_p exactly;
    llama.cpp keeps up to the first candidate whose running sum exceeds p (strictly)."""
    x = np.zeros(n, dtype=F32)  # no zero-probability filler: every shifted score ties
    k = int(n * p)
    cum = np.cumsum(softmax_sorted(x), dtype=F32)
    assert cum[k - 1] == F32(p)
    ours = muser_apply(C.typical, x, F32(p), 1)
    theirs, _ = llama_apply([L.llama_sampler_init_typical(p, 1)], x)
    same_kept(ours, theirs)
    assert ours.size == k + 1


@pytest.mark.parametrize("min_keep", [2, 3, 6])
def test_typical_min_keep_binds(min_keep):
    x = np.full(96, F32(-6.0), dtype=F32)
    x[[3, 50, 51, 70]] = F32([9.0, 0.0, 0.0, -1.0])
    ours = muser_apply(C.typical, x, F32(0.2), min_keep)
    theirs, _ = llama_apply([L.llama_sampler_init_typical(0.2, min_keep)], x)
    same_kept(ours, theirs)
    assert ours.size == min_keep


def test_typical_edges():
    """typical_p near 1 (keeps everything up to the last), one candidate, and a flat row."""
    rng = np.random.default_rng(7)
    for x, p in [((rng.standard_normal(300) * 2).astype(F32), 0.999),
                 (np.where(np.arange(50) == 7, F32(0.0), LOW).astype(F32), 0.5),
                 (np.zeros(33, F32), 0.3)]:
        same_kept(muser_apply(C.typical, x, F32(p), 1), llama_apply([L.llama_sampler_init_typical(p, 1)], x)[0])


# --- dist: the draw exactly on a running sum --------------------------------------------------------


def _expf_at_most(r: float) -> tuple[F32, F32]:
    """The f32 logit x with the largest expf(x) <= r, and expf(x)."""
    x = F32(np.log(r))
    while float(libm.expf_scalar(x)) > r:
        x = np.nextafter(x, F32(-np.inf))
    while float(libm.expf_scalar(np.nextafter(x, F32(np.inf)))) <= r:
        x = np.nextafter(x, F32(np.inf))
    return x, libm.expf_scalar(x)


def draw_on_boundary(seed: int, vocab: int = 64) -> np.ndarray | None:
    """Logits whose dist draw target sum_cum * rnd equals the first running sum (1.0) exactly:
    id 0 at logit 0 (p = 1), then candidates tuned so the double sum S makes S * rnd == 1.0."""
    rnd = MT19937(seed).uniform()
    if rnd < 0.55:
        return None
    S = 1.0 / rnd
    for _ in range(8):  # a double S with fl(S * rnd) == 1.0
        if S * rnd == 1.0:
            break
        S = np.nextafter(S, np.inf if S * rnd < 1.0 else -np.inf)
    if S * rnd != 1.0:
        return None
    logits = [F32(0.0)]
    total = 1.0
    for _ in range(6):
        rest = S - total
        if rest <= 0:
            break
        x, p = _expf_at_most(rest)
        for _ in range(64):  # the last term: find an expf value that lands the double sum on S
            if total + float(p) == S:
                break
            x = np.nextafter(x, F32(np.inf) if total + float(p) < S else F32(-np.inf))
            p = libm.expf_scalar(x)
        logits.append(x)
        total = total + float(p)
        if total == S:
            break
    if total != S:
        return None
    row = np.full(vocab, LOW, dtype=F32)
    row[:len(logits)] = logits
    return row


def boundary_rows(n: int) -> list[tuple[int, np.ndarray]]:
    out = []
    seed = 1
    while len(out) < n and seed < 400:
        row = draw_on_boundary(seed)
        if row is not None:
            out.append((seed, row))
        seed += 1
    assert len(out) == n, out
    return out


@pytest.mark.parametrize("seed, row", boundary_rows(4))
def test_dist_draw_exactly_on_a_running_sum(seed, row):
    """llama.cpp selects the first candidate whose running sum reaches the target (sum >= target):
    here the target equals candidate 0's running sum, so candidate 0 is picked."""
    p = libm.expf(row)
    run = np.cumsum(p.astype(np.float64))
    assert run[-1] * MT19937(seed).uniform() == run[0]  # the boundary is hit exactly
    c = C.Candidates(np.arange(row.size, dtype=np.int32), row.copy(), None)
    ours = C.dist(c, MT19937(seed))
    _, theirs = llama_apply([L.llama_sampler_init_dist(seed)], row)
    assert ours == theirs == 0
    P = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed)
    assert Sampler(P, row.size).sample(row) == 0


# --- the full chain on boundary rows ------------------------------------------------------------------


CHAIN_ROWS = [
    ("top_p", lambda: ties(4, 64), dict(top_k=0, top_p=0.75, min_p=0.0)),
    ("top_p_bucketed", lambda: ties(2048, 2048), dict(top_k=0, top_p=0.5, min_p=0.0)),
    ("min_p", lambda: at_min_p(0.25)[0], dict(top_k=0, top_p=1.0, min_p=0.25)),
    ("min_p_sorted", lambda: at_min_p(0.1)[0], dict(top_k=30, top_p=1.0, min_p=0.1)),
    ("typical", lambda: np.zeros(8, F32), dict(top_k=0, typical_p=0.75, top_p=1.0, min_p=0.0)),
    ("min_keep", lambda: at_min_p(0.5, above=0, at=0)[0], dict(top_k=0, top_p=0.3, min_p=0.5, min_keep=4)),
]


@pytest.mark.parametrize("name, make, kw", CHAIN_ROWS, ids=[r[0] for r in CHAIN_ROWS])
def test_chain_picks_on_boundary_rows(name, make, kw):
    """The default chain order (top-k, typical, top-p, min-p, temperature, dist) over 40 seeds."""
    x = make()
    P = SamplingParams(temperature=1.0, **kw)
    for seed in range(40):
        ch = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        for s in (L.llama_sampler_init_top_k(P.top_k), L.llama_sampler_init_typical(P.typical_p, P.min_keep),
                  L.llama_sampler_init_top_p(P.top_p, P.min_keep), L.llama_sampler_init_min_p(P.min_p, P.min_keep),
                  L.llama_sampler_init_temp_ext(P.temperature, 0.0, 1.0), L.llama_sampler_init_dist(seed)):
            L.llama_sampler_chain_add(ch, s)
        buf = np.zeros(x.size, _TD)
        buf["id"] = np.arange(x.size)
        buf["logit"] = x
        arr = L.llama_token_data_array(buf.ctypes.data_as(L.llama_token_data_p), x.size, -1, False)
        L.llama_sampler_apply(ch, ctypes.byref(arr))
        theirs = int(arr.data[arr.selected].id)
        L.llama_sampler_free(ch)
        ours = Sampler(P.replace(seed=seed), x.size).sample(x)
        assert ours == theirs, f"{name}: seed {seed}: llama.cpp {theirs}, muser {ours}"
