#!/usr/bin/env python3
"""attend_triton on CUDA at the engine's attention shape (H 32, n_kv 2, D 128), per layer kind
(sliding ring of 2,048, head-major full plane) and depth, for both operand kinds (f32 operands:
the exact lane's exact-split tf32 dots; f16 operands: the fast lane's):

1. against attend_ref (max |diff|; share of elements within 4e-6);
2. row invariance: a row decoded alone == the same row inside a 16-row block, and the grid sized
   from the plane's length == sized from its capacity (graph calls), bitwise;
3. the time of one decode call and of one 16-row call (CUDA graphs of 20 calls, median), with
   the planes warm in L2 (every call over the same planes) and cold (`cold_*`: each call of the
   graph over its own copy of them, as a layer's call inside a step finds its keys and values in
   DRAM; a full layer's planes at 32,768 are 34 MB, which the H100's and H200's 50 MB L2 holds),
   and with f16 operands the grid sized as the bench's step graph sizes it (`graph_*`: the
   power-of-two context bound of a session of depth + 16 positions) and as a session opened at
   the model's context length has it (`ctx_*`, one row);
4. with --sweep, the f32-operand pass under each (keys per block, warps, pipeline stages): its
   invariance and its decode time, so the shipped choice is read off a table; with --sweep-f16,
   the f16-operand passes under each (rows per program, keys per block, warps, stages), the same way;
   with --sweep-splits, the f16-operand passes under each split length of the layer kind
   (SPLIT_SLIDING or SPLIT_FULL: how many partials a row's keys make, the merge's work);
5. with --before FILE, the same calls through another attention module (a copy of an earlier
   kernels/attention.py), timed beside the current one (warm and cold), both operand kinds, and
   whether both give the same bits (`before_eq_*`).

    PYTHONPATH=src python3 tools/device_attn.py [--depths 2048,32768] [--json PATH] [--sweep]
                                                [--sweep-f16] [--sweep-splits] [--before FILE]
    PYTHONPATH=src python3 tools/device_attn.py --smoke   # CPU, Triton interpreter, depth 40
"""
from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated

import time  # noqa: E402

import torch  # noqa: E402

from muser.engine.kernels import attention as att  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from device_kernels import graph_seconds  # noqa: E402

DEV = "cpu" if "--smoke" in sys.argv else "cuda"
if DEV == "cpu":
    from muser.engine.kernels.interpreter import interpreter_compat

    interpreter_compat()

H, N_KV, D = 32, 2, 128
CONTEXT_LENGTH = 131072  # the full geometry's (model/synth.py FULL_GEOMETRY)
SCALE = 0.0883883
# planes a cold timing cycles over: 20 x 34 MB (a full layer at 32,768) is 13 x the L2
COLD_COPIES = 2 if DEV == "cpu" else 20
SWEEP = [(bs, w, st) for bs in (32, 64, 128) for w in (4, 8) for st in (2, 3, 4)]
SWEEP_SPLITS = {"sliding": (32, 64, 128, 256, 512), "full": (128, 256, 512, 1024, 2048)}
# (rows a program, keys a block, warps, pipeline stages): the shipped group and block under each
# launch choice (the group and block were swept before: bench/NOTES.md)
SWEEP_F16 = [(4, 32, 4, 2), (4, 32, 4, 4)]


def _case(depth: int, sliding: bool, g: torch.Generator):
    cap = 2048 if sliding else depth + 64
    win = 2048 if sliding else 0
    shape = (cap, N_KV * D) if sliding else (N_KV, cap, D)
    kp = torch.randn(shape, generator=g).half().to(DEV)
    vp = torch.randn(shape, generator=g).half().to(DEV)
    return kp, vp, cap, win


