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
    spinning; each small op then waits for its threads to wake, and a decoding step
    slows down markedly. Measured: BENCHMARKS.md, "Serving".
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
isolation
    one request's failure fails that request alone. A prefill that raises is retried
    one sequence at a time, so only a sequence whose own prefill raises is failed. A
    decoding step that raises drops the batch's rows; each of them is then prefilled
    again alone, from its prompt plus the tokens it already streamed (recomputation:
    nothing is sent twice), and runs one step alone: a sequence whose solo prefill or
    step raises is failed, the others go back to the front of the waiting queue and
    join the next batch.
drain
    graceful shutdown (:meth:`Scheduler.drain`): new jobs are refused (503) while
    admitted ones go on decoding until they end or the grace period runs out; then
    what is left is failed with a 503 "shutting down" error, and the worker returns.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from distill.errors import ConfigError
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
    logprobs: list | None = None  # TokenLogprob of the tokens that arrived with this text (when asked for)
    prompt_logprobs: list | None = None  # the prompt's (first delta only, when asked for: echo)


@dataclass
class Done:
    index: int
    finish_reason: str  # stop | length | abort
    prompt_tokens: int
    completion_tokens: int


@dataclass
class Failed:
    message: str
    status: int = 500  # the HTTP status the request gets (503: the server is shutting down)


SHUTTING_DOWN = "the server is shutting down"


