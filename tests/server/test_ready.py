"""Readiness through real server processes: the port answers while the model loads (/health 503
{"status": "loading"}, every other endpoint 503 with Retry-After), the "listening on" line comes
once the server can answer, and then /health, /v1/models and a completion answer at once; a load
that fails stops the server with its error. The engine loop's warm-up runs the shapes its steps
issue (by construction: the loop's own prompt_rows), on the slots' own sessions."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from muser.bench.kinds.serve import MUSER_LINE
from muser.server.loop import EngineLoop, prompt_rows, warm_batches

from .test_batcher import Recording, _finish, _job

SRC = str(Path(__file__).resolve().parents[2] / "src")
LOADING = re.compile(r"loading behind (http://127\.0\.0\.1:\d+) ")
# a server whose load (model load and warm-up) takes LOAD_S seconds longer than it does
SLOW = """
import sys, time
import muser
from muser.server import Server

def load():
    time.sleep(float(sys.argv[1]))
    return muser.load(device="cpu")

Server(load, slots=2, port=0).serve()
"""
LOAD_S = 4.0


class Proc:
    """A subprocess whose stderr lines are collected with their arrival times."""

    def __init__(self, argv: list[str]):
        env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[tuple[float, str]] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.p.stderr:
            self.lines.append((time.monotonic(), line))

    def wait_for(self, pattern: re.Pattern, timeout: float = 120.0) -> tuple[float, re.Match]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for t, line in list(self.lines):
                m = pattern.search(line)
                if m:
                    return t, m
            if self.p.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"no line matching {pattern.pattern}:\n" + "".join(x for _, x in self.lines))

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()


def test_the_server_says_loading_until_it_can_answer():
    proc = Proc([sys.executable, "-c", SLOW, str(LOAD_S)])
    try:
        _, m = proc.wait_for(LOADING, timeout=60)
        base = m.group(1)
        h = httpx.get(base + "/health", timeout=5)  # the port answers at once, the load still sleeping
        assert h.status_code == 503 and h.json() == {"status": "loading"} and h.headers["retry-after"] == "1"
        r = httpx.post(base + "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1}, timeout=5)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "unavailable_error"
        assert httpx.get(base + "/v1/models", timeout=5).status_code == 503
        t_refused = time.monotonic()
        assert not any(MUSER_LINE.search(x) for _, x in proc.lines)  # not ready: no "listening on" line yet
        t_ready, m = proc.wait_for(MUSER_LINE)
        assert m.group(1) == base and t_ready > t_refused
        # ready means ready: each answers at once (the model's identity was hashed during the load)
        h = httpx.get(base + "/health", timeout=2)
        assert h.status_code == 200 and h.json()["status"] == "ok" and h.json()["slots"] == 2
        models = httpx.get(base + "/v1/models", timeout=2).json()["data"]
        assert models[0]["id"] == m.group(2) and len(models[0]["meta"]["sha256"]) == 64
        r = httpx.post(base + "/v1/completions", timeout=60, json={"model": m.group(2), "prompt": "def f(",
                                                                   "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    finally:
        proc.stop()


def test_a_load_that_fails_stops_the_server_with_its_error(tmp_path):
    proc = Proc([sys.executable, "-m", "muser", "serve", "--port", "0", "--ctx", str(1 << 30)])
    try:
        proc.p.wait(timeout=120)
    finally:
        proc.stop()
    time.sleep(0.2)  # the pump's last lines
    err = "".join(x for _, x in proc.lines)
    assert proc.p.returncode != 0
    assert LOADING.search(err) and not MUSER_LINE.search(err)
    assert f"--ctx {1 << 30} must be in [2, " in err


def test_warm_batches_are_the_steps_the_loop_builds(model):
    """The loop's steps with k decoding slots, alone and beside a prompt longer than a chunk, are
    warm-up batches (their rows per item, decoders first)."""
    slots, ctx = 3, 1024
    want = warm_batches(slots, ctx)
    assert want == [(1, []), (2, []), (3, []), (0, [512]), (1, [64])]
    assert warm_batches(1, 40) == [(1, []), (0, [39])]
    assert prompt_rows(2, [10, 70, 5]) == [10, 54]  # 64 rows shared, oldest first
    want_rows = [[1] * k + p for k, p in want]
    for k in range(slots + 1):
        rec = Recording(model, ctx)
        loop = EngineLoop(model, slots=slots, context=ctx, backend=rec, batch_window_us=0)
        loop.start()
        try:
            short = [_job(model, [5 + i, 6, 7], 200) for i in range(k)]
            for j in short:
                loop.submit(j)
            while any(j.t_first is None for j in short):
                time.sleep(0.01)
            t_decoding = time.monotonic()
            time.sleep(0.05)
            long = None
            if k < slots:
                long = _job(model, [40 + i % 300 for i in range(ctx - 1)], 1)
                loop.submit(long)
                _finish(long)
            for j in short:
                loop.cancel(j)
        finally:
            loop.stop()
        steps = [(t, rows) for what, t, rows in rec.log if what == "step"]
        if k:  # k decoders alone
            alone = [rows for t, rows in steps if t > t_decoding and (long is None or t < long.t_submit)]
            assert alone and all(rows == [1] * k for rows in alone) and [1] * k in want_rows, (k, alone)
        if long is not None:  # then beside the long prompt's first chunk: a warm-up batch, or
            # (more decoders beside an eager chunk) that batch's chunk beside more decode rows
            first = next(rows for t, rows in steps if t >= long.t_submit and len(rows) == k + 1)
            assert first in want_rows or [1] + first[k:] in want_rows, (k, first)
            assert first[:k] == [1] * k and first[k] > 16  # eager: nothing to capture


def test_warm_up_runs_its_batches_on_the_slots_sessions_and_empties_them(model):
    slots, ctx = 3, 256
    rec = Recording(model, ctx)
    loop = EngineLoop(model, slots=slots, context=ctx, backend=rec)
    assert loop.warm_up() is None and rec.log == []  # the CPU captures nothing: start-up stays fast
    batches = warm_batches(slots, ctx)
    loop.run_warm(batches)
    assert [e[2] for e in rec.log] == [[1] * k + p for k, p in batches]
    owns = [s.own for s in loop.slots]
    assert all(s is not None and s.n_past == 0 for s in owns)
    loop.start()  # the warmed sessions serve requests (kept, not replaced)
    try:
        j = _job(model, [5, 6, 7], 3)
        loop.submit(j)
        _finish(j)
    finally:
        loop.stop()
    assert loop.slots[0].own is owns[0]
