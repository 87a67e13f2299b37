"""The lookup proposer: its tree from n-gram matches, greedy == plain on MT-Bench, lossless rejection sampling, the bench CLI.

Losslessness as in tests/test_engine_sampling.py: 6,000 three-token continuations of a prompt that repeats itself (so
the proposer drafts), drawn with lookup + tree rejection sampling, against the exact continuation distribution by a
chi-square test at the 0.1% level; typical acceptance on the same draws is caught by the same test.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import MT_QUESTIONS, MT_TOKENS, run_distill
from distill.engine import Engine, EngineConfig, SamplingParams
from distill.engine.proposers.lookup import Lookup, LookupState, _Context
from distill.errors import ConfigError
from helpers import ALPHA, CONT, SAMPLES, chi2_pvalue, exact_distribution, tiny_medusa


# -- the tree (pure) ----------------------------------------------------------------------------------
def test_the_tree_is_the_trie_of_the_longest_match_s_continuations_by_count_then_recency():
    #     0  1  2  3  4  5  6  7  8  9 10 11   (11: the root)
    t = [7, 1, 2, 3, 4, 9, 1, 2, 3, 5, 1, 2]
    ctx = _Context(t, max_ngram=4)
    # (5, 1, 2) never occurred before; (1, 2) did, followed by 3 4 9 (at 3) and 3 5 1 (at 8, more recent)
    assert ctx.draft(3, depth=3, min_ngram=1, occurrences=8) == [(0, 3), (1, 5), (1, 4)]
    assert ctx.draft(6, depth=3, min_ngram=1, occurrences=8) == [(0, 3), (1, 5), (1, 4), (2, 1), (3, 9)]
    assert ctx.draft(6, depth=3, min_ngram=1, occurrences=1) == [(0, 3), (1, 5), (2, 1)]  # the most recent only
    assert ctx.draft(6, depth=3, min_ngram=3, occurrences=8) == []  # no match of 3 or more tokens
    assert _Context([1, 2, 3, 4], max_ngram=4).draft(4, 3, 1, 8) == []  # nothing repeats: no draft
    ctx.extend([3, 5])  # the context grows as tokens are committed: now (1, 2, 3, 5) matched at 6..9
    assert ctx.draft(1, depth=2, min_ngram=1, occurrences=8) == [(0, 1)]


def test_rows_without_a_match_are_padded_with_distinct_root_children_and_the_state_follows_the_batch():
    lk = Lookup(max_nodes=4, depth=2)
    state = LookupState([_Context([1, 2, 3, 1, 2], 6), _Context([5, 6, 7], 6)])
    prop = lk.propose(state, torch.tensor([2, 7]), torch.tensor([4, 2]), 4, 4)
    assert prop.tokens.tolist()[0][:3] == [2, 3, 1] and prop.tokens.shape == (2, 3)
    assert prop.buffers.parent.tolist() == [[-1, 0, 1], [-1, 0, 0]]
    assert prop.tokens[1, 1:].tolist() == [0, 1]  # filler: distinct children of the root
    state.keep([1], 3)
    assert [c.tokens for c in state.rows] == [[5, 6, 7]]
    assert lk.propose(state, torch.tensor([7]), torch.tensor([2]), 2, 4).tokens.shape == (1, 1)  # no match: plain
    with pytest.raises(ConfigError, match="min_ngram"):
        Lookup(min_ngram=3, max_ngram=2)


# -- decoding ----------------------------------------------------------------------------------------
@pytest.mark.usefixtures("one_torch_thread")
def test_lookup_rejection_sampling_is_lossless(temperature=0.7, top_p=0.9):  # the rules themselves: test_engine_sampling
    model, _ = tiny_medusa()
    prompt = [1, 5, 2, 1, 5, 2, 1, 5]
    exact = exact_distribution(model, prompt, temperature, top_p)
    params = [SamplingParams(max_tokens=CONT, temperature=temperature, top_p=top_p, seed=i) for i in range(SAMPLES)]

    def engine(acceptance):
        return Engine(model, None, Lookup(max_nodes=4, depth=3), EngineConfig(acceptance=acceptance, max_batch=SAMPLES,
                                                                              speculate_max_batch=SAMPLES), model_name="tiny")

    results, stats = engine("rejection").generate([prompt] * SAMPLES, params)
    assert all(len(r.token_ids) == CONT for r in results) and stats.tree_nodes >= 2
    assert max(a for r in results for a in r.accepted) >= 2  # the drafts were accepted
    assert chi2_pvalue([r.token_ids for r in results], exact) > ALPHA
    typical, _ = engine("typical").generate([prompt] * SAMPLES, params)
    assert chi2_pvalue([r.token_ids for r in typical], exact) < ALPHA


def test_greedy_lookup_equals_plain_greedy_on_mt_bench(hf_model, tokenizer, mt_prompts, mt_plain):
    engine = Engine(hf_model, tokenizer, Lookup(max_nodes=8), EngineConfig(speculate_max_batch=8))
    results, stats = engine.generate(mt_prompts, SamplingParams(max_tokens=MT_TOKENS))  # batch 3
    assert [r.token_ids for r in results] == mt_plain
    assert stats.batch_size == MT_QUESTIONS and stats.tree_nodes > 0  # drafts were verified
    one, _ = engine.generate([mt_prompts[1]], SamplingParams(max_tokens=MT_TOKENS))
    assert one[0].token_ids == mt_plain[1]


def test_bench_cli_runs_plain_vs_lookup_with_the_bundled_model(tmp_path, cli_env):
    r = run_distill(["bench", "--heads", "lookup", "--limit", "1", "--max-tokens", "12", "--modes", "greedy", "--out",
                     str(tmp_path / "b")], env=cli_env)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads((tmp_path / "b" / "bench.json").read_text())
    assert doc["tree"]["proposer"] == "lookup" and doc["heads"] == "lookup"
    assert {g["identical"] for g in doc["groups"]} == {1}


def test_the_adaptive_policy_observes_lookup_trees_smaller_than_the_size_it_chose(hf_model, tokenizer, mt_prompts, mt_plain):
    """A lookup tree holds as many nodes as the context offers, up to the chosen size (6 of 8, say): the policy learns
    per chosen size (regression: `distill serve`, adaptive by default, failed such steps with a KeyError)."""
    from distill.engine.policy import candidate_sizes

    # a free tree in the cost model: the policy starts at the full 8 nodes, which the context rarely fills exactly
    engine = Engine(hf_model, tokenizer, Lookup(max_nodes=8), EngineConfig(adaptive=True, max_batch=1, step_cost_ratio=0))
    sizes = set(candidate_sizes(8))
    odd = []
    for prompt, plain in zip(mt_prompts, mt_plain):
        (res,), stats = engine.generate([prompt], SamplingParams(max_tokens=MT_TOKENS))
        assert res.token_ids == plain
        odd += [n for n in stats.tree_nodes_per_step if n not in sizes]
    assert odd  # such steps happened (and were observed without error)
    assert engine.policy._seen and all(n in sizes for _, n in engine.policy._seen)
