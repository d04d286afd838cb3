#!/usr/bin/env python3
"""What bounds a kernel: the projection kernels of both lanes on full-geometry shapes, each
launched once under Nsight Compute (`ncu`, hardware counters), with the counters that say where
its issue slots go (warp stall reasons per issued instruction), how full its pipes and memory
paths are, and its occupancy. Synthetic weights of the format (the counters do not depend on the
values); no model file.

    python3 tools/device_counters.py OUT [--shape Q4_K:39936:6656[,FMT:N_OUT:N_IN...]] [--rows 1,16]
                                         [--lanes exact,fast]

The integer lane's calls take the tuning table's route for their shape and row count
(qtile_i8.matmul: the tile, its ring variant or the stream-K walk), as the engine's do.

Runs itself under `ncu --clock-control none` (METHOD.md: leave the clocks alone) with profiling
off until every kernel has compiled and run once; writes OUT/counters.json (`labels`: the calls
in launch order, e.g. "exact T16 Q4_K:39936:6656"; `records`: one per kernel launch in the same
order, its kernel name and each metric; a call may launch more than one kernel: the exact lane's
activation prep, the integer lane's chunk reduce) and OUT/counters.txt (a table), and prints it. A bad --shape or
--lanes is refused before any work; where `ncu` is absent or cannot read the counters it says so
and exits 3.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

# Warp stall reasons, each as warps stalled per issued instruction (ncu's "Warp State Statistics"):
# their sum plus 1 (the issuing warp) is the cycles between a warp's instructions.
STALLS = ("long_scoreboard", "short_scoreboard", "wait", "math_pipe_throttle", "mio_throttle", "lg_throttle",
          "not_selected", "selected", "barrier", "dispatch_stall", "no_instruction", "branch_resolving",
          "tex_throttle", "drain", "imc_miss", "membar", "misc", "sleeping")
METRICS = (
    "gpu__time_duration.sum",
    "launch__registers_per_thread",
    "launch__grid_size",
    "launch__block_size",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
    "sm__inst_executed.sum",
    "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active",
    "sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active",
    "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
    "dram__bytes_read.sum",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "lts__t_bytes.sum",
    "lts__throughput.avg.pct_of_peak_sustained_elapsed",
    "lts__t_sector_hit_rate.pct",
    "l1tex__t_bytes.sum",
    "l1tex__throughput.avg.pct_of_peak_sustained_active",
    "l1tex__t_sector_hit_rate.pct",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum",
    "smsp__warps_eligible.avg.per_cycle_active",
) + tuple(f"smsp__average_warps_issue_stalled_{s}_per_issue_active.ratio" for s in STALLS)


LANES = ("exact", "fast")
FORMATS = ("Q4_K", "Q5_K", "Q6_K")  # the K-quants both lanes' kernels serve


def shape_arg(s: str) -> list[tuple[str, int, int]]:
    """FMT:N_OUT:N_IN[,...] -> [(FMT, N_OUT, N_IN)], or an argparse error naming the bad value."""
    out = []
    for one in s.split(","):
        parts = one.split(":")
        if (len(parts) != 3 or parts[0] not in FORMATS or not all(p.isdigit() and int(p) > 0 for p in parts[1:])
                or int(parts[2]) % 256):
            raise argparse.ArgumentTypeError(f"{one!r}: expected FMT:N_OUT:N_IN with FMT one of "
                                             f"{', '.join(FORMATS)} and N_IN a positive multiple of 256")
        out.append((parts[0], int(parts[1]), int(parts[2])))
    return out


def list_arg(allowed: tuple[str, ...] | None):
    def parse(s: str) -> list[str]:
        items = s.split(",")
        bad = [v for v in items if (v not in allowed if allowed else not (v.isdigit() and 1 <= int(v) <= 16))]
        if bad:
            raise argparse.ArgumentTypeError(f"{s!r}: {bad[0]!r} is not one of "
                                             f"{', '.join(allowed) if allowed else '1..16 (rows)'}")
        return items
    return parse


def parse_records(raw: str) -> list[dict]:
    """ncu's `--csv --page raw` output -> [{kernel, metrics}] in launch order: the header row is
    the first that starts with "ID", the units row after it has no ID, numbers may carry
    thousands separators; text before the header (the program's own output) is skipped."""
    at = raw.find('"ID"')
    if at < 0:
        return []
    rows = [r for r in csv.DictReader(io.StringIO(raw[at:])) if r.get("ID", "").strip().isdigit()]
    return [{"kernel": r.get("Kernel Name", ""), "metrics": {k: _num(r[k]) for k in METRICS if k in r}}
            for r in rows]


def target(args) -> int:
    """The profiled process: every kernel compiled and run once, then the profiled launches."""
    import torch

    from muser.engine.kernels import qmatmul_i8, qmatvec_v3, qtile_i8
    from muser.engine.weights import random_bytes, repack
    from muser.gguf.types import GgmlType as G

    dev = "cuda"
    rows = [int(r) for r in args.rows]
    calls = []  # (label, fn): one launch group each, in the order ncu sees them
    for fmt_name, n_out, n_in in args.shape:
        fmt = G[fmt_name]
        shape = f"{fmt_name}:{n_out}:{n_in}"
        w = repack("t", fmt, n_out, n_in, torch.from_numpy(random_bytes(fmt, n_out, n_in, 3).copy()).to(dev))
        g = torch.Generator(device="cpu").manual_seed(1)
        x = torch.randn(max(rows), n_in, generator=g).to(dev)
        for lane in args.lanes:
            if lane == "exact":
                packed = qmatvec_v3.pack(w)
            for T in rows:
                xt = x[:T].contiguous()
                out = torch.empty(T, n_out, device=dev)
                if lane == "exact":
                    calls.append((f"exact T{T} {shape}",
                                  lambda xt=xt, out=out, packed=packed: qmatvec_v3.matvec_v3(packed, xt, out)))
                else:
                    act = qmatmul_i8.quantize_act(xt, G.Q8_K)
                    calls.append((f"fast T{T} {shape}", lambda act=act, out=out, w=w: qtile_i8.matmul(w, act, out)))
    for _, fn in calls:  # compile and warm
        fn()
        fn()
    torch.cuda.synchronize()
    order = []
    torch.cuda.cudart().cudaProfilerStart()
    for label, fn in calls:
        fn()
        torch.cuda.synchronize()
        order.append(label)
    torch.cuda.cudart().cudaProfilerStop()
    Path(args.order).write_text(json.dumps(order))
    return 0


def _num(v: str):
    try:
        return float(v.replace(",", ""))
    except ValueError:
        return v


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?")
    ap.add_argument("--shape", type=shape_arg, default="Q4_K:39936:6656", help="FMT:N_OUT:N_IN")
    ap.add_argument("--rows", type=list_arg(None), default="1,16", help="activation rows, 1..16 each")
    ap.add_argument("--lanes", type=list_arg(LANES), default="exact,fast")
    ap.add_argument("--target", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--order", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.target:
        return target(args)
    if not args.out:
        ap.error("OUT is required")
    out = Path(args.out)
    ncu = shutil.which("ncu") or next((str(p) for p in sorted(Path("/opt/nvidia").glob("nsight-compute/*/ncu"))), None)
    if ncu is None and Path("/usr/local/cuda/bin/ncu").exists():
        ncu = "/usr/local/cuda/bin/ncu"
    if ncu is None:
        print("ncu: not found on this machine", file=sys.stderr)
        return 3
    out.mkdir(parents=True, exist_ok=True)
    order = out / "order.json"
    shape = ",".join(":".join(str(v) for v in one) for one in args.shape)
    cmd = [ncu, "--clock-control", "none", "--profile-from-start", "off", "--csv", "--page", "raw",
           "--metrics", ",".join(METRICS), sys.executable, __file__, "--target", "--order", str(order),
           "--shape", shape, "--rows", ",".join(args.rows), "--lanes", ",".join(args.lanes)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    (out / "ncu.log").write_text(p.stdout + "\n--- stderr ---\n" + p.stderr)
    if p.returncode != 0:
        print(p.stderr[-3000:], file=sys.stderr)
        return 3
    table = parse_records(p.stdout)
    if not table:
        print("ncu: no kernel records (counters unreadable?)\n" + p.stdout[-2000:], file=sys.stderr)
        return 3
    labels = json.loads(order.read_text())
    res = {"shape": shape, "labels": labels, "records": table, "ncu": ncu}
    (out / "counters.json").write_text(json.dumps(res, indent=1))
    lines = []
    for t in table:
        m = t["metrics"]
        stalls = {s: m.get(f"smsp__average_warps_issue_stalled_{s}_per_issue_active.ratio") for s in STALLS}
        top = sorted(((v, s) for s, v in stalls.items() if isinstance(v, float)), reverse=True)[:6]
        lines.append(f"{t['kernel'][:28]:28s} {m.get('gpu__time_duration.sum', 0) / 1e3:9.1f} us "
                     f"regs {m.get('launch__registers_per_thread')} grid {m.get('launch__grid_size')} "
                     f"occ {m.get('sm__warps_active.avg.pct_of_peak_sustained_active')} "
                     f"issue {m.get('smsp__issue_active.avg.pct_of_peak_sustained_active')} "
                     f"fma {m.get('sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active')} "
                     f"lsu {m.get('sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active')} "
                     f"dram {m.get('dram__throughput.avg.pct_of_peak_sustained_elapsed')} "
                     f"L2 {m.get('lts__throughput.avg.pct_of_peak_sustained_elapsed')} "
                     f"L1 {m.get('l1tex__throughput.avg.pct_of_peak_sustained_active')} "
                     f"eligible {m.get('smsp__warps_eligible.avg.per_cycle_active')}\n"
                     f"    stalls per issue: " + ", ".join(f"{s} {v:.2f}" for v, s in top))
    txt = f"{shape}; launches in order of {labels}\n" + "\n".join(lines)
    (out / "counters.txt").write_text(txt + "\n")
    print(txt)
    return 0


if __name__ == "__main__":
    sys.exit(main())
