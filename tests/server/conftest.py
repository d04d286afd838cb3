"""Real `muser serve` processes on free ports of 127.0.0.1 (one per module), reached with the
real `openai` client and httpx."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

import muser

from muser.bench.kinds.serve import muser_server

from .fixtures import write_atem_fixture

API_KEY = "test-key"


@pytest.fixture(scope="module")
def model(tiny_gguf):
    """The tiny synthetic model loaded in process (engine-loop tests without a server)."""
    m = muser.load(tiny_gguf)
    yield m
    m.close()


class Served:
    def __init__(self, args: list[str]):
        self.proc = muser_server(args)
        self.root, self.model = self.proc.base, self.proc.model
        self.base_url = self.root + "/v1"

    def client(self, **kw):
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key=API_KEY, max_retries=0, **kw)

    def alive(self) -> bool:
        return self.proc.proc.poll() is None and httpx.get(self.root + "/health", timeout=10).status_code == 200

    def stop(self) -> None:
        self.proc.stop()


@pytest.fixture(scope="session")
def atem_gguf(tmp_path_factory) -> Path:
    return write_atem_fixture(tmp_path_factory.mktemp("server") / "atem.gguf")


@pytest.fixture(scope="module")
def micro():
    """The shipped micro model (the default model of `muser serve`), 4 slots, one CPU thread, with
    an API key."""
    s = Served(["--slots", "4", "--threads", "1", "--api-key", API_KEY])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def atem(atem_gguf):
    """The turn-protocol fixture, 4 slots."""
    s = Served(["--model", str(atem_gguf), "--slots", "4", "--api-key", API_KEY, "--max-body", "65536"])
    yield s
    s.stop()
