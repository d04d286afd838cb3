"""Request bodies of the OpenAI-compatible API as pydantic models, and the one error shape.

Every model forbids unknown fields (refused by name), takes numbers as numbers (no "1.0"
strings), refuses NaN and infinities, and checks ranges; the first problem becomes an ApiError
whose `param` names the field (OpenAI's error body: {"error": {message, type, param, code}}).
Sampling values are checked again by muser.SamplingParams, which names the field too.

Unspecified sampling knobs take llama-server's defaults (muser.SamplingParams: temperature 0.8,
top_k 40, top_p 0.95, min_p 0.05), the comparator this server is measured against.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

MAX_STOP = 16  # stop strings per request
MAX_TOP_LOGPROBS_CHAT = 20  # OpenAI's bound for chat top_logprobs
MAX_LOGPROBS_COMPLETION = 5  # OpenAI's bound for the legacy completions `logprobs`


class ApiError(Exception):
    """An HTTP error with OpenAI's body; `param` names the offending field."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


Float = Annotated[float, Field(allow_inf_nan=False)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: StrictBool = False


class FunctionDef(_Strict):
    name: Annotated[StrictStr, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.\-]+$")]
    description: StrictStr = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: StrictBool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: StrictStr


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class FunctionCall(_Strict):
    name: StrictStr
    arguments: StrictStr  # a JSON object, as OpenAI sends it


class ToolCall(_Strict):
    id: StrictStr
    type: Literal["function"]
    function: FunctionCall


class TextPart(_Strict):
    type: Literal["text"]
    text: StrictStr


Content = Union[StrictStr, list[TextPart]]


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: StrictStr | None = None
    reasoning_content: StrictStr | None = None


class _Sampling(_Strict):
    """Fields shared by chat and legacy completions."""

    model: StrictStr
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: Float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: Float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(default=None, ge=0)
    min_p: Float | None = Field(default=None, ge=0.0, le=1.0)
    presence_penalty: Float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: Float | None = Field(default=None, ge=-2.0, le=2.0)
    repeat_penalty: Float | None = Field(default=None, gt=0.0)
    seed: StrictInt | None = Field(default=None, ge=0, le=0xFFFFFFFE)
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt = 1
    logit_bias: dict[str, Float] | None = None
    user: StrictStr | None = None


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS_CHAT)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True


class CompletionRequest(_Sampling):
    prompt: StrictStr | list[StrictInt] = Field(min_length=1)
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS_COMPLETION)
    echo: StrictBool = False


_TYPE_LABELS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def _loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
            continue
        p = str(part)
        if p in _TYPE_LABELS or "[" in p or "-" in p or p[:1].isupper():
            continue  # pydantic's union-branch labels are not field names
        out += ("." if out else "") + p
    return out or "body"


def parse(model: type[_Strict], raw: bytes) -> Any:
    """Decode a JSON body into `model`; every problem is an ApiError naming the field."""
    try:
        data = json.loads(raw, parse_constant=_refuse_constant)
    except _Constant as e:
        raise ApiError(400, f"the body holds {e.args[0]}, which is not a JSON number", "body") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the body is not valid JSON: {e}", "body") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the body must be a JSON object, got {type(data).__name__}", "body")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = _first_error(e)
        where = _loc(err["loc"])
        if err["type"] == "extra_forbidden":
            raise ApiError(400, f"unknown field '{where}'", where) from None
        if err["type"] == "missing":
            raise ApiError(400, f"missing required field '{where}'", where) from None
        raise ApiError(400, f"{where}: {err['msg']} (got {err.get('input')!r:.80})", where) from None


def _first_error(e: ValidationError) -> dict:
    errs = e.errors()
    # a union reports one error per branch: prefer the one that names a real field
    for kind in ("extra_forbidden", "missing"):
        for err in errs:
            if err["type"] == kind:
                return err
    return errs[0]


class _Constant(ValueError):
    pass


def _refuse_constant(name: str) -> None:
    raise _Constant(name)
