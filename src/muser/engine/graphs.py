"""CUDA graphs for step shapes: the whole step, embedding -> softcapped logits, captured once
per batch shape and replayed (book 10.3: record the tape once, press play).

A shape is the tuple of per-item (rows, output rows 'last' | 'all', context bound) plus the
capture layers; a graph belongs to the engine, not to a session. Everything that changes from
step to step lives in device tensors the graph reads: token ids, positions, and per item each
plane's metadata (kernels/attention.plane_meta: origin_logical, origin_physical, len, capacity
before the append, and the addresses of its K and V storage), its first position, and the
ring/plane write slots reserved by muser.kv on the host. They travel in one pinned int64
buffer, one host->device copy per step; the only synchronisation is reading back the logits
(or, for greedy decode, the argmax and a finiteness flag). All intermediates come from the
graph's private pool: nothing is allocated on the hot path.

Since the plane storage is data, one capture serves every session of the engine whose context
fits the shape's bound (`graph_context`: max_context rounded up to a power of two, at least
GRAPH_CONTEXT_MIN; the bound sizes the attention grid and scratch, never the arithmetic), fresh
sessions, restored ones and swapped planes included. The first call of a shape runs the step
eagerly (its real result) and captures it; later calls replay. A prompt-shaped step (an item of
several rows with its last row out) is captured only on its second call, so a shape no warm-up
recorded does not put its capture inside a request's TTFT; muser.load's warm-up
(engine/warmup.py) records the prompt shapes of up to 16 rows for the bound of its sessions.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from ..errors import LaneError

from .kernels.attention import META_FIELDS, AttnScratch, attend_triton, kv_round, kv_store, plane_meta_of, split_count

# The smallest context bound of a graph: sessions of up to this many positions share one set of
# captures (the warm-up's, engine/warmup.py), whatever their own max_context.
GRAPH_CONTEXT_MIN = 4096
# The step is captured as consecutive graphs of layers sharing one pool, split at PART_LAYERS. A
# graph launch costs host time per node (~0.75 us a node on the H100 machine's host, ~22 nodes a
# layer at one row), and the GPU starts a graph only once its launch returns; the host also
# reserves each part's K/V slots before launching it. So the first part is short (the GPU starts
# soon after the host has the step's tokens) and each part's GPU time covers the host's work for
# the next: at one row a layer is ~0.14-0.17 ms of GPU time against ~0.035 ms of the host's
# reservation and launch, so each part may be up to ~4x the one before it. Two layers, then ten,
# then the rest: the split at six layers (one seam) left the last part's reservation and launch
# (~1.4 ms for 46 layers) longer than the first part's ~1.0 ms of GPU time.
PART_LAYERS: tuple[int, ...] = (2, 12)


def part_bounds(splits: tuple[int, ...], n_layers: int) -> list[tuple[int, int]]:
    """The layer ranges [a, b) of the step's graphs for split layers `splits` (increasing; those
    outside (0, n_layers) dropped): consecutive, covering 0..n_layers."""
    cuts = [0] + [b for b in splits if 0 < b < n_layers] + [n_layers]
    if any(b <= a for a, b in zip(cuts, cuts[1:])):
        raise ValueError(f"graph part splits {splits} are not increasing")
    return list(zip(cuts, cuts[1:]))


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic collector off for the duration of a capture, restored after. An engine
    and its step graphs form reference cycles, so a dropped engine's CUDA graphs are freed by
    whichever collection finds them; inside a capture that frees them with cudaGraphExecDestroy,
    which the stream's global capture mode refuses, and the capture in progress ends with
    cudaErrorStreamCaptureInvalidated (torch's `graph` no longer collects before capturing)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def graph_context(max_context: int, context_length: int) -> int:
    """The context bound of the graphs serving a session of `max_context` positions: its power of
    two, at least GRAPH_CONTEXT_MIN, at most the model's context length (so >= max_context)."""
    assert 0 < max_context <= context_length, f"max_context {max_context} outside (0, {context_length}]"
    return min(context_length, max(GRAPH_CONTEXT_MIN, 1 << (max_context - 1).bit_length()))


