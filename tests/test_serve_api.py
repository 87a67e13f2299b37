"""`distill serve` as a real process, driven by the official `openai` client.

One server per fixture (module scope): the bundled model with freshly initialised
heads (random residual weights), greedy answers checked token for token against the
engine's plain decoding; vLLM's own benchmark client (`vllm bench serve`) runs against it. A second,
tiny-queue server (the lookup proposer) checks HTTP 503 and vLLM's speculative-decoding metrics. The last
test of the main server stops it with SIGTERM.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from conftest import REPO
from distill.store.shards import iter_rows
from helpers import API_KEY, Server, chat, plain_answers

pytestmark = pytest.mark.slow

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def heads_dir(tmp_path_factory, model_dir) -> Path:
    import torch
    from safetensors.torch import load_file

    from distill.heads import HeadsConfig, MedusaHeads

    cfg = json.loads((model_dir / "config.json").read_text())
    sd = load_file(str(model_dir / "model.safetensors"))
    lm = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
    torch.manual_seed(0)
    heads = MedusaHeads(HeadsConfig(cfg["hidden_size"], cfg["vocab_size"], num_heads=3), lm_head_weight=lm)
    with torch.no_grad():
        for block in heads.blocks:
            for layer in block.layers:
                layer.weight.normal_(0, 0.02)
    out = tmp_path_factory.mktemp("heads") / "heads"
    heads.save(out)
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory, heads_dir):
    srv = Server(["--heads", str(heads_dir), "--api-key", API_KEY, "--max-batch", "4", "--queue-size", "32",
                  "--max-tokens", str(MAX_TOKENS), "--served-model-name", "smol"], tmp_path_factory.mktemp("log") / "serve.log",
                 log_level="info")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def plain(model_dir):
    """The engine's plain greedy decoding (no heads), batch 1: the reference every greedy answer must equal."""
    return plain_answers(model_dir, MAX_TOKENS)


QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
    "Give me a synonym for happy.",
    "What is 12 times 12?",
    "Describe a cat in one sentence.",
    "Why is the sky blue?",
]


def test_the_start_up_lines_name_the_proposer_and_the_step_costs_measured(server):
    started = server.log.read_text()  # at --log-level info
    assert "distill serve: smol (speculative decoding, proposer medusa) on http://127.0.0.1:" in started, started[-2000:]
    assert re.search(r"distill serve: step costs (measured at start|kept from an earlier start in \S+step-costs\S+\.json) "
                     r"\(rows: cost of a forward over a one-row one\): \{'1': 1\.0, '2': ", started), started[-2000:]


def test_greedy_chat_answer_equals_the_engines_plain_decoding(server, plain):
    r = server.client().chat.completions.create(model="smol", messages=chat(QUESTIONS[0]), temperature=0, max_tokens=MAX_TOKENS)
    text, n = plain(chat(QUESTIONS[0]))
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == text
    assert r.usage.completion_tokens == n and r.usage.prompt_tokens > 0
    assert r.choices[0].finish_reason in ("stop", "length") and r.model == "smol"


def test_streamed_chat_deltas_join_to_the_non_streamed_answer(server, plain):
    stream = server.client().chat.completions.create(model="smol", messages=chat(QUESTIONS[1]), temperature=0, max_tokens=MAX_TOKENS,
                                                     stream=True, stream_options={"include_usage": True})
    parts, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            finish = c.finish_reason or finish
    text, n = plain(chat(QUESTIONS[1]))
    assert "".join(parts) == text
    assert len([p for p in parts if p]) > 1  # really streamed, not one blob
    assert finish in ("stop", "length") and usage.completion_tokens == n


def test_text_completions_with_a_prompt_list_answer_each_prompt(server, plain):
    prompts = ["The capital of Italy is", "Once upon a time"]
    r = server.client().completions.create(model="smol", prompt=prompts, temperature=0, max_tokens=8)
    assert [c.index for c in r.choices] == [0, 1]
    for c, p in zip(r.choices, prompts):
        assert c.text == plain(prompt=p, max_tokens=8)[0]
    streamed = "".join(c.choices[0].text for c in server.client().completions.create(
        model="smol", prompt=prompts[0], temperature=0, max_tokens=8, stream=True) if c.choices)
    assert streamed == r.choices[0].text


