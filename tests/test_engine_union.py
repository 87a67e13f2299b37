"""The lookup proposer's trees merged with an EAGLE drafter's (distill.engine.proposers.union): the merge, greedy == plain greedy,
lossless rejection sampling, and the engine's and CLI's plumbing.

The decoding tests run the tiny random Llama of the EAGLE engine tests (tests/helpers.py: vocabulary 8, where both proposers' drafts
are often right) and the bundled SmolLM2 on real MT-Bench first turns with an untrained drafter.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import MT_QUESTIONS, MT_TOKENS, run_distill
from distill.engine import Engine, EngineConfig, SamplingParams
from distill.engine.proposers.eagle import Eagle
from distill.engine.proposers.lookup import Lookup
from distill.engine.proposers.base import host_proposal
from distill.engine.proposers.union import REALLOCATE_EVERY, Union, allocate, merge, paths, union_tau
from distill.errors import ConfigError
from helpers import (ALPHA, CONT, SAMPLES, bundled_drafter, chi2_pvalue, exact_distribution, generate_watching_drafts,
                     joining_rows_decode_as_plain, make_heads, tiny_eagle)


def test_the_union_s_expected_tokens_model_independent_geometric_parts():
    assert union_tau([]) == 1.0 and union_tau([1.0, 1.0]) == 1.0
    for t in (1.2, 1.87, 2.43, 4.0):  # one part: its own expectation (1 + q / (1 - q) = t)
        assert union_tau([t]) == pytest.approx(t, rel=1e-6)
        assert union_tau([t, 1.0]) == pytest.approx(t, rel=1e-6)  # a part that accepts nothing adds nothing
    both = union_tau([2.426, 1.615])  # the lookup's and an EAGLE-3 drafter's full trees on MT-Bench (measured 2.73)
    assert both == pytest.approx(2.753, abs=2e-3)
    assert 2.426 < both < 2.426 + 0.615  # more than the better part, less than both parts' drafts summed
    assert union_tau([1.5, 1.5, 1.5]) > union_tau([1.5, 1.5]) > 1.5


def test_a_budget_goes_where_it_buys_the_most_tokens_per_unit_of_cost():
    lookup = {32: 1.87, 16: 1.85, 8: 1.82, 4: 1.71, 2: 1.53, 1: 1.35}
    drafter = {24: 1.87, 12: 1.75, 6: 1.62, 3: 1.51, 1: 1.33}
    sizes = [32, 24]
    assert allocate(56, [lookup, drafter], sizes) == (32, 24) and allocate(99, [lookup, drafter], sizes) == (32, 24)
    assert allocate(0, [lookup, drafter], sizes) == (0, 0)
    assert allocate(1, [lookup, drafter], sizes) == (1, 0)  # the better single node
    free = {n: allocate(n, [lookup, drafter], sizes) for n in (2, 4, 8, 16, 32)}
    assert free[2] == (1, 1) and free[4] == (2, 1) and free[8] == (4, 3) and free[32] == (8, 24)
    assert all(k in (0, *t) for ks in free.values() for k, t in zip(ks, (lookup, drafter)))
    # a drafter whose passes cost a fifth of a forward each: small budgets go to the free lookup alone
    costly = [lambda k: 0.0, lambda k: 0.2 * {24: 5, 12: 4, 6: 3, 3: 2, 1: 1}[k]]
    priced = {n: allocate(n, [lookup, drafter], sizes, costly) for n in (1, 2, 4, 8, 32)}
    assert priced[1] == (1, 0) and priced[2] == (2, 0) and priced[4] == (4, 0) and priced[8] == (8, 0)
    assert priced[32] == (32, 0)
    cheap = [lambda k: 0.0, lambda k: 0.01]
    assert allocate(4, [lookup, drafter], sizes, cheap) == (2, 1)  # cheap passes: both parts again


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
    return tiny_eagle()


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


def test_the_engine_s_union_prices_each_size_by_its_parts_shares(tiny):
    union = tiny_union(tiny).proposer
    lookup, drafter = union.parts
    assert union.forward_weights and union.shares[10] == (4, 6) and union.share(99) == (4, 6)  # the full tree
    assert set(union.taus()) == {10, 5, 2, 1} | set(lookup.taus()) | set(drafter.taus())
    for n, ks in union.shares.items():
        assert sum(ks) <= n and all(k in (0, *p.taus()) for k, p in zip(ks, union.parts))
        assert union.taus()[n] == pytest.approx(union_tau([p.taus()[k] for k, p in zip(ks, union.parts) if k]))
        cost = sum(p.proposal_cost(k, union.forward_weights) for k, p in zip(ks, union.parts) if k)
        assert union.proposal_cost(n, union.forward_weights) == pytest.approx(cost)
    assert union.share(3) == union.shares[2] and union.share(0) == (0, 0)


def test_measured_acceptance_moves_the_budget_to_the_part_that_earns_it(tiny):
    union = Union([Lookup(max_nodes=4, depth=3), Lookup(max_nodes=4, depth=3)])  # two equal tables: shared alike
    assert union.shares[2] == (1, 1) and union.acceptance_ratios == [1.0, 1.0] and union.revision == 0
    rows = REALLOCATE_EVERY
    for _ in range(3):  # the first part's paths hold the accepted drafts, the second's never do
        drafted = [(0, 4, [{(5,), (5, 6), (5, 6, 1)}] * rows), (1, 4, [{(7,), (7, 2)}] * rows)]
        union._credit(drafted, [[5, 6, 1]] * rows, [3] * rows)
    first, second = union.acceptance_ratios
    assert first > 1.5 and second < 0.3 and union.revision >= 1
    assert union.shares[2] == (2, 0) and union.shares[4] == (4, 0) and union.shares[8] == (4, 4)  # full: both
    assert union.taus()[4] == pytest.approx(union.part_taus()[0][4])
    # the engine prices its sizes again when the revision moves: the policy's table is the union's new one
    model, drafter = tiny
    engine = Engine(model, None, drafter, EngineConfig(max_batch=2, draft_nodes=6, draft_depth=3, draft_topk=2, adaptive=True),
                    model_name="tiny", lookup=Lookup(max_nodes=4, depth=3))
    u = engine.proposer
    u._credit([(0, 4, [{(5,), (5, 6)}] * rows)], [[5, 6]] * rows, [2] * rows)
    assert u.revision == 1 and engine.policy.taus != u.taus()
    engine.generate([[1, 2, 3, 1, 2, 3]], SamplingParams(max_tokens=4))
    assert engine.pricing.revision == u.revision and engine.policy.taus == u.taus() == engine.pricing.taus


@pytest.mark.usefixtures("one_torch_thread")
def test_steps_the_drafter_has_no_share_of_defer_its_catch_up_and_its_drafts_stay_the_same(tiny, monkeypatch):
    """Union steps of the lookup alone commit different lengths per row; the drafter catches up on them in one pass."""
    from itertools import cycle

    from distill.engine.proposers import eagle as eagle_module

    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 8, (n,), generator=g).tolist() for n in (4, 9, 6)]
    params = [SamplingParams(max_tokens=n) for n in (12, 20, 28)]

    def run(defer_steps):
        monkeypatch.setattr(eagle_module, "DEFER_STEPS", defer_steps)
        engine = tiny_union(tiny)
        turns = cycle([(4, 0), (4, 0), (4, 0), (4, 6)])  # three steps of the lookup alone, then both
        engine.proposer.share = lambda nodes: next(turns)
        return generate_watching_drafts(engine, engine.proposer.parts[1], prompts, params)

    tokens, drafts, passes, stats = run(eagle_module.DEFER_STEPS)
    tokens_each, drafts_each, passes_each, _ = run(1)  # a catch-up after every step
    plain = [tiny_union(tiny).generate([p], sp, speculative=False)[0][0].token_ids for p, sp in zip(prompts, params)]
    assert tokens == tokens_each == plain and len(drafts) == len(drafts_each) > 2
    assert len({a for step in stats.accepted_per_step for a in step}) > 1  # rows committed different lengths
    for (tree, logp), (tree_each, logp_each) in zip(drafts, drafts_each):
        assert torch.equal(tree, tree_each) and torch.allclose(logp, logp_each, atol=1e-5)
    assert passes_each - passes >= 4  # the lookup's steps: caught up in one pass before the drafter's next tree


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
    from distill.bench.config import BenchConfig
    from distill.serve.config import ServeConfig

    for heads in ("lookup", None):
        with pytest.raises(ConfigError, match="--lookup merges"):
            ServeConfig.from_options(heads=heads, lookup=True)
    with pytest.raises(ConfigError, match="--lookup merges"):
        BenchConfig.from_options(heads="lookup", lookup=True)
    with pytest.raises(ConfigError, match="--lookup is for --engine distill"):
        ServeConfig.from_options(heads="out/heads", engine="vllm", lookup=True)
    with pytest.raises(ConfigError, match=r"it needs --heads lookup \(or --lookup\)"):
        BenchConfig.from_options(heads="out/heads", lookup_data="out/data")
    with pytest.raises(ConfigError, match="--lookup-nodes must be >= 1"):
        BenchConfig.from_options(heads="lookup", lookup_nodes=0)
    assert BenchConfig.from_options(heads="out/heads", lookup=True, lookup_data="out/data", lookup_history=0, lookup_nodes=16).decoding.lookup


def test_bench_cli_runs_a_trained_drafter_with_the_lookup_merged_in(tmp_path_factory, real_shards, cli_env):
    from distill.train import TrainConfig, train

    out = tmp_path_factory.mktemp("union-bench") / "drafter"
    train(TrainConfig(data=str(real_shards), out=str(out), arch="eagle3", steps=4, max_len=64, batch_size=4, lr=3e-3,
                      warmup_steps=1, seed=0, progress=False))
    b = out.parent / "bench"
    r = run_distill(["bench", "--heads", str(out), "--lookup", "--lookup-data", str(real_shards), "--full-tree", "--draft-nodes", "8",
                     "--lookup-nodes", "4", "--limit", "1", "--max-tokens", "12", "--modes", "greedy", "--out", str(b)], env=cli_env)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads((b / "bench.json").read_text())
    assert doc["tree"]["proposer"] == "lookup+eagle3" and doc["tree"]["nodes"] == 12  # the lookup's 4 and the drafter's 8
    assert "datastore" in doc["tree"]["source"] and "eagle3 dynamic" in doc["tree"]["source"]
    assert doc["config"]["decoding"]["lookup"] is True and {g["identical"] for g in doc["groups"]} == {1}


def test_greedy_union_with_medusa_heads_equals_plain_greedy_on_mt_bench(hf_model, tokenizer, mt_prompts, mt_plain):
    heads = make_heads(hf_model, random_w1=True, seed=3)
    engine = Engine(hf_model, tokenizer, heads, EngineConfig(tree="sparse-8", speculate_max_batch=8), lookup=Lookup(max_nodes=8))
    assert engine.proposer.name == "lookup+medusa" and engine.heads is heads and len(engine.tree.paths) == 8
    results, stats = engine.generate(mt_prompts, SamplingParams(max_tokens=MT_TOKENS))  # batch 3: Medusa's shared tree per row
    assert [r.token_ids for r in results] == mt_plain
    assert stats.tree_nodes > 8
