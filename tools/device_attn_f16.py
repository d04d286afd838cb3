#!/usr/bin/env python3
"""attend_triton with f16 operands (the fast lane over f16 K/V) against f32 operands on CUDA, at
the engine's attention shape (H 32, n_kv 2, D 128): per layer kind (sliding ring of 2,048,
head-major full plane) and depth, (1) the flagged kernel against attend_ref with the flag (max
|diff|, share of elements within 4e-6), (2) row invariance: a row decoded alone == the same row
inside a 16-row block, grid from the length == grid from the capacity, bitwise, (3) the time per
decode call (CUDA events, median of repeated launches) of both variants.

    PYTHONPATH=src python3 tools/device_attn_f16.py [--depths 2048,32768] [--json PATH]
    PYTHONPATH=src python3 tools/device_attn_f16.py --smoke   # CPU, Triton interpreter, depth 40
"""
from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated

import time  # noqa: E402

import torch  # noqa: E402

from muser.engine.kernels import attention as att  # noqa: E402

DEV = "cpu" if "--smoke" in sys.argv else "cuda"
if DEV == "cpu":
    from muser.engine.kernels.interpreter import index_compat

    index_compat()

H, N_KV, D = 32, 2, 128
SCALE = 0.0883883


def _case(depth: int, sliding: bool, g: torch.Generator):
    cap = 2048 if sliding else depth + 64
    win = 2048 if sliding else 0
    dev = DEV
    shape = (cap, N_KV * D) if sliding else (N_KV, cap, D)
    kp = torch.randn(shape, generator=g).half().to(dev)
    vp = torch.randn(shape, generator=g).half().to(dev)
    return kp, vp, cap, win


def _run(q, kn, vn, kp, vp, hm, ol, op, ln, cap, p0, win, f16, plane_len=True):
    T = q.shape[0]
    meta = torch.tensor([ol, op, ln, cap], dtype=torch.int64, device=DEV)
    pos = torch.tensor([p0], dtype=torch.int64, device=DEV)
    sc = att.AttnScratch(T, H, D, att.split_count(T, cap, win), DEV)
    return lambda: att.attend_triton(q, kn, vn, kp, vp, hm, meta, pos, win, SCALE, sc,
                                     plane_len=ln if plane_len else None, f16_operands=f16)


def _time(fn, reps: int) -> float:
    """Median ms per call."""
    if DEV == "cpu":
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t) * 1e3)
        return sorted(ts)[len(ts) // 2]
    for _ in range(10):
        fn()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    ts = sorted(a.elapsed_time(b) for a, b in ev)
    return ts[len(ts) // 2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depths", default="2048,32768")
    ap.add_argument("--json", default=None)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--smoke", action="store_true", help="CPU under the Triton interpreter, depth 40, 1 rep")
    a = ap.parse_args(argv)
    if a.smoke:
        a.depths, a.reps = "40", 1
    g = torch.Generator().manual_seed(0)
    rows, ok = [], True
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
            blk = _run(q, kn, vn, kp, vp, hm, ol, op, ln, cap, p0, win, True)()
            ref = att.attend_ref(q, kn, vn, kp, vp, hm, ol, op, ln, cap, p0, win, SCALE, f16_operands=True)
            d = (blk - ref).abs()
            # row T-1 alone: its 15 predecessors now in the plane (their K/V are kn/vn rows)
            ol1, op1, ln1 = plane(p)
            kp1, vp1 = kp.clone(), vp.clone()
            for j in range(T - 1):
                s = (op1 + p0 + j - ol1) % cap
                if hm:
                    kp1[:, s], vp1[:, s] = kn[j], vn[j]
                else:
                    kp1[s], vp1[s] = kn[j].reshape(-1), vn[j].reshape(-1)
            alone = _run(q[T - 1:], kn[T - 1:], vn[T - 1:], kp1, vp1, hm, ol1, op1, ln1, cap, p, win, True)()
            alone_cap = _run(q[T - 1:], kn[T - 1:], vn[T - 1:], kp1, vp1, hm, ol1, op1, ln1, cap, p, win, True,
                             plane_len=False)()
            inv = bool(torch.equal(alone.view(torch.int32), blk[T - 1:].view(torch.int32)))
            inv_cap = bool(torch.equal(alone.view(torch.int32), alone_cap.view(torch.int32)))
            one = (q[T - 1:], kn[T - 1:], vn[T - 1:], kp1, vp1, hm, ol1, op1, ln1, cap, p, win)
            t_exact = _time(_run(*one, False), a.reps)
            t_f16 = _time(_run(*one, True), a.reps)
            t16_exact = _time(_run(q, kn, vn, kp, vp, hm, ol, op, ln, cap, p0, win, False), a.reps)
            t16_f16 = _time(_run(q, kn, vn, kp, vp, hm, ol, op, ln, cap, p0, win, True), a.reps)
            r = {"layer": "sliding" if sliding else "full", "depth": depth, "max_abs_vs_ref": d.max().item(),
                 "share_within_4e-6": (d <= 4e-6).double().mean().item(), "alone_eq_block": inv,
                 "len_grid_eq_cap_grid": inv_cap, "decode_ms_f32ops": t_exact, "decode_ms_f16ops": t_f16,
                 "rows16_ms_f32ops": t16_exact, "rows16_ms_f16ops": t16_f16}
            ok &= inv and inv_cap and r["share_within_4e-6"] >= 0.9
            print(json.dumps(r), flush=True)
            rows.append(r)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu (interpreter)",
                       "rows": rows}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