def test_stop_string_cuts_the_answer_before_it(server, plain):
    text, _ = plain(chat(QUESTIONS[2]))
    words = text.split()
    assert len(words) >= 3, text
    stop = words[2]
    expected = text[: text.index(stop)]
    client = server.client()
    r = client.chat.completions.create(model="smol", messages=chat(QUESTIONS[2]), temperature=0, max_tokens=MAX_TOKENS, stop=[stop, "\u2603never"])
    assert r.choices[0].message.content == expected and r.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(model="smol", messages=chat(QUESTIONS[2]), temperature=0, max_tokens=MAX_TOKENS, stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected


def test_same_seed_gives_the_same_sample(tiny_queue_server):
    """Same seed, same tree sizes (--static, batch 1): same sample (the adaptive policy may pick other trees)."""
    client = tiny_queue_server.client(key="unused")
    model = client.models.list().data[0].id
    kw = dict(model=model, messages=chat(QUESTIONS[3]), temperature=1.0, top_p=0.95, max_tokens=24, seed=1234)
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    assert a == b and a


@pytest.mark.parametrize(("change", "error"), [
    ({"max_tokens": -1}, openai.BadRequestError),
    ({"temperature": 5}, openai.BadRequestError),
    ({"model": "no-such-model"}, openai.NotFoundError),
    ({"top_logprobs": 2}, openai.BadRequestError),  # without logprobs: true
    ({"max_tokens": 10**7}, openai.BadRequestError),
    ({"messages": []}, openai.BadRequestError),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, openai.BadRequestError),
])
def test_bad_chat_requests_get_a_4xx_with_a_message(server, change, error):
    kw = {"model": "smol", "messages": chat("hi"), "max_tokens": 4, **change}
    with pytest.raises(error) as exc:
        server.client(max_retries=0).chat.completions.create(**kw)
    assert 400 <= exc.value.status_code < 500 and exc.value.body["message"]


def test_raw_http_errors_missing_messages_bad_json_and_bad_key(server):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "smol"}, headers=auth)
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/chat/completions", content=b"{nope", headers={**auth, "Content-Type": "application/json"})
    assert r.status_code == 400
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "smol", "prompt": [10**9]}, headers=auth)
    assert r.status_code == 400
    with pytest.raises(openai.AuthenticationError):
        server.client(key="wrong", max_retries=0).models.list()
    assert httpx.get(f"{server.url}/v1/models").status_code == 401


def test_concurrent_clients_are_all_answered_correctly(server, plain):
    client = server.client()

    def ask(q: str) -> str:
        return client.chat.completions.create(model="smol", messages=chat(q), temperature=0, max_tokens=MAX_TOKENS).choices[0].message.content

    questions = QUESTIONS[:6]  # more than --max-batch 4: two engine batches
    with cf.ThreadPoolExecutor(len(questions)) as pool:
        answers = list(pool.map(ask, questions))
    assert answers == [plain(chat(q))[0] for q in questions]


def test_models_health_and_metrics(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["smol"]
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    text = httpx.get(f"{server.url}/metrics").text
    samples = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line and not line.startswith("#")}
    assert samples['distill_requests_total{endpoint="/v1/chat/completions",status="200"}'] >= 1
    assert samples["distill_generation_tokens_total"] > 0
    assert samples["distill_tokens_per_step_count"] > 0 and samples["distill_step_latency_seconds_count"] > 0
    assert samples["distill_tree_nodes_count"] == samples["distill_step_latency_seconds_count"]  # one per step
    assert samples["distill_tree_nodes_sum"] > 0 and samples["distill_acceptance_ratio"] > 0  # the adaptive policy ran trees and measured its acceptance
    assert samples['distill_requests_total{endpoint="/v1/models",status="401"}'] >= 1


def test_client_disconnect_cancels_the_sequence(server):
    """A streaming client that goes away mid-answer: its sequence ends as 'abort' instead of running to max_tokens.
    While it runs, vLLM's KV-cache usage gauge shows its slots; once it is gone, none."""
    def sample(prefix: str) -> float:
        text = httpx.get(f"{server.url}/metrics").text
        return sum(float(l.split(" ")[1]) for l in text.splitlines() if l.startswith(prefix))

    def aborted() -> float:
        return sample('distill_sequences_total{finish_reason="abort"}')

    before, tokens = aborted(), 0
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"model": "smol", "messages": chat("Tell me a very long story."), "max_tokens": 1000, "stream": True,
                            "temperature": 0}, timeout=300) as r:
        for line in r.iter_lines():
            tokens += '"content": "' in line and '"content": ""' not in line
            if tokens == 3:  # the third token: a step after the prefill has been reported
                assert 0 < sample("vllm:kv_cache_usage_perc{") <= 1
                break  # hang up
    deadline = time.monotonic() + 240
    while aborted() == before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert aborted() == before + 1
    assert sample("vllm:kv_cache_usage_perc{") == 0  # the aborted row left the batch, and nothing else runs


