"""The server's scheduler in-process on the real engine: continuous batching, a failed step, a dead worker."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from distill.engine import Engine, EngineConfig, SamplingParams
from distill.serve.scheduler import Delta, Done, Failed, Job, Scheduler, Sequence
from distill.serve.text import StreamDecoder


@pytest.fixture(scope="module")
def engine(hf_model, model_dir):
    from transformers import AutoTokenizer

    return Engine(hf_model, AutoTokenizer.from_pretrained(model_dir), None, EngineConfig(max_batch=2))


def job_of(engine, loop, text: str, max_tokens: int) -> Job:
    tok = engine.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                                  return_dict=True)["input_ids"]
    seq = Sequence(0, list(ids), SamplingParams(max_tokens=max_tokens), StreamDecoder(tok, []))
    return Job([seq], loop)


async def events_until_end(job: Job) -> list:
    out = []
    while not out or not isinstance(out[-1], (Done, Failed)):
        out.append(await asyncio.wait_for(job.events.get(), 300))
    return out


def test_a_failed_step_fails_its_rows_and_the_worker_serves_the_next_request(engine):
    """A decoding step that raises ends the running sequences with an error event; the worker lives on."""

    async def scenario():
        loop = asyncio.get_running_loop()
        sched = Scheduler(engine, queue_size=4, max_batch=2, speculative=False)
        batch_step = None
        real = engine.running_batch

        def running_batch(*a, **kw):  # the worker's batch, with its third step failing once
            nonlocal batch_step
            batch = real(*a, **kw)
            step, calls = batch.step, []

            def flaky(*joining):
                calls.append(1)
                if len(calls) == 3:
                    raise RuntimeError("injected step failure")
                return step(*joining)

            batch.step = flaky
            batch_step = calls
            return batch

        engine.running_batch = running_batch
        try:
            sched.start()
            first = job_of(engine, loop, "Tell me a long story.", 32)
            sched.submit(first)
            ev1 = await events_until_end(first)
            second = job_of(engine, loop, "What is 2 + 2?", 6)
            sched.submit(second)
            ev2 = await events_until_end(second)
        finally:
            del engine.running_batch
            sched.stop()
        return ev1, ev2, batch_step

    ev1, ev2, calls = asyncio.run(scenario())
    assert isinstance(ev1[-1], Failed) and "injected step failure" in ev1[-1].message
    assert any(isinstance(e, Delta) for e in ev1)  # it had streamed before the failure
    assert isinstance(ev2[-1], Done) and ev2[-1].finish_reason in ("stop", "length") and ev2[-1].completion_tokens > 0
    assert len(calls) > 3  # the same worker and batch went on stepping after the failure


def greedy_answer(engine, text: str, max_tokens: int) -> tuple[str, int]:
    """The engine's own plain greedy answer, alone (the reference a greedy request must equal)."""
    tok = engine.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                                  return_dict=True)["input_ids"]
    (res,), _ = engine.generate([list(ids)], [SamplingParams(max_tokens=max_tokens)], speculative=False)
    return tok.decode(res.token_ids, skip_special_tokens=True), len(res.token_ids)


def text_of(events: list) -> str:
    return "".join(e.text for e in events if isinstance(e, Delta))


GOOD = ["What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea."]


