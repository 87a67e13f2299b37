"""The server's vLLM surface in-process: request fields honoured or refused, defaults, chat templates,
/tokenize, /detokenize, /v1/models and vLLM's metrics, over the real engine (plain decoding).

Each app runs its scheduler's worker on a thread of its own (one app at a time over the module's
engine); requests go through FastAPI's TestClient. The process-level server (and the speculative
metrics) are in test_serve_api.py.
"""

from __future__ import annotations

import contextlib
import json

import pytest
from fastapi.testclient import TestClient

from distill.engine import Engine, EngineConfig
from distill.errors import ConfigError
from distill.serve.app import AppSettings, create_app
from distill.serve.protocol import HONOURED, ChatCompletionRequest, CompletionRequest, fields_of, request_defaults
from distill.models import load_chat_template
from distill.serve.server import generation_config

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def engine(hf_model, model_dir):
    from transformers import AutoTokenizer

    return Engine(hf_model, AutoTokenizer.from_pretrained(model_dir), None, EngineConfig(max_batch=2))


@pytest.fixture(scope="module")
def tokenizer(engine):
    return engine.tokenizer


@contextlib.contextmanager
def serving(engine, model_dir, **settings):
    from distill.models import stop_token_ids

    base = dict(model_name="smol", max_model_len=engine.max_len, stop_token_ids=tuple(sorted(stop_token_ids(engine.tokenizer, model_dir))),
                max_batch=2, model_root=str(model_dir))
    with TestClient(create_app(engine, AppSettings(**{**base, **settings}))) as client:
        yield client


@pytest.fixture(scope="module")
def client(engine, model_dir):
    with serving(engine, model_dir) as c:
        yield c


def chat(client, **body):
    return client.post("/v1/chat/completions", json={"model": "smol", "messages": QUESTION, "temperature": 0, **body})


def complete(client, **body):
    return client.post("/v1/completions", json={"model": "smol", "prompt": "The capital of France is", "temperature": 0, **body})


def metrics(client) -> dict[str, float]:
    lines = client.get("/metrics").text.splitlines()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines if line and not line.startswith("#")}


