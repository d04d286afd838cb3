"""Warm-up at load on CUDA: every kernel a request will launch is compiled, and the step graphs
captured once, before the first request rather than inside it (DESIGN.md: TTFT of a 16-token
prompt after load <= 50 ms).

Triton compiles a kernel per specialization: the matvec per row bucket (1, 2, 4, 8, 16 rows:
qmatvec._rows_bucket); the attention kernels split keys at fixed absolute positions and take the
split count as a runtime argument (kernels/attention.py), so one session capacity covers every
depth. The warm-up runs, on a throwaway session, decodes, verify-shaped steps of each row bucket,
prompts of every length up to 16 rows (graphs: a prompt's first call runs eagerly, its second is
captured; a decode's or verify's first call is captured), and an eager prefill chunk wider than
the graph shapes (its projections in 16-row matvec slices and a partial one). A graph reads its
sessions' plane storage from its metadata (engine/graphs.py), so the captures serve every later
session whose context fits their bound (graphs.graph_context: up to GRAPH_CONTEXT_MIN positions
for this session's), and a request of such a session replays from its first step. Batched steps
of several sessions launch the same binaries: every item's metadata in a step graph is 16-byte
aligned like a single item's (Triton specializes on pointer alignment; engine/graphs.py);
`muser serve` captures its slots' batch shapes before it says it is ready
(muser.server.loop.EngineLoop.warm_up). The session is released afterwards; the graphs stay.

On the CPU nothing runs (no compilation, no graphs): muser.load calls this for CUDA only.
"""

from __future__ import annotations

import time

import numpy as np

from ..errors import LaneError
from ..progress import Progress
from ..sequence import MAX_VERIFY
from .kernels.qmatvec import MAX_ROWS

WARM_CAPACITY = 4096  # the warm-up session's capacity (at most the context length)
ROW_BUCKETS = (2, 4, 8, MAX_VERIFY)  # verify-shaped steps, one per matvec row bucket past 1
PROMPT_ROWS = tuple(range(2, MAX_VERIFY + 1))  # prompt-shaped steps: every length a graph serves
EAGER_ROWS = 2 * MAX_ROWS + 8  # an eager prefill chunk: two full matvec slices and a partial one


def capacities(context_length: int) -> list[int]:
    """The warm-up sessions' capacities: one, since no kernel specializes on the depth."""
    return [min(context_length, WARM_CAPACITY)]


def plan(context_length: int) -> list[tuple[int, str, int]]:
    """The warm-up's calls, in order: (session capacity, 'decode' | 'verify' | 'prompt' | 'prefill',
    rows); each session starts with one prefilled token, each shape runs twice (a decode or verify:
    eager + capture, then the replay; a prompt: eager, then eager + capture)."""
    caps = capacities(context_length)
    big = caps[-1]
    shapes = [(c, "decode", 1) for c in caps[:-1]]
    shapes.append((big, "prefill", EAGER_ROWS))
    shapes += [(big, "verify", t) for t in ROW_BUCKETS]
    shapes += [(big, "prompt", t) for t in PROMPT_ROWS]
    shapes.append((big, "decode", 1))
    out = []
    used: dict[int, int] = {}
    for cap, what, rows in shapes:
        for _ in range(2):
            n = used.get(cap, 1)
            if n + rows <= cap:
                out.append((cap, what, rows))
                used[cap] = n + rows
    return out


def warm_up(engine, stream=None, enabled: bool = True) -> dict:
    """Compile and capture on `engine` (CUDA only), with a progress line on stderr. Returns a
    record {seconds, calls}."""
    if engine.device.type != "cuda":
        raise LaneError(f"warm-up compiles CUDA kernels and graphs; the engine runs on {engine.device.type!r}")
    import torch

    calls = plan(engine.cfg.context_length)
    bar = Progress("warm-up", len(calls), stream=stream, enabled=enabled)
    t0 = time.perf_counter()
    run_plan(engine, calls, bar)
    torch.cuda.synchronize(engine.device)
    bar.close()
    return {"seconds": time.perf_counter() - t0, "calls": len(calls)}


def run_plan(engine, calls: list[tuple[int, str, int]], bar: Progress) -> None:
    """The calls of `plan` on throwaway sessions (random ids), dropped afterwards (the graphs they
    captured stay with the engine: they hold no session)."""
    rng = np.random.default_rng(0)
    vocab = engine.cfg.vocab
    sessions: dict[int, object] = {}
    for cap, what, rows in calls:
        s = sessions.get(cap)
        if s is None:
            s = sessions[cap] = engine.session(max_context=cap)
            s.prefill(rng.integers(0, vocab, 1))
        ids = rng.integers(0, vocab, rows)
        if what == "prefill":
            s.prefill(ids)
        elif what == "verify":
            s.verify(ids)
        else:  # a request's prompt or the generation loop's decode: the last row kept on the device
            row = s.prefill_row(ids) if what == "prompt" else s.decode_row(ids[0])
            if not isinstance(row, np.ndarray):
                row.host()
        bar.advance(1, f"{what} {rows} row{'s' * (rows > 1)}, context {cap}")


__all__ = ["PROMPT_ROWS", "capacities", "plan", "run_plan", "warm_up"]
