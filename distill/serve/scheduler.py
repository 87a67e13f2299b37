"""The request queue and the one worker thread that runs the engine.

Terms
-----
sequence
    one completion choice: a prompt's token ids, its sampling parameters and a
    :class:`~distill.serve.text.StreamDecoder`. An HTTP request holds one or more
    (``n`` choices, or several prompts for ``/v1/completions``).
job
    the sequences of one HTTP request plus the asyncio queue its handler reads
    events from. Events are pushed from the worker thread with
    ``loop.call_soon_threadsafe``; the handler never touches the engine.
waiting queue
    sequences admitted but not yet handed to the engine, bounded by ``queue_size``:
    a job whose sequences do not all fit is refused whole (:class:`QueueFull`, HTTP 503).
worker
    the one thread that calls the engine: a thread of its own (:meth:`Scheduler.start`)
    or the caller's (:meth:`Scheduler.run`). ``distill serve`` runs it on the process's
    main thread and uvicorn on a second one: with the GNU OpenMP runtime (torch's on
    Linux), a second thread that runs torch ops gets a second OpenMP pool, and once
    the pools' threads outnumber the cores every pool's idle threads sleep instead of
    spinning; each small op then waits for its threads to wake, and a decoding step on
    a 2-core CPU was a third slower (BENCHMARKS.md, "Serving").
batch
    the sequences decoding together, at most ``max_batch``: the engine's
    :class:`~distill.engine.engine.RunningBatch` (continuous batching). Between two
    decoding steps the worker moves waiting sequences into free rows (their prompts
    are prefilled in one forward and join the batch) and a finished sequence leaves
    at once, so a new request never waits for a whole batch to end. Only the worker
    calls the engine.
cancel
    a client that disconnects sets its job's ``cancelled`` event; the engine
    learns it from ``on_tokens`` returning False at its next step. A stop string
    ends a sequence the same way.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from distill.serve.text import StreamDecoder

log = logging.getLogger("distill.serve")


class QueueFull(Exception):
    """The waiting queue cannot take the job's sequences (HTTP 503)."""


class ShuttingDown(Exception):
    """The server is stopping and takes no new work (HTTP 503)."""


# -- events sent to a job's handler ----------------------------------------------------
@dataclass
class Delta:
    index: int
    text: str


@dataclass
class Done:
    index: int
    finish_reason: str  # stop | length | abort
    prompt_tokens: int
    completion_tokens: int


@dataclass
class Failed:
    message: str
    status: int = 500


@dataclass
class Sequence:
    index: int  # the choice index within its job
    prompt_ids: list[int]
    params: Any  # distill.engine.SamplingParams
    decoder: StreamDecoder
    job: "Job" = field(repr=False, default=None)
    finished: bool = False
    finish_reason: str | None = None

    def emit(self, event) -> None:
        self.job.push(event)

    def finish(self, reason: str) -> None:
        if self.finished:
            return
        self.finished = True
        self.finish_reason = reason
        tail = self.decoder.finish()
        if tail:
            self.emit(Delta(self.index, tail))
        self.emit(Done(self.index, reason, len(self.prompt_ids), len(self.decoder.ids)))


