"""The engine loop's decode batcher on the tiny fixture, in process: sequences that become ready
within the coalesce window share one Engine.step (counted by muser_engine_steps_total and
muser_step_sequences), a window of 0 does not hold a step, decode rows go before a whole-prompt
prefill, a prompt is chunked 512 alone and 64 while a decoder waits, and a step's events reach the
asyncio loop in one cross-thread call."""

from __future__ import annotations

import queue
import time

import pytest

from muser.errors import LaneError
from muser.generation import emitter
from muser.sample import greedy
from muser.server.loop import Batcher, Done, EngineLoop, Failed, Job, StepBackend
from muser.server.metrics import Metrics


class Inline:
    """Stands in for the server's asyncio loop: events land in a thread-safe queue at once."""

    @staticmethod
    def call_soon_threadsafe(fn, *args):
        fn(*args)


class Recording(StepBackend):
    """The real backend, with every Engine.step and whole-prompt prefill logged in order:
    ("step", start time, rows per item) and ("prefill", start time, prompt length)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.log: list[tuple] = []

    def step(self, items):
        self.log.append(("step", time.monotonic(), [len(t) for _, t in items]))
        return super().step(items)

    def prefill(self, sess, ids, history):
        self.log.append(("prefill", time.monotonic(), len(ids)))
        return super().prefill(sess, ids, history)


class Counting(Inline):
    """Inline, counting the cross-thread calls."""

    calls = 0

    @classmethod
    def call_soon_threadsafe(cls, fn, *args):
        cls.calls += 1
        fn(*args)


def _job(model, prompt: list[int], max_tokens: int, aloop=Inline) -> Job:
    tok = model.tokenizer  # end-of-generation banned: every request runs to max_tokens
    em = emitter(tok, prompt, greedy(logit_bias={t: -100.0 for t in tok.eog_ids}), max_tokens=max_tokens)
    return Job(prompt=prompt, emitter=em, deadline=time.monotonic() + 300, events=queue.Queue(), aloop=aloop)


def _finish(job: Job, timeout: float = 120.0):
    while True:
        ev = job.events.get(timeout=timeout)
        if isinstance(ev, (Done, Failed)):
            assert isinstance(ev, Done), ev
            return ev


def _first_token(job: Job, timeout: float = 120.0) -> None:
    ev = job.events.get(timeout=timeout)
    assert not isinstance(ev, (Done, Failed)), ev


def _loop(model, window_us: int, backend=None, slots: int = 4) -> EngineLoop:
    loop = EngineLoop(model, slots=slots, context=1024, metrics=Metrics(slots), batch_window_us=window_us,
                      backend=backend)
    loop.start()
    return loop


def _steps(loop: EngineLoop) -> tuple[float, float, float]:
    """(steps, steps counted by the sequences histogram, sequences summed over the steps)."""
    r = loop.metrics.registry
    return (r.get_sample_value("muser_engine_steps_total"), r.get_sample_value("muser_step_sequences_count"),
            r.get_sample_value("muser_step_sequences_sum"))


def test_window_arithmetic():
    b = Batcher(250)  # the default, book 10.2
    assert b.window_s == pytest.approx(250e-6)
    # first row ready at 0: a sequence ready 100 us later still finds the step open ...
    assert b.wait_s(100e-6, 0.0, free_slots=3) == pytest.approx(150e-6)
    # ... one ready 300 us later does not (the step left at 250 us)
    assert b.wait_s(250e-6, 0.0, free_slots=3) == 0.0
    assert b.wait_s(300e-6, 0.0, free_slots=3) == 0.0
    assert b.wait_s(0.0, 0.0, free_slots=0) == 0.0  # every slot busy: nobody can join, go at once
    assert Batcher(0).wait_s(0.0, 0.0, free_slots=3) == 0.0
    for bad in (-1, 2.5, True, "250"):
        with pytest.raises(LaneError, match="batch window"):
            Batcher(bad)


def test_two_requests_ready_within_the_window_share_one_step(model):
    # a wide window (0.5 s) so that a second request 100 us after the first is inside it on a
    # loaded CI host too; each request wants one token: its whole prompt and its first token are
    # one step, so a shared step shows as one step carrying two sequences
    loop = _loop(model, 500_000)
    try:
        a, b = _job(model, [5, 6, 7, 8], 1), _job(model, [9, 10, 11], 1)
        loop.submit(a)
        time.sleep(100e-6)
        loop.submit(b)
        _finish(a), _finish(b)
        assert _steps(loop) == (1.0, 1.0, 2.0)
    finally:
        loop.stop()


def test_window_zero_does_not_hold_a_step(model):
    loop = _loop(model, 0)
    try:
        a, b = _job(model, [5, 6, 7, 8], 1), _job(model, [9, 10, 11], 1)
        loop.submit(a)
        _finish(a)  # served alone before the second one exists
        loop.submit(b)
        _finish(b)
        assert _steps(loop) == (2.0, 2.0, 2.0)
    finally:
        loop.stop()


def test_one_cross_thread_call_per_step_carries_every_slots_events(model):
    # three requests in one wide window share every step; each step's tokens (and the last
    # step's Done events) reach the asyncio loop in one call, in each job's order
    loop = _loop(model, 500_000)
    try:
        jobs = [_job(model, [5 + i, 6, 7, 8], 5, Counting) for i in range(3)]
        for j in jobs:
            loop.submit(j)
        got = []
        for j in jobs:
            evs = [j.events.get(timeout=120)]
            while not isinstance(evs[-1], (Done, Failed)):
                evs.append(j.events.get(timeout=120))
            got.append(evs)
        steps, _, sequences = _steps(loop)
    finally:
        loop.stop()
    assert (steps, sequences) == (5.0, 15.0)
    assert Counting.calls == steps  # one per step, not one per event (18 events)
    for j, evs in zip(jobs, got):
        assert [e.index for e in evs[:-1]] == [0, 1, 2, 3, 4] and isinstance(evs[-1], Done), evs
        assert [e.token for e in evs[:-1]] == j.emitter.tokens


def test_decode_rows_go_before_a_whole_prompt_prefill(model, tmp_path):
    # with a kvpack store a prompt on an empty slot is prefilled in one call (restore + suffix)
    rec = Recording(model, 1024, kvpack=tmp_path / "kvpack")
    loop = _loop(model, 250, backend=rec)
    try:
        a = _job(model, [5, 6, 7, 8], 40)
        loop.submit(a)
        _first_token(a)  # a decodes from now on
        b = _job(model, list(range(20, 90)), 2)
        loop.submit(b)
        _finish(a), _finish(b)
    finally:
        loop.stop()
    (i_b,) = [i for i, e in enumerate(rec.log) if e[0] == "prefill" and e[2] == 70]
    after = [i for i, e in enumerate(rec.log) if e[0] == "step" and e[1] >= b.t_submit]
    assert after and after[0] < i_b, rec.log  # the first step built after b arrived went before b's prefill
    assert rec.log[after[0]][2] == [1]  # a's decode row


def test_prompt_rows_512_alone_and_64_while_a_decoder_waits(model):
    rec = Recording(model, 1024)
    loop = _loop(model, 250, backend=rec)
    try:
        c = _job(model, [40 + i % 300 for i in range(600)], 1)
        loop.submit(c)
        _finish(c)
        assert [e[2] for e in rec.log] == [[512], [88]]
        rec.log.clear()
        a = _job(model, [5, 6, 7, 8], 30)
        loop.submit(a)
        _first_token(a)
        d = _job(model, [40 + i % 300 for i in range(150)], 1)
        loop.submit(d)
        _finish(d), _finish(a)
    finally:
        loop.stop()
    rows = [e[2] for e in rec.log if e[1] >= d.t_submit]
    with_d = [r for r in rows if len(r) == 2]
    assert with_d == [[1, 64], [1, 64], [1, 22]], rows  # a's decode row + d's prompt chunk


def test_cli_refuses_a_negative_window_before_loading(capsys):
    from muser.cli import main

    assert main(["serve", "--model", "/nonexistent.gguf", "--batch-window-us", "-1"]) == 2
    assert "--batch-window-us must be >= 0, got -1" in capsys.readouterr().err


def test_cli_refuses_zero_threads_before_loading(capsys):
    from muser.cli import main

    assert main(["serve", "--model", "/nonexistent.gguf", "--threads", "0"]) == 2
    assert "--threads must be >= 1, got 0" in capsys.readouterr().err
