"""Per-token output of one request: sample, detokenize, stop strings, logprobs.

The rules are muser.generation's (the sampler sees the prompt; an end-of-generation token ends
the turn unrendered; a stop string ends it with the text before it; text that could still become
a stop string is held back; `logprob` is the raw distribution's log-softmax in float64); the
sampler, its suppress-token bias and the stop validation come from `muser.generation.generate`
itself. What differs is the driver: the engine loop hands this object the logits of each step
instead of the object calling the session.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..generation import FINISH_EOG, FINISH_LENGTH, FINISH_STOP, _held_suffix, generate
from ..text.detok import Detokenizer


@dataclass(frozen=True)
class Piece:
    token: int
    text: str  # released text ("" while held back)
    logprob: float | None
    top: tuple[tuple[int, float], ...]  # (token, logprob) best first, when asked
    finish: str | None  # "eog" | "stop" | "length" on the last piece


def top_logprobs(logits: np.ndarray, n: int) -> tuple[tuple[int, float], ...]:
    x = logits.astype(np.float64)  # [vocab]
    m = float(x.max())
    lse = m + float(np.log(np.exp(x - m).sum()))
    idx = np.argsort(-x, kind="stable")[:n]
    return tuple((int(i), float(x[i] - lse)) for i in idx)


class Emitter:
    def __init__(self, tokenizer, prompt_ids, sampling, max_tokens: int, stop, logprobs: int | None = None,
                 render_special: bool = False):
        gen = generate(None, tokenizer, prompt_ids, sampling, max_tokens, stop, render_special)
        self.tokenizer = tokenizer
        self.sampler = gen.sampler
        self.stops = gen.stop
        self.max_tokens = max_tokens
        self.logprobs = logprobs  # None: none; n >= 0: the token's and n alternatives
        self.detok = Detokenizer(tokenizer, render_special=render_special)
        self.eog = tokenizer.eog_ids
        self.pending = ""
        self.tokens: list[int] = []
        self.finish: str | None = None
        for t in gen.prompt_ids:
            self.sampler.accept(t)

    @property
    def seed(self) -> int:
        return self.sampler.seed

    def step(self, logits: np.ndarray) -> Piece:
        """Draw the next token from `logits` [vocab] and say what it releases."""
        token = self.sampler.sample(logits)
        self.sampler.accept(token)
        self.tokens.append(token)
        lp, top = None, ()
        if self.logprobs is not None:
            top = top_logprobs(logits, max(self.logprobs, 1))
            lp = next((v for t, v in top if t == token), None)
            if lp is None:
                from ..sample import log_softmax_at

                lp = log_softmax_at(logits, token)
            top = top[: self.logprobs]
        if token in self.eog:
            return self._end(token, self.pending + self.detok.flush(), lp, top, FINISH_EOG)
        self.pending += self.detok.add(token)
        if self.stops:
            hits = [k for k in (self.pending.find(s) for s in self.stops) if k >= 0]
            if hits:
                return self._end(token, self.pending[: min(hits)], lp, top, FINISH_STOP)
        if len(self.tokens) >= self.max_tokens:
            return self._end(token, self.pending + self.detok.flush(), lp, top, FINISH_LENGTH)
        hold = _held_suffix(self.pending, self.stops) if self.stops else 0
        text = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(self.pending) - hold:]
        return Piece(token, text, lp, top, None)

    def _end(self, token, text, lp, top, reason) -> Piece:
        self.pending = ""
        self.finish = reason
        return Piece(token, text, lp, top, reason)
