"""The lookup proposer's trees merged with an EAGLE drafter's (distill.engine.union): the merge, greedy == plain greedy,
lossless rejection sampling, and the engine's and CLI's plumbing.

The decoding tests run the tiny random Llama of tests/test_engine_eagle.py (vocabulary 8, where both proposers' drafts
are often right) and the bundled SmolLM2 on real MT-Bench first turns with an untrained drafter.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from conftest import DISTILL, MT_QUESTIONS, MT_TOKENS
from distill.engine import Engine, EngineConfig, SamplingParams
from distill.engine.eagle import Eagle
from distill.engine.lookup import Lookup
from distill.engine.proposer import host_proposal
from distill.engine.union import Union, merge, paths, shares
from distill.errors import ConfigError
from test_engine_eagle import build_tiny, bundled_drafter, joining_rows_decode_as_plain
from test_engine_sampling import ALPHA, CONT, SAMPLES, chi2_pvalue, exact_distribution


def test_a_budget_is_shared_in_proportion_each_part_at_least_one_node_none_past_its_full_tree():
    assert shares(32, [8, 24]) == [8, 24] and shares(100, [8, 24]) == [8, 24]  # the full tree: every part's own
    assert shares(16, [8, 24]) == [4, 12] and shares(4, [8, 24]) == [1, 3]
    assert shares(2, [8, 24]) == [1, 1] and shares(1, [8, 24]) == [1, 0] and shares(0, [8, 24]) == [0, 0]
    for n in range(0, 40):
        s = shares(n, [8, 24])
        assert sum(s) == min(n, 32) and s[0] <= 8 and s[1] <= 24


def test_the_merged_tree_keeps_every_part_s_paths_once_parents_first():
    a = [((5,), 5), ((5, 6), 6), ((7,), 7)]
    b = [((5,), 5), ((9,), 9), ((5, 6), 6), ((5, 6, 1), 1), ((5, 2), 2)]
    tree = merge([a, b])
    assert tree == [(0, 5), (1, 6), (0, 7), (0, 9), (2, 1), (1, 2)]
    # the proposal of the merged trees: per-row buffers, the first row padded with distinct root children
    root = torch.tensor([3, 4])
    prop = host_proposal(root, [merge([a]), tree])
    assert prop.tokens.shape == (2, 7) and prop.tokens[:, 0].tolist() == [3, 4]
    got = paths(prop, 2)
    assert [p for p, _ in got[1]] == [(5,), (5, 6), (7,), (9,), (5, 6, 1), (5, 2)]
    first = [p for p, _ in got[0]]
    assert first[:3] == [(5,), (5, 6), (7,)] and all(len(p) == 1 for p in first[3:])
    kids = [p[0] for p in first if len(p) == 1]
    assert len(kids) == len(set(kids))  # fillers never repeat a sibling's token


@pytest.fixture(scope="module")
def tiny():
    return build_tiny()


def tiny_union(tiny, acceptance="greedy", lookup_nodes=4) -> Engine:
    model, drafter = tiny
    cfg = EngineConfig(acceptance=acceptance, max_batch=SAMPLES, speculate_max_batch=SAMPLES, draft_nodes=6, draft_depth=3,
                       draft_topk=2)
    return Engine(model, None, drafter, cfg, model_name="tiny", lookup=Lookup(max_nodes=lookup_nodes, depth=3))


@pytest.mark.usefixtures("one_torch_thread")
def test_tiny_greedy_union_equals_plain_greedy_batched_and_joining(tiny):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 8, (n,), generator=g).tolist() for n in (1, 4, 9, 2, 6, 3, 12, 5)]
    engine = tiny_union(tiny)
    assert isinstance(engine.proposer, Union) and engine.proposer.name == "lookup+eagle3"
    assert engine.proposer.max_nodes == 10 and engine.max_tree_size == 11 and isinstance(engine.trained, Eagle)
    engine.config.max_batch = 8
    sp = SamplingParams(max_tokens=20)
    plain = [engine.generate([p], sp, speculative=False)[0][0].token_ids for p in prompts]
    batched, stats = engine.generate(prompts, [sp] * len(prompts))
    assert [r.token_ids for r in batched] == plain
    assert 6 < stats.tree_nodes <= 10  # more than the drafter's own 6 nodes: the lookup's paths joined them
    assert max(a for r in batched for a in r.accepted) >= 3
    one = [engine.generate([p], sp)[0][0].token_ids for p in prompts]
    assert one == plain
    joining_rows_decode_as_plain(engine, prompts, plain)  # both parts' states move with the rows


@pytest.mark.usefixtures("one_torch_thread")
def test_union_accepts_at_least_what_either_part_accepts_on_the_same_context(tiny):
    """One step from the same context: the merged tree holds both parts' trees, so it accepts their longer path."""
    model, drafter = tiny
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 8, (12,), generator=g).tolist() for _ in range(24)]
    cfg = dict(max_batch=24, speculate_max_batch=24, draft_nodes=6, draft_depth=3, draft_topk=2)
    first = {}
    for name, engine in {
        "lookup": Engine(model, None, Lookup(max_nodes=4, depth=3), EngineConfig(**cfg), model_name="tiny"),
        "eagle": Engine(model, None, drafter, EngineConfig(**cfg), model_name="tiny"),
        "union": tiny_union(tiny),
    }.items():
        res, _ = engine.generate(prompts, SamplingParams(max_tokens=2))
        first[name] = [r.accepted[0] for r in res]
    assert all(u >= max(a, b) for u, a, b in zip(first["union"], first["lookup"], first["eagle"]))
    assert sum(first["union"]) > max(sum(first["lookup"]), sum(first["eagle"]))


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_union_rejection_sampling_is_lossless(tiny, temperature, top_p):
    prompt = [1, 5, 2, 1, 5]
    exact = exact_distribution(tiny[0], prompt, temperature, top_p)
    params = [SamplingParams(max_tokens=CONT, temperature=temperature, top_p=top_p, seed=i) for i in range(SAMPLES)]
    results, _ = tiny_union(tiny, "rejection").generate([prompt] * SAMPLES, params)
    assert all(len(r.token_ids) == CONT for r in results)
    assert max(a for r in results for a in r.accepted) >= 2
    assert chi2_pvalue([r.token_ids for r in results], exact) > ALPHA
    typical, _ = tiny_union(tiny, "typical").generate([prompt] * SAMPLES, params)  # the test can fail: a biased rule
    assert chi2_pvalue([r.token_ids for r in typical], exact) < ALPHA