def test_a_new_request_joins_the_running_batch_and_finishes_first(server, plain):
    """Continuous batching: a short request sent while a long answer streams is answered (correctly)
    before the long one ends; a batch that admitted nobody until it finished could not do that."""
    started, chunks = threading.Event(), []

    def long_answer() -> None:
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                          json={"model": "smol", "messages": chat("Tell me a very long story about a dragon."), "max_tokens": 96,
                                "stream": True, "temperature": 0}, timeout=300) as r:
            for line in r.iter_lines():
                if '"content": "' in line and '"content": ""' not in line:
                    chunks.append(time.monotonic())
                    started.set()
        started.set()

    with cf.ThreadPoolExecutor(1) as pool:
        streaming = pool.submit(long_answer)
        assert started.wait(240) and chunks, "the long answer never streamed"
        short = server.client().chat.completions.create(model="smol", messages=chat(QUESTIONS[0]), temperature=0, max_tokens=MAX_TOKENS)
        answered = time.monotonic()
        streaming.result(timeout=300)
    assert short.choices[0].message.content == plain(chat(QUESTIONS[0]))[0]
    assert sum(t > answered for t in chunks) >= 5, f"{len(chunks)} chunks, {sum(t > answered for t in chunks)} after the short answer"


def test_vllms_own_benchmark_client_runs_against_the_server(server, model_dir, tmp_path):
    """Conformance: `vllm bench serve --backend openai-chat` (through benchmarks/vllm_bench_serve.py), random prompts of 32
    tokens, 16-token answers (vLLM's client sends ignore_eos for random prompts), a TTFT and ITL to report."""
    cmd = [sys.executable, str(REPO / "benchmarks" / "vllm_bench_serve.py"), "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
           "--base-url", server.url, "--model", "smol", "--tokenizer", str(model_dir), "--dataset-name", "random",
           "--random-input-len", "32", "--random-output-len", "16", "--num-prompts", "4", "--temperature", "0", "--disable-tqdm",
           "--save-result", "--result-dir", str(tmp_path), "--result-filename", "result.json"]
    proc = subprocess.run(cmd, env=dict(os.environ, OPENAI_API_KEY=API_KEY), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["completed"] == 4 and result["failed"] == 0
    assert result["total_output_tokens"] == 4 * 16  # ignore_eos honoured: every answer runs to its length
    assert result["mean_ttft_ms"] > 0 and result["median_itl_ms"] > 0 and result["p99_itl_ms"] >= result["median_itl_ms"]
    # (its speculative-decoding section appears only when the adaptive policy drafted during the run: with these
    # random heads it may have turned speculation off by now; the counters are checked on the lookup server below)


def test_sigterm_stops_the_server_cleanly(server):
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=60) == 0
    assert "Traceback" not in server.log.read_text()


@pytest.fixture(scope="module")
def tiny_queue_server(tmp_path_factory, real_shards):
    """The lookup proposer (``--heads lookup``: nothing trained; a self-distilled dataset as its datastore) behind a
    queue of one."""
    # Trees priced by the CPU line, not the curve the server measures at start: at one thread (each xdist worker's) some
    # CPUs time a second row at well over a first's, and the policy then drafts nothing (BENCHMARKS.md, "Step costs and
    # the speculation policy"), where the metrics test needs drafts.
    srv = Server(["--heads", "lookup", "--lookup-data", str(real_shards), "--max-batch", "1", "--queue-size", "1",
                  "--max-tokens", "24", "--static", "--step-cost-ratio", "0.08"], tmp_path_factory.mktemp("log") / "serve-small.log",
                 log_level="info")
    yield srv
    srv.stop()


def test_full_queue_answers_503_and_the_admitted_requests_succeed(tiny_queue_server, plain, real_shards):
    client = tiny_queue_server.client(key="unused", max_retries=0)
    model = client.models.list().data[0].id
    # what the history held before: the module's earlier requests to this server (the seed test's two samples); the
    # bound below is on what this test's answered requests add (which of the 8 get in is timing: their replies differ)
    held_before = scrape(tiny_queue_server).get("distill_lookup_history_tokens", 0.0)

    def ask(i: int):
        try:
            r = client.chat.completions.create(model=model, messages=chat(QUESTIONS[i % len(QUESTIONS)]), temperature=0, max_tokens=24)
            return r.choices[0].message.content
        except openai.APIStatusError as exc:
            return exc.status_code

    with cf.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(ask, range(8)))
    refused = [r for r in results if r == 503]
    answered = [r for r in results if isinstance(r, str)]
    assert refused and answered and len(refused) + len(answered) == 8, results
    for i, r in enumerate(results):  # greedy with lookup drafting: plain decoding's answers
        if isinstance(r, str):
            assert r == plain(chat(QUESTIONS[i % len(QUESTIONS)]), max_tokens=24)[0]
    text = httpx.get(f"{tiny_queue_server.url}/metrics").text
    assert 'distill_proposer{proposer="lookup"} 1.0' in text
    started = tiny_queue_server.log.read_text()  # its start-up lines, at --log-level info
    assert "distill serve: smollm2-135m-instruct (speculative decoding, proposer lookup) on http://127.0.0.1:" in started
    assert "distill serve: lookup datastore: " in started and "distill serve: lookup history: " in started
    assert "distill serve: step costs" not in started  # --step-cost-ratio: the line, no curve measured
    indexed = sum(int(sum(r["loss_mask"])) for r in iter_rows(real_shards, columns=["loss_mask"]))
    assert f"distill_lookup_datastore_tokens {float(indexed)}" in text  # --lookup-data: every generated token indexed
    # the history (on by default): each answered request's reply and the 6 prompt tokens before it
    held = scrape(tiny_queue_server)["distill_lookup_history_tokens"] - held_before
    assert len(answered) * (6 + 1) <= held <= len(answered) * (6 + 24 + 8), (held_before, held, results)
    # vLLM's admission counter: the refusals by the sequence limit, none by a token limit (the queue has none)
    assert f'vllm:admission_rejections_total{{model_name="smollm2-135m-instruct",reason="max_num_queued_reqs"}} {len(refused)}.0' in text
    assert 'vllm:admission_rejections_total{model_name="smollm2-135m-instruct",reason="max_num_queued_tokens"} 0.0' in text