# -- request fields ---------------------------------------------------------------------------
def test_every_field_of_vllms_requests_has_a_row_in_the_table_and_honoured_ones_are_declared():
    """A vLLM upgrade that adds a request field fails here until the table says what happens to it."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as VllmChat
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest as VllmCompletion

    for ours, theirs, endpoint in ((ChatCompletionRequest, VllmChat, "chat"), (CompletionRequest, VllmCompletion, "completions")):
        rows = fields_of(endpoint)
        assert set(theirs.model_fields) <= set(rows), set(theirs.model_fields) - set(rows)
        honoured = {name for name, rule in rows.items() if rule.support == HONOURED}
        assert honoured <= set(ours.model_fields), honoured - set(ours.model_fields)


@pytest.mark.parametrize(("send", "field", "value"), [
    (chat, "echo", True), (complete, "prompt_logprobs", 1), (chat, "use_beam_search", True), (complete, "bad_words", ["Paris"]),
    (chat, "chat_template", "{{ messages }}"), (chat, "tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
])
def test_a_field_the_server_cannot_honour_gets_a_400_naming_it(client, send, field, value):
    r = send(client, max_tokens=2, **{field: value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and field in error["message"] and error["type"] == "invalid_request_error"


def test_neutral_values_of_unhonoured_fields_and_unknown_keys_change_nothing(client):
    plain = chat(client, max_tokens=6).json()["choices"][0]["message"]["content"]
    neutral = {"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "logprobs": False, "top_logprobs": 0, "min_tokens": 0,
               "presence_penalty": 0, "use_beam_search": False, "prompt_logprobs": None, "user": "u1", "session_id": "s", "not_a_field_anywhere": 1}
    for extra in (neutral, {"top_k": 0}):
        r = chat(client, max_tokens=6, **extra)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == plain


def test_vllms_sampling_fields_reach_the_engine_and_bad_values_get_a_400_naming_them(client, engine):
    from distill.engine import SamplingParams

    fields = {"repetition_penalty": 1.4, "frequency_penalty": 0.3, "top_k": 5, "min_p": 0.05, "logit_bias": {"504": 2.5}}
    got = chat(client, max_tokens=12, ignore_eos=True, **fields).json()
    ids = client.post("/tokenize", json={"messages": QUESTION}).json()["tokens"]
    params = dict(fields, logit_bias={504: 2.5})
    want = engine.generate([ids], SamplingParams(max_tokens=12, ignore_eos=True, **params))[0][0].token_ids
    assert got["choices"][0]["message"]["content"] == engine.tokenizer.decode(want, skip_special_tokens=True)
    assert got["choices"][0]["message"]["content"] != chat(client, max_tokens=12, ignore_eos=True).json()["choices"][0]["message"]["content"]
    held = chat(client, max_tokens=40, min_tokens=30).json()
    assert held["usage"]["completion_tokens"] >= 30
    for field, value in (("top_k", -5), ("min_p", 2.0), ("repetition_penalty", 0), ("logit_bias", {"x": 1.0})):
        r = chat(client, max_tokens=2, **{field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)
    r = chat(client, max_tokens=2, top_logprobs=2)
    assert r.status_code == 400 and "logprobs" in r.json()["error"]["message"]


def test_chat_logprobs_whole_and_streamed_are_the_engine_s(client, engine):
    from distill.engine import SamplingParams

    r = chat(client, max_tokens=8, ignore_eos=True, logprobs=True, top_logprobs=2).json()
    content = r["choices"][0]["logprobs"]["content"]
    ids = client.post("/tokenize", json={"messages": QUESTION}).json()["tokens"]
    want = engine.generate([ids], SamplingParams(max_tokens=8, ignore_eos=True, logprobs=2))[0][0]
    assert [c["token"] for c in content] == [engine.tokenizer.decode([t]) for t in want.token_ids]
    assert [c["logprob"] for c in content] == pytest.approx([e.logprob for e in want.logprobs], abs=1e-4)
    assert all(len(c["top_logprobs"]) == 2 and c["top_logprobs"][0]["logprob"] >= c["logprob"] - 1e-6 for c in content)
    assert content[0]["bytes"] == list(content[0]["token"].encode())
    streamed = []
    with client.stream("POST", "/v1/chat/completions", json={"model": "smol", "messages": QUESTION, "temperature": 0, "max_tokens": 8,
                                                             "ignore_eos": True, "logprobs": True, "top_logprobs": 2, "stream": True}) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                lp = json.loads(line[6:])["choices"][0].get("logprobs")
                streamed += (lp or {}).get("content", [])
    assert streamed == content


def test_echo_with_logprobs_scores_the_prompt_as_a_transformers_forward_does(client, engine, hf_model, tokenizer):
    """lm-eval-harness's log-likelihood request: the prompt as token ids, echo, logprobs=1, max_tokens=1."""
    import torch

    ids = tokenizer("The capital of France is Paris. The capital of Italy is Rome.")["input_ids"]
    r = client.post("/v1/completions", json={"model": "smol", "prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 1,
                                             "temperature": 0}).json()
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)
    want = [float(ref[t - 1, ids[t]]) for t in range(1, len(ids))] + [float(ref[-1].max())]  # the answer: greedy
    assert lp["token_logprobs"][1:] == pytest.approx(want, abs=1e-3)
    assert all(len(top) == 1 for top in lp["top_logprobs"][1:])
    text = r["choices"][0]["text"]
    assert text.startswith(tokenizer.decode(ids)) and lp["text_offset"][0] == 0
    assert lp["text_offset"] == sorted(lp["text_offset"])
    plain = complete(client, max_tokens=3, echo=True).json()["choices"][0]
    assert plain["text"].startswith("The capital of France is") and plain["logprobs"] is None


