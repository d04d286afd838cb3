"""llama.cpp's default sampler chain (common/sampling.cpp common_sampler_init), step for step.

Order: logit-bias -> penalties -> [dry] -> [top-n-sigma] -> top-k -> typical -> top-p -> min-p ->
[xtc] -> temperature -> dist. The bracketed steps are off at llama.cpp's defaults and are not
offered. Each step is the function of the same name in src/llama-sampler.cpp with its float32
arithmetic (libllama is built without FMA or fast-math), libm's expf/logf, libstdc++'s sort
orders, and the dist draw: softmax in float32, cumulative sum in double, target = sum *
uniform(mt19937), first candidate whose running sum reaches it.

A step that llama.cpp's init function turns into a no-op ("empty" sampler) is decided on the
float32 value llama.cpp receives (e.g. top_p 0.99999999 is 1.0f, i.e. off).
"""

from __future__ import annotations

import math
import os
from collections import deque
from dataclasses import dataclass

import numpy as np

from ..errors import NonFiniteLogits, SamplingError
from . import libm
from .mt19937 import MT19937
from .params import LLAMA_DEFAULT_SEED, SamplingParams
from .sorting import NBUCKETS, BucketSort, bucket_partial_sort, partial_sort_desc, sort_asc

F32 = np.float32


@dataclass
class Candidates:
    """llama_token_data_array: parallel arrays, in the array's current order."""

    ids: np.ndarray  # int32 [n]
    logit: np.ndarray  # float32 [n]
    p: np.ndarray | None  # float32 [n]; None until a softmax fills it
    sorted: bool = False

    @property
    def size(self) -> int:
        return int(self.ids.size)

    def take(self, pos: np.ndarray) -> None:
        self.ids, self.logit = self.ids[pos], self.logit[pos]
        if self.p is not None:
            self.p = self.p[pos]


# -- steps (llama-sampler.cpp) --------------------------------------------------------------------


def _partial_sort_inplace(c: Candidates, npartial: int, exact: bool) -> None:
    """llama_token_data_array_partial_sort_inplace: keep the top npartial, sorted."""
    if npartial <= 128:
        order = partial_sort_desc(c.logit, np.arange(c.size), npartial, exact)
    else:
        order = bucket_partial_sort(c.logit, npartial, exact)[:npartial]
    c.take(order)
    c.sorted = True


def softmax(c: Candidates, do_sort: bool, exact: bool) -> None:
    """llama_sampler_softmax_impl: p = expf(l - max) / sum, float32, sequential sum."""
    if do_sort and not c.sorted:
        _partial_sort_inplace(c, c.size, exact)
    max_l = c.logit[0] if c.sorted else c.logit.max()
    with np.errstate(invalid="ignore"):
        p = libm.expf(c.logit - max_l)
    cum = np.cumsum(p, dtype=F32)[-1]  # float cum_sum += p, in order
    p /= cum  # float32 division, in place
    c.p = p


def top_k(c: Candidates, k: int, exact: bool) -> None:
    if k <= 0:
        return
    k = min(k, c.size)
    if not c.sorted:
        _partial_sort_inplace(c, k, exact)
    c.take(np.arange(k))


def typical(c: Candidates, p: F32, min_keep: int, exact: bool) -> None:
    softmax(c, True, exact)
    with np.errstate(divide="ignore", invalid="ignore"):
        logp = libm.logf(c.p)
        terms = np.concatenate(([F32(0.0)], ((-c.p) * logp).astype(F32)))
        entropy = np.cumsum(terms, dtype=F32)[-1]  # float entropy = 0; entropy += -p * logf(p)
        shifted = np.abs((-logp) - entropy).astype(F32)  # fabsf(-logf(p) - entropy)
    idx = sort_asc(shifted, np.arange(c.size), exact, payload=c.logit)
    cum = np.cumsum(c.p[idx], dtype=F32)
    ok = cum > p
    if min_keep > 0:
        ok[: min_keep - 1] = False
    hit = np.flatnonzero(ok)
    last = int(hit[0]) + 1 if hit.size else idx.size
    c.take(idx[:last])
    c.sorted = False


def _first_hit(cum: np.ndarray, p: F32, min_keep: int, offset: int) -> int | None:
    """First i (offset + index) with cum >= p and i + 1 >= min_keep."""
    ok = cum >= p
    lo = max(0, min_keep - 1 - offset)
    ok[:lo] = False
    hit = np.flatnonzero(ok)
    return offset + int(hit[0]) if hit.size else None


