#!/usr/bin/env python3
"""What the integer lane's float64 block terms cost its K-quant GEMM on CUDA: each route of the
tuning table (kernels/i8_tuning.json) at one and 16 rows, timed beside the same route of a copy
of kernels/qtile_i8.py whose terms and sums are float32 (term = dd * f32(sumi) + dm * f32(summ),
accumulators f32, no float64 conversion, multiply or add in the loop).

The copy is a probe, not a lane: its bits are not the contract (dot.py forms each term in float64
and sums in float64). Its outputs are compared with the shipped kernel's by max relative error only,
to show that the copy computes the same product. The timings bound what a float32 term contract
would save per call, before any change to the contract is considered.

    PYTHONPATH=src python3 tools/device_term_probe.py [--json PATH] [--rows 1,16]
    PYTHONPATH=src python3 tools/device_term_probe.py --sass   # CPU: the copy's loops compiled for
                                                                # sm_90 and counted (tools/sass_loop.py)
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src" / "muser" / "engine" / "kernels" / "qtile_i8.py"

# (text in qtile_i8.py, its float32 form); each must occur at least once
EDITS = [
    ("dd.to(gl.float64) * sumi.to(gl.float64) + dm.to(gl.float64) * summ.to(gl.float64)",
     "dd * sumi.to(gl.float32) + dm * summ.to(gl.float32)"),
    ("dd.to(gl.float64) * sumi.to(gl.float64)", "dd * sumi.to(gl.float32)"),
    ("gl.float64", "gl.float32"),
    ("torch.float64", "torch.float32"),
]


def f32_module():
    """kernels/qtile_i8.py with float32 terms and sums, loaded as a sibling module of the package
    (its relative imports resolve; the tuning table is not loaded: routes are passed explicitly)."""
    text = SRC.read_text()
    for old, new in EDITS:
        if old not in text:
            raise SystemExit(f"device_term_probe: {old!r} no longer occurs in {SRC}")
        text = text.replace(old, new)
    path = Path(tempfile.mkdtemp(prefix="term_probe_")) / "qtile_i8_f32term.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("muser.engine.kernels.qtile_i8_f32term", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def call(mod, w, act, out, entry: dict):
    path, cfg = entry["path"], tuple(entry["config"])
    if path == "ring":
        return mod.matmul_ring(w, act, out, config=cfg, split=entry.get("split"), group=entry.get("group", 1),
                               stream=entry.get("stream", 0))
    return mod.matmul_tile(w, act, out, config=cfg, split=entry.get("split"))


def probe(rows: list[int]) -> dict:
    import numpy as np
    import torch

    sys.path.insert(0, str(REPO / "tools"))
    from device_kernels import graph_seconds

    from muser.engine.kernels import qmatmul_i8, qtile_i8
    from muser.engine.weights import random_bytes, repack
    from muser.gguf.types import GgmlType as G

    var = f32_module()
    table = json.loads((SRC.parent / "i8_tuning.json").read_text())
    bucket = {1: 8, 16: 16}
    out: list[dict] = []
    g = torch.Generator(device="cpu").manual_seed(5)
    shapes: dict = {}
    for e in table:  # one random weight a shape, every row count of it timed on that weight
        shapes.setdefault((e["fmt"], e["n_out"], e["n_in"]), []).append(e)
    for (fmt_name, n_out, n_in), entries in shapes.items():
        todo = [(T, e) for T in rows for e in entries if e["rows"] == bucket[T]]
        if not todo:
            continue
        fmt = G[fmt_name]
        raw = random_bytes(fmt, n_out, n_in, 3)
        w = repack("t", fmt, n_out, n_in, torch.from_numpy(raw.copy()).to("cuda"))
        del raw
        for T, e in todo:
            act = qmatmul_i8.quantize_act(torch.randn(T, n_in, generator=g).to("cuda"), G.Q8_K)
            y64 = torch.empty(T, n_out, device="cuda")
            y32 = torch.empty(T, n_out, device="cuda")
            r = {k: e[k] for k in ("fmt", "n_out", "n_in", "path", "config")} | {
                "rows": T, "split": e.get("split"), "stream": e.get("stream", 0)}
            try:
                call(qtile_i8, w, act, y64, e)
                call(var, w, act, y32, e)
                rel = ((y32 - y64).abs() / y64.abs().clamp_min(1e-3)).max().item()
                r["max_rel_f32_vs_f64"] = rel
                t64, t32 = [], []
                for _ in range(2):  # in turn, so drift between them cancels
                    t64 += graph_seconds(lambda: call(qtile_i8, w, act, y64, e), 20, 5)
                    t32 += graph_seconds(lambda: call(var, w, act, y32, e), 20, 5)
                r["us_f64"] = float(np.median(t64)) * 1e6
                r["us_f32"] = float(np.median(t32)) * 1e6
                r["f32_over_f64"] = r["us_f32"] / r["us_f64"]
            except Exception as ex:  # noqa: BLE001 (a route the copy cannot build is a row too)
                r["error"] = f"{type(ex).__name__}: {str(ex)[:300]}"
            print(json.dumps(r), flush=True)
            out.append(r)
        del w
        torch.cuda.empty_cache()
    return {"device": torch.cuda.get_device_name(), "edits": EDITS, "rows": out}


def sass() -> int:
    """The copy's walked 16-row ring and one-row tile compiled for sm_90 here, loops counted."""
    sys.path.insert(0, str(REPO / "tools"))
    import sass_loop as sl

    import muser.engine.kernels as pkg

    var = f32_module()
    setattr(pkg, "qtile_i8", var)  # sass_loop's launchers import the tile module from the package
    sys.modules["muser.engine.kernels.qtile_i8"] = var
    for argv in (["ring", "Q4_K", "16", "--n-out", "39936", "--n-in", "6656", "--config", "64,16,4,4", "--walk"],
                 ["tile", "Q4_K", "1", "--n-out", "39936", "--n-in", "6656", "--config", "32,8,2,1"]):
        print("f32 terms:", " ".join(argv), flush=True)
        sl.main(argv)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--rows", default="16,1")
    ap.add_argument("--sass", action="store_true", help="compile the copy's loops for sm_90 here and count them")
    a = ap.parse_args(argv)
    if a.sass:
        return sass()
    rows = [int(x) for x in a.rows.split(",")]
    if not rows or any(r not in (1, 16) for r in rows):
        ap.error(f"--rows {a.rows!r}: the table's one-row and 16-row buckets are 1 and 16")
    res = probe(rows)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0 if not any("error" in r for r in res["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
