"""Programmatic dependent launch (PDL, sm_90 and later) for the kernels of a CUDA step.

A decode step is ~740 kernels in a row, most of them a few microseconds long: each boundary costs
the next kernel's launch and ramp plus the last wave's tail of the one before. A kernel launched
with PDL may start while the kernel before it still runs: its programs become resident, read
what no kernel writes (quantized weights: the matvec's first chunk), then wait in
`after_prior` until the kernel before it has finished and its writes are visible, and only then
read activations or write anything. Each kernel also releases its own successor right after that
wait, so at most one kernel waits ahead of the one running. Completion stays ordered: a kernel
finishes only after its wait returned, so when it is done every kernel before it is done too
(a kernel launched without PDL waits for its predecessor's completion as always). The
arithmetic of every kernel is unchanged: PDL moves launch times, never a value.

`launch(t)` says whether a launch over t (rows in its first dimension) takes PDL: compiled kernels
on a GPU of compute capability 9 or later, ENABLED, and at most ROWS rows. The Triton interpreter
and CPU tensors never do. ENABLED is configuration (tools time the step with it off), not a
per-call switch.

Why up to 16 rows: on the H200 the one-row graph step at depth 0 went from 10.65 to 9.68 ms with
PDL (`bench/receipts/20261204T192934Z-step-profile-cuda.json`). At 16 rows PDL first lost (the
same receipt: 61.12 to 62.89 ms; then 0.1 ms worse on the ring kernels of an H100,
`bench/receipts/20261206T183428Z-step-profile-cuda.json`); with today's kernels it wins: on an H100
the 16-row graph step took 12.91 -> 12.77 ms at depth 0 and 14.32 -> 14.20 ms at depth 32,768,
its gaps between kernels 0.56 -> 0.12 and 0.61 -> 0.27 ms (`bench/receipts/20261207T142115Z-step-profile-cuda.json`,
same call). Rows 2-15 were not measured apart; they run the same kernels as 1 or 16 rows, each
launch one or a few waves, and take PDL with them. Longer launches (prefill chunks) keep none.
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    HAVE_TRITON = False

ENABLED = True
ROWS = 16  # launches of at most this many rows take PDL (module doc)


@functools.lru_cache(maxsize=None)
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def launch(t: torch.Tensor) -> bool:
    """PDL for a launch over t: t's rows (first dimension) at most ROWS, on a capable GPU."""
    if not ENABLED or not HAVE_TRITON or t.device.type != "cuda" or t.shape[0] > ROWS \
            or os.environ.get("TRITON_INTERPRET"):
        return False
    return _capable(t.device.index if t.device.index is not None else torch.cuda.current_device())


def kwargs(t: torch.Tensor) -> dict:
    """A launch's PDL constexpr and launch option (`kernel[grid](..., **kwargs(x))`)."""
    on = launch(t)
    return {"PDL": on, "launch_pdl": on}


if HAVE_TRITON:

    @triton.jit
    def after_prior(PDL: tl.constexpr):
        """Wait until the previous kernel has finished (its writes visible), then let the next
        kernel's programs launch. Every PDL kernel calls it before its first read of anything a
        kernel writes and before its first store. A program with nothing to read or store may
        exit without it (the attention partial's splits past every visible key), provided some
        program of the launch waits, so the kernel still completes after the one before it."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()


__all__ = ["ENABLED", "HAVE_TRITON", "ROWS", "after_prior", "kwargs", "launch"]
