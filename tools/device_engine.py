#!/usr/bin/env python3
"""The engine's device run: kernel parity, Gate 2, CUDA graphs, memory and a first decode tok/s
on the full geometry, each stage defensive, every figure written into JSON receipts.

    python3 tools/device_engine.py --out "$OUT" [--full FULL.gguf] [--llama-bench-json F.json]
                                   [--device cuda|cpu] [--budget 480] [--workdir DIR]

Stages (each in try/except; a failing stage records its error and the run goes on; a stage is
skipped when the time budget left is below its estimate):

  env          torch / triton / GPU, device-to-device copy bandwidth (GB/s, read + write)
  kernels      Triton tile decoder bit-exact vs the torch decoder and muser.quant (every format),
               fused dequant-matvec (1 and 16 rows) and attention vs their torch references
  gate2        tiny fixtures of every dtype: exact lane vs oracle f32, f32 and f16 K/V, prefill +
               256 greedy tokens, with the noise floor; graph shapes captured; the shipped micro
               model (models/*.gguf) reported beside it
  full         FULL_GEOMETRY (16.75 GB Q4_K mix): load, resident bytes of weights and of KV at 1 and
               4 slots of 131,072, decode tok/s (warm-up + 5 reps, CV) at depth 0 / 8k / 32k,
               16-row verify vs decode, prefill pp512 (exact lane), llama.cpp's figures beside
  invariance   chunked prefill = decode = verify rows; graph replay vs eager bitwise; every verify
               width captured; GPU argmax; fast-lane drift

Outputs in --out: device_engine.json (everything), receipt files from muser.bench.receipt, and a
summary table printed last. --device cpu runs the CPU stages (env, gate2, invariance; `full` only
with --full). --stages picks stages; --gate-dtypes narrows Gate 2; --budget bounds the whole run.
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
try:  # the `gguf` package (pure Python) may travel inside a carried site-packages folder
    import gguf  # noqa: F401
except ImportError:
    for sp in sorted((REPO / ".venv" / "lib").glob("python*/site-packages")):
        if (sp / "gguf").is_dir():
            sys.path.append(str(sp))
            break

import numpy as np  # noqa: E402

DTYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "q4_k_xl"]


class Run:
    def __init__(self, out: Path, budget: float, device: str):
        self.out = out
        self.out.mkdir(parents=True, exist_ok=True)
        self.t0 = time.time()
        self.budget = budget
        self.device = device
        self.results: dict = {"device_run": {"started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                             "budget_s": budget, "device": device, "argv": sys.argv}}
        self.rows: list[tuple[str, str, str]] = []  # summary: stage, item, value

    def left(self) -> float:
        return self.budget - (time.time() - self.t0)

    def stage(self, name: str, need_s: float, fn, *a, **kw):
        if self.left() < need_s:
            self.results[name] = {"skipped": f"{self.left():.0f} s left of the budget, stage needs ~{need_s:.0f} s"}
            self.rows.append((name, "skipped", "budget"))
            self.flush()
            return None
        t = time.time()
        print(f"[{time.time() - self.t0:6.1f}s] stage {name} ...", flush=True)
        try:
            r = fn(*a, **kw)
        except BaseException as e:  # record and continue (KeyboardInterrupt too: keep the JSON)
            r = {"error": repr(e), "traceback": traceback.format_exc()[-6000:]}
            self.rows.append((name, "ERROR", repr(e)[:90]))
            if isinstance(e, KeyboardInterrupt):
                raise
        r = r if isinstance(r, dict) else {"value": r}
        r["_seconds"] = round(time.time() - t, 2)
        self.results[name] = r
        self.flush()
        return r

    def flush(self) -> None:
        self.results["device_run"]["elapsed_s"] = round(time.time() - self.t0, 2)
        tmp = self.out / "device_engine.json.tmp"
        tmp.write_text(json.dumps(self.results, indent=1, default=_js) + "\n")
        os.replace(tmp, self.out / "device_engine.json")


def _js(o):
    if isinstance(o, (np.generic,)):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------
# stages


def stage_env(run: Run) -> dict:
    import torch

    r = {"python": sys.version.split()[0], "torch": torch.__version__, "numpy": np.__version__,
         "cuda_available": torch.cuda.is_available()}
    try:
        import triton

        r["triton"] = triton.__version__
    except ImportError as e:
        r["triton"] = f"missing: {e}"
    try:
        import gguf

        r["gguf"] = getattr(gguf, "__version__", "present")
    except ImportError as e:
        r["gguf"] = f"missing: {e}"
    if run.device == "cuda" and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        r.update(gpu=p.name, sms=p.multi_processor_count, gpu_mem_gib=round(p.total_memory / 2**30, 1),
                 capability=f"{p.major}.{p.minor}")
        n = 1 << 30  # 1 GiB copies, read + write counted
        a = torch.empty(n, dtype=torch.uint8, device="cuda")
        b = torch.empty_like(a)
        for _ in range(3):
            b.copy_(a)
        _sync()
        ts = []
        for _ in range(5):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            b.copy_(a)
            e1.record()
            e1.synchronize()
            ts.append(e0.elapsed_time(e1) / 1e3)
        r["copy_GBps"] = round(2 * n / np.mean(ts) / 1e9, 1)
        r["copy_samples_s"] = ts
        del a, b
        torch.cuda.empty_cache()
        run.rows.append(("env", "gpu", f"{r['gpu']} copy {r['copy_GBps']} GB/s"))
    run.rows.append(("env", "torch/triton", f"{r['torch']} / {r.get('triton')}"))
    return r


def stage_kernels(run: Run) -> dict:
    import torch

    from muser.engine.kernels import attention as att
    from muser.engine.kernels import qmatvec as qmv
    from muser.engine.weights import BASE_FORMATS, random_bytes, repack
    from muser.quant import dequantize

    dev = "cuda"
    out: dict = {"dequant": {}, "matvec": {}, "attention": []}
    ok = True
    for fmt in BASE_FORMATS:
        n_out, n_in = 300, 768 + (32 if fmt.name in ("F32", "F16", "BF16", "Q8_0", "Q4_0") else 0)
        raw = random_bytes(fmt, n_out, n_in, 11)
        w = repack("t", fmt, n_out, n_in, torch.from_numpy(raw.copy()).to(dev))
        ref_np = dequantize(raw.reshape(-1), fmt, n_out * n_in).reshape(n_out, n_in)
        dq_torch = w.decode()
        dq_tri = qmv.dequant_triton(w)
        _sync()
        b_torch = bool(np.array_equal(dq_torch.cpu().numpy().view(np.uint32), ref_np.view(np.uint32)))
        b_tri = bool(torch.equal(dq_tri.view(torch.int32), dq_torch.view(torch.int32)))
        out["dequant"][fmt.name] = {"torch_vs_quant_bitexact": b_torch, "triton_vs_torch_bitexact": b_tri}
        ok &= b_torch and b_tri
        rel = {}
        for T in (1, 16):
            x = torch.randn(T, n_in, device=dev, generator=torch.Generator(dev).manual_seed(T))
            y = qmv.matvec_triton(w, x)
            y64 = x.double() @ dq_torch.double().T
            scale = x.abs().double() @ dq_torch.abs().double().T
            rel[T] = float(((y.double() - y64).abs() / (scale + 1e-30)).max())
        out["matvec"][fmt.name] = rel
        ok &= max(rel.values()) < 1e-5
    g = torch.Generator(dev).manual_seed(0)
    cases = [(1, 2048, 2048, 1000, 1000 % 2048, 3048, 2048, False, torch.float16),
             (16, 2048, 2048, 77, 77, 2125, 2048, False, torch.float16),
             (7, 2048, 900, 0, 0, 900, 2048, False, torch.float32),
             (1, 8192, 5000, 0, 0, 5000, 0, True, torch.float16),
             (16, 8192, 5000, 0, 0, 5000, 0, True, torch.float16),
             (3, 4096, 0, 0, 0, 0, 0, True, torch.float32)]
    H, n_kv, D = 32, 2, 128
    for (T, cap, ln, ol, op, p0, win, hm, dt) in cases:
        q = torch.randn(T, H, D, device=dev, generator=g)
        kn = torch.randn(T, n_kv, D, device=dev, generator=g).to(dt)
        vn = torch.randn(T, n_kv, D, device=dev, generator=g).to(dt)
        shape = (n_kv, cap, D) if hm else (cap, n_kv * D)
        kp = torch.randn(shape, device=dev, generator=g).to(dt)
        vp = torch.randn(shape, device=dev, generator=g).to(dt)
        ref = att.attend_ref(q, kn, vn, kp, vp, hm, ol, op, ln, cap, p0, win, 0.0883883)
        meta = torch.tensor([ol, op, ln, cap], dtype=torch.int64, device=dev)
        pos = torch.tensor([p0], dtype=torch.int64, device=dev)
        sc = att.AttnScratch(T, H, D, att.split_count(T, cap, win), dev)
        got = att.attend_triton(q, kn, vn, kp, vp, hm, meta, pos, win, 0.0883883, sc)
        err = float((got - ref).abs().max())
        out["attention"].append({"T": T, "cap": cap, "len": ln, "head_major": hm, "dtype": str(dt),
                                 "max_abs_err": err})
        ok &= err < 1e-4
    out["status"] = "pass" if ok else "fail"
    run.rows.append(("kernels", "dequant bit-exact / matvec / attention", out["status"]))
    return out


def _fixture(workdir: Path, dtype: str) -> Path:
    from muser.model.synth import SynthSpec, write_fixture

    p = workdir / f"tiny-{dtype}.gguf"
    if not p.is_file():
        write_fixture(p, SynthSpec(dtype=dtype))
    return p


def stage_gate2(run: Run, workdir: Path, n_gen: int, dtypes: list[str] = DTYPES) -> dict:
    import muser.oracle as oracle
    from muser.engine import Engine
    from muser.gates import gate2

    rows = []
    for dt in dtypes:
        for kv in ("f32", "f16"):
            if run.left() < 20:
                rows.append({"dtype": dt, "kv": kv, "skipped": "budget"})
                continue
            try:
                p = _fixture(workdir, dt)
                r = gate2(p, Engine.open(p, device=run.device, lane="exact", kv=kv),
                          oracle.load(p, arithmetic="f32", kv=kv), kv, n_gen=n_gen, noise="always")
                r["dtype"] = dt
            except Exception as e:
                r = {"dtype": dt, "kv": kv, "error": repr(e), "traceback": traceback.format_exc()[-3000:]}
            rows.append(r)
            print(f"   gate2 {dt:8s} kv={kv}: {r.get('status', 'ERROR')} max {r.get('max_dlsm')} "
                  f"floor {r.get('noise_floor')} tokens_identical {r.get('tokens_identical')}", flush=True)
    tiny = list(rows)
    # the shipped micro model (natural weights), when the tree carries it: reported beside the gate
    for mp in sorted((REPO / "models").glob("*.gguf")) if (REPO / "models").is_dir() else []:
        for kv in ("f32", "f16"):
            if run.left() < 30:
                rows.append({"dtype": mp.name, "kv": kv, "skipped": "budget"})
                continue
            try:
                r = gate2(mp, Engine.open(mp, device=run.device, lane="exact", kv=kv),
                          oracle.load(mp, arithmetic="f32", kv=kv), kv, n_gen=n_gen, noise="always")
                r["dtype"] = mp.name
            except Exception as e:
                r = {"dtype": mp.name, "kv": kv, "error": repr(e), "traceback": traceback.format_exc()[-3000:]}
            rows.append(r)
            print(f"   gate2 {mp.name} kv={kv}: {r.get('status', 'ERROR')} max {r.get('max_dlsm')} "
                  f"floor {r.get('noise_floor')}", flush=True)
    # every row is part of the verdict (the micro model too); rows skipped for budget make it partial
    ran = [r for r in rows if "skipped" not in r]
    status = "fail" if not ran or any(r.get("status") != "pass" for r in ran) else \
        ("partial" if len(ran) < len(rows) else "pass")
    for r in rows:
        run.rows.append((f"gate2 {run.device}", f"{r.get('dtype')} kv={r.get('kv')}",
                         f"{r.get('status', 'ERROR')} max {_f(r.get('max_dlsm'))} floor {_f(r.get('noise_floor'))} "
                         f"tok {'=' if r.get('tokens_identical') else r.get('token_agreement')}"))
    return {"status": status, "greedy_tokens": n_gen, "rows": tiny, "micro_model": rows[len(tiny):],
            "skipped": [f"{r['dtype']} kv={r['kv']}" for r in rows if "skipped" in r]}


def _f(x) -> str:
    return "-" if x is None else f"{x:.2e}"


def stage_invariance(run: Run, workdir: Path) -> dict:
    import muser.oracle as oracle
    from muser.engine import Engine
    from muser.gates import default_prompt, invariance, max_dlsm

    out: dict = {}
    p = _fixture(workdir, "Q4_K")
    e32 = Engine.open(p, device=run.device, lane="exact", kv="f32")
    toks = default_prompt(e32.cfg, 120)
    out["q4_k_f32kv"] = invariance(e32, toks, chunks=(512, 64, 7), verify_from=50)
    e16 = Engine.open(p, device=run.device, lane="exact", kv="f16")
    floor16 = oracle.load(p, arithmetic="f32", kv="f16").noise_floor(toks).value
    out["q4_k_f16kv"] = invariance(e16, toks, chunks=(512, 7), verify_from=50, bound=2 * floor16)
    out["q4_k_f16kv"]["noise_floor"] = floor16
    if run.device == "cuda":
        # graph replay vs the same step run eagerly: same kernels, so the same bits
        a = e16.session(max_context=256, graphs=True)
        b = e16.session(max_context=256, graphs=False)
        a.prefill(toks[:40])
        b.prefill(toks[:40])
        la, lb = [], []
        for t in toks[40:80]:
            la.append(a.decode(t))
            lb.append(b.decode(t))
        va, vb = a.verify(toks[80:96]), b.verify(toks[80:96])
        out["graph_vs_eager"] = {
            "decode_bitwise": bool(all(np.array_equal(x, y) for x, y in zip(la, lb))),
            "decode_max_dlsm": max_dlsm(np.stack(la), np.stack(lb)),
            "verify16_bitwise": bool(np.array_equal(va, vb)), "verify16_max_dlsm": max_dlsm(va, vb),
            "captured_shapes": {f"{k[0]}x{k[1]}": g.captures for k, g in a._graphs.items()},
        }
        # every verify width gets its own graph
        s = e16.session(max_context=256)
        s.prefill(toks[:20])
        for T in range(2, 17):
            cp = s.checkpoint(16)
            s.verify(toks[20:20 + T])
            s.rollback(cp)
        out["verify_graph_shapes"] = sorted(k[0] for k in s._graphs)
        # greedy argmax on the GPU (argmax + finiteness read back) equals the CPU argmax
        g1 = e16.session(max_context=64)
        g2 = e16.session(max_context=64)
        g1.prefill(toks[:10])
        g2.prefill(toks[:10])
        out["gpu_argmax_equal"] = bool(all(g1.decode_greedy(t) == int(np.argmax(g2.decode(t))) for t in toks[10:30]))
    fast = Engine.open(p, device=run.device, lane="fast", kv="f32")
    ex = e32.session(max_context=600).prefill(toks, all_logits=True)
    fs = fast.session(max_context=600).prefill(toks, all_logits=True)
    out["fast_lane_drift"] = {"max_dlsm": max_dlsm(ex, fs),
                              "top1_agreement": float(np.mean(ex.argmax(-1) == fs.argmax(-1))),
                              "note": "bf16 prefill GEMMs (the fast lane); reported, never gated as exact"}
    ok = out["q4_k_f32kv"]["status"] == "pass" and out["q4_k_f16kv"]["status"] == "pass"
    if "graph_vs_eager" in out:
        ok &= out["graph_vs_eager"]["decode_max_dlsm"] <= 1e-4 and out["gpu_argmax_equal"]
    out["status"] = "pass" if ok else "fail"
    run.rows.append(("invariance", "chunk/decode/verify f32kv", f"{out['q4_k_f32kv']['status']} "
                     f"max {_f(out['q4_k_f32kv']['max_dlsm'])}"))
    if "graph_vs_eager" in out:
        gv = out["graph_vs_eager"]
        run.rows.append(("graphs", "replay vs eager", f"decode bitwise {gv['decode_bitwise']}, "
                         f"verify16 bitwise {gv['verify16_bitwise']}, shapes {len(out['verify_graph_shapes']) + 1}"))
    run.rows.append(("fast lane", "drift vs exact", f"max {_f(out['fast_lane_drift']['max_dlsm'])} "
                     f"top1 {out['fast_lane_drift']['top1_agreement']:.3f}"))
    return out


def _timed(fn, reps=5, warmup=1):
    from muser.bench.receipt import run_interleaved

    return run_interleaved(fn, reps=reps, warmup=warmup)


def _has_v2() -> bool:
    return (REPO / "src" / "muser" / "engine" / "kernels" / "qmatvec_v2.py").is_file()


def _mem() -> int:
    import torch

    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0


def stage_full(run: Run, workdir: Path, full: str | None, llama_json: str | None, gate_status: str,
               C: int = 131072, depths: tuple[int, ...] = (0, 8192, 32768),
               matvec_variants: tuple[str, ...] = ("v1",)) -> dict:
    import torch

    from muser.engine import Engine
    from muser.kv.torch_backend import resident_bytes

    out: dict = {}
    if full:
        path = Path(full)
    else:
        from muser.model.synth import FULL_GEOMETRY, write_fixture  # needs the `gguf` package

        path = workdir / "full-q4_k_xl.gguf"
        if not path.is_file():
            t = time.time()
            write_fixture(path, FULL_GEOMETRY)
            out["write_s"] = round(time.time() - t, 1)
    out["path"] = str(path)
    out["file_bytes"] = path.stat().st_size
    cuda = run.device == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    m0 = _mem()
    t = time.time()
    # v3 (the default) packs the K-quant matrices at load; older kernels timed beside it need
    # the repacked fields kept as well
    compare = any(v != "v3" for v in matvec_variants)
    if compare:
        os.environ["MUSER_MATVEC_COMPARE"] = "1"
    eng = Engine.open(path, device=run.device, lane="exact", kv="f16")
    os.environ.pop("MUSER_MATVEC_COMPARE", None)
    out["fields_kept_for_comparison"] = compare
    from muser.engine.kernels import qmatvec_v3

    out["v3_tuning"] = {"file": os.environ.get("MUSER_V3_TUNING"),
                        "entries": {"/".join(map(str, k)): list(v) for k, v in qmatvec_v3.TUNED.items()},
                        "default_configs": {str(k): list(v) for k, v in qmatvec_v3.CONFIGS.items()}}
    _sync()
    out["load_s"] = round(time.time() - t, 1)
    out["weights_resident_bytes"] = eng.weight_bytes
    out["weights_allocated_bytes"] = _mem() - m0
    mf = eng.model_file
    out["config"] = eng.cfg.describe()
    out["dtype_mix"] = sorted(set(mf.contract.dtypes.values()))
    out["stream_bytes_per_token"] = mf.weight_bytes_per_token()
    run.rows.append(("full", "weights resident", f"{eng.weight_bytes / 1e9:.3f} GB (file {out['file_bytes'] / 1e9:.2f} GB)"))

    # KV at 131,072 for 1 and 4 slots (book 10.8: 1.827 GB per slot)
    kv = {"context": C, "formula_bytes_per_slot": eng.cfg.kv_bytes(C)}
    sessions = []
    for slots in (1, 4):
        while len(sessions) < slots:
            a0 = _mem()
            sessions.append(eng.session(max_context=C))
            _sync()
            kv.setdefault("allocated_per_slot", []).append(_mem() - a0)
        kv[f"resident_{slots}_slots"] = sum(resident_bytes(s.cache) for s in sessions)
    out["kv"] = kv
    run.rows.append(("full", f"KV 1 / 4 slots @{C}", f"{kv['resident_1_slots'] / 1e9:.3f} / "
                     f"{kv['resident_4_slots'] / 1e9:.3f} GB (formula {kv['formula_bytes_per_slot'] / 1e9:.3f}/slot)"))
    del sessions
    if cuda:
        torch.cuda.empty_cache()

    # decode tok/s at each depth (warm-up + 5 reps of N steps, interleaved cells), for each matvec
    # variant (MUSER_MATVEC, read when a step is captured: each variant gets a fresh session)
    N = 32
    vocab = eng.cfg.vocab
    rng = np.random.default_rng(0)
    dec: dict = {}
    variants = [v for v in matvec_variants if v in ("v1", "v3") or _has_v2()]
    for variant in variants:
        os.environ["MUSER_MATVEC"] = variant
        s = eng.session(max_context=C)
        s.prefill([eng.cfg.bos_id])
        filled = 1
        for depth in depths:
            key = str(depth) if variant == "v1" else f"{depth}/{variant}"
            if run.left() < 45:
                dec[key] = {"skipped": "budget"}
                continue
            if depth > filled:
                # fill the planes to `depth` by a detached install (timing only: the work per
                # token depends on the depth, not on the cached values)
                inst = s.begin_install(depth)
                for il, p in enumerate(inst.planes):
                    a, b = inst.expected(il)
                    z = torch.zeros((b - a, p.geometry.kv_dim), dtype=torch.float16, device=eng.device)
                    inst.put(il, a, z, z)
                s.commit(inst)
                filled = depth
            toks = rng.integers(6, min(vocab, 8000), size=16 * N)  # 2 cells x (1 + 5) reps x N, spare
            it = iter(toks.tolist())

            def steps_logits():
                for _ in range(N):
                    s.decode(next(it))

            def steps_argmax():
                for _ in range(N):
                    s.decode_greedy(next(it))

            cells = _timed({"decode_logits": steps_logits, "decode_argmax": steps_argmax})
            filled += 12 * N
            vt = []
            for _ in range(4):
                cp = s.checkpoint(16)
                blk = rng.integers(6, min(vocab, 8000), size=16).tolist()
                _sync()
                t = time.perf_counter()
                s.verify(blk)
                _sync()
                vt.append(time.perf_counter() - t)
                s.rollback(cp)
            one = cells["decode_logits"].mean / N
            d = {"matvec": variant, "steps_per_rep": N, "tok_s": N / cells["decode_logits"].mean,
                 "cv": cells["decode_logits"].cv,
                 "tok_s_argmax_readback": N / cells["decode_argmax"].mean, "cv_argmax": cells["decode_argmax"].cv,
                 "samples_s": cells["decode_logits"].samples, "samples_argmax_s": cells["decode_argmax"].samples,
                 "verify16_s": float(np.mean(vt[1:])), "verify16_over_decode": float(np.mean(vt[1:]) / one),
                 "achieved_GBps": out["stream_bytes_per_token"] * N / cells["decode_logits"].mean / 1e9,
                 "graphs": {f"{k[0]}x{k[1]}": g.captures for k, g in s._graphs.items()}}
            dec[key] = d
            run.rows.append(("full decode", f"depth {depth} {variant}", f"{d['tok_s']:.1f} tok/s (cv {d['cv']:.3f}), "
                             f"argmax-readback {d['tok_s_argmax_readback']:.1f}, {d['achieved_GBps']:.0f} GB/s, "
                             f"verify16/decode {d['verify16_over_decode']:.2f}"))
            run.results["full"] = {**out, "decode": dec}
            run.flush()
        del s
        if cuda:
            torch.cuda.empty_cache()
    os.environ.pop("MUSER_MATVEC", None)
    out["decode"] = dec
    out["decode_note"] = ("exact lane, f16 K/V, CUDA graphs, logits row read back each token; depth > 0 "
                          "filled by a detached install of zero rows (work per token depends on depth only)")

    # prefill pp512 on the exact lane (eager; f32 GEMMs, TF32 off)
    if run.left() > 60:
        pp = eng.session(max_context=1024)
        prompt = rng.integers(6, min(vocab, 8000), size=512).tolist()

        def pp512():
            cp = pp.checkpoint(512)
            pp.prefill(prompt)
            _sync()
            pp.rollback(cp)

        from muser.engine.lanes import Lane

        lin = eng.forward.linear
        last = {}

        def pp512_fast():
            lin.lane = Lane.FAST  # same weights; the fast lane's bf16 tensor-core GEMMs for > 16 rows
            try:
                cp = pp.checkpoint(512)
                last["fast"] = pp.prefill(prompt)
                _sync()
                pp.rollback(cp)
            finally:
                lin.lane = Lane.EXACT

        def pp512_exact():
            cp = pp.checkpoint(512)
            last["exact"] = pp.prefill(prompt)
            _sync()
            pp.rollback(cp)

        cells = _timed({"pp512_exact": pp512_exact, "pp512_fast": pp512_fast}, reps=3 if run.left() < 150 else 5,
                       warmup=1)
        for lane_name in ("exact", "fast"):
            c = cells[f"pp512_{lane_name}"]
            out[f"prefill_pp512_{lane_name}"] = {"tok_s": 512 / c.mean, "cv": c.cv, "samples_s": c.samples,
                                                 "lane": lane_name}
            run.rows.append(("full prefill", f"pp512 {lane_name}", f"{512 / c.mean:.0f} tok/s (cv {c.cv:.3f})"))
        out["prefill_pp512"] = out["prefill_pp512_exact"]
        la, lb = last["exact"].astype(np.float64), last["fast"].astype(np.float64)
        lsm = lambda v: v - (np.log(np.sum(np.exp(v - v.max()))) + v.max())  # noqa: E731
        out["fast_lane_drift"] = {"max_abs_dlogit": float(np.max(np.abs(la - lb))),
                                  "max_abs_dlogsoftmax": float(np.max(np.abs(lsm(la) - lsm(lb)))),
                                  "top1_same": bool(np.argmax(la) == np.argmax(lb)),
                                  "what": "last-row logits of pp512, fast vs exact lane, same prompt"}
        run.rows.append(("full prefill", "fast-lane drift", f"max |dlsm| {out['fast_lane_drift']['max_abs_dlogsoftmax']:.3g}, "
                         f"top-1 same {out['fast_lane_drift']['top1_same']}"))
    out["peak_allocated_bytes"] = torch.cuda.max_memory_allocated() if cuda else None

    if llama_json and Path(llama_json).is_file():
        try:
            lj = json.loads(Path(llama_json).read_text())
            rows = lj if isinstance(lj, list) else lj.get("results", [lj])
            out["llama_cpp"] = [{k: r.get(k) for k in ("n_prompt", "n_gen", "n_depth", "avg_ts", "stddev_ts",
                                                        "model_size", "test", "type_k", "flash_attn")}
                                for r in rows if isinstance(r, dict)]
            for r in out["llama_cpp"]:
                what = f"pp{r['n_prompt']}" if r.get("n_prompt") else f"tg{r.get('n_gen')}"
                run.rows.append(("llama.cpp", f"{what} @ d{r.get('n_depth', 0)}", f"{r.get('avg_ts')} tok/s"))
        except Exception as e:
            out["llama_cpp_error"] = repr(e)
    out["gate2_status_this_run"] = gate_status
    return out


# ---------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "bench" / "receipts"))
    ap.add_argument("--receipts", default=None, help="where receipt files go (default: --out)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--full", default=None, help="an already written full-geometry GGUF")
    ap.add_argument("--no-full", action="store_true", help="skip the full-geometry stage")
    ap.add_argument("--llama-bench-json", default=None)
    ap.add_argument("--budget", type=float, default=480.0, help="seconds for the whole run")
    ap.add_argument("--gate-tokens", type=int, default=256)
    ap.add_argument("--gate-dtypes", default=",".join(DTYPES), help="tiny-fixture dtypes for Gate 2")
    ap.add_argument("--workdir", default=None, help="fixtures (default: $TMPDIR/muser-device)")
    ap.add_argument("--kv-context", type=int, default=131072, help="slot context for the KV figures")
    ap.add_argument("--depths", default="0,8192,32768", help="decode depths for the tok/s cells")
    ap.add_argument("--stages", default="env,kernels,gate2,invariance,full")
    ap.add_argument("--matvec", default="v1,v2", help="matvec variants timed in the full stage")
    ap.add_argument("--gate-receipt", default=None,
                    help="without the gate2 stage: the Gate 2 receipt of this tree on this machine")
    a = ap.parse_args(argv)
    out = Path(a.out)
    work = Path(a.workdir or os.path.join(os.environ.get("TMPDIR", "/tmp"), "muser-device"))
    work.mkdir(parents=True, exist_ok=True)
    run = Run(out, a.budget, a.device)
    import torch

    if a.device == "cpu":
        torch.set_num_threads(1)  # tiny fixtures: intra-op threads only add overhead
    stages = set(a.stages.split(","))
    depths = tuple(int(x) for x in a.depths.split(",") if x != "")
    if "env" in stages:
        run.stage("env", 0, stage_env, run)
    if a.device == "cuda" and "kernels" in stages:
        run.stage("kernels", 30, stage_kernels, run)
    g = (run.stage("gate2", 60, stage_gate2, run, work, a.gate_tokens, a.gate_dtypes.split(","))
         if "gate2" in stages else None) or {}
    if not g and a.gate_receipt:
        # Gate 2 ran earlier on the same machine and tree (another process of the same call):
        # its receipt's verdict gates these figures, and is named in them
        gr = json.loads(Path(a.gate_receipt).read_text())
        g = {"status": gr["gate"]["status"], "gated_by": Path(a.gate_receipt).name}
    if "full" in stages and not a.no_full and (a.device == "cuda" or a.full):
        need = 150 if a.full else 300
        run.stage("full", need, stage_full, run, work, a.full, a.llama_bench_json, g.get("status", "n/a"),
                  a.kv_context, depths, tuple(a.matvec.split(",")))
    if "invariance" in stages:
        run.stage("invariance", 40, stage_invariance, run, work)

    # receipts (muser.bench.receipt): one for the gate, one for the full-geometry figures
    try:
        from muser.bench.receipt import device_description, write_receipt

        dev = device_description(a.device)
        rdir = Path(a.receipts) if a.receipts else out
        gate = {"status": g.get("status", "n/a"), "what": "Gate 2: exact lane vs oracle f32, prefill + "
                f"{a.gate_tokens} greedy tokens, f32 and f16 K/V, tiny fixtures of {a.gate_dtypes}",
                "rows": g.get("rows"), "micro_model": g.get("micro_model"), "skipped": g.get("skipped")}
        paths = []
        if "gate2" in run.results:
            paths.append(write_receipt(
                f"engine-gate2-{a.device}", model={"fixtures": "SynthSpec() tiny, every dtype"},
                device=dev, lane="exact", gate=gate,
                results={"gate2": run.results.get("gate2"), "invariance": run.results.get("invariance"),
                         "kernels": run.results.get("kernels"), "env": run.results.get("env")}, out_dir=rdir))
        if "full" in run.results and "error" not in run.results["full"] and "skipped" not in run.results["full"]:
            fr = run.results["full"]
            paths.append(write_receipt("engine-full-geometry", model={"path": fr.get("path"),
                                       "file_bytes": fr.get("file_bytes"), "dtype_mix": fr.get("dtype_mix"),
                                       "config": fr.get("config")}, device=dev, lane="exact",
                                       gate={"status": "n/a", "gated_by": g.get("gated_by") or "engine-gate2 receipt of this call",
                                             "gated_by_status": g.get("status", "n/a"),
                                             "what": "Gate 2 (tiny fixtures, this tree on this machine) gates these figures"},
                                       results=fr, out_dir=rdir))
        run.results["receipts"] = [str(p) for p in paths]
        run.flush()
    except Exception as e:
        run.results["receipts_error"] = repr(e)
        run.flush()

    print("\n" + "=" * 100)
    print(f"muser engine device run ({a.device}), {time.time() - run.t0:.0f} s; JSON: {out / 'device_engine.json'}")
    print("-" * 100)
    for st, item, val in run.rows:
        print(f"{st:16s} {item:34s} {val}")
    print("=" * 100)
    return 0


if __name__ == "__main__":
    sys.exit(main())
