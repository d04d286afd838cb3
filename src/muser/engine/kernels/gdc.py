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

Why one row only: on the H200 the one-row graph step at depth 0 went from 10.65 to 9.68 ms with
PDL, the 16-row step from 61.12 to 62.89 ms (`bench/receipts/20261204T192934Z-step-profile-cuda.json`,
same call, same kernels). Measured again on the integer lane's ring kernels (an H100, fast lane,
depth 0, `bench/receipts/20261206T183428Z-step-profile-cuda.json`): with PDL up to 16 rows the
16-row step's gaps between kernels fell from 0.47 to 0.16 ms but its kernels' busy time rose from
13.04 to 13.46 ms, 0.1 ms worse in all. Row counts between were not measured, so they keep the
launches they were measured with.
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
ROWS = 1  # launches of at most this many rows take PDL (module doc)


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
        kernel writes and before its first store."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()


__all__ = ["ENABLED", "HAVE_TRITON", "ROWS", "after_prior", "kwargs", "launch"]
