"""Exact verification of drafted tokens (book 8.6 item 1; Leviathan et al., speculative sampling).

Greedy: the accepted prefix is the longest run of proposals equal to the target's argmax at each
position, followed by the target's own token at the first mismatch (the bonus).

Sampled: a proposal d drawn from the draft distribution q is accepted with probability
min(1, p(d) / q(d)), p being the target's distribution after the whole sampler chain; on rejection
the token is drawn from the residual norm(max(0, p - q)). Every draw comes from the sequence's
llama.cpp-exact MT19937 stream (muser.sample.mt19937): `leviathan`.

A deterministic (greedy) drafter proposes with q = the point mass on d. Then min(1, p/q) = p(d) and
the residual is p with d removed, renormalized: exactly the law of "draw x from p; accept iff x == d;
else x is the replacement". `verify_point_mass` realizes it that way, with the target sampler's own
draw, so speculative and plain decoding consume the MT19937 stream identically and give the same
tokens for the same seed (and the same distribution for any seed).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..errors import SamplingError
from .chain import Sampler
from .mt19937 import MT19937


def greedy_prefix(proposals: Sequence[int], argmaxes: Sequence[int]) -> tuple[int, int]:
    """(number of accepted proposals, the target's token after them): argmaxes[i] is the target's
    greedy token after the i-th verified row (row 0 = the last committed token), len = k + 1."""
    if len(argmaxes) != len(proposals) + 1:
        raise SamplingError(f"{len(proposals)} proposals need {len(proposals) + 1} target rows, got {len(argmaxes)}")
    a = 0
    while a < len(proposals) and int(proposals[a]) == int(argmaxes[a]):
        a += 1
    return a, int(argmaxes[a])


def _draw(probs: np.ndarray, rng: MT19937) -> int:
    """Index drawn from unnormalized probabilities (double running sum, first index whose running
    sum reaches u * total), as llama_sampler_dist_apply does."""
    run = np.cumsum(probs.astype(np.float64))
    total = float(run[-1])
    if not total > 0:
        raise SamplingError("the residual distribution is empty")
    sel = int(np.searchsorted(run, total * rng.uniform(), side="left"))
    return min(sel, len(probs) - 1)


def leviathan(p: np.ndarray, q: np.ndarray, draft: int, rng: MT19937) -> tuple[bool, int]:
    """One proposal against the target: p, q float distributions over the same vocab [V], draft
    drawn from q. Returns (accepted, token): the draft, or the residual resample."""
    if p.shape != q.shape or p.ndim != 1:
        raise SamplingError(f"p and q must be 1-D of one shape, got {p.shape} and {q.shape}")
    if not 0 <= draft < p.size:
        raise SamplingError(f"draft token {draft} is outside the vocab [0, {p.size})")
    qd = float(q[draft])
    if not qd > 0:
        raise SamplingError(f"the draft distribution gives its own proposal {draft} probability {qd}")
    u = rng.uniform()
    if u < min(1.0, float(p[draft]) / qd):
        return True, int(draft)
    return False, _draw(np.maximum(p.astype(np.float64) - q.astype(np.float64), 0.0), rng)


def verify_point_mass(sampler: Sampler, logits: np.ndarray, draft: int) -> tuple[bool, int]:
    """A greedy drafter's proposal (q = point mass on `draft`) against the target's logits at that
    position: the target sampler draws x from its chain's p; accepted iff x == draft."""
    x = sampler.sample(logits)
    return x == int(draft), x


__all__ = ["greedy_prefix", "leviathan", "verify_point_mass"]