def test_a_sequence_whose_prefill_raises_fails_alone_and_its_batch_mates_finish(engine):
    """Six requests admitted in one prefill, one with a seed the engine's generator cannot take (no API
    validation in between): the engine raises for the whole prefill; the bad request fails alone and the
    other five get exactly their greedy answers."""
    questions = GOOD + ["How many legs does a spider have?", "What is 12 times 12?"]

    async def scenario():
        loop = asyncio.get_running_loop()
        sched = Scheduler(engine, queue_size=8, max_batch=6, speculative=False)
        prefills = []  # the sequences of each prefill the worker's batch runs
        real = engine.running_batch

        def running_batch(*a, **kw):
            batch = real(*a, **kw)
            add = batch.add

            def counted(prompts, params, keys):
                prefills.append(len(prompts))
                return add(prompts, params, keys)

            batch.add = counted
            return batch

        engine.running_batch = running_batch
        jobs = [job_of(engine, loop, q, 12) for q in questions]
        bad = job_of(engine, loop, "Tell me a joke.", 12)
        bad.sequences[0].params = SamplingParams(max_tokens=12, temperature=0.7, seed=2**70)
        for job in (*jobs[:2], bad, *jobs[2:]):  # all waiting before the worker starts: one prefill
            sched.submit(job)
        sched.start()
        try:
            return [await events_until_end(j) for j in jobs], await events_until_end(bad), prefills
        finally:
            del engine.running_batch
            sched.stop()

    good, bad, prefills = asyncio.run(scenario())
    assert prefills == [6] + [1] * 6  # the six together, then each alone after that prefill raised
    assert isinstance(bad[-1], Failed) and bad[-1].status == 500 and "Overflow" in bad[-1].message
    for q, events in zip(questions, good):
        assert isinstance(events[-1], Done) and events[-1].finish_reason in ("stop", "length")
        assert (text_of(events), events[-1].completion_tokens) == greedy_answer(engine, q, 12)


def test_a_sequence_whose_step_raises_fails_alone_and_the_others_resume_unchanged(engine):
    """A decoding step raises because of one row (a fault injected in the engine's acceptance, tied to that
    row's seed): the scheduler steps each row alone, fails that request only, and the other rows, prefilled
    again from their prompt plus what they had streamed, end with exactly their greedy answers."""
    marked = 4242

    async def scenario():
        loop = asyncio.get_running_loop()
        sched = Scheduler(engine, queue_size=8, max_batch=4, speculative=False)
        jobs = [job_of(engine, loop, q, 16) for q in GOOD]
        bad = job_of(engine, loop, "Tell me a joke.", 16)
        bad.sequences[0].params = SamplingParams(max_tokens=16, temperature=0.7, seed=marked)
        real = engine.decoding.accept

        def accept(tokens, logits, buf, seqs, *rest):  # the marked row breaks any step after its third token
            if any(s.params.seed == marked and (len(s.tokens) >= 3 or s.params.max_tokens < 16) for s in seqs):
                raise RuntimeError("injected failure of one row")
            return real(tokens, logits, buf, seqs, *rest)

        engine.decoding.accept = accept
        try:
            for job in (jobs[0], bad, *jobs[1:]):
                sched.submit(job)
            sched.start()
            return [await events_until_end(j) for j in jobs], await events_until_end(bad)
        finally:
            del engine.decoding.accept
            sched.stop()

    good, bad = asyncio.run(scenario())
    assert isinstance(bad[-1], Failed) and "injected failure of one row" in bad[-1].message
    assert any(isinstance(e, Delta) for e in bad)  # it had streamed: the failure came in a step, not the prefill
    for q, events in zip(GOOD, good):
        assert isinstance(events[-1], Done) and events[-1].finish_reason in ("stop", "length")
        assert (text_of(events), events[-1].completion_tokens) == greedy_answer(engine, q, 16)


def test_a_step_that_raises_while_a_request_joins_it_retries_both_and_only_the_running_one_is_preempted(engine):
    """A newcomer joins the running batch inside a decoding step (prefilled in its forward); that step raises once: the
    running request and the newcomer are each stepped alone and put back, and both end with exactly their greedy
    answers; only the running one counts as preempted."""

    async def scenario():
        loop = asyncio.get_running_loop()
        sched = Scheduler(engine, queue_size=4, max_batch=2, speculative=False)
        joins = []  # the sequences that joined each step that took newcomers
        real = engine.running_batch

        def running_batch(*a, **kw):
            batch = real(*a, **kw)
            step = batch.step

            def flaky(prompts=(), params=(), keys=()):
                if prompts:
                    joins.append(list(keys))
                    if len(joins) == 1:
                        raise RuntimeError("injected failure of a joining step")
                return step(prompts, params, keys)

            batch.step = flaky
            return batch

        engine.running_batch = running_batch
        running, joining = job_of(engine, loop, GOOD[2], 24), job_of(engine, loop, GOOD[0], 12)
        try:
            sched.start()
            sched.submit(running)
            events = [await asyncio.wait_for(running.events.get(), 300)]  # it streams: it runs
            sched.submit(joining)
            events += await events_until_end(running)
            return events, await events_until_end(joining), joins, running.sequences[0], joining.sequences[0]
        finally:
            del engine.running_batch
            sched.stop()

    first, second, joins, s1, s2 = asyncio.run(scenario())
    assert joins and joins[0] == [s2]  # the newcomer joined a step, which raised
    assert (text_of(first), first[-1].completion_tokens) == greedy_answer(engine, GOOD[2], 24)
    assert (text_of(second), second[-1].completion_tokens) == greedy_answer(engine, GOOD[0], 12)
    assert (s1.preemptions, s2.preemptions) == (1, 0)


