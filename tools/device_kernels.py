#!/usr/bin/env python3
"""Dequant-matvec kernels on the full geometry: v1 (kernels/qmatvec.py), v2
(kernels/qmatvec_v2.py) and v3 (kernels/qmatvec_v3.py, K-quants in their packed layout) checked
against each other and the torch reference, timed at 1 and 16 rows, with the device-to-device
copy bandwidth of the same run beside them.

    python3 tools/device_kernels.py --out DIR [--budget 90] [--device cuda|cpu] [--smoke] [--no-sweep]

For every weight shape/format of the full geometry (Muse Glimmer, Figure 6.6 mix: Q4_K bulk,
Q6_K attn_v/ffn_down of even layers, Q5_K LM head; Q8_0 and F16 at the attn_q shape as well),
random valid quantized weights are built on the device directly as QWeight fields (random
quant bytes, positive finite f16 d/dmin, 6-bit scales/mins). Per case: v2 decoder bit-exact vs
the torch decoder (first rows), v1 and v2 vs the float64 dot of the torch-decoded weight on a
row subset (max error relative to sum |products|), v1 vs v2, then CUDA-event timing (warm-up,
5 reps of N calls; mean and CV), in µs and GB/s (bytes of the weight fields / time). Small
weights are rotated over enough copies that the L2 cannot hold them (decode streams from HBM).
A config sweep of v3 follows (its kernels compiled first in parallel worker processes), and
its winners per (format, shape, rows) are written to DIR/v3_tuning.json, the file
kernels/qmatvec_v3.load_tuning reads (MUSER_V3_TUNING). Every case is in its own try/except.

Output: DIR/device_kernels.json and a table on stdout. --device cpu --smoke runs tiny shapes
under the Triton interpreter (TRITON_INTERPRET=1), as tests/engine does.

    python3 tools/device_kernels.py --attn-invariance [--out DIR] [--device cuda|cpu] [--smoke]

checks the row invariance of decode attention (kernels/attention.attend_triton; DESIGN.md
"Exactness contract") with the full geometry's heads (32 query heads, 2 KV heads, head_dim 128):
per layer kind (sliding: a token-major ring of the window; full: a head-major plane), KV dtype
and depth (0, 4,096, 32,768 plane rows before a block of 16), every row of the block against the
same row decoded alone with everything before it in the plane, bitwise, plus the largest
difference from attend_ref; then times one decode attention call (T = 1, grid sized for the
capacity as in a captured step, inside a CUDA graph, rotating plane copies past the L2) at depth
0 and 32,768. Prints one JSON line (also DIR/attn_invariance.json with --out).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

# Full geometry (src/muser/model/synth.py FULL_GEOMETRY): hidden, attn_dim = heads * head_dim,
# kv_dim = kv_heads * head_dim, ffn, vocab.
H, A, KV, FF, V, N_LAYERS = 6656, 32 * 128, 2 * 128, 19968, 202048, 52

# (name, format, n_out, n_in, matrices of this kind per token, plan): "unstacked" = one launch
# per projection (v1/v2 in the engine), "stacked" = the engine's v3 launches (q|k|v|gate of the
# odd layers, q|k|gate + v of the even ones, gate|up), "both" = the same in either plan.
# Most important first (the budget may cut the tail).
QKVG, QKG = 2 * A + 2 * KV, 2 * A + KV
CASES = [
    ("ffn_gate|up", "Q4_K", 2 * FF, H, N_LAYERS, "stacked"),
    ("ffn_down.q6", "Q6_K", H, FF, N_LAYERS // 2, "both"),
    ("output", "Q5_K", V, H, 1, "both"),
    ("attn_qkvg", "Q4_K", QKVG, H, N_LAYERS // 2, "stacked"),
    ("attn_qkg", "Q4_K", QKG, H, N_LAYERS // 2, "stacked"),
    ("attn_output", "Q4_K", H, A, N_LAYERS, "both"),
    ("ffn_down.q4", "Q4_K", H, FF, N_LAYERS // 2, "both"),
    ("attn_v.q6", "Q6_K", KV, H, N_LAYERS // 2, "both"),
    ("ffn_gate+up", "Q4_K", FF, H, 2 * N_LAYERS, "unstacked"),
    ("attn_q+gate", "Q4_K", A, H, 2 * N_LAYERS, "unstacked"),
    ("attn_k", "Q4_K", KV, H, N_LAYERS, "unstacked"),
    ("attn_v.q4", "Q4_K", KV, H, N_LAYERS // 2, "unstacked"),
    ("q8_0@attn_q", "Q8_0", A, H, 0, "both"),
    ("f16@attn_q", "F16", A, H, 0, "both"),
]
SMOKE_SHAPES = {FF: 19, H: 11, V: 37, A: 13, KV: 5, 2 * FF: 21, QKVG: 23, QKG: 17}  # n_out in --smoke; n_in becomes 256
SMOKE_CASES = ("ffn_gate|up", "ffn_down.q6", "output", "q8_0@attn_q", "f16@attn_q")  # every format once

# v2 configs tried beyond the defaults: (BLOCK_N, SB, num_warps, ACC_FMA), fma_decode
SWEEP = {
    1: [((4, 2, 4, False), False), ((16, 2, 8, False), False), ((8, 4, 4, False), False),
        ((8, 2, 4, False), True), ((4, 1, 4, True), False), ((2, 2, 4, True), False), ((16, 1, 4, False), False)],
    16: [((4, 1, 8, True), False), ((1, 1, 4, True), False), ((2, 1, 4, False), False),
         ((4, 1, 4, False), False), ((2, 1, 4, True), True), ((1, 2, 4, True), False)],
}
SWEEP_CASES = ("ffn_gate|up", "ffn_down.q6", "output")

# v3 configs swept: (BN, J, num_warps, PREFETCH); one-row tiles need BN % num_warps == 0
V3_SWEEP = {
    1: [(bn, j, nw, pf) for bn in (4, 8, 16, 32) for j in (16, 32, 64) for nw in (4, 8) for pf in (True, False)
        if bn % nw == 0],
    16: [(bn, j, 4, False) for bn in (2, 4, 8) for j in (8, 16, 32)] + [(4, 16, 8, False), (8, 16, 8, False)],
}
V3_SWEEP_CASES = ("ffn_gate|up", "ffn_down.q6", "output", "attn_qkvg", "attn_qkg", "attn_output", "ffn_down.q4",
                  "attn_v.q6")


class Ctx:
    def __init__(self, args):
        import torch

        self.torch = torch
        self.dev = args.device
        self.smoke = args.smoke
        self.t0 = time.time()
        self.budget = args.budget
        self.gen = torch.Generator(self.dev).manual_seed(1234)
        self.graph = getattr(args, "graph", False)

    def left(self) -> float:
        return self.budget - (time.time() - self.t0)

    def sync(self) -> None:
        if self.dev == "cuda":
            self.torch.cuda.synchronize()


def make_weight(ctx: Ctx, fmt_name: str, n_out: int, n_in: int, name: str = "w"):
    """Random valid QWeight built on the device field by field (layout of engine/weights.py)."""
    torch = ctx.torch
    from muser.engine.weights import QWeight
    from muser.gguf.types import GgmlType as G

    fmt = G[fmt_name]
    dev, g = ctx.dev, ctx.gen
    nb = n_in // 256

    def u8(*shape, hi=256):
        return torch.randint(0, hi, shape, dtype=torch.uint8, device=dev, generator=g)

    def i8(*shape):
        return torch.randint(-128, 128, shape, dtype=torch.int16, device=dev, generator=g).to(torch.int8)

    def f16(*shape, lo=1e-3, hi=4e-3):  # positive finite scales
        return (torch.rand(shape, device=dev, generator=g) * (hi - lo) + lo).to(torch.float16)

    if fmt == G.Q4_K or fmt == G.Q5_K:
        f = {"qs": u8(n_out, nb * 128), "d": f16(n_out, nb), "dmin": f16(n_out, nb),
             "sc": u8(n_out, nb * 8, hi=64), "m": u8(n_out, nb * 8, hi=64)}
        if fmt == G.Q5_K:
            f["qh"] = u8(n_out, nb * 32)
    elif fmt == G.Q6_K:
        f = {"ql": u8(n_out, nb * 128), "qh": u8(n_out, nb * 64), "sc": i8(n_out, nb * 16), "d": f16(n_out, nb)}
    elif fmt == G.Q8_0:
        f = {"qs": i8(n_out, n_in), "d": f16(n_out, n_in // 32)}
    elif fmt == G.F16:
        f = {"w": (torch.randn(n_out, n_in, device=dev, generator=g) * 0.02).to(torch.float16)}
    else:
        raise ValueError(fmt_name)
    return QWeight(name, fmt, n_out, n_in, f)


def sub_rows(w, r: int):
    """The first r rows of a QWeight (row-major fields: contiguous views)."""
    from muser.engine.weights import QWeight

    return QWeight(w.name, w.fmt, r, w.n_in, {k: v[:r] for k, v in w.fields.items()})


def check(ctx: Ctx, w, v1, v2, v3=None, p3=None) -> dict:
    torch = ctx.torch
    r = {}
    head = sub_rows(w, min(w.n_out, 64 if ctx.smoke else 512))
    ref_dq = head.decode().view(torch.int32)
    r["v2_decode_bitexact"] = bool(torch.equal(v2.dequant_v2(head).view(torch.int32), ref_dq))
    if w.fmt.name in ("Q4_K", "Q5_K"):
        r["v2_fma_decode_bitexact"] = bool(torch.equal(v2.dequant_v2(head, fma_decode=True).view(torch.int32), ref_dq))
    if p3 is not None:
        r["v3_decode_bitexact"] = bool(torch.equal(v3.dequant_v3(v3.Packed(w.name, w.fmt, head.n_out, w.n_in, {
            k: t[:head.n_out] for k, t in p3.fields.items()})).view(torch.int32), ref_dq))
    n_sub = min(w.n_out, 4096)
    rows = torch.randperm(w.n_out, device=ctx.dev, generator=ctx.gen)[:n_sub]
    rows[0] = w.n_out - 1
    dq = w.decode(rows).double()  # [n_sub, n_in]
    for T in (1, 16):
        x = torch.randn(T, w.n_in, device=ctx.dev, generator=ctx.gen)
        y1 = v1.matvec_triton(w, x)
        y2 = v2.matvec_v2(w, x)
        y2f = v2.matvec_v2(w, x, fma_decode=True)
        exact = x.double() @ dq.T
        scale = x.abs().double() @ dq.abs().T + 1e-300
        rel = {}
        ys = [("v1", y1), ("v2", y2), ("v2_fma_decode", y2f)]
        if p3 is not None:
            ys.append(("v3", v3.matvec_v3(p3, x)))
        for nm, y in ys:
            rel[nm] = float(((y[:, rows].double() - exact).abs() / scale).max())
        rel["v1_vs_v2_max_abs_over_max"] = float((y1 - y2).abs().max() / y1.abs().max().clamp_min(1e-30))
        r[f"T{T}"] = rel
    r["ok"] = bool(r["v2_decode_bitexact"] and r.get("v2_fma_decode_bitexact", True) and r.get("v3_decode_bitexact", True)
                   and all(max(v for k, v in r[f"T{T}"].items() if k != "v1_vs_v2_max_abs_over_max") < 1e-5
                           for T in (1, 16)))
    return r


def timeit(ctx: Ctx, fn, n_copies: int) -> dict:
    """warm-up, then 5 reps of `iters` calls (rotating weight copies); per-call seconds."""
    torch = ctx.torch
    fn(0)
    ctx.sync()
    if ctx.dev == "cuda" and ctx.graph:
        # device time without host launch cost: `iters` calls captured in one CUDA graph
        iters = max(n_copies, 16)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(iters):
                fn(i)
        g.replay()
        ctx.sync()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        samples = []
        for _ in range(5):
            e0.record()
            g.replay()
            e1.record()
            e1.synchronize()
            samples.append(e0.elapsed_time(e1) / 1e3 / iters)
        del g
    elif ctx.dev == "cuda":
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for i in range(3):
            fn(i)
        e1.record()
        e1.synchronize()
        est = e0.elapsed_time(e1) / 3e3
        iters = int(min(500, max(3, n_copies, 3e-3 / max(est, 1e-7))))
        for i in range(iters):  # warm-up at the measured size
            fn(i)
        samples = []
        for _ in range(5):
            e0.record()
            for i in range(iters):
                fn(i)
            e1.record()
            e1.synchronize()
            samples.append(e0.elapsed_time(e1) / 1e3 / iters)
    else:
        iters = 1
        samples = []
        for _ in range(1 if ctx.smoke else 5):
            t = time.perf_counter()
            fn(0)
            samples.append(time.perf_counter() - t)
    mean = sum(samples) / len(samples)
    sd = math.sqrt(sum((s - mean) ** 2 for s in samples) / max(1, len(samples) - 1))
    return {"mean_s": mean, "cv": sd / mean if mean > 0 else 0.0, "iters": iters, "samples_s": samples}


def time_case(ctx: Ctx, ws, T: int, kind: str, v1, v2, config=None, fma_decode=False) -> dict:
    torch = ctx.torch
    x = torch.randn(T, ws[0].n_in, device=ctx.dev, generator=ctx.gen)
    out = torch.empty(T, ws[0].n_out, device=ctx.dev)
    if kind == "v1":
        def fn(i):
            v1.matvec_triton(ws[i % len(ws)], x, out)
    elif kind == "v3":
        def fn(i):
            ctx.v3.matvec_v3(ws[i % len(ws)].packed, x, out, config=config)
    else:
        def fn(i):
            v2.matvec_v2(ws[i % len(ws)], x, out, config=config, fma_decode=fma_decode)
    t = timeit(ctx, fn, len(ws))
    t["us"] = t["mean_s"] * 1e6
    nb = ws[0].packed.nbytes if kind == "v3" else sum(v.numel() * v.element_size() for v in ws[0].fields.values())
    t["bytes"] = nb
    t["GBps"] = nb / t["mean_s"] / 1e9
    return t


KINDS = ("v1", "v2", "v3")


def _compile_one(job) -> str:
    """Worker: compile (not run) one v3 kernel variant on a small weight whose specialization
    (alignment, divisibility by 16) matches the full-geometry launches; fills Triton's cache."""
    fmt_name, rows, cfg = job
    import torch

    sys.path.insert(0, str(REPO / "src"))
    from muser.engine.kernels import qmatvec_v3 as v3
    from muser.engine.weights import random_bytes, repack
    from muser.gguf.types import GgmlType as G

    fmt = G[fmt_name]
    n_out, n_in = 64, 6656
    w = repack("t", fmt, n_out, n_in, torch.from_numpy(random_bytes(fmt, n_out, n_in, 1)).cuda())
    p = v3.pack(w)
    x = torch.zeros(rows, n_in, device="cuda")
    try:
        v3.matvec_v3(p, x, config=cfg)
        torch.cuda.synchronize()
        return "ok"
    except Exception as e:  # reported by the sweep itself when it runs the config
        return f"{type(e).__name__}: {e}"[:200]


