"""`distill generate --samples N`, `--top-k`, `--min-p`, `--repetition-penalty`, on the real model and engines.

Every test keeps sequences short (a few seed rows, 6-16 new tokens a turn).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import ARGMAX_TOL, REPO, assert_same_rows, assert_teacher_matches_model, run_distill
from distill.conversation import seed_conversation_id
from distill.data.transform import dedupe, eval_side, merge, split
from distill.data.validate import validate_dataset
from distill.errors import ConfigError
from distill.generate import GenerateConfig, Generator
from distill.store import iter_rows, load_manifest

BACKENDS = ["vllm_backend", "hf_backend"]


def _seed(tmp_path, convs: list[list[str]], name="seed.jsonl"):
    """A seed file of conversations given as their user turns (with short seed replies between them)."""
    path = tmp_path / name
    lines = []
    for i, users in enumerate(convs):
        msgs = []
        for u in users:
            msgs += [{"role": "user", "content": u}, {"role": "assistant", "content": "Sure."}]
        lines.append(json.dumps({"id": f"c{i}", "messages": msgs}))
    path.write_text("\n".join(lines) + "\n")
    return path


def _run(backend, out, **options):
    cfg = GenerateConfig(out=str(out), dtype="float32", **options)
    return Generator(cfg, backend=backend).run()


def _replies(row) -> list[str]:
    return [m["content"] for m in row["messages"] if m["role"] == "assistant"]


def test_samples_are_independent_resumable_and_more_can_be_added(vllm_backend, tmp_path, hf_model):
    seed = _seed(tmp_path, [["Name a fruit.", "Another one?"], ["Write a short poem about the sea.", "Shorter?"]])
    opts = dict(seed=str(seed), max_new_tokens=12, temperature=1.0, top_p=0.95)
    out = tmp_path / "out"
    s = _run(vllm_backend, out, samples=3, **opts)
    assert (s.seed_rows, s.samples, s.generated, s.rejected, s.skipped, s.rows) == (2, 3, 6, 0, 0, 6) and s.balanced
    rows = list(iter_rows(out))
    assert [r["id"] for r in rows] == [f"seed:c{i}#s{j}" for i in range(2) for j in range(3)]  # seed order, then sample
    for i in range(2):
        group = [r for r in rows if seed_conversation_id(r["id"]) == f"seed:c{i}"]
        assert all(len(_replies(r)) == 2 and r["stop_reason"] == "completed" for r in group)  # each replays every user turn
        assert len({tuple(r["input_ids"]) for r in group}) == 3  # independent completions, not copies
    manifest = load_manifest(out)
    assert manifest["totals"]["seed_rows"] == 2 and manifest["totals"]["samples"] == 3 and manifest["totals"]["rows"] == 6
    assert manifest["meta"]["sampling"]["samples"] == 3 and manifest["config_key"]["sample_ids"] is True
    assert validate_dataset(out).ok
    assert assert_teacher_matches_model(out, hf_model, greedy=False) == s.generated_tokens

    again = _run(vllm_backend, out, samples=3, **opts)  # a rerun finds every sample done
    assert again.new_conversations == 0 and again.generated == 6
    more = _run(vllm_backend, out, samples=4, **opts)  # more samples: only #s3 is new, the others are kept as they were
    assert (more.new_conversations, more.generated, more.rows) == (2, 8, 8) and more.balanced
    now = {r["id"]: r for r in iter_rows(out)}
    assert all(now[r["id"]]["input_ids"] == r["input_ids"] for r in rows)
    assert {"seed:c0#s3", "seed:c1#s3"} <= set(now) and validate_dataset(out).ok
    with pytest.raises(ConfigError, match=r"holds 4 samples beyond --samples 2 \(e.g. seed:c1#s3\)"):
        _run(vllm_backend, out, samples=2, **opts)

    fresh = _run(vllm_backend, tmp_path / "fresh", samples=2, **opts)  # sample i does not depend on how many are drawn
    assert fresh.generated == 4
    assert {r["id"]: r["input_ids"] for r in iter_rows(tmp_path / "fresh")} == \
        {r["id"]: r["input_ids"] for r in rows if r["id"].endswith(("#s0", "#s1"))}


def test_self_talk_samples_simulate_different_users(vllm_backend, tmp_path, hf_model):
    s = _run(vllm_backend, tmp_path / "out", seed="chitchat", mode="self-talk", turns=2, limit=1, samples=2,
             max_new_tokens=10, temperature=1.0)
    assert (s.generated, s.rows, s.skipped) == (2, s.seed_rows * 2, (s.seed_rows - 1) * 2) and s.balanced
    a, b = list(iter_rows(tmp_path / "out"))
    assert a["id"].endswith("#s0") and b["id"] == a["id"][:-1] + "1"
    users = [[m["content"] for m in r["messages"] if m["role"] == "user"] for r in (a, b)]
    assert users[0][0] == users[1][0]  # one seed opener ...
    assert a["input_ids"] != b["input_ids"]  # ... two conversations (own replies, own simulated user)
    assert validate_dataset(tmp_path / "out").ok
    assert assert_teacher_matches_model(tmp_path / "out", hf_model, greedy=False) == s.generated_tokens


def test_samples_split_by_part_merge_dedupe_and_split_as_one_conversation(vllm_backend, tmp_path):
    # c0 and c2 ask the same question (a duplicate prompt); c1 and c3 differ
    seed = _seed(tmp_path, [["Name a colour."], ["What is the capital of Italy?"], ["Name a colour."], ["Count to three."]])
    opts = dict(seed=str(seed), mode="single-turn", samples=3, max_new_tokens=6, temperature=1.0)
    whole = _run(vllm_backend, tmp_path / "whole", **opts)
    parts = [_run(vllm_backend, tmp_path / f"part{i}", part=f"{i}/2", **opts) for i in range(2)]
    assert whole.generated == 12 and [(p.generated, p.skipped) for p in parts] == [(6, 6), (6, 6)]
    assert all(p.balanced for p in parts)
    part0 = {seed_conversation_id(r["id"]) for r in iter_rows(tmp_path / "part0")}
    assert part0 == {"seed:c0", "seed:c2"}  # every sample of a seed row in its row's part
    merge([tmp_path / "part0", tmp_path / "part1"], tmp_path / "merged")
    assert {r["id"]: r["input_ids"] for r in iter_rows(tmp_path / "merged")} == \
        {r["id"]: r["input_ids"] for r in iter_rows(tmp_path / "whole")}
    assert validate_dataset(tmp_path / "merged").ok

    d = dedupe(tmp_path / "whole", tmp_path / "dedup")  # c2 repeats c0's prompt: its 3 samples go; c0's 3 stay
    assert d.rows_out["out"] == 9 and d.dropped == {"duplicate_exact": 3}
    kept = [r["id"] for r in iter_rows(tmp_path / "dedup")]
    assert sum(seed_conversation_id(i) == "seed:c0" for i in kept) == 3 and not any("c2#" in i for i in kept)

    ids = [r["id"] for r in iter_rows(tmp_path / "whole")]
    fraction = 0.5
    assert len({eval_side(i, fraction) for i in ids if i.startswith("seed:c1#")}) == 2  # by row id, c1's samples would part
    split(tmp_path / "whole", tmp_path / "split", eval_fraction=fraction)
    sides = {name: [r["id"] for r in iter_rows(tmp_path / "split" / name)] for name in ("train", "eval")}
    assert sorted(sides["train"] + sides["eval"]) == sorted(ids)
    for name, side_ids in sides.items():
        assert {seed_conversation_id(i) for i in side_ids}.isdisjoint(
            {seed_conversation_id(i) for n, other in sides.items() if n != name for i in other})  # nothing held out leaks
        assert all(eval_side(seed_conversation_id(i), fraction) == (name == "eval") for i in side_ids)
        assert validate_dataset(tmp_path / "split" / name).ok


def test_hf_samples_do_not_depend_on_the_batch_size(tmp_path):
    """The per-request seed contract on the transformers backend: one generator per row, not per batch."""
    opts = dict(seed="mt-bench", mode="single-turn", limit=3, samples=2, max_new_tokens=10, temperature=0.9, top_p=0.95,
                backend="hf", dtype="float32")
    outs = []
    for bs in (1, 4):
        out = tmp_path / f"bs{bs}"
        s = Generator(GenerateConfig(out=str(out), batch_size=bs, **opts)).run()
        assert s.generated == 6 and s.balanced
        outs.append(out)
    assert_same_rows(outs[0], outs[1])  # the same tokens, token for token; teacher within the encoding error
    assert len({tuple(r["input_ids"]) for r in iter_rows(outs[0])}) == 6  # sampled: every row its own


def test_row_sampler_draws_each_row_from_its_own_seed_and_the_warped_distribution():
    """The transformers backend's sampler on tiny synthetic logits (no model)."""
    import torch

    from distill.generate.backends import Request, RowSampler

    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, -3.0])  # (V,)

    def draws(seeds: list[int], steps: int = 3000, **sampling) -> torch.Tensor:
        reqs = [Request([1], 8, seed, 0, **sampling) for seed in seeds]
        sampler = RowSampler(reqs, 1, "cpu")
        ids = torch.ones(len(reqs), 1, dtype=torch.long)  # (B, 1)
        return torch.stack([sampler(ids, logits.expand(len(reqs), -1).clone()).argmax(-1) for _ in range(steps)])  # (steps, B)

    alone = draws([7], temperature=0.8, top_k=3)[:, 0]
    assert torch.equal(draws([1, 7, 3], temperature=0.8, top_k=3)[:, 1], alone)  # its own seed only, wherever it sits
    assert not torch.equal(draws([8], temperature=0.8, top_k=3)[:, 0], alone)
    freq = torch.bincount(alone, minlength=5).double() / alone.numel()
    want = torch.softmax(logits[:3].double() / 0.8, -1)
    assert freq[3:].sum() == 0 and (freq[:3] - want).abs().max() < 0.03  # top-k 3 of the tempered distribution

    # the repetition penalty counts the row's own tokens, not the left padding (pad id 0 here)
    x = torch.tensor([[1.0, 0.9, 0.0], [1.0, 0.9, 0.0]])  # (B, V)
    reqs = [Request([2], 8, 0, 0, temperature=0.0, repetition_penalty=2.0), Request([0, 2], 8, 0, 0, temperature=0.0,
                                                                                   repetition_penalty=2.0)]
    chosen = RowSampler(reqs, 2, "cpu")(torch.tensor([[0, 2], [0, 2]]), x).argmax(-1)
    assert chosen.tolist() == [0, 1]  # row 0's token 0 is padding; row 1 said it (1.0 / 2 < 0.9)


