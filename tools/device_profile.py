#!/usr/bin/env python3
"""Where a decode step's time goes on the GPU: the full-geometry engine (default kernels), a
session filled to each depth, eager decode steps under the torch profiler (GPU time per kernel
name, per step), and graph-replayed decode tok/s beside them, for each full-layer split length
(kernels/attention.SPLIT_FULL; other than the shipped one it changes the exact lane's bits, so
those cells are timings only).

    python3 tools/device_profile.py FULL.gguf OUT [--depths 0,32768] [--split-full 256,128]

Writes OUT/device_profile.json and prints the per-step breakdown.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

C = 131072


def fill(eng, s, depth: int) -> None:
    inst = s.begin_install(depth)
    for il, p in enumerate(inst.planes):
        a, b = inst.expected(il)
        z = torch.zeros((b - a, p.geometry.kv_dim), dtype=torch.float16, device=eng.device)
        inst.put(il, a, z, z)
    s.commit(inst)


def group(name: str) -> str:
    for key in ("_matvec_v3_kernel", "_matvec_v2_kernel", "_matvec_kernel", "_attn_partial", "_attn_reduce",
                "_dequant"):
        if key in name:
            return key
    return "other: " + name[:70]


def main() -> int:
    from muser.engine import Engine
    from muser.engine.kernels import attention

    ap = argparse.ArgumentParser()
    ap.add_argument("full")
    ap.add_argument("out")
    ap.add_argument("--depths", default="0,32768")
    ap.add_argument("--split-full", default=str(attention.SPLIT_FULL))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--gate-receipt", default=None, help="Gate 2 receipt of this tree on this machine")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {"started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cells": []}
    t = time.time()
    eng = Engine.open(a.full, device="cuda", lane="exact", kv="f16")
    res["load_s"] = round(time.time() - t, 1)
    rng = np.random.default_rng(0)
    for depth in [int(d) for d in a.depths.split(",")]:
        for split in [int(v) for v in a.split_full.split(",")]:
            attention.SPLIT_FULL = split
            eng._graphs.clear()  # captured graphs hold scratch sized for the split length
            cell: dict = {"depth": depth, "split_full": split}
            res["cells"].append(cell)
            try:
                s = eng.session(max_context=C, graphs=False)
                s.prefill([eng.cfg.bos_id])
                if depth > 1:
                    fill(eng, s, depth)
                toks = rng.integers(6, 8000, size=64).tolist()
                for i in range(3):
                    s.decode(toks[i])
                torch.cuda.synchronize()
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for i in range(a.steps):
                        s.decode(toks[3 + i])
                    torch.cuda.synchronize()
                agg: dict = defaultdict(lambda: [0.0, 0])
                for e in prof.events():
                    dt = getattr(e, "device_type", None)
                    if dt is None or "CUDA" not in str(dt):
                        continue
                    g = group(e.name)
                    agg[g][0] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
                    agg[g][1] += 1
                rows = sorted(((k, v[0] / a.steps / 1e3, v[1] / a.steps) for k, v in agg.items()),
                              key=lambda r: -r[1])
                cell["per_step_ms"] = {k: round(ms, 4) for k, ms, _ in rows}
                cell["launches_per_step"] = {k: n for k, _, n in rows}
                cell["gpu_ms_per_step"] = round(sum(ms for _, ms, _ in rows), 3)
                del s
                # graph-replayed decode for the same cell
                g = eng.session(max_context=C)
                g.prefill([eng.cfg.bos_id])
                if depth > 1:
                    fill(eng, g, depth)
                for i in range(4):
                    g.decode(toks[i])
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                n = 32
                for i in range(n):
                    g.decode(toks[i % 64])
                torch.cuda.synchronize()
                cell["graph_tok_s"] = n / (time.perf_counter() - t0)
                del g
            except Exception as e:  # recorded; the other cells go on
                import traceback

                cell["error"] = repr(e)[:300]
                cell["traceback"] = traceback.format_exc()[-2000:]
            torch.cuda.empty_cache()
            print(f"depth {depth} split_full {split}: graph {cell.get('graph_tok_s', 0):.1f} tok/s, eager GPU "
                  f"{cell.get('gpu_ms_per_step', 0)} ms/step", flush=True)
            for k, ms in list(cell.get("per_step_ms", {}).items())[:14]:
                print(f"   {ms:8.3f} ms  x{cell['launches_per_step'][k]:6.1f}  {k}", flush=True)
            (out / "device_profile.json").write_text(json.dumps(res, indent=1))
    from muser.bench.receipt import device_description, write_receipt

    gate = {"status": "n/a", "what": "profile only"}
    if a.gate_receipt:
        gr = json.loads(Path(a.gate_receipt).read_text())
        gate = {"status": "n/a", "gated_by": Path(a.gate_receipt).name, "gated_by_status": gr["gate"]["status"],
                "what": "Gate 2 of the same tree on the same machine"}
    write_receipt("decode-profile-cuda", model={"path": a.full, "bytes": Path(a.full).stat().st_size},
                  device=device_description("cuda"), lane="exact", gate=gate, results=res, out_dir=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
