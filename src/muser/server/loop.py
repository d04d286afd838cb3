"""The engine loop: one thread owns the model; requests reach it through a queue.

    loop = EngineLoop(model, slots=4, context=1024)
    loop.start()
    job = loop.submit(Job(...))      # ApiError(503, Retry-After) when the queue is full
    ... job.events (an asyncio.Queue on the server's event loop) receives GenEvent / Done / Failed

Scheduling (book 10.2-10.5, 10.10; the scheduler sees ids and counts, the backend owns tensors):
* N slots, each with its own session (its own KV). A free slot takes the oldest queued job.
* Every iteration is one step: each decoding slot contributes its one next-token row, and the
  prefilling slots, oldest first, share a budget of prompt rows (512, 64 while decoders wait),
  so a long prompt never starves the decoders and decoders never starve a prompt.
* The decode batcher (book 10.2: the server's 250 us DecodeBatcher coalesce window feeds one
  grouped forward): the rows of the sequences that become ready within the window of the first
  one share one Engine.step. A sequence becomes ready when its request is submitted and when
  the step that produced its last row ends; while a slot is free the step is held open until the
  window after the first ready row has passed (a request arriving meanwhile joins it), and with
  every slot busy it goes at once. Window 0: every step goes as soon as it has a row.
* Decode outranks prefill (book 10.2): besides the 64-row budget above, a whole-prompt prefill
  (below) runs after the iteration's step, so the decoders' rows are never behind it.
* Events reach the server's asyncio loop once per step (Outbox): one cross-thread wake carries
  every slot's token of the step, and the wake goes after the step's sampling, not between it.
* A job that is cancelled (client gone) or past its deadline leaves its slot before the next
  step is built. A failing step fails only the jobs in it; the loop goes on.
* Named sessions keep a conversation's KV across requests: a request whose prompt extends the
  tokens already in the named session's cache prefills only the new suffix.
* Whole-prompt prefills, on the loop thread when a slot starts, after the step of that iteration
  (decoders then wait for it, as for a local prefill of the prompt in one piece):
  - with a prefill node (muser.handoff.RemotePrefill) the prompt (or a named session's new
    suffix, the held prefix as history) is prefilled remotely; a refused or dead link prefills
    locally inside RemotePrefill, which logs why; each is counted by path (remote / local);
  - with a kvpack store (muser.kvpack.WarmSession) a prompt on an empty session restores its
    longest stored prefix, prefills the rest and persists the new chunks in the background; the
    slot waits for that writer before its session is emptied for the next request.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import LaneError, MuserError
from ..generation import Emitter, GenEvent
from .protocol import ApiError

log = logging.getLogger("muser.server")

PREFILL_CHUNK = 512  # PREFILL_BATCH_TOKENS (book 10.10)
WAITING_CHUNK = 64  # MAX_TEACHER_FORCED_TOKENS while decoders wait (book 10.10)
BATCH_WINDOW_US = 250  # the DecodeBatcher coalesce window (book 10.2)


def prompt_rows(n_decoders: int, todo: list[int]) -> list[int]:
    """The prompt rows each prefilling slot (oldest first; `todo`: its prompt tokens not yet
    prefilled) puts into a step beside `n_decoders` decode rows: they share PREFILL_CHUNK rows,
    WAITING_CHUNK while decoders wait."""
    budget = WAITING_CHUNK if n_decoders else PREFILL_CHUNK
    out = []
    for n in todo:
        if budget <= 0:
            break
        out.append(min(n, budget))
        budget -= out[-1]
    return out


def warm_batches(slots: int, context: int) -> list[tuple[int, list[int]]]:
    """The steps EngineLoop.warm_up runs, as (decode rows, prompt rows per prefilling slot): k =
    1..slots decoding slots alone (each k its own captured graph), then a prompt longer than a
    chunk, alone and beside one decoder, with the rows `prompt_rows` gives it (512 alone, 64
    beside decoders). A step with an item over 16 rows runs eagerly (engine/step.py): it
    captures nothing and launches the same kernels whatever the count of decoders beside it,
    so one of each chunk is run."""
    long = [context - 1]  # the longest prompt a slot takes; PREFILL_CHUNK or more from a 1024 context
    return [(k, []) for k in range(1, slots + 1)] + [(k, prompt_rows(k, long)) for k in range(min(2, slots))]


class Batcher:
    """The coalesce window of the decode batcher (see the module doc): how long a step is still
    held open for sequences that may join it."""

    def __init__(self, window_us: int = BATCH_WINDOW_US):
        if isinstance(window_us, bool) or not isinstance(window_us, int) or window_us < 0:
            raise LaneError(f"the batch window must be an integer >= 0 microseconds, got {window_us!r}")
        self.window_us = window_us
        self.window_s = window_us * 1e-6

    def wait_s(self, now: float, first_ready: float, free_slots: int) -> float:
        """Seconds to hold the step open at `now` (time.monotonic()), its first row ready at
        `first_ready`: none once the window has passed or when no slot is free to join."""
        if free_slots <= 0:
            return 0.0
        return max(0.0, first_ready + self.window_s - now)


@dataclass(frozen=True)
class Done:
    finish: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class Failed:
    error: ApiError


@dataclass
class Job:
    prompt: list[int]
    emitter: Emitter  # muser.generation's, built (its arguments checked) before the job is queued
    deadline: float  # time.monotonic() seconds
    logprobs: bool = False  # the client asked for logprobs
    session_name: str | None = None
    id: str = ""
    cancelled: bool = False
    events: Any = None  # asyncio.Queue, fed with call_soon_threadsafe
    aloop: Any = None  # the asyncio loop that owns `events`
    t_submit: float = field(default_factory=time.monotonic)
    t_first: float | None = None
    t_last: float | None = None


def _deliver(batch: list[tuple[Any, Any]]) -> None:
    for events, ev in batch:  # on the asyncio loop: in the order the engine loop emitted them
        events.put_nowait(ev)


class Outbox:
    """The engine loop's events for the jobs' asyncio loops, handed over in one call per loop
    at `flush`. Each call_soon_threadsafe writes the loop's self-pipe, and the woken loop thread
    takes the GIL while the engine thread is still sampling the step's other slots; one wake per
    step instead of one per event keeps that trade to one per step."""

    def __init__(self) -> None:
        self._pending: list[tuple[Job, Any]] = []

    def put(self, job: Job, ev) -> None:
        if job.aloop is not None:
            self._pending.append((job, ev))

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        loops: dict[int, tuple[Any, list]] = {}
        for job, ev in pending:
            loops.setdefault(id(job.aloop), (job.aloop, []))[1].append((job.events, ev))
        for aloop, batch in loops.values():
            try:
                aloop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:  # the server's event loop is closed: nobody is listening
                pass


class SessionStore:
    """Named sessions: name -> (backend session, tokens whose K/V it holds). LRU-bounded."""

    def __init__(self, limit: int):
        self.limit = limit
        self._d: collections.OrderedDict[str, tuple[Any, list[int]]] = collections.OrderedDict()
        self.busy: set[str] = set()
        self.lock = threading.Lock()

    def names(self) -> list[dict]:
        with self.lock:
            return [{"id": k, "tokens": len(v[1]), "busy": k in self.busy} for k, v in self._d.items()]

    def take(self, name: str):
        with self.lock:
            return self._d.pop(name, None)

    def put(self, name: str, sess, tokens: list[int]) -> None:
        with self.lock:
            self._d[name] = (sess, tokens)
            self._d.move_to_end(name)
            while len(self._d) > self.limit:
                self._d.popitem(last=False)

    def delete(self, name: str) -> bool:
        with self.lock:
            if name in self.busy:
                raise ApiError(409, f"session '{name}' is serving a request", "session")
            return self._d.pop(name, None) is not None


class StepBackend:
    """The engine side of the loop: sessions and one Engine.step per iteration (engine/step.py).
    `step(items)` takes (session, tokens) pairs and gives each item its last row's float32
    logits [vocab] (on CUDA left on the device: a muser.engine.rows.DeviceRow), or the exception that item raised: a step that fails is all-or-nothing in
    the engine (every session back where it was), so its items are re-run one by one and only
    the ones that fail alone are failed."""

    def __init__(self, model, context: int, remote=None, kvpack=None):
        from ..engine import StepItem

        self.model = model
        self.engine = model.engine
        self.context = context
        self._item = StepItem
        self.remote = remote  # muser.handoff.RemotePrefill or None
        self.store = None  # muser.kvpack.Store or None
        if kvpack is not None:
            from ..kvpack import Binding, Store

            self.store = Store.open(kvpack, Binding.of_session(self.model.session(max_context=context)))

    def new_session(self):
        sess = self.model.session(max_context=self.context)
        # an empty-cache checkpoint with a block as long as the context: rolling back to it
        # empties the cache at no cost (no ring row is live yet), so a slot keeps its buffers
        sess.muser_empty = sess.checkpoint(block=self.context)
        sess.muser_writer = None  # a WarmSession whose persistence may still read the planes
        return sess

    def reset(self, sess):
        """`sess` emptied, or a new session when its planes were swapped (an install or restore
        gives the planes a fresh epoch, so the empty-cache checkpoint no longer applies)."""
        if sess.muser_writer is not None:
            sess.muser_writer.wait()  # rows being persisted are not overwritten
            sess.muser_writer = None
        if sess.muser_empty is None:
            return self.new_session()
        if sess.n_past:
            sess.rollback(sess.muser_empty)
        return sess

    def whole_prefill(self, history: list[int]) -> bool:
        """Whether a slot's prompt on top of `history` is prefilled in one call (prefill)."""
        return self.remote is not None or (self.store is not None and not history)

    def prefill(self, sess, ids: list[int], history: list[int]) -> tuple[np.ndarray, str, int, int]:
        """`ids` prefilled in one call: (logits [vocab], path, tokens prefilled here, tokens
        restored from kvpack). path: "remote" | "local" (RemotePrefill's) | "kvpack"."""
        try:
            if self.remote is not None:
                logits = self.remote.prefill(sess, ids, history=history)
                path = self.remote.last.path
                if path == "remote":
                    sess.muser_empty = None  # the planes were swapped in: reset makes a new session
                return logits, path, 0 if path == "remote" else len(ids), 0
            from ..kvpack import WarmSession

            warm = WarmSession(sess, self.store)
            logits = warm.prefill(ids)
            sess.muser_writer = warm
            restored = warm.last["restored"]
            if restored:
                sess.muser_empty = None  # restored planes were swapped in
            return logits, "kvpack", warm.last["prefilled"], restored
        except BaseException:
            sess.muser_empty = None  # a failed install or restore may have swapped planes
            raise

    def _run(self, items: list[tuple[Any, list[int]]]) -> list[Any]:
        # on CUDA each row stays on the device (a DeviceRow): the emitter reads back its candidates
        res = self.engine.step([self._item(sess, toks, "last") for sess, toks in items], device_rows=True)
        return [r.logits[-1] if r.row is None else r.row for r in res]  # [vocab] each

    def step(self, items: list[tuple[Any, list[int]]]) -> list[Any]:
        try:
            return list(self._run(items))
        except Exception as e:  # noqa: BLE001 - isolate the failing items below
            if len(items) == 1:
                return [e]
        out: list[Any] = []
        for it in items:
            try:
                out.append(self._run([it])[0])
            except Exception as e:  # noqa: BLE001 - this item fails, the others go on
                out.append(e)
        return out