def _assert_penalized_greedy(out, model, penalty: float) -> int:
    """Every generated token is the argmax of the raw logits after vLLM's repetition penalty over every token before it
    (the turn's prompt is the conversation so far); returns the positions checked."""
    import torch

    checked = 0
    for row in iter_rows(out):
        ids = torch.tensor(row["input_ids"])[None]  # (1, T)
        with torch.inference_mode():
            logits = model(ids).logits[0].float()  # (T, V)
        for p in np.flatnonzero(row["loss_mask"]):
            x = logits[p - 1].clone()  # (V,)
            seen = torch.zeros_like(x, dtype=torch.bool)
            seen[ids[0, :p]] = True
            x = torch.where(seen, torch.where(x > 0, x / penalty, x * penalty), x)
            gap = float(x.max() - x[row["input_ids"][p]])
            assert gap <= ARGMAX_TOL * penalty, f"{row['id']} position {p}: {gap:.4f} below the penalized argmax"
            checked += 1
    return checked


@pytest.mark.parametrize("backend", BACKENDS)
def test_sampling_options_change_what_is_sampled_never_the_stored_teacher(request, backend, tmp_path, hf_model):
    b = request.getfixturevalue(backend)
    seed = _seed(tmp_path, [["Repeat after me: la la la la.", "Again, please."], ["List three animals."]])
    opts = dict(seed=str(seed), max_new_tokens=12)
    tokens = {}
    for name, extra in (("greedy", dict(temperature=0.0)), ("top_k_1", dict(temperature=1.0, top_k=1)),
                        ("min_p_1", dict(temperature=1.0, min_p=1.0)),
                        ("penalty", dict(temperature=0.0, repetition_penalty=1.5))):
        s = _run(b, tmp_path / name, **opts, **extra)
        assert s.generated == 2 and s.balanced
        tokens[name] = {r["id"]: r["input_ids"] for r in iter_rows(tmp_path / name)}
        meta = load_manifest(tmp_path / name)["meta"]
        for key, value in extra.items():
            assert meta["sampling"][key] == value and meta["config_key"][key] == value
    # top_k=1 and min_p=1 leave only the most likely token: greedy output at temperature 1
    assert tokens["top_k_1"] == tokens["greedy"] == tokens["min_p_1"]
    # the penalty changes what is sampled ...
    assert tokens["penalty"] != tokens["greedy"]
    checked = _assert_penalized_greedy(tmp_path / "penalty", hf_model, 1.5)
    # ... never the stored teacher: the raw model's top-k at every generated position
    assert assert_teacher_matches_model(tmp_path / "penalty", hf_model, greedy=False) == checked
    assert validate_dataset(tmp_path / "penalty").ok


