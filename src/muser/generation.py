"""Generation: a per-token Emitter and the loop that drives it over a session's steps.

    em = emitter(tokenizer, prompt_ids, SamplingParams(...), max_tokens=128, stop=["\\n\\n"])
    ev = em.step(logits)      # sample from these logits, then push: a GenEvent (em.done after)
    ev = em.push(token, logits)   # a token chosen elsewhere (a verified draft), same rules

The Emitter holds everything per token (sampler chain, streaming detokenizer, stop strings
with the held suffix, logprobs and top logprobs, max_tokens, finish reason) and no forward;
the speculative driver pushes the k tokens of one verify step one by one and stops at the
first that finishes the generation; a server drives many Emitters from one Engine.step loop.
`Generation` is the single-sequence loop: prefill, then step + decode until done.

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
  logits the token was drawn from), before any sampling step reshapes it; `top_logprobs` the
  n most likely tokens under that distribution (ties: lower id first).
* TTFT = from the request's start to the first sampled token (prefill included): `t_start` when
  given (the CLI passes the moment after the model is loaded, so tokenizing the prompt and making
  the session count), else the first event's request; decode tokens/s counts the tokens after the
  first over the time after the first.
* Logits may be a DeviceRow (an engine session's prefill_row / decode_row on CUDA): the sampler
  then reads back only the candidates its chain can keep, and the whole row only when it needs
  it (muser.sample.candidates); the tokens are the same as from the host row, and the logprob's
  sum of exponentials runs on the device.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from .errors import EmptyInput, SamplingError, TokenizerError
from .sample import Sampler, SamplingParams
from .text import Tokenizer
from .text.detok import Detokenizer

FINISH_EOG, FINISH_STOP, FINISH_LENGTH = "eog", "stop", "length"
MAX_TOP_LOGPROBS = 20  # the OpenAI API's bound on top_logprobs


@dataclass(frozen=True)
class GenEvent:
    index: int  # 0-based position among generated tokens
    token: int
    text: str  # text released with this token ("" while held back)
    logprob: float
    finish_reason: str | None = None  # set on the last event: "eog" | "stop" | "length"
    top_logprobs: tuple[tuple[int, float], ...] = ()  # (token, logprob), most likely first

    def to_json(self) -> dict:
        out: dict[str, Any] = {"index": self.index, "token": self.token, "text": self.text,
                               "logprob": self.logprob, "finish_reason": self.finish_reason}
        if self.top_logprobs:
            out["top_logprobs"] = [[t, lp] for t, lp in self.top_logprobs]
        return out


def _held_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


def raw_logprobs(logits: np.ndarray, token: int, top: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """log p(token) and the `top` most likely (token, log p) under the raw distribution
    (float64 log-softmax of the logits)."""
    x = logits.astype(np.float64)
    m = float(x.max())
    log_z = math.log(float(np.exp(x - m).sum()))
    lp = float(x[token] - m - log_z)  # the same expression as muser.sample.log_softmax_at
    if top <= 0:
        return lp, ()
    top = min(top, x.size)
    thr = -np.partition(-x, top - 1)[top - 1]  # the top-th largest value
    above = np.flatnonzero(x > thr)
    idx = np.concatenate([above, np.flatnonzero(x == thr)[:top - above.size]])  # ties: lowest ids
    idx = idx[np.lexsort((idx, -x[idx]))]  # descending logit, then ascending id
    return lp, tuple((int(i), float(x[i] - m - log_z)) for i in idx)


class Emitter:
    """One generation's per-token state (see module doc). Build it with `emitter(...)`."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], sampler: Sampler, max_tokens: int,
                 stop: tuple[str, ...], render_special: bool = False, top_logprobs: int = 0):
        self.tokenizer = tokenizer
        self.prompt_ids = prompt_ids
        self.sampler = sampler
        self.max_tokens = max_tokens
        self.stop = stop
        self.top_logprobs = top_logprobs
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self._detok = Detokenizer(tokenizer, render_special=render_special)
        self._eog = tokenizer.eog_ids
        self._pending = ""  # released by the detokenizer, not yet emitted (may start a stop string)
        self._out: list[str] = []
        self._filter: Any = None  # muser.sample.candidates.DeviceFilter, made for a first DeviceRow
        self._reduced: tuple[Any, Any] | None = None  # (row, what its reduction read back)
        # The sampler sees the prompt (llama.cpp's server and CLI accept it before the first draw).
        for t in prompt_ids:
            sampler.accept(t)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return "".join(self._out)

    def check_logits(self, logits: Any) -> Any:
        """float32 [vocab] on the host, or a DeviceRow (muser.engine.rows) of that vocab."""
        V = self.tokenizer.vocab_size
        shape = getattr(logits, "shape", None) if isinstance(logits, np.ndarray) else \
            tuple(getattr(getattr(logits, "logits", None), "shape", ()))
        if shape != (V,):
            raise TokenizerError(f"the session's logits have shape {shape}, the tokenizer's vocab is {V}")
        return logits

    def sample(self, logits: Any) -> int:
        """Draw the next token from `logits` (the sampler chain; nothing is accepted yet). A
        DeviceRow is reduced on the device to the candidates the chain can keep and only those
        are read back, whenever that gives the chain's own pick (muser.sample.candidates)."""
        self._refuse_if_done()
        logits = self.check_logits(logits)
        if isinstance(logits, np.ndarray):
            return self.sampler.sample(logits)
        if not self.top_logprobs:  # the n most likely tokens need the whole row
            if self._filter is None:
                from .sample.candidates import DeviceFilter

                self._filter = DeviceFilter(self.sampler)
            red = self._filter.read(logits)
            if red is not None:
                tok = self.sampler.sample_top(red.ids, red.logit)
                if tok is not None:
                    self._reduced = (logits, red)
                    return tok
        return self.sampler.sample(logits.host())

    def step(self, logits: Any) -> GenEvent:
        """sample(logits), then push the drawn token."""
        return self.push(self.sample(logits), logits)

    def _logprobs(self, logits: Any, token: int) -> tuple[float, tuple[tuple[int, float], ...]]:
        if isinstance(logits, np.ndarray):
            return raw_logprobs(logits, token, self.top_logprobs)
        red = self._reduced[1] if self._reduced is not None and self._reduced[0] is logits else None
        lp = None if red is None or self.top_logprobs else red.logprob(token)
        if lp is not None:
            return lp, ()
        return raw_logprobs(logits.host(), token, self.top_logprobs)

    def push(self, token: int, logits: Any) -> GenEvent:
        """Emit `token`, drawn from (or verified against) `logits` [vocab]: the sampler accepts
        it; its text is released, held (a possible stop-string start) or cut at a stop string;
        the event carries finish_reason when this token ends the generation."""
        self._refuse_if_done()
        self.check_logits(logits)
        token = int(token)
        if not 0 <= token < self.tokenizer.vocab_size:
            raise TokenizerError(f"token {token} is outside the vocab [0, {self.tokenizer.vocab_size})")
        self.sampler.accept(token)
        lp, top = self._logprobs(logits, token)
        self._reduced = None
        i = len(self.tokens)
        self.tokens.append(token)
        if token in self._eog:  # reported, not rendered
            return self._end(i, token, self._pending + self._detok.flush(), lp, top, FINISH_EOG)
        self._pending += self._detok.add(token)
        if self.stop:
            hits = [k for k in (self._pending.find(s) for s in self.stop) if k >= 0]
            if hits:
                return self._end(i, token, self._pending[:min(hits)], lp, top, FINISH_STOP)
        if len(self.tokens) == self.max_tokens:
            return self._end(i, token, self._pending + self._detok.flush(), lp, top, FINISH_LENGTH)
        hold = _held_suffix(self._pending, self.stop) if self.stop else 0
        piece = self._pending[:len(self._pending) - hold]
        self._pending = self._pending[len(self._pending) - hold:]
        self._out.append(piece)
        return GenEvent(i, token, piece, lp, None, top)

    def push_many(self, tokens: Sequence[int], logits: Sequence[np.ndarray]) -> list[GenEvent]:
        """push(tokens[j], logits[j]) in order until the generation finishes (then the rest are
        not taken); the events of the tokens taken."""
        if len(tokens) != len(logits):
            raise SamplingError(f"{len(tokens)} tokens but {len(logits)} logits rows")
        out = []
        for t, lg in zip(tokens, logits):
            out.append(self.push(t, lg))
            if self.done:
                break
        return out

    def _end(self, i: int, token: int, piece: str, lp: float, top: tuple, reason: str) -> GenEvent:
        self._pending = ""
        self._out.append(piece)
        self.finish_reason = reason
        return GenEvent(i, token, piece, lp, reason, top)

    def _refuse_if_done(self) -> None:
        if self.done:
            raise SamplingError(f"the generation has finished ({self.finish_reason}); no more tokens")


