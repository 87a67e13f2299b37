"""`distill serve` against a careless or hostile client, as a real process driven over real HTTP.

One server for the module: plain decoding (no heads), bound to 0.0.0.0 without an API key
(it must warn), an 8 MB body limit, a 12 s shutdown grace. In order: one bad request among
six concurrent ones, a non-streaming client that hangs up, huge bodies and a long prompt
next to /health, and last SIGTERM with requests in flight (the server is gone after it).
"""

from __future__ import annotations

import concurrent.futures as cf
import http.client
import json
import signal
import threading
import time

import httpx
import pytest

from helpers import Server, chat, plain_answers

pytestmark = pytest.mark.slow

MAX_BODY = 8_000_000
MAX_TOKENS = 8  # the server's --max-tokens: the length of its answers and of the reference's
LONG_QUESTION = "Tell me a very long story about a dragon."
GRACE_S = 12  # the short request needs its few tokens (under a second at batch 3 here), 4000 tokens take minutes
STEPS_AFTER_HANG_UP = 10  # a step or two on an idle machine; slack for a busy one, far short of 2000 tokens
QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea.",
             "How many legs does a spider have?", "Give me a synonym for happy.", "What is 12 times 12?"]


@pytest.fixture(scope="module")
def plain(model_dir):
    """The engine's own greedy answers, the reference."""
    return plain_answers(model_dir, MAX_TOKENS)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(["--host", "0.0.0.0", "--max-batch", "8", "--max-tokens", str(MAX_TOKENS), "--max-body-bytes", str(MAX_BODY),
                  "--shutdown-grace", str(GRACE_S)], tmp_path_factory.mktemp("log") / "serve.log")
    yield srv
    srv.stop()


def body(question: str, **kw) -> dict:
    return {"model": "smollm2-135m-instruct", "messages": chat(question), "temperature": 0, **kw}


def metrics(srv: Server) -> dict[str, float]:
    text = httpx.get(f"{srv.url}/metrics", timeout=30).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line and not line.startswith("#")}


def aborted(m: dict) -> float:
    return m.get('distill_sequences_total{finish_reason="abort"}', 0.0)


def wait_for(cond, what: str, timeout: float = 240):
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)
    return value


def test_binding_all_addresses_without_a_key_warns(server):
    log = server.log.read_text()
    assert "binds 0.0.0.0 without an API key" in log and "DISTILL_API_KEY" in log


def test_one_bad_request_among_six_concurrent_fails_alone(server, plain):
    """Five good requests and one whose seed no generator can take, sent together: the bad one gets a 400
    naming `seed` before it is queued (the engine ends five sequences, none with an error); the five get
    their exact greedy answers. (tests/test_serve_scheduler.py: such a request that reaches a prefill.)"""
    before = metrics(server)
    requests = [body(q) for q in QUESTIONS[:5]]
    requests.insert(2, body(QUESTIONS[5], temperature=0.7, seed=2**70))

    def post(b: dict) -> httpx.Response:
        return httpx.post(f"{server.url}/v1/chat/completions", json=b, timeout=300)

    with cf.ThreadPoolExecutor(len(requests)) as pool:
        responses = list(pool.map(post, requests))
    bad = responses.pop(2)
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"]["param"] == "seed" and "seed" in bad.json()["error"]["message"]
    assert [r.status_code for r in responses] == [200] * 5
    assert [r.json()["choices"][0]["message"]["content"] for r in responses] == [plain(chat(q))[0] for q in QUESTIONS[:5]]
    after = metrics(server)
    ended = {k: after[k] - before.get(k, 0.0) for k in after if k.startswith("distill_sequences_total")}
    assert sum(ended.values()) == 5 and ended.get('distill_sequences_total{finish_reason="error"}', 0.0) == 0, ended


NAN, INF = float("nan"), float("inf")  # sent as JSON's NaN and Infinity, which Python's json reads


@pytest.mark.parametrize(("change", "param"), [
    ({"temperature": 1e-30}, "temperature"), ({"top_p": 1e-50}, "top_p"), ({"seed": -(2**63) - 1}, "seed"),
    ({"top_k": 2**70}, "top_k"), ({"stop_token_ids": [2**63], "min_tokens": 1}, "stop_token_ids"),
    ({"stop_token_ids": [10**9], "min_tokens": 1}, "stop_token_ids"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"repetition_penalty": NAN}, "repetition_penalty"), ({"repetition_penalty": INF}, "repetition_penalty"),
    ({"min_p": NAN}, "min_p"), ({"frequency_penalty": NAN}, "frequency_penalty"), ({"presence_penalty": -INF}, "presence_penalty"),
    ({"logit_bias": {"504": NAN}}, "logit_bias"), ({"logit_bias": {"504": INF}}, "logit_bias"), ({"logit_bias": 5}, "logit_bias"),
])
def test_sampling_values_the_engine_cannot_take_get_a_400_naming_the_field(server, change, param):
    r = httpx.post(f"{server.url}/v1/chat/completions", content=json.dumps(body("Hi!", **change)),
                   headers={"Content-Type": "application/json"}, timeout=300)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert param in r.json()["error"]["message"]