def precompile_v3(jobs: int) -> dict:
    import concurrent.futures as cf
    import multiprocessing as mp

    work = [(f, T, c) for f in ("Q4_K", "Q5_K", "Q6_K") for T, cs in V3_SWEEP.items() for c in cs]
    with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn")) as ex:
        got = list(ex.map(_compile_one, work))
    return {"variants": len(work), "failed": [f"{w}: {g}" for w, g in zip(work, got) if g != "ok"][:20]}


def sweep_v3(ctx: Ctx, res: dict, name: str, ws, v1, v2, flush) -> None:
    """Time every V3_SWEEP config on this case; record the best per row count on the case."""
    torch = ctx.torch
    c = next(cc for cc in res["cases"] if cc["name"] == name)
    for T, cfgs in V3_SWEEP.items():
        best = None
        x = torch.randn(T, ws[0].n_in, device=ctx.dev, generator=ctx.gen)
        ref = ctx.v3.matvec_v3(ws[0].packed, x)
        for cfg in (cfgs[:2] if ctx.smoke else cfgs):
            s = {"name": name, "fmt": ws[0].fmt.name, "T": T, "config": list(cfg)}
            res["v3_sweep"].append(s)
            if ctx.left() < 3:
                s["skipped"] = "budget"
                continue
            try:
                got = ctx.v3.matvec_v3(ws[0].packed, x, config=cfg)
                s["max_abs_vs_default_over_max"] = float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
                s.update(time_case(ctx, ws, T, "v3", v1, v2, config=cfg))
                s.pop("samples_s", None)
                if s["max_abs_vs_default_over_max"] < 1e-5 and (best is None or s["mean_s"] < best["mean_s"]):
                    best = s
            except Exception as e:
                s["error"] = repr(e)[:300]
        if best is not None:
            c[f"v3best_T{T}"] = {k: best[k] for k in ("config", "us", "GBps", "cv", "mean_s", "bytes")}
        flush()


