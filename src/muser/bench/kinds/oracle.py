"""`muser bench oracle`: CPU oracle speed, prefill of P tokens (512) and D decode steps (64).

Cells (interleaved, warm-up then --reps counted repetitions):
- prefill/<arithmetic>: a fresh session prefills P tokens (chunks of 512 rows);
- decode/<arithmetic>: the session state after the prefill is restored from a snapshot (a copy
  of a few hundred KiB, included in the time) and D tokens are decoded one at a time.

Gate: before timing, the same P + D tokens (prefill P, then decode D) run through the oracle and
the pinned llama.cpp; the receipt carries Gate 1a (arithmetic f32, KV f32) or 1b (ggml-cpu) for
that feeding, and the speed numbers are results only if it passes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from dataclasses import asdict


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("oracle", help="CPU oracle speed: prefill P tokens and D decode steps (receipt)")
    p.add_argument("--model", default=None,
                   help="Muse Glimmer GGUF (default: the default tiny synthetic fixture, written once)")
    p.add_argument("--prefill", type=int, default=512, help="prompt tokens (default 512)")
    p.add_argument("--decode", type=int, default=64, help="decode steps (default 64)")
    p.add_argument("--arithmetic", default="f32,ggml-cpu", help="comma-separated: f32, ggml-cpu")
    p.add_argument("--kv", choices=("f16", "f32"), default=None,
                   help="KV type (default: f32 for arithmetic f32, f16 for ggml-cpu)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=None, help="receipt directory (default: the per-user cache, muser.api.cache_dir()/receipts; give bench/receipts for the project's evidence)")
    p.set_defaults(func=run)


def default_fixture() -> str:
    """The default tiny synthetic fixture, written once under .cache/ (keyed by its spec)."""
    from ...bench.receipt import REPO_ROOT
    from ...model.synth import SynthSpec, write_fixture

    spec = SynthSpec()
    key = hashlib.sha256(json.dumps(asdict(spec), sort_keys=True).encode()).hexdigest()[:12]
    path = REPO_ROOT / ".cache" / "bench-fixtures" / f"tiny-{key}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_fixture(path, spec)
    return str(path)


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from ... import oracle as oracle_mod
    from ...bench.llamacpp import LlamaCppRunner
    from ...bench.receipt import device_description, run_interleaved, write_receipt
    from ...errors import LaneError
    from .parity import run_suite

    if args.prefill < 1 or args.decode < 0:
        raise LaneError(f"--prefill must be >= 1 and --decode >= 0, got {args.prefill} / {args.decode}")
    ariths = [a.strip() for a in args.arithmetic.split(",") if a.strip()]
    for a in ariths:
        if a not in ("f32", "ggml-cpu"):
            raise LaneError(f"--arithmetic {a!r} is not f32 or ggml-cpu")
    path = args.model or default_fixture()
    models = {a: oracle_mod.load(path, arithmetic=a, kv=args.kv) for a in ariths}
    cfg = next(iter(models.values())).config
    n = args.prefill + args.decode
    if n > cfg.context_length:
        raise LaneError(f"{n} tokens exceed the model's context_length {cfg.context_length}")
    tokens = [int(t) for t in np.random.default_rng(args.seed).integers(0, cfg.vocab, n)]
    prompt, steps = tokens[: args.prefill], tokens[args.prefill:]

    gates = {}
    for a, m in models.items():
        runner = LlamaCppRunner(path, kv=m.kv, n_ctx=max(256, n))
        try:
            mode = args.prefill if args.decode else "prefill"
            suite = run_suite(m, runner, tokens, [(mode, n)])
        finally:
            runner.close()
        gates[a] = suite.summary() | {"run": suite.runs[0].label}

    fns = {}
    for a, m in models.items():
        s0 = m.session(max_context=n)
        s0.prefill(prompt)
        snap = s0.snapshot()

        def prefill_cell(m=m):
            m.session(max_context=n).prefill(prompt)

        def decode_cell(m=m, snap=snap):
            s = m.session(max_context=n)
            s.restore(snap)
            for t in steps:
                s.decode(t)

        fns[f"prefill{args.prefill}/{a}"] = prefill_cell
        if steps:
            fns[f"decode{args.decode}/{a}"] = decode_cell
    cells = run_interleaved(fns, reps=args.reps, warmup=args.warmup)

    results = {}
    for name, c in cells.items():
        count = args.prefill if name.startswith("prefill") else args.decode
        results[name] = {"mean_s": c.mean, "cv": c.cv, "tokens": count, "tokens_per_s": count / c.mean}
    statuses = {g["status"] for g in gates.values()}
    status = "fail" if "fail" in statuses else ("pass" if "pass" in statuses else "n/a")
    m0 = next(iter(models.values()))
    out = write_receipt(
        "oracle", model={"path": path, "identity": m0.identity.to_json()},
        device=device_description("cpu"), lane="oracle (numpy CPU reference)",
        gate={"status": status, "parity": gates}, results=results, cells=cells, out_dir=args.out_dir,
        extra={"prefill_tokens": args.prefill, "decode_steps": args.decode, "kv": {a: m.kv for a, m in models.items()}},
    )
    for name, r in results.items():
        print(f"{name:>24}  {r['mean_s'] * 1e3:9.1f} ms  cv {r['cv']:.3f}  {r['tokens_per_s']:9.1f} tok/s")
    for a, g in gates.items():
        print(f"gate ({a}, {g['run']}): Gate {g['gate']} {g['status']}  max {g['max']:.3e}  "
              f"top1 {g['top1_agreement']:.4f}  noise floor {g['noise_floor']:.3e}")
    print(f"receipt: {out}")
    return 0 if status != "fail" else 1
