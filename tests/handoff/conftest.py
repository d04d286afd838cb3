"""Handoff fixtures: certs dirs (ours and another CA), a small fixture model with two NoPE
layers and a wrapping SWA ring, prefill nodes as separate processes on 127.0.0.1, and a
man-in-the-middle relay / byte proxy for fault injection."""

from __future__ import annotations

import select
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from muser.errors import HandoffRefused
from muser.handoff import certs as C
from muser.handoff.spawn import NodeProcess
from muser.handoff.transport import END, REFUSE, REQUEST, Link, send_frame
from muser.model.synth import SynthSpec

# 8 layers = two collars: 6 SWA rings (window 64, wrapped by the prompts), 2 NoPE planes
SPEC = SynthSpec(n_layers=8, hidden=128, n_heads=4, head_dim=32, ffn=256, sliding_window=64,
                 context_length=2048)


def ca_with_nodes(d: Path) -> Path:
    """A private CA in `d` with the two node certificates, prefill and decode."""
    C.init(d)
    for name in ("prefill", "decode"):
        C.issue(d, name)
    return d


@pytest.fixture(scope="session")
def certs_dir(tmp_path_factory) -> Path:
    return ca_with_nodes(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="session")
def other_ca(tmp_path_factory) -> Path:
    return ca_with_nodes(tmp_path_factory.mktemp("other-ca"))


@pytest.fixture(scope="session")
def handoff_gguf(make_gguf) -> Path:
    return make_gguf(SPEC)


@pytest.fixture(scope="session")
def other_gguf(make_gguf) -> Path:
    return make_gguf(SPEC.with_(seed=7))


def Node(model: Path, certs: Path, kv: str) -> NodeProcess:
    return NodeProcess(model, certs, kv=kv, stall_s=5.0, threads=1)


@pytest.fixture(scope="package", autouse=True)
def one_thread():
    """Both sides single-threaded: the same thread count as the nodes, and no OpenMP spinning
    against the node processes on a small machine."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def nodes(handoff_gguf, certs_dir):
    """Prefill nodes for f16 and f32 KV, and one f16 node to be killed mid-stream, started
    together."""
    started = {kv: Node(handoff_gguf, certs_dir, kv.split("-")[0]) for kv in ("f16", "f32", "f16-victim")}
    try:
        yield {kv: n.wait() for kv, n in started.items()}
    finally:
        for n in started.values():
            n.stop()


@pytest.fixture(scope="session")
def models(handoff_gguf, other_gguf):
    import muser

    return {"f16": muser.load(handoff_gguf, kv="f16"), "f32": muser.load(handoff_gguf, kv="f32"),
            "other": muser.load(other_gguf, kv="f16")}


def prompt(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(6, 300, n)]


def plane_state(session):
    """Everything observable about the live planes: the tuple itself, metadata, bytes."""
    planes = session.cache.planes
    return planes, [(p.state(), p.keys.clone(), p.values.clone()) for p in planes]


def assert_unchanged(session, before) -> None:
    planes, rows = before
    assert session.cache.planes is planes
    for p, (st, k, v) in zip(planes, rows):
        assert p.state() == st
        assert bool((p.keys == k).all()) and bool((p.values == v).all())


# --- fault injection ------------------------------------------------------------------------


def _addr(a: str) -> tuple[str, int]:
    h, p = a.rsplit(":", 1)
    return h, int(p)


class Relay:
    """A TLS-terminating man in the middle holding a valid producer certificate (but not the
    sealing key): takes one request from the decode node, forwards it to the real node, collects
    the node's frames and sends `mutate(frames)` back."""

    def __init__(self, certs_dir: Path, upstream: str, mutate, hold_manifest_s: float = 0.0):
        self.server_ctx = C.Certs.load(certs_dir, "prefill").server_context()
        self.client_ctx = C.Certs.load(certs_dir, "decode").client_context()
        self.upstream, self.mutate, self.hold = upstream, mutate, hold_manifest_s
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.addr = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.recorded: list = []
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _upstream_frames(self, request) -> list:
        up = self.client_ctx.wrap_socket(socket.create_connection(_addr(self.upstream), timeout=30))
        try:
            send_frame(up, REQUEST, request.seq, request.payload)
            link, frames = Link(up, 30.0), []
            while True:
                fr = link.read(1 << 26, "relay")
                frames.append(fr)
                if fr.kind in (END, REFUSE):
                    return frames
        finally:
            up.close()

    def _run(self) -> None:
        try:
            raw, _ = self.sock.accept()
            conn = self.server_ctx.wrap_socket(raw, server_side=True)
            request = Link(conn, 30.0).read(1 << 24, "relay request")
            frames = self._upstream_frames(request)
            self.recorded = frames
        except (OSError, HandoffRefused) as e:  # surfaced by the test
            self.error = e
            self.sock.close()
            return
        try:
            for i, fr in enumerate(self.mutate(frames)):
                if i == 0:
                    time.sleep(self.hold)  # a delayed delivery: the manifest arrives late
                send_frame(conn, fr.kind, fr.seq, bytes(fr.payload))
            time.sleep(0.2)
        except OSError:
            pass  # the decode node hung up on a refused stream: expected
        finally:
            conn.close()
            self.sock.close()


class ByteProxy:
    """A plain TCP forwarder (TLS passes through untouched). After `limit` bytes from the node
    it either stops forwarding (a stalled link), or calls `on_limit` (e.g. kill the node)."""

    def __init__(self, upstream: str, limit: int, on_limit=None, bytes_per_s: float | None = None):
        self.upstream, self.limit, self.on_limit, self.rate = upstream, limit, on_limit, bytes_per_s
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.addr = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        down, _ = self.sock.accept()
        up = socket.create_connection(_addr(self.upstream))
        sent = 0
        try:
            while not self.stop.is_set():
                r, _, _ = select.select([down, up], [], [], 0.1)
                for s in r:
                    data = s.recv(256 if (s is up and self.rate) else 65536)
                    if not data:
                        return
                    if s is down:
                        up.sendall(data)
                        continue
                    if sent >= self.limit:
                        if self.on_limit is None:
                            continue  # stalled: swallow, send nothing more
                        self.on_limit()
                        self.on_limit = None
                    down.sendall(data)
                    sent += len(data)
                    if self.rate:
                        time.sleep(len(data) / self.rate)
        except OSError:
            return
        finally:
            self.stop.wait(3.0)
            down.close()
            up.close()
            self.sock.close()