@dataclass
class Sequence:
    index: int  # the choice index within its job: prompt * n + choice
    prompt_ids: list[int]
    params: Any  # distill.engine.SamplingParams
    decoder: StreamDecoder
    job: "Job" = field(repr=False, default=None)
    finished: bool = False
    finish_reason: str | None = None
    resumed: int = 0  # decoder tokens already streamed when the engine last prefilled it (recomputation)
    scheduled_at: float | None = None  # monotonic times (the metrics): taken into the batch, first and last token
    first_token_at: float | None = None
    last_token_at: float | None = None
    prefill_tokens: int = 0  # tokens its prefills computed (a re-prefill after a preemption computes its tokens again)
    preemptions: int = 0
    n: int = 1  # choices per prompt (the request's n): this sequence's siblings are the job's others of its prompt

    def siblings(self) -> list["Sequence"]:
        """The job's sequences of this sequence's prompt (itself included)."""
        return [t for t in self.job.sequences if t.index // self.n == self.index // self.n]

    def engine_input(self) -> tuple[list[int], Any]:
        """Prompt ids and sampling parameters for a (re)prefill: after a failed step, the tokens
        already streamed extend the prompt and shorten ``max_tokens``."""
        done = list(self.decoder.ids)
        self.resumed = len(done)
        if not done:
            return self.prompt_ids, self.params
        return self.prompt_ids + done, dataclasses.replace(self.params, max_tokens=self.params.max_tokens - len(done))

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
    until :meth:`stop`, or until a :meth:`drain` ends); one of the two, once.
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
        self._drain_deadline: float | None = None  # set by drain(): monotonic time the grace period ends
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
        """Run the worker on the calling thread until :meth:`stop`, the end of a :meth:`drain`, or its death
        (recorded in ``error`` and logged, not raised)."""
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

    # -- called from the event loop (or a signal handler) ------------------------------------
    @property
    def alive(self) -> bool:
        """Taking new work: not stopping, not draining, worker not dead."""
        return not self._stopping and self._drain_deadline is None and self.error is None

    @property
    def draining(self) -> bool:
        return self._drain_deadline is not None

    def submit(self, job: Job) -> None:
        """Admit all of the job's sequences or none (raises QueueFull / ShuttingDown)."""
        with self._cond:
            if self._stopping or self._drain_deadline is not None:
                raise ShuttingDown(SHUTTING_DOWN)
            if len(self._waiting) + len(job.sequences) > self.queue_size:
                raise QueueFull(f"the request queue is full ({self.queue_size} waiting); retry later")
            self._waiting.extend(job.sequences)
            self._gauge()
            self._cond.notify()

    def drain(self, grace: float) -> None:
        """Refuse new work; admitted sequences go on for up to ``grace`` seconds, then those left are
        failed (503); the worker returns once nothing is waiting or running. Safe in a signal handler."""
        with self._cond:
            if self._drain_deadline is None:
                self._drain_deadline = time.monotonic() + grace
            self._cond.notify_all()

    def stop(self, timeout: float = 30.0) -> None:
        """Refuse new work, fail what is waiting or running (503), and wait for the worker to return."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            started = self._worker is not None
        if not started:
            with self._cond:
                waiting, self._waiting = list(self._waiting), deque()
            self._fail(waiting, SHUTTING_DOWN, 503)
        elif threading.get_ident() != self._worker:
            self._done.wait(timeout)

    # -- the worker thread -----------------------------------------------------------------
    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_depth.set(len(self._waiting))
            self.metrics.vllm.waiting.set(len(self._waiting))
            self.metrics.vllm.waiting_capacity.set(len(self._waiting))

    def _ending(self, running: int) -> bool:
        """(holding the lock) Whether the loop must end now: stopped, or drained (idle or out of time)."""
        if self._stopping:
            return True
        if self._drain_deadline is None:
            return False
        return (not self._waiting and not running) or time.monotonic() >= self._drain_deadline

    def _admit(self, running: int) -> list[Sequence] | None:
        """Waiting sequences that fit beside ``running`` rows (blocks while both are empty); None: end the loop."""
        with self._cond:
            while not self._waiting and not running and not self._ending(running):
                self._cond.wait()
            if self._ending(running):
                return None
            new: list[Sequence] = []
            now = time.monotonic()
            while self._waiting and running + len(new) < self.max_batch:
                s = self._waiting.popleft()
                if s.job.cancelled.is_set():
                    self._end(s, "abort")  # nobody listens: its handler only waits for the end
                    continue
                if s.scheduled_at is None:  # a row put back after a failed step keeps its first time
                    s.scheduled_at = now
                new.append(s)
            self._gauge()
            return new

    def _loop(self) -> None:
        self._worker = threading.get_ident()
        batch = self.engine.running_batch(self.speculative, self._on_tokens)
        try:
            while (new := self._admit(len(batch))) is not None:
                if new and not len(batch):
                    self._join(batch, new)
                elif len(batch):
                    self._step(batch, new)  # the newcomers are prefilled in the step and join it
            with self._cond:  # stopped or drained: what is left ends here
                waiting, self._waiting = list(self._waiting), deque()
                self._stopping = True
                self._gauge()
            self._fail(waiting + batch.clear(), SHUTTING_DOWN, 503)
            self._report(batch, [])
        except BaseException as exc:  # noqa: BLE001 - a dead worker must be visible on /health
            self.error = f"{type(exc).__name__}: {exc}"
            log.exception("engine worker died")
            with self._cond:
                self._stopping = True
                waiting, self._waiting = list(self._waiting), deque()
            self._fail(waiting + batch.clear(), f"engine failed: {self.error}")
            raise
        finally:
            self._done.set()

    def _on_tokens(self, s: Sequence, new_ids: list[int], logprobs: list | None = None, prompt_logprobs: list | None = None) -> bool:
        """The engine's callback (worker thread): stream the text (and the tokens' logprobs, when asked for);
        False ends the sequence."""
        if s.finished or s.job.cancelled.is_set():
            return False
        before = len(s.decoder.ids)
        delta = s.decoder.add(new_ids)
        self._tokens(s, len(s.decoder.ids) - before)
        if logprobs is not None:
            logprobs = logprobs[: len(s.decoder.ids) - before]  # not past a stop string
        if delta.text or logprobs or prompt_logprobs:
            s.emit(Delta(s.index, delta.text, logprobs, prompt_logprobs))
        if delta.stopped:
            self._end(s, "stop")
            return False
        return True

    def _tokens(self, s: Sequence, n: int) -> None:
        """The sequence gained ``n`` tokens in one step (its first ones: the prefill's): the token metrics."""
        now = time.monotonic()
        m = self.metrics
        if m is not None and n:
            m.vllm.generation_tokens.inc(n)
            if s.first_token_at is not None:
                m.vllm.itl.observe(now - s.last_token_at)
        if s.first_token_at is None:
            s.first_token_at = now
            if m is not None:
                m.vllm.ttft.observe(now - s.job.arrived)
                m.vllm.prompt_tokens.inc(len(s.prompt_ids))
        s.last_token_at = now

    def _end(self, s: Sequence, reason: str) -> None:
        """End the sequence with ``reason``: its metrics first, then its Done event (so that a scrape after its answer sees it)."""
        if s.finished:
            return
        m = self.metrics
        if m is not None:
            if s.first_token_at is None and reason in ("stop", "length"):  # it ended at its first token (a stop token)
                self._tokens(s, 0)
            m.sequences.labels(reason).inc()
            m.generation_tokens.inc(len(s.decoder.ids))
            m.vllm.finished(reason, s, time.monotonic())
            siblings = s.siblings()  # the parent request's too, when this is its last choice (before the answer can go out)
            if all(t.finished or t is s for t in siblings):
                m.vllm.parent_finished(s.n, max(len(t.decoder.ids) for t in siblings))
        s.finish(reason)

    def _add(self, batch, seqs: list[Sequence], step: bool = False) -> list:
        """Prefill ``seqs`` into ``batch``; ``step``: inside a decoding step of its running rows (which they join)."""
        inputs = [s.engine_input() for s in seqs]
        prompts, params = [ids for ids, _ in inputs], [p for _, p in inputs]
        done = batch.step(prompts, params, seqs) if step else batch.add(prompts, params, seqs)
        for s, (ids, _) in zip(seqs, inputs):
            s.prefill_tokens += len(ids)
        return done

    def _join(self, batch, new: list[Sequence]) -> None:
        """Prefill the newcomers and add them to the running batch (continuous batching).

        A prefill that raises adds nothing; it is retried one sequence at a time, so that only
        a sequence whose own prefill raises is failed ("isolation")."""
        try:
            done = self._add(batch, new)
        except Exception as exc:  # noqa: BLE001 - a failed prefill fails its own sequences only
            if len(new) == 1:
                log.exception("prefill failed")
                self._fail(new, *_failure(exc))
                return
            log.warning("a prefill of %d sequences failed (%s: %s): retrying them one at a time", len(new), type(exc).__name__, exc)
            done = []
            for s in new:
                if s.finished:  # already ended (e.g. a stop string in the failed prefill's first token)
                    continue
                try:
                    done += self._add(batch, [s])
                except Exception as one:  # noqa: BLE001
                    log.exception("prefill failed")
                    self._fail([s], *_failure(one))
        self._report(batch, done)

    def _step(self, batch, new: list[Sequence] = ()) -> None:
        """One decoding step of the running rows, which ``new`` join (prefilled in it)."""
        if self.metrics is not None:
            self.metrics.batch_size.observe(len(batch))
        try:
            done = self._add(batch, list(new), step=True)
        except Exception as exc:  # noqa: BLE001 - one failed step must not kill the server, nor fail every row
            rows = batch.clear()
            new = [s for s in new if s not in rows]  # those that had not joined yet
            if len(rows) + len(new) == 1:
                log.exception("decoding step failed")
                self._fail(rows + new, *_failure(exc))
            else:
                log.warning("a decoding step of %d sequences (%d joining) failed (%s: %s): stepping each alone",
                            len(rows) + len(new), len(new), type(exc).__name__, exc)
                self._isolate(batch, rows, new)
            self._report(batch, [])
            return
        self._report(batch, done)

    def _isolate(self, batch, rows: list[Sequence], fresh: list[Sequence] = ()) -> None:
        """After a failed step (``batch`` now empty): prefill and step each row alone (``rows``, then the ``fresh`` ones
        that were joining it); fail those that raise, put the others back at the front of the waiting queue (their order
        kept; only ``rows`` count as preempted)."""
        survivors: list[Sequence] = []
        for s in [*rows, *fresh]:
            if s.finished:
                continue
            try:
                done = self._add(batch, [s])
                if len(batch):
                    done += batch.step()
            except Exception as exc:  # noqa: BLE001 - this sequence's own failure
                log.exception("decoding step failed")
                batch.clear()
                self._fail([s], *_failure(exc))
                continue
            self._report(batch, done)
            survivors += batch.clear()
        preempted = [s for s in survivors if s not in fresh]
        for s in preempted:
            s.preemptions += 1
        if self.metrics is not None:
            self.metrics.vllm.preemptions.inc(len(preempted))
        with self._cond:
            self._waiting.extendleft(reversed(survivors))
            self._gauge()

    def _fail(self, seqs: list[Sequence], message: str, status: int = 500) -> None:
        for s in seqs:
            if not s.finished:
                if self.metrics is not None:
                    self.metrics.sequences.labels("error").inc()
                    self.metrics.vllm.finished("error", s, time.monotonic())
                s.finished, s.finish_reason = True, "error"
                s.emit(Failed(message, status))

    def _report(self, batch, done: list) -> None:
        """Move the batch's step figures into the metrics, then finish the sequences that left the batch
        (in that order: a scrape after an answer ends sees the steps that made it)."""
        stats, batch.stats = batch.stats, type(batch.stats)()
        m = self.metrics
        if m is not None:
            for sec in stats.step_seconds:
                m.step_latency.observe(sec)
            for n in stats.tree_nodes_per_step:
                m.tree_nodes.observe(n)
            for n in stats.prefill_tokens:  # a prefill forward: the prompts' tokens and a first token each
                m.vllm.iteration_tokens.observe(n)
            for drafted, accepted, joined in zip(stats.drafted_per_step, stats.accepted_per_step, stats.joined_per_step):
                m.vllm.step(drafted, accepted)
                m.vllm.iteration_tokens.observe(sum(a + 1 for a in accepted) + joined)
            if stats.prefill_seconds:
                m.prefill_latency.observe(stats.prefill_seconds)
            if getattr(self.engine, "policy", None) is not None:
                m.acceptance_ratio.set(self.engine.policy.acceptance_ratio)
            m.running.set(len(batch))
            m.vllm.running.set(len(batch))
            used, allocated = batch.kv_slots
            m.vllm.kv_usage.set(used / allocated if allocated else 0.0)
        for s, r in done:
            self._finish(s, r.token_ids, r.finish_reason, r.accepted)

    def _finish(self, s: Sequence, token_ids: list[int], reason: str, accepted: list[int] = ()) -> None:
        if self.metrics is not None:
            for n in accepted:
                self.metrics.tokens_per_step.observe(n)
        if not s.finished:
            produced = s.decoder.ids[s.resumed:]  # what this prefill's tokens streamed so far
            seen = len(produced)
            rest = list(token_ids[seen:]) if list(token_ids[:seen]) == produced else []
            if rest:  # tokens the engine did not report through on_tokens
                before = len(s.decoder.ids)
                delta = s.decoder.add(rest)
                self._tokens(s, len(s.decoder.ids) - before)
                if delta.text:
                    s.emit(Delta(s.index, delta.text))
                if delta.stopped:
                    reason = "stop"
            self._end(s, {"stop": "stop", "length": "length"}.get(reason, "abort"))


def _failure(exc: Exception) -> tuple[str, int]:
    """A request's own failure in the engine -> (message, HTTP status): 400 for the engine's refusal of
    its input (a ConfigError), 500 otherwise."""
    if isinstance(exc, ConfigError):
        return f"the engine refused this request: {exc}", 400
    return f"generation failed: {type(exc).__name__}: {exc}", 500
