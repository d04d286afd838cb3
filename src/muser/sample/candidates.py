"""The sampler's candidates filtered where the logits are: only the largest few come back.

    f = DeviceFilter(sampler)            # one per generation (its logit biases, uploaded once)
    red = f.read(row)                    # None: this chain needs the whole vocabulary
    tok = sampler.sample_top(red.ids, red.logit)   # None: a tie, the full row decides
    lp = red.logprob(tok)                # log p(tok) under the raw distribution

`row` is a muser.engine.rows.DeviceRow (next-token logits f32 [vocab] kept on the device, read
back in one copy with their finiteness flag). On the device: the chain's logit-bias step (float32
adds, as chain.Sampler.sample), torch.topk of the biased row for the sampler's filter_width()
(the chain's top k and the next value, or the two largest under greedy decoding), the raw
logits at those ids, and the raw row's max and float64 sum of exp(l - max) for the logprob. What
the pick may depend on and when the whole row is needed instead is chain.Sampler.filter_width /
sample_top: with active penalties, top_k = 0 outside greedy decoding, a tied pick, or
top_logprobs requested, the caller reads the row in full (DeviceRow.host) and samples it as on
the CPU. The same code runs on CPU tensors (the parity tests).

The speculative driver's rows come back whole from its verify forward (one readback of k + 1
rows a round, muser.spec.session) and go through the same Emitter as host arrays.

The logprob is float64 log-softmax as muser.generation.raw_logprobs computes it on the host; the
sum of exponentials runs on the device, in the device's order (the last bits may differ from
the host sum's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import SamplingError
from .chain import F32, Sampler


@dataclass(frozen=True)
class Reduced:
    """What came back: the m largest biased logits (largest first) and the raw row's summary."""

    ids: np.ndarray  # int64 [m]
    logit: np.ndarray  # float32 [m], biased (the chain's input to top-k)
    raw: np.ndarray  # float32 [m], the row's own logits at ids
    max_raw: float  # max of the raw row
    log_z: float  # log sum exp(raw - max_raw), float64

    def logprob(self, token: int) -> float | None:
        """log p(token) under the raw distribution, or None when token is not among the ids."""
        hit = np.flatnonzero(self.ids == token)
        if not hit.size:
            return None
        return float(np.float64(self.raw[hit[0]]) - self.max_raw - self.log_z)


def reduce_row(logits: torch.Tensor, m: int, bias: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """float64 [2 + 3m] on logits' device: max raw logit, sum exp(raw - max), then the ids, biased
    logits and raw logits of the m largest biased logits (largest first; ties in any order)."""
    x = logits  # f32 [V]
    b = x
    if bias is not None:
        ids, vals = bias
        b = x.clone()
        b[ids] = b[ids] + vals  # float32 adds, one per biased id (chain.Sampler.sample)
    top, idx = torch.topk(b, m)  # [m], sorted largest first
    xd = x.double()
    mx = xd.max()
    se = torch.exp(xd - mx).sum()  # float64, as raw_logprobs (np.exp(x - m).sum())
    return torch.cat([mx.view(1), se.view(1), idx.double(), top.double(), x[idx].double()])


def unpack(packed: np.ndarray, m: int) -> Reduced:
    if packed.shape != (2 + 3 * m,):
        raise SamplingError(f"a reduced row of width {m} has {2 + 3 * m} values, got {packed.shape}")
    se = float(packed[1])
    return Reduced(ids=packed[2:2 + m].astype(np.int64), logit=packed[2 + m:2 + 2 * m].astype(F32),
                   raw=packed[2 + 2 * m:].astype(F32), max_raw=float(packed[0]),
                   log_z=math.log(se) if se > 0 else math.inf)


class DeviceFilter:
    """The device side of one Sampler: its biases as device tensors (per device, uploaded once)."""

    def __init__(self, sampler: Sampler):
        self.sampler = sampler
        self._bias: dict[str, tuple[torch.Tensor, torch.Tensor] | None] = {}

    def bias_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        key = str(device)
        if key not in self._bias:
            pairs = self.sampler._bias
            self._bias[key] = None if not pairs else (
                torch.tensor([t for t, _ in pairs], dtype=torch.int64, device=device),
                torch.tensor(np.array([b for _, b in pairs], dtype=F32), device=device))
        return self._bias[key]

    def read(self, row: Any) -> Reduced | None:
        """The reduced row (one readback), or None when the chain needs the whole vocabulary."""
        m = self.sampler.filter_width()
        if m is None:
            return None
        lg = row.logits
        if lg.shape != (self.sampler.vocab_size,):
            raise SamplingError(f"logits must be float32[{self.sampler.vocab_size}], got {tuple(lg.shape)}")
        with torch.inference_mode():
            packed = reduce_row(lg, m, self.bias_on(lg.device))
        return unpack(row.read(packed), m)


def warm_up(device: torch.device, vocab: int) -> None:
    """Run the reduction once per width class on `device`, so its kernels are loaded before the
    first request (CUDA loads a module on first launch)."""
    x = torch.zeros(vocab, dtype=torch.float32, device=device)
    bias = (torch.zeros(1, dtype=torch.int64, device=device), torch.zeros(1, dtype=torch.float32, device=device))
    with torch.inference_mode():
        for m in {min(2, vocab), min(41, vocab)}:
            reduce_row(x, m, bias).cpu()
            reduce_row(x, m, None).cpu()


__all__ = ["DeviceFilter", "Reduced", "reduce_row", "unpack", "warm_up"]
