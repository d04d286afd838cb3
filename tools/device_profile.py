#!/usr/bin/env python3
"""Where a decode or verify step's time goes on the GPU: the engine on one file and lane, a
session at each depth, the step eager and replayed as its CUDA graph, each timed (wall per step)
and then under the torch profiler: GPU time per kernel and launch counts, and the timeline split
into GPU busy time, short idle gaps between one step's kernels and long ones (the host's work
between steps: bookkeeping, the logits read-back).

    python3 tools/device_profile.py FULL.gguf OUT [--lanes exact,fast] [--depths 0] [--rows 1,16]
                                    [--steps 8] [--gate-receipt R] [--pdl on,off] [--acts tails,separate]
                                    [--parts "6;2,12"]

Writes one `step-profile-cuda` receipt per lane into OUT and prints the per-step tables.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

import numpy as np  # noqa: E402
import torch  # noqa: E402


def family(name: str) -> str:
    """A kernel's family: Triton kernels by their function name, the rest by a name prefix."""
    n = name.strip()
    if n.startswith(("Memcpy", "Memset")):
        return " ".join(n.split(" ")[:2])  # "Memcpy DtoH (Device -> Pageable)" -> "Memcpy DtoH"
    return n[:80]


HOST_GAP_US = 150.0  # an idle stretch of the GPU at least this long is the host's turn between steps


def kernel_events(prof) -> list:
    """The device-side events (kernels, copies) of a profile, by start time."""
    ev = [e for e in prof.events() if getattr(e, "device_type", None) is not None and "CUDA" in str(e.device_type)]
    return sorted(ev, key=lambda e: e.time_range.start)


def per_kernel(ev: list, steps: int) -> tuple[list[dict], float, float]:
    agg: dict = defaultdict(lambda: [0.0, 0])
    for e in ev:
        a = agg[family(e.name)]
        a[0] += e.time_range.end - e.time_range.start
        a[1] += 1
    table = sorted(((k, v[0] / steps / 1e3, v[1] / steps) for k, v in agg.items()), key=lambda r: -r[1])
    rows = [{"name": k, "ms_per_step": round(ms, 4), "launches_per_step": round(n, 2)} for k, ms, n in table]
    return rows, sum(ms for _, ms, _ in table), sum(n for _, _, n in table)


def timeline(ev: list, steps: int) -> dict:
    """GPU busy time (the union of the kernels' intervals), the idle gaps shorter than HOST_GAP_US
    (between the kernels of one step: launch latency, dependency waits) and the longer ones (the
    host preparing the next step, the read-back), each per step."""
    busy = short = long_ = 0.0
    end = None
    prev = ""
    where: dict = defaultdict(lambda: [0.0, 0])  # (kernel before, kernel after) -> [us, count]
    for e in ev:
        a, b = e.time_range.start, e.time_range.end
        if end is None:
            busy += b - a
            end = b
            prev = family(e.name)
            continue
        if a > end:
            gap = a - end
            if gap >= HOST_GAP_US:
                long_ += gap
                w = where[(prev[:40], family(e.name)[:40])]
                w[0] += gap
                w[1] += 1
            else:
                short += gap
            busy += b - a
            end = b
        elif b > end:
            busy += b - end
            end = b
        prev = family(e.name)
    # where the long gaps fall: between steps (after the logits' copy) or inside one (a graph
    # part waiting for its launch), by the kernels either side of them
    gaps = sorted(({"before": k[0], "after": k[1], "ms_per_step": round(v[0] / steps / 1e3, 4),
                    "per_step": round(v[1] / steps, 2)} for k, v in where.items()), key=lambda r: -r["ms_per_step"])
    return {"gpu_busy_ms_per_step": round(busy / steps / 1e3, 4),
            "short_gaps_ms_per_step": round(short / steps / 1e3, 4),
            "host_gaps_ms_per_step": round(long_ / steps / 1e3, 4),
            "host_gaps_where": gaps[:8]}


