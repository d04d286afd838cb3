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

import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

from ..errors import (
    CacheDiscontinuity,
    ContextOverflow,
    EmptyInput,
    LaneError,
    NonFiniteLogits,
    TokenOutOfRange,
)
from ..kv import DEFAULT_BLOCK, KvCache, KvCheckpoint, KvSnapshot
from ..model.config import MuseConfig
from ..model.loader import ModelFile, open_model
from .forward import OracleForward, OracleWeights, single_thread_blas
from .numerics import ARITHMETICS, REDUCTIONS, Arithmetic, log_softmax

DEFAULT_CHUNK = 512  # prefill rows per forward (book 10.10: PREFILL_BATCH_TOKENS)
DEFAULT_KV = {"f32": "f32", "ggml-cpu": "f16"}
ORDER_PROBES = ("f32-block32", "f32-seq")  # the other f32 reduction orders noise_floor() runs


@dataclass(frozen=True)
class SessionCheckpoint:
    kv: KvCheckpoint
    n_past: int
    session: int  # id() of the session it belongs to


class OracleSession:
    """One sequence: its KV planes and position. Bad input is refused before any work; a forward
    that fails (non-finite logits) is undone, so the session stays usable."""

    def __init__(self, model: "OracleModel", max_context: int, chunk: int = DEFAULT_CHUNK,
                 capture: Iterable[int] = ()):
        cfg = model.config
        if not 0 < max_context <= cfg.context_length:
            raise ContextOverflow(
                f"max_context {max_context} must be in [1, {cfg.context_length}] (the model's context_length)"
            )
        if chunk < 1:
            raise EmptyInput(f"prefill chunk must be >= 1 row, got {chunk}")
        self.model = model
        self.max_context = max_context
        self.chunk = chunk
        self.capture = model._check_capture(capture)
        self.cache = KvCache.for_config(cfg, max_context, model.kv)
        self.n_past = 0
        self.captured: dict[int, np.ndarray] = {}

    # -- validation ----------------------------------------------------------------------------
    def _check(self, ids: Any, position: int | None) -> np.ndarray:
        arr = np.asarray(ids)
        if arr.ndim == 0:
            arr = arr.reshape(1)
        if arr.ndim != 1:
            raise TokenOutOfRange(f"token ids must be a flat sequence, got shape {list(arr.shape)}")
        if arr.size == 0:
            raise EmptyInput("no tokens to process (empty input)")
        if not np.issubdtype(arr.dtype, np.integer):
            raise TokenOutOfRange(f"token ids must be integers, got dtype {arr.dtype}")
        vocab = self.model.config.vocab
        bad = np.flatnonzero((arr < 0) | (arr >= vocab))
        if bad.size:
            i = int(bad[0])
            raise TokenOutOfRange(f"token id {int(arr[i])} at index {i} is outside the vocab [0, {vocab})")
        if position is not None and position != self.n_past:
            raise CacheDiscontinuity(0, self.n_past, position)
        if self.n_past + arr.size > self.max_context:
            raise ContextOverflow(
                f"positions [{self.n_past}, {self.n_past + arr.size}) run past max_context {self.max_context}"
            )
        return arr.astype(np.int64)

    # -- forward -------------------------------------------------------------------------------
    def _run(self, ids: np.ndarray, all_logits: bool, capture: Sequence[int]) -> np.ndarray:
        fwd = self.model.forward
        cp = self.cache.checkpoint(block=max(len(ids), 1))  # undo point for a failed forward
        outs: list[np.ndarray] = []
        hidden: dict[int, list[np.ndarray]] = {il: [] for il in capture}
        try:
            with single_thread_blas():
                pos = self.n_past
                for i in range(0, len(ids), self.chunk):
                    part = ids[i:i + self.chunk]
                    last = i + self.chunk >= len(ids)
                    want = "all" if all_logits else ("last" if last else "none")
                    out = fwd.chunk(self.cache, part, pos, want, capture)
                    if out.logits is not None:
                        outs.append(out.logits)
                    for il, h in out.hidden.items():
                        hidden[il].append(h)
                    pos += len(part)
                logits = np.concatenate(outs) if all_logits else outs[-1][0]
                if not np.all(np.isfinite(logits)):
                    bad = np.argwhere(~np.isfinite(np.atleast_2d(logits)))[0]
                    raise NonFiniteLogits(
                        f"non-finite logit {float(np.atleast_2d(logits)[tuple(bad)])!r} at row {int(bad[0])}, "
                        f"token {int(bad[1])}: no distribution installed (book 10.9)"
                    )
        except BaseException:
            self.cache.rollback(cp)
            raise
        self.n_past = pos
        self.captured = {il: np.concatenate(hs) for il, hs in hidden.items()}
        return logits

    def prefill(self, ids: Sequence[int], all_logits: bool = False, position: int | None = None,
                capture: Iterable[int] | None = None) -> np.ndarray:
        """Process `ids` in chunks of `chunk` rows; float32 logits of the last token [vocab], or of
        every token [T, vocab] with all_logits. `position` (optional) must equal n_past."""
        arr = self._check(ids, position)
        cap = self.capture if capture is None else self.model._check_capture(capture)
        return self._run(arr, all_logits, cap)

    def decode(self, token: int, position: int | None = None) -> np.ndarray:
        """One token in, next-token logits out (float32 [vocab])."""
        arr = self._check([token] if np.ndim(token) == 0 else token, position)
        if arr.size != 1:
            raise TokenOutOfRange(f"decode takes one token, got {arr.size}")
        return self._run(arr, False, self.capture)

    # -- state ---------------------------------------------------------------------------------
    def checkpoint(self, block: int = DEFAULT_BLOCK) -> SessionCheckpoint:
        """A rollback point covering up to `block` later tokens (book 10.6)."""
        return SessionCheckpoint(self.cache.checkpoint(block), self.n_past, id(self))

    def rollback(self, cp: SessionCheckpoint, keep: int = 0) -> None:
        """Return to `cp`, keeping the first `keep` tokens processed since (an accepted prefix)."""
        if cp.session != id(self):
            from ..errors import KvStateError

            raise KvStateError("this checkpoint belongs to another session")
        self.cache.rollback(cp.kv, keep)
        self.n_past = cp.n_past + keep

    def snapshot(self) -> KvSnapshot:
        return self.cache.snapshot()

    def restore(self, snap: KvSnapshot) -> None:
        self.cache.restore(snap)
        self.n_past = snap.n_tokens


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

    def _check_capture(self, layers: Iterable[int]) -> tuple[int, ...]:
        out = tuple(int(x) for x in layers)
        for il in out:
            if not 0 <= il <= self.config.n_layers:
                raise LaneError(f"capture layer {il} is outside [0, {self.config.n_layers}]")
        return out

    def session(self, max_context: int | None = None, chunk: int = DEFAULT_CHUNK,
                capture: Iterable[int] = ()) -> OracleSession:
        return OracleSession(self, max_context or self.config.context_length, chunk, capture)

    def logits(self, tokens: Sequence[int], mode: str | int = "prefill", max_context: int | None = None,
               chunk: int = DEFAULT_CHUNK, jitter: Any = None) -> np.ndarray:
        """All-position logits [T, vocab] of `tokens` in a fresh session: one chunked prefill
        ("prefill"), token-by-token decode ("decode"), or a prefill of P tokens then decode (P).
        `jitter` ("up" | "down" | a numpy Generator) moves every perturbation site by 1 ulp."""
        if jitter is not None:
            arith = self.forward.arith
            arith.jitter = jitter
            try:
                return self.logits(tokens, mode, max_context, chunk)
            finally:
                arith.jitter = None
        toks = [int(t) for t in tokens]
        s = self.session(max_context or max(len(toks), 1), chunk)
        if mode == "prefill":
            return s.prefill(toks, all_logits=True)
        if mode == "decode":
            return np.stack([s.decode(t) for t in toks])
        if isinstance(mode, int) and not isinstance(mode, bool) and 0 < mode <= len(toks):
            head = s.prefill(toks[:mode], all_logits=True)
            return np.concatenate([head, *[s.decode(t)[None] for t in toks[mode:]]])
        raise LaneError(f"mode must be 'prefill', 'decode' or a prefill length in [1, {len(toks)}], got {mode!r}")

    def noise_runs(self, tokens: Sequence[int], mode: str | int = "prefill", trials: int = 2, seed: int = 0,
                   chunk: int = DEFAULT_CHUNK, orders: Sequence[str] = ORDER_PROBES
                   ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """The unperturbed log-softmax [T, vocab] of `tokens` and each perturbed one noise_floor()
        compares it with: "jitter:up", "jitter:down", "jitter:rngN" (1-ulp moves), and
        "order:NAME" (the same forward under another f32 reduction order)."""
        if trials < 1:
            raise LaneError(f"noise floor needs at least one trial, got {trials}")
        arith = self.forward.arith
        bad = [o for o in orders if o not in REDUCTIONS or o == arith.reduction]
        if bad:
            raise LaneError(f"noise-floor orders {bad} must be reductions other than the oracle's "
                            f"{arith.reduction!r} (one of {', '.join(REDUCTIONS)})")
        base = log_softmax(self.logits(tokens, mode, chunk=chunk))
        runs: dict[str, np.ndarray] = {}
        for t in range(trials):
            jitter = ("up", "down")[t] if t < 2 else np.random.default_rng([seed, t])
            label = ("up", "down")[t] if t < 2 else f"rng{t}"
            runs[f"jitter:{label}"] = log_softmax(self.logits(tokens, mode, chunk=chunk, jitter=jitter))
        own = arith.reduction
        for o in orders:
            arith.reduction = o
            try:
                runs[f"order:{o}"] = log_softmax(self.logits(tokens, mode, chunk=chunk))
            finally:
                arith.reduction = own
        return base, runs

    def noise_floor(self, tokens: Sequence[int], mode: str | int = "prefill", trials: int = 2, seed: int = 0,
                    chunk: int = DEFAULT_CHUNK, orders: Sequence[str] = ORDER_PROBES) -> "NoiseFloor":
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


def noise_floor(model: OracleModel, tokens: Sequence[int], mode: str | int = "prefill", trials: int = 2,
                orders: Sequence[str] = None) -> NoiseFloor:
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