def _run(mod, q, kn, vn, kp, vp, hm, ol, op, ln, cap, p0, win, f16, plane_len=True, bound=None):
    """A call of attend_triton; its grid sized from the plane's length (plane_len), its capacity,
    or `bound` (a step graph's: the capacity of the largest session the graph serves)."""
    T = q.shape[0]
    meta = torch.tensor(mod.plane_meta(kp, vp, hm, N_KV, D, ol, op, ln), dtype=torch.int64, device=DEV)
    pos = torch.tensor([p0], dtype=torch.int64, device=DEV)
    rows_bound = bound if bound is not None else ln if plane_len else cap
    sc = mod.AttnScratch(T, H, D, mod.split_count(T, max(cap, rows_bound), win), DEV)
    def call(planes=(kp, vp)):  # meta holds only the planes' addresses: the call keeps them alive
        return mod.attend_triton(q, kn, vn, hm, meta, pos, win, SCALE, sc, rows_bound=rows_bound, f16_operands=f16)
    return call


def _graph_bound(depth: int, cap: int, sliding: bool) -> int:
    """The attention grid's bound in the step graph of a session of depth + 16 positions (the
    bench's verify and decode sessions): engine/graphs.py's graph_context and plane_bound."""
    from types import SimpleNamespace

    from muser.engine.graphs import graph_context, plane_bound

    geo = SimpleNamespace(sliding=sliding, window=cap if sliding else 0)
    return max(cap, plane_bound(geo, graph_context(depth + 16, CONTEXT_LENGTH)))


def _run_cold(mod, q, kn, vn, kp, vp, *rest, copies: int):
    """As _run, each call over the next of `copies` copies of the planes (cycled), so the keys and
    values a call reads are not in the L2 the calls before it filled."""
    fns = itertools.cycle([_run(mod, q, kn, vn, kp.clone(), vp.clone(), *rest) for _ in range(copies)])
    return lambda: next(fns)()


