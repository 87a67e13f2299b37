"""`distill generate` with other chat templates, on the real model and generation path: a Qwen3-shaped thinking
template (history think-stripping, the enable_thinking kwarg) and Meta's Llama-3 template.

The policy under test: every row's ``input_ids`` are exactly what the teacher conditioned on, and every prompt in
them is the chat template's rendering of the conversation so far; turns are joined at the token level while the
template extends the stream, and where it re-renders the history instead (Qwen3 drops earlier think blocks, Llama-3
trims replies) the next turn starts a new row ``<id>#t<turn>`` from the whole rendering. The loss mask covers only
what the teacher generated in the row.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import REPO, assert_teacher_matches_model, run_distill
from distill.conversation import conversation_id, turn_row_id
from distill.data.convert import export
from distill.data.stats import compute_stats
from distill.data.validate import validate_dataset
from distill.errors import ConfigError, StoreError
from distill.generate import GenerateConfig, Generator
from distill.templating import strip_reasoning
from distill.store import iter_rows, load_manifest

# The shape of Qwen3's template (tools left out): a reply's think block is kept after the last user message and
# dropped from earlier replies; enable_thinking=false puts an empty think block into the generation prompt.
QWEN3 = (
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- set ns = namespace(last_query_index=0) %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_query_index = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set content = message.content %}{%- set reasoning_content = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
# Meta-Llama-3-8B-Instruct's template, as it ships (its `| trim` re-renders replies that begin or end with whitespace).
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim"
    " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
THINK_OFF = {"enable_thinking": False}
EMPTY_THINK = "<think>\n\n</think>\n\n"
CONVERSATIONS = [["What is the capital of France?", "And of Italy?", "Which one is bigger?"],
                 ["Write a poem about the sea.", "Now make it rhyme.", "Give it a title."]]


def _seed(tmp_path, conversations=CONVERSATIONS) -> str:
    path = tmp_path / "seed.jsonl"
    with path.open("w") as f:
        for i, users in enumerate(conversations):
            messages = [m for u in users for m in ({"role": "user", "content": u}, {"role": "assistant", "content": "ok"})]
            f.write(json.dumps({"id": f"c{i}", "messages": messages}) + "\n")
    return str(path)


def _generate(backend, tmp_path, name, **options):
    cfg = GenerateConfig(seed=_seed(tmp_path), out=str(tmp_path / name), dtype="float32", max_new_tokens=8,
                         temperature=0.0, **options)
    return Generator(cfg, backend=backend).run(), tmp_path / name


def _render(tok, messages, template, kwargs) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, chat_template=template,
                                   **(kwargs or {}))


def _decode(tok, ids) -> str:
    return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _assert_rows_follow_the_template(out, tok, template, kwargs=None) -> dict[str, list[dict]]:
    """The policy, checked on every row of ``out`` (made with --reasoning keep); returns the rows by conversation."""
    by_conv: dict[str, list[dict]] = {}
    for row in iter_rows(out):
        by_conv.setdefault(conversation_id(row["id"]), []).append(row)
    for conv, rows in by_conv.items():
        for row in rows:
            ids, mask = row["input_ids"], np.asarray(row["loss_mask"])
            system = [m for m in row["messages"] if m["role"] == "system"]
            chat = [m for m in row["messages"] if m["role"] != "system"]
            history = len(chat) - len(row["turns"])  # messages the row holds only inside its first prompt
            assert row["id"] == turn_row_id(conv, history // 2)
            assert not mask[: row["turns"][0]["end"]].any()  # history and prompt: never a target
            for j, turn in enumerate(row["turns"]):
                if turn["role"] != "assistant":
                    continue
                # The teacher was prompted with exactly the template's rendering of the conversation so far ...
                assert _decode(tok, ids[: turn["start"]]) == _render(tok, system + chat[: history + j], template, kwargs)
                # ... and the mask covers exactly what it generated: the turn's first n_tokens, not the closing tokens.
                span = mask[turn["start"]: turn["end"]]
                assert span[: turn["n_tokens"]].all() and not span[turn["n_tokens"]:].any()
        for a, b in zip(rows, rows[1:]):
            assert a["stop_reason"] == "continued" and b["messages"][: len(a["messages"])] == a["messages"]
            # a new row only where the template does not extend the stream the teacher saw
            assert not _decode(tok, b["input_ids"][: b["turns"][1]["start"]]).startswith(_decode(tok, a["input_ids"]))
        assert rows[-1]["stop_reason"] != "continued"
    return by_conv


def _assert_valid_and_trainable(out, generated_tokens: int) -> None:
    from distill.train.data import iter_examples

    report = validate_dataset(out)
    assert report.ok, [str(p) for p in report.problems]
    assert sum(int(e.loss_mask.sum()) for e in iter_examples(out, max_len=512)) == generated_tokens


@pytest.mark.parametrize("backend", ["hf_backend", "vllm_backend"])
def test_qwen3_template_without_thinking_prompts_each_turn_as_the_template_renders_it(request, backend, tmp_path,
                                                                                      hf_model):
    b = request.getfixturevalue(backend)
    summary, out = _generate(b, tmp_path, "qwen3", chat_template=QWEN3, chat_template_kwargs=THINK_OFF)
    # the empty think block of every prompt is gone from the history of the next: each turn is a row
    assert (summary.generated, summary.continued_rows, summary.balanced) == (2, 4, True)
    by_conv = _assert_rows_follow_the_template(out, b.tokenizer, QWEN3, THINK_OFF)
    assert {c: [(r["id"], r["stop_reason"]) for r in rows] for c, rows in by_conv.items()} == {
        f"seed:c{i}": [(f"seed:c{i}", "continued"), (f"seed:c{i}#t1", "continued"), (f"seed:c{i}#t2", "completed")]
        for i in range(2)}
    for rows in by_conv.values():
        last = rows[-1]
        assert [t["role"] for t in last["turns"]] == ["user", "assistant"]
        prompt = _decode(b.tokenizer, last["input_ids"][: last["turns"][1]["start"]])
        assert prompt.count("<think>") == 1 and prompt.endswith("<|im_start|>assistant\n" + EMPTY_THINK)  # history stripped
        replies = [m["content"] for m in last["messages"] if m["role"] == "assistant"]
        assert len(replies) == 3 and all(r.startswith(EMPTY_THINK) for r in replies)  # --reasoning keep: the whole turn
    assert assert_teacher_matches_model(out, hf_model, greedy=True) == summary.generated_tokens
    _assert_valid_and_trainable(out, summary.generated_tokens)
    meta = load_manifest(out)["meta"]
    assert meta["generation"]["chat_template"] == QWEN3 and meta["generation"]["chat_template_kwargs"] == THINK_OFF
    again, _ = _generate(b, tmp_path, "qwen3", chat_template=QWEN3, chat_template_kwargs=THINK_OFF)
    assert (again.new_conversations, again.generated, again.continued_rows) == (0, 2, 4)  # resumed by conversation
    st = compute_stats(out)  # `distill data stats`: 6 rows are 2 conversations, each ending once
    assert (st.rows, st.conversations, st.continued_rows, st.stop_reasons) == (6, 2, 4, {"completed": 2})


def test_qwen3_template_with_thinking_joins_turns_whose_history_renders_as_generated(hf_backend, tmp_path, hf_model):
    """The model writes no think block, so the template renders its replies back as the model saw them: one row."""
    summary, out = _generate(hf_backend, tmp_path, "qwen3", chat_template=QWEN3)
    assert (summary.generated, summary.continued_rows) == (2, 0)
    by_conv = _assert_rows_follow_the_template(out, hf_backend.tokenizer, QWEN3)
    for (row,) in by_conv.values():
        assert [t["role"] for t in row["turns"]] == ["user", "assistant"] * 3 and row["stop_reason"] == "completed"
        assert "<think>" not in _decode(hf_backend.tokenizer, row["input_ids"])
    assert assert_teacher_matches_model(out, hf_model, greedy=True) == summary.generated_tokens
    _assert_valid_and_trainable(out, summary.generated_tokens)


def test_llama3_template_starts_a_row_only_where_it_re_renders_a_reply(hf_backend, tmp_path, hf_model):
    summary, out = _generate(hf_backend, tmp_path, "llama3", chat_template=LLAMA3)
    by_conv = _assert_rows_follow_the_template(out, hf_backend.tokenizer, LLAMA3)
    assert summary.generated == 2 and summary.continued_rows == sum(len(rows) - 1 for rows in by_conv.values())
    assert summary.continued_rows  # the bundled model's replies open with a line break that `| trim` re-renders away
    assert all(r["input_ids"][0] == hf_backend.tokenizer.bos_token_id for rows in by_conv.values() for r in rows)
    assert assert_teacher_matches_model(out, hf_model, greedy=True) == summary.generated_tokens
    _assert_valid_and_trainable(out, summary.generated_tokens)
    # the template and its variables are part of what a resume must match
    with pytest.raises(StoreError, match="chat_template_sha256"):
        _generate(hf_backend, tmp_path, "llama3", chat_template=QWEN3)
    with pytest.raises(StoreError, match="chat_template_kwargs"):
        _generate(hf_backend, tmp_path, "llama3", chat_template=LLAMA3, chat_template_kwargs={"date_string": "1 Jan 2025"})


def test_reasoning_keep_strip_both_choose_the_think_blocks_messages_keep(hf_backend, tmp_path):
    from distill.data.inspect import conversation_view

    runs = {policy: _generate(hf_backend, tmp_path, policy, chat_template=QWEN3, chat_template_kwargs=THINK_OFF,
                              reasoning=policy)[1] for policy in ("keep", "strip", "both")}
    rows = {policy: list(iter_rows(out)) for policy, out in runs.items()}
    assert len(rows["keep"]) == 6
    for keep, strip, both in zip(rows["keep"], rows["strip"], rows["both"]):
        assert keep["input_ids"] == strip["input_ids"] == both["input_ids"]  # what the model saw and wrote, always
        replies = {p: [m["content"] for m in r["messages"] if m["role"] == "assistant"]
                   for p, r in (("keep", keep), ("strip", strip), ("both", both))}
        own = len(replies["keep"]) - 1  # each of these rows trains its last reply
        assert all(r.startswith(EMPTY_THINK) for r in replies["keep"])
        assert replies["strip"] == [strip_reasoning(r) for r in replies["keep"]] and "<think>" not in "".join(replies["strip"])
        assert replies["both"] == replies["strip"][:own] + replies["keep"][own:]
    for out in runs.values():
        assert validate_dataset(out).ok
    assert load_manifest(runs["strip"])["config_key"]["reasoning"] == "strip"
    # inspect pairs a continuing row's turns with its last messages
    view = conversation_view(runs["keep"], row_id="seed:c0#t2", tokenizer=hf_backend.tokenizer)
    assert [(t.role, t.content) for t in view.turns] == [("user", "Which one is bigger?"),
                                                          ("assistant", rows["keep"][2]["messages"][-1]["content"])]


def test_turns_cut_with_a_re_rendering_template_ends_as_truncated_turns(hf_backend, tmp_path):
    summary, out = _generate(hf_backend, tmp_path, "cut", chat_template=QWEN3, chat_template_kwargs=THINK_OFF, turns=2)
    assert [(r["id"], r["stop_reason"]) for r in iter_rows(out)] == [
        ("seed:c0", "continued"), ("seed:c0#t1", "truncated_turns"), ("seed:c1", "continued"), ("seed:c1#t1", "truncated_turns")]
    assert (summary.generated, summary.continued_rows) == (2, 2)
    # message-only exports: one entry per conversation, its last row's messages, under the conversation's id
    export(out, "openai", tmp_path / "chat.jsonl")
    lines = [json.loads(line) for line in (tmp_path / "chat.jsonl").read_text().splitlines()]
    assert [(e["id"], len(e["messages"])) for e in lines] == [("seed:c0", 4), ("seed:c1", 4)]
    # validate accepts the history inside a continuing row's first turn only for a continuing row's id
    shard = next(out.glob("shard-*.parquet"))
    table = pq.read_table(shard)
    ids = [i.replace("seed:c0#t1", "seed:c0-1") for i in table["id"].to_pylist()]
    pq.write_table(table.set_column(0, "id", pa.array(ids)), shard)
    problems = [(p.check, p.row) for p in validate_dataset(out).problems if p.check not in ("size", "checksum")]
    assert problems == [("turns", "seed:c0-1")]


def test_strip_reasoning_removes_think_blocks_and_never_empties_a_message():
    assert strip_reasoning(EMPTY_THINK + "Paris.") == "Paris."
    assert strip_reasoning("<think>\nweigh it\n</think>\n\nParis.") == "Paris."
    assert strip_reasoning("the prompt opened the block</think>\n\nParis.") == "Paris."  # R1-style: no opening tag
    assert strip_reasoning("Paris. <think>cut off by the length limit") == "Paris."
    assert strip_reasoning("<think>all reasoning, cut off") == "<think>all reasoning, cut off"  # nothing else: kept
    assert strip_reasoning("  no think block ") == "  no think block "


def test_template_options_are_checked_before_anything_runs(tmp_path):
    with pytest.raises(ConfigError, match="--chat-template-kwargs must be a JSON object"):
        GenerateConfig(chat_template_kwargs="{enable_thinking: false")
    with pytest.raises(ConfigError, match="may not set add_generation_prompt"):
        GenerateConfig(chat_template_kwargs={"add_generation_prompt": False})
    with pytest.raises(ConfigError, match="--reasoning must be one of keep, strip, both"):
        GenerateConfig(reasoning="drop")
    with pytest.raises(ConfigError, match="no such file"):
        GenerateConfig(chat_template=str(tmp_path / "missing.jinja"))
    (tmp_path / "t.jinja").write_text(QWEN3)
    cfg = GenerateConfig(chat_template=str(tmp_path / "t.jinja"), chat_template_kwargs='{"enable_thinking": false}')
    assert cfg.chat_template_kwargs == THINK_OFF


def test_cli_passes_the_template_file_and_its_kwargs_to_generate(tmp_path, cli_env):
    (tmp_path / "qwen3.jinja").write_text(QWEN3)
    out = tmp_path / "out"
    args = ["generate", "--backend", "hf", "--seed", _seed(tmp_path), "--mode", "single-turn", "--limit", "1",
            "--max-tokens", "2", "--dtype", "float32", "--out", str(out), "--quiet",
            "--chat-template", str(tmp_path / "qwen3.jinja"), "--chat-template-kwargs", '{"enable_thinking": false}']
    proc = run_distill([*args], env=cli_env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = iter_rows(out)
    assert row["messages"][-1]["content"].startswith(EMPTY_THINK)
    assert load_manifest(out)["meta"]["generation"]["chat_template_kwargs"] == THINK_OFF
    bad = run_distill([*args[:-1], "{enable_thinking: false}"], env=cli_env, cwd=REPO)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and bad.stderr.startswith("error: --chat-template-kwargs")


def test_seed_conversion_with_a_think_stripping_template_gives_a_row_per_turn(tmp_path, model_dir):
    from distill.data.convert import seed_to_shards

    seed = tmp_path / "think.jsonl"
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
                {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "<think>\nadd again\n</think>\n\n6"}]
    seed.write_text(json.dumps({"id": "t", "messages": messages}) + "\n")
    summary = seed_to_shards(str(seed), tmp_path / "shards", model=str(model_dir), chat_template=QWEN3)
    rows = list(iter_rows(tmp_path / "shards"))
    assert summary.rows == 2 and [(r["id"], r["stop_reason"]) for r in rows] == [("think:t", "continued"),
                                                                                 ("think:t#t1", "completed")]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    second = _decode(tok, rows[1]["input_ids"])
    assert "add\n" not in second and second.endswith("<think>\nadd again\n</think>\n\n6<|im_end|>\n")  # history stripped
    assert second.startswith(_render(tok, messages[:3], QWEN3, None))
    assert validate_dataset(tmp_path / "shards").ok
    plain = seed_to_shards(str(seed), tmp_path / "plain", model=str(model_dir))  # the model's own template joins them
    assert plain.rows == 1


def test_bench_renders_its_prompts_with_the_template_and_its_kwargs(tokenizer):
    from distill.bench import BenchConfig
    from distill.bench.runner import chat_ids

    question = [{"role": "user", "content": "Hi"}]
    ids = chat_ids(tokenizer, question, QWEN3, THINK_OFF)
    assert _decode(tokenizer, ids) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n" + EMPTY_THINK
    assert chat_ids(tokenizer, question) == tokenizer.apply_chat_template(question, add_generation_prompt=True,
                                                                          tokenize=True, return_dict=True)["input_ids"]
    assert BenchConfig.from_options(heads="h", chat_template_kwargs='{"enable_thinking": false}').chat_template_kwargs == THINK_OFF
    with pytest.raises(ConfigError, match="may not set tokenize"):
        BenchConfig.from_options(heads="h", chat_template_kwargs={"tokenize": True})
