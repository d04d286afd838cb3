"""`muser bench verify`: the speculative verify shape (book 10.1): one forward of N <= 16 rows
with every row's logits, against one single-row decode at the same KV depth, interleaved A B A B.

Reports both times, their CVs and the ratio verify / decode (DESIGN.md target on CUDA: <= 1.3 for
16 rows), and the same for the pinned llama.cpp (--against llama.cpp: one llama_decode batch of
N rows with all logits vs one token; on CUDA llama-bench's pp N and tg 1). The exactness gate
(Gate 2) runs first; a failing gate marks the figures "not a result". Definitions:
muser.bench.speed.
"""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    from ..speed import register_kind

    register_kind(sub, "verify", "16-row verify forward time / one-row decode time, beside llama.cpp", __doc__)
