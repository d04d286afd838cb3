"""`muser bench parity`: Gate 1 (DESIGN.md "Exactness contract"), oracle vs the pinned llama.cpp.

The same tokens run through `muser.oracle` and through llama.cpp (all-position logits, type_k /
type_v set to the KV type, non-flash attention). Each run reports max and median over positions
of the per-position max |d log-softmax| over the full vocabulary, top-1 agreement, and the
oracle's noise floor for exactly that run (same tokens, same feeding).

Runs (default): prefill of prompts whose last position is 1, W-1, W, W+1, 2W+1 and the whole
prompt (> 3 windows), token-by-token decode of the whole prompt, and prefill to W+1 followed by
decode (a wrapped ring continued one token at a time).

Gate 1a (F32 weights, arithmetic f32, KV f32): every run max <= max(1e-4, 2 x noise floor) and
median <= max(1e-5, 2 x the noise's median), top-1 identical everywhere. Gate 1b (arithmetic
ggml-cpu): the same max and median rules per run, top-1 agreement >= 99% over all positions
(muser.gates.judge). Other combinations are reported with gate "n/a". The noise floor holds the
1-ulp jitter and the f32 summation-order spread (OracleModel.noise_floor).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field
from typing import Sequence

import numpy as np

from ...gates import GATE_FLOOR as FLOOR, MEDIAN_FLOOR, judge  # noqa: F401 - the one verdict rule


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("parity", help="Gate 1: oracle vs pinned llama.cpp (max/median |d log-softmax|, top-1)")
    p.add_argument("--model", required=True, help="Muse Glimmer GGUF")
    p.add_argument("--tokens", default=None, help="comma-separated token ids (default: seeded random)")
    p.add_argument("--n-tokens", type=int, default=None, help="random prompt length (default 3W + 8)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompt (default 0)")
    p.add_argument("--kv", choices=("f16", "f32"), default="f16", help="KV element type on both sides")
    p.add_argument("--arithmetic", choices=("f32", "ggml-cpu"), default=None,
                   help="oracle arithmetic (default: f32 with --kv f32, ggml-cpu with --kv f16)")
    p.add_argument("--runs", default="boundaries",
                   help="'boundaries' (default), or comma-separated: prefill, decode, or a prefill length P "
                        "(prefill P then decode)")
    p.add_argument("--out-dir", default=None, help="receipt directory (default: the per-user cache, muser.api.cache_dir()/receipts; give bench/receipts for the project's evidence)")
    p.set_defaults(func=run)


# --- the suite --------------------------------------------------------------------------------


def default_tokens(vocab: int, window: int, n: int | None = None, seed: int = 0) -> list[int]:
    """A seeded random prompt, by default 3W + 8 tokens (crosses every SWA boundary)."""
    n = 3 * window + 8 if n is None else n
    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab, n)]


def boundary_runs(n_tokens: int, window: int) -> list[tuple[str | int, int]]:
    """(mode, length) pairs: prefills ending at positions 1, W-1, W, W+1, 2W+1 and n-1; decode of
    all n; prefill to W+1 then decode."""
    lengths = sorted({L for L in (2, window, window + 1, window + 2, 2 * window + 2, n_tokens) if 1 <= L <= n_tokens})
    runs: list[tuple[str | int, int]] = [("prefill", L) for L in lengths]
    runs.append(("decode", n_tokens))
    if window + 1 < n_tokens:
        runs.append((window + 1, n_tokens))
    return runs


def gate_name(arithmetic: str, kv: str, all_f32_weights: bool) -> str:
    """1a: F32 weights, F32 KV, oracle f32 (semantics). 1b: oracle ggml-cpu (rounding points).
    Anything else (e.g. a quantized file under arithmetic f32) is reported, not gated."""
    if arithmetic == "f32" and kv == "f32" and all_f32_weights:
        return "1a"
    if arithmetic == "ggml-cpu":
        return "1b"
    return "n/a"


def _all_f32(oracle) -> bool:
    return all(d == "F32" for d in oracle.file.contract.dtypes.values())


@dataclass
class ParityRun:
    mode: str | int
    n_tokens: int
    max: float
    median: float
    top1_agreement: float
    noise_floor: float
    threshold: float
    ok: bool
    median_floor: float
    median_threshold: float
    noise_jitter: float  # the two parts of noise_floor (OracleModel.noise_floor)
    noise_order: float
    argmax_position: int
    top1_mismatches: list[int] = field(default_factory=list)
    per_position_max: list[float] = field(default_factory=list, repr=False)

    @property
    def label(self) -> str:
        return f"{self.mode}[{self.n_tokens}]" if isinstance(self.mode, str) else f"prefill{self.mode}+decode[{self.n_tokens}]"


@dataclass
class ParitySuite:
    gate: str
    arithmetic: str
    kv: str
    runs: list[ParityRun]

    @property
    def max(self) -> float:
        return max(r.max for r in self.runs)

    @property
    def median(self) -> float:
        return float(np.median(np.concatenate([r.per_position_max for r in self.runs])))

    @property
    def noise_floor(self) -> float:
        return max(r.noise_floor for r in self.runs)

    @property
    def noise_jitter(self) -> float:
        return max(r.noise_jitter for r in self.runs)

    @property
    def noise_order(self) -> float:
        return max(r.noise_order for r in self.runs)

    @property
    def top1(self) -> float:
        n = sum(r.n_tokens for r in self.runs)
        return sum(r.top1_agreement * r.n_tokens for r in self.runs) / n

    @property
    def outright(self) -> bool:
        return self.max <= FLOOR

    def status(self) -> str:
        if self.gate == "n/a":
            return "n/a"
        need = self.top1_need
        return "pass" if all(r.ok for r in self.runs) and self.top1 >= need else "fail"

    @property
    def top1_need(self) -> float:
        return 1.0 if self.gate == "1a" else 0.99

    def summary(self) -> dict:
        return {"gate": self.gate, "status": self.status(), "arithmetic": self.arithmetic, "kv": self.kv,
                "max": self.max, "median": self.median, "top1_agreement": self.top1, "top1_need": self.top1_need,
                "runs_over_max": [r.label for r in self.runs if r.max > r.threshold],
                "runs_over_median": [r.label for r in self.runs if r.median > r.median_threshold],
                "noise_floor": self.noise_floor, "noise_jitter": self.noise_jitter, "noise_order": self.noise_order,
                "max_le_1e-4": self.outright,
                "runs": len(self.runs), "positions": sum(r.n_tokens for r in self.runs)}


def run_suite(oracle, runner, tokens: Sequence[int], runs: Sequence[tuple[str | int, int]],
              oracle_feeding: str = "same") -> ParitySuite:
    """Every (mode, length) run through both engines, with the oracle's noise floor per run.

    oracle_feeding="same" feeds the oracle exactly like llama.cpp. "prefill" computes the oracle
    once per prompt with one prefill (base and every noise perturbation) and slices it for every
    run: valid because the oracle is causal, row-independent and chunk-invariant bit for bit
    (tests/oracle checks prefill == decode == prefill+decode == any chunk size)."""
    from ...oracle import NoiseFloor, parity_stats
    from ...oracle.numerics import log_softmax

    if oracle_feeding not in ("same", "prefill"):
        raise ValueError(f"oracle_feeding must be 'same' or 'prefill', got {oracle_feeding!r}")
    shared = None
    if oracle_feeding == "prefill":
        shared = oracle.noise_runs(list(tokens[: max(n for _, n in runs)]))
    out = []
    for mode, n in runs:
        toks = list(tokens[:n])
        if shared is None:
            base, pert = oracle.noise_runs(toks, mode=mode)
            nf = NoiseFloor.measure(base, pert, mode)
        else:
            base, pert = shared
            nf = NoiseFloor.measure(base, pert, mode, rows=n)
        ours = base[:n]
        theirs = runner.logits(toks, mode)
        st = parity_stats(ours, theirs)
        per_pos = np.abs(ours - log_softmax(theirs)).max(axis=-1)
        v = judge(per_pos, st["top1_agreement"], nf, top1_need=0.0)  # top-1 is judged over the suite
        out.append(ParityRun(mode, n, st["max"], st["median"], st["top1_agreement"], nf.value, v["bounds"]["max"],
                             v["ok"], nf.median, v["bounds"]["median"], nf.jitter, nf.order, st["argmax_position"],
                             st["top1_mismatches"], [float(x) for x in per_pos]))
    return ParitySuite(gate_name(oracle.arithmetic, oracle.kv, _all_f32(oracle)), oracle.arithmetic, oracle.kv, out)


# --- command ----------------------------------------------------------------------------------


def _parse_runs(text: str, n: int, window: int) -> list[tuple[str | int, int]]:
    from ...errors import MuserError

    if text == "boundaries":
        return boundary_runs(n, window)
    runs: list[tuple[str | int, int]] = []
    for part in text.split(","):
        part = part.strip()
        if part in ("prefill", "decode"):
            runs.append((part, n))
        elif part.isdigit() and 0 < int(part) <= n:
            runs.append((int(part), n))
        else:
            raise MuserError(f"--runs: {part!r} is not prefill, decode or a prefill length in [1, {n}]")
    return runs


def run(args: argparse.Namespace) -> int:
    from ...bench.llamacpp import LlamaCppRunner
    from ...bench.receipt import device_description, write_receipt
    from ...errors import MuserError
    from ... import oracle as oracle_mod

    arithmetic = args.arithmetic or ("f32" if args.kv == "f32" else "ggml-cpu")
    m = oracle_mod.load(args.model, arithmetic=arithmetic, kv=args.kv)
    cfg = m.config
    if args.tokens:
        try:
            tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
        except ValueError as e:
            raise MuserError(f"--tokens must be comma-separated integers: {e}") from None
    else:
        tokens = default_tokens(cfg.vocab, cfg.sliding_window, args.n_tokens, args.seed)
    if not tokens:
        from ...errors import EmptyInput

        raise EmptyInput("--tokens is empty")
    runs = _parse_runs(args.runs, len(tokens), cfg.sliding_window)
    from ...sequence import check_tokens

    check_tokens(tokens, cfg.vocab, "--tokens")  # bad ids refused before any work (muser.sequence)
    runner = LlamaCppRunner(args.model, kv=args.kv, n_ctx=max(256, len(tokens)))
    try:
        suite = run_suite(m, runner, tokens, runs)
    finally:
        runner.close()
    ident = m.identity
    model = {"path": str(m.path), "identity": ident.to_json(),
             "dtypes": sorted(set(m.file.contract.dtypes.values())),
             "synth_spec": json.loads(m.file.gguf.get("muser.synth_spec")) if "muser.synth_spec" in m.file.gguf else None}
    summary = suite.summary()
    gate = {"status": suite.status(), "name": f"Gate {suite.gate}",
            "rule": "every run: max <= max(1e-4, 2 x noise floor), median <= max(1e-5, 2 x noise median); top-1 " +
                    ("identical" if suite.gate == "1a" else ">= 99% of positions"),
            "max": summary["max"], "median": summary["median"], "top1_agreement": summary["top1_agreement"],
            "noise_floor": summary["noise_floor"], "runs_over_max": summary["runs_over_max"],
            "runs_over_median": summary["runs_over_median"]}
    results = {"summary": summary,
               "runs": [{k: v for k, v in asdict(r).items() if k != "per_position_max"} | {"label": r.label}
                        for r in suite.runs]}
    path = write_receipt("parity", model=model, device=device_description("cpu"),
                         lane=f"oracle {arithmetic} kv={args.kv} vs llama.cpp", gate=gate, results=results,
                         out_dir=args.out_dir, extra={"comparator": runner.settings(), "tokens": tokens})
    for r in suite.runs:
        print(f"{r.label:>24}  max {r.max:.3e}  median {r.median:.3e}  top1 {r.top1_agreement:.4f}  "
              f"noise {r.noise_floor:.3e} / median {r.median_floor:.3e}  {'ok' if r.ok else 'OVER'}")
    print(f"Gate {suite.gate}: {suite.status()}  max {suite.max:.3e}  median {suite.median:.3e}  "
          f"top1 {suite.top1:.4f}  noise floor {suite.noise_floor:.3e}")
    print(f"receipt: {path}")
    return 0 if suite.status() in ("pass", "n/a") else 1
