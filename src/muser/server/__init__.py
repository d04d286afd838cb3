"""The OpenAI-compatible server: HTTP API (app, responses, protocol), the engine loop and slots
over Engine.step with muser.generation's Emitter per request (loop), chat rendering and the Muse
Glimmer turn parser (chat), metrics.

    from muser.server import Server
    srv = Server(lambda: muser.load(path, device="cuda"), slots=4, context=1024, host="127.0.0.1",
                 port=8080, remote=RemotePrefill(addr, certs_dir))   # remote: optional, muser.handoff
    srv.serve()       # blocks; prints "muser serve: listening on http://HOST:PORT ..." once ready

`serve` binds the port first and loads the model behind it (llama-server's order): until the
model is loaded, its identity hashed (what /v1/models reports), the slots' step graphs captured
(EngineLoop.warm_up, CUDA) and the engine loop running, /health answers 503 {"status":
"loading"} and every other endpoint 503 with Retry-After; then /health answers 200 and the
"listening on" line is printed. A load that fails stops the server and `serve` raises its error.
"""

from __future__ import annotations

import socket
import sys
import threading
from typing import Any, Callable

from .app import Api, Readiness, ServerConfig, build_app
from .loop import BATCH_WINDOW_US, Batcher, EngineLoop
from .metrics import Metrics


class Server:
    def __init__(self, load: Callable[[], Any], slots: int = 4, context: int | None = None,
                 host: str = "127.0.0.1", port: int = 8080, model_id: str | None = None, queue_limit: int = 64,
                 max_sessions: int = 16, remote=None, kvpack=None, batch_window_us: int = BATCH_WINDOW_US, **cfg):
        if not callable(load):
            raise TypeError(f"load must be a callable returning the model (it runs behind the bound port), "
                            f"got {type(load).__name__}")
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        Batcher(batch_window_us)  # a bad window is refused before anything loads
        self._load = load  # () -> muser.Model, called behind the bound port
        self.slots, self.context, self.model_id = slots, context, model_id
        self.queue_limit, self.max_sessions, self.remote, self.kvpack = queue_limit, max_sessions, remote, kvpack
        self.batch_window_us, self.cfg = batch_window_us, cfg
        self.metrics = Metrics(slots)
        self.ready = Readiness()
        self.app = build_app(self.ready, self.metrics)
        self.host, self.port = host, port
        self.model: Any = None
        self.loop: EngineLoop | None = None
        self.config: ServerConfig | None = None
        self.error: BaseException | None = None  # what stopped the load

    def _open(self, model) -> Api:
        """The engine loop and the API over a loaded model."""
        from ..errors import ContextOverflow

        self.model = model
        limit = model.config.context_length
        context = min(limit, 4096) if self.context is None else self.context
        if not 2 <= context <= limit:
            raise ContextOverflow(f"--ctx {context} must be in [2, {limit}] (the model's context_length)")
        self.loop = EngineLoop(model, slots=self.slots, context=context, queue_limit=self.queue_limit,
                               max_sessions=self.max_sessions, metrics=self.metrics, remote=self.remote,
                               kvpack=self.kvpack, batch_window_us=self.batch_window_us)
        self.config = ServerConfig(model_id=self.model_id or model.path.name.removesuffix(".gguf"), **self.cfg)
        return Api(self.loop, self.config, self.metrics)

    def _extras(self, loop: EngineLoop) -> str:
        b = loop.backend
        return ("" if b.remote is None else f"; prompts prefill on {b.remote.host}:{b.remote.port}") + \
            ("" if b.store is None else f"; kvpack {b.store.backend.root}")

    def _threads(self) -> str:
        if self.model.device != "cpu":
            return ""
        import torch

        return f", threads {torch.get_num_threads()}"  # the C kernels follow torch's count

    def _prepare(self, server, url: str) -> None:
        """On its own thread while the HTTP server answers 503: load, hash, warm, start; then ready."""
        try:
            api = self._open(self._load())
            assert self.loop is not None and self.config is not None
            # the artifact SHA-256 /v1/models reports: a read of the whole file (16.7 GB for the
            # full Q4_K model), cached on the model, so it is done here and not in the first request
            _ = self.model.identity.artifact_sha256
            self.loop.warm_up()
            self.loop.start()
        except BaseException as e:  # noqa: BLE001 - raised by serve() once the HTTP server has stopped
            self.error = e
            server.should_exit = True
            return
        self.ready.api = api
        print(f"muser serve: listening on {url}/v1 (model {self.config.model_id}, "
              f"{len(self.loop.slots)} slots, context {self.loop.context}, device {self.model.device}, lane {self.model.lane}"
              f"{self._threads()})" + self._extras(self.loop),
              file=sys.stderr, flush=True)

    def serve(self, log_level: str = "warning") -> None:
        import uvicorn

        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))  # bound before any line is printed: --port 0 reports the real port
        sock.listen(2048)  # connections queue from now on, while uvicorn starts (asyncio listens again)
        port = sock.getsockname()[1]
        host = f"[{self.host}]" if family == socket.AF_INET6 else self.host
        url = f"http://{host}:{port}"
        print(f"muser serve: loading behind {url} (/health answers 503 until the model is ready)",
              file=sys.stderr, flush=True)
        server = uvicorn.Server(uvicorn.Config(self.app, log_level=log_level, access_log=False,
                                               timeout_graceful_shutdown=2))
        loading = threading.Thread(target=self._prepare, args=(server, url), name="muser-serve-load", daemon=True)
        loading.start()
        try:
            server.run(sockets=[sock])
        finally:
            if self.loop is not None:
                self.loop.stop()
            if self.model is not None and not loading.is_alive():  # a load still running dies with the process
                self.model.close()
        if self.error is not None:
            raise self.error


__all__ = ["Server", "EngineLoop", "Readiness", "ServerConfig", "build_app"]