def top_p(c: Candidates, p: F32, min_keep: int, exact: bool) -> None:
    softmax(c, False, exact)
    size = c.size
    buf = None  # positions into c of the sorted buffer (when the adaptive path is taken)
    if not c.sorted and size > 1024:
        k = min(256, size)
        order = BucketSort(c.logit)
        buf = order.partial_sort(k, exact)
    elif not c.sorted:
        k = size
        _partial_sort_inplace(c, k, exact)
    else:
        k = size
    # float cum_sum += p in order; at i == k - 1 the adaptive buffer is re-sorted in full and
    # the sum carries on over the new buffer from position k
    pdata = c.p if buf is None else c.p[buf[:k]]
    cum = np.cumsum(pdata[:k], dtype=F32)
    hit = _first_hit(cum, p, min_keep, 0)
    if hit is None and buf is not None and k < size:
        # The full re-sort ends in the lowest bucket; the sum reads it only down to the hit, so
        # the buckets are sorted from the top as far as it likely goes first, the rest if needed.
        low = order.cut(size)
        stop = max(order.reach(c.p, p, max(k + 1, min_keep)), low)
        buf = order.runs(NBUCKETS - 1, stop, low, exact)
        done, total = k, cum[-1]
        while True:
            rest = np.empty(buf.size - done + 1, dtype=F32)
            rest[0] = total
            rest[1:] = c.p[buf[done:]]
            cum2 = np.cumsum(rest, dtype=F32)[1:]
            hit = _first_hit(cum2, p, min_keep, done)
            if hit is not None or stop == low:
                break
            done, total = buf.size, rest[0] if not cum2.size else cum2[-1]
            buf = np.concatenate((buf, order.runs(stop - 1, low, low, exact)))
            stop = low
    last = size if hit is None else hit + 1
    if buf is not None:
        c.take(buf[:last])
        c.sorted = True
    else:
        c.take(np.arange(last))


def min_p(c: Candidates, p: F32, min_keep: int, exact: bool) -> None:
    if not c.size:
        return
    lp = libm.logf_scalar(p)
    if not c.sorted:
        max_logit = max(F32(-3.4028235e38), c.logit.max())
        keep = np.flatnonzero(c.logit >= F32(max_logit + lp))
        if keep.size and keep.size >= min_keep:
            c.take(keep)
            return
        _partial_sort_inplace(c, c.size, exact)
    min_logit = F32(c.logit[0] + lp)
    stop = c.logit < min_logit
    stop[: max(1, min_keep)] = False  # position 0 always stays; i >= min_keep
    hit = np.flatnonzero(stop)
    c.take(np.arange(int(hit[0]) if hit.size else c.size))


def temperature(c: Candidates, t: F32) -> None:
    """llama_sampler_temp_impl: t <= 0 keeps only the first maximal candidate."""
    if not c.size:
        return
    if t <= 0:
        keep = int(np.argmax(c.logit))  # first occurrence of the maximum
        lg = np.full_like(c.logit, -np.inf)
        lg[keep] = c.logit[keep]
        c.logit = lg
        return
    c.logit = (c.logit / t).astype(F32)


def dist(c: Candidates, rng: MT19937) -> int:
    """llama_sampler_dist_apply: returns the selected index."""
    if c.size == 0:
        raise SamplingError("no candidate left to sample from")
    if c.size == 1:
        rng.uniform()  # llama.cpp draws once even here, keeping the stream aligned
        c.p = np.ones(1, dtype=F32)
        return 0
    max_l = c.logit[0] if c.sorted else c.logit.max()
    if max_l == -np.inf:
        raise SamplingError("every remaining candidate has logit -inf (all tokens banned)")
    p = libm.expf(c.logit - max_l)  # float32 minus float32 scalar: float32
    p64 = p.astype(np.float64)
    run = np.cumsum(p64)  # double sum_cum += p, in order
    sum_cum = float(run[-1])
    rnd = rng.uniform()
    target = sum_cum * rnd
    sel = int(np.searchsorted(run, target, side="left"))
    if sel >= c.size:
        sel = c.size - 1  # llama.cpp's fallback (unreachable for rnd < 1)
    p64 /= sum_cum
    c.p = p64.astype(F32)
    return sel


# -- the chain ------------------------------------------------------------------------------------


