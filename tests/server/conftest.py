"""Real `muser serve` processes on free ports of 127.0.0.1 (one per module), reached with the
real `openai` client and httpx."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from .fixtures import write_atem_fixture

API_KEY = "test-key"
SRC = Path(__file__).resolve().parents[2] / "src"
LINE = re.compile(r"listening on (http://127\.0\.0\.1:\d+/v1) \(model (\S+),")


class Served:
    def __init__(self, args: list[str]):
        env = dict(os.environ, PYTHONPATH=f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        self.proc = subprocess.Popen([sys.executable, "-m", "muser", "serve", "--port", "0", *args],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        self.log: list[str] = []
        found = threading.Event()

        def pump():
            for line in self.proc.stderr:
                self.log.append(line)
                m = LINE.search(line)
                if m:
                    self.base_url, self.model = m.group(1), m.group(2)
                    found.set()

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + 180
        while not found.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("muser serve did not start:\n" + "".join(self.log))
        self.root = self.base_url[: -len("/v1")]

    def client(self, **kw):
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key=API_KEY, max_retries=0, **kw)

    def aclient(self, **kw):
        import openai

        return openai.AsyncOpenAI(base_url=self.base_url, api_key=API_KEY, max_retries=0, **kw)

    def alive(self) -> bool:
        import httpx

        return self.proc.poll() is None and httpx.get(self.root + "/health", timeout=10).status_code == 200

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="session")
def atem_gguf(tmp_path_factory) -> Path:
    return write_atem_fixture(tmp_path_factory.mktemp("server") / "atem.gguf")


@pytest.fixture(scope="module")
def micro():
    """The shipped micro model (the default model of `muser serve`), 4 slots, with an API key."""
    s = Served(["--slots", "4", "--api-key", API_KEY])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def atem(atem_gguf):
    """The turn-protocol fixture, 4 slots."""
    s = Served(["--model", str(atem_gguf), "--slots", "4", "--api-key", API_KEY, "--max-body", "65536"])
    yield s
    s.stop()