def test_ignore_eos_decodes_past_the_models_end_and_stop_token_ids_still_end_it(client, tokenizer):
    natural = chat(client, max_tokens=64).json()
    text, n = natural["choices"][0]["message"]["content"], natural["usage"]["completion_tokens"]
    assert natural["choices"][0]["finish_reason"] == "stop" and n < 64  # the model ends its answer itself
    longer = chat(client, max_tokens=n + 5, ignore_eos=True).json()
    assert longer["usage"]["completion_tokens"] == n + 5 and longer["choices"][0]["finish_reason"] == "length"
    assert longer["choices"][0]["message"]["content"].startswith(text)
    own_stop = chat(client, max_tokens=64, ignore_eos=True, stop_token_ids=[tokenizer.eos_token_id]).json()
    assert own_stop["choices"][0]["message"]["content"] == text  # with ignore_eos only the request's ids stop
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    cut = chat(client, max_tokens=64, stop_token_ids=[ids[2]]).json()
    assert cut["usage"]["completion_tokens"] == 2 and cut["choices"][0]["finish_reason"] == "stop"
    assert cut["choices"][0]["message"]["content"] == tokenizer.decode(ids[:2])


def test_model_may_be_omitted_and_request_id_names_the_response(client):
    r = client.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 2, "request_id": "abc-123"})
    assert r.status_code == 200 and r.json()["id"] == "chatcmpl-abc-123" and r.json()["model"] == "smol"


# -- defaults -----------------------------------------------------------------------------------
def test_missing_max_tokens_means_the_rest_of_the_context(engine, model_dir):
    with serving(engine, model_dir, max_model_len=64) as c:
        prompt = c.post("/tokenize", json={"messages": QUESTION}).json()["count"]
        r = chat(c, ignore_eos=True).json()
        assert r["usage"]["completion_tokens"] == 64 - prompt and r["choices"][0]["finish_reason"] == "length"
        over = chat(c, max_tokens=64 - prompt + 1)
        assert over.status_code == 400 and over.json()["error"]["param"] == "max_tokens"


def test_generation_config_gives_the_defaults_of_omitted_fields(engine, model_dir, tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.0, "top_k": 50, "repetition_penalty": 1.0, "max_new_tokens": 6, "eos_token_id": 2}))
    applied, unhonoured = request_defaults(generation_config(str(tmp_path), model_dir))
    assert applied == {"temperature": 0.0, "top_k": 50, "repetition_penalty": 1.0, "max_tokens": 6} and unhonoured == {}
    assert generation_config("vllm", model_dir) == generation_config("none", model_dir) == {}
    with pytest.raises(ConfigError, match="generation_config.json"):
        generation_config(str(tmp_path / "nowhere"), model_dir)
    with serving(engine, model_dir, sampling_defaults=applied) as c:
        greedy = chat(c, max_tokens=6, temperature=0, ignore_eos=True).json()
        omitted = c.post("/v1/chat/completions", json={"messages": QUESTION, "ignore_eos": True}).json()
    assert omitted["usage"]["completion_tokens"] == 6
    assert omitted["choices"][0]["message"]["content"] == greedy["choices"][0]["message"]["content"]


THINKING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking %}<think>\n{% endif %}{% endif %}")