def test_openai_backend_sends_the_sampling_options_and_matches_the_in_process_engine(vllm_server, vllm_backend, tmp_path,
                                                                                    model_dir):
    from distill.generate.backends import BackendOptions
    from distill.generate.openai_server import OpenAIBackend, ServerOptions

    seed = _seed(tmp_path, [["Name a fruit.", "Another one?"], ["Say something nice."]])
    opts = dict(seed=str(seed), max_new_tokens=10, temperature=0.8, top_k=20, min_p=0.02, repetition_penalty=1.2,
                samples=2)
    ref = _run(vllm_backend, tmp_path / "ref", **opts)
    server = OpenAIBackend(model_dir, BackendOptions(dtype="float32"), ServerOptions((vllm_server.url,), concurrency=4))
    got = _run(server, tmp_path / "server", **opts)
    assert (got.generated, got.rows) == (ref.generated, ref.rows) == (4, 4)
    assert_same_rows(tmp_path / "server", tmp_path / "ref")  # one seed per sample and turn: the same draws
    assert load_manifest(tmp_path / "server")["meta"]["sampling"]["repetition_penalty"] == 1.2


@pytest.mark.parametrize("options, message", [
    (dict(samples=0), "--samples must be >= 1"),
    (dict(samples=2, temperature=0.0), "--samples 2 needs --temperature > 0"),
    (dict(top_k=-1), "--top-k must be >= 0"),
    (dict(min_p=1.5), r"--min-p must be in \[0, 1\]"),
    (dict(repetition_penalty=0.0), "--repetition-penalty must be > 0"),
])
def test_bad_sampling_options_are_config_errors(options, message):
    with pytest.raises(ConfigError, match=message):
        GenerateConfig(**options)


