"""Prompt defaults: the one place that says how a prompt becomes token ids and how a request's
sampling knobs are settled. The CLI (`muser generate`, `muser chat`), `Model.generate/stream`, the
oracle's users and the server all call these functions, so one prompt gives one token sequence.

Rules
* Text is tokenized with the BOS the GGUF asks for (tokenizer.ggml.add_bos_token) and with
  special-token text taken literally: "<|eot|>" typed by a user is five ordinary pieces, not the
  end-of-turn control token. A caller that wants control tokens parsed opts in
  (`parse_special=True`, `--special`), as llama.cpp's `--special` / `parse_special` do.
* A chat is rendered through the GGUF's template (which validates the roles against the
  template's) and tokenized with special tokens parsed (the template writes them). The BOS is
  added only when the rendered text does not already start with it: never a second BOS
  (llama.cpp's tokenizer would add one and warn; we do not serve that prompt).
* Sampling: `SamplingParams()` is the default, temperature DEFAULT_TEMPERATURE = 0.8 (llama.cpp's
  common_params_sampling default). max_tokens and stop may come from the call or from the
  SamplingParams; given in both places with different values they are refused by name, never one
  silently ignored. With neither, max_tokens is DEFAULT_MAX_TOKENS.
"""

from __future__ import annotations

from typing import Any, Sequence

from .errors import ContextOverflow, EmptyInput, SamplingError, TokenizerError
from .sample.params import DEFAULT_TEMPERATURE

DEFAULT_MAX_TOKENS = 128
# The embedded default model is trained on Python sources: start a Python file.
DEFAULT_PROMPT = "import os\nimport sys\n\n\ndef main():\n"


def encode_text(tokenizer: Any, text: str, parse_special: bool = False) -> list[int]:
    """Plain text -> ids: the GGUF's BOS (and EOS) as it asks; special-token text literal unless
    `parse_special`."""
    if not isinstance(text, str):
        raise TokenizerError(f"a text prompt must be str, got {type(text).__name__}")
    if not isinstance(parse_special, bool):
        raise TokenizerError(f"parse_special must be True or False, got {parse_special!r}")
    ids = tokenizer.encode(text, add_special=True, parse_special=parse_special)
    if not ids:
        raise EmptyInput("the prompt has no tokens")
    return ids


def encode_rendered(tokenizer: Any, rendered: str) -> list[int]:
    """Text rendered by a chat template -> ids: specials parsed (the template wrote them), the
    GGUF's BOS added only when the template did not already write it."""
    ids = tokenizer.encode(rendered, add_special=False, parse_special=True)
    bos = tokenizer.bos_id
    if tokenizer.add_bos and bos is not None and (not ids or ids[0] != bos):
        ids = [bos] + ids
    if not ids:
        raise EmptyInput("the rendered chat has no tokens")
    return ids


def encode_chat(tokenizer: Any, template: Any, messages: Sequence[dict],
                add_generation_prompt: bool = True) -> list[int]:
    """Messages -> the template's text -> ids (roles checked by the template's render)."""
    return encode_rendered(tokenizer, template.render(messages, add_generation_prompt=add_generation_prompt))


def encode_prompt(tokenizer: Any, prompt: Any, parse_special: bool = False) -> list[int]:
    """A text prompt (encode_text) or token ids (taken as given, range-checked)."""
    if isinstance(prompt, str):
        return encode_text(tokenizer, prompt, parse_special)
    if isinstance(prompt, (bytes, bytearray, dict)) or not hasattr(prompt, "__iter__"):
        raise TokenizerError(f"a prompt is str or a sequence of token ids, got {type(prompt).__name__}")
    ids = []
    for t in prompt:
        if isinstance(t, bool) or not hasattr(t, "__index__"):
            raise TokenizerError(f"prompt token {t!r} is not an integer id")
        t = int(t)
        if not 0 <= t < tokenizer.vocab_size:
            raise TokenizerError(f"prompt token {t} is outside the vocab [0, {tokenizer.vocab_size})")
        ids.append(t)
    if not ids:
        raise EmptyInput("the prompt has no tokens")
    return ids


def resolve_sampling(sampling: Any = None, max_tokens: int | None = None,
                     stop: Sequence[str] | str | None = None) -> tuple[Any, int, tuple[str, ...]]:
    """(params, max_tokens, stop) for one request. `sampling=None` is SamplingParams() (the
    documented defaults); max_tokens / stop given both here and in the params must agree."""
    from .sample import SamplingParams

    if sampling is None:
        sampling = SamplingParams()
    if not isinstance(sampling, SamplingParams):
        raise SamplingError(f"sampling must be SamplingParams, got {type(sampling).__name__}")
    if max_tokens is not None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise SamplingError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        if sampling.max_tokens is not None and sampling.max_tokens != max_tokens:
            raise SamplingError(f"max_tokens={max_tokens} disagrees with SamplingParams.max_tokens="
                                f"{sampling.max_tokens}; give it in one place")
    n = max_tokens if max_tokens is not None else sampling.max_tokens
    n = DEFAULT_MAX_TOKENS if n is None else n
    if stop is not None:
        stops = (stop,) if isinstance(stop, str) else tuple(stop)
        for s in stops:
            if not isinstance(s, str) or not s:
                raise SamplingError(f"stop strings must be non-empty strings, got {s!r}")
        if sampling.stop and stops and sampling.stop != stops:
            raise SamplingError(f"stop={list(stops)!r} disagrees with SamplingParams.stop="
                                f"{list(sampling.stop)!r}; give it in one place")
        stops = stops or sampling.stop
    else:
        stops = sampling.stop
    return sampling.replace(max_tokens=n, stop=stops), n, stops


def context_size(n_prompt: int, max_tokens: int, limit: int, max_context: int | None = None,
                 name: str = "max_context") -> int:
    """The session context for a prompt and max_tokens: `max_context` when given, else
    prompt + max tokens. The last sampled token is not fed back, so prompt + max_tokens - 1
    positions must fit; both the request and the model's context_length are checked."""
    need = n_prompt + max_tokens - 1
    if max_context is not None:
        if isinstance(max_context, bool) or not isinstance(max_context, int) or max_context < 1:
            raise SamplingError(f"{name} must be an integer >= 1, got {max_context!r}")
        if max_context > limit:
            raise ContextOverflow(f"{name} {max_context} exceeds the model's context_length {limit}")
        if need > max_context:
            raise ContextOverflow(f"prompt ({n_prompt} tokens) + max tokens ({max_tokens}) needs {need} "
                                  f"positions, over {name} {max_context}")
        return max_context
    if need > limit:
        raise ContextOverflow(f"prompt ({n_prompt} tokens) + max tokens ({max_tokens}) needs {need} "
                              f"positions, over the model's context_length {limit}")
    return min(n_prompt + max_tokens, limit)


__all__ = ["DEFAULT_TEMPERATURE", "DEFAULT_MAX_TOKENS", "DEFAULT_PROMPT", "encode_text", "encode_rendered",
           "encode_chat", "encode_prompt", "resolve_sampling", "context_size"]
