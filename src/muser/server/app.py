"""The OpenAI-compatible HTTP API (Starlette on uvicorn) over one EngineLoop.

    POST /v1/chat/completions   POST /v1/completions   GET /v1/models
    GET /v1/sessions            DELETE /v1/sessions/{id}
    GET /health                 GET /metrics (Prometheus)

Until the model is loaded and warmed (Readiness) every endpoint answers 503 with Retry-After:
/health {"status": "loading"}, the others OpenAI's error body (llama-server's loading state).

Every refusal is OpenAI's error body with the offending field in `param`, before any work: a
bad or unknown field (400), a prompt that does not fit the context (400), a body over the limit
(413), a missing or wrong API key (401), a full queue (503 with Retry-After). A client that goes
away is cancelled: its slot is free before the next step is built.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..errors import MuserError
from ..sample import SamplingParams
from . import chat as chatfmt
from ..generation import emitter as make_emitter
from ..prompt import encode_prompt, encode_rendered
from .loop import Done, EngineLoop, Failed, Job
from .metrics import Metrics
from .protocol import ApiError, ChatRequest, CompletionRequest, parse
from .responses import Completion, Turn

SESSION_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@dataclass
class ServerConfig:
    model_id: str
    api_key: str | None = None
    max_body_bytes: int = 4 << 20
    max_prompt_tokens: int | None = None  # None: the context less one
    timeout_s: float = 600.0


RETRY_AFTER_S = 1  # what a request during loading is told to wait before asking again


class Readiness:
    """The server's Api once it can answer (the model loaded, warmed, the engine loop running);
    None while loading."""

    def __init__(self) -> None:
        self.api: Api | None = None


class Api:
    def __init__(self, loop: EngineLoop, cfg: ServerConfig, metrics: Metrics):
        self.loop, self.cfg, self.metrics = loop, cfg, metrics
        model = loop.model
        self.tokenizer = model.tokenizer
        self.template = model.template
        self.format = chatfmt.output_format(self.template.source)
        self.reads_tools = chatfmt.template_reads_tools(self.template.source)
        self.created = int(time.time())

    # -- plumbing ------------------------------------------------------------------------------
    def _auth(self, request: Request) -> None:
        if self.cfg.api_key is None:
            return
        got = request.headers.get("authorization", "")
        if got != f"Bearer {self.cfg.api_key}":
            raise ApiError(401, "a valid API key is required (Authorization: Bearer KEY)", None,
                           "authentication_error")

    async def _body(self, request: Request) -> bytes:
        limit = self.cfg.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"the body is {int(declared):,} bytes, over the {limit:,}-byte limit", "body")
        chunks, n = [], 0
        async for c in request.stream():
            n += len(c)
            if n > limit:
                raise ApiError(413, f"the body is over the {limit:,}-byte limit", "body")
            chunks.append(c)
        return b"".join(chunks)

    def _session_name(self, request: Request) -> str | None:
        name = request.headers.get("x-session-id")
        if name is None:
            return None
        if not SESSION_NAME.match(name):
            raise ApiError(400, f"x-session-id {name[:80]!r} must match {SESSION_NAME.pattern}", "x-session-id")
        return name

    def _check_model(self, name: str) -> None:
        if name != self.cfg.model_id:
            raise ApiError(404, f"model '{name[:200]}' is not served here (this server serves "
                                f"'{self.cfg.model_id}')", "model", "model_not_found")

    def _sampling(self, req) -> tuple[SamplingParams, tuple[str, ...]]:
        if req.n != 1:
            raise ApiError(400, f"n must be 1 (one choice per request is served), got {req.n}", "n")
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        if len(stop) > 16:
            raise ApiError(400, f"stop holds {len(stop)} strings, at most 16 are served", "stop")
        if any(not s for s in stop):
            raise ApiError(400, "stop strings must not be empty", "stop")
        kw: dict[str, Any] = {}
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repeat_penalty", "seed"):
            v = getattr(req, name)
            if v is not None:
                kw[name] = v
        if req.logit_bias:
            bias = {}
            for k, v in req.logit_bias.items():
                if not k.isdigit() or int(k) >= self.tokenizer.vocab_size:
                    raise ApiError(400, f"logit_bias key {k[:40]!r} is not a token id in [0, "
                                        f"{self.tokenizer.vocab_size})", "logit_bias")
                if not -100.0 <= v <= 100.0:
                    raise ApiError(400, f"logit_bias[{k}] = {v} is outside [-100, 100]", "logit_bias")
                bias[int(k)] = float("-inf") if v == -100.0 else v  # -100 bans the token (OpenAI)
            kw["logit_bias"] = bias
        try:
            return SamplingParams(**kw), stop
        except MuserError as e:
            raise ApiError(400, str(e), str(e).split(" ", 1)[0]) from None

    def _budget(self, prompt: list[int], max_tokens: int | None, field: str, where: str) -> int:
        ctx = self.loop.context
        limit = self.cfg.max_prompt_tokens if self.cfg.max_prompt_tokens is not None else ctx - 1
        if len(prompt) > limit or len(prompt) >= ctx:
            raise ApiError(400, f"the prompt is {len(prompt)} tokens; this server takes at most "
                                f"{min(limit, ctx - 1)} (context {ctx})", where)
        room = ctx - len(prompt)
        if max_tokens is None:
            return room
        if max_tokens > room:
            raise ApiError(400, f"{field} {max_tokens} + prompt {len(prompt)} tokens exceeds the context "
                                f"{ctx}", field)
        return max_tokens

    def _submit(self, job: Job) -> None:
        job.aloop = asyncio.get_running_loop()
        job.events = asyncio.Queue()
        job.id = uuid.uuid4().hex[:24]
        self.loop.submit(job)  # a full queue is refused here, before any response starts

    async def _events(self, job: Job):
        """Engine events until Done / Failed; cancels the job when the caller stops listening."""
        try:
            while True:
                ev = await job.events.get()
                yield ev
                if isinstance(ev, (Done, Failed)):
                    return
        finally:
            self.loop.cancel(job)

    def _job(self, prompt, params, stop, max_tokens, logprobs, render_special, session) -> Job:
        try:  # the sampler and stop strings are checked here, before the job is queued
            em = make_emitter(self.tokenizer, prompt, params, max_tokens, stop, render_special, logprobs or 0)
        except MuserError as e:
            raise ApiError(400, str(e), None) from None
        self.metrics.prompt_tokens.inc(len(prompt))
        return Job(prompt=prompt, emitter=em, logprobs=logprobs is not None,
                   deadline=time.monotonic() + self.cfg.timeout_s, session_name=session)

    # -- chat ----------------------------------------------------------------------------------
    def _chat_prompt(self, req: ChatRequest) -> list[int]:
        tools = chatfmt.template_tools(req)
        if tools and not self.reads_tools:
            raise ApiError(400, "this model's chat template does not render tools, so they cannot be offered",
                           "tools")
        tc = req.tool_choice
        if tc is not None and not isinstance(tc, str):
            raise ApiError(400, "tool_choice naming a function needs constrained decoding, which is not served; "
                                "use 'auto' or 'none'", "tool_choice")
        if tc == "required":
            raise ApiError(400, "tool_choice 'required' needs constrained decoding, which is not served; "
                                "use 'auto' or 'none'", "tool_choice")
        if tc is not None and not tools:
            raise ApiError(400, "tool_choice is given without tools", "tool_choice")
        try:
            text = self.template.render(chatfmt.template_messages(req), add_generation_prompt=True, tools=tools)
            return encode_rendered(self.tokenizer, text)  # muser.prompt: the BOS the GGUF asks, never twice
        except MuserError as e:
            raise ApiError(400, f"the chat template refused the messages: {e}", "messages") from None

    async def chat(self, request: Request) -> Response:
        self._auth(request)
        req = parse(ChatRequest, await self._body(request))
        self._check_model(req.model)
        session = self._session_name(request)
        params, stop = self._sampling(req)
        if req.max_tokens is not None and req.max_completion_tokens is not None \
                and req.max_tokens != req.max_completion_tokens:
            raise ApiError(400, "max_tokens and max_completion_tokens disagree", "max_completion_tokens")
        mt_field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        if req.stream_options is not None and not req.stream:
            raise ApiError(400, "stream_options needs stream: true", "stream_options")
        prompt = self._chat_prompt(req)
        max_tokens = self._budget(prompt, req.max_completion_tokens or req.max_tokens, mt_field, "messages")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        atem = self.format == "atem"
        job = self._job(prompt, params, stop, max_tokens, logprobs, atem, session)
        tools = chatfmt.template_tools(req) if req.tool_choice != "none" else None
        turn = Turn(self, atem, tools, req.parallel_tool_calls, req.logprobs)
        cid = "chatcmpl-" + uuid.uuid4().hex[:24]
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return self._sse(request, job, lambda ev: turn.chunks(ev, cid, include_usage), "chat")
        return await self._collect(request, job, lambda evs: turn.message(evs, cid), "chat")

    # -- completions ---------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        self._auth(request)
        req = parse(CompletionRequest, await self._body(request))
        self._check_model(req.model)
        session = self._session_name(request)
        params, stop = self._sampling(req)
        if req.stream_options is not None and not req.stream:
            raise ApiError(400, "stream_options needs stream: true", "stream_options")
        if req.echo and req.logprobs is not None:
            raise ApiError(400, "echo with logprobs needs prompt logprobs, which are not served", "echo")
        try:  # muser.prompt's defaults: the GGUF's BOS, special-token text literal; ids range-checked
            prompt = encode_prompt(self.tokenizer, req.prompt)
        except MuserError as e:
            raise ApiError(400, str(e), "prompt") from None
        max_tokens = self._budget(prompt, req.max_tokens if req.max_tokens is not None else 16, "max_tokens",
                                  "prompt")
        job = self._job(prompt, params, stop, max_tokens, req.logprobs, False, session)
        echo = (req.prompt if isinstance(req.prompt, str) else self.tokenizer.decode(prompt, render_special=False)) \
            if req.echo else ""
        cid = "cmpl-" + uuid.uuid4().hex[:24]
        comp = Completion(self, cid, echo, req.logprobs is not None)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return self._sse(request, job, lambda ev: comp.chunks(ev, include_usage), "completions")
        return await self._collect(request, job, comp.body, "completions")

    # -- responses -----------------------------------------------------------------------------
    async def _collect(self, request: Request, job: Job, build, endpoint: str) -> Response:
        events: list = []
        self._submit(job)
        watcher = asyncio.create_task(_watch_disconnect(request, lambda: self.loop.cancel(job)))
        try:
            async for ev in self._events(job):
                events.append(ev)
        finally:
            watcher.cancel()
        last = events[-1]
        if isinstance(last, Failed):
            raise last.error
        self.metrics.requests.labels(endpoint, "200").inc()
        return JSONResponse(build(events))

    def _sse(self, request: Request, job: Job, chunks, endpoint: str) -> Response:
        self._submit(job)
        gen = self._events(job)

        async def body():
            try:
                async for ev in gen:
                    if isinstance(ev, Failed):
                        yield _sse(ev.error.body())
                        break
                    for c in chunks(ev):
                        yield _sse(c)
                    if isinstance(ev, Done):
                        self.metrics.requests.labels(endpoint, "200").inc()
                        yield b"data: [DONE]\n\n"
            finally:
                await gen.aclose()

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # -- small endpoints -----------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        self._auth(request)
        m = self.loop.model
        return JSONResponse({"object": "list", "data": [{
            "id": self.cfg.model_id, "object": "model", "created": self.created, "owned_by": "muser",
            "meta": {"n_ctx": self.loop.context, "vocab": self.tokenizer.vocab_size, "device": m.device,
                     "lane": m.lane, "kv": m.kv, "sha256": m.identity.artifact_sha256}}]})

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "slots": len(self.loop.slots), "slots_busy": self.loop.active,
                             "queue": len(self.loop.queue), "steps": self.loop.steps})

    async def metrics_text(self, request: Request) -> Response:
        self._auth(request)
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

    async def sessions(self, request: Request) -> Response:
        self._auth(request)
        return JSONResponse({"object": "list", "data": self.loop.sessions.names()})

    async def delete_session(self, request: Request) -> Response:
        self._auth(request)
        name = request.path_params["name"]
        if not SESSION_NAME.match(name):
            raise ApiError(400, f"session id {name[:80]!r} must match {SESSION_NAME.pattern}", "session")
        if not self.loop.sessions.delete(name):
            raise ApiError(404, f"no session '{name}'", "session")
        return JSONResponse({"id": name, "object": "session", "deleted": True})


async def _watch_disconnect(request: Request, on_gone) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            on_gone()
            return


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


async def _api_error(request: Request, exc: ApiError) -> Response:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def build_app(ready: Readiness, metrics: Metrics) -> Starlette:
    """The routes over `ready.api`; every one answers 503 (Retry-After) while it is None."""

    def route(name: str):
        async def handler(request: Request) -> Response:
            api = ready.api
            if api is not None:
                return await getattr(api, name)(request)
            wait = {"Retry-After": str(RETRY_AFTER_S)}
            if name == "health":
                return JSONResponse({"status": "loading"}, status_code=503, headers=wait)
            raise ApiError(503, "the model is loading", None, "unavailable_error", wait)

        return handler

    async def on_error(request: Request, exc: ApiError) -> Response:
        path = request.url.path.rsplit("/", 1)[-1] or "root"
        metrics.requests.labels(path, str(exc.status)).inc()
        return await _api_error(request, exc)

    routes = [
        Route("/v1/chat/completions", route("chat"), methods=["POST"]),
        Route("/v1/completions", route("completions"), methods=["POST"]),
        Route("/v1/models", route("models"), methods=["GET"]),
        Route("/v1/sessions", route("sessions"), methods=["GET"]),
        Route("/v1/sessions/{name}", route("delete_session"), methods=["DELETE"]),
        Route("/health", route("health"), methods=["GET"]),
        Route("/metrics", route("metrics_text"), methods=["GET"]),
    ]
    async def on_http(request: Request, exc: HTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return await on_error(request, ApiError(exc.status_code, f"{request.method} {request.url.path}: "
                                                                 f"{exc.detail}", None, kind))

    async def on_bug(request: Request, exc: Exception) -> Response:
        return await on_error(request, ApiError(500, f"internal error: {type(exc).__name__}: {exc}", None,
                                                "server_error"))

    handlers: dict[Any, Any] = {ApiError: on_error, HTTPException: on_http, Exception: on_bug}
    return Starlette(routes=routes, exception_handlers=handlers)


__all__ = ["Api", "Readiness", "ServerConfig", "build_app"]
