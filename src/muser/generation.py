"""The generation loop: prompt ids in, a stream of events out.

    gen = generate(session, tokenizer, prompt_ids, SamplingParams(...), max_tokens=128, stop=["\\n\\n"])
    for ev in gen:            # GenEvent per sampled token, as it is produced
        print(ev.text, end="")
    gen.finish_reason, gen.ttft_s, gen.decode_tokens_per_s

`session` is any object with the Session surface (DESIGN.md): `prefill(ids) -> float32[vocab]`
(the last row), `decode(token) -> float32[vocab]`, `n_past`.

Rules
* The sampler sees the prompt: every prompt token is accepted before the first draw, as
  llama.cpp's server and CLI do, so repetition penalties cover it. The GGUF's suppress tokens get
  a -inf logit bias after the user's biases (common_sampler_init).
* Generation ends at the first of: an end-of-generation token (any of tokenizer.eog_ids: EOS, EOT,
  ...), which is reported (finish "eog") but not rendered or fed back; a stop string in the
  generated text (finish "stop": the text before it is emitted, the stop string and anything after
  it are not); max_tokens tokens (finish "length"; the last token is not fed back).
* Text is streamed through the Detokenizer (complete characters only). Text that could still turn
  into a stop string is held back until it cannot; at the end, held-back text is released (and an
  unfinished UTF-8 character becomes U+FFFD).
* `logprob` is log p(token) under the model's raw distribution (float64 log-softmax of the
  logits the token was drawn from), before any sampling step reshapes it.
* TTFT = from the call to the first sampled token (prefill included); decode tokens/s counts the
  tokens after the first over the time after the first.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np

from .errors import EmptyInput, SamplingError, TokenizerError
from .sample import Sampler, SamplingParams, log_softmax_at
from .text import Tokenizer
from .text.detok import Detokenizer

FINISH_EOG, FINISH_STOP, FINISH_LENGTH = "eog", "stop", "length"


@dataclass(frozen=True)
class GenEvent:
    index: int  # 0-based position among generated tokens
    token: int
    text: str  # text released with this token ("" while held back)
    logprob: float
    finish_reason: str | None = None  # set on the last event: "eog" | "stop" | "length"

    def to_json(self) -> dict:
        return {"index": self.index, "token": self.token, "text": self.text, "logprob": self.logprob,
                "finish_reason": self.finish_reason}


def _held_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


@dataclass
class Generation:
    """An iterator of GenEvent with the run's record once it is exhausted."""

    session: Any
    tokenizer: Tokenizer
    prompt_ids: list[int]
    sampling: SamplingParams
    max_tokens: int
    stop: tuple[str, ...]
    sampler: Sampler
    render_special: bool = False
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    ttft_s: float | None = None
    total_s: float | None = None
    decode_s: float | None = None

    def __post_init__(self) -> None:
        self._it = self._run()

    def __iter__(self) -> "Generation":
        return self

    def __next__(self) -> GenEvent:
        return next(self._it)

    @property
    def seed(self) -> int:
        return self.sampler.seed

    @property
    def decode_tokens_per_s(self) -> float | None:
        n = len(self.tokens) - 1
        if n <= 0 or not self.decode_s:
            return None
        return n / self.decode_s

    def stats(self) -> dict:
        return {"prompt_tokens": len(self.prompt_ids), "generated_tokens": len(self.tokens),
                "finish_reason": self.finish_reason, "ttft_s": self.ttft_s,
                "decode_tokens_per_s": self.decode_tokens_per_s, "total_s": self.total_s,
                "seed": self.seed}

    def _run(self) -> Iterator[GenEvent]:
        tok = self.tokenizer
        t0 = time.perf_counter()
        sampler = self.sampler
        for t in self.prompt_ids:
            sampler.accept(t)
        logits = self.session.prefill(self.prompt_ids)
        if not isinstance(logits, np.ndarray) or logits.shape != (tok.vocab_size,):
            raise TokenizerError(
                f"the session's logits have shape {getattr(logits, 'shape', None)}, "
                f"the tokenizer's vocab is {tok.vocab_size}"
            )
        detok = Detokenizer(tok, render_special=self.render_special)
        eog = tok.eog_ids
        stops = self.stop
        pending = ""  # released by the detokenizer, not yet emitted (may start a stop string)
        out: list[str] = []
        t_first = None
        for i in range(self.max_tokens):
            token = sampler.sample(logits)
            sampler.accept(token)
            now = time.perf_counter()
            if t_first is None:
                t_first = now
                self.ttft_s = now - t0
            lp = log_softmax_at(logits, token)
            self.tokens.append(token)
            if token in eog:
                rest = pending + detok.flush()
                out.append(rest)
                self._finish(FINISH_EOG, out, t0, t_first)
                yield GenEvent(i, token, rest, lp, FINISH_EOG)
                return
            pending += detok.add(token)
            if stops:
                hits = [(pending.find(s), s) for s in stops]
                hits = [(k, s) for k, s in hits if k >= 0]
                if hits:
                    k = min(k for k, _ in hits)
                    before = pending[:k]
                    out.append(before)
                    self._finish(FINISH_STOP, out, t0, t_first)
                    yield GenEvent(i, token, before, lp, FINISH_STOP)
                    return
            last = i == self.max_tokens - 1
            if last:
                piece = pending + detok.flush()
                pending = ""
            else:
                hold = _held_suffix(pending, stops) if stops else 0
                piece = pending[: len(pending) - hold]
                pending = pending[len(pending) - hold :]
            out.append(piece)
            if last:
                self._finish(FINISH_LENGTH, out, t0, t_first)
                yield GenEvent(i, token, piece, lp, FINISH_LENGTH)
                return
            yield GenEvent(i, token, piece, lp)
            logits = self.session.decode(token)

    def _finish(self, reason: str, out: list[str], t0: float, t_first: float) -> None:
        now = time.perf_counter()
        self.finish_reason = reason
        self.text = "".join(out)
        self.total_s = now - t0
        self.decode_s = now - t_first


def generate(session: Any, tokenizer: Tokenizer, prompt_ids: Sequence[int], sampling: SamplingParams,
             max_tokens: int | None = None, stop: Sequence[str] | None = None,
             render_special: bool = False) -> Generation:
    """Start generating (lazily: nothing runs until the first event is asked for)."""
    if not isinstance(sampling, SamplingParams):
        raise SamplingError(f"sampling must be SamplingParams, got {type(sampling).__name__}")
    if max_tokens is None:
        max_tokens = sampling.max_tokens
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise SamplingError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    stops = tuple(sampling.stop if stop is None else stop)
    if isinstance(stop, str):
        stops = (stop,)
    for s in stops:
        if not isinstance(s, str) or not s:
            raise SamplingError(f"stop strings must be non-empty strings, got {s!r}")
    ids = [int(t) for t in prompt_ids]
    if not ids:
        raise EmptyInput("the prompt has no tokens")
    for t in ids:
        if not 0 <= t < tokenizer.vocab_size:
            raise TokenizerError(f"prompt token {t} is outside the vocab [0, {tokenizer.vocab_size})")
    suppress = tokenizer.vocab.suppress_tokens
    if suppress:
        bias = dict(sampling.logit_bias)
        bias.update({t: -math.inf for t in suppress})
        sampling = sampling.replace(logit_bias=bias)
    return Generation(session, tokenizer, ids, sampling, max_tokens, stops,
                      Sampler(sampling, tokenizer.vocab_size), render_special)


__all__ = ["GenEvent", "Generation", "generate", "FINISH_EOG", "FINISH_STOP", "FINISH_LENGTH"]