def _fresh_seed() -> int:
    while True:
        s = int.from_bytes(os.urandom(4), "little")
        if s != LLAMA_DEFAULT_SEED:
            return s


class Sampler:
    """The chain for one sequence. `sample(logits)` picks a token; `accept(token)` records a
    token in the sequence (prompt tokens included, as llama.cpp's server and CLI do) for the
    repetition penalties."""

    def __init__(self, params: SamplingParams, vocab_size: int):
        if not isinstance(params, SamplingParams):
            raise SamplingError(f"params must be SamplingParams, got {type(params).__name__}")
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise SamplingError(f"vocab_size must be a positive integer, got {vocab_size!r}")
        params.check_vocab(vocab_size)
        self.params = params
        self.vocab_size = vocab_size
        self.seed = params.seed if params.seed is not None else _fresh_seed()
        self.rng = MT19937(self.seed)
        # float32 copies: what llama.cpp's init functions receive
        self._temp = F32(params.temperature)
        self._top_p = F32(params.top_p)
        self._min_p = F32(params.min_p)
        self._typ_p = F32(params.typical_p)
        self._rep = F32(params.repeat_penalty)
        self._freq = F32(params.frequency_penalty)
        self._pres = F32(params.presence_penalty)
        self._bias = [(t, F32(b)) for t, b in params.logit_bias.items()]
        self._penalties_on = params.penalty_last_n != 0 and not (
            self._rep == 1.0 and self._freq == 0.0 and self._pres == 0.0)
        self._prev: deque[int] = deque()
        self._counts: dict[int, int] = {}
        self.last: Candidates | None = None
        self._all_ids = np.arange(vocab_size, dtype=np.int32)
        self._all_ids.setflags(write=False)

    # -- state ----------------------------------------------------------------------------------

    def accept(self, token: int) -> None:
        if isinstance(token, bool) or not isinstance(token, (int, np.integer)) or not 0 <= token < self.vocab_size:
            raise SamplingError(f"accepted token {token!r} is outside the vocab [0, {self.vocab_size})")
        if not self._penalties_on:
            return
        token = int(token)
        self._counts[token] = self._counts.get(token, 0) + 1
        if len(self._prev) >= self.params.penalty_last_n:
            old = self._prev.popleft()
            self._counts[old] -= 1
            if self._counts[old] == 0:
                del self._counts[old]
        self._prev.append(token)

    def reset(self) -> None:
        self.rng = MT19937(self.seed)
        self._prev.clear()
        self._counts.clear()

    def checkpoint(self) -> tuple:
        return (self.rng.getstate(), tuple(self._prev), dict(self._counts))

    def restore(self, cp: tuple) -> None:
        rs, prev, counts = cp
        self.rng.setstate(rs)
        self._prev = deque(prev)
        self._counts = dict(counts)

    # -- sampling -------------------------------------------------------------------------------

    def sample(self, logits: np.ndarray) -> int:
        if not isinstance(logits, np.ndarray) or logits.dtype != np.float32 or logits.shape != (self.vocab_size,):
            got = f"{type(logits).__name__} {getattr(logits, 'dtype', '')} {getattr(logits, 'shape', '')}"
            raise SamplingError(f"logits must be float32[{self.vocab_size}], got {got}")
        if not np.isfinite(logits).all():
            bad = np.flatnonzero(~np.isfinite(logits))
            raise NonFiniteLogits(
                f"{bad.size} non-finite logits (first at token {int(bad[0])}: {logits[bad[0]]}); "
                "no distribution installed"
            )
        base = logits.astype(F32, copy=True)
        for tok, b in self._bias:  # logit-bias: the array is still in id order
            base[tok] = F32(base[tok] + b)
        if self._penalties_on and self._counts:
            toks = np.fromiter(self._counts.keys(), dtype=np.int64, count=len(self._counts))
            cnt = np.fromiter(self._counts.values(), dtype=np.int64, count=len(self._counts)).astype(F32)
            lg = base[toks]
            lg = np.where(lg <= 0, lg * self._rep, lg / self._rep).astype(F32)
            lg = (lg - (cnt * self._freq + (cnt > 0).astype(F32) * self._pres).astype(F32)).astype(F32)
            base[toks] = lg
        # Pass 1 orders equal logits any way; every decision of the chain depends on values only,
        # so the pick is exact unless the picked value is shared by another token (then which of
        # them sits where is libstdc++'s call): replay with the real algorithms and the same draw.
        state = self.rng.getstate()
        c, sel = self._run(Candidates(self._all_ids, base.copy(), None), exact=False)
        v = base[c.ids[sel]]
        if int(np.count_nonzero(base == v)) > 1:
            self.rng.setstate(state)
            c, sel = self._run(Candidates(self._all_ids, base.copy(), None), exact=True)
        self.last = c
        return int(c.ids[sel])

    # -- the pick from the largest logits alone (muser.sample.candidates) --------------------------

    def filter_width(self) -> int | None:
        """How many of the largest biased logits decide this chain's pick (sample_top), or None
        when it needs the whole vocabulary: active penalties rewrite the logits of the tokens
        seen; with top_k = 0 (and not greedy) top-p's softmax, typical's entropy and dist's sum
        run over every id."""
        if self._penalties_on:
            return None
        if self._temp <= 0 and self._typ_p >= 1.0:
            return min(2, self.vocab_size)  # the maximum and whether it is tied
        if 0 < self.params.top_k < self.vocab_size:
            return self.params.top_k + 1  # the top k and the next value (a tie past the k-th)
        return None

    def sample_top(self, ids: np.ndarray, logit: np.ndarray) -> int | None:
        """The chain's pick given only the filter_width() largest biased logits of the row (ids
        int [m], logit float32 [m], largest first, ties in any order), or None (the stream
        rewound) when the row decides it: sample(row) then gives the pick.

        Greedy: every step before temperature keeps the maximum (top-k and top-p keep the first
        sorted candidate, min-p every candidate at the maximum) and temperature keeps the first
        maximal candidate, so a unique maximum is the pick; dist draws once. top_k = k: the
        chain's values after top-k are the row's k largest, largest first, and every later step
        decides on values alone (pass 1 of sample), so the pick's value and the stream position
        are the full chain's; a value held by one id names the pick. A tied value (or a zero draw
        where the greedy order may be unsorted) is the row's: the full chain then orders ties the
        way libstdc++ does over the whole vocabulary (std::partial_sort's heap starts from the
        first k ids, whatever their values), which the largest logits alone do not fix."""
        m = self.filter_width()
        if m is None or ids.shape != (m,) or logit.shape != (m,) or logit.dtype != F32:
            raise SamplingError(f"sample_top takes the {m} largest float32 logits and their ids, got "
                                f"{logit.dtype} {logit.shape} and {ids.shape}")
        if self._temp <= 0 and self._typ_p >= 1.0:
            v = logit[0]
            if v == -np.inf or (m > 1 and logit[1] == v):
                return None  # all banned (the chain's error) or a tied maximum
            state = self.rng.getstate()
            if self.rng.uniform() == 0.0:  # dist's target 0 picks the first candidate in the order
                self.rng.setstate(state)
                return None
            self.last = Candidates(ids[:1].astype(np.int32), logit[:1].copy(), np.ones(1, dtype=F32), True)
            return int(ids[0])
        k = self.params.top_k
        top_ids, top_l = ids[:k], logit[:k]
        order = np.argsort(top_ids, kind="stable")  # id order, as the full array starts
        state = self.rng.getstate()
        c, sel = self._run(Candidates(top_ids[order].astype(np.int32), top_l[order].copy(), None), exact=False)
        v = top_l[order][np.flatnonzero(top_ids[order] == c.ids[sel])[0]]
        if int(np.count_nonzero(top_l == v)) + int(logit[k] == v) > 1:
            self.rng.setstate(state)
            return None
        self.last = c
        return int(c.ids[sel])

    def _run(self, c: Candidates, exact: bool) -> tuple[Candidates, int]:
        P = self.params
        top_k(c, P.top_k, exact)
        if self._typ_p < 1.0:
            typical(c, self._typ_p, P.min_keep, exact)
        if self._top_p < 1.0:
            top_p(c, self._top_p, P.min_keep, exact)
        if self._min_p > 0.0:
            min_p(c, self._min_p, P.min_keep, exact)
        if not self._temp == 1.0:
            temperature(c, self._temp)
        return c, dist(c, self.rng)


def log_softmax_at(logits: np.ndarray, token: int) -> float:
    """log p(token) under the model's own distribution (float64), for reporting."""
    x = logits.astype(np.float64)
    m = float(x.max())
    return float(x[token] - m - math.log(float(np.exp(x - m).sum())))
