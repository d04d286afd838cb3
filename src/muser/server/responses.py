"""OpenAI response bodies and stream chunks from engine events (GenEvent ... Done).

Chat: `logprobs.content` entries are {token, logprob, bytes, top_logprobs: [{token, logprob,
bytes}]}; a stream is role chunk, delta chunks (content / reasoning_content / tool_calls), a
finish chunk, and with stream_options.include_usage one last chunk with `choices: []` and the
usage. Legacy completions: `logprobs` is {tokens, token_logprobs, top_logprobs: [{token: lp}],
text_offset}. finish_reason: "length" at max_tokens, "tool_calls" when calls were parsed,
"stop" otherwise (an end-of-generation token or a stop string).
"""

from __future__ import annotations

import time

from . import chat as chatfmt
from ..generation import GenEvent
from .loop import Done


def finish_reason(reason: str, tool_calls: bool = False) -> str:
    if tool_calls:
        return "tool_calls"
    return "length" if reason == "length" else "stop"


def usage(d: Done) -> dict:
    return {"prompt_tokens": d.prompt_tokens, "completion_tokens": d.completion_tokens,
            "total_tokens": d.prompt_tokens + d.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": d.cached_tokens}}


class _Base:
    def __init__(self, api):
        self.api = api
        self.tok = api.tokenizer
        self.model = api.cfg.model_id
        self.created = int(time.time())

    def piece_bytes(self, token: int) -> bytes:
        return self.tok.token_to_piece(token, special=True)

    def token_text(self, token: int) -> str:
        return self.piece_bytes(token).decode("utf-8", errors="replace")


class Turn(_Base):
    """One chat turn: raw model text -> content, reasoning_content and tool_calls."""

    def __init__(self, api, atem: bool, tools, parallel: bool, logprobs: bool):
        super().__init__(api)
        self.atem, self.tools, self.parallel, self.logprobs = atem, tools, parallel, logprobs
        self.raw = ""
        self.sent_content = self.sent_reasoning = 0
        self.role_sent = False

    def _entry(self, p: GenEvent) -> dict:
        return {"token": self.token_text(p.token), "logprob": p.logprob, "bytes": list(self.piece_bytes(p.token)),
                "top_logprobs": [{"token": self.token_text(t), "logprob": lp, "bytes": list(self.piece_bytes(t))}
                                 for t, lp in p.top_logprobs]}

    def _parse(self, final: bool) -> chatfmt.ParsedTurn:
        if not self.atem:
            return chatfmt.ParsedTurn(content=self.raw)
        if final:
            return chatfmt.parse_atem(self.raw, self.tools, parse_calls=bool(self.tools), parallel=self.parallel)
        text = self.raw[: len(self.raw) - chatfmt.held_marker_suffix(self.raw)]
        return chatfmt.parse_atem(text, self.tools, parse_calls=bool(self.tools), partial=True)

    def _calls(self, turn: chatfmt.ParsedTurn) -> list[dict]:
        return [{"id": chatfmt.call_id(), "type": "function",
                 "function": {"name": c["name"], "arguments": c["arguments"]}} for c in turn.tool_calls]

    def message(self, events: list, cid: str) -> dict:
        pieces = [e for e in events if isinstance(e, GenEvent)]
        done: Done = events[-1]
        self.raw = "".join(p.text for p in pieces)
        turn = self._parse(final=True)
        msg: dict = {"role": "assistant", "content": turn.content if (turn.content or not turn.tool_calls) else None}
        if turn.reasoning:
            msg["reasoning_content"] = turn.reasoning
        calls = self._calls(turn)
        if calls:
            msg["tool_calls"] = calls
        logprobs = None
        if self.logprobs:
            logprobs = {"content": [self._entry(p) for p in pieces]}
        return {"id": cid, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "message": msg, "logprobs": logprobs,
                             "finish_reason": finish_reason(done.finish, bool(calls))}],
                "usage": usage(done)}

    def _chunk(self, cid: str, delta: dict, logprobs=None, finish=None) -> dict:
        return {"id": cid, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}

    def _deltas(self, turn: chatfmt.ParsedTurn) -> dict:
        d = {}
        if len(turn.reasoning) > self.sent_reasoning:
            d["reasoning_content"] = turn.reasoning[self.sent_reasoning:]
            self.sent_reasoning = len(turn.reasoning)
        if len(turn.content) > self.sent_content:
            d["content"] = turn.content[self.sent_content:]
            self.sent_content = len(turn.content)
        return d

    def chunks(self, ev, cid: str, include_usage: bool) -> list[dict]:
        out = []
        if not self.role_sent:
            out.append(self._chunk(cid, {"role": "assistant", "content": ""}))
            self.role_sent = True
        if isinstance(ev, GenEvent):
            self.raw += ev.text
            lp = {"content": [self._entry(ev)]} if self.logprobs else None
            delta = self._deltas(self._parse(final=False))
            if delta or lp:
                out.append(self._chunk(cid, delta, lp))
            return out
        if isinstance(ev, Done):
            turn = self._parse(final=True)
            delta = self._deltas(turn)
            calls = self._calls(turn)
            if calls:
                delta["tool_calls"] = [dict(c, index=i) for i, c in enumerate(calls)]
            if delta:
                out.append(self._chunk(cid, delta))
            out.append(self._chunk(cid, {}, None, finish_reason(ev.finish, bool(calls))))
            if include_usage:
                out.append({"id": cid, "object": "chat.completion.chunk", "created": self.created,
                            "model": self.model, "choices": [], "usage": usage(ev)})
        return out


class Completion(_Base):
    def __init__(self, api, cid: str, echo: str, logprobs: bool):
        super().__init__(api)
        self.cid, self.echo, self.logprobs = cid, echo, logprobs
        self.offset = len(echo)
        self.first = True

    def _logprobs(self, pieces: list[GenEvent], offset: int) -> dict | None:
        if not self.logprobs:
            return None
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for p in pieces:
            out["tokens"].append(self.token_text(p.token))
            out["token_logprobs"].append(p.logprob)
            out["top_logprobs"].append({self.token_text(t): lp for t, lp in p.top_logprobs})
            out["text_offset"].append(offset)
            offset += len(p.text)
        return out

    def body(self, events: list) -> dict:
        pieces = [e for e in events if isinstance(e, GenEvent)]
        done: Done = events[-1]
        text = self.echo + "".join(p.text for p in pieces)
        return {"id": self.cid, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "text": text, "logprobs": self._logprobs(pieces, len(self.echo)),
                             "finish_reason": finish_reason(done.finish)}],
                "usage": usage(done)}

    def _chunk(self, text: str, logprobs=None, finish=None) -> dict:
        return {"id": self.cid, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}]}

    def chunks(self, ev, include_usage: bool) -> list[dict]:
        out = []
        if self.first and self.echo:
            out.append(self._chunk(self.echo))
        self.first = False
        if isinstance(ev, GenEvent):
            out.append(self._chunk(ev.text, self._logprobs([ev], self.offset)))
            self.offset += len(ev.text)
        elif isinstance(ev, Done):
            out.append(self._chunk("", None, finish_reason(ev.finish)))
            if include_usage:
                out.append({"id": self.cid, "object": "text_completion", "created": self.created,
                            "model": self.model, "choices": [], "usage": usage(ev)})
        return out
