#!/usr/bin/env python3
"""The sampling run on the GPU machine: device-filtered candidates against the full-vocabulary
chain on CUDA tensors, generation over device rows against host rows, the load-time warm-up,
and `muser generate`'s TTFT and tok/s on the shipped micro model (plain and speculative).
With --model, the load, generation and cli stages run that GGUF instead (the full geometry: the
load-time warm-up, and the generation loop's TTFT for PROMPT16 and tok/s on it).

    python3 tools/device_sampling.py --out "$OUT" [--rows 300] [--tokens 128] [--model GGUF]

Writes device_sampling.json into --out (after each stage), a receipt (kind sampling-cuda) beside
it at the end, and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
SITE = REPO / ".device" / "site"  # a carried pure-Python package folder (gguf), when present
if SITE.is_dir():
    sys.path.append(str(SITE))

import numpy as np  # noqa: E402
import torch  # noqa: E402

PROMPT16 = "import os\nimport sys\n\n\ndef main(argv):\n    parser = "  # about 16 tokens of the micro vocab


def parity(rows: int) -> dict:
    from muser.engine.rows import DeviceRow
    from muser.sample import Sampler, SamplingParams
    from muser.sample.candidates import DeviceFilter

    V = 50_000
    sets = {"default": SamplingParams(seed=7), "greedy": SamplingParams(temperature=0.0, seed=7),
            "top_k_200": SamplingParams(top_k=200, top_p=0.9, seed=7),
            "bias": SamplingParams(top_k=20, logit_bias={5: -math.inf, 9: 2.5}, seed=7)}
    out = {}
    rng = np.random.default_rng(0)
    for name, P in sets.items():
        a, b = Sampler(P, V), Sampler(P, V)
        f = DeviceFilter(b)
        same = filtered = 0
        for i in range(rows):
            x = rng.normal(0, 3, V).astype(np.float32)
            if i % 2:
                x = (np.round(x * 4) / 4).astype(np.float32)
            t = torch.from_numpy(x).cuda()
            row = DeviceRow(t, torch.isfinite(t).all())
            red = f.read(row)
            tb = None if red is None else b.sample_top(red.ids, red.logit)
            if tb is None:
                tb = b.sample(row.host())
            else:
                filtered += 1
            ta = a.sample(x)
            same += ta == tb
        out[name] = {"rows": rows, "identical": same, "filtered": filtered,
                     "rng_aligned": a.rng.getstate() == b.rng.getstate()}
    return out


class HostRows:
    """An engine session seen through the Session surface only (full host rows)."""

    def __init__(self, s):
        self.s = s

    def prefill(self, ids):
        return self.s.prefill(ids)

    def decode(self, t):
        return self.s.decode(t)


def generation(m, tokens: int, n_prompt: int | None = None) -> dict:
    """Generation over device rows and over host rows from PROMPT16 (its first n_prompt tokens of
    it repeated, when given: the TTFT of a prompt of that many tokens)."""
    from muser.generation import generate
    from muser.sample import SamplingParams

    tok = m.tokenizer
    ids = m.encode(PROMPT16)
    if n_prompt is not None:
        ids = m.encode(PROMPT16 * (n_prompt // max(1, len(ids)) + 1))[:n_prompt]
    out = {"prompt_tokens": len(ids)}
    for name, P in {"default": SamplingParams(seed=11), "greedy": SamplingParams(temperature=0.0, seed=11),
                    "top_p_only": SamplingParams(top_k=0, seed=11)}.items():
        n_ctx = len(ids) + tokens
        g_dev = generate(m.session(max_context=n_ctx), tok, ids, P, tokens)
        ev_dev = list(g_dev)
        g_host = generate(HostRows(m.session(max_context=n_ctx)), tok, ids, P, tokens)
        ev_host = list(g_host)
        out[name] = {"identical_tokens": [e.token for e in ev_dev] == [e.token for e in ev_host],
                     "n": len(ev_dev), "max_logprob_diff": max(abs(a.logprob - b.logprob) for a, b in zip(ev_dev, ev_host)),
                     "device_rows": g_dev.stats(), "host_rows": g_host.stats()}
    return out


def cli(args: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "src")] + ([str(SITE)] if SITE.is_dir() else [])),
               PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "muser"] + args, capture_output=True, text=True, env=env, timeout=300)
    return {"argv": args, "rc": p.returncode, "seconds": time.perf_counter() - t0,
            "stderr_tail": p.stderr[-1500:], "stdout_tail": p.stdout[-300:]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, default=300)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--stages", default="parity,load,generation,cli")
    ap.add_argument("--model", default=None, help="GGUF for the load, generation and cli stages (default: the "
                                                  "shipped micro model)")
    ap.add_argument("--prompt-tokens", default=None, help="comma-separated prompt lengths for the generation "
                    "stage (default: PROMPT16 as it tokenizes)")
    a = ap.parse_args()
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rec: dict = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0)}
    stages = a.stages.split(",")
    m = None

    def stage(name, fn):
        t0 = time.perf_counter()
        try:
            rec[name] = fn()
        except Exception:  # noqa: BLE001 - record and go on
            rec[name] = {"error": traceback.format_exc()[-3000:]}
        rec[name + "_seconds"] = time.perf_counter() - t0
        print(f"== {name} ({rec[name + '_seconds']:.1f} s)", json.dumps(rec[name], default=str)[:3000], flush=True)
        (out_dir / "device_sampling.json").write_text(json.dumps(rec, indent=1, default=str))

    if "parity" in stages:
        stage("parity", lambda: parity(a.rows))
    if "load" in stages:
        def load():
            nonlocal m
            import muser

            t0 = time.perf_counter()
            m = muser.load(a.model, device="cuda")
            return {"load_s": time.perf_counter() - t0, "warm": m.warm_record}
        stage("load", load)
    if "generation" in stages and m is not None:
        if a.prompt_tokens:
            for n in (int(v) for v in a.prompt_tokens.split(",")):
                stage(f"generation_{n}", lambda n=n: generation(m, a.tokens, n))
        else:
            stage("generation", lambda: generation(m, a.tokens))
    if "cli" in stages:
        base = ["generate", "--device", "cuda", "--prompt", PROMPT16, "--max-tokens", str(a.tokens), "--seed", "3"]
        base += ["--model", a.model] if a.model else []
        stage("cli_plain", lambda: cli(base + ["--no-draft"]))
        stage("cli_plain_greedy", lambda: cli(base + ["--no-draft", "--temperature", "0"]))
        stage("cli_spec", lambda: cli(base))
    if "bench" in stages:
        stage("bench_decode", lambda: cli(["bench", "decode", "--device", "cuda", "--depths", "0", "--tokens",
                                           str(a.tokens), "--reps", "3", "--out-dir", str(out_dir)]))
    # the receipt: device-filtered sampling gives the full chain's tokens and keeps its random stream
    # aligned (parity), and generation over device rows equals generation over host rows
    checks = {}
    for name, r in (rec.get("parity") or {}).items():
        if isinstance(r, dict) and "identical" in r:
            checks[f"parity/{name}"] = r["identical"] == r["rows"] and r["rng_aligned"]
    for key in [k for k in rec if k == "generation" or (k.startswith("generation_") and not k.endswith("seconds"))]:
        for name, r in (rec.get(key) or {}).items():
            if isinstance(r, dict) and "identical_tokens" in r:
                checks[f"{key}/{name}"] = bool(r["identical_tokens"])
    missing = [st for st in ("parity", "generation") if st in stages and not any(k.startswith(st) for k in checks)]
    status = "fail" if not all(checks.values()) else ("partial" if missing or not checks else "pass")
    from muser.bench.receipt import device_description, write_receipt

    path = write_receipt("sampling-cuda", model={"path": a.model or "the shipped micro model"},
                         device=device_description("cuda"),
                         lane="exact", gate={"status": status, "rule": "device-filtered candidates sample the full "
                                             "chain's tokens with the random stream aligned; device-row generation "
                                             "equals host-row generation", "checks": checks, "skipped": missing},
                         results=rec, out_dir=out_dir.parent if out_dir.name == "sampling" else out_dir)
    print(f"sampling: {status}; receipt {path}", flush=True)
    return 0 if status == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
