"""SamplingParams: the knobs of llama.cpp's default sampler chain (common/common.h
common_params_sampling, same defaults), validated at construction.

Every invalid value is a SamplingError naming the field and the value: NaN or infinite numbers,
a negative temperature, top_p / typical_p outside (0, 1], min_p outside [0, 1], a repeat penalty
that is not positive, a negative top_k / penalty_last_n / min_keep, a logit bias on a token that
is not an integer or with a NaN / +inf bias, a seed outside [0, 2^32 - 2], max_tokens < 1, an
empty stop string.

temperature 0 is greedy: llama.cpp's temperature sampler keeps only the first maximal candidate,
so the pick is the argmax, ties going to the candidate that comes first in the chain's order.
seed None draws a fresh seed (reported by the Sampler); 0xFFFFFFFF is llama.cpp's "random seed"
marker and is refused so a given seed always means one stream.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from ..errors import SamplingError

LLAMA_DEFAULT_SEED = 0xFFFFFFFF
DEFAULT_TEMPERATURE = 0.8  # common/common.h common_params_sampling::temp; the one default everywhere


def _finite(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise SamplingError(f"{name} must be a number, got {v!r}")
    v = float(v)
    if not math.isfinite(v):
        raise SamplingError(f"{name} must be finite, got {v!r}")
    return v


def _int(name: str, v: Any, lo: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise SamplingError(f"{name} must be an integer, got {v!r}")
    if lo is not None and v < lo:
        raise SamplingError(f"{name} must be >= {lo}, got {v}")
    return v


@dataclass(frozen=True, eq=False)
class SamplingParams:
    temperature: float = DEFAULT_TEMPERATURE
    top_k: int = 40  # 0 = off
    top_p: float = 0.95  # 1 = off
    min_p: float = 0.05  # 0 = off
    typical_p: float = 1.0  # 1 = off
    repeat_penalty: float = 1.0  # 1 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64  # 0 = off
    min_keep: int = 0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    seed: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        t = _finite("temperature", self.temperature)
        if t < 0:
            raise SamplingError(f"temperature must be >= 0 (0 = greedy), got {t}")
        for name in ("top_p", "typical_p"):
            v = _finite(name, getattr(self, name))
            if not 0.0 < v <= 1.0:
                raise SamplingError(f"{name} must be in (0, 1], got {v}")
        mp = _finite("min_p", self.min_p)
        if not 0.0 <= mp <= 1.0:
            raise SamplingError(f"min_p must be in [0, 1], got {mp}")
        rp = _finite("repeat_penalty", self.repeat_penalty)
        if rp <= 0 or not math.isfinite(1.0 / rp):
            raise SamplingError(f"repeat_penalty must be > 0, got {rp}")
        _finite("presence_penalty", self.presence_penalty)
        _finite("frequency_penalty", self.frequency_penalty)
        _int("top_k", self.top_k, 0)
        _int("penalty_last_n", self.penalty_last_n, 0)
        _int("min_keep", self.min_keep, 0)
        if not isinstance(self.logit_bias, Mapping):
            raise SamplingError(f"logit_bias must be a mapping token -> bias, got {type(self.logit_bias).__name__}")
        bias: dict[int, float] = {}
        for tok, b in self.logit_bias.items():
            _int("logit_bias token", tok, 0)
            if isinstance(b, bool) or not isinstance(b, (int, float)) or math.isnan(b) or b == math.inf:
                raise SamplingError(f"logit_bias[{tok}] must be a finite number or -inf, got {b!r}")
            bias[tok] = float(b)
        object.__setattr__(self, "logit_bias", MappingProxyType(bias))
        if self.seed is not None:
            s = _int("seed", self.seed, 0)
            if s >= LLAMA_DEFAULT_SEED:
                raise SamplingError(f"seed must be in [0, {LLAMA_DEFAULT_SEED - 1}], got {s}")
        if self.max_tokens is not None:
            _int("max_tokens", self.max_tokens, 1)
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, (tuple, list)):
            raise SamplingError(f"stop must be a list of strings, got {type(stop).__name__}")
        for s in stop:
            if not isinstance(s, str) or not s:
                raise SamplingError(f"stop strings must be non-empty strings, got {s!r}")
        object.__setattr__(self, "stop", tuple(stop))
        for name in ("temperature", "top_p", "min_p", "typical_p", "repeat_penalty",
                     "presence_penalty", "frequency_penalty"):
            object.__setattr__(self, name, float(getattr(self, name)))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalties_on(self) -> bool:
        # llama_sampler_penalties::is_disabled
        return self.penalty_last_n != 0 and not (
            self.repeat_penalty == 1.0 and self.frequency_penalty == 0.0 and self.presence_penalty == 0.0)

    def check_vocab(self, vocab_size: int) -> None:
        for tok in self.logit_bias:
            if tok >= vocab_size:
                raise SamplingError(f"logit_bias token {tok} is outside the vocab [0, {vocab_size})")

    def to_json(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["logit_bias"] = {str(k): v for k, v in self.logit_bias.items()}
        d["stop"] = list(self.stop)
        return d

    def replace(self, **kw: Any) -> "SamplingParams":
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["logit_bias"] = dict(self.logit_bias)
        d.update(kw)
        return SamplingParams(**d)


def greedy(**kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)