class Job:
    """One HTTP request's sequences and the event queue its handler awaits."""

    def __init__(self, sequences: list[Sequence], loop: asyncio.AbstractEventLoop, prompt_tokens: int = 0):
        self.sequences = sequences
        self.prompt_tokens = prompt_tokens  # of the job's distinct prompts (usage)
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.arrived = time.monotonic()
        for s in sequences:
            s.job = self

    def push(self, event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self.cancelled.set()

    def cancel(self) -> None:
        self.cancelled.set()


class Scheduler:
    """A bounded waiting queue and one worker that batches sequences through the engine.

    The worker is :meth:`start` (a thread of its own) or :meth:`run` (the calling thread,
    until :meth:`stop`); one of the two, once.
    """

    def __init__(self, engine, *, queue_size: int, max_batch: int, speculative: bool, metrics=None):
        self.engine = engine
        self.queue_size = queue_size
        self.max_batch = max_batch
        self.speculative = speculative
        self.metrics = metrics
        self._waiting: deque[Sequence] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._worker: int | None = None  # ident of the thread running the loop
        self._done = threading.Event()  # set when the worker loop has returned
        self.error: str | None = None  # set when the worker died

    def start(self) -> None:
        """Run the worker on a thread of its own."""
        self._claim()
        self._thread = threading.Thread(target=self._loop, name="distill-engine", daemon=True)
        self._thread.start()

    def run(self) -> None:
        """Run the worker on the calling thread until :meth:`stop` (or its death, which is recorded, not raised)."""
        self._claim()
        try:
            self._loop()
        except BaseException:  # noqa: BLE001 - already recorded in self.error and logged
            pass

    def _claim(self) -> None:
        with self._cond:
            if self._worker is not None or self._thread is not None:
                raise RuntimeError("the scheduler's worker is already running")
            self._worker = -1  # claimed; the loop sets its thread's ident

    # -- called from the event loop ------------------------------------------------------
    @property
    def alive(self) -> bool:
        return not self._stopping and self.error is None

    def submit(self, job: Job) -> None:
        """Admit all of the job's sequences or none (raises QueueFull / ShuttingDown)."""
        with self._cond:
            if self._stopping:
                raise ShuttingDown("the server is shutting down")
            if len(self._waiting) + len(job.sequences) > self.queue_size:
                raise QueueFull(f"the request queue is full ({self.queue_size} waiting); retry later")
            self._waiting.extend(job.sequences)
            self._gauge()
            self._cond.notify()

    def stop(self, timeout: float = 30.0) -> None:
        """Refuse new work, fail waiting sequences, cancel running ones, and wait for the worker to return."""
        with self._cond:
            self._stopping = True
            waiting, self._waiting = list(self._waiting), deque()
            self._cond.notify_all()
            started = self._worker is not None
        for s in waiting:
            s.emit(Failed("the server is shutting down", 503))
        if started and threading.get_ident() != self._worker:
            self._done.wait(timeout)

    # -- the worker thread -----------------------------------------------------------------
    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_depth.set(len(self._waiting))

    def _admit(self, running: int) -> list[Sequence] | None:
        """Waiting sequences that fit beside ``running`` rows (blocks while both are empty); None: stop."""
        with self._cond:
            while not self._waiting and not running and not self._stopping:
                self._cond.wait()
            if self._stopping:
                return None
            new: list[Sequence] = []
            while self._waiting and running + len(new) < self.max_batch:
                s = self._waiting.popleft()
                if s.job.cancelled.is_set():
                    s.finished, s.finish_reason = True, "abort"  # nobody listens; drop it
                    if self.metrics is not None:
                        self.metrics.sequences.labels("abort").inc()
                    continue
                new.append(s)
            self._gauge()
            return new

    def _loop(self) -> None:
        self._worker = threading.get_ident()
        batch = self.engine.running_batch(self.speculative, self._on_tokens)
        try:
            while (new := self._admit(len(batch))) is not None:
                if new:
                    self._join(batch, new)
                if len(batch):
                    self._step(batch)
            for key in batch.clear():  # stopping: the rows still decoding end here
                self._finish(key, [], "cancelled")
        except BaseException as exc:  # noqa: BLE001 - a dead worker must be visible on /health
            self.error = f"{type(exc).__name__}: {exc}"
            log.exception("engine worker died")
            with self._cond:
                self._stopping = True
                waiting, self._waiting = list(self._waiting), deque()
            for s in waiting + batch.clear():
                s.emit(Failed(f"engine failed: {self.error}"))
            raise
        finally:
            self._done.set()

    def _on_tokens(self, s: Sequence, new_ids: list[int]) -> bool:
        """The engine's callback (worker thread): stream the text; False ends the sequence."""
        if s.finished or s.job.cancelled.is_set() or self._stopping:
            return False
        delta = s.decoder.add(new_ids)
        if delta.text:
            s.emit(Delta(s.index, delta.text))
        if delta.stopped:
            s.finish("stop")
            return False
        return True

    def _join(self, batch, new: list[Sequence]) -> None:
        """Prefill the newcomers and add them to the running batch (continuous batching)."""
        try:
            done = batch.add([s.prompt_ids for s in new], [s.params for s in new], new)
        except Exception as exc:  # noqa: BLE001 - a failed prefill fails its own sequences only
            log.exception("prefill failed")
            self._fail(new, exc)
            return
        self._report(batch, done)

    def _step(self, batch) -> None:
        if self.metrics is not None:
            self.metrics.batch_size.observe(len(batch))
        try:
            done = batch.step()
        except Exception as exc:  # noqa: BLE001 - one failed step must not kill the server
            log.exception("decoding step failed")
            self._fail(batch.clear(), exc)
            return
        self._report(batch, done)

    def _fail(self, seqs: list[Sequence], exc: Exception) -> None:
        for s in seqs:
            if not s.finished:
                s.finished = True
                s.emit(Failed(f"generation failed: {type(exc).__name__}: {exc}"))

    def _report(self, batch, done: list) -> None:
        """Finish the sequences that left the batch; move the batch's step figures into the metrics."""
        for s, r in done:
            self._finish(s, r.token_ids, r.finish_reason, r.accepted)
        stats, batch.stats = batch.stats, type(batch.stats)()
        m = self.metrics
        if m is None:
            return
        for sec in stats.step_seconds:
            m.step_latency.observe(sec)
        for n in stats.tree_nodes_per_step:
            m.tree_nodes.observe(n)
        if stats.prefill_seconds:
            m.prefill_latency.observe(stats.prefill_seconds)
        if getattr(self.engine, "policy", None) is not None:
            m.acceptance_ratio.set(self.engine.policy.acceptance_ratio)
        m.running.set(len(batch))

    def _finish(self, s: Sequence, token_ids: list[int], reason: str, accepted: list[int] = ()) -> None:
        if not s.finished:
            seen = len(s.decoder.ids)
            rest = list(token_ids[seen:]) if list(token_ids[:seen]) == s.decoder.ids else []
            if rest:  # tokens the engine did not report through on_tokens
                delta = s.decoder.add(rest)
                if delta.text:
                    s.emit(Delta(s.index, delta.text))
                if delta.stopped:
                    reason = "stop"
            s.finish({"stop": "stop", "length": "length"}.get(reason, "abort"))
        m = self.metrics
        if m is not None:
            for n in accepted:
                m.tokens_per_step.observe(n)
            m.sequences.labels(s.finish_reason or "abort").inc()
            m.generation_tokens.inc(len(s.decoder.ids))
