"""The server's scheduler in-process on the real engine: continuous batching and a failed step."""

from __future__ import annotations

import asyncio

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

            def flaky():
                calls.append(1)
                if len(calls) == 3:
                    raise RuntimeError("injected step failure")
                return step()

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