def copy_bandwidth(ctx: Ctx) -> dict:
    torch = ctx.torch
    n = (8 << 20) if ctx.smoke else (1 << 30)
    a = torch.empty(n, dtype=torch.uint8, device=ctx.dev)
    b = torch.empty_like(a)
    t = timeit(ctx, lambda i: b.copy_(a), 1)
    del a, b
    return {"bytes": n, "GBps_read_plus_write": 2 * n / t["mean_s"] / 1e9, "GBps_read_only": n / t["mean_s"] / 1e9,
            "cv": t["cv"], "samples_s": t["samples_s"]}


def attn_invariance(ctx: Ctx) -> dict:
    """Decode alone vs row j of a 16-row block, bitwise, and decode attention timing (see the
    module docstring)."""
    torch = ctx.torch
    from muser.engine.kernels import attention as att
    from muser.model.config import COLLAR
    from muser.model.synth import FULL_GEOMETRY as FG

    dev = ctx.dev
    if ctx.smoke:  # interpreter-sized
        H, n_kv, D, W, depths, timed, cap_full = 4, 2, 16, 80, (0, 40, 300), (0, 300), 512
    else:
        H, n_kv, D, W = FG.n_heads, FG.n_kv_heads, FG.head_dim, FG.sliding_window
        depths, timed, cap_full = (0, 4096, 32768), (0, 32768), 32768 + 64
    T, scale = 16, 1.0 / math.sqrt(D)
    res: dict = {"mode": "attn-invariance", "device": dev, "heads": [H, n_kv, D], "window": W,
                 "split_sliding": att.SPLIT_SLIDING, "split_full": att.SPLIT_FULL, "block": att.BLOCK,
                 "reduce_chunk": att.REDUCE_CHUNK, "cases": [], "timing_us": {}}
    g = ctx.gen

    def planes(kind: str, dt, n: int):
        """History of n positions; the plane layout of the layer kind."""
        hm, cap, win = (True, cap_full, 0) if kind == "full" else (False, W, W)
        k = torch.randn(n, n_kv, D, device=dev, generator=g).to(dt)
        v = torch.randn(n, n_kv, D, device=dev, generator=g).to(dt)
        return hm, cap, win, k, v

    def fill(hm: bool, cap: int, k, v, p0: int):
        """A plane as muser.kv leaves it before position p0: [ol, p0) at slot pos % cap."""
        ol = max(0, p0 - cap)
        shape = (n_kv, cap, D) if hm else (cap, n_kv * D)
        kp = torch.zeros(shape, dtype=k.dtype, device=dev)
        vp = torch.zeros_like(kp)
        if p0 > ol:
            slots = torch.arange(ol, p0, device=dev) % cap
            if hm:
                kp[:, slots] = k[ol:p0].transpose(0, 1)
                vp[:, slots] = v[ol:p0].transpose(0, 1)
            else:
                kp[slots] = k[ol:p0].reshape(p0 - ol, -1)
                vp[slots] = v[ol:p0].reshape(p0 - ol, -1)
        meta = torch.tensor([ol, ol % cap, p0 - ol, cap], dtype=torch.int64, device=dev)
        return kp, vp, meta

    def call(q, k, v, hm, cap, win, p0, rows, kp, vp, meta, sc, out=None):
        pos = torch.tensor([p0], dtype=torch.int64, device=dev)
        return att.attend_triton(q, k[p0:p0 + rows].contiguous(), v[p0:p0 + rows].contiguous(), kp, vp, hm,
                                 meta, pos, win, scale, sc, out=out)

    ok = True
    for kind in ("sliding", "full"):
        for dt in (torch.float16, torch.float32):
            for depth in depths:
                c: dict = {"kind": kind, "kv": str(dt).replace("torch.", ""), "depth": depth}
                res["cases"].append(c)
                if ctx.left() < 5:
                    c["skipped"] = "budget"
                    continue
                try:
                    hm, cap, win, k, v = planes(kind, dt, depth + T)
                    q = torch.randn(depth + T, H, D, device=dev, generator=g)
                    sc = att.AttnScratch(T, H, D, att.split_count(T, cap, win), dev)
                    kp, vp, meta = fill(hm, cap, k, v, depth)
                    blk = call(q[depth:depth + T], k, v, hm, cap, win, depth, T, kp, vp, meta, sc)
                    ol = int(meta[0])
                    ref = att.attend_ref(q[depth:depth + T], k[depth:depth + T], v[depth:depth + T], kp, vp, hm, ol,
                                         int(meta[1]), depth - ol, cap, depth, win, scale)
                    c["max_abs_vs_ref"] = float((blk - ref).abs().max())
                    same = 0
                    for j in range(T):
                        kp, vp, meta = fill(hm, cap, k, v, depth + j)
                        alone = call(q[depth + j:depth + j + 1], k, v, hm, cap, win, depth + j, 1, kp, vp, meta, sc)
                        same += bool(torch.equal(alone[0].view(torch.int32), blk[j].view(torch.int32)))
                    c["rows_bitwise_equal"] = f"{same}/{T}"
                    c["ok"] = same == T and c["max_abs_vs_ref"] < 1e-4
                    ok &= c["ok"]
                    del k, v, kp, vp, q
                except Exception as e:
                    c["error"] = repr(e)[:300]
                    c["traceback"] = traceback.format_exc()[-2000:]
                    ok = False
    res["invariance"] = "pass" if ok else "fail"
    # decode attention at depth 0 vs 32,768, T = 1, grid sized for the capacity (a captured step)
    l2_avoid = 0 if ctx.smoke else 256 << 20
    per_step = {}
    for kind in ("sliding", "full"):
        for depth in timed:
            key = f"{kind}_d{depth}"
            try:
                hm, cap, win, k, v = planes(kind, torch.float16, depth + 1)
                kv_bytes = 2 * k[:depth].numel() * k.element_size()  # K and V rows a call reads
                n_copies = 1 if depth == 0 else max(1, min(16, -(-l2_avoid // kv_bytes)))
                pl = [fill(hm, cap, k, v, depth) for _ in range(n_copies)]
                sc = att.AttnScratch(1, H, D, att.split_count(1, cap, win), dev)
                q = torch.randn(1, H, D, device=dev, generator=g)
                kn, vn = k[depth:depth + 1].contiguous(), v[depth:depth + 1].contiguous()
                pos = torch.tensor([depth], dtype=torch.int64, device=dev)
                o = torch.empty(1, H, D, device=dev)

                def fn(i, pl=pl, sc=sc, q=q, kn=kn, vn=vn, pos=pos, o=o, hm=hm, win=win):
                    kp, vp, meta = pl[i % len(pl)]
                    att.attend_triton(q, kn, vn, kp, vp, hm, meta, pos, win, scale, sc, out=o)

                t = timeit(ctx, fn, n_copies)
                res["timing_us"][key] = {"us": t["mean_s"] * 1e6, "cv": t["cv"], "copies": n_copies,
                                         "cuda_graph": ctx.graph}
                del pl, k, v
            except Exception as e:
                res["timing_us"][key] = {"error": repr(e)[:300]}
    n_full = FG.n_layers // COLLAR  # one full layer per collar of the full geometry
    n_layers = {"sliding": FG.n_layers - n_full, "full": n_full}
    for depth in timed:
        ts = [res["timing_us"].get(f"{kd}_d{depth}", {}).get("us") for kd in ("sliding", "full")]
        if None not in ts:
            per_step[f"d{depth}"] = {"layers": n_layers, "ms": (ts[0] * n_layers["sliding"]
                                                                 + ts[1] * n_layers["full"]) / 1e3}
    res["attention_per_decode_step"] = per_step
    res["wall_s"] = time.time() - ctx.t0
    return res


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="output folder (required unless --attn-invariance)")
    ap.add_argument("--budget", type=float, default=90.0)
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter check)")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--graph", action="store_true", help="time each kernel inside a CUDA graph (no host launch cost)")
    ap.add_argument("--kinds", default="v1,v2,v3", help="kernels timed")
    ap.add_argument("--gate-receipt", default=None, help="Gate 2 receipt of this tree on this machine")
    ap.add_argument("--v2-sweep", action="store_true", help="also sweep v2 configs")
    ap.add_argument("--jobs", type=int, default=12, help="worker processes compiling the v3 sweep")
    ap.add_argument("--attn-invariance", action="store_true",
                    help="only the attention row-invariance check and decode attention timing")
    args = ap.parse_args(argv)
    if args.out is None and not args.attn_invariance:
        ap.error("--out is required")
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import
    switch = os.environ.pop("MUSER_MATVEC", None)  # "v1" below must be the v1 kernel
    from muser.engine.kernels.interpreter import index_compat

    index_compat()
    import torch

    from muser.engine.kernels import qmatvec as v1
    from muser.engine.kernels import qmatvec_v2 as v2
    from muser.engine.kernels import qmatvec_v3 as v3

    ctx = Ctx(args)
    ctx.v3 = v3
    if args.attn_invariance:
        ctx.graph = args.device == "cuda"  # the engine replays its steps as CUDA graphs
        r = attn_invariance(ctx)
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "attn_invariance.json").write_text(json.dumps(r, indent=1) + "\n")
        print(json.dumps(r, default=str), flush=True)
        return r
    if args.device == "cuda" and not args.no_sweep and not args.smoke:
        t = time.time()
        ctx.precompiled = precompile_v3(args.jobs)
        print(f"[{time.time() - ctx.t0:6.1f}s] v3 sweep kernels compiled in {time.time() - t:.0f} s "
              f"({ctx.precompiled})", flush=True)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    res: dict = {"started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "argv": sys.argv if argv is None
                 else list(argv), "device": args.device, "smoke": args.smoke, "budget_s": args.budget,
                 "MUSER_MATVEC_unset_for_run": switch, "timing": "cuda graph" if args.graph else "host loop",
                 "v2_configs": {str(k): v for k, v in v2.CONFIGS.items()},
                 "v3_configs": {str(k): v for k, v in v3.CONFIGS.items()}, "cases": [], "sweep": [], "v3_sweep": []}
    try:
        import triton

        res["triton"] = triton.__version__
    except ImportError as e:
        res["triton"] = f"missing: {e}"
    res["torch"] = torch.__version__
    if args.device == "cuda":
        p = torch.cuda.get_device_properties(0)
        res["gpu"] = {"name": p.name, "sms": p.multi_processor_count, "mem_gib": round(p.total_memory / 2**30, 1)}
    rows_out: list[str] = []

    def flush():
        (out_dir / "device_kernels.json").write_text(json.dumps(res, indent=1, default=str))

    try:
        res["copy"] = copy_bandwidth(ctx)
    except Exception as e:
        res["copy"] = {"error": repr(e), "traceback": traceback.format_exc()[-3000:]}
    flush()

    l2_avoid = 0 if ctx.smoke else 256 << 20  # rotate copies until this many bytes (> L2)
    weights: dict[str, list] = {}
    for name, fmt, n_out, n_in, per_tok, plan in CASES:
        if ctx.smoke:
            if name not in SMOKE_CASES:
                continue
            n_out, n_in = SMOKE_SHAPES[n_out], 256
        c: dict = {"name": name, "fmt": fmt, "n_out": n_out, "n_in": n_in, "per_token": per_tok, "plan": plan}
        res["cases"].append(c)
        if ctx.left() < 4:
            c["skipped"] = f"budget: {ctx.left():.0f} s left"
            continue
        t = time.time()
        try:
            w = make_weight(ctx, fmt, n_out, n_in, name)
            c["bytes"] = w.nbytes
            if v3.supports(w.fmt):
                w.packed = v3.pack(w)
            c["check"] = check(ctx, w, v1, v2, v3, w.packed)
            n_copies = max(1, min(128, -(-l2_avoid // w.nbytes)))
            ws = [w] + [make_weight(ctx, fmt, n_out, n_in, name) for _ in range(n_copies - 1)]
            if w.packed is not None:
                for wc in ws[1:]:
                    wc.packed = v3.pack(wc)
            c["copies"] = n_copies
            for T in (1, 16):
                for kind in args.kinds.split(","):
                    if kind == "v3" and w.packed is None:
                        continue
                    c[f"{kind}_T{T}"] = time_case(ctx, ws, T, kind, v1, v2)
            if not args.no_sweep and w.packed is not None and name in V3_SWEEP_CASES:
                sweep_v3(ctx, res, name, ws, v1, v2, flush)
            if name in SWEEP_CASES:
                weights[name] = ws
            else:
                del ws
        except Exception as e:
            c["error"] = repr(e)
            c["traceback"] = traceback.format_exc()[-3000:]
        c["wall_s"] = time.time() - t
        flush()
        print(f"[{time.time() - ctx.t0:6.1f}s] {name} {fmt} {n_out}x{n_in} done", flush=True)
        if ctx.dev == "cuda":
            torch.cuda.empty_cache()

    if not args.no_sweep and args.v2_sweep:
        for name in SWEEP_CASES[:1] if ctx.smoke else SWEEP_CASES:
            ws = weights.get(name)
            if ws is None:
                continue
            for T, cfgs in SWEEP.items():
                for cfg, fmad in (cfgs[:1] if ctx.smoke else cfgs):
                    s = {"name": name, "fmt": ws[0].fmt.name, "T": T, "config": list(cfg), "fma_decode": fmad}
                    res["sweep"].append(s)
                    if ctx.left() < 3:
                        s["skipped"] = "budget"
                        continue
                    try:
                        x = torch.randn(T, ws[0].n_in, device=ctx.dev, generator=ctx.gen)
                        ref = v2.matvec_v2(ws[0], x)
                        got = v2.matvec_v2(ws[0], x, config=cfg, fma_decode=fmad)
                        s["max_abs_vs_default_over_max"] = float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
                        s.update(time_case(ctx, ws, T, "v2", v1, v2, config=cfg, fma_decode=fmad))
                    except Exception as e:
                        s["error"] = repr(e)
                        s["traceback"] = traceback.format_exc()[-2000:]
                    flush()
        weights.clear()

    # per-token matvec time of the Figure 6.6 mix (sum of per-kind times x count), v1 vs v2
    tok: dict = {}
    for kind in KINDS + ("v3best",):
        for T in (1, 16):
            tot, byts, missing = 0.0, 0, []
            for c in res["cases"]:
                if not c["per_token"] or c["plan"] == ("unstacked" if kind.startswith("v3") else "stacked"):
                    continue
                t = c.get(f"{kind}_T{T}")
                if kind.startswith("v3") and t is None:  # formats v3 does not pack: the v2 kernel
                    t = c.get(f"v2_T{T}")
                if t is None:
                    missing.append(c["name"])
                    continue
                tot += c["per_token"] * t["mean_s"]
                byts += c["per_token"] * t.get("bytes", c["bytes"])
            tok[f"{kind}_T{T}"] = {"matvec_s_per_step": tot, "bytes": byts,
                                   "GBps": byts / tot / 1e9 if tot else None, "missing": missing}
    res["per_token"] = tok
    copy_gbps = res["copy"].get("GBps_read_plus_write")

    rows_out.append(f"copy bandwidth (read+write, {res['copy'].get('bytes', 0) / 2**30:.3f} GiB): "
                    f"{copy_gbps and round(copy_gbps, 1)} GB/s")
    cols = [f"{k}_T{T}" for T in (1, 16) for k in KINDS] + ["v3best_T1", "v3best_T16"]
    hdr = f"{'case':14s} {'fmt':5s} {'shape':>13s} {'MB':>7s} {'ok':>3s} " + " ".join(
        f"{k.replace('_', ' ') + ' us|GB/s':>17s}" for k in cols)
    rows_out.append(hdr)
    for c in res["cases"]:
        def cell(k):
            t = c.get(k)
            return f"{t['us']:9.1f}|{t['GBps']:7.0f}" if t else f"{'-':>17s}"
        ok = c.get("check", {}).get("ok")
        extra = f"  ERROR {c['error'][:60]}" if "error" in c else (f"  {c['skipped']}" if "skipped" in c else "")
        rows_out.append(f"{c['name']:14s} {c['fmt']:5s} {c['n_out']:>6d}x{c['n_in']:<6d} {c.get('bytes', 0) / 1e6:7.1f} "
                        f"{'y' if ok else 'N':>3s} " + " ".join(cell(k) for k in cols)
                        + extra)
    for s in res["sweep"]:
        if "us" in s:
            rows_out.append(f"sweep {s['name']:12s} T{s['T']:<2d} cfg {s['config']} fma_decode={s['fma_decode']}: "
                            f"{s['us']:9.1f} us {s['GBps']:7.0f} GB/s cv {s['cv']:.3f}")
        else:
            rows_out.append(f"sweep {s['name']:12s} T{s['T']:<2d} cfg {s['config']}: {s.get('error', s.get('skipped'))}")
    for s3 in res["v3_sweep"]:
        if "us" in s3:
            rows_out.append(f"v3 sweep {s3['name']:12s} T{s3['T']:<2d} cfg {s3['config']}: {s3['us']:9.1f} us "
                            f"{s3['GBps']:7.0f} GB/s cv {s3['cv']:.3f}")
    for k, t in tok.items():
        if t["matvec_s_per_step"]:
            rows_out.append(f"per step {k}: {t['matvec_s_per_step'] * 1e3:.3f} ms of matvec, {t['bytes'] / 1e9:.2f} GB, "
                            f"{t['GBps']:.0f} GB/s" + (f" (missing {t['missing']})" if t["missing"] else ""))
    res["table"] = rows_out
    res["wall_s"] = time.time() - ctx.t0
    tuning = [{"fmt": c["fmt"], "rows": T, "n_out": c["n_out"], "n_in": c["n_in"], "config": c[f"v3best_T{T}"]["config"],
               "us": c[f"v3best_T{T}"]["us"]} for c in res["cases"] for T in (1, 16) if f"v3best_T{T}" in c]
    (out_dir / "v3_tuning.json").write_text(json.dumps(tuning, indent=1) + "\n")
    # the run as a receipt (muser.bench.receipt), gated by a Gate 2 receipt of the same tree and
    # machine when one is named
    from muser.bench.receipt import device_description, write_receipt

    gate = {"status": "n/a", "what": "kernel comparisons only (see check per case)"}
    if args.gate_receipt:
        gr = json.loads(Path(args.gate_receipt).read_text())
        gate = {"status": "n/a", "gated_by": Path(args.gate_receipt).name, "gated_by_status": gr["gate"]["status"],
                "what": "Gate 2 of the same tree on the same machine"}
    res["receipt"] = str(write_receipt("kernels-graph-" + args.device if args.graph else "kernels-" + args.device,
                                       model={"what": "random valid quantized weights at the full geometry's shapes"},
                                       device=device_description(args.device), lane="exact", gate=gate,
                                       results={k: v for k, v in res.items() if k != "table"} | {"table": rows_out},
                                       out_dir=out_dir))
    flush()
    print("\n".join(rows_out))
    if switch is not None:
        os.environ["MUSER_MATVEC"] = switch
    return res


if __name__ == "__main__":
    main()
