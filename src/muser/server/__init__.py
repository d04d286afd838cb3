"""The OpenAI-compatible server: HTTP API (app, responses, protocol), the engine loop and slots
over Engine.step with muser.generation's Emitter per request (loop), chat rendering and the Muse
Glimmer turn parser (chat), metrics.

    from muser.server import Server
    srv = Server(model, slots=4, context=1024, host="127.0.0.1", port=8080,
                 remote=RemotePrefill(addr, certs_dir))   # remote: optional, muser.handoff
    srv.serve()       # blocks; prints "muser serve: listening on http://HOST:PORT ..."
"""

from __future__ import annotations

import socket
import sys

from .app import ServerConfig, build_app
from .loop import BATCH_WINDOW_US, EngineLoop
from .metrics import Metrics


class Server:
    def __init__(self, model, slots: int = 4, context: int | None = None, host: str = "127.0.0.1",
                 port: int = 8080, model_id: str | None = None, queue_limit: int = 64, max_sessions: int = 16,
                 remote=None, kvpack=None, batch_window_us: int = BATCH_WINDOW_US, **cfg):
        from ..errors import ContextOverflow

        limit = model.config.context_length
        context = min(limit, 4096) if context is None else context
        if not 2 <= context <= limit:
            raise ContextOverflow(f"--ctx {context} must be in [2, {limit}] (the model's context_length)")
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.model = model
        self.metrics = Metrics(slots)
        self.loop = EngineLoop(model, slots=slots, context=context, queue_limit=queue_limit,
                               max_sessions=max_sessions, metrics=self.metrics, remote=remote,
                               kvpack=kvpack, batch_window_us=batch_window_us)
        self.config = ServerConfig(model_id=model_id or model.path.name.removesuffix(".gguf"), **cfg)
        self.app = build_app(self.loop, self.config, self.metrics)
        self.host, self.port = host, port

    def _extras(self) -> str:
        b = self.loop.backend
        return ("" if b.remote is None else f"; prompts prefill on {b.remote.host}:{b.remote.port}") + \
            ("" if b.store is None else f"; kvpack {b.store.backend.root}")

    def _threads(self) -> str:
        if self.model.device != "cpu":
            return ""
        import torch

        return f", threads {torch.get_num_threads()}"  # the C kernels follow torch's count

    def serve(self, log_level: str = "warning") -> None:
        import uvicorn

        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))  # bound before the line is printed: --port 0 reports the real port
        port = sock.getsockname()[1]
        self.loop.start()
        host = f"[{self.host}]" if family == socket.AF_INET6 else self.host
        print(f"muser serve: listening on http://{host}:{port}/v1 (model {self.config.model_id}, "
              f"{len(self.loop.slots)} slots, context {self.loop.context}, device {self.model.device}"
              f"{self._threads()})"
              + self._extras(),
              file=sys.stderr, flush=True)
        server = uvicorn.Server(uvicorn.Config(self.app, log_level=log_level, access_log=False,
                                               timeout_graceful_shutdown=2))
        try:
            server.run(sockets=[sock])
        finally:
            self.loop.stop()


__all__ = ["Server", "EngineLoop", "ServerConfig", "build_app"]
