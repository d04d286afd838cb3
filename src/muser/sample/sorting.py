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
    the first m handles of the result (handles index `key`). With exact=False, equal keys come
    out in handle order rather than libstdc++'s (the caller checks afterwards that this cannot
    change the pick), the same on every machine."""
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
            # ties by position, as below: argpartition leaves equal keys in an order of its own,
            # which differs between numpy's SIMD builds (AVX-512 and AVX2 machines)
            top = np.sort(part if identity else seg[part])
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


def _bucket_ids(logits: np.ndarray) -> tuple[np.ndarray, bool]:
    """buckets(logits), and whether the bucket index is a non-decreasing function of the logit
    over this array (it is unless a NaN or a logit too large for the conversion is present)."""
    with np.errstate(over="ignore", invalid="ignore"):
        v = _BUCKET_SCALE * np.asarray(logits, dtype=np.float32) + _BUCKET_INTER  # float32 * then +, no FMA
        wild = ~(v < 2147483648.0)  # NaN, inf, >= 2^31: INT_MIN, clamped to bucket 0 below
        regular = not wild.any()
        if not regular:
            v[wild] = 0.0
        np.clip(v, 0.0, NBUCKETS - 1, out=v)  # clamping first, then truncating: the same integer
    return v.astype(np.intp), regular


def buckets(logits: np.ndarray) -> np.ndarray:
    """int(bucket_scale * logit + bucket_inter) clamped to [0, 127], in float32 as llama.cpp
    computes it; a value the float -> int conversion cannot hold gives INT_MIN (x86 cvttss2si)."""
    return _bucket_ids(logits)[0]


def _stable_desc(logits: np.ndarray, sel: np.ndarray) -> np.ndarray:
    """`sel` (ascending handles) ordered by logit descending, equal logits in handle order: what a
    stable sort gives. -0.0 and +0.0 are equal; NaNs land anywhere (the caller redoes them). One
    unstable sort of 64-bit keys (order-preserving logit bits, then the handle) does it."""
    v = logits[sel]
    v += np.float32(0.0)  # -0.0 + 0.0 = +0.0
    b = v.view(np.int32)
    flip = ~b
    flip >>= 31
    flip &= 0x7FFFFFFF
    flip ^= b  # as uint32: ascending for descending floats
    key = flip.view(np.uint32).astype(np.uint64)
    key <<= np.uint64(32)
    key |= np.asarray(sel, dtype=np.int64).view(np.uint64)  # handles are >= 0
    key.sort()
    key &= np.uint64(0xFFFFFFFF)
    return key.view(np.int64).astype(np.intp, copy=False)


class BucketSort:
    """llama_token_data_array_partial_sort over one array: the 128-bucket histogram pass, then
    sorted runs of buckets on demand (a caller that reads the result only down to some point
    sorts only the buckets above it).

    A bucket above the one where npartial is reached is std::sort'ed whole; that one is
    std::partial_sort'ed (sorted whole when npartial takes all of it). Whole buckets come from one
    stable sort by (bucket, logit, position), which is each bucket's sort_desc / partial_sort_desc
    result whenever its logits are distinct or exact is off (both then order ties by position);
    a bucket holding NaN, or ties under exact, is redone by that function."""

    def __init__(self, logits: np.ndarray):
        if logits.dtype != np.float32:
            raise TypeError(f"bucket sorting takes float32 logits, got {logits.dtype}")
        self.logits = logits
        self.ids, self.regular = _bucket_ids(logits)
        self.histo = np.bincount(self.ids, minlength=NBUCKETS)

    def cut(self, npartial: int) -> int:
        """The bucket in which the top npartial end."""
        nhave = 0
        ib = NBUCKETS - 1
        while ib >= 0:
            nhave += int(self.histo[ib])
            if nhave >= npartial:
                break
            ib -= 1
        return ib

    def runs(self, hi: int, lo: int, last: int, exact: bool) -> np.ndarray:
        """Buckets hi down to lo, each sorted whole: with std::sort, except bucket `last` (the one
        std::partial_sort ends in), which std::partial_sort sorts to its end."""
        ids, histo, logits = self.ids, self.histo, self.logits
        inside = ids >= lo
        if hi < NBUCKETS - 1:
            inside &= ids <= hi
        order = _stable_desc(logits, np.flatnonzero(inside))
        if not self.regular:  # the bucket is then not a function of the logit's rank: group by it
            order = order[np.argsort((NBUCKETS - 1 - ids[order]).astype(np.uint8), kind="stable")]
        redo = set()
        if not self.regular and lo == 0 and np.isnan(logits[order]).any():
            redo.add(0)  # NaN lands in bucket 0 only
        if exact:
            vs = logits[order]
            tie = np.flatnonzero(vs[1:] == vs[:-1])  # equal logits share a bucket
            redo.update(np.unique(ids[order[tie]]).tolist())
        for j in redo:
            end = int(histo[j : hi + 1].sum())
            start = end - int(histo[j])
            seg = np.sort(order[start:end])  # the bucket in position order, as the histogram pass scatters it
            order[start:end] = sort_desc(logits, seg, exact) if j != last else partial_sort_desc(
                logits, seg, seg.size, exact)
        return order

    def partial_sort(self, npartial: int, exact: bool) -> np.ndarray:
        """The result buffer's positions: its first npartial (1 <= npartial <= size) entries are
        the top npartial candidates in llama.cpp's order."""
        ib = self.cut(npartial)
        h = int(self.histo[ib])
        m = npartial - int(self.histo[ib + 1 :].sum())
        if m == h:
            return self.runs(NBUCKETS - 1, ib, ib, exact)
        head = self.runs(NBUCKETS - 1, ib + 1, ib, exact) if ib < NBUCKETS - 1 else np.empty(0, np.intp)
        seg = np.flatnonzero(self.ids == ib)
        return np.concatenate((head, partial_sort_desc(self.logits, seg, m, exact), seg[m:]))

    def reach(self, p: np.ndarray, target: float, need: int) -> int:
        """A guess at the lowest bucket the running sum of `p` down the sorted array needs to pass
        `target` after at least `need` entries: the highest bucket where both hold, in float64 with
        a margin for float32 rounding (0 when none; only how far to sort first depends on it)."""
        mass = np.cumsum(np.bincount(self.ids, weights=p, minlength=NBUCKETS)[::-1])
        count = np.cumsum(self.histo[::-1])
        ok = np.flatnonzero((mass >= float(target) + 2.0**-10) & (count >= need))
        return NBUCKETS - 1 - int(ok[0]) if ok.size else 0


def bucket_partial_sort(logits: np.ndarray, npartial: int, exact: bool = True) -> np.ndarray:
    """llama_token_data_array_partial_sort: the positions (into `logits`) of the result buffer;
    its first `npartial` (1 <= npartial <= logits.size) entries are the top npartial candidates
    in llama.cpp's order."""
    return BucketSort(logits).partial_sort(npartial, exact)