def test_chat_template_and_its_kwargs_shape_the_prompt(engine, model_dir, tokenizer, tmp_path):
    (tmp_path / "t.jinja").write_text(THINKING_TEMPLATE)
    assert load_chat_template(str(tmp_path / "t.jinja")) == THINKING_TEMPLATE == load_chat_template(THINKING_TEMPLATE)
    with pytest.raises(ConfigError, match="no such file"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with serving(engine, model_dir, chat_template=THINKING_TEMPLATE) as c:
        plain = c.post("/tokenize", json={"messages": QUESTION}).json()["tokens"]
        thinking = c.post("/tokenize", json={"messages": QUESTION, "chat_template_kwargs": {"enable_thinking": True}}).json()
        expected = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
        assert plain == tokenizer(expected, add_special_tokens=False)["input_ids"]  # ours, not the model's (no system turn)
        assert thinking["tokens"][: len(plain)] == plain and tokenizer.decode(thinking["tokens"][len(plain):]) == "<think>\n"
        for extra in ({"chat_template_kwargs": {"enable_thinking": True}}, {"reasoning_effort": "high"}):
            r = chat(c, max_tokens=1, **extra).json()
            assert r["usage"]["prompt_tokens"] == thinking["count"]  # what the answer was generated from
        bad = chat(c, max_tokens=1, chat_template_kwargs={"tokenize": True})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"
    # --chat-template-kwargs: the server's defaults, under each request's own (vLLM's --default-chat-template-kwargs)
    with serving(engine, model_dir, chat_template=THINKING_TEMPLATE, chat_template_kwargs={"enable_thinking": True}) as c:
        assert c.post("/tokenize", json={"messages": QUESTION}).json()["tokens"] == thinking["tokens"]
        assert chat(c, max_tokens=1).json()["usage"]["prompt_tokens"] == thinking["count"]
        off = c.post("/tokenize", json={"messages": QUESTION, "chat_template_kwargs": {"enable_thinking": False}}).json()
        assert off["tokens"] == plain


def test_continue_final_message_leaves_the_last_turn_open(client, tokenizer):
    messages = QUESTION + [{"role": "assistant", "content": "The capital of France is"}]
    r = client.post("/tokenize", json={"messages": messages, "continue_final_message": True}).json()
    assert tokenizer.decode(r["tokens"]).endswith("<|im_start|>assistant\nThe capital of France is")
    both = client.post("/tokenize", json={"messages": messages, "continue_final_message": True, "add_generation_prompt": True})
    assert both.status_code == 400


# -- endpoints ----------------------------------------------------------------------------------
def test_tokenize_and_detokenize_answer_in_vllms_shapes(client, tokenizer, engine):
    r = client.post("/tokenize", json={"model": "smol", "prompt": "Hello world", "return_token_strs": True}).json()
    ids = tokenizer("Hello world")["input_ids"]
    assert r == {"count": len(ids), "max_model_len": engine.max_len, "tokens": ids, "token_strs": tokenizer.convert_ids_to_tokens(ids)}
    assert client.post("/detokenize", json={"model": "smol", "tokens": ids}).json() == {"prompt": "Hello world"}
    rendered = client.post("/tokenize", json={"messages": QUESTION}).json()
    assert rendered["tokens"] == tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert chat(client, max_tokens=1).json()["usage"]["prompt_tokens"] == rendered["count"]
    assert client.post("/tokenize", json={"model": "other", "prompt": "x"}).status_code == 404
    assert client.post("/tokenize", json={"model": "smol"}).status_code == 400  # neither prompt nor messages
    tools = client.post("/tokenize", json={"messages": QUESTION, "tools": [{"type": "function", "function": {"name": "f"}}]})
    assert tools.json()["error"]["param"] == "tools"  # rendered without them would not be what vLLM renders
    assert client.post("/detokenize", json={"tokens": [10**9]}).json()["error"]["param"] == "tokens"


#: vLLM metrics with nothing to count here, and why (each is absent from /metrics).
NOT_SERVED = {
    "vllm:cache_config_info": "vLLM's block-cache configuration as labels; the slot cache has no blocks",
    "vllm:corrupted_requests": "vLLM's NaN-logits check of its own kernels",
    "vllm:engine_sleep_state": "no sleep mode",
    "vllm:prefix_cache_hits": "no prefix cache", "vllm:prefix_cache_queries": "no prefix cache",
    "vllm:external_prefix_cache_hits": "no KV connector", "vllm:external_prefix_cache_queries": "no KV connector",
    "vllm:prompt_tokens_cached": "no prefix cache", "vllm:prompt_tokens_cached_by_source": "no prefix cache",
    "vllm:prompt_tokens_by_source": "every prompt token is computed here (vllm:prompt_tokens)",
    "vllm:kv_block_lifetime_seconds": "no KV blocks", "vllm:kv_block_idle_before_evict_seconds": "no KV blocks",
    "vllm:kv_block_reuse_gap_seconds": "no KV blocks",
    "vllm:num_requests_kv_fetch_by_stage": "no KV connector",
    "vllm:lora_requests_info": "no LoRA adapters",
    "vllm:mm_cache_hits": "text only", "vllm:mm_cache_queries": "text only",
    "vllm:watermark_requests": "no watermarking",
}


def test_every_vllm_metric_is_served_or_declared_not_served(engine, model_dir):
    """The metric families the installed vLLM's Prometheus logger defines (read from its source) are all
    on /metrics, but for the declared ones: a vLLM upgrade that adds a metric fails here until it is served
    or declared."""
    import re
    from pathlib import Path

    import vllm.v1.metrics.loggers as loggers

    theirs = set(re.findall(r'"(vllm:[a-z_]+)"', Path(loggers.__file__).read_text()))  # every metric name it spells out
    assert {"vllm:num_requests_running", "vllm:kv_cache_usage_perc"} <= theirs  # the source still reads as expected
    with serving(engine, model_dir) as c:
        chat(c, max_tokens=3)
        text = c.get("/metrics").text
    types = re.findall(r"^# TYPE (vllm:[a-z_]+) (\w+)$", text, re.M)
    ours = {name.removesuffix("_total") if kind == "counter" else name for name, kind in types}  # a counter's samples end in _total
    assert theirs - ours == set(NOT_SERVED), sorted(theirs - ours)
    assert not ours & set(NOT_SERVED)


def test_models_list_carries_max_model_len_root_and_permission(client, engine, model_dir):
    card = client.get("/v1/models").json()["data"][0]
    assert card["id"] == "smol" and card["max_model_len"] == engine.max_len and card["root"] == str(model_dir)
    assert card["parent"] is None and card["permission"][0]["object"] == "model_permission"


def test_vllm_metrics_count_every_sequence(engine, model_dir):
    """vLLM's per-request metrics, per sequence (each of n choices is one): a fresh app's registry after 2 requests, 3 sequences."""
    with serving(engine, model_dir) as c:
        answers = [chat(c, max_tokens=5, ignore_eos=True).json(), chat(c, max_tokens=4, n=2, temperature=0.8, seed=1).json()]
        m = metrics(c)
    label = '{engine="0",model_name="smol"}'
    generated = sum(a["usage"]["completion_tokens"] for a in answers)
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_generation_tokens"):
        assert m[f"vllm:{name}_count{label}"] == 3, name
    assert m[f"vllm:generation_tokens_total{label}"] == m[f"vllm:request_generation_tokens_sum{label}"] == generated
    assert m[f"vllm:inter_token_latency_seconds_count{label}"] == generated - 3  # one per step after the first token
    prompt = answers[0]["usage"]["prompt_tokens"]
    assert m[f"vllm:prompt_tokens_total{label}"] == 3 * prompt
    finished = sum(v for k, v in m.items() if k.startswith("vllm:request_success_total"))
    assert finished == 3 and m['vllm:request_success_total{engine="0",finished_reason="length",model_name="smol"}'] >= 1
    assert m[f"vllm:num_requests_running{label}"] == 0 and m[f"vllm:num_requests_waiting{label}"] == 0
    assert m[f"vllm:kv_cache_usage_perc{label}"] == 0  # idle: no row holds a slot
    # per prompt (vLLM's parent request): its n, and the most tokens one of its choices generated
    assert m[f"vllm:request_params_n_count{label}"] == 2 and m[f"vllm:request_params_n_sum{label}"] == 3
    assert m[f"vllm:request_max_num_generation_tokens_count{label}"] == 2
    second = answers[1]["usage"]["completion_tokens"]  # its two choices' tokens: the longer has at least half
    assert (second + 1) // 2 <= m[f"vllm:request_max_num_generation_tokens_sum{label}"] - 5 <= min(4, second)
    assert m[f"vllm:request_params_max_tokens_sum{label}"] == 5 + 4 + 4
    assert m[f"vllm:request_prefill_kv_computed_tokens_sum{label}"] == 3 * prompt  # no re-prefill
    assert m[f"vllm:request_num_preemptions_sum{label}"] == 0 and m[f"vllm:num_preemptions_total{label}"] == 0
    # every token the engine computed, in its steps: the prompts (with each first token) and the decoding steps
    assert m[f"vllm:iteration_tokens_total_sum{label}"] == 3 * prompt + generated
    assert m['vllm:num_requests_waiting_by_reason{engine="0",model_name="smol",reason="capacity"}'] == 0
    assert not any(k.startswith("vllm:spec_decode") for k in m)  # no speculation, no counters (as vLLM)
