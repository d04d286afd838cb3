#!/usr/bin/env python3
"""Row invariance and matvec speed of the CUDA exact lane, in one GPU-machine stage
(tools/device_session.sh `kernels`; `--device cpu --smoke` runs the same checks here under the
Triton interpreter on tiny shapes).

Part 1, invariance (DESIGN.md "Exactness contract"): for each weight format the engine serves and
both K/V types, a synthetic model (muser.model.synth, default widths, 80 positions: the sliding
ring wraps) on the engine's device; the logits of every position decoded alone are compared
bitwise with the same positions verified in blocks of 2, 7 and 16, prefilled in chunks of 1, 5 and
16 (every call <= 16 rows: the matvec family), and stepped in one Engine.step beside three other
sessions, and prefilled in chunks of 33 and 64 (on CUDA the matvec in 16-row slices; both are
asserted bitwise).

Part 2, speed: each K-quant shape of the full geometry's launches through the split GEMM
(kernels/qgemm_split.py, `split_case`: bitwise against its reference, a row alone against the same
row in 2, 16 and 512 rows, timed at 1..512 rows beside the v3 matvec; on the first Q4_K shape the
tile tilings of SPLIT_SWEEP); then, for NVFP4,
each (format, n_out, n_in) of the full geometry's launch shapes (the shipped tuning
table's keys), random valid blocks, timed at 1, 2, 4, 8 and 16 rows through a CUDA graph of 20
launches (warm-up, 5 repetitions, mean and CV), achieved GB/s of the weight bytes, and one row
alone against the same row inside a 16-row launch (bitwise); then each tiling of SWEEP at 1 and 16
rows (graph-timed), the winners whose outputs are bitwise the default tiling's written as
DIR/v3_tuning.json (the shipped table's form). Then, informational (exact lane, CUDA), the
explicit-layout int8 tile of tools/sass_gluon_tile.py: its outputs against an exact product and
its GB/s beside a device copy.

With --lane fast, part 1 runs the integer lane's engines (every format it serves on the device)
and part 2 times the integer GEMM (kernels/qmatmul_i8.py) at 1, 16, 64 and 512 rows, each shape's
outputs on a row subset checked bitwise against muser.quant.dot.matmul_ggml (the lane's contract),
and one row alone against the same row inside the 16- and 512-row launches (bitwise); on the
K-quant shapes the int8 tile (kernels/qtile_i8.py, the lane's CUDA path for them) beside it: bitwise
matmul_ggml on the row subset and bitwise the reference at 1, 16 and 512 rows (both gated), timed at
1, 16, 64 and 512 rows, tilings swept (one-row calls split or walking their chunks); the fastest
route per shape and row bucket with the reference's bits is written as DIR/i8_tuning.json
(qtile_i8.load_tuning's form).

    python3 tools/device_kernels.py --out DIR [--budget 140] [--device cuda|cpu --smoke] [--lane exact|fast]
                                    [--before FILE]   (an earlier qmatvec_v3.py: its 4/16-row calls beside)

Writes DIR/device-kernels.json (one record; rewritten after each case), a receipt (kind
kernels-<device>) at the end, and prints one line per case.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from contextlib import nullcontext
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

DTYPES = ("F16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "q4_k_xl", "nvfp4", "nvfp4-ggml")
# the fixtures of lane split: every projection through the split GEMM (kernels/qgemm_split.py) on
# CUDA, row-invariant at every chunk size, so their wide prefill chunks are asserted too
SPLIT_DTYPES = ("Q4_K", "Q5_K", "Q6_K", "q4_k_xl")
N_POS = 80


def _ids(vocab: int, n: int) -> list[int]:
    return [3 + (i * 37 + (i * i) % 11) % (vocab - 3) for i in range(n)]


def invariance_case(dtype: str, kv: str, device: str, work: Path, smoke: bool, lane: str = "exact") -> dict:
    import numpy as np

    from muser.engine import Engine, StepItem
    from muser.model.synth import SynthSpec, write_fixture

    spec = SynthSpec(dtype=dtype, source="blocks") if dtype.startswith("nvfp4") else SynthSpec(dtype=dtype)
    path = work / f"inv-{dtype}.gguf"
    if not path.exists():
        write_fixture(path, spec)
    eng = Engine.open(path, device=device, lane=lane, kv=kv)
    n = 24 if smoke else N_POS
    ids = _ids(eng.cfg.vocab, n)
    s = eng.session(max_context=n)
    ref = np.stack([s.decode(t) for t in ids])  # [n, vocab]: one row per forward
    out: dict = {"dtype": dtype, "kv": kv, "lane": lane, "positions": n, "finite": bool(np.isfinite(ref).all()),
                 "distinct_argmax": len({int(np.argmax(r)) for r in ref})}

    def cmp(got):
        bad = np.flatnonzero((got != ref).any(-1))
        return {"bitwise": bool(bad.size == 0), "rows_differing": int(bad.size),
                "max_abs_delta": float(np.abs(got - ref).max())}

    # the decode graph `s` captured, replayed for another session with planes of another size
    # (a graph reads each session's K/V storage from the step's metadata: engine/graphs.py)
    s2 = eng.session(max_context=n + 100)
    out["decode_other_session"] = cmp(np.stack([s2.decode(t) for t in ids]))
    for block in (2, 7) if smoke else (2, 7, 16):
        s = eng.session(max_context=n)
        s.prefill(ids[:3])
        rows = [ref[:3]] + [s.verify(ids[b0:b0 + block]) for b0 in range(3, n, block)]
        out[f"verify{block}"] = cmp(np.concatenate(rows))
    for chunk in (1, 5, 16, 33, 64):
        if smoke and chunk > 16:
            continue
        got = eng.session(max_context=n, chunk=chunk).prefill(ids, all_logits=True)
        out[f"prefill{chunk}"] = cmp(got)
    # four sessions in one step: session 0 carries the reference sequence, the others other tokens
    ss = [eng.session(max_context=n) for _ in range(4)]
    other = [_ids(eng.cfg.vocab, n + 7 * k)[7 * k:] for k in range(4)]
    rows = []
    for p in range(n):
        res = eng.step([StepItem(ss[0], [ids[p]])] + [StepItem(ss[k], [other[k][p]]) for k in (1, 2, 3)])
        rows.append(res[0].logits.reshape(-1))
    out["step4"] = cmp(np.stack(rows))
    cells = [v for v in out.values() if isinstance(v, dict)]
    out["ok"] = bool(out["finite"] and out["distinct_argmax"] > 1 and all(v["bitwise"] for v in cells))
    return out


def capture_beside_collection() -> dict:
    """CUDA: a capture during which a dead CUDA graph, held only by a reference cycle, meets
    Python's cyclic collector (an engine dropped while another captures). Without the engine's
    guard (muser.engine.graphs.collector_paused) the collection destroys that graph inside the
    capture; with it the capture completes and replays. The collector runs at every allocation
    here (threshold 1), so the unguarded capture meets it for certain."""
    import gc

    import torch

    from muser.engine.graphs import collector_paused

    x = torch.zeros(16, device="cuda")

    def attempt(guarded: bool) -> dict:
        dead = torch.cuda.CUDAGraph()
        with collector_paused(), torch.cuda.graph(dead):
            x.add_(1)
        g = torch.cuda.CUDAGraph()
        was, thresholds = gc.isenabled(), gc.get_threshold()
        gc.collect()
        gc.set_threshold(1, 1, 1)
        gc.enable()
        try:
            with collector_paused() if guarded else nullcontext(), torch.cuda.graph(g):
                x.add_(1)
                on = gc.isenabled()
                gc.disable()  # the cycle built and dropped young: generation 0's next run frees it
                cycle: dict = {"graph": dead}
                cycle["self"] = cycle
                del dead, cycle  # the graph's last reference is now the cycle's
                if on:
                    gc.enable()
                _junk = [[i] for i in range(256)]  # allocations: the collector's chances
                x.add_(1)
            before = float(x.sum())
            g.replay()
            torch.cuda.synchronize()
            return {"captured": True, "replay_adds": float(x.sum()) - before}
        except Exception as e:  # noqa: BLE001 - the unguarded attempt is expected to fail
            torch.cuda.synchronize()
            return {"captured": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
        finally:
            gc.set_threshold(*thresholds)
            if not was:
                gc.disable()
            gc.collect()

    guarded = attempt(True)
    unguarded = attempt(False)  # last: a failed capture is what it demonstrates
    ok = guarded["captured"] and guarded.get("replay_adds") == 2.0 * x.numel()
    return {"guarded": guarded, "unguarded": unguarded, "ok": bool(ok)}


def graph_seconds(fn, launches: int, reps: int) -> list[float]:
    """CUDA: `launches` calls of fn captured in one graph, replayed `reps` times after one warm
    replay; seconds per call of each replay."""
    import torch

    fn()
    torch.cuda.synchronize()
    from muser.engine.graphs import collector_paused

    graph = torch.cuda.CUDAGraph()
    with collector_paused(), torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b) / 1e3 / launches)
    return samples


def call_seconds(fn, device: str, launches: int) -> list[float]:
    """Per-call seconds of fn: 5 graph replays on CUDA, one timed call elsewhere (smoke runs)."""
    if device == "cuda":
        return graph_seconds(fn, launches, 5)
    t0 = time.perf_counter()
    fn()
    return [time.perf_counter() - t0]


def speed_case(fmt_name: str, n_out: int, n_in: int, device: str, smoke: bool, before=None) -> dict:
    import numpy as np
    import torch

    from muser.engine.kernels import qmatvec, qmatvec_v3
    from muser.engine.weights import random_bytes, repack
    from muser.gguf.types import GgmlType as G

    fmt = G[fmt_name]
    if smoke:
        n_out, n_in = min(n_out, 64), min(n_in, 512)
    if fmt in (G.NVFP4, G.NVFP4_E2M1):
        from muser.engine import nvfp4

        raw, sc, s2 = nvfp4.random_bytes(fmt, n_out, n_in, 3)
        w = repack("t", fmt, n_out, n_in, torch.from_numpy(raw.copy()).to(device),
                   None if sc is None else torch.from_numpy(sc.copy()).to(device), s2)
    else:
        w = repack("t", fmt, n_out, n_in, torch.from_numpy(random_bytes(fmt, n_out, n_in, 3).copy()).to(device))
    if qmatvec_v3.supports(fmt):
        w.packed = qmatvec_v3.pack(w)
        nbytes = w.packed.nbytes
    else:
        nbytes = sum(t.numel() * t.element_size() for t in w.fields.values())
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(16, n_in, generator=g).to(device)
    r: dict = {"fmt": fmt_name, "n_out": n_out, "n_in": n_in, "weight_bytes": nbytes}
    y16 = qmatvec.matvec(w, x)
    y1 = torch.cat([qmatvec.matvec(w, x[i:i + 1]) for i in range(16)])
    r["row_alone_equals_row_in_16"] = bool(torch.equal(y1.view(torch.int32), y16.view(torch.int32)))
    rows = torch.arange(0, n_out, max(1, n_out // 64), device=device)
    wd = w.decode(rows).double()  # the reference decoder's values [64, n_in]
    ref = x.double() @ wd.T
    scale = x.double().abs() @ wd.abs().T
    r["max_err_over_sum_abs"] = float(((y16[:, rows].double() - ref).abs() / scale.clamp_min(1e-300)).max())
    for T in (1, 2, 4, 8, 16):
        xt = x[:T].contiguous()
        out = torch.empty(T, n_out, device=device)
        samples = call_seconds(lambda: qmatvec.matvec(w, xt, out), device, 20)
        mean = float(np.mean(samples))
        r[f"T{T}"] = {"us": mean * 1e6, "cv": float(np.std(samples) / mean) if len(samples) > 1 else None,
                      "samples_s": samples, "GBps": nbytes / mean / 1e9}
    r["T16_over_T1"] = r["T16"]["us"] / r["T1"]["us"]
    if device == "cuda" and w.packed is not None and before is not None:  # an earlier module, same weight
        old = before.Packed(w.packed.name, w.packed.fmt, w.packed.n_out, w.packed.n_in, dict(w.packed.fields))
        for T in (4, 16):
            xt, out = x[:T].contiguous(), torch.empty(T, n_out, device=device)
            got = before.matvec_v3(old, xt, out)
            r[f"before_T{T}"] = {"bitwise_equal_now": bool(torch.equal(got.view(torch.int32), y16[:T].view(torch.int32))),
                                 "us": float(np.mean(call_seconds(lambda: before.matvec_v3(old, xt, out), device, 20))) * 1e6}
    if device == "cuda" and w.packed is not None:  # the tilings (BN, num_warps, PIPE[, rows a program]): speed only
        for T, cfgs in SWEEP.items():
            sweep = {}
            ref_t = y16[:T]
            for cfg in cfgs:
                try:
                    xt, out = x[:T].contiguous(), torch.empty(T, n_out, device=device)
                    rt = cfg[3] if len(cfg) > 3 else None
                    got = qmatvec_v3.matvec_v3(w.packed, xt, out, config=cfg[:3], rt=rt)
                    same = bool(torch.equal(got.view(torch.int32), ref_t.view(torch.int32)))
                    sec = graph_seconds(lambda: qmatvec_v3.matvec_v3(w.packed, xt, out, config=cfg[:3], rt=rt), 20, 1)[0]
                    sweep[str(list(cfg))] = {"us": sec * 1e6, "bitwise_equal_default": same}
                except Exception as e:  # noqa: BLE001
                    sweep[str(list(cfg))] = {"error": f"{type(e).__name__}: {e}"[:300]}
            r[f"T{T}_sweep"] = sweep
    return r


# the tilings each row bucket's sweep times (every one sums each output in the same order)
# (BN, num_warps, PIPE): qmatvec_v3.check_config. One row: no shared-memory pipelining (PIPE >= 2
# took 3-5x the plain loop's time on every shape, bench/reports/device-20261203/call2).
# Several rows: (BN, num_warps, PIPE, rows a program takes); a program's weight rows a thread are
# BN / (num_warps / 2) (two warps along a chunk's word pairs), so (16, 4, ...) is 8 of them. BN
# sets how often the activations are re-read from L2 (once per BN weight rows), the rows a program
# how often the weights are (once per RT activation rows).
SWEEP = {
    1: ((8, 4, 0), (16, 4, 0), (16, 4, 1), (16, 8, 0), (32, 4, 0), (32, 8, 0), (32, 8, 1), (64, 8, 0)),
    16: ((16, 4, 0, 4), (16, 8, 0, 4), (32, 8, 0, 4), (8, 4, 0, 4), (16, 4, 0, 2), (8, 2, 0, 4), (32, 8, 0, 2),
         (8, 4, 0, 2)),
}


def tuning_table(speed: list[dict]) -> list[dict]:
    """The sweep's winner per (format, row bucket, shape): v3_tuning.json's entries, only from
    configs whose outputs were bitwise those of the default tiling (several rows: with the rows a
    program takes)."""
    table = []
    for r in speed:
        for T in SWEEP:
            ok = {c: v["us"] for c, v in r.get(f"T{T}_sweep", {}).items() if v.get("bitwise_equal_default")}
            if ok:
                best = min(ok, key=ok.__getitem__)
                table.append({"fmt": r["fmt"], "rows": T, "n_out": r["n_out"], "n_in": r["n_in"],
                              "config": json.loads(best), "us": round(ok[best], 1)})
    return table


def i8_tuning_table(speed: list[dict], margin: float = 0.03) -> list[dict]:
    """The integer lane's sweep -> i8_tuning.json entries (qtile_i8.load_tuning's form): per shape
    and row bucket (8: the one-row times, 16, 64: the widest call's) the fastest of the tile's
    default, its swept tilings (one-row: split or walking its chunks; the ring's chunk groups "gN"
    and stream-K walks "skN" as the entry's group and stream), among those whose outputs were
    bitwise the default's. A candidate replaces the default only if `margin` faster (the sweep's
    times are one sample)."""
    from muser.engine.kernels import qtile_i8

    table = []
    for r in speed:
        tr = r.get("tile")
        if not isinstance(tr, dict) or "error" in tr or "T1" not in tr:
            continue
        big = max(int(k[1:]) for k in tr if k.startswith("T") and k[1:].isdigit())
        for bucket, T in ((8, 1), (16, 16), (64, big)):
            if f"T{T}" not in tr or not all(tr.get("bitwise_vs_reference", {}).values()):
                continue
            default = ({"path": "tile", "config": list(qtile_i8.config_for(T))}, tr[f"T{T}"]["us"])
            cands = [default]
            for key, v in tr.get("sweep", {}).items():
                head, _, rest = key.partition(" ")
                if head != f"T{T}" or not v.get("bitwise_equal_default"):
                    continue
                group = 1
                if " g" in rest:
                    rest, _, g = rest.rpartition(" g")
                    group = int(g)
                stream = 0
                if " sk" in rest:  # the stream-K walk, programs an SM
                    rest, _, k = rest.rpartition(" sk")
                    stream = int(k)
                walk = rest.endswith(" walk")
                rest = rest.removesuffix(" walk")
                ring = rest.endswith(" ring")
                e = {"path": "ring" if ring else "tile", "config": json.loads(rest.removesuffix(" ring"))}
                if walk:
                    e["split"] = False
                if group > 1:
                    e["group"] = group
                if stream:
                    e["stream"] = stream
                cands.append((e, v["us"]))
            best = min(cands, key=lambda c: c[1])
            if best[1] > (1.0 - margin) * default[1]:
                best = default
            table.append({"fmt": r["fmt"], "rows": bucket, "n_out": r["n_out"], "n_in": r["n_in"], **best[0],
                          "us": round(best[1], 1), "default_us": round(default[1], 1)})
    return table


# (BM, BN, num_warps, num_stages) of the split GEMM's tiles timed per row count (qgemm_split.check_tile_config)
# (a pair: the one-row CUDA-core kernel's (BN, num_warps)); tools/sass_loop.py split shows each one's registers
SPLIT_SWEEP = {1: ((16, 2), (32, 2), (32, 4), (16, 1), (2, 32, 2, 1)),
               8: ((8, 32, 2, 1), (8, 32, 2, 2)),
               16: ((16, 32, 2, 2), (16, 32, 2, 1), (16, 64, 4, 1)),
               512: ((16, 32, 2, 2), (16, 32, 2, 1), (16, 64, 4, 1))}
# the shapes swept: each format's largest traffic (FFN gate/up, FFN down, the LM head)
SPLIT_SWEEP_SHAPES = (("Q4_K", 39936, 6656), ("Q6_K", 6656, 19968), ("Q5_K", 202048, 6656))


def split_case(fmt_name: str, n_out: int, n_in: int, device: str, smoke: bool, sweep: bool) -> dict:
    """The split GEMM (kernels/qgemm_split.py) on one shape: the kernels bitwise against
    matmul_ref on a row subset, a row alone (CUDA-core kernel) bitwise equal to it inside 2, 16 and
    512 rows (tensor-core tiles), the error against the f32 dot of the decoded weights, and the time
    per launch at 1, 2, 16, 64 and 512 rows (activation split included, as the engine calls it)
    beside the v3 matvec's at 1 and 16 rows; `sweep`: the tile tilings of SPLIT_SWEEP."""
    import numpy as np
    import torch

    from muser.engine.kernels import qgemm_split as sg
    from muser.engine.kernels import qmatvec_v3
    from muser.engine.weights import random_bytes, repack
    from muser.gguf.types import GgmlType as G

    fmt = G[fmt_name]
    if smoke:
        n_out, n_in = min(n_out, 48), min(n_in, 512)
    raw = random_bytes(fmt, n_out, n_in, 3)
    w = repack("t", fmt, n_out, n_in, torch.from_numpy(raw.copy()).to(device))
    p = sg.pack(w)
    v3 = qmatvec_v3.pack(w)
    nbytes = p.nbytes
    big = 40 if smoke else 512
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(big, n_in, generator=g).to(device)
    x[:, 7] *= 30.0  # an outlier channel
    bits = lambda t: t.contiguous().view(torch.int32)  # noqa: E731
    r: dict = {"fmt": fmt_name, "n_out": n_out, "n_in": n_in, "weight_bytes": nbytes}
    act = sg.split_act(x)
    ra = sg.split_act_ref(x.cpu())
    r["split_act_bitwise_vs_ref"] = bool(torch.equal(act.a.cpu(), ra.a) and torch.equal(bits(act.s).cpu(), bits(ra.s))
                                         and torch.equal(act.bx16.cpu(), ra.bx16) and torch.equal(act.bx32.cpu(), ra.bx32))
    yb = sg.matmul(p, act)
    y16 = sg.matmul(p, x[:16].contiguous())
    y2 = sg.matmul(p, x[:2].contiguous())
    y1 = torch.cat([sg.matmul(p, x[i:i + 1].contiguous()) for i in range(4)])
    r["row_alone_equals_row_in_2_16_and_big"] = bool(torch.equal(bits(y1), bits(y16[:4])) and torch.equal(
        bits(y2), bits(y16[:2])) and torch.equal(bits(y16), bits(yb[:16])))
    rows = torch.arange(0, n_out, max(1, n_out // 48), device=device)
    sub = sg.SplitPacked("sub", fmt, int(rows.numel()), n_in, {k: v.index_select(0, rows) for k, v in p.fields.items()})
    act16 = sg.split_act(x[:16].contiguous())
    ref = sg.matmul_ref(sub, act16)
    got = y16.index_select(1, rows)
    r["bitwise_vs_matmul_ref"] = bool(torch.equal(bits(got), bits(ref)))
    dec = sg.decode(sub).double()
    exact = x[:16].double() @ dec.T
    mag = x[:16].double().abs() @ dec.abs().T
    r["max_err_over_sum_abs"] = float(((got.double() - exact).abs() / mag.clamp_min(1e-30)).max())
    for T in sorted({1, 2, 8, 16, min(64, big), big}):
        xt = x[:T].contiguous()
        out = torch.empty(T, n_out, device=device)
        samples = call_seconds(lambda: sg.matmul(p, xt, out), device, 20 if T <= 64 else 5)
        mean = float(np.mean(samples))
        r[f"T{T}"] = {"us": mean * 1e6, "cv": float(np.std(samples) / mean) if len(samples) > 1 else None,
                      "samples_s": samples, "GBps": nbytes / mean / 1e9, "TOPS": 2.0 * T * n_out * n_in / mean / 1e12}
        if T in (1, 16):
            o3 = torch.empty(T, n_out, device=device)
            s3 = call_seconds(lambda: qmatvec_v3.matvec_v3(v3, xt, o3), device, 20)
            r[f"v3_T{T}_us"] = float(np.mean(s3)) * 1e6
    r["T16_over_T1"] = r["T16"]["us"] / r["T1"]["us"]
    if sweep and device == "cuda":
        sw = {}
        for T, cfgs in SPLIT_SWEEP.items():
            xt = x[:T].contiguous()
            at = sg.split_act(xt)
            ref_y = {1: y1[:1], 16: y16}.get(T, yb[:T])
            for cfg in cfgs:
                try:
                    out = torch.empty(T, n_out, device=device)
                    same = bool(torch.equal(bits(sg.matmul(p, at, out, config=cfg)), bits(ref_y)))
                    sec = graph_seconds(lambda: sg.matmul(p, at, out, config=cfg), 3 if T > 16 else 10, 1)[0]
                    sw[f"T{T} {list(cfg)}"] = {"us": sec * 1e6, "bitwise_equal_default": same}
                except Exception as e:  # noqa: BLE001
                    sw[f"T{T} {list(cfg)}"] = {"error": f"{type(e).__name__}: {e}"[:300]}
        r["sweep"] = sw
    return r


def i8_case(fmt_name: str, n_out: int, n_in: int, device: str, smoke: bool) -> dict:
    """The integer lane's GEMM on one shape: bitwise against matmul_ggml on 64 output rows, a row
    alone against it inside 16 and 512 rows, and the time per launch at 1, 16, 64 and 512 rows."""
    import numpy as np
    import torch

    from muser.engine.kernels import qmatmul_i8
    from muser.engine.weights import random_bytes, repack
    from muser.gguf.types import GgmlType as G
    from muser.quant.dot import matmul_ggml

    fmt = G[fmt_name]
    if smoke:
        n_out, n_in = min(n_out, 64), min(n_in, 512)
    raw = random_bytes(fmt, n_out, n_in, 3)
    w = repack("t", fmt, n_out, n_in, torch.from_numpy(raw.copy()).to(device))
    nbytes = sum(t.numel() * t.element_size() for t in w.fields.values())
    big = 64 if smoke else 512
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(big, n_in, generator=g).to(device)
    r: dict = {"fmt": fmt_name, "n_out": n_out, "n_in": n_in, "weight_bytes": nbytes}
    yb = qmatmul_i8.matmul_i8(w, x)
    y16 = qmatmul_i8.matmul_i8(w, x[:16].contiguous())
    y1 = torch.cat([qmatmul_i8.matmul_i8(w, x[i:i + 1].contiguous()) for i in range(4)])
    bits = lambda t: t.contiguous().view(torch.int32)  # noqa: E731
    r["row_alone_equals_row_in_16_and_big"] = bool(torch.equal(bits(y1), bits(y16[:4])) and
                                                   torch.equal(bits(y16), bits(yb[:16])))
    rows = np.arange(0, n_out, max(1, n_out // 64))
    ref = matmul_ggml(raw[rows], fmt, x[:16].cpu().numpy())  # [16, 64]: the lane's contract
    got = y16[:, torch.from_numpy(rows).to(device)].cpu().numpy()
    r["bitwise_vs_matmul_ggml"] = bool(np.array_equal(got.view(np.int32), ref.view(np.int32)))
    r["max_abs_delta_vs_matmul_ggml"] = float(np.abs(got - ref).max())
    for T in (1, 16, 64, big):
        xt = x[:T].contiguous()
        out = torch.empty(T, n_out, device=device)
        samples = call_seconds(lambda: qmatmul_i8.matmul_i8(w, xt, out), device, 20 if T <= 64 else 5)
        mean = float(np.mean(samples))
        r[f"T{T}"] = {"us": mean * 1e6, "cv": float(np.std(samples) / mean) if len(samples) > 1 else None,
                      "samples_s": samples, "GBps": nbytes / mean / 1e9,
                      "TOPS": 2.0 * T * n_out * n_in / mean / 1e12}
    r["T16_over_T1"] = r["T16"]["us"] / r["T1"]["us"]
    if device == "cuda":  # tilings of the one-row and the wide call: speed only, never bits
        sweep = {}
        for T, cfgs in ((1, [(16, n, w_, s) for n in (16, 32) for w_ in (1, 2) for s in (2, 4)]),
                        (big, [(16, 16, 1, 4), (16, 32, 1, 4), (16, 32, 2, 3), (32, 32, 2, 3), (64, 64, 4, 3)])):
            xt, ref_y = x[:T].contiguous(), (y1[:1] if T == 1 else yb)
            for cfg in cfgs:
                try:
                    out = torch.empty(T, n_out, device=device)
                    got = qmatmul_i8.matmul_i8(w, xt, out, config=cfg)
                    same = bool(torch.equal(bits(got), bits(ref_y)))
                    sec = graph_seconds(lambda: qmatmul_i8.matmul_i8(w, xt, out, config=cfg), 10 if T == 1 else 3, 1)[0]
                    sweep[f"T{T} {list(cfg)}"] = {"us": sec * 1e6, "bitwise_equal_default": same}
                except Exception as e:  # noqa: BLE001
                    sweep[f"T{T} {list(cfg)}"] = {"error": f"{type(e).__name__}: {e}"[:300]}
        r["sweep"] = sweep
    from muser.engine.kernels import qtile_i8

    if qtile_i8.supports(fmt) and qtile_i8.available(device):
        try:  # a tile that fails to build or run is reported, and the reference's figures stay
            r["tile"] = tile_part(w, x, yb, raw, rows, ref, nbytes, device)
        except Exception:  # noqa: BLE001
            r["tile"] = {"error": traceback.format_exc()[-2000:]}
    return r


def where_differ(got, want) -> dict:
    """Where two int32 views of (rows, outputs) differ: the count, the first few indices, the
    differing rows (and their residues mod 8, a decode tile's width) and outputs (their residues
    mod 64 and 64-wide blocks, a weight tile's), to read an index-math fault off."""
    bad = (got != want).nonzero()
    if bad.numel() == 0:
        return {"differing": 0}
    r, c = bad[:, 0], bad[:, 1]
    return {"differing": int(bad.shape[0]), "of": int(got.numel()), "first": bad[:8].tolist(),
            "rows": sorted(set(r.tolist()))[:32], "out_mod64": sorted(set((c % 64).tolist()))[:64],
            "out_blocks64": sorted(set((c // 64).tolist()))[:16], "rows_mod8": sorted(set((r % 8).tolist()))}


def waves_probe(w, act, device: str, config=(64, 16, 4, 4)) -> dict:
    """Whether a walked 16-row call is paced by its last wave: the ring walking its chunks
    (`config`) on the weight's first k x SMs x BN rows (k = 1, 2, 3: every program of one wave at k
    programs an SM) and on all of them; each timed alone (a graph of 10 launches), with the
    weight bytes a microsecond. A call whose programs all run at once streams at the full-wave
    rate; one paced by an underfilled last wave takes about as long as the next whole wave.
    Shapes with fewer than 2 x SMs tiles are not probed."""
    import torch

    from muser.engine.kernels import qtile_i8
    from muser.engine.weights import QWeight

    sms = torch.cuda.get_device_properties(device).multi_processor_count
    bn = config[0]
    if w.n_out < 2 * sms * bn:
        return {}
    res: dict = {"config": list(config), "sms": sms}
    for n in sorted({k * sms * bn for k in (1, 2, 3) if k * sms * bn <= w.n_out} | {w.n_out}):
        part = QWeight(w.name, w.fmt, n, w.n_in, {k: v[:n] for k, v in w.fields.items()})
        nbytes = sum(v.numel() * v.element_size() for v in part.fields.values())
        try:
            out = torch.empty(act.rows, n, device=device)
            sec = graph_seconds(lambda: qtile_i8.matmul_ring(part, act, out, config=config, split=False), 10, 3)
            us = min(sec) * 1e6
            res[f"N{n}"] = {"tiles": -(-n // bn), "us": us, "GBps": nbytes / us / 1e3}
        except Exception as e:  # noqa: BLE001
            res[f"N{n}"] = {"error": f"{type(e).__name__}: {e}"[:300]}
    return res


def stream_probe(w, act, device: str, config=(64, 16, 4, 4), stream: int = 3) -> dict:
    """Whether the stream-K walk's programs all stream at once: the walk (`config`, `stream`
    programs an SM) on 1, 2, ... `stream` programs an SM (P = k x SMs, at most the call's units),
    each timed alone (a graph of 10 launches), with the weight bytes a microsecond. If `stream`
    programs an SM are resident, the time falls as P grows, each program's run shorter; if fewer
    are, the last P's programs run in two waves and its time rises again. Shapes of fewer tiles
    than SMs are not probed."""
    import torch

    from muser.engine.kernels import qtile_i8

    sms = torch.cuda.get_device_properties(device).multi_processor_count
    bn = config[0]
    if w.n_out < sms * bn:
        return {}
    nbytes = sum(v.numel() * v.element_size() for v in w.fields.values())
    res: dict = {"config": list(config), "stream": stream, "sms": sms}
    out = torch.empty(act.rows, w.n_out, device=device)
    for k in range(1, stream + 1):
        try:
            sec = graph_seconds(lambda: qtile_i8.matmul_ring(w, act, out, config=config, split=False, stream=stream,
                                                             programs=k * sms), 10, 3)
            us = min(sec) * 1e6
            res[f"P{k * sms}"] = {"us": us, "GBps": nbytes / us / 1e3}
        except Exception as e:  # noqa: BLE001
            res[f"P{k * sms}"] = {"error": f"{type(e).__name__}: {e}"[:300]}
    return res


def residency() -> list[dict]:
    """Every int8 tile and ring variant this process compiled: its registers, spilled bytes, shared
    memory, warps, and the programs an SM the driver can keep resident at once
    (cuOccupancyMaxActiveBlocksPerMultiprocessor on the loaded function)."""
    import ctypes

    import torch

    from muser.engine.kernels import qtile_i8

    cuda = ctypes.CDLL("libcuda.so.1")
    dev = torch.cuda.current_device()
    rows = []
    for jit in (qtile_i8._qtile_kernel, qtile_i8._ring_kernel, qtile_i8._ring_sk_kernel):
        for key, ck in list(jit.device_caches[dev][0].items()):
            try:
                ck._init_handles()
                md = ck.metadata
                n = ctypes.c_int(0)
                rc = cuda.cuOccupancyMaxActiveBlocksPerMultiprocessor(
                    ctypes.byref(n), ctypes.c_void_p(ck.function), ctypes.c_int(md.num_warps * 32),
                    ctypes.c_size_t(md.shared))
                rows.append({"kernel": ck.name, "constants": str(key)[-240:], "regs": ck.n_regs,
                             "spills": ck.n_spills, "shared": md.shared, "warps": md.num_warps,
                             "programs_per_sm": n.value if rc == 0 else f"CUresult {rc}"})
            except Exception as e:  # noqa: BLE001
                rows.append({"kernel": getattr(ck, "name", "?"), "error": f"{type(e).__name__}: {e}"[:300]})
    return rows


def tile_part(w, x, yb, raw, rows, ref, nbytes: int, device: str) -> dict:
    """The int8 tile (kernels/qtile_i8.py) on one shape beside its reference (qmatmul_i8, the
    default-tiled `yb` of every row): bitwise against matmul_ggml (`ref` on output rows `rows`) and
    against the reference at 1, 16 and all rows, its time per launch at 1, 16, 64 and all rows, and
    tilings swept (speed only; each one's bits compared with the default's)."""
    import numpy as np
    import torch

    from muser.engine.kernels import qmatmul_i8, qtile_i8
    from muser.gguf.types import GgmlType as G

    big = x.shape[0]
    bits = lambda t: t.contiguous().view(torch.int32)  # noqa: E731
    acts = {T: qmatmul_i8.quantize_act(x[:T].contiguous(), G.Q8_K) for T in (1, 16, 64, big)}
    t: dict = {}
    y16 = qtile_i8.matmul_tile(w, acts[16])
    got = y16[:, torch.from_numpy(rows).to(device)].cpu().numpy()
    t["bitwise_vs_matmul_ggml"] = bool(np.array_equal(got.view(np.int32), ref.view(np.int32)))
    t["max_abs_delta_vs_matmul_ggml"] = float(np.abs(got - ref).max())
    same = {}
    for T in (1, 16, big):
        y = y16 if T == 16 else qtile_i8.matmul_tile(w, acts[T])
        same[f"T{T}"] = bool(torch.equal(bits(y), bits(yb[:T])))
        if not same[f"T{T}"]:
            t[f"where_differ_T{T}"] = where_differ(bits(y), bits(yb[:T]))
    t["bitwise_vs_reference"] = same
    for T in (1, 16, 64, big):
        out = torch.empty(T, w.n_out, device=device)
        samples = graph_seconds(lambda: qtile_i8.matmul_tile(w, acts[T], out), 20 if T <= 64 else 3, 5)
        mean = float(np.mean(samples))
        t[f"T{T}"] = {"us": mean * 1e6, "cv": float(np.std(samples) / mean), "samples_s": samples,
                      "GBps": nbytes / mean / 1e9, "TOPS": 2.0 * T * w.n_out * w.n_in / mean / 1e12}
    t["T16_over_T1"] = t["T16"]["us"] / t["T1"]["us"]
    sweep = {}
    # Tile tilings beside the defaults: at one row the one-warp tile. (Tilings that lost on every
    # full-geometry shape of earlier sweeps are no longer timed, so the stage stays in its box: at
    # 16 rows one m-tile a warp over two and four warps and the walking tile, at 512 rows the
    # 16-row activation tiles with and without PF; the ring took those buckets: bench/NOTES.md.)
    for T, cfgs in ((1, [(16, 8, 1, 1)]),):
        for cfg in cfgs:
            try:
                out = torch.empty(T, w.n_out, device=device)
                got_t = qtile_i8.matmul_tile(w, acts[T], out, config=cfg)
                eq = bool(torch.equal(bits(got_t), bits(yb[:T])))
                sec = graph_seconds(lambda: qtile_i8.matmul_tile(w, acts[T], out, config=cfg), 10 if T <= 16 else 3, 1)[0]
                sweep[f"T{T} {list(cfg)}"] = {"us": sec * 1e6, "bitwise_equal_default": eq}
            except Exception as e:  # noqa: BLE001
                sweep[f"T{T} {list(cfg)}"] = {"error": f"{type(e).__name__}: {e}"[:300]}
    # the ring variant (a program's next S - 1 blocks copied into shared memory ahead of its IMMAs):
    # split as the tile (one program a chunk, or a group of g chunks, each its own partial) and
    # walking its chunks (the ring runs across them); at 16 rows also walking 32-row weight tiles
    # (twice the programs: fewer idle SM slots in the last wave) and 8-row activation tiles (six
    # slots and 128-row tiles were slower on the gate/up and Q6_K down shapes at 16 rows; three and
    # six slots lost to four at 512 on every shape; groups lost at one row: bench/NOTES.md)
    # and, walking at 1 and 16 rows, the stream-K walk (sk k: k programs an SM, each an equal run of
    # the (tile, chunk) units: no last wave of whole tiles; sk8 on (32, 16, 2, 3), registers capped
    # at 128, lost to sk6 by 28-56 % on both FFN downs: spills in the loop, and Q6_K's rings do not
    # fit eight an SM: bench/NOTES.md)
    for T, cfg, split, group, sk in ((1, (64, 8, 4, 4), None, 1, 0), (1, (32, 8, 2, 4), False, 1, 0),
                                     (16, (64, 16, 4, 4), None, 1, 0), (16, (32, 16, 2, 4), None, 1, 0),
                                     (16, (64, 16, 4, 4), None, 2, 0), (16, (64, 16, 4, 4), None, 4, 0),
                                     (16, (64, 16, 4, 4), False, 1, 0), (16, (64, 16, 4, 3), False, 1, 0),
                                     (16, (32, 16, 2, 4), False, 1, 0), (16, (32, 16, 2, 3), False, 1, 0),
                                     (16, (32, 8, 2, 4), False, 1, 0),
                                     (16, (64, 16, 4, 4), False, 1, 3), (16, (64, 16, 4, 4), False, 1, 2),
                                     (16, (32, 16, 2, 3), False, 1, 6),
                                     (1, (64, 16, 4, 4), False, 1, 3), (1, (32, 8, 2, 4), False, 1, 6),
                                     (big, (64, 16, 4, 4), False, 1, 0)):
        key = (f"T{T} {list(cfg)} ring" + (" walk" if split is False else "") + (f" sk{sk}" if sk else "")
               + (f" g{group}" if group > 1 else ""))
        try:
            out = torch.empty(T, w.n_out, device=device)
            got_t = qtile_i8.matmul_ring(w, acts[T], out, config=cfg, split=split, group=group, stream=sk)
            eq = bool(torch.equal(bits(got_t), bits(yb[:T])))
            sec = graph_seconds(lambda: qtile_i8.matmul_ring(w, acts[T], out, config=cfg, split=split, group=group,
                                                             stream=sk), 10 if T <= 16 else 3, 1)[0]
            sweep[key] = {"us": sec * 1e6, "bitwise_equal_default": eq}
            if not eq:
                sweep[key]["where_differ"] = where_differ(bits(got_t), bits(yb[:T]))
        except Exception as e:  # noqa: BLE001
            sweep[key] = {"error": f"{type(e).__name__}: {e}"[:300]}
    t["sweep"] = sweep
    t["waves"] = waves_probe(w, acts[16], device)
    t["stream_probe"] = stream_probe(w, acts[16], device)
    return t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget", type=float, default=140.0, help="wall seconds; cases past it are skipped")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, few cases (the CPU dry run)")
    ap.add_argument("--no-invariance", action="store_true",
                    help="part 2 only (the kernels' timings and tilings; part 1 ran on this tree before)")
    ap.add_argument("--lane", default="exact", choices=("exact", "fast", "split"),
                    help="fast: the integer lane's engines and its GEMM (kernels/qmatmul_i8.py)")
    ap.add_argument("--shapes", default=None,
                    help="FMT:N_OUT:N_IN,...: only these of the full geometry's shapes (part 2)")
    ap.add_argument("--before", default=None,
                    help="an earlier qmatvec_v3 module file: its 4- and 16-row calls timed beside this one's, "
                         "bits compared")
    a = ap.parse_args(argv)
    t0 = time.time()
    if a.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
        from muser.engine.kernels.interpreter import interpreter_compat

        interpreter_compat()
    import torch

    from muser.engine.kernels import qmatvec_v3

    before = None
    if a.before:  # a module beside this tree's, in its package (its relative imports resolve)
        import importlib.util

        spec = importlib.util.spec_from_file_location("muser.engine.kernels._v3_before", a.before)
        assert spec is not None and spec.loader is not None, a.before
        before = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = before  # its dataclasses look their module up
        spec.loader.exec_module(before)
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(os.environ.get("MUSER_DEVICE_WORK", "/tmp/muser-dev")) / "kernels"
    work.mkdir(parents=True, exist_ok=True)
    rec: dict = {"device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu (Triton interpreter)",
                 "torch": torch.__version__, "smoke": a.smoke, "invariance": [], "speed": [], "skipped": []}

    def save():
        rec["seconds"] = round(time.time() - t0, 1)
        (out_dir / "device-kernels.json").write_text(json.dumps(rec, indent=1) + "\n")

    dtypes = {"exact": DTYPES, "split": SPLIT_DTYPES}.get(a.lane, tuple(d for d in DTYPES if not d.startswith("nvfp4")))
    cases = [(d, kv) for d in (("Q8_0", "Q4_K") if a.smoke else dtypes) for kv in ("f16", "f32")]
    if a.no_invariance:
        rec["skipped"].append("invariance: --no-invariance")
        cases = []
    for dtype, kv in cases:
        if time.time() - t0 > a.budget * (0.6 if a.lane != "fast" else 0.45):
            rec["skipped"].append(f"invariance {dtype}/{kv}: budget")
            continue
        try:
            r = invariance_case(dtype, kv, a.device, work, a.smoke, a.lane)
        except Exception as e:  # noqa: BLE001 - every case is recorded, the stage goes on
            r = {"dtype": dtype, "kv": kv, "ok": False, "error": f"{type(e).__name__}: {e}",
                 "trace": traceback.format_exc()[-2000:]}
        rec["invariance"].append(r)
        cells = " ".join(f"{k}=bitwise" if v["bitwise"] else f"{k}={v['max_abs_delta']:.3g}"
                         for k, v in r.items() if isinstance(v, dict) and "bitwise" in v)
        print(f"invariance {dtype:10} kv {kv}: ok={r['ok']} {cells or r.get('error', '')}", flush=True)
        save()
    if a.device == "cuda" and cases:
        r = capture_beside_collection()
        r.update({"dtype": "capture beside a collection", "kv": "-"})
        rec["invariance"].append(r)
        print(f"capture beside a collection: ok={r['ok']} guarded {r['guarded']} unguarded {r['unguarded']}",
              flush=True)
        save()
    shapes = sorted({(f, n_out, n_in) for (f, _, n_out, n_in) in qmatvec_v3.TUNED if f != "NVFP4"})
    # the same shapes in ggml's NVFP4 (type 40): the storage lane's bytes per second beside the K-quants'
    shapes += sorted({("NVFP4", n_out, n_in) for (_, n_out, n_in) in shapes if n_out >= 4096})
    if a.lane in ("fast", "split"):
        shapes = sorted({(f, n_out, n_in) for (f, _, n_out, n_in) in qmatvec_v3.TUNED if f != "NVFP4"})
    if a.lane == "split":  # the swept shapes first (the stage's budget may skip the last)
        shapes = [s for s in SPLIT_SWEEP_SHAPES if s in shapes] + [s for s in shapes if s not in SPLIT_SWEEP_SHAPES]
    if a.smoke:
        shapes = shapes[:2] + [("Q8_0", 64, 512)]
    if a.shapes:
        want = [(f, int(n), int(k)) for f, n, k in (x.split(":") for x in a.shapes.split(","))]
        missing = [w for w in want if w not in shapes]
        if missing:
            ap.error(f"--shapes {missing}: not among this lane's shapes {shapes}")
        shapes = want
    for fmt, n_out, n_in in shapes:
        if a.lane == "split":
            if time.time() - t0 > a.budget:
                rec["skipped"].append(f"split {fmt} {n_out}x{n_in}: budget")
                continue
            try:
                r = split_case(fmt, n_out, n_in, a.device, a.smoke, sweep=(fmt, n_out, n_in) in SPLIT_SWEEP_SHAPES)
                big = max(int(k[1:]) for k in r if k.startswith("T") and k[1:].isdigit())
                print(f"split {fmt} {n_out}x{n_in}: T1 {r['T1']['us']:.1f} us {r['T1']['GBps']:.0f} GB/s "
                      f"(v3 {r['v3_T1_us']:.1f}), T2 {r['T2']['us']:.1f}, T8 {r['T8']['us']:.1f}, T16 {r['T16']['us']:.1f} us "
                      f"({r['T16_over_T1']:.2f}x; v3 {r['v3_T16_us']:.1f}), T{big} {r[f'T{big}']['TOPS']:.1f} TOPS, "
                      f"bitwise vs ref {r['bitwise_vs_matmul_ref']}, act {r['split_act_bitwise_vs_ref']}, "
                      f"alone==in2==in16==in{big} {r['row_alone_equals_row_in_2_16_and_big']}, "
                      f"err {r['max_err_over_sum_abs']:.2e}", flush=True)
                if "sweep" in r:
                    print("  sweep " + ", ".join(f"{k}: {v.get('us', 0):.1f} us {v.get('bitwise_equal_default', v.get('error'))}"
                                                 for k, v in r["sweep"].items()), flush=True)
            except Exception as e:  # noqa: BLE001
                r = {"fmt": fmt, "n_out": n_out, "n_in": n_in, "error": f"{type(e).__name__}: {e}",
                     "trace": traceback.format_exc()[-2000:]}
                print(f"split {fmt} {n_out}x{n_in}: {r['error']}", flush=True)
            rec["split"] = rec.get("split", []) + [r]
            save()
            continue
        if a.lane == "fast":
            if time.time() - t0 > a.budget:
                rec["skipped"].append(f"i8 {fmt} {n_out}x{n_in}: budget")
                continue
            try:
                r = i8_case(fmt, n_out, n_in, a.device, a.smoke)
                big = max(int(k[1:]) for k in r if k.startswith("T") and k[1:].isdigit())
                print(f"i8 {fmt} {n_out}x{n_in}: T1 {r['T1']['us']:.1f} us {r['T1']['GBps']:.0f} GB/s, "
                      f"T16 {r['T16']['us']:.1f} us ({r['T16_over_T1']:.2f}x), T{big} {r[f'T{big}']['TOPS']:.1f} TOPS, "
                      f"bitwise vs matmul_ggml {r['bitwise_vs_matmul_ggml']}, alone==in16==in{big} "
                      f"{r['row_alone_equals_row_in_16_and_big']}", flush=True)
                if "tile" in r and "error" in r["tile"]:
                    print(f"  tile: {r['tile']['error']}", flush=True)
                elif "tile" in r:
                    tr = r["tile"]
                    for k in [k for k in tr if k.startswith("where_differ")]:
                        print(f"  tile {k}: {tr[k]}", flush=True)
                    print(f"  tile: T1 {tr['T1']['us']:.1f} us {tr['T1']['GBps']:.0f} GB/s, T16 {tr['T16']['us']:.1f} us "
                          f"({tr['T16_over_T1']:.2f}x), T{big} {tr[f'T{big}']['us']:.1f} us {tr[f'T{big}']['TOPS']:.1f} TOPS, "
                          f"bitwise vs matmul_ggml {tr['bitwise_vs_matmul_ggml']}, vs reference "
                          f"{tr['bitwise_vs_reference']}", flush=True)
                    print("  tile sweep " + ", ".join(f"{k}: {v.get('us', 0):.1f} us {v.get('bitwise_equal_default', v.get('error'))}"
                                                      for k, v in tr["sweep"].items()), flush=True)
                    if tr.get("waves"):
                        print("  waves (ring walk, 16 rows) " + ", ".join(
                            f"{k} ({v.get('tiles')} tiles): {v.get('us', 0):.1f} us {v.get('GBps', 0):.0f} GB/s"
                            for k, v in tr["waves"].items() if k.startswith("N")), flush=True)
                    if tr.get("stream_probe"):
                        print("  stream-K walk (16 rows) by programs " + ", ".join(
                            f"{k}: {v.get('us', 0):.1f} us {v.get('GBps', 0):.0f} GB/s"
                            for k, v in tr["stream_probe"].items() if k.startswith("P")), flush=True)
            except Exception as e:  # noqa: BLE001
                r = {"fmt": fmt, "n_out": n_out, "n_in": n_in, "error": f"{type(e).__name__}: {e}",
                     "trace": traceback.format_exc()[-2000:]}
                print(f"i8 {fmt} {n_out}x{n_in}: {r['error']}", flush=True)
            rec["speed"].append(r)
            try:  # the variants compiled so far: registers, spills and programs an SM
                rec["residency"] = residency()
            except Exception as e:  # noqa: BLE001
                rec["residency"] = [{"error": f"{type(e).__name__}: {e}"[:300]}]
            i8_table = i8_tuning_table(rec["speed"])
            if i8_table:  # the sweep's winners so far, in i8_tuning.json's form
                (out_dir / "i8_tuning.json").write_text(json.dumps(i8_table, indent=1) + "\n")
            save()
            continue
        if time.time() - t0 > a.budget:
            rec["skipped"].append(f"speed {fmt} {n_out}x{n_in}: budget")
            continue
        try:
            r = speed_case(fmt, n_out, n_in, a.device, a.smoke, before)
            was = "".join(f", before T{T} {r[f'before_T{T}']['us']:.1f} us (bits equal {r[f'before_T{T}']['bitwise_equal_now']})"
                          for T in (4, 16) if f"before_T{T}" in r)
            print(f"matvec {fmt} {n_out}x{n_in}: T1 {r['T1']['us']:.1f} us {r['T1']['GBps']:.0f} GB/s, "
                  f"T4 {r['T4']['us']:.1f}, T16 {r['T16']['us']:.1f} us ({r['T16_over_T1']:.2f}x){was}, alone==in16 "
                  f"{r['row_alone_equals_row_in_16']}, err {r['max_err_over_sum_abs']:.2e}", flush=True)
            if "T16_sweep" in r:
                print("  T16 sweep " + ", ".join(f"{k}: {v.get('us', 0):.1f} us {v.get('bitwise_equal_default', v.get('error'))}"
                                                 for k, v in r["T16_sweep"].items()), flush=True)
        except Exception as e:  # noqa: BLE001
            r = {"fmt": fmt, "n_out": n_out, "n_in": n_in, "error": f"{type(e).__name__}: {e}",
                 "trace": traceback.format_exc()[-2000:]}
            print(f"matvec {fmt} {n_out}x{n_in}: {r['error']}", flush=True)
        rec["speed"].append(r)
        table = tuning_table(rec["speed"])
        if table:  # the sweep's winners so far, in v3_tuning.json's form
            (out_dir / "v3_tuning.json").write_text(json.dumps(table, indent=1) + "\n")
        save()
    if a.device == "cuda" and a.lane == "exact":  # the explicit-layout int8 tile (informational, not gated)
        try:
            sys.path.insert(0, str(REPO / "tools"))
            import sass_gluon_tile

            rec["gluon_tile"] = [sass_gluon_tile.probe(), sass_gluon_tile.probe(bn=128, bk=128),
                                 sass_gluon_tile.probe(bn=128, bk=128, scaled=True)]
            for g in rec["gluon_tile"]:
                print(f"gluon int8 tile {g['config']} scaled {g['scaled']}: {g['tile_us']:.1f} us, {g['tile_GBps']:.0f} GB/s of weight "
                      f"bytes (copy {g['copy_read_write_GBps']:.0f} GB/s read + write), exact {g['exact_vs_f64']}",
                      flush=True)
        except Exception as e:  # noqa: BLE001
            rec["gluon_tile"] = {"error": f"{type(e).__name__}: {e}"[:500], "trace": traceback.format_exc()[-2000:]}
            print(f"gluon int8 tile: {rec['gluon_tile']['error']}", flush=True)
        save()
    if a.device == "cuda":  # attention, both operand kinds: against the reference, invariance, time
        import subprocess

        aj = out_dir / "attn.json"
        try:
            p = subprocess.run([sys.executable, str(REPO / "tools" / "device_attn.py"), "--json", str(aj)],
                               capture_output=True, text=True, timeout=max(30.0, a.budget + 60 - (time.time() - t0)))
            print(p.stdout[-3000:], p.stderr[-2000:], flush=True)
            rec["attention"] = json.loads(aj.read_text()) if aj.is_file() else {"rc": p.returncode}
        except subprocess.TimeoutExpired:
            rec["skipped"].append("attention: budget")
        save()
    if a.lane == "fast":
        rec["ok"] = all(r.get("ok") for r in rec["invariance"]) and all(
            r.get("row_alone_equals_row_in_16_and_big") and r.get("bitwise_vs_matmul_ggml")
            and (r["tile"].get("bitwise_vs_matmul_ggml", False) and all(r["tile"].get("bitwise_vs_reference", {0: False}).values())
                 if "tile" in r else True) for r in rec["speed"])
    elif a.lane == "split":
        rec["ok"] = all(r.get("ok") for r in rec["invariance"]) and bool(rec.get("split")) and all(
            r.get("row_alone_equals_row_in_2_16_and_big") and r.get("bitwise_vs_matmul_ref")
            and r.get("split_act_bitwise_vs_ref") for r in rec.get("split", []))
    else:
        rec["ok"] = all(r.get("ok") for r in rec["invariance"]) and all(
            r.get("row_alone_equals_row_in_16") for r in rec["speed"])
    save()
    from muser.bench.receipt import device_description, write_receipt

    checked = {f"{r['dtype']}/{r['kv']}": r.get("ok", False) for r in rec["invariance"]}
    gate = {"status": ("partial" if rec["skipped"] else "pass") if rec["ok"] else "fail",
            "rule": ("logits of every position bitwise equal decoded alone, verified in blocks, prefilled in "
                     "chunks of any size and stepped beside other sessions; each matvec shape's row alone bitwise "
                     "equal to it inside 16 rows"
                     if a.lane == "exact" else
                     "logits of every position bitwise equal decoded alone, verified in blocks, prefilled in "
                     "chunks of any size and stepped beside other sessions; each split GEMM shape bitwise equal to "
                     "matmul_ref on a row subset, its activation digits bitwise the reference's, and a row alone "
                     "bitwise equal to it inside 2, 16 and 512 rows" if a.lane == "split" else
                     "logits of every position bitwise equal decoded alone, verified in blocks, prefilled in "
                     "chunks of any size and stepped beside other sessions; each GEMM shape bitwise equal to "
                     "matmul_ggml on a row subset and a row alone bitwise equal to it inside 16 and 512 rows; "
                     "the K-quant int8 tile (the lane's CUDA path for them) bitwise matmul_ggml on the row subset "
                     "and bitwise its reference at 1, 16 and 512 rows"),
            "per_case": checked, "skipped": rec["skipped"]}
    receipt = write_receipt(f"kernels-{a.device}", model={"fixtures": "muser.model.synth default widths per dtype; "
                                                             "the full geometry's matvec shapes (random blocks)"},
                            device=device_description(a.device), lane=a.lane, gate=gate, results=rec,
                            out_dir=out_dir.parent if out_dir.name == "kernels" else out_dir)
    print(f"device_kernels: ok={rec['ok']} in {time.time() - t0:.0f} s -> {out_dir / 'device-kernels.json'}; "
          f"receipt {receipt}")
    return 0 if rec["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
