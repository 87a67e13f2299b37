"""`distill data convert`: real shards to ShareGPT / OpenAI / datasets, and seed data to teacher-less shards."""

from __future__ import annotations

import json

import pytest

from conftest import run_distill
from distill.data.convert import export, seed_to_shards
from distill.data.stats import compute_stats
from distill.data.validate import validate_dataset
from distill.store import iter_rows, load_manifest


@pytest.mark.vllm
def test_exports_carry_every_conversation(real_shards, tmp_path, cli_env):
    rows = list(iter_rows(real_shards, columns=["id", "messages"]))
    r = run_distill(["data", "convert", str(real_shards), "--format", "sharegpt", "--out", str(tmp_path / "c.json")], env=cli_env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["rows"] == 16
    sharegpt = json.loads((tmp_path / "c.json").read_text())
    role = {"system": "system", "user": "human", "assistant": "gpt"}
    assert [c["id"] for c in sharegpt] == [r["id"] for r in rows]
    assert sharegpt[3]["conversations"] == [{"from": role[m["role"]], "value": m["content"]} for m in rows[3]["messages"]]

    assert export(real_shards, "openai", tmp_path / "c.jsonl").rows == 16
    lines = [json.loads(line) for line in (tmp_path / "c.jsonl").read_text().splitlines()]
    assert lines == [{"id": r["id"], "messages": r["messages"]} for r in rows]

    import datasets

    assert export(real_shards, "hf", tmp_path / "hf").rows == 16
    ds = datasets.load_from_disk(str(tmp_path / "hf"))
    assert ds.num_rows == 16 and ds[5]["id"] == rows[5]["id"]
    assert str(ds.features["teacher_ids"]) == "List(Value('uint16'))"

    r = run_distill(["data", "convert", str(real_shards), "--format", "csv", "--out", str(tmp_path / "x")], env=cli_env)
    assert r.returncode == 2 and "--format must be one of" in r.stderr


@pytest.mark.vllm
def test_exported_messages_convert_back_to_teacherless_shards(real_shards, tmp_path):
    export(real_shards, "openai", tmp_path / "c.jsonl")
    summary = seed_to_shards(str(tmp_path / "c.jsonl"), tmp_path / "shards", shard_rows=7)
    assert summary.rows == 16 and not summary.rejected
    report = validate_dataset(tmp_path / "shards")
    assert report.ok, [str(p) for p in report.problems]
    manifest = load_manifest(tmp_path / "shards")
    assert manifest["meta"]["teacher"] is None and manifest["totals"]["shards"] == 3
    original = {r["id"]: r for r in iter_rows(real_shards)}
    for row in iter_rows(tmp_path / "shards"):
        src = original[row["id"].split(":", 1)[1]]
        assert row["messages"] == src["messages"] and row["teacher_ids"] == [] and row["teacher_lp"] == []
        first_user = src["turns"][0]
        assert row["input_ids"][: first_user["end"]] == src["input_ids"][: first_user["end"]]  # same template, same prompt
        assert row["n_generated_tokens"] == sum(row["loss_mask"]) > 0
    st = compute_stats(tmp_path / "shards")
    assert st.teacher is None and st.conversations == 16 and st.assistant_turns == 32

    from huggingface_hub import DatasetCard

    from distill.hub import CardOptions, push

    push(tmp_path / "shards", CardOptions("me/hard-targets"), dry_run=tmp_path / "dry")
    card = DatasetCard.load(tmp_path / "dry" / "README.md")
    assert "no teacher columns" in card.text and "distill data convert" in card.text and "np.cumsum" not in card.text
    assert card.data.configs[0]["data_files"] == [{"split": "train", "path": "data/train/*.parquet"}]


def test_seed_conversion_drops_trailing_user_turns_and_rejects_reply_less_rows(tmp_path, model_dir):
    seed = tmp_path / "seed.jsonl"
    convs = [
        {"id": "a", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                                 {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye?"}]},
        {"id": "b", "messages": [{"role": "user", "content": "Only a question"}]},
        {"id": "c", "messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": "x"}]},
    ]
    seed.write_text("".join(json.dumps(c) + "\n" for c in convs))
    summary = seed_to_shards(str(seed), tmp_path / "out", model=str(model_dir))
    assert summary.rows == 1 and summary.trailing_user_turns == 1
    assert summary.rejected == {"no_assistant_turn": 1, "empty_text": 1}
    row = next(iter_rows(tmp_path / "out"))
    assert [m["role"] for m in row["messages"]] == ["system", "user", "assistant"]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    targets = [t for t, m in zip(row["input_ids"], row["loss_mask"]) if m]
    assert tok.decode(targets) == "Hello!<|im_end|>"  # the reply and the end-of-turn token are the targets
    assert tok.decode(row["input_ids"]) == tok.apply_chat_template(row["messages"], tokenize=False)
    assert validate_dataset(tmp_path / "out").ok
    reasons = {json.loads(line)["reason"] for line in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()}
    assert reasons == {"no_assistant_turn", "empty_text"}


def test_trl_export_decodes_the_teacher_into_lists_aligned_with_input_ids(real_shards, tmp_path):
    import datasets
    import numpy as np

    from distill.store import TeacherEncoding, decode_row_dense

    out = tmp_path / "trl"
    assert export(real_shards, "trl", out).rows == 16
    ds = datasets.load_dataset("parquet", data_dir=str(out), split="train")
    assert ds.column_names == ["id", "messages", "input_ids", "assistant_masks", "teacher_topk_ids", "teacher_topk_logprobs"]
    enc = TeacherEncoding.from_dict(load_manifest(real_shards)["meta"]["teacher"])
    stored = {r["id"]: r for r in iter_rows(real_shards)}
    for row in ds:
        src = stored[row["id"]]
        assert row["input_ids"] == src["input_ids"] and row["messages"] == src["messages"]
        assert row["assistant_masks"] == [int(m) for m in src["loss_mask"]]
        ids, lps = decode_row_dense(src["input_ids"], src["loss_mask"], src["teacher_ids"], src["teacher_lp"], enc)
        for t, generated in enumerate(src["loss_mask"]):
            if generated:
                assert row["teacher_topk_ids"][t] == ids[t].tolist()
                assert np.allclose(row["teacher_topk_logprobs"][t], lps[t])
            else:
                assert row["teacher_topk_ids"][t] == [] and row["teacher_topk_logprobs"][t] == []


def test_specforge_export_is_its_conversation_jsonl(real_shards, tmp_path):
    out = tmp_path / "sf.jsonl"
    assert export(real_shards, "specforge", out).rows == 16
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    stored = {r["id"]: r["messages"] for r in iter_rows(real_shards)}
    assert {line["id"] for line in lines} == set(stored)
    for line in lines:
        assert set(line) == {"id", "conversations"} and line["conversations"] == stored[line["id"]]
        assert all(set(m) == {"role", "content"} and m["role"] in ("system", "user", "assistant") for m in line["conversations"])
