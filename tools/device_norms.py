#!/usr/bin/env python3
"""The row-norm kernels (kernels/fused.py norm2, norm_mul) at the engine's width on CUDA under
each warp count: time of a one-row call and a 16-row call (CUDA graphs of 50 calls, median),
and row invariance (a row alone == the same row inside 16 rows, bitwise) for each choice.
The shipped choice is fused.norm_warps.

    PYTHONPATH=src python3 tools/device_norms.py [--n 6656] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from muser.engine.kernels import fused

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from device_kernels import graph_seconds  # noqa: E402


def _time(fn, reps: int = 20, n: int = 50) -> float:
    """Median µs per call, the calls captured in a CUDA graph."""
    return 1e6 * sorted(graph_seconds(fn, n, reps))[reps // 2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=6656)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("device_norms: CUDA is not available", file=sys.stderr)
        return 2
    g = torch.Generator().manual_seed(0)
    N = a.n
    x = (torch.randn(16, N, generator=g) * 3).cuda()
    res = torch.randn(16, N, generator=g).cuda()
    w = torch.randn(N, generator=g).cuda()
    w2 = torch.randn(N, generator=g).cuda()
    shipped = fused.norm_warps
    rows, ok = [], True
    for warps in (4, 8, 16, 32):
        fused.norm_warps = lambda n, w_=warps: w_  # noqa: E731 (the sweep's choice)
        try:
            h16, x16 = fused.norm2(x, w, 1e-6, res, w2, 1e-6)
            h1, x1 = fused.norm2(x[5:6], w, 1e-6, res[5:6], w2, 1e-6)
            m16 = fused.norm_mul(x, w, 1e-6)
            m1 = fused.norm_mul(x[5:6], w, 1e-6)
            inv = bool(torch.equal(h1.view(torch.int32), h16[5:6].view(torch.int32))
                       and torch.equal(x1.view(torch.int32), x16[5:6].view(torch.int32))
                       and torch.equal(m1.view(torch.int32), m16[5:6].view(torch.int32)))
            r = {"warps": warps, "row_alone_eq_row_of_16": inv,
                 "norm2_us_1row": _time(lambda: fused.norm2(x[:1], w, 1e-6, res[:1], w2, 1e-6)),
                 "norm2_us_16rows": _time(lambda: fused.norm2(x, w, 1e-6, res, w2, 1e-6)),
                 "norm_mul_us_1row": _time(lambda: fused.norm_mul(x[:1], w, 1e-6))}
            ok &= inv
        except Exception as e:  # noqa: BLE001 (a choice that fails is a row too)
            r = {"warps": warps, "error": f"{type(e).__name__}: {str(e)[:200]}"}
        print(json.dumps(r), flush=True)
        rows.append(r)
    fused.norm_warps = shipped
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "n": N, "shipped": shipped(N), "rows": rows}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