def host_profile(step, steps: int, top: int = 30) -> list[dict]:
    """The host side of `steps` steps under cProfile: the functions with the most own time (C
    calls included: the graph launch, the copies, the waits), ms per step."""
    import cProfile
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    for i in range(steps):
        step(i)
    torch.cuda.synchronize()
    pr.disable()
    st = pstats.Stats(pr)
    rows = []
    for (fn, line, name), (_, ncalls, tt, ct, _) in st.stats.items():  # type: ignore[attr-defined]
        rows.append({"fn": f"{Path(fn).name}:{line}({name})", "calls_per_step": round(ncalls / steps, 2),
                     "own_ms_per_step": round(tt / steps * 1e3, 4), "cum_ms_per_step": round(ct / steps * 1e3, 4)})
    rows.sort(key=lambda r: -r["own_ms_per_step"])
    return rows[:top]


def profile_prefill_cell(eng, depth: int, rows: int, steps: int, rng) -> dict:
    """A prefill of `rows` tokens after `depth` (eager: prefill is not a graph step), as `muser
    bench prefill` times it (the session rolled back to its depth checkpoint each step): `steps`
    timed, `steps` under the profiler (kernels, launches, busy time and gaps) and `steps` under
    cProfile (the host's side)."""
    vocab = eng.cfg.vocab
    ids = rng.integers(6, min(vocab, 8000), size=depth + rows).astype(np.int64)
    s = eng.session(max_context=depth + rows)
    if depth:
        s.prefill(ids[:depth])
    cp = s.checkpoint(block=rows)

    def step(_i: int) -> None:
        s.rollback(cp)
        s.prefill(ids[depth:])

    cell: dict = {"depth": depth, "rows": rows, "steps": steps, "mode": "prefill"}
    for i in range(2):  # warm-up
        step(i)
    torch.cuda.synchronize()
    samples = []
    for i in range(steps):
        t0 = time.perf_counter()
        step(i)
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) * 1e3)
    cell["eager_wall_ms_per_step"] = round(float(np.mean(samples)), 4)
    cell["eager_wall_ms_samples"] = [round(x, 4) for x in samples]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            step(i)
        torch.cuda.synchronize()
    ev = kernel_events(prof)
    table, gpu_ms, launches = per_kernel(ev, steps)
    cell["eager_kernels"] = table
    cell["eager_kernel_ms_per_step"] = round(gpu_ms, 4)
    cell["eager_launches_per_step"] = round(launches, 1)
    cell["eager_timeline"] = timeline(ev, steps)
    cell["eager_host"] = host_profile(step, steps)
    del s
    torch.cuda.empty_cache()
    return cell


