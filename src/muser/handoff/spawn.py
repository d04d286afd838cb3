"""`muser prefill-node` as a child process on this machine (loopback benchmarks and tests): start
it on 127.0.0.1 with an ephemeral port, read the address it prints, stop it by its own pid."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Self

from ..errors import MuserError

SRC = str(Path(__file__).resolve().parents[2])


class NodeProcess:
    def __init__(self, model: str | os.PathLike, certs: str | os.PathLike, kv: str = "f16",
                 lane: str = "exact", device: str = "cpu", stall_s: float = 30.0, threads: int | None = None):
        env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "muser", "prefill-node", "--listen", "127.0.0.1:0", "--certs", str(certs),
             "--model", str(model), "--kv", kv, "--lane", lane, "--device", device,
             "--stall-timeout", str(stall_s)] + ([] if threads is None else ["--threads", str(threads)]),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.addr: str | None = None

    def wait(self, timeout_s: float = 180.0) -> NodeProcess:
        """Block until the node prints its address (it has loaded the model and bound)."""
        end = time.monotonic() + timeout_s
        out = self.proc.stdout
        assert out is not None  # Popen(stdout=PIPE)
        while self.addr is None:
            r, _, _ = select.select([out], [], [], max(0.0, end - time.monotonic()))
            if not r:
                self.stop()
                raise MuserError(f"prefill-node did not start within {timeout_s:g} s")
            line = out.readline()
            if not line:
                raise MuserError(f"prefill-node exited: {self.proc.stderr.read()[-2000:]}")
            if line.startswith("prefill-node listening on "):
                self.addr = line.split()[-1]
        return self

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for f in (self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()

    def __enter__(self) -> Self:
        return self.wait()

    def __exit__(self, *exc) -> None:
        self.stop()