def test_union_settings_are_checked(tiny, tmp_path):
    model, drafter = tiny
    with pytest.raises(ConfigError, match="merges with Medusa heads or an EAGLE drafter"):
        Engine(model, None, Lookup(), EngineConfig(), model_name="tiny", lookup=Lookup())
    with pytest.raises(ConfigError, match="two or more"):
        Union([Lookup()])
    with pytest.raises(ConfigError, match="pass their folder as heads"):
        Engine.from_pretrained(None, "lookup", EngineConfig(lookup=True))
    with pytest.raises(ConfigError, match="pass their folder as heads"):
        Engine.from_pretrained(None, None, EngineConfig(lookup=True))


def test_greedy_union_equals_plain_greedy_on_mt_bench(hf_model, tokenizer, mt_prompts, mt_plain):
    engine = Engine(hf_model, tokenizer, bundled_drafter(hf_model, "fresh"),
                    EngineConfig(speculate_max_batch=8, draft_nodes=12, draft_depth=4, draft_topk=4), lookup=Lookup(max_nodes=8))
    results, stats = engine.generate(mt_prompts, SamplingParams(max_tokens=MT_TOKENS))  # batch 3
    assert [r.token_ids for r in results] == mt_plain
    assert stats.tree_nodes > 12 and stats.batch_size == MT_QUESTIONS
    one, _ = engine.generate([mt_prompts[0]], SamplingParams(max_tokens=MT_TOKENS))
    assert one[0].token_ids == mt_plain[0]


def test_the_lookup_switch_is_checked_where_users_give_it():
    from distill.benchmark.config import BenchConfig
    from distill.serve.config import ServeConfig

    for heads in ("lookup", None):
        with pytest.raises(ConfigError, match="--lookup merges"):
            ServeConfig(heads=heads, lookup=True)
    with pytest.raises(ConfigError, match="--lookup merges"):
        BenchConfig(heads="lookup", lookup=True)
    with pytest.raises(ConfigError, match="--lookup is for --engine distill"):
        ServeConfig(heads="out/heads", engine="vllm", lookup=True)
    with pytest.raises(ConfigError, match=r"it needs --heads lookup \(or --lookup\)"):
        BenchConfig(heads="out/heads", lookup_data="out/data")
    with pytest.raises(ConfigError, match="--lookup-nodes must be >= 1"):
        BenchConfig(heads="lookup", lookup_nodes=0)
    assert BenchConfig(heads="out/heads", lookup=True, lookup_data="out/data", lookup_history=0, lookup_nodes=16).lookup


def test_bench_cli_runs_a_trained_drafter_with_the_lookup_merged_in(tmp_path_factory, real_shards, cli_env):
    from distill.train import TrainConfig, train

    out = tmp_path_factory.mktemp("union-bench") / "drafter"
    train(TrainConfig(data=str(real_shards), out=str(out), arch="eagle3", steps=4, max_len=64, batch_size=4, lr=3e-3,
                      warmup_steps=1, seed=0, progress=False))
    b = out.parent / "bench"
    r = subprocess.run([DISTILL, "bench", "--heads", str(out), "--lookup", "--lookup-data", str(real_shards), "--full-tree",
                        "--draft-nodes", "8", "--lookup-nodes", "4", "--limit", "1", "--max-tokens", "12", "--modes", "greedy", "--out", str(b)],
                       capture_output=True, text=True, env=cli_env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads((b / "bench.json").read_text())
    assert doc["tree"]["proposer"] == "lookup+eagle3" and doc["tree"]["nodes"] == 12  # the lookup's 4 and the drafter's 8
    assert "datastore" in doc["tree"]["source"] and "eagle3 dynamic" in doc["tree"]["source"]
    assert doc["config"]["lookup"] is True and {g["identical"] for g in doc["groups"]} == {1}


def test_greedy_union_with_medusa_heads_equals_plain_greedy_on_mt_bench(hf_model, tokenizer, mt_prompts, mt_plain):
    from test_engine_decoding import make_heads

    heads = make_heads(hf_model, random_w1=True, seed=3)
    engine = Engine(hf_model, tokenizer, heads, EngineConfig(tree="sparse-8", speculate_max_batch=8), lookup=Lookup(max_nodes=8))
    assert engine.proposer.name == "lookup+medusa" and engine.heads is heads and len(engine.tree.paths) == 8
    results, stats = engine.generate(mt_prompts, SamplingParams(max_tokens=MT_TOKENS))  # batch 3: Medusa's shared tree per row
    assert [r.token_ids for r in results] == mt_plain
    assert stats.tree_nodes > 8