def profile_cell(eng, depth: int, rows: int, steps: int, rng, modes: tuple[bool, ...] = (False, True)) -> dict:
    """One (depth, rows) cell, eager and then graph-replayed: `steps` steps timed, then `steps`
    more under the profiler (kernels, launches, the timeline's busy time and gaps). More rows
    than a verify block: a prefill (profile_prefill_cell)."""
    from muser.engine import MAX_VERIFY

    if rows > MAX_VERIFY:
        return profile_prefill_cell(eng, depth, rows, steps, rng)
    vocab = eng.cfg.vocab
    n_steps = 3 + 4 * steps  # warm-up, timed, profiled, host-profiled
    n_ctx = max(depth, 1) + rows * n_steps + 8
    ids = rng.integers(6, min(vocab, 8000), size=n_ctx).astype(np.int64)
    cell: dict = {"depth": depth, "rows": rows, "steps": steps}
    p0 = max(depth, 1)

    def advance(s, i: int) -> None:
        if rows == 1:
            s.decode(int(ids[p0 + i]))
        else:
            s.verify(ids[p0 + i * rows: p0 + (i + 1) * rows])

    for graphs in modes:
        tag = "graph" if graphs else "eager"
        s = eng.session(max_context=n_ctx, graphs=graphs)
        s.prefill(ids[:p0])
        for i in range(3):  # warm-up (graph capture on the graph session)
            advance(s, i)
        torch.cuda.synchronize()
        samples = []
        for i in range(steps):
            t0 = time.perf_counter()
            advance(s, 3 + i)
            torch.cuda.synchronize()
            samples.append((time.perf_counter() - t0) * 1e3)
        cell[f"{tag}_wall_ms_per_step"] = round(float(np.mean(samples)), 4)
        cell[f"{tag}_wall_ms_samples"] = [round(x, 4) for x in samples]
        g = s._graphs.get((rows, "last" if rows == 1 else "all")) if graphs else None
        if g is not None and g.parts:
            # the last step's graphs replayed back to back (the same inputs, its K/V rewritten in
            # the same slots): the GPU's time a step with no host work between steps, so the
            # wall's excess over it is the host's share of the step's critical path
            reps = []
            for _ in range(3):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _i in range(steps):
                    for part in g.parts:
                        part.replay()
                torch.cuda.synchronize()
                reps.append((time.perf_counter() - t0) * 1e3 / steps)
            cell["graph_replay_ms_per_step"] = round(float(np.median(reps)), 4)
            cell["graph_replay_ms_samples"] = [round(x, 4) for x in reps]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for i in range(steps):
                advance(s, 3 + steps + i)
            torch.cuda.synchronize()
        ev = kernel_events(prof)
        table, gpu_ms, launches = per_kernel(ev, steps)
        cell[f"{tag}_kernels"] = table
        cell[f"{tag}_kernel_ms_per_step"] = round(gpu_ms, 4)
        cell[f"{tag}_launches_per_step"] = round(launches, 1)
        cell[f"{tag}_timeline"] = timeline(ev, steps)
        if graphs:
            cell["graph_host"] = host_profile(lambda i: advance(s, 3 + 2 * steps + i), steps)
        del s
        torch.cuda.empty_cache()
    return cell


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--lanes", default="exact", help="comma-separated lanes, each its own engine and receipt")
    ap.add_argument("--depths", default="0")
    ap.add_argument("--rows", default="1,16", help="rows per step: 1 = decode, 2..16 = a verify block, more = a "
                    "prefill of that many tokens (eager)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--modes", default="eager,graph", help="eager and/or graph steps (each prefills its own session)")
    ap.add_argument("--gate-receipt", default=None, help="the wide Gate 2 receipt of this tree and lane")
    ap.add_argument("--pdl", default="on", help="on, off and/or a row count N: the step's kernels with "
                    "programmatic dependent launch (engine/kernels/gdc.py) at its ROWS, without, or on launches of "
                    "up to N rows; each setting captures its own graphs")
    ap.add_argument("--acts", default="tails", help="tails and/or separate (lane fast): each projection input "
                    "quantized by the tail kernel that writes it (lanes.Linear.tail_acts) or by a quantize launch "
                    "of its own; each setting captures its own graphs")
    ap.add_argument("--parts", default="", help="graph part splits to compare, ';'-separated, each a comma list of "
                    "layers (engine/graphs.PART_LAYERS; empty: the shipped one); each setting captures its own graphs")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("device_profile: CUDA is not available", file=sys.stderr)
        return 2
    from muser.bench.receipt import device_description, write_receipt
    from muser.engine import Engine

    lanes = a.lanes.split(",")
    for ln in lanes:
        if ln not in ("exact", "fast"):
            print(f"device_profile: lane {ln!r}: expected exact or fast", file=sys.stderr)
            return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    gate = {"status": "n/a", "what": "a profile, not a speed result"}
    if a.gate_receipt:
        gr = json.loads(Path(a.gate_receipt).read_text())
        gate = {"status": "n/a", "gated_by": Path(a.gate_receipt).name, "gated_by_status": gr["gate"]["status"],
                "what": "the wide Gate 2 of this tree on this machine"}
    for lane in lanes:
        res: dict = {"cells": []}
        t = time.time()
        eng = Engine.open(a.model, device="cuda", lane=lane, kv="f16")
        res["load_s"] = round(time.time() - t, 1)
        from muser.engine.kernels import gdc

        acts = a.acts.split(",") if lane == "fast" else ["tails"]
        from muser.engine import graphs

        parts0 = graphs.PART_LAYERS
        try:  # refused before any cell runs: digits only, each set increasing
            part_sets = [tuple(int(x) for x in p.split(",") if x) for p in a.parts.split(";")] if a.parts else [parts0]
            for ps in part_sets:
                graphs.part_bounds(ps, eng.cfg.n_layers)
        except ValueError as e:
            print(f"device_profile: --parts {a.parts!r}: {e}", file=sys.stderr)
            return 2
        cells = [(parts, pdl, act, int(d), int(r)) for parts in part_sets for pdl in a.pdl.split(",") for act in acts
                 for d in a.depths.split(",") for r in a.rows.split(",")]
        rows0 = gdc.ROWS
        for parts, pdl, act, depth, rows in cells:
            if graphs.PART_LAYERS != parts:
                graphs.PART_LAYERS = parts
                eng._graphs.clear()  # graphs captured under the other split
            if not (pdl in ("on", "off") or (pdl.isdigit() and int(pdl) >= 1)) or act not in ("tails", "separate"):
                print(f"device_profile: --pdl {pdl!r} / --acts {act!r}: expected on, off or a row count / tails or "
                      f"separate", file=sys.stderr)
                return 2
            pdl_rows = int(pdl) if pdl.isdigit() else rows0
            if (gdc.ENABLED != (pdl != "off") or gdc.ROWS != pdl_rows
                    or eng.forward.linear.tail_acts != (act == "tails")):
                gdc.ENABLED = pdl != "off"
                gdc.ROWS = pdl_rows
                eng.forward.linear.tail_acts = act == "tails"
                eng._graphs.clear()  # graphs captured under the other setting
            rng = np.random.default_rng(0)
            try:
                cell = profile_cell(eng, depth, rows, a.steps, rng,
                                    tuple(m == "graph" for m in a.modes.split(",")))
            except Exception as e:  # recorded; the other cells go on
                cell = {"depth": depth, "rows": rows, "error": repr(e)[:300],
                        "traceback": traceback.format_exc()[-2000:]}
            cell["pdl"] = pdl != "off"
            cell["pdl_rows"] = pdl_rows
            cell["tail_acts"] = act == "tails"
            cell["part_layers"] = list(parts)
            res["cells"].append(cell)
            print(f"lane {lane} parts {parts} pdl {pdl} acts {act} depth {depth} rows {rows}: graph {cell.get('graph_wall_ms_per_step', 0)} ms/step "
                  f"wall ({cell.get('graph_replay_ms_per_step', 0)} replayed back to back), its kernels "
                  f"{cell.get('graph_kernel_ms_per_step', 0)} ms in "
                  f"{cell.get('graph_launches_per_step', 0)} launches, {cell.get('graph_timeline', {})}; eager "
                  f"wall {cell.get('eager_wall_ms_per_step', 0)} ms", flush=True)
            print(f"   eager {cell.get('eager_kernel_ms_per_step', 0)} ms of kernels in "
                  f"{cell.get('eager_launches_per_step', 0)} launches, {cell.get('eager_timeline', {})}", flush=True)
            for k in cell.get("graph_kernels", cell.get("eager_kernels", []))[:18]:
                print(f"   {k['ms_per_step']:8.3f} ms  x{k['launches_per_step']:7.2f}  {k['name']}", flush=True)
            for h in cell.get("graph_host", cell.get("eager_host", []))[:16]:
                print(f"   host {h['own_ms_per_step']:8.4f} ms own {h['cum_ms_per_step']:8.4f} cum "
                      f"x{h['calls_per_step']:7.2f}  {h['fn']}", flush=True)
            if "error" in cell:
                print("   " + cell["error"], flush=True)
        p = write_receipt("step-profile-cuda", model={"path": str(a.model), "bytes": Path(a.model).stat().st_size},
                          device=device_description("cuda"), lane=lane, gate=gate, results=res, out_dir=out)
        print(f"device_profile: lane {lane}: receipt {p}", flush=True)
        del eng
        gdc.ENABLED = True
        gdc.ROWS = rows0
        graphs.PART_LAYERS = parts0
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
