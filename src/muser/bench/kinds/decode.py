"""`muser bench decode`: decode speed (llama-bench's tg N at depth d) of Muser on one model, device
and lane, side by side with the pinned llama.cpp (--against llama.cpp), interleaved A B A B.

Reports tok/s per repetition, mean and CV, and achieved GB/s = bytes streamed per decoded token
(the GGUF weight bytes one token streams, plus the K/V bytes attention reads at that depth) x
tok/s; on CUDA also the run's measured copy bandwidth and the fraction reached. Beside the
engine's figure, the end-to-end `muser generate` loop's tok/s over the same positions (sampling
included) and its ratio to the engine's. The exactness
gate (Gate 2) runs first; a failing gate marks the figures "not a result". Definitions and the
comparator settings: muser.bench.speed.
"""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    from ..speed import register_kind

    register_kind(sub, "decode", "decode tok/s and GB/s at KV depths, side by side with llama.cpp", __doc__)