def scrape(srv: Server) -> dict[str, float]:
    """/metrics as {sample name: value}, each summed over its label sets; a histogram's bucket ``le="0.0"`` under
    its own name, ``NAME_bucket_le0``."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{srv.url}/metrics").text):
        for sample in family.samples:
            name = sample.name + ("_le0" if sample.labels.get("le") == "0.0" else "")
            out[name] = out.get(name, 0.0) + sample.value
    return out


def test_vllm_metrics_of_one_speculative_request_agree_with_each_other(tiny_queue_server):
    """One greedy request on the lookup server (batch 1): vLLM's counters against its answer and our step records.

    G generated tokens = 1 (the prefill's) + S steps + A accepted draft tokens, less what the last
    step's acceptance ran past max_tokens (at most its accepted tokens)."""
    before = scrape(tiny_queue_server)
    text = "Repeat this line five times: the cat sat on the mat, the dog sat on the log."
    r = httpx.post(f"{tiny_queue_server.url}/v1/chat/completions", timeout=300,
                   json={"messages": chat(text), "max_tokens": 24, "temperature": 0, "ignore_eos": True}).json()
    after = scrape(tiny_queue_server)
    labels = 'vllm:time_to_first_token_seconds_count{engine="0",model_name="smollm2-135m-instruct"}'
    assert labels in httpx.get(f"{tiny_queue_server.url}/metrics").text  # vLLM's labels

    def d(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    generated = r["usage"]["completion_tokens"]
    assert generated == 24 and d("vllm:generation_tokens_total") == generated
    assert d("vllm:prompt_tokens_total") == r["usage"]["prompt_tokens"]
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert d(f"vllm:{name}_count") == 1, name
    assert 0 < d("vllm:time_to_first_token_seconds_sum") <= d("vllm:e2e_request_latency_seconds_sum")
    steps = d("distill_tokens_per_step_count")
    accepted = d("vllm:spec_decode_num_accepted_tokens_total")
    assert d("vllm:inter_token_latency_seconds_count") == steps  # one per step after the prefill
    assert accepted == d("distill_tokens_per_step_sum") - steps
    assert 0 <= 1 + steps + accepted - generated <= accepted
    drafts, draft_tokens = d("vllm:spec_decode_num_drafts_total"), d("vllm:spec_decode_num_draft_tokens_total")
    assert drafts == steps - d("distill_tree_nodes_bucket_le0")  # every step with a tree drafted, one row
    assert draft_tokens == d("distill_tree_nodes_sum") and accepted <= draft_tokens
    assert drafts > 0 and accepted > 0  # the repeated line is found in the context
    assert d("vllm:spec_decode_num_accepted_tokens_per_pos_total") == accepted


def test_vllm_draft_counters_count_each_row_s_own_chain():
    """Rows of one chain step draft unlike numbers of nodes (the node budget), some none: a draft is a row that
    drafted, its tokens the nodes it drafted, not the padded chain's length times the rows."""
    from prometheus_client import CollectorRegistry

    from distill.serve.metrics import VllmMetrics

    registry = CollectorRegistry()
    m = VllmMetrics(registry, "m", speculative=True, max_model_len=64)
    m.step([3, 0, 1], [2, 0, 1])
    m.step([0, 0, 0], [0, 0, 0])  # a plain step of a speculating server: no draft
    value = lambda name: registry.get_sample_value(name, {"model_name": "m", "engine": "0"})
    assert value("vllm:spec_decode_num_drafts_total") == 2 and value("vllm:spec_decode_num_draft_tokens_total") == 4
    assert value("vllm:spec_decode_num_accepted_tokens_total") == 3