def _time(fn, reps: int) -> float:
    """Median ms per call. On CUDA the call is captured in a graph of 20 calls and the graph is
    timed (GPU time, not the host's launch cost: an eager call of two small kernels is bounded by
    Python, not by the kernels)."""
    if DEV == "cpu":
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t) * 1e3)
        return sorted(ts)[len(ts) // 2]
    return 1e3 * sorted(graph_seconds(fn, 20, max(3, reps // 20)))[max(3, reps // 20) // 2]


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32)))


def _load(path: str):
    # a module of the kernels package (its relative imports: gdc), under a name of its own
    spec = importlib.util.spec_from_file_location("muser.engine.kernels.attention_before", path)
    assert spec is not None and spec.loader is not None, path
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depths", default="2048,32768")
    ap.add_argument("--json", default=None)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--sweep", action="store_true", help="time the f32-operand pass under each launch choice")
    ap.add_argument("--sweep-f16", action="store_true",
                    help="time the f16-operand passes under each (rows per program, keys per block, warps, "
                         "stages)")
    ap.add_argument("--sweep-splits", action="store_true",
                    help="time the f16-operand passes under each split length of the layer kind")
    ap.add_argument("--before", default=None, help="another attention module file, timed beside this one")
    ap.add_argument("--smoke", action="store_true", help="CPU under the Triton interpreter, depth 40, 1 rep")
    a = ap.parse_args(argv)
    if a.smoke:
        a.depths, a.reps = "40", 1
    before = _load(a.before) if a.before else None
    g = torch.Generator().manual_seed(0)
    rows, sweep, ok = [], [], True
    shipped = (att.BLOCK_EXACT, dict(att.PARTIAL_LAUNCH))
    shipped_f16 = (att.ROW_GROUP_F16, att.BLOCK, dict(att.F16_LAUNCH))
    shipped_splits = (att.SPLIT_SLIDING, att.SPLIT_FULL)
    for depth in (int(x) for x in a.depths.split(",")):
        for sliding in (True, False):
            kp, vp, cap, win = _case(depth, sliding, g)
            hm = not sliding
            p = depth  # the target row's position; the plane holds what precedes the call
            T = 16
            p0 = p - T + 1
            q = (torch.randn(T, H, D, generator=g) * 3).to(DEV)
            kn = torch.randn(T, N_KV, D, generator=g).half().to(DEV)
            vn = torch.randn(T, N_KV, D, generator=g).half().to(DEV)

            def plane(p0):  # (ol, op, ln) of a plane holding what precedes p0
                ol = max(0, p0 - cap) if sliding else 0
                return ol, (7 + ol) % cap if sliding else 0, p0 - ol  # position x at slot (7 + x) % cap

            # the plane's slots hold random data standing in for the positions before p0
            ol, op, ln = plane(p0)
            # row T-1 alone: its 15 predecessors now in the plane (their K/V are kn/vn rows)
            ol1, op1, ln1 = plane(p)
            kp1, vp1 = kp.clone(), vp.clone()
            for j in range(T - 1):
                s = (op1 + p0 + j - ol1) % cap
                if hm:
                    kp1[:, s], vp1[:, s] = kn[j], vn[j]
                else:
                    kp1[s], vp1[s] = kn[j].reshape(-1), vn[j].reshape(-1)
            block = (q, kn, vn, kp, vp, hm, ol, op, ln, cap, p0, win)
            one = (q[T - 1:], kn[T - 1:], vn[T - 1:], kp1, vp1, hm, ol1, op1, ln1, cap, p, win)
            r: dict = {"layer": "sliding" if sliding else "full", "depth": depth}

            def checks(f16: bool) -> dict:
                blk = _run(att, *block, f16)()
                ref = att.attend_ref(q, kn, vn, kp, vp, hm, ol, op, ln, cap, p0, win, SCALE, f16_operands=f16)
                d = (blk - ref).abs()
                alone = _run(att, *one, f16)()
                alone_cap = _run(att, *one, f16, plane_len=False)()
                return {"max_abs_vs_ref": d.max().item(), "share_within_4e-6": (d <= 4e-6).double().mean().item(),
                        "alone_eq_block": _bits_equal(alone, blk[T - 1:]),
                        "len_grid_eq_cap_grid": _bits_equal(alone, alone_cap)}

            for tag, f16 in (("f32ops", False), ("f16ops", True)):
                c = checks(f16)
                r[tag] = c
                ok &= c["alone_eq_block"] and c["len_grid_eq_cap_grid"] and c["share_within_4e-6"] >= 0.9
                r[f"decode_ms_{tag}"] = _time(_run(att, *one, f16), a.reps)
                r[f"rows16_ms_{tag}"] = _time(_run(att, *block, f16), a.reps)
                r[f"cold_decode_ms_{tag}"] = _time(_run_cold(att, *one, f16, copies=COLD_COPIES), a.reps)
                r[f"cold_rows16_ms_{tag}"] = _time(_run_cold(att, *block, f16, copies=COLD_COPIES), a.reps)
                if f16:  # the grid as the bench's step graph sizes it (programs past the plane exit at once)
                    gb = _graph_bound(depth, cap, sliding)
                    r["graph_bound"] = gb
                    r[f"graph_decode_ms_{tag}"] = _time(_run(att, *one, f16, bound=gb), a.reps)
                    r[f"graph_rows16_ms_{tag}"] = _time(_run(att, *block, f16, bound=gb), a.reps)
                    # a session opened at the model's context length (Engine.session's default)
                    cb = _graph_bound(CONTEXT_LENGTH - 16, cap, sliding)
                    r["ctx_bound"] = cb
                    r[f"ctx_decode_ms_{tag}"] = _time(_run(att, *one, f16, bound=cb), a.reps)
            if before is not None:
                for tag, f16 in (("f32ops", False), ("f16ops", True)):
                    # the same rows through both modules, bitwise (a change meant to keep the bits)
                    r[f"before_eq_{tag}"] = (_bits_equal(_run(before, *block, f16)(), _run(att, *block, f16)())
                                             and _bits_equal(_run(before, *one, f16)(), _run(att, *one, f16)()))
                    r[f"before_decode_ms_{tag}"] = _time(_run(before, *one, f16), a.reps)
                    r[f"before_rows16_ms_{tag}"] = _time(_run(before, *block, f16), a.reps)
                    r[f"before_cold_decode_ms_{tag}"] = _time(_run_cold(before, *one, f16, copies=COLD_COPIES), a.reps)
                    r[f"before_cold_rows16_ms_{tag}"] = _time(_run_cold(before, *block, f16, copies=COLD_COPIES),
                                                              a.reps)
                    if f16:  # the step graph's grid through the other module too
                        r[f"before_graph_decode_ms_{tag}"] = _time(_run(before, *one, f16, bound=r["graph_bound"]),
                                                                   a.reps)
                        r[f"before_graph_rows16_ms_{tag}"] = _time(_run(before, *block, f16, bound=r["graph_bound"]),
                                                                   a.reps)
                        r[f"before_ctx_decode_ms_{tag}"] = _time(_run(before, *one, f16, bound=r["ctx_bound"]), a.reps)
            print(json.dumps(r), flush=True)
            rows.append(r)
            if a.sweep_f16:
                for rg, bs, w, st in SWEEP_F16:
                    att.ROW_GROUP_F16, att.BLOCK, att.F16_LAUNCH = rg, bs, {"num_warps": w, "num_stages": st}
                    try:
                        c = checks(True)
                        c.update({"f16": True, "row_group": rg, "block": bs, "num_warps": w, "num_stages": st,
                                  "layer": r["layer"],
                                  "depth": depth, "decode_ms": _time(_run(att, *one, True), a.reps),
                                  "rows16_ms": _time(_run(att, *block, True), a.reps)})
                    except Exception as e:  # noqa: BLE001 (a choice that does not compile is a row too)
                        c = {"f16": True, "row_group": rg, "block": bs, "num_warps": w, "num_stages": st,
                             "layer": r["layer"],
                             "depth": depth, "error": f"{type(e).__name__}: {str(e)[:200]}"}
                    print("  sweep " + json.dumps(c), flush=True)
                    sweep.append(c)
                att.ROW_GROUP_F16, att.BLOCK, att.F16_LAUNCH = shipped_f16[0], shipped_f16[1], dict(shipped_f16[2])
            if a.sweep_splits:
                for S in SWEEP_SPLITS[r["layer"]]:
                    if sliding:
                        att.SPLIT_SLIDING = S
                    else:
                        att.SPLIT_FULL = S
                    try:  # the scratch is sized from split_count, which reads the split length
                        c = checks(True)
                        c.update({"f16": True, "split": S, "layer": r["layer"], "depth": depth,
                                  "decode_ms": _time(_run(att, *one, True), a.reps),
                                  "rows16_ms": _time(_run(att, *block, True), a.reps)})
                    except Exception as e:  # noqa: BLE001 (a choice that does not compile is a row too)
                        c = {"f16": True, "split": S, "layer": r["layer"], "depth": depth,
                             "error": f"{type(e).__name__}: {str(e)[:200]}"}
                    print("  sweep " + json.dumps(c), flush=True)
                    sweep.append(c)
                att.SPLIT_SLIDING, att.SPLIT_FULL = shipped_splits
            if not a.sweep:
                continue
            for bs, w, st in SWEEP:
                att.BLOCK_EXACT, att.PARTIAL_LAUNCH = bs, {"num_warps": w, "num_stages": st}
                try:
                    c = checks(False)
                    c.update({"block": bs, "num_warps": w, "num_stages": st, "layer": r["layer"], "depth": depth,
                              "decode_ms": _time(_run(att, *one, False), a.reps),
                              "rows16_ms": _time(_run(att, *block, False), max(20, a.reps // 4))})
                except Exception as e:  # noqa: BLE001 (a choice that does not compile is a row too)
                    c = {"block": bs, "num_warps": w, "num_stages": st, "layer": r["layer"], "depth": depth,
                         "error": f"{type(e).__name__}: {str(e)[:200]}"}
                print("  sweep " + json.dumps(c), flush=True)
                sweep.append(c)
            att.BLOCK_EXACT, att.PARTIAL_LAUNCH = shipped[0], dict(shipped[1])
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu (interpreter)",
                       "shipped": {"block_exact": shipped[0], "partial_launch": shipped[1],
                                   "row_group_f16": shipped_f16[0], "block_f16": shipped_f16[1],
                                   "f16_launch": shipped_f16[2], "split_sliding": shipped_splits[0],
                                   "split_full": shipped_splits[1]},
                       "rows": rows, "sweep": sweep}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
