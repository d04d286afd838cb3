"""The host path over a whole vocabulary row. The bucketed sort (llama_token_data_array_partial_sort)
against a plain bucket-by-bucket loop on heavily tied rows, and the chain's pick, stream position
and kept candidates (ids, logit, p) on fixed rows against values recorded from the chain."""

from __future__ import annotations

import hashlib
import zlib

import numpy as np
import pytest

from muser.sample import Sampler, SamplingParams
from muser.sample import sorting as S

F32 = np.float32


# --- bucket_partial_sort against the bucket-by-bucket loop ----------------------------------------


def _reference(logits: np.ndarray, npartial: int, exact: bool) -> np.ndarray:
    """The top npartial in llama.cpp's order: whole buckets from the highest down with std::sort,
    then std::partial_sort inside the bucket where npartial is reached."""
    ib_each = S.buckets(logits)
    parts = []
    nhave = 0
    for j in range(S.NBUCKETS - 1, -1, -1):
        seg = np.flatnonzero(ib_each == j)  # index order: how the histogram pass scatters them
        if nhave + seg.size >= npartial:
            parts.append(S.partial_sort_desc(logits, seg, npartial - nhave, exact))
            break
        if seg.size:
            parts.append(S.sort_desc(logits, seg, exact))
        nhave += seg.size
    return np.concatenate(parts)


