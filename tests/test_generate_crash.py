"""SIGKILL a real `distill generate` run at random points: what was finished is never lost."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

from conftest import REPO, assert_same_rows
from distill.generate import GenerateConfig, Generator
from distill.store import ShardStore

SCRIPT = REPO / "tests" / "scripts" / "generate_reporting.py"
CONVERSATIONS = 16
CONCURRENCY = 3


def _config(server, out) -> dict:
    return dict(backend="openai", server=server.url, concurrency=CONCURRENCY, seed="sharegpt", limit=CONVERSATIONS,
                shard_size=5, max_new_tokens=16, temperature=0.0, dtype="float32", out=str(out))


def _durable(server, out) -> set[str]:
    """Ids in shards or the journal, as the next run finds them (opening the store recovers the journal)."""
    gen = Generator(GenerateConfig(**_config(server, out)))
    with ShardStore(out, gen.meta(), gen.config_key(), gen.enc.id_dtype) as store:
        return store.done_ids()


def test_random_sigkills_lose_no_finished_conversation_and_the_rerun_equals_an_uninterrupted_run(vllm_server, tmp_path):
    reference = tmp_path / "reference"
    assert Generator(GenerateConfig(**_config(vllm_server, reference))).run().generated == CONVERSATIONS

    out = tmp_path / "out"
    rng = random.Random(16)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    durable: set[str] = set()
    kills = []
    while len(kills) < 3:
        proc = subprocess.Popen([sys.executable, str(SCRIPT), json.dumps(_config(vllm_server, out))], env=env, cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
        finished = 0
        first = proc.stdout.readline()  # the first conversation is in the journal
        assert first.strip() == "FINISHED", first
        finished += 1
        time.sleep(rng.uniform(0.0, 1.5))  # then a random point: mid-request, mid-append or mid-shard
        os.killpg(proc.pid, signal.SIGKILL)
        rest = proc.stdout.read()
        proc.wait()
        finished += rest.count("FINISHED")
        assert "DONE" not in rest, "the kill came too late"
        after = _durable(vllm_server, out)
        lost = len(durable) + finished - len(after)
        kills.append({"finished": finished, "durable": len(after), "lost_finished": lost})
        assert lost <= 0, f"conversations reported finished are missing after the kill: {kills}"  # journal read back
        assert durable <= after
        durable = after
    summary = Generator(GenerateConfig(**_config(vllm_server, out))).run()
    assert summary.generated == CONVERSATIONS and summary.new_conversations == CONVERSATIONS - len(durable)
    assert_same_rows(out, reference)  # token for token; the top-k within the encoding error (batching noise)
