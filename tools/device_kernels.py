#!/usr/bin/env python3
"""The exact lane's GEMM family (kernels/qgemm.py) on the H200, in one call of <= ~150 s:

1. compare  - per format (F32 F16 BF16 Q8_0 Q4_0 Q4_K Q5_K Q6_K): the Triton GEMM vs the f64
              matmul of the decoded weight at 1, 16, 17 and 512 rows (max error relative to
              sum |x w|), and inside the GEMM: each probed row alone vs inside the 16- and
              512-row launches, bitwise (the N tile and the K-chunk programs change with the
              row count; the K order must not), and one row under every N tile / warps / split
              choice, bitwise. A 64-row M tile is probed too (reported only: the engine fixes 16).
2. invariance - bitwise row invariance on the engine: every position's logits decoded alone
              vs verified in blocks of 2..16 vs prefilled in chunks of 64 and 512 vs stepped
              beside another session (Engine.step), both K/V types, over a sequence that wraps
              every sliding ring (> 2 x window), on the shipped micro model
              (models/muse-glimmer-micro-q8_0.gguf).
3. bench    - full-geometry layer shapes (tools/make_fixture.py --full: QKV|gate stack,
              attn_output, ffn gate|up, ffn_down, lm_head), random Q4_K / Q6_K weights built
              on the GPU (no file): time of 1 vs 16 vs 512 rows per shape (CUDA events,
              weights rotated past the L2), achieved GB/s of the weight bytes; at 1 row a sweep
              of N tile x warps beside the default config.
4. gate2    - Gate 2 on CUDA (f32 and f16 K/V) for the micro model (and --gate-dtypes fixtures).
5. fixtures - stage 2 on a tiny fixture of every dtype (tools/make_fixture.py's writer,
              muser.model.synth; written to --workdir unless already there), blocks 2, 5, 16.

    python3 tools/device_kernels.py --out DIR [--budget 150] [--device cuda|cpu] [--smoke]
                                    [--stages compare,invariance,bench,gate2,fixtures] [--gate-tokens 256]

Stages run in the order given (default: as numbered). Output: DIR/kernels.json (one object per
stage, each with its status, rewritten after every stage) and a table on stdout.
Every stage is in its own try/except and checks the remaining budget. --device cpu --smoke
runs tiny shapes under the Triton interpreter (TRITON_INTERPRET=1), as tests/engine does.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

# Full geometry (muser.model.synth FULL_GEOMETRY): hidden, attn_dim, kv_dim, ffn, vocab.
H, A, KV, FF, V = 6656, 32 * 128, 2 * 128, 19968, 202048
BENCH = [  # (name, format, n_out, n_in): the engine's launches per layer and the LM head
    ("attn_q|k|v|gate", "Q4_K", 2 * A + 2 * KV, H),
    ("attn_output", "Q4_K", H, A),
    ("ffn_gate|up", "Q4_K", 2 * FF, H),
    ("ffn_down", "Q6_K", H, FF),
    ("lm_head", "Q6_K", V, H),
]
FORMATS = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K"]
FIXTURE_DTYPES = FORMATS + ["q4_k_xl"]
# the shipped micro model: beside this tree, else in the working directory (a copied tree
# run from the checkout)
MICRO = next((d / "models" / "muse-glimmer-micro-q8_0.gguf" for d in (REPO, Path.cwd())
              if (d / "models" / "muse-glimmer-micro-q8_0.gguf").is_file()), REPO / "models" / "muse-glimmer-micro-q8_0.gguf")


class Run:
    def __init__(self, args):
        import torch

        self.torch = torch
        self.dev = args.device
        self.smoke = args.smoke
        self.t0 = time.time()
        self.budget = args.budget
        self.gen = torch.Generator(self.dev).manual_seed(1234)
        self.rows: list[tuple[str, str, str]] = []

    def left(self) -> float:
        return self.budget - (time.time() - self.t0)

    def sync(self) -> None:
        if self.dev == "cuda":
            self.torch.cuda.synchronize()


def _weight(run: Run, fmt_name: str, n_out: int, n_in: int, seed: int):
    """Random valid stored rows (weights.random_bytes) repacked on the device."""
    from muser.engine.weights import random_bytes, repack
    from muser.gguf.types import GgmlType as G

    raw = random_bytes(G[fmt_name], n_out, n_in, seed)
    return repack("w", G[fmt_name], n_out, n_in, run.torch.from_numpy(raw.copy()).to(run.dev))


def stage_compare(run: Run) -> dict:
    torch = run.torch
    from muser.engine.kernels import qgemm

    out, ok = {}, True
    n_out, n_in = (40, 512) if run.smoke else (1000, 4096)
    for fmt in FORMATS:
        if run.left() < 10:
            out[fmt] = {"skipped": "budget"}
            continue
        try:
            w = _weight(run, fmt, n_out, n_in - (0 if fmt not in ("F32", "F16", "BF16") else 24), 7)
            ms = (1, 16, 17) if run.smoke else (1, 16, 17, 512)
            x = torch.randn(max(ms), w.n_in, device=run.dev, generator=run.gen)
            scale = x.abs().double() @ w.decode().abs().double().T
            r: dict = {"n_out": w.n_out, "n_in": w.n_in}
            full = {}
            bn = 16 if run.dev == "cpu" else None  # the interpreter's dot is numpy's: exact per element for one shape only
            for M in ms:
                y = qgemm.gemm(w, x[:M].contiguous(), bn=bn)
                full[M] = y
                ref = qgemm.gemm_ref(w, x[:M])
                r[f"rel_err_m{M}"] = float(((y.double() - ref.double()).abs() / scale[:M]).max())
            probes = [0, 5, 15] + ([16, 300, max(ms) - 1] if max(ms) > 17 else [16])
            bit = True
            for i in probes:
                alone = qgemm.gemm(w, x[i:i + 1].contiguous(), bn=bn)
                for M, y in full.items():
                    if i < M:
                        bit &= bool(torch.equal(alone, y[i:i + 1]))
            r["row_alone_vs_blocks_bitwise"] = bit
            # N tile, warps and K-chunk programs are speed choices: the same bits for each
            cfgs = [(16, 1, True), (32, 1, True), (64, 2, False), (128, 4, True)]
            x1 = x[:1].contiguous()
            y0 = qgemm.gemm(w, x1, bn=bn)
            r["configs_bitwise"] = all(bool(torch.equal(qgemm.gemm(w, x1, bn=b if bn is None else bn, num_warps=nw,
                                                                   split=sp), y0)) for b, nw, sp in cfgs)
            bit &= r["configs_bitwise"]
            if run.dev == "cuda":
                y64 = qgemm.gemm(w, x.contiguous(), block_m=64)
                r["block_m64_equals_16_bitwise"] = bool(torch.equal(y64, full[max(ms)]))
            r["status"] = "pass" if bit and max(v for k, v in r.items() if k.startswith("rel_err")) <= 2e-6 else "fail"
        except Exception as e:  # noqa: BLE001 - report and go on
            r = {"error": repr(e), "traceback": traceback.format_exc()[-2000:], "status": "fail"}
        ok &= r.get("status") == "pass"
        out[fmt] = r
        run.rows.append(("compare", fmt, f"{r.get('status')} err1 {r.get('rel_err_m1', float('nan')):.1e} "
                         f"bitwise {r.get('row_alone_vs_blocks_bitwise')} m64 {r.get('block_m64_equals_16_bitwise')}"))
    out["status"] = "pass" if ok else "fail"
    return out


def _fixture(workdir: Path, dtype: str) -> Path:
    from muser.model.synth import SynthSpec, write_fixture

    p = workdir / f"tiny-{dtype}.gguf"
    if not p.is_file():
        write_fixture(p, SynthSpec(dtype=dtype))
    return p


def stage_gate2(run: Run, workdir: Path, n_gen: int, dtypes: list[str]) -> dict:
    import muser.oracle as oracle
    from muser.engine import Engine
    from muser.gates import gate2

    rows = []
    paths = ([MICRO] if MICRO.is_file() else []) + [_fixture(workdir, d) for d in dtypes]
    if not paths:
        return {"status": "fail", "error": f"no model: {MICRO} is missing and no fixture dtypes were named"}
    for p in paths:
        for kv in ("f32", "f16"):
            if run.left() < 25:
                rows.append({"model": p.name, "kv": kv, "skipped": "budget"})
                continue
            try:
                r = gate2(p, Engine.open(p, device=run.dev, lane="exact", kv=kv),
                          oracle.load(p, arithmetic="f32", kv=kv), kv, n_gen=n_gen, noise="always")
            except Exception as e:  # noqa: BLE001
                r = {"error": repr(e), "traceback": traceback.format_exc()[-2000:]}
            r.update(model=p.name, kv=kv)
            rows.append(r)
            run.rows.append(("gate2", f"{p.name} kv={kv}", f"{r.get('status', 'ERROR')} max {r.get('max_dlsm')} "
                             f"floor {r.get('noise_floor')} tok= {r.get('tokens_identical')}"))
    ran = [r for r in rows if "skipped" not in r]
    status = "fail" if not ran or any(r.get("status") != "pass" for r in ran) else \
        ("partial" if len(ran) < len(rows) else "pass")
    return {"status": status, "greedy_tokens": n_gen, "rows": rows}


def _invariance_one(eng, blocks: list[int], chunks: list[int]) -> dict:
    """Bitwise: decode alone vs verify blocks vs prefill chunks vs a two-session step."""
    import numpy as np

    from muser.engine import StepItem

    cfg = eng.cfg
    n = min(cfg.context_length - 1, max(80, 2 * cfg.sliding_window + 17))
    ids = [3 + (i * 37 + (i * i) % 11) % (cfg.vocab - 3) for i in range(n)]
    s = eng.session(max_context=n)
    ref = np.stack([s.decode(t) for t in ids])  # [n, vocab]
    out: dict = {"positions": n, "window": cfg.sliding_window, "bad": {}}

    def cmp(name, got):
        bad = np.flatnonzero((got != ref).any(-1))
        if bad.size:
            out["bad"][name] = {"rows": bad[:8].tolist(), "n": int(bad.size),
                                "max_abs": float(np.abs(got - ref).max())}

    for c in chunks:
        cmp(f"prefill{c}", eng.session(max_context=n, chunk=c).prefill(ids, all_logits=True))
    for b in blocks:
        s = eng.session(max_context=n)
        s.prefill(ids[:3])
        rows = [ref[:3]]
        for b0 in range(3, n, b):
            rows.append(s.verify(ids[b0:b0 + b]))
        cmp(f"verify{b}", np.concatenate(rows))
    # stepped beside another session (the server's batcher): a 1-row item next to a 4-row one
    s1, s2 = eng.session(max_context=n), eng.session(max_context=n)
    s1.prefill(ids[:40])
    s2.prefill(ids[:36])
    r1, r2 = eng.step([StepItem(s1, ids[40:41]), StepItem(s2, ids[36:40], logits="all")])
    got = np.concatenate([r2.logits, r1.logits])  # positions 36..40
    bad = np.flatnonzero((got != ref[36:41]).any(-1))
    if bad.size:
        out["bad"]["step"] = {"rows": (bad + 36).tolist()}
    out["bitwise"] = not out["bad"]
    return out


def stage_invariance(run: Run, workdir: Path, dtypes: list[str] | None) -> dict:
    """dtypes None: the micro model, verify blocks 2..16; else tiny fixtures, blocks 2, 5, 16."""
    from muser.engine import Engine

    rows, ok = [], True
    if dtypes is None:
        cases = [(MICRO, list(range(2, 17)))] if MICRO.is_file() else []
    else:
        cases = [(_fixture(workdir, d), [2, 5, 16]) for d in dtypes]
    for p, blocks in cases:
        for kv in ("f16", "f32"):
            if run.left() < 15:
                rows.append({"model": p.name, "kv": kv, "skipped": "budget"})
                continue
            try:
                r = _invariance_one(Engine.open(p, device=run.dev, lane="exact", kv=kv), blocks, [64, 512])
            except Exception as e:  # noqa: BLE001
                r = {"error": repr(e), "traceback": traceback.format_exc()[-2000:], "bitwise": False}
            r.update(model=p.name, kv=kv, blocks=blocks)
            ok &= bool(r.get("bitwise"))
            rows.append(r)
            run.rows.append(("invariance", f"{p.name} kv={kv}",
                             "bitwise" if r.get("bitwise") else f"DIFFERS {sorted(r.get('bad', {}))[:6]} {r.get('error', '')}"))
    ran = [r for r in rows if "skipped" not in r]
    return {"status": "fail" if not ok or not ran else ("partial" if len(ran) < len(rows) else "pass"), "rows": rows}


def _random_kquant(run: Run, fmt: str, n_out: int, n_in: int):
    """Random valid Q4_K / Q6_K fields built on the GPU (weights.repack layout)."""
    torch = run.torch
    from muser.engine.weights import QWeight
    from muser.gguf.types import GgmlType as G

    g, dev, nb = run.gen, run.dev, n_in // 256

    def u8(*shape, hi=256):
        return torch.randint(0, hi, shape, dtype=torch.uint8, device=dev, generator=g)

    def f16(*shape):
        return (torch.rand(shape, device=dev, generator=g) * 3e-3 + 1e-3).to(torch.float16)

    if fmt == "Q4_K":
        f = {"qs": u8(n_out, nb * 128), "d": f16(n_out, nb), "dmin": f16(n_out, nb),
             "sc": u8(n_out, nb * 8, hi=64), "m": u8(n_out, nb * 8, hi=64)}
    else:
        f = {"ql": u8(n_out, nb * 128), "qh": u8(n_out, nb * 64), "d": f16(n_out, nb),
             "sc": (u8(n_out, nb * 16).to(torch.int16) - 128).to(torch.int8)}
    return QWeight(f"{fmt}[{n_out}x{n_in}]", G[fmt], n_out, n_in, f)


def stage_bench(run: Run) -> dict:
    torch = run.torch
    from muser.engine.kernels import qgemm

    out: dict = {"timing": "CUDA events over rotated weight copies (> 2 x L2 per round)"}
    l2 = torch.cuda.get_device_properties(0).L2_cache_size if run.dev == "cuda" else 1 << 20
    for name, fmt, n_out, n_in in BENCH:
        if run.smoke:
            n_out, n_in = 48, 512
        r: dict = {"format": fmt, "n_out": n_out, "n_in": n_in}
        try:
            w0 = _random_kquant(run, fmt, n_out, n_in)
            nbytes = w0.nbytes
            copies = max(1, min(8, -(-2 * l2 // nbytes)))
            ws = [w0] + [_random_kquant(run, fmt, n_out, n_in) for _ in range(copies - 1)]
            r["weight_bytes"] = nbytes
            for M in (1, 16, 512):
                if run.left() < 8:
                    r[f"m{M}"] = {"skipped": "budget"}
                    continue
                x = torch.randn(M, n_in, device=run.dev, generator=run.gen)
                y = torch.empty(M, n_out, device=run.dev)
                qgemm.gemm(ws[0], x, y)  # compile + warm
                run.sync()
                reps = 3 if run.smoke else max(copies, 8 if M < 512 else 2)
                if run.dev == "cuda":
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    for i in range(reps):
                        qgemm.gemm(ws[i % copies], x, y)
                    e1.record()
                    run.sync()
                    us = e0.elapsed_time(e1) * 1e3 / reps
                else:
                    t = time.perf_counter()
                    for i in range(reps):
                        qgemm.gemm(ws[i % copies], x, y)
                    us = (time.perf_counter() - t) * 1e6 / reps
                r[f"m{M}"] = {"us": us, "GBps": nbytes / us / 1e3, "TFLOPs_useful": 2 * M * n_out * n_in / us / 1e6,
                              "config": list(qgemm.config(M, n_out))}
                if M == 1 and run.dev == "cuda":  # the N tile / warps sweep (speed only, same bits)
                    sweep = {}
                    for b, nw in ((32, 1), (64, 4), (128, 4)):
                        if run.left() < 10:
                            break
                        qgemm.gemm(ws[0], x, y, bn=b, num_warps=nw)
                        e0.record()
                        for i in range(reps):
                            qgemm.gemm(ws[i % copies], x, y, bn=b, num_warps=nw)
                        e1.record()
                        run.sync()
                        sweep[f"{b}x{nw}"] = e0.elapsed_time(e1) * 1e3 / reps
                    r["m1_sweep_us"] = sweep
            del ws
        except Exception as e:  # noqa: BLE001
            r["error"] = repr(e)
            r["traceback"] = traceback.format_exc()[-2000:]
        out[name] = r
        cells = " ".join(f"m{M} {r[f'm{M}']['us']:.0f}us {r[f'm{M}']['GBps']:.0f}GB/s"
                         for M in (1, 16, 512) if "us" in r.get(f"m{M}", {}))
        run.rows.append(("bench", name, cells or r.get("error", "skipped")))
    out["status"] = "measured" if all("error" not in v for v in out.values() if isinstance(v, dict)) else "partial"
    return out


def muser_file() -> str:
    import muser

    return muser.__file__


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget", type=float, default=150.0)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter check of this script)")
    ap.add_argument("--stages", default="compare,invariance,bench,gate2,fixtures")
    ap.add_argument("--gate-tokens", type=int, default=256)
    ap.add_argument("--gate-dtypes", default="", help="tiny fixtures gated beside the micro model (e.g. Q4_K,Q6_K)")
    ap.add_argument("--inv-dtypes", default=",".join(FIXTURE_DTYPES), help="tiny fixtures of the fixtures stage")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
        from muser.engine.kernels.interpreter import index_compat

        index_compat()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    workdir = Path(args.workdir or Path(os.environ.get("TMPDIR", "/tmp")) / "muser-kernels")
    workdir.mkdir(parents=True, exist_ok=True)
    run = Run(args)
    import torch

    res: dict = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu (interpreter)",
                 "torch": torch.__version__, "budget_s": args.budget,
                 "micro_model": str(MICRO) if MICRO.is_file() else None, "muser_from": str(Path(muser_file()).parent)}
    try:
        import triton

        res["triton"] = triton.__version__
    except ImportError:
        pass
    stages = [s for s in args.stages.split(",") if s]
    split = lambda s: [d for d in s.split(",") if d]  # noqa: E731
    for st in stages:
        t = time.time()
        try:
            if st == "compare":
                res[st] = stage_compare(run)
            elif st == "gate2":
                res[st] = stage_gate2(run, workdir, args.gate_tokens, split(args.gate_dtypes))
            elif st == "invariance":
                res[st] = stage_invariance(run, workdir, None)
            elif st == "fixtures":
                res[st] = stage_invariance(run, workdir, split(args.inv_dtypes))
            elif st == "bench":
                res[st] = stage_bench(run)
            else:
                raise ValueError(f"unknown stage {st!r}")
        except Exception as e:  # noqa: BLE001
            res[st] = {"status": "error", "error": repr(e), "traceback": traceback.format_exc()[-3000:]}
        res[st]["seconds"] = round(time.time() - t, 1)
        (out_dir / "kernels.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
        print(f"== {st}: {res[st].get('status')} in {res[st]['seconds']} s ({run.left():.0f} s left)", flush=True)
    for a, b, c in run.rows:
        print(f"{a:11s} {b:40s} {c}")
    res["total_s"] = round(time.time() - run.t0, 1)
    (out_dir / "kernels.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
