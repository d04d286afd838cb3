"""The candidate orderings of llama-sampler.cpp, reproduced including the order of ties.

The sampler sorts candidates by logit (descending) with libstdc++'s std::partial_sort (top-k up
to 128, small arrays) or with a 128-bucket histogram pass followed by std::sort / std::partial_sort
inside buckets (llama_token_data_array_partial_sort). Neither is stable, and which of two equal
logits comes first decides which token a later step keeps or draws. Each function takes the fast
numpy path when the elements whose order it fixes are all distinct (every correct sort then gives
the same answer) and otherwise runs the libstdc++ algorithm itself (muser.text.stl).
"""

from __future__ import annotations

import numpy as np

from ..text import stl

_CHUNK = 4096
NBUCKETS = 128
_BUCKET_SCALE = np.float32(NBUCKETS) / (np.float32(10.0) - np.float32(-10.0))  # 6.4f
_BUCKET_INTER = -np.float32(-10.0) * _BUCKET_SCALE  # 64.0f


def _distinct(v: np.ndarray) -> bool:
    if v.size < 2:
        return not np.isnan(v).any()
    if np.isnan(v).any():
        return False  # NaN compares false with everything: only the real algorithm knows the order
    s = np.sort(v)
    return bool(np.all(s[1:] != s[:-1]))  # -0.0 == +0.0 counts as a tie, as the comparator sees it


def partial_sort_desc(key: np.ndarray, seg: np.ndarray, m: int, exact: bool = True) -> np.ndarray:
    """std::partial_sort(seg, seg + m, seg_end, [](a, b){ return key[a] > key[b]; }):
    the first m handles of the result (handles index `key`). With exact=False, equal keys may
    come out in any order (the caller checks afterwards that this cannot matter)."""
    n = seg.size
    m = min(m, n)
    if m <= 0:
        return seg[:0]
    identity = n == key.size and seg[0] == 0 and seg[-1] == n - 1  # seg is arange(n) here
    vals = key if identity else key[seg]
    if m < n:
        part = np.argpartition(vals, n - m)[n - m :]
        vm = vals[part].min()  # the m-th largest value
        if not exact or (int(np.count_nonzero(vals >= vm)) == m and _distinct(vals[part])):
            top = part if identity else seg[part]
            return top[np.argsort(-key[top], kind="stable")]
    elif not exact or _distinct(vals):
        return seg[np.argsort(-vals, kind="stable")]
    return _partial_sort_exact(key, seg, m)


def _partial_sort_exact(key: np.ndarray, seg: np.ndarray, m: int) -> np.ndarray:
    """libstdc++ heap_select + sort_heap. Elements that cannot enter the heap (not above its top)
    only ever touch positions past `m`, which the sampler discards, so they are skipped."""
    kv = key.tolist()
    comp = lambda a, b: kv[a] > kv[b]  # noqa: E731
    heap = seg[:m].tolist()
    stl.make_heap(heap, 0, m, comp)
    n = seg.size
    pos = m
    while pos < n:
        end = min(n, pos + _CHUNK)
        thr = kv[heap[0]]
        block = seg[pos:end]
        for h in block[key[block] > thr].tolist():
            if comp(h, heap[0]):
                # __pop_heap(first, middle, i): value = *i; *i = *first; adjust_heap(first, 0, m, value)
                stl._adjust_heap(heap, 0, 0, m, h, comp)
        pos = end
    stl.sort_heap(heap, 0, m, comp)
    return np.asarray(heap, dtype=seg.dtype)


def sort_desc(key: np.ndarray, seg: np.ndarray, exact: bool = True) -> np.ndarray:
    """std::sort(seg, seg_end, [](a, b){ return key[a] > key[b]; })."""
    if not exact or _distinct(key[seg]):
        return seg[np.argsort(-key[seg], kind="stable")]
    kv = key.tolist()
    a = seg.tolist()
    stl.sort(a, 0, len(a), lambda x, y: kv[x] > kv[y])
    return np.asarray(a, dtype=seg.dtype)


def sort_asc(key: np.ndarray, seg: np.ndarray, exact: bool = True, payload: np.ndarray | None = None) -> np.ndarray:
    """std::sort(seg, seg_end, [](a, b){ return key[a] < key[b]; }). With exact=False the fast
    order is used unless two elements with equal keys carry different `payload` values (then
    their order is observable and the real algorithm runs)."""
    k = key[seg]
    if exact:
        fast = _distinct(k)
    else:
        o = np.argsort(k, kind="stable")
        ks = k[o]
        same = ks[1:] == ks[:-1]
        if payload is None:
            fast = not np.isnan(k).any()
        else:
            ps = payload[seg][o]
            fast = not np.isnan(k).any() and not np.any(same & (ps[1:] != ps[:-1]))
    if fast:
        return seg[np.argsort(key[seg], kind="stable")]
    kv = key.tolist()
    a = seg.tolist()
    stl.sort(a, 0, len(a), lambda x, y: kv[x] < kv[y])
    return np.asarray(a, dtype=seg.dtype)


def buckets(logits: np.ndarray) -> np.ndarray:
    """int(bucket_scale * logit + bucket_inter) clamped to [0, 127], in float32 as llama.cpp
    computes it; a value the float -> int conversion cannot hold gives INT_MIN (x86 cvttss2si)."""
    with np.errstate(over="ignore", invalid="ignore"):
        v = _BUCKET_SCALE * logits.astype(np.float32) + _BUCKET_INTER  # float32 * then +, no FMA
        ok = np.isfinite(v) & (v > -2147483648.0) & (v < 2147483648.0)
        ib = np.where(ok, np.trunc(np.where(ok, v, 0)), -2147483648.0).astype(np.int64)
    return np.clip(ib, 0, NBUCKETS - 1)


def bucket_partial_sort(logits: np.ndarray, npartial: int, exact: bool = True) -> np.ndarray:
    """llama_token_data_array_partial_sort: the positions (into `logits`) of the result buffer;
    its first `npartial` entries are the top npartial candidates in llama.cpp's order."""
    n = logits.size
    ib_each = buckets(logits)
    histo = np.bincount(ib_each, minlength=NBUCKETS)
    nhave = 0
    ib = NBUCKETS - 1
    while ib >= 0:
        nhave += int(histo[ib])
        if nhave >= npartial:
            break
        ib -= 1
    # scatter in index order into bucket slots, highest bucket first
    pos = np.arange(n)
    chosen = pos[ib_each >= ib]
    order = chosen[np.argsort(-ib_each[chosen], kind="stable")]
    out = order.copy()
    start = 0
    ndone = 0
    for j in range(NBUCKETS - 1, ib, -1):
        h = int(histo[j])
        if h:
            out[start : start + h] = sort_desc(logits, order[start : start + h], exact)
        start += h
        ndone += h
    h = int(histo[ib])
    m = npartial - ndone
    out[start : start + m] = partial_sort_desc(logits, order[start : start + h], m, exact)
    return out