LONE = "a\ud800b"  # a lone surrogate: JSON can carry it (json.dumps escapes it as \\ud800), UTF-8 cannot


@pytest.mark.parametrize(("path", "payload", "param"), [
    ("/v1/chat/completions", body(LONE), "messages.0.content"),
    ("/v1/chat/completions", {**body("Hi!"), "messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]},
     "messages.0.content.0.text"),
    ("/v1/chat/completions", body("Hi!", stop=["x", LONE]), "stop.1"),
    ("/v1/chat/completions", body("Hi!", chat_template_kwargs={LONE: True}), "chat_template_kwargs"),  # a key: not echoed
    ("/v1/completions", {"model": "smollm2-135m-instruct", "prompt": LONE, "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"model": "smollm2-135m-instruct", "prompt": ["ok", LONE], "max_tokens": 2}, "prompt.1"),
    ("/tokenize", {"prompt": LONE}, "prompt"),
    ("/tokenize", {"messages": chat(LONE)}, "messages.0.content"),
])
def test_text_utf8_cannot_encode_gets_a_400_naming_the_field(server, path, payload, param):
    """A lone surrogate in any request text is a 400 naming the field (once a 500 from the tokenizer), and the
    server goes on answering."""
    raw = json.dumps(payload).encode("ascii")
    r = httpx.post(f"{server.url}{path}", content=raw, headers={"Content-Type": "application/json"}, timeout=300)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}: ") and error["type"] == "invalid_request_error", error
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    assert httpx.post(f"{server.url}/tokenize", json={"prompt": "Hi!"}, timeout=60).status_code == 200


@pytest.mark.parametrize("raw", [b'{"model": "x", "messages": [{"role": "user", "content": "\xff\xfe"}]}', b'{"model": '])
def test_a_body_that_is_not_utf8_json_gets_a_400_in_the_openai_error_shape(server, raw):
    r = httpx.post(f"{server.url}/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and ("UTF-8" in error["message"] or "JSON" in error["message"]), error
    assert httpx.get(f"{server.url}/nowhere", timeout=30).json()["error"]["message"] == "Not Found"


def test_a_non_streaming_client_that_hangs_up_frees_the_engine(server):
    """The client sends a 2000-token request and closes its connection once the engine decodes it: the
    sequence ends as `abort` within a few decoding steps of the hang-up (the handler awaits the disconnect
    itself, no polling; the worker drops the row at its next step), and the engine runs nothing."""
    before = metrics(server)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=300)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body("Tell me a very long story.", max_tokens=2000)),
                 headers={"Content-Type": "application/json"})
    wait_for(lambda: metrics(server).get("distill_running_sequences") == 1, "the request to be decoding")
    steps = before["distill_step_latency_seconds_count"]
    wait_for(lambda: metrics(server)["distill_step_latency_seconds_count"] > steps + 5, "decoding steps")
    at_hang_up = metrics(server)
    conn.close()  # hang up without reading the response
    after = wait_for(lambda: aborted(m := metrics(server)) > aborted(before) and m.get("distill_running_sequences") == 0 and m,
                     "the sequence to be cancelled and the engine to run nothing")
    assert aborted(after) == aborted(before) + 1
    later = after["distill_step_latency_seconds_count"] - at_hang_up["distill_step_latency_seconds_count"]
    assert later <= STEPS_AFTER_HANG_UP, later
    assert after["distill_generation_tokens_total"] - before["distill_generation_tokens_total"] < 2000
    assert httpx.post(f"{server.url}/v1/chat/completions", json=body(QUESTIONS[0]), timeout=300).status_code == 200


