"""Model output in the turn protocol, token by token through muser.generation's Emitter (control
tokens rendered), into OpenAI chat bodies and stream chunks: reasoning_content, content and
tool_calls, validated by the openai package's own types."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from muser.generation import emitter
from muser.gguf.reader import GGUFFile
from muser.sample import SamplingParams
from muser.server.loop import Done
from muser.server.responses import Turn
from muser.text import Tokenizer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
CALL = ('<atem:function_calls>\n<atem:invoke name="get_weather">\n<atem:parameter name="city">Paris</atem:parameter>\n'
        '<atem:parameter name="days">2</atem:parameter>\n</atem:invoke>\n</atem:function_calls>')


@pytest.fixture(scope="module")
def tok(atem_gguf):
    f = GGUFFile(atem_gguf)
    yield Tokenizer.from_gguf(f)
    f.close()


def _events(tok, text: str, eot: bool):
    ids = tok.encode(text, add_special=False, parse_special=True)
    if eot:
        ids.append(tok.eot_id)
    em = emitter(tok, [tok.bos_id], SamplingParams(temperature=0.0), max_tokens=len(ids) + 1,
                 render_special=True, top_logprobs=1)
    zeros = np.zeros(tok.vocab_size, dtype=np.float32)
    evs = [em.push(t, zeros) for t in ids]
    return evs + [Done(evs[-1].finish_reason or "length", 1, len(ids), 0)]


def _api(tok):
    return SimpleNamespace(tokenizer=tok, cfg=SimpleNamespace(model_id="m"))


CASES = [
    (" to=self<|message|>Let me look it up.<|eom|><|start|>assistant to=get_weather<|message|>" + CALL,
     "Let me look it up.", None, [{"city": "Paris", "days": 2}]),
    (" to=user<|message|>It is sunny in Paris.", "", "It is sunny in Paris.", []),
    (" to=user<|message|>Checking.<|eom|><|start|>assistant to=get_weather<|message|>" + CALL,
     "", "Checking.", [{"city": "Paris", "days": 2}]),
    ("plain text, no protocol", "", "plain text, no protocol", []),
]


@pytest.mark.parametrize("text,reasoning,content,calls", CASES)
def test_turn_body_and_stream(tok, text, reasoning, content, calls):
    evs = _events(tok, text, eot=not calls)
    body = Turn(_api(tok), True, TOOLS, True, True).message(evs, "chatcmpl-x")
    msg = ChatCompletion.model_validate(body).choices[0]
    assert msg.message.content == content
    assert (body["choices"][0]["message"].get("reasoning_content") or "") == reasoning
    got = [json.loads(c.function.arguments) for c in msg.message.tool_calls or []]
    assert got == calls
    assert msg.finish_reason == ("tool_calls" if calls else "stop")
    assert len(msg.logprobs.content) == len(evs) - 1

    turn = Turn(_api(tok), True, TOOLS, True, True)
    chunks = [c for ev in evs for c in turn.chunks(ev, "chatcmpl-x", include_usage=True)]
    for c in chunks:
        ChatCompletionChunk.model_validate(c)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == reasoning
    assert "".join(d.get("content") or "" for d in deltas) == (content or "")
    streamed = [json.loads(tc["function"]["arguments"]) for d in deltas for tc in d.get("tool_calls", [])]
    assert streamed == calls
    for d in deltas:  # protocol markers never leak into content while streaming
        assert "<|message|>" not in (d.get("content") or "") and " to=" not in (d.get("content") or "")[:4]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(evs) - 1
