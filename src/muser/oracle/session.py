"""`muser.oracle`: the numpy CPU reference with the engine's Session surface (DESIGN.md).

    import muser
    m = muser.oracle.load(path, arithmetic="f32" | "ggml-cpu", kv="f16" | "f32", pin=None)
    s = m.session(max_context=4096)
    logits = s.prefill(ids, all_logits=False)   # float32 [vocab] (last row) or [T, vocab]
    logits = s.decode(token)                    # float32 [vocab]
    s.n_past, cp = s.checkpoint(); s.rollback(cp)
    s.captured                                  # {layer: [T, hidden]} inputs of the capture layers
    m.noise_floor(tokens)                       # max |d log-softmax|: 1-ulp jitter, f32 summation orders

Arithmetic "f32": weights dequantized to f32, correctly rounded dots, no rounding point except
the KV type (f32 by default). Arithmetic "ggml-cpu": the pinned llama.cpp CPU graph's rounding
points for the file's dtypes and the KV type (f16 by default); see muser.oracle.numerics.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence as Seq

import numpy as np

from ..errors import LaneError
from ..kv import KvCache
from ..model.config import MuseConfig
from ..model.loader import ModelFile, open_model
from .forward import OracleForward, OracleWeights, single_thread_blas
from ..sequence import Sequence, check_chunk, check_max_context
from .numerics import ARITHMETICS, REDUCTIONS, Arithmetic, log_softmax

DEFAULT_CHUNK = 512  # prefill rows per forward (book 10.10: PREFILL_BATCH_TOKENS)
DEFAULT_KV = {"f32": "f32", "ggml-cpu": "f16"}
ORDER_PROBES = ("f32-block32", "f32-seq")  # the other f32 reduction orders noise_floor() runs


class OracleSession(Sequence):
    """One sequence: its KV planes and position, on the shared protocol (muser.sequence: one
    validation, one rollback-on-failure, the same typed errors as the engine's session)."""

    def __init__(self, model: "OracleModel", max_context: int, chunk: int = DEFAULT_CHUNK,
                 capture: Iterable[int] = ()):
        cfg = model.config
        max_context = check_max_context(max_context, cfg.context_length)
        chunk = check_chunk(chunk)
        self.model = model
        self._init_seq(KvCache.for_config(cfg, max_context, model.kv), cfg.vocab, cfg.n_layers,
                       max_context, chunk, capture)

    @property
    def capture(self) -> tuple[int, ...]:
        return self.capture_layers

    def _forward(self, ids: np.ndarray, rows: str,
                 capture: tuple[int, ...]) -> tuple[np.ndarray | None, dict[int, np.ndarray]]:
        with single_thread_blas():
            out = self.model.forward.chunk(self.cache, ids, self.n_past, rows, capture)
        return out.logits, dict(out.hidden)


class OracleModel:
    def __init__(self, mf: ModelFile, arithmetic: str, kv: str):
        self.file = mf
        self.config: MuseConfig = mf.config
        self.arithmetic = arithmetic
        self.kv = kv
        self.weights = OracleWeights(mf)
        self.forward = OracleForward(self.config, self.weights, Arithmetic(arithmetic, kv))

    @property
    def identity(self):
        return self.file.identity

    @property
    def path(self):
        return self.file.path

    def session(self, max_context: int | None = None, chunk: int = DEFAULT_CHUNK,
                capture: Iterable[int] = ()) -> OracleSession:
        return OracleSession(self, self.config.context_length if max_context is None else max_context,
                             chunk, capture)

    def logits(self, tokens: Seq[int], mode: str | int = "prefill", max_context: int | None = None,
               chunk: int = DEFAULT_CHUNK, jitter: Any = None, rows_from: int = 0) -> np.ndarray:
        """All-position logits [T, vocab] of `tokens` in a fresh session: one chunked prefill
        ("prefill"), token-by-token decode ("decode"), or a prefill of P tokens then decode (P).
        `jitter` ("up" | "down" | a numpy Generator) moves every perturbation site by 1 ulp.
        `rows_from` (prefill only): the logits of positions rows_from.. [T - rows_from, vocab],
        the same bits as those rows of the whole prefill's (a random-sign jitter draws its signs
        in the order the sites are computed, so with rows_from it is another sample)."""
        if jitter is not None:
            own = copy.copy(self.forward.arith)
            own.jitter = jitter
            return self._with(own).logits(tokens, mode, max_context, chunk, rows_from=rows_from)
        toks = [int(t) for t in tokens]
        if rows_from and (mode != "prefill" or not 0 <= rows_from < len(toks)):
            raise LaneError(f"rows_from {rows_from} needs mode 'prefill' and 0 <= rows_from < {len(toks)} tokens")
        s = self.session(max_context or max(len(toks), 1), chunk)
        if mode == "prefill":
            # the chunks before the one holding rows_from run without the LM head (its rows are
            # never read: ~40 % of a 616-token gate prefill's work at the full vocabulary), the
            # chunk boundaries stay those of the whole prefill, so the rows kept are its bits
            c = rows_from // s.chunk * s.chunk
            if c:
                s.prefill(toks[:c])
            return s.prefill(toks[c:], all_logits=True)[rows_from - c:]
        if mode == "decode":
            return np.stack([s.decode(t) for t in toks])
        if isinstance(mode, int) and not isinstance(mode, bool) and 0 < mode <= len(toks):
            head = s.prefill(toks[:mode], all_logits=True)
            return np.concatenate([head, *[s.decode(t)[None] for t in toks[mode:]]])
        raise LaneError(f"mode must be 'prefill', 'decode' or a prefill length in [1, {len(toks)}], got {mode!r}")

    def noise_runs(self, tokens: Seq[int], mode: str | int = "prefill", trials: int = 2, seed: int = 0,
                   chunk: int = DEFAULT_CHUNK, orders: Seq[str] = ORDER_PROBES, rows_from: int = 0,
                   workers: int = 1) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """The unperturbed log-softmax [T, vocab] of `tokens` and each perturbed one noise_floor()
        compares it with: "jitter:up", "jitter:down", "jitter:rngN" (1-ulp moves), and
        "order:NAME" (the same forward under another f32 reduction order). `rows_from` (prefill):
        only positions rows_from.. ([T - rows_from, vocab] each; see `logits`). `workers` > 1 runs
        that many of the forwards at once on threads (each its own session and arithmetic over the
        shared weights, one BLAS thread each): the same bits as one at a time."""
        if trials < 1:
            raise LaneError(f"noise floor needs at least one trial, got {trials}")
        if workers < 1:
            raise LaneError(f"noise floor workers must be >= 1, got {workers}")
        arith = self.forward.arith
        bad = [o for o in orders if o not in REDUCTIONS or o == arith.reduction]
        if bad:
            raise LaneError(f"noise-floor orders {bad} must be reductions other than the oracle's "
                            f"{arith.reduction!r} (one of {', '.join(REDUCTIONS)})")
        plan: list[tuple[str, Any, str]] = [("base", None, arith.reduction)]
        for t in range(trials):
            jitter = ("up", "down")[t] if t < 2 else np.random.default_rng([seed, t])
            plan.append((f"jitter:{('up', 'down')[t] if t < 2 else f'rng{t}'}", jitter, arith.reduction))
        plan += [(f"order:{o}", None, o) for o in orders]

        def run(job: tuple[str, Any, str]) -> np.ndarray:
            _, jitter, reduction = job
            own = copy.copy(arith)  # the model's arithmetic as it is (its rounding points included)
            own.jitter, own.reduction = jitter, reduction
            return log_softmax(self._with(own).logits(tokens, mode, chunk=chunk, rows_from=rows_from))

        if workers > 1 and len(plan) > 1:
            from concurrent.futures import ThreadPoolExecutor

            # one BLAS thread for the whole pool: the runs' own limits nest inside it (each
            # restores 1 on exit), so no run's exit hands the others a multi-threaded BLAS
            with single_thread_blas(), ThreadPoolExecutor(min(workers, len(plan))) as pool:
                outs = list(pool.map(run, plan))
        else:
            outs = [run(job) for job in plan]
        return outs[0], {label: o for (label, _, _), o in zip(plan[1:], outs[1:])}

    def _with(self, arith: Arithmetic) -> "OracleModel":
        """This model with another arithmetic (jitter, reduction order): the same weights, a
        forward of its own, so runs on other threads do not share mutable state."""
        view, fwd = copy.copy(self), copy.copy(self.forward)  # the forward as it is (stateless)
        fwd.arith = arith
        view.forward = fwd
        return view

    def noise_floor(self, tokens: Seq[int], mode: str | int = "prefill", trials: int = 2, seed: int = 0,
                    chunk: int = DEFAULT_CHUNK, orders: Seq[str] = ORDER_PROBES) -> "NoiseFloor":
        """The fixture's noise floor for this feeding of `tokens` (DESIGN.md "Exactness
        contract"): per-position max |d log-softmax| against the unperturbed run, in two parts:
        - jitter: every norm output and every rounding point's input moved by 1 f32 ulp. Trial 0
          moves every value up, trial 1 down (so an element just below and one just above a
          rounding boundary are both caught), further trials use a random sign per element;
        - order: the same forward with its dot products reduced in each other legitimate f32
          order (`orders`, from numerics.REDUCTIONS). On trained weights this part can exceed
          the 1-ulp probe, and no f32 implementation is bound to the oracle's own order.
        value is the larger max of the two parts; median and top1 are the worst perturbation's."""
        base, runs = self.noise_runs(tokens, mode, trials, seed, chunk, orders)
        return NoiseFloor.measure(base, runs, mode)

    def close(self) -> None:
        self.file.close()


@dataclass(frozen=True)
class NoiseFloor:
    value: float  # max(jitter, order): the max no non-bit-identical implementation can beat
    trials: list[float] = field(default_factory=list)  # max per 1-ulp jitter trial
    mode: str | int = "prefill"
    n_tokens: int = 0
    jitter: float = 0.0  # the 1-ulp part: max over trials
    order: float = 0.0  # the summation-order part: max over the other reduction orders
    orders: dict[str, float] = field(default_factory=dict)  # max per reduction order
    median: float = 0.0  # worst perturbation's median over positions of per-position max |d|
    top1: float = 1.0  # worst perturbation's top-1 agreement with the unperturbed run

    @classmethod
    def measure(cls, base: np.ndarray, runs: dict[str, np.ndarray], mode: str | int = "prefill",
                rows: int | None = None) -> "NoiseFloor":
        """The floor over the first `rows` positions (all by default) of noise_runs() output."""
        n = base.shape[0] if rows is None else rows
        b = base[:n]
        top = np.argmax(b, axis=-1)
        per: dict[str, tuple[float, float, float]] = {}
        for k, r in runs.items():
            d = np.abs(r[:n] - b).max(axis=-1)  # [n]
            per[k] = (float(d.max()), float(np.median(d)), float(np.mean(np.argmax(r[:n], axis=-1) == top)))
        jit = [v[0] for k, v in per.items() if k.startswith("jitter:")]
        orders = {k.split(":", 1)[1]: v[0] for k, v in per.items() if k.startswith("order:")}
        j, o = max(jit, default=0.0), max(orders.values(), default=0.0)
        return cls(max(j, o), jit, mode, n, j, o, orders, max((v[1] for v in per.values()), default=0.0),
                   min((v[2] for v in per.values()), default=1.0))

    def to_json(self) -> dict:
        return {"value": self.value, "jitter": self.jitter, "order": self.order, "orders": dict(self.orders),
                "median": self.median, "top1": self.top1, "trials": list(self.trials), "mode": self.mode,
                "n_tokens": self.n_tokens}


def load(path: str | os.PathLike, arithmetic: str = "f32", kv: str | None = None, pin: Any = None) -> OracleModel:
    """Open and validate `path` (fails closed), dequantize its weights, and return the oracle."""
    if arithmetic not in ARITHMETICS:
        raise LaneError(f"arithmetic {arithmetic!r} is not one of {', '.join(ARITHMETICS)}")
    kv = DEFAULT_KV[arithmetic] if kv is None else kv
    if kv not in ("f16", "f32"):
        raise LaneError(f"kv {kv!r} is not one of f16, f32")
    mf = open_model(path, pin=pin)
    try:
        return OracleModel(mf, arithmetic, kv)
    except BaseException:
        mf.close()
        raise


def noise_floor(model: OracleModel, tokens: Seq[int], mode: str | int = "prefill", trials: int = 2,
                orders: Seq[str] | None = None) -> NoiseFloor:
    """Module-level form of OracleModel.noise_floor."""
    return model.noise_floor(tokens, mode=mode, trials=trials,
                             orders=ORDER_PROBES if orders is None else orders)


def parity_stats(reference: np.ndarray, other: np.ndarray) -> dict:
    """max / median over positions of the per-position max |d log-softmax| over the vocabulary,
    and top-1 agreement, between two [T, vocab] logit arrays."""
    a, b = np.atleast_2d(reference), np.atleast_2d(other)
    if a.shape != b.shape:
        raise LaneError(f"logit shapes differ: {list(a.shape)} vs {list(b.shape)}")
    d = np.abs(log_softmax(a) - log_softmax(b)).max(axis=-1)  # [T]
    top = np.argmax(a, axis=-1) == np.argmax(b, axis=-1)
    return {
        "positions": int(a.shape[0]),
        "max": float(d.max()),
        "median": float(np.median(d)),
        "argmax_position": int(np.argmax(d)),
        "top1_agreement": float(top.mean()),
        "top1_mismatches": [int(i) for i in np.flatnonzero(~top)],
    }