def test_bodies_over_the_limit_get_413_unread_while_health_answers_within_1s(server):
    """A 24 MB prompt, sent with its length (refused before a byte of it is read), then chunked at a pace
    (counted while read, refused past the limit): both get 413, and /health, probed back to back
    meanwhile, answers each probe within 1 s."""
    huge = json.dumps(body("x" * 24_000_000)).encode()
    answers: list[httpx.Response] = []

    def chunks():  # no Content-Length: chunked transfer
        for i in range(0, len(huge), 1 << 20):
            time.sleep(0.1)
            yield huge[i: i + (1 << 20)]

    def send() -> None:
        for content in (huge, chunks()):
            answers.append(httpx.post(f"{server.url}/v1/chat/completions", content=content,
                                      headers={"Content-Type": "application/json"}, timeout=300))

    thread = threading.Thread(target=send)
    thread.start()
    latencies = []
    with httpx.Client(timeout=30) as probe:
        while thread.is_alive():
            start = time.monotonic()
            assert probe.get(f"{server.url}/health").status_code == 200
            latencies.append(time.monotonic() - start)
            time.sleep(0.02)
    thread.join()
    assert [r.status_code for r in answers] == [413, 413]
    assert str(MAX_BODY) in answers[0].json()["error"]["message"]
    assert len(latencies) >= 5 and max(latencies) < 1.0, latencies


def test_health_answers_while_a_long_prompt_is_tokenized_and_the_prompt_gets_a_400(server):
    """A 6 MB prompt (within the body limit, far beyond the context) takes seconds to tokenize. Probed back
    to back meanwhile, /health answers 200 and /metrics answers while it reports the tokenization under way:
    an event loop busy tokenizing could answer neither until it ended. The prompt gets a 400
    context_length_exceeded."""
    prompt = "The quick brown fox jumps over the lazy dog. " * 133_000  # ~6 MB, ~1.3 M tokens
    result: dict = {}

    def big() -> None:
        result["response"] = httpx.post(f"{server.url}/v1/completions", timeout=600,
                                        json={"model": "smollm2-135m-instruct", "prompt": prompt, "max_tokens": 4})

    thread = threading.Thread(target=big)
    thread.start()
    health, tokenizing = [], []
    while thread.is_alive():
        health.append(httpx.get(f"{server.url}/health", timeout=600).status_code)
        tokenizing.append(metrics(server).get("distill_tokenizing_requests"))
        time.sleep(0.05)
    thread.join()
    r = result["response"]
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert set(health) == {200}
    assert 1.0 in tokenizing, tokenizing  # answered in the middle of the tokenization
    assert metrics(server)["distill_tokenizing_requests"] == 0


def test_sigterm_drains_finishes_the_short_request_ends_the_long_ones_cleanly_and_exits_0(server):
    """In flight at SIGTERM: a long streaming answer, a long non-streaming one and a short streaming one.
    The short one completes; a new request and /health get 503 while the server drains; after the grace
    period the long stream ends with an error event and [DONE], the long non-streaming request with a 503
    JSON error; the process exits 0 with no traceback in its log."""
    events: dict[str, list[str]] = {"long": [], "short": []}
    first = {name: threading.Event() for name in events}

    def stream(name: str, question: str, max_tokens: int) -> None:
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body(question, max_tokens=max_tokens, stream=True),
                          timeout=300) as r:
            for line in r.iter_lines():
                if line:
                    events[name].append(line)
                if '"content": "' in line and '"content": ""' not in line:
                    first[name].set()
        first[name].set()

    with cf.ThreadPoolExecutor(3) as pool:
        long_stream = pool.submit(stream, "long", LONG_QUESTION, 4000)
        assert first["long"].wait(240)
        running = metrics(server).get("distill_running_sequences", 0)
        # the long stream's own question (greedy: the same answer), started later: cut whenever the stream is
        long_plain = pool.submit(httpx.post, f"{server.url}/v1/chat/completions", json=body(LONG_QUESTION, max_tokens=4000),
                                 timeout=300)
        wait_for(lambda: metrics(server).get("distill_running_sequences", 0) >= running + 1, "the second long request to decode")
        short = pool.submit(stream, "short", QUESTIONS[0], 6)
        assert first["short"].wait(240)
        server.proc.send_signal(signal.SIGTERM)
        health = wait_for(lambda: (r := httpx.get(f"{server.url}/health", timeout=30)).status_code == 503 and r, "/health to say 503")
        assert "draining" in health.json()["detail"]
        refused = httpx.post(f"{server.url}/v1/chat/completions", json=body(QUESTIONS[1]), timeout=60)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
        short.result(timeout=300)
        long_stream.result(timeout=300)
        plain_response = long_plain.result(timeout=300)
    assert events["short"][-1] == "data: [DONE]"
    assert json.loads(events["short"][-2][len("data: "):])["choices"][0]["finish_reason"] in ("stop", "length"), events["short"]
    assert events["long"][-1] == "data: [DONE]"
    assert json.loads(events["long"][-2][len("data: "):])["error"]["code"] == "shutting_down"
    assert plain_response.status_code == 503 and plain_response.json()["error"]["code"] == "shutting_down"
    assert server.proc.wait(timeout=120) == 0
    log = server.log.read_text()
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-3000:]