class Slot:
    def __init__(self, index: int):
        self.index = index
        self.job: Job | None = None
        self.own = None  # the slot's session, kept across requests
        self.session = None  # the one serving the job: `own` or a named session
        self.todo: list[int] = []  # prompt tokens not prefilled yet
        self.next_token: int | None = None  # sampled, to be fed back (decode row)
        self.emitter: Emitter | None = None
        self.history: list[int] = []  # tokens whose K/V the session holds
        self.cached = 0
        self.ready_at = 0.0  # time.monotonic() its next row became ready (submitted, or its last step ended)

    @property
    def decoding(self) -> bool:
        return self.job is not None and not self.todo and self.next_token is not None

    @property
    def prefilling(self) -> bool:
        return self.job is not None and bool(self.todo)


class EngineLoop:
    def __init__(self, model, slots: int = 4, context: int = 1024, queue_limit: int = 64,
                 max_sessions: int = 16, backend=None, metrics=None, remote=None, kvpack=None,
                 batch_window_us: int = BATCH_WINDOW_US):
        self.batcher = Batcher(batch_window_us)
        self.model = model
        self.tokenizer = model.tokenizer
        self.context = context
        self.backend = backend or StepBackend(model, context, remote, kvpack)
        self.slots = [Slot(i) for i in range(slots)]
        self.queue: collections.deque[Job] = collections.deque()
        self.queue_limit = queue_limit
        self.sessions = SessionStore(max_sessions)
        self.metrics = metrics
        self.outbox = Outbox()
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="muser-engine-loop", daemon=True)
        self.steps = 0

    # -- outside the loop ----------------------------------------------------------------------
    def warm_up(self, stream=None) -> dict | None:
        """Before `start`, on CUDA: the steps of `warm_batches` on the slots' own sessions (the
        decoders in slot order, as slots fill from an idle server), so the graphs of k batched
        decoders at the server's context bound are captured here and not inside the first
        requests that batch them (muser.load's warm-up captures single-session shapes at its own
        bound; a graph serves any sessions of its shape: engine/graphs.py). A progress line on stderr.
        Returns {seconds, steps}; None on the CPU, where nothing is captured (start-up stays fast)."""
        if self.model.device == "cpu":
            return None
        from ..progress import Progress

        batches = warm_batches(len(self.slots), self.context)
        bar = Progress("serve warm-up", len(batches), stream=stream)
        t0 = time.perf_counter()
        self.run_warm(batches, bar)
        bar.close()
        return {"seconds": time.perf_counter() - t0, "steps": len(batches)}

    def run_warm(self, batches: list[tuple[int, list[int]]], bar=None) -> None:
        """Each batch as one step: slots 0..k-1 decode a row, the next slots prefill their rows;
        the sessions are emptied after each (their planes, and so the captured graphs, kept)."""
        vocab = self.model.config.vocab
        for s in self.slots:
            if s.own is None:
                s.own = self.backend.new_session()
        for k, prompts in batches:
            if k + len(prompts) > len(self.slots):
                raise LaneError(f"a warm-up step of {k} decoders and {len(prompts)} prompts needs more than "
                                f"the {len(self.slots)} slots")
            rows = [1] * k + prompts
            items = [(s.own, [(7 * i + j) % vocab for j in range(n)]) for i, (s, n) in enumerate(zip(self.slots, rows))]
            for res in self.backend.step(items):
                if isinstance(res, BaseException):
                    raise res
            for s in self.slots[:len(rows)]:
                s.own = self.backend.reset(s.own)
            if bar is not None:
                bar.advance(1, f"{k} decoders" + (f" + {prompts[0]} prompt rows" if prompts else ""))

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread.ident is not None:  # started
            self._thread.join(timeout=30)

    def submit(self, job: Job) -> Job:
        with self._cv:
            if len(self.queue) >= self.queue_limit:
                raise ApiError(503, f"the request queue is full ({self.queue_limit} waiting)", None,
                               "server_busy", {"Retry-After": "1"})
            if job.session_name is not None:
                with self.sessions.lock:
                    if job.session_name in self.sessions.busy:
                        raise ApiError(409, f"session '{job.session_name}' is serving another request", "session")
                    self.sessions.busy.add(job.session_name)
            self.queue.append(job)
            self._cv.notify_all()
        self._gauge()
        return job

    def cancel(self, job: Job) -> None:
        job.cancelled = True
        with self._cv:
            self._cv.notify_all()

    @property
    def active(self) -> int:
        return sum(s.job is not None for s in self.slots)

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_depth.set(len(self.queue))
            self.metrics.slots_busy.set(self.active)

    # -- the loop ------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not self.queue and self.active == 0:
                    self._cv.wait(timeout=1.0)
                if self._stop:
                    break
            try:
                self._iteration()
            except Exception as e:  # noqa: BLE001 - a bug in one iteration fails its jobs, not the server
                for s in self.slots:
                    if s.job is not None:
                        self._fail(s, ApiError(500, f"engine loop error: {type(e).__name__}: {e}", None,
                                               "server_error"))
            self.outbox.flush()
        for s in self.slots:
            if s.job is not None:
                self._fail(s, ApiError(503, "the server is shutting down", None, "server_error"))
        self.outbox.flush()

    def _leave(self, now: float) -> None:
        for s in self.slots:  # before the step: gone clients, deadlines
            if s.job is not None:
                if s.job.cancelled:
                    self._release(s, keep=False)
                elif now > s.job.deadline:
                    self._fail(s, ApiError(504, "the request ran past its timeout", None, "timeout"))

    def _gather(self) -> None:
        """Leave, admit, and hold the step open for the batcher's window while a slot is free."""
        while True:
            now = time.monotonic()
            self._leave(now)
            self._admit(now)
            self._gauge()
            self.outbox.flush()  # refusals (deadlines, bad requests) before any wait
            ready = [s.ready_at for s in self.slots if s.job is not None]
            if not ready:
                return
            wait = self.batcher.wait_s(time.monotonic(), min(ready), sum(s.job is None for s in self.slots))
            if wait <= 0:
                return
            with self._cv:
                if self._stop:
                    return
                if not self.queue:
                    self._cv.wait(wait)  # a submit or a cancel wakes it early

    def _iteration(self) -> None:
        self._gather()
        # started, nothing prefilled in a step yet: prefilled in one call, after this step
        whole = [s for s in self.slots if s.prefilling and not s.history[s.cached:]
                 and self.backend.whole_prefill(s.history)]
        decoders = [s for s in self.slots if s.decoding]
        prefillers = sorted((s for s in self.slots if s.prefilling and s not in whole), key=lambda s: s.job.t_submit)
        items: list[tuple[Slot, list[int]]] = [(s, [int(s.next_token)]) for s in decoders]  # decoding: set
        for p, n in zip(prefillers, prompt_rows(len(decoders), [len(p.todo) for p in prefillers])):
            items.append((p, p.todo[:n]))
        if items:
            self._step(items)
            self.outbox.flush()  # the step's tokens go out before any whole-prompt prefill runs
        for s in whole:  # decode outranks prefill: the decoders' rows went first
            if s.prefilling:
                self._prefill_whole(s)
                self.outbox.flush()

    def _step(self, items: list[tuple[Slot, list[int]]]) -> None:
        results = self.backend.step([(s.session, toks) for s, toks in items])
        self.steps += 1
        done = time.monotonic()
        if self.metrics is not None:
            self.metrics.steps.inc()
            self.metrics.step_sequences.observe(len(items))
            self.metrics.step_rows.observe(sum(len(toks) for _, toks in items))
        for (s, toks), res in zip(items, results):
            s.ready_at = done
            if isinstance(res, BaseException):
                msg = str(res) if isinstance(res, MuserError) else f"{type(res).__name__}: {res}"
                self._fail(s, ApiError(500, f"the engine step failed: {msg}", None, "server_error"))
                continue
            s.history.extend(toks)
            if s.todo:
                if self.metrics is not None:
                    self.metrics.prefilled_tokens.inc(len(toks))
                del s.todo[: len(toks)]
                if s.todo:
                    continue
            try:
                self._advance(s, res)
            except Exception as e:  # noqa: BLE001 - this job fails, the others go on
                msg = str(e) if isinstance(e, MuserError) else f"{type(e).__name__}: {e}"
                self._fail(s, ApiError(500, f"sampling failed: {msg}", None, "server_error"))

    def _prefill_whole(self, s: Slot) -> None:
        todo = list(s.todo)
        try:
            logits, path, ran, restored = self.backend.prefill(s.session, todo, list(s.history))
        except Exception as e:  # noqa: BLE001 - a prefill that fails locally too fails only this job
            msg = str(e) if isinstance(e, MuserError) else f"{type(e).__name__}: {e}"
            self._fail(s, ApiError(500, f"the prefill failed: {msg}", None, "server_error"))
            return
        if self.metrics is not None:
            if path != "kvpack":
                self.metrics.prefills.labels(path).inc()
            self.metrics.prefilled_tokens.inc(ran)
            self.metrics.restored_tokens.inc(restored)
        if path == "local":
            log.warning("slot %d: prompt of %d tokens prefilled locally: %s", s.index, len(todo),
                        self.backend.remote.last.reason)
        s.history.extend(todo)
        s.todo = []
        s.ready_at = time.monotonic()
        try:
            self._advance(s, logits)
        except Exception as e:  # noqa: BLE001 - this job fails, the others go on
            msg = str(e) if isinstance(e, MuserError) else f"{type(e).__name__}: {e}"
            self._fail(s, ApiError(500, f"sampling failed: {msg}", None, "server_error"))

    def _admit(self, now: float) -> None:
        for s in self.slots:
            if s.job is not None:
                continue
            job = None
            with self._cv:
                while self.queue:
                    cand = self.queue.popleft()
                    if cand.cancelled:
                        self._unbusy(cand)
                        continue
                    job = cand
                    break
            if job is None:
                return
            if now > job.deadline:
                self._unbusy(job)
                self.outbox.put(job, Failed(ApiError(504, "the request timed out in the queue", None, "timeout")))
                continue
            try:
                self._start(s, job)
            except ApiError as e:
                self._fail(s, e)
            except MuserError as e:
                self._fail(s, ApiError(400, str(e), None))
            except Exception as e:  # noqa: BLE001 - e.g. no memory for a session: this job fails
                self._fail(s, ApiError(500, f"cannot start the request: {type(e).__name__}: {e}", None,
                                       "server_error"))

    def _start(self, s: Slot, job: Job) -> None:
        s.job = job
        s.emitter = job.emitter
        s.next_token = None
        s.history, s.cached, s.session = [], 0, None
        if job.session_name is not None:
            held = self.sessions.take(job.session_name)
            if held is not None:
                sess, toks = held
                n = len(toks)
                # reuse only when the new prompt extends what the cache holds, leaving >= 1 token to run
                if n < len(job.prompt) and job.prompt[:n] == toks:
                    s.session, s.history, s.cached = sess, list(toks), n
        if s.session is None and job.session_name is not None:
            s.session = self.backend.new_session()  # becomes the named session's own KV
        if s.session is None:
            s.own = self.backend.new_session() if s.own is None else self.backend.reset(s.own)
            s.session = s.own
        s.todo = list(job.prompt[s.cached:])
        s.ready_at = job.t_submit

    def _advance(self, s: Slot, logits: Any) -> None:
        job = s.job
        piece: GenEvent = s.emitter.step(logits)
        if job.t_first is None:
            job.t_first = time.monotonic()
            if self.metrics is not None:
                self.metrics.ttft.observe(job.t_first - job.t_submit)
        elif self.metrics is not None:
            self.metrics.itl.observe(time.monotonic() - job.t_last)
        job.t_last = time.monotonic()
        if self.metrics is not None:
            self.metrics.completion_tokens.inc()
        self.outbox.put(job, piece)
        if piece.finish_reason is None:
            s.next_token = piece.token
            return
        self.outbox.put(job, Done(piece.finish_reason, len(job.prompt), len(s.emitter.tokens), s.cached))
        self._release(s, keep=True)

    def _fail(self, s: Slot, err: ApiError) -> None:
        self.outbox.put(s.job, Failed(err))
        self._release(s, keep=False)

    def _unbusy(self, job: Job) -> None:
        if job.session_name is not None:
            with self.sessions.lock:
                self.sessions.busy.discard(job.session_name)

    def _release(self, s: Slot, keep: bool) -> None:
        job = s.job
        if job.session_name is not None and keep and not s.todo:
            self.sessions.put(job.session_name, s.session, list(s.history))
        self._unbusy(job)
        s.job, s.session, s.emitter, s.todo, s.next_token, s.history = None, None, None, [], None, []
        self._gauge()