def emitter(tokenizer: Tokenizer, prompt_ids: Sequence[int], sampling: SamplingParams,
            max_tokens: int | None = None, stop: Sequence[str] | str | None = None,
            render_special: bool = False, top_logprobs: int = 0) -> Emitter:
    """Validate a request and build its Emitter (the GGUF's suppress tokens get a -inf bias after
    the user's, as common_sampler_init does)."""
    if not isinstance(sampling, SamplingParams):
        raise SamplingError(f"sampling must be SamplingParams, got {type(sampling).__name__}")
    if max_tokens is None:
        max_tokens = sampling.max_tokens
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise SamplingError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    if isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int) or \
            not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise SamplingError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs!r}")
    stops = (stop,) if isinstance(stop, str) else tuple(sampling.stop if stop is None else stop)
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
    return Emitter(tokenizer, ids, Sampler(sampling, tokenizer.vocab_size), max_tokens, stops,
                   render_special, top_logprobs)


class Generation:
    """The single-sequence loop over an Emitter: an iterator of GenEvent (lazy: nothing runs
    until the first event is asked for) with the run's record once it is exhausted.

    `session` is any object with the Session surface (DESIGN.md): `prefill(ids) ->
    float32[vocab]` (the last row), `decode(token) -> float32[vocab]`."""

    def __init__(self, session: Any, em: Emitter, t_start: float | None = None):
        self.session = session
        self.emitter = em
        self.t_start = t_start  # time.perf_counter() at the request's start (None: the first event's)
        self.ttft_s: float | None = None
        self.total_s: float | None = None
        self.decode_s: float | None = None
        self._it = self._run()

    def __iter__(self) -> "Generation":
        return self

    def __next__(self) -> GenEvent:
        return next(self._it)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.emitter.tokenizer

    @property
    def prompt_ids(self) -> list[int]:
        return self.emitter.prompt_ids

    @property
    def tokens(self) -> list[int]:
        return self.emitter.tokens

    @property
    def finish_reason(self) -> str | None:
        return self.emitter.finish_reason

    @property
    def text(self) -> str:
        return self.emitter.text if self.emitter.done else ""

    @property
    def seed(self) -> int:
        return self.emitter.sampler.seed

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
        em = self.emitter
        prefill, decode = row_calls(self.session)
        t0 = time.perf_counter() if self.t_start is None else self.t_start
        logits = prefill(em.prompt_ids)
        t_first = None
        while True:
            ev = em.step(logits)
            now = time.perf_counter()
            if t_first is None:
                t_first = now
                self.ttft_s = now - t0
            if em.done:
                self.total_s, self.decode_s = now - t0, now - t_first
                yield ev
                return
            yield ev
            logits = decode(ev.token)


def row_calls(session: Any) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
    """(prefill, decode) of `session`, returning next-token logits: an engine session's
    prefill_row / decode_row (DeviceRows on CUDA, host arrays on the CPU), else the Session
    surface's prefill / decode (any other session: the oracle's, a speculative or warm one)."""
    return (getattr(session, "prefill_row", session.prefill), getattr(session, "decode_row", session.decode))


def generate(session: Any, tokenizer: Tokenizer, prompt_ids: Sequence[int], sampling: SamplingParams,
             max_tokens: int | None = None, stop: Sequence[str] | None = None,
             render_special: bool = False, top_logprobs: int = 0, t_start: float | None = None) -> Generation:
    """Start generating (lazily: nothing runs until the first event is asked for); `t_start`: the
    request's start (time.perf_counter()) for TTFT."""
    return Generation(session, emitter(tokenizer, prompt_ids, sampling, max_tokens, stop, render_special,
                                       top_logprobs), t_start)


__all__ = ["Emitter", "GenEvent", "Generation", "emitter", "generate", "raw_logprobs", "row_calls", "FINISH_EOG",
           "FINISH_STOP", "FINISH_LENGTH", "MAX_TOP_LOGPROBS"]