def plane_bound(geometry, context: int) -> int:
    """The largest capacity a plane of `geometry` has in a session of at most `context` positions
    (muser.kv's formula: rings hold min(context, window)): the attention grid's bound."""
    return min(context, geometry.window) if geometry.sliding else context


def plane_storage(session) -> np.ndarray:
    """int64 [L, 3]: each plane's (capacity, K address, V address) (plane_meta's last fields,
    checked there), computed once per set of planes: an install swaps the cache's planes tuple,
    and the next step recomputes it. The session keeps the tuple it was computed for."""
    planes = session.cache.planes
    got = session._graph_storage
    if got is None or got[0] is not planes:
        got = (planes, np.array([plane_meta_of(p)[3:] for p in planes], dtype=np.int64).reshape(-1, 3))
        session._graph_storage = got
    return got[1]


def _even(n: int) -> int:
    """n rounded up to an even count of int64s (a 16-byte boundary)."""
    return n + (n & 1)


class _GraphKv:
    """Per item: attend its rows over its session's planes with device metadata, then write
    its K/V into the reserved slots."""

    def __init__(self, g: "StepGraph"):
        self.g = g

    def attend(self, il: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        g = self.g
        outs = []
        for i, s in enumerate(g.sessions):
            a, b = g.bounds[i]
            geo = s.cache.planes[il].geometry  # the model's layer geometry: the same for every session
            # rounded like the store (llama.cpp reads the cache back), K and V in one launch
            kq, vq = kv_round(k[a:b], v[a:b], s.kv_torch)
            outs.append(attend_triton(q[a:b], kq, vq, geo.head_major, g.meta[i][il], g.pos0[i],
                                      geo.window if geo.sliding else 0, s.cfg.attn_scale, g.scratch[i],
                                      rows_bound=plane_bound(geo, g.shape[i][2]),
                                      f16_operands=s.fwd.f16_attention and s.kv_torch == torch.float16))
            kv_store(kq, vq, g.meta[i][il], g.widx[i][il], geo.head_major)  # after attending
        return outs[0] if len(outs) == 1 else torch.cat(outs, 0)  # [N, H, D]


class _StaticCapture(dict):
    """Copies captured layer inputs into static buffers inside the graph."""

    def __init__(self, bufs: dict[int, torch.Tensor]):
        super().__init__()
        self.bufs = bufs

    def __setitem__(self, il: int, h: torch.Tensor) -> None:
        self.bufs[il].copy_(h)


class StepGraph:
    """One batch shape: items ((T, 'last' | 'all', context bound), ...) and capture layers."""

    def __init__(self, engine, shape: tuple[tuple[int, str, int], ...], capture: tuple[int, ...]):
        cfg = engine.cfg
        dev = engine.device
        L = cfg.n_layers
        self.engine, self.shape, self.capture = engine, shape, capture
        Ts = [T for T, _, _ in shape]
        N = sum(Ts)
        self.N = N
        self.bounds = []
        o = 0
        for T in Ts:
            self.bounds.append((o, o + T))
            o += T
        # each item's metadata block starts on an even int64 (16 bytes): Triton specializes a
        # kernel on whether a pointer is 16-byte aligned, so an odd offset for the second item
        # of a batch compiled new attention kernels inside the first batched request
        M = META_FIELDS
        blocks = [_even(M * L + 1 + L * T) for T in Ts]
        n = _even(2 * N) + sum(blocks)
        self.cuda = dev.type == "cuda"  # elsewhere the same step runs without capture (tests)
        self.host = torch.zeros(n, dtype=torch.int64)
        if self.cuda:
            self.host = self.host.pin_memory()
        self.dev = torch.zeros(n, dtype=torch.int64, device=dev)
        o = 0
        self.tokens = self.dev[o:o + N]
        o += N
        self.positions = self.dev[o:o + N]
        o = _even(o + N)
        self.meta, self.pos0, self.widx = [], [], []
        self.blocks = []  # per item: (offset, length) of its metadata block in `host` / `dev`
        for T, size in zip(Ts, blocks):
            self.blocks.append((o, size))
            self.meta.append(self.dev[o:o + M * L].view(L, M))
            self.pos0.append(self.dev[o + M * L:o + M * L + 1])  # even offset + M L: aligned too
            self.widx.append(self.dev[o + M * L + 1:o + M * L + 1 + L * T].view(L, T))
            o += size
        # output rows: one item keeps the forward's 'last' / 'all' (llama.cpp inp_out_ids);
        # several items select their rows by a static index tensor
        rows = []
        for (T, mode, _), (a, b) in zip(shape, self.bounds):
            rows += list(range(a, b)) if mode == "all" else [b - 1]
        self.out_rows: str | torch.Tensor = shape[0][1] if len(shape) == 1 else \
            torch.tensor(rows, dtype=torch.int64, device=dev)
        self.item_rows = [(T if mode == "all" else 1) for T, mode, _ in shape]
        R = len(rows)
        self.logits = torch.empty((R, cfg.vocab), dtype=torch.float32, device=dev)
        self.top = torch.empty((R,), dtype=torch.int64, device=dev)
        self.finite = torch.empty((), dtype=torch.bool, device=dev)
        self.captured = {il: torch.empty((N, cfg.hidden), dtype=torch.float32, device=dev) for il in capture}
        # attention partials per item, sized for the largest capacities of its bound
        self.scratch = []
        for T, _, context in shape:
            W = cfg.sliding_window
            splits = max(split_count(T, min(context, W), W) if sl else split_count(T, context, 0)
                         for sl in cfg.swa_pattern)
            self.scratch.append(AttnScratch(T, cfg.n_heads, cfg.head_dim, splits, dev))
        self.sessions: list = []  # the items' sessions while a step runs eagerly or is captured
        self.p0: list[int] = []  # each item's first position, read once a step (`_prepare`)
        self.parts: tuple | None = None  # the step's CUDA graphs, in replay order, once captured
        self.part_layers: list[tuple[int, int]] = []  # each graph's layer range [a, b), set at capture
        self.calls = 0  # steps run, captured or not
        # prompt-shaped: some item has several rows and only its last row's logits out
        self.prompt_like = any(T > 1 and mode == "last" for T, mode, _ in shape)
        self.copied = torch.cuda.Event() if self.cuda else None
        self.captures = 0

    def _prepare(self, sessions: list, ids: list[np.ndarray], layers: range) -> None:
        """Reserve this step's rows in the planes of `layers` (host metadata, muser.kv) and upload.
        The range starting at layer 0 also checks every plane of every item (a refusal reserves
        nothing) and its bound, and writes the tokens and positions; a replayed step prepares each
        graph's layers and launches that graph before preparing the next (`launch`).
        Each upload copies the whole buffer (a few KB): a range's layers are final in it, the
        later layers' slots are rewritten by the later upload before any graph reads them."""
        L = self.engine.cfg.n_layers
        N = self.N
        h = self.host.numpy()
        if layers.start == 0:
            if self.copied is not None:
                self.copied.synchronize()  # the previous upload has left the pinned buffer
            # n_past reads every plane, which disagree between the two ranges' reservations
            self.p0 = [s.n_past for s in sessions]
            for (a, b), s, p0, (_, _, context) in zip(self.bounds, sessions, self.p0, self.shape):
                if s.max_context > context:  # its attention grid would not reach every key
                    raise LaneError(f"a session of max_context {s.max_context} in a step graph bound to "
                                    f"{context} positions")
                s.cache.check_batch_all(p0, b - a)
            for (a, b), t, p0 in zip(self.bounds, ids, self.p0):
                h[a:b] = t
                h[N + a:N + b] = np.arange(p0, p0 + b - a)
        lo, hi = layers.start, layers.stop
        for (a, b), (o, _), s, p0 in zip(self.bounds, self.blocks, sessions, self.p0):
            T = b - a
            planes = s.cache.planes[lo:hi]
            M = META_FIELDS
            blk = h[o + M * lo:o + M * hi].reshape(-1, M)  # a view: one assignment per column group
            blk[:, :3] = np.array([(p.origin_logical, p.origin_physical, p.len) for p in planes], dtype=np.int64)
            blk[:, 3:] = plane_storage(s)[lo:hi]
            h[o + M * L] = p0
            w = o + M * L + 1
            placements = s.cache.reserve_batch_all(p0, T, layers)
            assert all(pl.source_first == 0 and len(pl.physical) == T for pl in placements)
            h[w + lo * T:w + hi * T] = np.concatenate([pl.physical for pl in placements])
        self.dev.copy_(self.host, non_blocking=self.cuda)
        if self.copied is not None and hi == L:
            self.copied.record()

    def _step(self, layer_hook=None) -> None:
        cap = _StaticCapture(self.captured) if self.captured else None
        self.engine.forward.run(self.tokens, self.positions, _GraphKv(self), self.out_rows, self.capture, cap,
                                logits_out=self.logits, layer_hook=layer_hook)
        torch.argmax(self.logits, -1, out=self.top)  # first maximal index, like greedy's tie rule
        torch.all(torch.isfinite(self.logits), out=self.finite)

    def launch(self, sessions: list, ids: list[np.ndarray]) -> None:
        """Prepare inputs and run the step (replay; eager + capture on first use; a prompt-shaped
        step eagerly on its first use and captured on its second)."""
        L = self.engine.cfg.n_layers
        parts = self.parts
        self.calls += 1
        if parts is not None:
            # each graph's layers prepared, then the graph launched: the host's bookkeeping of the
            # later layers runs while the GPU runs the earlier ones (PART_LAYERS)
            for (a, b), g in zip(self.part_layers, parts):
                self._prepare(sessions, ids, range(a, b))
                g.replay()
            return
        self._prepare(sessions, ids, range(0, L))
        self.sessions = list(sessions)
        try:
            if not self.cuda or (self.prompt_like and self.calls == 1):
                # a prompt shape no warm-up recorded: eagerly, captured if it comes again (recording
                # it cost a 16-token prompt's TTFT 30-40 ms on the H200: bench/NOTES.md)
                with torch.inference_mode():
                    self._step()
                return
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), torch.inference_mode():
                self._step()  # the real step for this call (also compiles the kernels)
            torch.cuda.current_stream().wait_stream(side)
            self.parts = self._capture()
            self.captures += 1
        finally:
            self.sessions = []  # a graph holds no session: their storage is data (`_prepare`)

    def _capture(self) -> tuple:
        """The step recorded (not executed) as graphs of consecutive layers in one pool, replayed
        in capture order (PART_LAYERS; the ranges kept in `part_layers`)."""
        pool = torch.cuda.graph_pool_handle()
        bounds = part_bounds(PART_LAYERS, self.engine.cfg.n_layers)
        splits = {a for a, _ in bounds[1:]}
        parts = [torch.cuda.CUDAGraph()]
        ctx = [torch.cuda.graph(parts[0], pool=pool)]

        def hook(il: int) -> None:  # at the top of layer il, inside forward.run
            if il in splits:
                ctx[0].__exit__(None, None, None)
                parts.append(torch.cuda.CUDAGraph())
                ctx[0] = torch.cuda.graph(parts[-1], pool=pool)
                ctx[0].__enter__()

        with collector_paused():
            ctx[0].__enter__()
            try:
                with torch.inference_mode():
                    self._step(hook)
            except BaseException:
                ctx[0].__exit__(None, None, None)
                raise
            ctx[0].__exit__(None, None, None)
        self.part_layers = bounds
        return tuple(parts)

    def run(self, sessions: list, ids: list[np.ndarray]) -> torch.Tensor:
        """Logits f32 [R, vocab] of every item's output rows, items in order."""
        self.launch(sessions, ids)
        return self.logits

    def split(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Per-item views of a [R, ...] output (logits, top)."""
        out, r = [], 0
        for n in self.item_rows:
            out.append(t[r:r + n])
            r += n
        return out
