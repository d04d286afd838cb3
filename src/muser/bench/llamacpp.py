"""The pinned comparator: all-position logits from llama.cpp through llama-cpp-python 0.3.36.

Settings are explicit, never library defaults:
- `type_k` / `type_v`: the KV element type (GGML_TYPE_F32 = 0, GGML_TYPE_F16 = 1);
- `flash_attn=False`: the non-flash attention path (llama-graph.cpp build_attn_mha). It is
  llama-cpp-python's default, and the only path whose F32 KV has no rounding point (the flash
  path casts an F32 K/V to F16). The oracle mirrors this path.
- `n_threads=1` by default: ggml splits work by output rows, so the logits are bit-identical for
  any thread count (tests/oracle checks 1 vs 2), while two OpenMP threads spin-waiting on a
  shared 2-core machine cost ~100 ms per decoded token. `logits_all=True` (every position's
  logits), seeded, `verbose=False`.

`schedule` decides how tokens are fed: one prefill, one token at a time, or prefill then decode;
llama.cpp's numerics depend on the batch shape (gemm vs gemv kernels), so each is a distinct run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..errors import ComparatorError

PINNED_VERSION = "0.3.36"
GGML_TYPE = {"f32": 0, "f16": 1}  # ggml.h enum ggml_type


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError as e:  # the comparator is part of the test environment: fail loudly
        raise ComparatorError(
            f"llama-cpp-python=={PINNED_VERSION} is not importable ({e}); run `make comparator`"
        ) from e
    version = getattr(llama_cpp, "__version__", "?")
    if version != PINNED_VERSION:
        raise ComparatorError(f"llama-cpp-python {version} is installed, the pinned comparator is {PINNED_VERSION}")
    return llama_cpp


def schedule_for(mode: str | int, n_tokens: int) -> list[int]:
    """Chunk sizes: "prefill" -> [T], "decode" -> [1]*T, an int P -> [P] + [1]*(T-P)."""
    if n_tokens <= 0:
        raise ComparatorError(f"no tokens to evaluate ({n_tokens})")
    if mode == "prefill":
        return [n_tokens]
    if mode == "decode":
        return [1] * n_tokens
    if isinstance(mode, int) and 0 < mode <= n_tokens:
        return [mode] + [1] * (n_tokens - mode)
    raise ComparatorError(f"mode must be 'prefill', 'decode' or a prefill length in [1, {n_tokens}], got {mode!r}")


@dataclass
class LlamaCppRunner:
    """One loaded llama.cpp context; `logits()` resets it and evaluates a fresh sequence."""

    path: str | os.PathLike
    kv: str = "f16"
    n_ctx: int = 4096
    n_batch: int = 512
    n_threads: int = 1
    flash_attn: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kv not in GGML_TYPE:
            raise ComparatorError(f"kv {self.kv!r} is not one of {', '.join(GGML_TYPE)}")
        llama_cpp = _llama_cpp()
        try:
            self._llm = llama_cpp.Llama(
                str(self.path), n_ctx=self.n_ctx, n_batch=self.n_batch, n_ubatch=self.n_batch,
                logits_all=True, type_k=GGML_TYPE[self.kv], type_v=GGML_TYPE[self.kv],
                flash_attn=self.flash_attn, n_threads=self.n_threads, n_threads_batch=self.n_threads,
                seed=self.seed, verbose=False,
            )
        except Exception as e:  # llama-cpp-python raises ValueError on a model it cannot load
            raise ComparatorError(f"llama.cpp could not load {str(self.path)!r}: {e}") from e
        self.n_vocab = int(self._llm.n_vocab())

    def settings(self) -> dict:
        return {"comparator": f"llama-cpp-python=={PINNED_VERSION}", "type_k": GGML_TYPE[self.kv],
                "type_v": GGML_TYPE[self.kv], "flash_attn": self.flash_attn, "n_threads": self.n_threads,
                "n_ctx": self.n_ctx, "n_batch": self.n_batch, "n_ubatch": self.n_batch}

    def logits(self, tokens: Sequence[int], mode: str | int = "prefill") -> np.ndarray:
        """float32 [T, vocab]: the logits llama.cpp produced at every position of `tokens`."""
        toks = [int(t) for t in tokens]
        if len(toks) > self.n_ctx:
            raise ComparatorError(f"{len(toks)} tokens exceed the comparator's n_ctx {self.n_ctx}")
        bad = [t for t in toks if not 0 <= t < self.n_vocab]
        if bad:
            raise ComparatorError(f"token id {bad[0]} is outside the vocab [0, {self.n_vocab})")
        llm = self._llm
        llm.reset()
        pos = 0
        try:
            for n in schedule_for(mode, len(toks)):
                llm.eval(toks[pos:pos + n])
                pos += n
        except Exception as e:
            raise ComparatorError(f"llama.cpp eval failed at position {pos}: {e}") from e
        return np.array(llm.scores[: len(toks)], dtype=np.float32, copy=True)

    def close(self) -> None:
        llm = getattr(self, "_llm", None)
        if llm is not None:
            llm.close()
            self._llm = None


def llamacpp_logits(path: str | os.PathLike, tokens: Sequence[int], kv: str = "f16",
                    mode: str | int = "prefill", n_ctx: int | None = None) -> np.ndarray:
    """One-shot: load, evaluate, close."""
    r = LlamaCppRunner(path, kv=kv, n_ctx=n_ctx or max(256, len(tokens)))
    try:
        return r.logits(tokens, mode)
    finally:
        r.close()
