"""Chat requests to prompt text, and model output back to OpenAI messages.

Rendering: messages (and `tools`) go through the GGUF's chat template (muser.text.ChatTemplate,
sandboxed). A tool call's `arguments` arrive as a JSON string and are handed to the template as
a mapping (templates index into them). A template that never reads `tools` cannot show tools to
the model, so a request with tools is refused for it rather than silently served without them.

Output formats (chosen from the template):
* "plain": the generated text is the assistant's content.
* "atem": the Muse Glimmer turn protocol (the pinned llama.cpp's common/parsers/muse-glimmer.cpp
  and models/templates/muse-glimmer.jinja). The generation prompt ends in "<|start|>assistant";
  the model writes messages " to=RECIPIENT<|message|>BODY" separated by "<|eom|>" +
  "<|start|>assistant" and ends its turn with <|eot|> (an end-of-generation token, never part
  of the text). Recipient "self" is reasoning, "user" (or none) the answer, any other a tool
  call whose body is an <atem:function_calls> block of <atem:invoke name=".."> with
  <atem:parameter name="..">value</atem:parameter> children. Parameters whose schema may be a
  string are taken as written; others are JSON. A call is recognised only as the first message
  after reasoning or after an answer closed by <|eom|>; markup quoted inside an answer or inside
  reasoning stays text. Output that does not follow the protocol is returned as content, whole.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Sequence

from .protocol import ApiError, ChatRequest

START = "<|start|>assistant"
MSG, EOM = "<|message|>", "<|eom|>"
CALLS_OPEN, CALLS_CLOSE = "<atem:function_calls>", "</atem:function_calls>"
INVOKE_CLOSE, PARAM_CLOSE = "</atem:invoke>", "</atem:parameter>"
_INVOKE = re.compile(r'\s*<atem:invoke name="([^"]*)">\s*')
_PARAM = re.compile(r'<atem:parameter name="([^"]*)">')
_MARKERS = (MSG, EOM, START, " to=")


def output_format(template_source: str) -> str:
    return "atem" if START in template_source and "atem:function_calls" in template_source else "plain"


def template_reads_tools(template_source: str) -> bool:
    from jinja2 import Environment, meta

    return "tools" in meta.find_undeclared_variables(Environment().parse(template_source))


def template_messages(req: ChatRequest) -> list[dict]:
    """The request's messages as the template sees them (arguments parsed into mappings)."""
    out: list[dict] = []
    for i, m in enumerate(req.messages):
        d: dict[str, Any] = {"role": m.role}
        if isinstance(m.content, list):
            d["content"] = [{"type": "text", "text": p.text} for p in m.content]
        else:
            d["content"] = m.content if m.content is not None else ""
        if m.role != "tool" and m.tool_call_id is not None:
            raise ApiError(400, f"messages[{i}].tool_call_id belongs on a 'tool' message", f"messages[{i}].tool_call_id")
        if m.tool_calls is not None:
            if m.role != "assistant":
                raise ApiError(400, f"messages[{i}].tool_calls belongs on an 'assistant' message",
                               f"messages[{i}].tool_calls")
            calls = []
            for j, tc in enumerate(m.tool_calls):
                where = f"messages[{i}].tool_calls[{j}].function.arguments"
                try:
                    args = json.loads(tc.function.arguments) if tc.function.arguments.strip() else {}
                except ValueError as e:
                    raise ApiError(400, f"{where} is not JSON: {e}", where) from None
                if not isinstance(args, dict):
                    raise ApiError(400, f"{where} must be a JSON object", where)
                calls.append({"id": tc.id, "type": "function",
                              "function": {"name": tc.function.name, "arguments": args}})
            d["tool_calls"] = calls
        for key in ("name", "tool_call_id", "reasoning_content"):
            v = getattr(m, key)
            if v is not None:
                d[key] = v
        out.append(d)
    return out


def template_tools(req: ChatRequest) -> list[dict] | None:
    if not req.tools:
        return None
    return [{"type": "function", "function": {"name": t.function.name, "description": t.function.description,
                                              "parameters": t.function.parameters}} for t in req.tools]


# -- parsing the model's turn --------------------------------------------------------------


@dataclass
class ParsedTurn:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict] = field(default_factory=list)  # {"name", "arguments" (JSON text)}


def _may_be_string(schema: Any) -> bool:
    if not isinstance(schema, dict):
        return True
    t = schema.get("type")
    if t is None:
        alts = schema.get("anyOf") or schema.get("oneOf")
        return True if not alts else any(_may_be_string(a) for a in alts)
    return t == "string" or (isinstance(t, list) and "string" in t)