def _tied_row(rng: np.random.Generator, n: int, kind: str) -> np.ndarray:
    if kind == "grid":  # 0.5 apart: many values per bucket, each shared by many ids
        return (np.round(rng.standard_normal(n) * 4) / 2).astype(F32)
    if kind == "fine":  # a 1/97 grid: fewer ids per value, most buckets still tied
        return (np.round(rng.standard_normal(n) * 300) / 97).astype(F32)
    if kind == "wide":  # past +-10: the clamped end buckets hold long runs
        return np.round(rng.standard_normal(n) * 15).astype(F32)
    if kind == "zeros":  # -0.0 and +0.0 compare equal
        x = np.round(rng.standard_normal(n)).astype(F32)
        x[(x == 0) & (rng.random(n) < 0.5)] = F32(-0.0)
        return x
    if kind == "odd":  # -inf, NaN and logits whose bucket index overflows (bucket 0)
        x = np.round(rng.standard_normal(n) * 6).astype(F32)
        m = max(1, n // 50)
        x[rng.integers(0, n, m)] = -np.inf
        x[rng.integers(0, n, m)] = F32(4e9)
        x[rng.integers(0, n, max(1, m // 2))] = F32(3.5e8)
        x[rng.integers(0, n, max(1, m // 4))] = np.nan
        return x
    assert kind == "distinct"
    return (rng.standard_normal(n) * 3).astype(F32)


_SIZES = [1, 2, 3, 17, 128, 200, 1024, 1025, 3000]
_KINDS = ["grid", "fine", "wide", "zeros", "odd", "distinct"]


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("kind", _KINDS)
def test_bucket_partial_sort_is_the_bucket_loop(kind, exact):
    rng = np.random.default_rng([len(kind), exact])
    for n in _SIZES:
        x = _tied_row(rng, n, kind)
        for k in sorted({1, 2, 7, 128, 129, 256, n // 3, n - 1, n}):
            if not 1 <= k <= n:
                continue
            got = S.bucket_partial_sort(x, k, exact)[:k]
            want = _reference(x, k, exact)[:k]
            assert np.array_equal(got, want), f"{kind} n={n} k={k} exact={exact}"
        if not exact and kind != "odd":  # the whole order: by bucket, then logit, then id (no NaN here)
            b = S.buckets(x)
            plain = sorted(range(n), key=lambda i: (-b[i], -x[i], i))
            assert S.bucket_partial_sort(x, n, exact).tolist() == plain, f"{kind} n={n}"


@pytest.mark.parametrize("exact", [False, True])
def test_bucket_partial_sort_large_rows(exact):
    rng = np.random.default_rng(7 + exact)
    for kind in ("grid", "fine", "distinct") if exact else _KINDS:
        x = _tied_row(rng, 40_000, kind)
        for k in (256, 5000, 40_000):
            got = S.bucket_partial_sort(x, k, exact)[:k]
            assert np.array_equal(got, _reference(x, k, exact)[:k]), f"{kind} k={k} exact={exact}"


# --- the chain on whole rows: recorded picks, streams and candidates ------------------------------


def _row(kind: str, vocab: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "normal":
        return (rng.standard_normal(vocab) * 3).astype(F32)
    if kind == "grid":
        return (np.round(rng.standard_normal(vocab) * 4) / 2).astype(F32)
    if kind == "coarse":
        return np.round(rng.standard_normal(vocab) * 2).astype(F32)
    if kind == "fine":
        return (np.round(rng.standard_normal(vocab) * 3 * 256) / 256).astype(F32)
    if kind == "zeros":
        x = np.round(rng.standard_normal(vocab) * 2).astype(F32)
        x[(x == 0) & (rng.random(vocab) < 0.5)] = F32(-0.0)
        return x
    if kind == "wide":
        return (np.round(rng.standard_normal(vocab) * 40) / 4).astype(F32)
    assert kind == "huge"  # bucket index overflow: the largest logits land in bucket 0
    x = (rng.standard_normal(vocab) * 3).astype(F32)
    x[rng.integers(0, vocab, 3)] = F32(4e8)
    x[rng.integers(0, vocab, 2)] = F32(3.9e8)
    return x


def _digest(s: Sampler, token: int) -> str:
    c = s.last
    assert c is not None and c.p is not None
    h = hashlib.sha256()
    h.update(np.int64(token).tobytes())
    h.update(np.asarray(s.rng.getstate()[1], dtype=np.uint32).tobytes())
    h.update(c.ids.astype(np.int32).tobytes())
    h.update(c.logit.astype(F32).tobytes())
    h.update(c.p.astype(F32).tobytes())
    h.update(bytes([c.sorted]))
    return h.hexdigest()[:16]


FULL = 202048
CASES = {  # name: (SamplingParams keywords, vocab, row kinds, one row per kind in turn)
    "top_p_normal": (dict(top_k=0, top_p=0.9), FULL, ["normal", "normal"]),
    "top_p_fine": (dict(top_k=0, top_p=0.9, min_p=0.0), FULL, ["fine", "normal"]),
    "top_p_grid": (dict(top_k=0, top_p=0.9), FULL, ["grid"]),
    "top_p_coarse": (dict(top_k=0, top_p=0.9, min_p=0.0), FULL, ["coarse"]),
    "top_p_wide": (dict(top_k=0, top_p=0.95, min_p=0.0, temperature=1.0), 50_000, ["wide", "wide"]),
    "top_p_huge": (dict(top_k=0, top_p=0.9, min_p=0.0), 50_000, ["huge", "huge"]),
    "top_p_zeros": (dict(top_k=0, top_p=0.7), 30_000, ["zeros", "zeros", "coarse"]),
    "top_p_shallow": (dict(top_k=0, top_p=0.05, min_p=0.0), FULL, ["normal", "fine"]),
    "top_p_deep": (dict(top_k=0, top_p=0.999, min_p=0.0, temperature=1.0), FULL, ["normal"]),
    "top_p_min_keep": (dict(top_k=0, top_p=0.3, min_p=0.0, min_keep=3000), 20_000, ["normal", "grid"]),
    "top_p_min_keep_small": (dict(top_k=0, top_p=0.01, min_keep=5), 4096, ["grid", "coarse", "normal"]),
    "top_p_1025": (dict(top_k=0, top_p=0.8, min_p=0.0), 1025, ["grid", "coarse", "normal"]),
    "top_p_1024": (dict(top_k=0, top_p=0.8, min_p=0.0), 1024, ["grid", "coarse", "normal"]),
    "top_p_small": (dict(top_k=0, top_p=0.9), 100, ["coarse", "grid", "normal"]),
    "pure_dist": (dict(top_k=0, top_p=1.0, min_p=0.0, temperature=1.0), FULL, ["normal", "fine"]),
    "dist_temp": (dict(top_k=0, top_p=1.0, min_p=0.0), FULL, ["normal"]),
    "min_p_only": (dict(top_k=0, top_p=1.0), FULL, ["normal", "coarse"]),
    "min_p_sorted": (dict(top_k=0, top_p=0.98, min_p=0.2, min_keep=40), 8192, ["coarse", "grid"]),
    "typical": (dict(top_k=0, typical_p=0.8, top_p=0.95), 3000, ["grid", "normal"]),
    "greedy_full": (dict(top_k=0, temperature=0.0), FULL, ["normal", "grid"]),
    "top_k_300": (dict(top_k=300, top_p=0.8), 20_000, ["coarse", "normal", "wide"]),
    "top_k_500_min_keep": (dict(top_k=500, top_p=0.99, min_p=0.01, min_keep=3, temperature=0.5), 20_000,
                           ["grid", "normal"]),
    "penalties": (dict(top_k=0, top_p=0.9, repeat_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3,
                       penalty_last_n=16), 30_000, ["grid", "normal", "coarse"]),
    "bias": (dict(top_k=0, top_p=0.85, logit_bias={1: 5.0, 2: -np.inf, 7: -2.5, 40: 9.0}), 30_000,
             ["normal", "grid"]),
}

GOLDEN = {  # (token, digest of stream and candidates) per row, recorded from the chain
    'top_p_normal': [(146844, 'dddf1d7c121905fc'), (154701, '9679d6736eae99f8')],
    'top_p_fine': [(61694, '2e3a807ba73a48e0'), (164989, '3e07fb820a97e2bd')],
    'top_p_grid': [(196781, '8786238628ef94ab')],
    'top_p_coarse': [(113764, 'e4000d6f41a8260a')],
    'top_p_wide': [(42472, '39d54efc051e89b8'), (8167, 'b99f5bf07d8ed00f')],
    'top_p_huge': [(6636, 'c531697a1fb9b3cf'), (38662, '4fd49e9c3d65cd1a')],
    'top_p_zeros': [(16077, 'a72fa57c79a7df2e'), (24055, '7bb1263969c5da48'), (13576, '1335e1ffa6c13e02')],
    'top_p_shallow': [(52110, '535063da603e04ec'), (32351, '857d57715467bfd8')],
    'top_p_deep': [(11710, '618a5a1cbb263e6a')],
    'top_p_min_keep': [(16782, 'cde459c252a5acaa'), (11318, '38a3375fcea350fc')],
    'top_p_min_keep_small': [(3704, '64d1a9d54f27d903'), (2048, '9890c36347b427b8'), (3317, '5b1a09a93d458b7c')],
    'top_p_1025': [(851, '686ef4326188a5d2'), (86, '51de84fc921f993d'), (273, '32780d114a31cdd3')],
    'top_p_1024': [(261, 'de51f1e33cafcc9e'), (993, 'a4ab3a75979ebf61'), (808, 'febcef06def450f4')],
    'top_p_small': [(38, 'c681f537a842639d'), (80, '4bf158e8c81dcdd0'), (13, '743d263c8b673eeb')],
    'pure_dist': [(8160, '4b64cfe694d1f182'), (22692, 'c246ae5647908fc5')],
    'dist_temp': [(141947, 'b751f9bf5dd8b45d')],
    'min_p_only': [(24833, '8c2986f6506a7963'), (122317, 'e59eeac7f9046f3d')],
    'min_p_sorted': [(5537, 'fed0cafa44c22369'), (4014, '276c0492b9caf0df')],
    'typical': [(1356, '6a339df89082fca9'), (815, 'e136da0431629919')],
    'greedy_full': [(123916, '7edbb5ba3fe838fd'), (104044, '5eccf0d1e29bebad')],
    'top_k_300': [(4502, 'd9904bd50b7aab33'), (2719, '5301cc8c5effd1c5'), (564, '6ed1eb09908e732e')],
    'top_k_500_min_keep': [(6958, 'f32f46ec7645eeb1'), (230, '0d74dc6ee0b429df')],
    'penalties': [(16224, 'a37887e742defd1b'), (6390, 'ea178b4bc161f0ac'), (23366, 'abac71174e5a74fb')],
    'bias': [(40, '4af5ca3218f4513f'), (40, '21d6f5277920282c')],
}


def _run_case(name: str) -> list[tuple[int, str]]:
    kw, vocab, kinds = CASES[name]
    seed = zlib.crc32(name.encode())
    s = Sampler(SamplingParams(seed=seed, **kw), vocab)
    for t in np.random.default_rng(seed).integers(0, vocab, 24).tolist():  # a prompt
        s.accept(int(t))
    out = []
    for i, kind in enumerate(kinds):
        with np.errstate(invalid="ignore"):  # "huge": dist's sum overflows (inf / inf), as in llama.cpp
            token = s.sample(_row(kind, vocab, seed + i))
        out.append((token, _digest(s, token)))
        s.accept(token)
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_chain_on_whole_rows(name):
    assert _run_case(name) == GOLDEN[name]


@pytest.mark.parametrize("name", [n for n in sorted(CASES) if n.startswith("top_p") or n in ("penalties", "bias")])
def test_chain_when_the_first_sort_falls_short(name, monkeypatch):
    """top-p sorts buckets first down to a guess at where its sum reaches p; a guess that stops
    at the first buckets holding enough entries leaves the rest to the second round."""
    monkeypatch.setattr(S.BucketSort, "reach", lambda self, p, target, need: self.cut(need))
    assert _run_case(name) == GOLDEN[name]


def test_fast_partial_sort_orders_ties_by_position_whatever_argpartition_does(monkeypatch):
    """The inexact pass's partial sort (exact=False) puts equal keys in position order, not in the
    order numpy's argpartition leaves them (which differs between its AVX-512 and AVX2 builds, and
    reached the chain's recorded candidates)."""
    rng = np.random.default_rng(11)
    key = np.round(rng.standard_normal(5000) * 3).astype(F32)  # heavily tied
    seg = np.arange(key.size)
    want = S.partial_sort_desc(key, seg, 300, exact=False)
    real = np.argpartition

    def shuffled(a, kth):  # a valid partition with every side permuted
        p = real(a, kth)
        lo, hi = p[:kth], p[kth:]
        return np.concatenate((rng.permutation(lo), rng.permutation(hi)))

    monkeypatch.setattr(np, "argpartition", shuffled)
    got = S.partial_sort_desc(key, seg, 300, exact=False)
    assert np.array_equal(got, want)
    vals = key[got]
    assert np.all(vals[:-1] >= vals[1:])
    tie = vals[:-1] == vals[1:]
    assert tie.any() and np.all(got[:-1][tie] < got[1:][tie])  # equal keys by position