def test_drain_refuses_new_jobs_and_fails_what_outlives_the_grace_period(engine):
    """drain(0): the request already admitted ends with a 503 "shutting down" event, a new one is refused,
    and the worker returns by itself."""
    from distill.serve.scheduler import ShuttingDown

    async def scenario():
        loop = asyncio.get_running_loop()
        sched = Scheduler(engine, queue_size=8, max_batch=4, speculative=False)
        sched.start()
        long = job_of(engine, loop, "Tell me a very long story.", 2000)
        sched.submit(long)
        first = await asyncio.wait_for(long.events.get(), 300)  # decoding
        sched.drain(0)
        with pytest.raises(ShuttingDown):
            sched.submit(job_of(engine, loop, "Hi!", 4))
        rest = await events_until_end(long)
        assert await asyncio.to_thread(sched._done.wait, 60)
        return [first, *rest], sched

    events, sched = asyncio.run(scenario())
    assert isinstance(events[-1], Failed) and events[-1].status == 503 and "shutting down" in events[-1].message
    assert not sched.alive and sched.error is None


class EngineDied(BaseException):
    """Not an Exception: what the worker cannot isolate to one request (it stands for the engine thread's death)."""


def test_serve_exits_1_with_the_error_logged_when_its_engine_worker_dies(engine, model_dir, monkeypatch, caplog, capsys):
    """`distill serve` on this engine, with a decoding step that kills the worker: the request in flight gets a 500
    naming the error, the error is logged with its traceback, and serve ends with exit code 1."""
    import httpx

    from conftest import free_port
    from distill.models import stop_token_ids
    from distill.serve import server
    from distill.serve.app import AppSettings, create_app
    from distill.serve.config import ServeConfig

    real = engine.running_batch

    def running_batch(*a, **kw):
        batch = real(*a, **kw)

        def dying_step(*joining):
            raise EngineDied("injected engine death")

        batch.step = dying_step
        return batch

    settings = AppSettings(model_name="smol", max_model_len=engine.max_len, max_batch=2,
                           stop_token_ids=tuple(sorted(stop_token_ids(engine.tokenizer, model_dir))))
    monkeypatch.setattr(server, "build_app", lambda cfg, worker_thread=True: (create_app(engine, settings, worker_thread), settings))
    port = free_port()
    replies = []

    def client() -> None:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                httpx.get(f"{url}/health", timeout=5)
                break
            except httpx.TransportError:
                time.sleep(0.1)
        replies.append(httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "model": "smol", "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 4}))

    engine.running_batch = running_batch
    thread = threading.Thread(target=client, daemon=True)
    try:
        thread.start()
        with pytest.raises(SystemExit) as exited, caplog.at_level("ERROR", logger="distill.serve"):
            server.serve(ServeConfig.from_options(port=port), log_level="warning")
    finally:
        del engine.running_batch
        thread.join(60)
    assert exited.value.code == 1
    assert "distill serve: the engine worker died: EngineDied: injected engine death" in capsys.readouterr().err
    died = [r for r in caplog.records if r.getMessage() == "engine worker died"]
    assert len(died) == 1 and died[0].exc_info[0] is EngineDied
    assert replies[0].status_code == 500 and "engine failed: EngineDied: injected engine death" in replies[0].text