def _tool_schemas(tools: Sequence[dict] | None) -> dict[str, dict]:
    out = {}
    for t in tools or ():
        fn = t["function"]
        out[fn["name"]] = (fn.get("parameters") or {}).get("properties") or {}
    return out


def _parse_call(body: str, recipient: str, schemas: dict[str, dict]) -> tuple[dict, str] | None:
    """One ATEM call block at the start of `body` -> (call, rest) or None if it is not one."""
    if not body.startswith(CALLS_OPEN):
        return None
    m = _INVOKE.match(body, len(CALLS_OPEN))
    if m is None or m.group(1) not in schemas:
        return None
    name, props = m.group(1), schemas[m.group(1)]
    pos, args = m.end(), {}
    while True:
        p = _PARAM.match(body, pos)
        if p is None:
            break
        pname = p.group(1)
        end = body.find(PARAM_CLOSE, p.end())
        if pname not in props or end < 0:
            return None
        raw = body[p.end():end]
        if _may_be_string(props[pname]):
            args[pname] = raw
        else:
            try:
                args[pname] = json.loads(raw)
            except ValueError:
                return None
        pos = end + len(PARAM_CLOSE)
        while pos < len(body) and body[pos].isspace():
            pos += 1
    if not body.startswith(INVOKE_CLOSE, pos):
        return None
    rest = body[pos + len(INVOKE_CLOSE):].lstrip()
    if not rest.startswith(CALLS_CLOSE):
        return None
    del recipient  # the header recipient is free text; the invoke name is the call
    return {"name": name, "arguments": json.dumps(args, ensure_ascii=False, separators=(",", ":"))}, \
        rest[len(CALLS_CLOSE):]


def parse_atem(text: str, tools: Sequence[dict] | None = None, parse_calls: bool = True,
               parallel: bool = True, partial: bool = False) -> ParsedTurn:
    """The model's turn (text after the "<|start|>assistant" generation prompt). `partial`
    (streaming): only what is already decided, no calls, never the whole-text fallback."""
    schemas = _tool_schemas(tools) if parse_calls else {}
    out = ParsedTurn()
    if partial:
        whole = out  # in partial mode the fallback is what was decided so far
    else:
        whole = ParsedTurn(content=text)
    rest = text
    while rest.startswith(" to=self" + MSG):  # reasoning messages, each closed by <|eom|>
        body = rest[len(" to=self" + MSG):]
        end = body.find(EOM)
        if end < 0:
            out.reasoning += body  # unfinished reasoning (length cut)
            return out
        out.reasoning += body[:end]
        rest = body[end + len(EOM):]
        if not rest.startswith(START):
            return whole
        rest = rest[len(START):]

    def calls(s: str) -> bool:
        while True:
            if not s.startswith(" to="):
                return False
            k = s.find(MSG)
            if k < 0:
                return False
            got = _parse_call(s[k + len(MSG):], s[4:k], schemas)
            if got is None:
                return False
            out.tool_calls.append(got[0])
            s = got[1]
            if not s:
                return True
            if not parallel or not s.startswith(EOM + START):
                return False
            s = s[len(EOM + START):]

    if partial and (rest in (" to=self"[:len(rest)], " to=user"[:len(rest)], MSG[:len(rest)])
                    or (rest.startswith(" to=") and MSG not in rest)):
        return out  # the header is not written yet
    if schemas and rest.startswith(" to=") and not rest.startswith(" to=user" + MSG):
        if partial:
            return out
        return out if calls(rest) else whole
    if rest.startswith(" to=user" + MSG):
        body = rest[len(" to=user" + MSG):]
    elif rest.startswith(MSG):
        body = rest[len(MSG):]
    else:
        if partial:
            header = rest.startswith(" to=") or any(mk.startswith(rest) for mk in (" to=", MSG))
            if not out.reasoning and not header:
                out.content = text  # not the protocol: all of it is content, streamed as it comes
            return out
        return whole if not out.reasoning else ParsedTurn(content=text)
    end = body.find(EOM)
    if end < 0:
        out.content = body
        return out
    out.content = body[:end]
    tail = body[end + len(EOM):]
    if partial:
        return out
    if tail and schemas and tail.startswith(START):
        if not calls(tail[len(START):]):
            out.tool_calls.clear()
            out.content = body
    elif tail:
        out.content = body  # text after a closed answer that is not a call: keep it all
    return out


def held_marker_suffix(text: str) -> int:
    """Length of the longest suffix of `text` that could still grow into a protocol marker
    (streaming holds it back until it is decided)."""
    best = 0
    for mk in _MARKERS + (CALLS_OPEN,):
        for n in range(min(len(mk) - 1, len(text)), best, -1):
            if text.endswith(mk[:n]):
                best = n
                break
    return best


def call_id() -> str:
    return "call_" + secrets.token_hex(12)
