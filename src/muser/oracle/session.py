"""`muser.oracle`: the numpy CPU reference with the engine's Session surface (DESIGN.md).

    import muser
    m = muser.oracle.load(path, arithmetic="f32" | "ggml-cpu", kv="f16" | "f32", pin=None)
    s = m.session(max_context=4096)
    logits = s.prefill(ids, all_logits=False)   # float32 [vocab] (last row) or [T, vocab]
    logits = s.decode(token)                    # float32 [vocab]
    s.n_past, cp = s.checkpoint(); s.rollback(cp)
    s.captured                                  # {layer: [T, hidden]} inputs of the capture layers
    m.noise_floor(tokens)                       # max |d log-softmax| under 1-ulp jitter

Arithmetic "f32": weights dequantized to f32, correctly rounded dots, no rounding point except
the KV type (f32 by default). Arithmetic "ggml-cpu": the pinned llama.cpp CPU graph's rounding
points for the file's dtypes and the KV type (f16 by default); see muser.oracle.numerics.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence as Seq

import numpy as np

from ..errors import LaneError
from ..kv import KvCache
from ..model.config import MuseConfig
from ..model.loader import ModelFile, open_model
from .forward import OracleForward, OracleWeights, single_thread_blas
from .numerics import ARITHMETICS, Arithmetic, log_softmax
from ..sequence import Sequence, check_chunk, check_max_context

DEFAULT_CHUNK = 512  # prefill rows per forward (book 10.10: PREFILL_BATCH_TOKENS)
DEFAULT_KV = {"f32": "f32", "ggml-cpu": "f16"}


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

    def noise_floor(self, tokens: Seq[int], mode: str | int = "prefill", trials: int = 2, seed: int = 0,
                    chunk: int = DEFAULT_CHUNK) -> "NoiseFloor":
        """The fixture's noise floor for this feeding of `tokens`: every norm output and every
        rounding point's input moved by 1 f32 ulp, and the max |d log-softmax| against the
        unperturbed run (DESIGN.md "Exactness contract"). Trial 0 moves every value up, trial 1
        down (so an element just below and one just above a rounding boundary are both caught),
        further trials use a random sign per element."""
        if trials < 1:
            raise LaneError(f"noise floor needs at least one trial, got {trials}")
        base = log_softmax(self.logits(tokens, mode, chunk=chunk))
        per_trial = []
        for t in range(trials):
            jitter = ("up", "down")[t] if t < 2 else np.random.default_rng([seed, t])
            pert = log_softmax(self.logits(tokens, mode, chunk=chunk, jitter=jitter))
            per_trial.append(float(np.abs(pert - base).max()))
        return NoiseFloor(max(per_trial), per_trial, mode, len(tokens))

    def close(self) -> None:
        self.file.close()


@dataclass(frozen=True)
class NoiseFloor:
    value: float  # max over trials of max |d log-softmax|
    trials: list[float] = field(default_factory=list)
    mode: str | int = "prefill"
    n_tokens: int = 0


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


def noise_floor(model: OracleModel, tokens: Seq[int], mode: str | int = "prefill", trials: int = 2) -> NoiseFloor:
    """Module-level form of OracleModel.noise_floor."""
    return model.noise_floor(tokens, mode=mode, trials=trials)


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
