"""`muser bench prefill`: prefill speed (llama-bench's pp N at depth d) of Muser on one model,
device and lane, side by side with the pinned llama.cpp (--against llama.cpp), interleaved A B A B.

Reports tok/s per repetition, mean, CV and the ratio Muser / llama.cpp. The exactness gate
(Gate 2; a fast-lane run is gated by the exact lane on the same weights and reports its drift)
runs first; a failing gate marks the figures "not a result". Definitions and the comparator
settings: muser.bench.speed.
"""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    from ..speed import register_kind

    register_kind(sub, "prefill", "prefill tok/s at KV depths, side by side with llama.cpp", __doc__)