def test_the_command_line_takes_the_sampling_options_and_counts_rows(tmp_path, cli_env):
    out = tmp_path / "o"
    r = run_distill(["generate", "--backend", "hf", "--seed", "mt-bench", "--mode", "single-turn", "--limit", "1", "--max-tokens",
                     "4", "--samples", "2", "--top-k", "5", "--set", "min_p=0.1", "--repetition-penalty", "1.1", "--dtype", "float32",
                     "--out", str(out), "-q"], env=cli_env, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert "2 generated + 0 rejected + 158 skipped = 160 rows (80 seed rows x 2 samples)" in r.stdout
    sampling = load_manifest(out)["meta"]["sampling"]
    assert (sampling["samples"], sampling["top_k"], sampling["min_p"], sampling["repetition_penalty"]) == (2, 5, 0.1, 1.1)
    assert [r["id"] for r in iter_rows(out)] == ["mt-bench:81#s0", "mt-bench:81#s1"]

    bad = run_distill(["generate", "--samples", "3", "--temperature", "0", "--out", str(tmp_path / "b")], env=cli_env, cwd=REPO)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "error: --samples 3 needs --temperature > 0: greedy decoding gives 3 identical completions"]


def test_a_dataset_card_reproduces_the_sampling_options_and_the_limit_in_seed_rows():
    from distill.hub.card import reproduce_command

    meta = {"teacher": {"k": 4}, "config_key": {"model_id": "m/x", "seed": "mt-bench", "temperature": 0.8, "top_k": 5,
                                                "repetition_penalty": 1.1, "sample_ids": True}}
    totals = {"seed_rows": 80, "samples": 3, "skipped": 228, "generated": 12}  # 4 seed rows x 3 samples generated
    assert reproduce_command(meta, totals) == ("distill generate --model m/x --seed mt-bench --temperature 0.8 --top-k 5 "
                                               "--repetition-penalty 1.1 --samples 3 --limit 4 --out data")
