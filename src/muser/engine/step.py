"""Engine.step: one forward over the rows of several sequences (DESIGN.md "Style": generation,
the speculative driver and the server are loops over it; nano-vllm's `step()`).

    from muser.engine import StepItem
    out = eng.step([StepItem(s1, [t1]), StepItem(s2, block, logits="all"),
                    StepItem(s3, prompt_chunk, logits="none"), StepItem(s4, ids, logits=[0, 3])])
    out[1].logits            # float32 [len(block), vocab]; out[2].logits is None

The rows of every item are concatenated: embedding, projections, norms and the LM head run
once over all rows; attention runs per item, each row over its own session's planes at its
own positions, and then appends its K/V to those planes. The LM head runs only on the rows
whose logits were asked for (a row-index selection inside the forward, llama.cpp's
inp_out_ids).

Every item is validated before any work (muser.sequence's rules, plus: a StepItem, a session
of this engine listed at most once, a valid logits request, at most max(chunk, 16) rows per
item, where chunk is the session's prefill chunk). The step is one transaction: if any
requested row's logits are not finite, every session returns to its state before the step
and NonFiniteLogits names the item and row (book 10.9).

On CUDA a step whose items all have <= 16 rows and ask for their last or all rows replays the
captured graph of its batch shape (engine/graphs.py: keyed by the per-item row counts and
context bounds, owned by the engine, serving any sessions); other steps run eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from ..errors import BatchError
from ..sequence import (
    MAX_VERIFY,
    check_capture,
    check_span,
    check_tokens,
    first_non_finite,
    non_finite_error,
    transaction,
)

ROW_MODES = ("last", "all", "none")


@dataclass(frozen=True)
class StepItem:
    """One sequence's part of a step: its next tokens and which rows' logits to return:
    'last' | 'all' | 'none' | strictly increasing row indices into `tokens`. capture: layers
    whose input residual is returned (None: the session's own capture layers)."""

    session: Any
    tokens: Any
    logits: Any = "last"
    capture: Iterable[int] | None = None


@dataclass(frozen=True)
class StepResult:
    logits: np.ndarray | None  # float32 [len(rows), vocab], None when no row was asked for
    rows: tuple[int, ...]  # the item's rows these logits belong to, in order
    captured: dict[int, np.ndarray] = field(default_factory=dict)  # layer -> [T, hidden]
    row: Any = None  # with device_rows on CUDA: the last row, a DeviceRow (logits is then None)


@dataclass
class StepWork:
    """A validated item: int64 ids [T], its logits request, its capture layers."""

    session: Any
    ids: np.ndarray
    rows: str | np.ndarray  # 'last' | 'all' | 'none' | int64 row indices
    capture: tuple[int, ...]

    @property
    def T(self) -> int:
        return len(self.ids)

    def row_indices(self) -> np.ndarray:
        if isinstance(self.rows, np.ndarray):
            return self.rows
        T = self.T
        return {"last": np.array([T - 1]), "all": np.arange(T), "none": np.zeros(0)}[self.rows].astype(np.int64)


def _check_rows(spec: Any, T: int, what: str) -> str | np.ndarray:
    if isinstance(spec, str):
        if spec not in ROW_MODES:
            raise BatchError(f"{what}: logits must be 'last', 'all', 'none' or row indices, got {spec!r}")
        return spec
    try:
        a = np.asarray(spec)
    except Exception:  # noqa: BLE001 - any unconvertible request is the caller's error
        raise BatchError(f"{what}: logits rows {spec!r} are not a list of row indices") from None
    if a.ndim != 1 or (a.size and (not np.issubdtype(a.dtype, np.integer) or a.dtype == np.bool_)):
        raise BatchError(f"{what}: logits rows must be a flat list of integers, got {spec!r}")
    a = a.astype(np.int64)
    if a.size and (a.min() < 0 or a.max() >= T or np.any(np.diff(a) <= 0)):
        raise BatchError(f"{what}: logits rows must be strictly increasing indices in [0, {T}), "
                         f"got {a.tolist()}")
    return a


def validate(engine, batch: Sequence[StepItem]) -> list[StepWork]:
    """Every item checked before any work; a typed error naming the item and value."""
    from .session import Session

    if isinstance(batch, StepItem) or not isinstance(batch, (list, tuple)):
        raise BatchError(f"a step takes a list of StepItem, got {type(batch).__name__}")
    if not batch:
        raise BatchError("a step needs at least one item")
    seen: dict[int, int] = {}
    works = []
    for i, it in enumerate(batch):
        what = f"step item {i}"
        if not isinstance(it, StepItem):
            raise BatchError(f"{what}: expected a StepItem, got {type(it).__name__}")
        s = it.session
        if not isinstance(s, Session) or s.engine is not engine:
            raise BatchError(f"{what}: its session does not belong to this engine")
        if id(s) in seen:
            raise BatchError(f"{what}: its session is already item {seen[id(s)]} of this step")
        seen[id(s)] = i
        ids = check_tokens(it.tokens, s.vocab, what)
        limit = max(s.chunk, MAX_VERIFY)
        if len(ids) > limit:
            raise BatchError(f"{what}: {len(ids)} rows exceed the step limit of {limit} rows per item "
                             "(the session's prefill chunk; use prefill)")
        check_span(s.n_past, len(ids), s.max_context, None, what)
        cap = s.capture_layers if it.capture is None else check_capture(it.capture, s.n_layers)
        works.append(StepWork(s, ids, _check_rows(it.logits, len(ids), what), cap))
    return works


class _BatchKv:
    """The KV strategy for concatenated rows: each item's slice attends over, then appends to,
    its own session's planes (the per-session strategies below)."""

    def __init__(self, parts: list, bounds: list[tuple[int, int]]):
        self.parts, self.bounds = parts, bounds

    def attend(self, il: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        outs = [p.attend(il, q[a:b], k[a:b].contiguous(), v[a:b].contiguous())
                for p, (a, b) in zip(self.parts, self.bounds)]
        return torch.cat(outs, 0)  # [N, H, D]


def _graph_mode(w: StepWork) -> str | None:
    """The graph output ('last' | 'all') serving this item, or None (eager)."""
    if isinstance(w.rows, str):
        mode = w.rows
    elif np.array_equal(w.rows, np.arange(w.T)):
        mode = "all"
    elif w.rows.tolist() == [w.T - 1]:
        mode = "last"
    else:
        return None
    return mode if w.session._graph_ok(w.T, mode, w.capture) else None


def run_rows(engine, works: list[StepWork]) -> list[tuple[torch.Tensor | None, dict[int, np.ndarray]]]:
    """One forward over the items' rows (no validation, no transaction: see `step`). Per item:
    device logits f32 [R, vocab] of its requested rows (or None) and its captured inputs.
    On CUDA a batch whose every item fits a graph (<= 16 rows, 'last' or 'all', its session's
    capture layers) replays the graph of its shape; otherwise the step runs eagerly."""
    from .session import _EagerKv

    modes = [_graph_mode(w) for w in works]
    if all(m is not None for m in modes):
        shape = tuple((w.T, m, w.session.graph_context) for w, m in zip(works, modes))
        capture = tuple(sorted(set().union(*[w.capture for w in works])))
        g = engine.graph(shape, capture)
        g.launch([w.session for w in works], [w.ids for w in works])
        if len(works) == 1:
            works[0].session._graphs[(works[0].T, modes[0])] = g
        cap = host_captures(g.captured)
        return [(lg, {il: cap[il][a:b] for il in w.capture})
                for w, lg, (a, b) in zip(works, g.split(g.logits), g.bounds)]
    dev = engine.device
    parts, bounds, sel = [], [], []
    o = 0
    for w in works:
        p0 = w.session.n_past
        parts.append(_EagerKv(w.session, p0, w.T))
        bounds.append((o, o + w.T))
        sel.append(w.row_indices() + o)
        o += w.T
    N = o
    ids = np.concatenate([w.ids for w in works])
    positions = np.concatenate([np.arange(w.session.n_past, w.session.n_past + w.T) for w in works])
    rows_all = np.concatenate(sel)
    if rows_all.size == 0:
        out_rows: str | torch.Tensor = "none"
    elif rows_all.size == N:
        out_rows = "all"
    elif len(works) == 1 and rows_all.tolist() == [N - 1]:
        out_rows = "last"
    else:
        out_rows = torch.from_numpy(rows_all).to(dev)
    kv = parts[0] if len(parts) == 1 else _BatchKv(parts, bounds)
    capture = tuple(sorted(set().union(*[w.capture for w in works])))
    captured: dict = {}
    with torch.inference_mode():
        logits = engine.forward.run(torch.from_numpy(ids).to(dev), torch.from_numpy(positions).to(dev), kv,
                                    out_rows, capture, captured)
    host = host_captures(captured)
    out = []
    r = 0
    for w, (a, b), s in zip(works, bounds, sel):
        lg = None if logits is None or s.size == 0 else logits[r:r + s.size]
        r += s.size
        out.append((lg, {il: host[il][a:b] for il in w.capture}))
    return out


def host_captures(captured: dict) -> dict[int, np.ndarray]:
    """Captured layer inputs {layer: device [T, hidden]} as host arrays, in one device-to-host copy
    (one sync a step, not one per layer: a speculative round captures 3 layers)."""
    if not captured:
        return {}
    keys = sorted(captured)
    H = captured[keys[0]].shape[-1]
    with torch.inference_mode():
        host = torch.cat([captured[il] for il in keys], 1).to("cpu").numpy()  # [T, n_cap*H]
    return {il: host[:, j * H:(j + 1) * H] for j, il in enumerate(keys)}


def host_rows(lg: torch.Tensor | None) -> np.ndarray | None:
    """Device logits as a float32 host array (graphs run on CUDA only, so a graph's reused
    buffer is always copied here; eager CPU logits are fresh tensors). From CUDA the copy lands
    in page-locked memory from torch's host cache: a fresh pageable buffer page-faults through
    the copy (16 verify rows, 12.9 MB, took 3.6 ms on the H200 machine's step profile); the
    array owns its block until it is dropped, so a caller may keep it."""
    if lg is None:
        return None
    if lg.device.type != "cuda":
        return lg.to("cpu", torch.float32).numpy()
    out = torch.empty(lg.shape, dtype=torch.float32, pin_memory=True)
    out.copy_(lg)  # synchronous: the step has finished when this returns
    return out.numpy()


def finite_flags(lgs: list[torch.Tensor | None]) -> torch.Tensor | None:
    """The finiteness of each item's logits that has any, reduced where they lie ([n] bool over the
    items whose logits are not None, in order; None when none has any). On CUDA this runs on the
    step's stream before the logits' copy to the host: read it after the copy, and the host scans
    only the items whose flag is false, to name the offending row (16 verify rows are 3.2 M logits,
    ~1 ms of numpy while the device waits). One item (a session's own forward): a view of its one
    reduction, no stacking launch."""
    red = [torch.isfinite(lg).all() for lg in lgs if lg is not None]
    if not red:
        return None
    return red[0].reshape(1) if len(red) == 1 else torch.stack(red)


def _check_finite(works: list[StepWork], lgs: list[np.ndarray | None], n0: list[int],
                  flags: torch.Tensor | None) -> None:
    """NonFiniteLogits for the first item whose logits hold a non-finite value, scanning on the
    host only the items whose flag (finite_flags over the same items' logits) is false."""
    known = iter(flags.tolist()) if flags is not None else None
    for i, (w, lg) in enumerate(zip(works, lgs)):
        if lg is None or (known is not None and next(known)):
            continue
        bad = first_non_finite(lg)
        if bad is not None:
            raise non_finite_error(lg, bad, i, int(w.row_indices()[bad[0]]), n0[i])


def step(engine, batch: Sequence[StepItem], device_rows: bool = False) -> list[StepResult]:
    """Advance every item's session by its tokens in one forward (see module doc). With
    `device_rows` on CUDA, each item's last row stays on the device (StepResult.row, a
    DeviceRow, its finiteness checked here in one readback for the batch) and logits is None."""
    works = validate(engine, batch)
    n0 = [w.session.n_past for w in works]
    keep = device_rows and engine.device.type == "cuda" and all(w.row_indices().size for w in works)

    def work() -> list[tuple[Any, dict[int, np.ndarray]]]:
        if not keep:
            out = run_rows(engine, works)
            with torch.inference_mode():
                flags = finite_flags([lg for lg, _ in out])  # before the copies (see finite_flags)
            res = [(host_rows(lg), cap) for lg, cap in out]
            _check_finite(works, [lg for lg, _ in res], n0, flags)
            return res
        from .rows import DeviceRow

        out = run_rows(engine, works)
        with torch.inference_mode():
            last = [lg[-1].clone() for lg, _ in out]  # [vocab] each, their own storage
            ok = finite_flags(last)
        assert ok is not None
        if not bool(ok.all()):  # the one readback of the batch; the rows name the offender
            _check_finite(works, [host_rows(lg) for lg, _ in out], n0, None)
        return [(DeviceRow(r, None), cap) for r, (_, cap) in zip(last, out)]

    res = transaction([w.session.cache for w in works], [w.T for w in works], work)
    out = []
    for w, (lg, cap) in zip(works, res):
        rows = w.row_indices()
        w.session.captured = cap
        if keep:
            w.session.logits = None  # the row stays on the device
            out.append(StepResult(None, tuple(int(x) for x in rows), cap, lg))
            continue
        w.session.logits = lg[-1].copy() if lg is not None and rows[-1] == w.T - 1 else None
        out.append(StepResult(lg, tuple(int(x) for x in rows), cap))
    return out
