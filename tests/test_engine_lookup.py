"""The lookup proposer: suffix matching and frequency scoring on handcrafted contexts, greedy == plain on MT-Bench,
lossless rejection sampling, the bench CLI.

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
from distill.engine.acceptance import greedy_accept, rejection_accept
from distill.engine.proposers.lookup import DEFAULT_CHAIN_ODDS, ChainOdds, Lookup, LookupState, _Context
from distill.engine.proposers.suffix import Draft, best_draft, merge
from distill.errors import ConfigError
from helpers import ALPHA, CONT, SAMPLES, chi2_pvalue, exact_distribution, tiny_medusa


# -- suffix matching and scoring (pure) -----------------------------------------------------------------
def test_the_longest_match_drafts_though_a_shorter_one_is_followed_more_often():
    #        0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15 16   (16: the root)
    ctx = _Context([5, 1, 2, 3, 7, 8, 9, 1, 2, 4, 1, 2, 4, 6, 5, 1, 2])
    levels = ctx.levels(depth=6, occurrences=64)
    # (1, 2) occurred 3 times, twice followed by 4; (5, 1, 2) once, followed by 3 7 8 9 ...
    assert [(lv.n, lv.total) for lv in levels] == [(2, 3), (3, 1)] and levels[1].continuations == [[3, 7, 8, 9, 1, 2]]
    # 3 tokens matched: 3 nodes of probability 1/2 (score 1.5) beat the 2-token match's 4 (2/4) and 3 (1/4)
    assert ctx.draft(8, 6, factor=1.0) == [(0, 3), (1, 7), (2, 8)]
    level = best_draft(levels, 8, 0.1, 1.0, 0.0, nested=True)
    assert level.match == 3 and level.score == pytest.approx(1.5)
    assert _Context([1, 2, 3, 4]).draft(4, 3) == []  # nothing repeats: no draft


def test_siblings_and_depths_follow_the_continuations_frequency():
    ctx = _Context([1, 2, 4, 9, 1, 2, 4, 9, 1, 2, 3, 9, 1, 2, 4, 8, 1, 2])  # (1, 2) four times: 4 9, 4 9, 3 9, 4 8
    # probabilities with the root's own position counted (5 occurrences): 4 3/5, 4 9 2/5, 4 9 1 2/5, 3 1/5, 4 8 1/5
    assert ctx.draft(3, 6, factor=4.0) == [(0, 4), (1, 9), (2, 1)]
    tree = ctx.draft(8, 6, factor=4.0)
    assert tree[:2] == [(0, 4), (0, 3)] and len(tree) == 8  # the rarer sibling after the more frequent one
    ctx.extend([4, 9])  # committed tokens join the context: (1, 2, 4, 9) now matched, twice followed by 1 2
    assert ctx.draft(2, 6, factor=4.0) == [(0, 1), (1, 2)]


def test_nodes_under_the_probability_floor_are_not_drafted():
    t = []
    for i in range(9):
        t += [7 + i, 1, 2, 4]  # (1, 2) followed by 4 nine times, each time by another token after it
    ctx = _Context(t + [30, 1, 2, 3, 31, 1, 2])  # and once by 3
    assert ctx.draft(8, 2, factor=4.0) == [(0, 4)]  # 9/11; the rest 1/11 < 0.1
    assert len(ctx.draft(8, 2, factor=4.0, min_prob=0.05)) == 8
    with pytest.raises(ConfigError, match="min_prob"):
        Lookup(min_prob=1.5)
    with pytest.raises(ConfigError, match="prior >= 0; got 0.1, 4.0, -1"):
        Lookup(prior=-1)


def test_a_match_drafts_at_most_factor_times_its_length_within_the_budget():
    ctx = _Context([7, 1, 2, 3, 4, 5, 6, 9, 1])  # 1 matched 1 token deep (7 1 vs 9 1): each node 1/2
    assert ctx.draft(8, 6, factor=1.0) == [(0, 2)]
    assert ctx.draft(8, 6, factor=3.0) == [(0, 2), (1, 3), (2, 4)]
    assert ctx.draft(8, 6, factor=1.0, offset=2.0) == [(0, 2), (1, 3), (2, 4)]
    assert ctx.draft(2, 6, factor=10.0) == [(0, 2), (1, 3)]  # the budget caps it
    long = _Context([7, 1, 2, 3, 4, 5, 6, 9, 7, 1, 2, 3])  # 4 tokens matched: up to 4 nodes at factor 1
    assert long.draft(8, 6, factor=1.0) == [(0, 4), (1, 5), (2, 6), (3, 9)]


def test_rows_without_a_match_are_padded_with_distinct_root_children_and_the_state_follows_the_batch():
    lk = Lookup(max_nodes=4, depth=2, history_tokens=0)
    state = LookupState([_Context([1, 2, 3, 1, 2]), _Context([5, 6, 7])])
    prop = lk.propose(state, torch.tensor([2, 7]), torch.tensor([4, 2]), 4, 4)
    assert prop.tokens.tolist()[0][:3] == [2, 3, 1] and prop.tokens.shape == (2, 3)
    assert prop.buffers.parent.tolist() == [[-1, 0, 1], [-1, 0, 0]]
    assert prop.tokens[1, 1:].tolist() == [0, 1]  # filler: distinct children of the root
    state.keep([1], 3)
    assert [c.tokens for c in state.rows] == [[5, 6, 7]]
    assert lk.propose(state, torch.tensor([7]), torch.tensor([2]), 2, 4).tokens.shape == (1, 1)  # no match: plain
    with pytest.raises(ConfigError, match="min_ngram"):
        Lookup(min_ngram=3, max_match=2)


def test_a_chain_follows_the_most_probable_child_and_merges_sources_by_probability():
    ctx = _Context([1, 2, 4, 9, 1, 2, 4, 9, 1, 2, 3, 9, 1, 2, 4, 8, 1, 2])  # (1, 2) four times: 4 9, 4 9, 3 9, 4 8
    levels = ctx.levels(depth=6, occurrences=64)
    tree = best_draft(levels, 8, 0.1, 4.0, 0.0, nested=True)
    chain = best_draft(levels, 8, 0.1, 4.0, 0.0, nested=True, chain=True)
    # the tree holds the sibling 3 (1/5) and 4 8 (1/5); the chain goes 4 (3/5), 9 1 2 (each 2/5), then 3 9 (1/5 each:
    # after 4 9 1 2 came 4 once and 3 once, and the tie goes to the more recent occurrence)
    assert (3,) in dict(tree.paths) and len(tree.paths) == 8
    assert [p for p, _ in chain.paths] == [(4,), (4, 9), (4, 9, 1), (4, 9, 1, 2), (4, 9, 1, 2, 3), (4, 9, 1, 2, 3, 9)]
    assert chain.score == pytest.approx(3 / 5 + 3 * 2 / 5 + 2 / 5)
    lk = Lookup(max_nodes=3, depth=6, history_tokens=0, chains=True)
    assert lk.draft(ctx, 3) == [(0, 4), (1, 9), (2, 1)]  # (parent, token): each node the child of the one before
    # two sources: the first token by the higher probability, then that path's continuation only
    a = Draft([((5,), 0.5), ((5, 6), 0.5)], 1.0, 2)
    b = Draft([((7,), 0.6), ((7, 8), 0.3), ((7, 8, 9), 0.2)], 1.1, 1)
    assert merge([a, b], 8, chain=True) == [(0, 7), (1, 8), (2, 9)]
    assert merge([a, b], 2, chain=True) == [(0, 7), (1, 8)]
    assert merge([a, b], 8) == [(0, 5), (0, 7), (1, 6), (2, 8), (4, 9)]  # the tree keeps both


def test_uneven_chains_end_in_filler_that_acceptance_never_reaches():
    lk = Lookup(max_nodes=4, depth=2, history_tokens=0, chains=True)
    state = LookupState([_Context([1, 2, 3, 1, 2]), _Context([5, 6, 7])])
    prop = lk.propose(state, torch.tensor([2, 7]), torch.tensor([4, 2]), 4, 4)
    assert prop.tokens.tolist() == [[2, 3, 1], [7, 0, 0]] and prop.chain_nodes == [2, 0]
    buf = prop.buffers
    assert buf.parent.tolist() == [[-1, 0, 1], [-1, 0, 1]] and buf.is_chain
    assert buf.retrieve.tolist() == [[[0, 1, 2]], [[0, -1, -1]]] and buf.children[1].tolist() == [[-1], [-1], [-1]]
    # logits that agree with every position of both rows, filler included: row 1 still accepts nothing
    logits = torch.full((2, 3, 10), -1.0)
    for b, row in enumerate([[3, 1, 4], [0, 0, 5]]):
        for t, tok in enumerate(row):
            logits[b, t, tok] = 1.0
    acc = greedy_accept(prop.tokens, logits, buf)
    assert acc.length.tolist() == [2, 0] and acc.next_token.tolist() == [4, 0]
    gens = [torch.Generator().manual_seed(0) for _ in range(2)]
    sure = rejection_accept(prop.tokens, torch.softmax(logits * 50, -1), buf, gens)
    assert sure.length.tolist() == [2, 0]
    assert lk.taus()[4] < Lookup(chains=False).taus()[4]  # one path accepts less than a tree of as many nodes
    lk.use_chains(False)  # the engine's word does not override a fixed shape
    assert lk.drafts_chains
    free = Lookup()
    assert not free.drafts_chains
    free.use_chains(True)
    assert free.drafts_chains and free.taus()[4] == lk.taus()[4]


def test_chain_odds_start_from_the_measured_table_and_follow_what_the_rows_accept():
    assert [ChainOdds.bucket(m) for m in (0, 1, 2, 4, 5, 7, 8, 15, 16, 40)] == [0, 0, 1, 3, 4, 4, 5, 5, 6, 6]
    odds = ChainOdds(weight=4.0)
    assert odds.odds(1, 0) == pytest.approx(DEFAULT_CHAIN_ODDS[0][0])
    assert odds.odds(40, 9) == pytest.approx(DEFAULT_CHAIN_ODDS[6][4])  # depth 4 stands for every deeper one
    a, b, c = DEFAULT_CHAIN_ODDS[1][:3]
    assert odds.values(2, 3) == pytest.approx([a, a * b, a * b * c])  # a node's ancestors must be accepted too
    for _ in range(200):
        odds.observe(1, 3, 3)  # one-token matches whose 3-node chains are accepted whole
        odds.observe(2, 4, 0)  # two-token matches rejected at their first node: deeper nodes are never judged
    assert min(odds.odds(1, d) for d in range(3)) > 0.95 and odds.odds(1, 3) == pytest.approx(DEFAULT_CHAIN_ODDS[0][3])
    assert odds.odds(2, 0) < 0.05 and odds.odds(2, 1) == pytest.approx(DEFAULT_CHAIN_ODDS[1][1])
    with pytest.raises(ValueError, match="chain odds need"):
        ChainOdds(prior=((0.5,),))


def test_a_chain_reports_the_match_length_of_the_source_its_first_node_came_from():
    lk = Lookup(max_nodes=4, depth=3, history_tokens=0, chains=True)
    ctx = _Context([1, 2, 3, 4, 9, 2, 3, 4, 1, 2, 3])  # "2 3" matched at 2 tokens (then 4), "1 2 3" at 3 (then 4 9)
    tree, match = lk.chain(ctx, 4)
    assert [tok for _, tok in tree][:2] == [4, 9] and match == 3
    assert lk.chain(_Context([5, 6, 7]), 4) == ([], 0)


# -- decoding ----------------------------------------------------------------------------------------
@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("chains", [False, True])
def test_lookup_rejection_sampling_is_lossless(chains, temperature=0.7, top_p=0.9):  # the rules: test_engine_sampling
    model, _ = tiny_medusa()
    prompt = [1, 5, 2, 1, 5, 2, 1, 5]
    exact = exact_distribution(model, prompt, temperature, top_p)
    params = [SamplingParams(max_tokens=CONT, temperature=temperature, top_p=top_p, seed=i) for i in range(SAMPLES)]

    def engine(acceptance):
        return Engine(model, None, Lookup(max_nodes=4, depth=3, chains=chains),
                      EngineConfig(acceptance=acceptance, max_batch=SAMPLES, speculate_max_batch=SAMPLES), model_name="tiny")

    results, stats = engine("rejection").generate([prompt] * SAMPLES, params)
    assert all(len(r.token_ids) == CONT for r in results) and stats.tree_nodes >= 2
    assert max(a for r in results for a in r.accepted) >= 2  # the drafts were accepted
    assert chi2_pvalue([r.token_ids for r in results], exact) > ALPHA
    typical, _ = engine("typical").generate([prompt] * SAMPLES, params)
    assert chi2_pvalue([r.token_ids for r in typical], exact) < ALPHA


@pytest.mark.parametrize("chains", [None, False])
def test_greedy_lookup_equals_plain_greedy_on_mt_bench(hf_model, tokenizer, mt_prompts, mt_plain, chains):
    """Chains where the engine chose them (its attention on vLLM's kernel verifies chains for less), and trees."""
    engine = Engine(hf_model, tokenizer, Lookup(max_nodes=8, chains=chains), EngineConfig(speculate_max_batch=8))
    lookup = engine.decoding.proposer
    assert lookup.drafts_chains == (chains is None and not engine.target.paged_problem)
    seen, uneven = [], []
    step, direct_step = engine.target.step, engine.target._direct_step

    def direct(tokens, *a):  # the chains that went packed, each row's own length
        if a[-1] is not None and min(a[-1]) < tokens.shape[1]:
            uneven.append((tokens.shape[1], a[-1]))
        return direct_step(tokens, *a)

    engine.target.step = lambda *a: seen.append((a[0].shape[1], a[7])) or step(*a)
    engine.target._direct_step = direct
    results, stats = engine.generate(mt_prompts, SamplingParams(max_tokens=MT_TOKENS))  # batch 3
    assert [r.token_ids for r in results] == mt_plain
    assert stats.batch_size == MT_QUESTIONS and stats.tree_nodes > 0  # drafts were verified
    assert {chain for T, chain in seen if T > 1} == {lookup.drafts_chains}  # chains on the kernel's path, trees not
    # uneven chains verified without their filler where the direct loop runs
    assert bool(uneven) == (lookup.drafts_chains and engine.target.direct is not None)
    assert all(len(used) == MT_QUESTIONS and min(used) < T for T, used in uneven)
    one, _ = engine.generate([mt_prompts[1]], SamplingParams(max_tokens=MT_TOKENS))
    assert one[0].token_ids == mt_plain[1]


def test_greedy_lookup_under_the_node_budget_equals_plain_on_mt_bench(hf_model, tokenizer, mt_prompts, mt_plain):
    """The default where chains are cheaper (as `distill serve` runs it, adaptive): each step prices every row's nodes
    together, so rows draft chains of their own lengths, none where nothing pays, and the chains' odds learn."""
    engine = Engine(hf_model, tokenizer, Lookup(max_nodes=8), EngineConfig(adaptive=True, max_batch=MT_QUESTIONS))
    lookup, budget = engine.decoding.proposer, engine.pricing.budget
    assert (budget is not None) == lookup.drafts_chains and (engine.policy is None) == lookup.drafts_chains
    if budget is None:
        pytest.skip("this target verifies trees: no node budget")
    chosen, lengths = [], budget.lengths
    engine.proposer.use_budget(lambda B, values: chosen.append((values, lengths(B, values))) or chosen[-1][1])
    prior = [row[:] for row in lookup.odds.seen]
    results, stats = engine.generate(mt_prompts, SamplingParams(max_tokens=MT_TOKENS))
    assert [r.token_ids for r in results] == mt_plain
    assert stats.tree_nodes > 0 and stats.steps < MT_TOKENS  # drafts were verified and accepted
    assert any(len(set(out)) > 1 for _, out in chosen if len(out) > 1)  # rows of one step drafted unlike lengths
    assert all(L <= len(v) for values, out in chosen for v, L in zip(values, out))
    assert lookup.odds.seen != prior  # the rows' acceptance moved the odds


def test_rows_joining_a_running_lookup_batch_in_its_chain_steps_decode_as_plain(hf_model, tokenizer, mt_prompts, mt_plain):
    """Continuous batching with the lookup: newcomers are prefilled inside the running rows' chain steps (their prompts
    packed after the chains, where the direct loop runs), and every greedy answer equals plain decoding."""
    engine = Engine(hf_model, tokenizer, Lookup(max_nodes=8), EngineConfig(speculate_max_batch=8, max_batch=MT_QUESTIONS))
    mixed, real = [], engine.target.mixed_step

    def spy(tokens, *a):  # each joining step's tokens per running row
        mixed.append(tokens.shape[1])
        return real(tokens, *a)

    engine.target.mixed_step = spy
    params = SamplingParams(max_tokens=MT_TOKENS)
    run = engine.running_batch()
    done = dict(run.add([mt_prompts[0]], [params], [0]))
    waiting = list(range(1, MT_QUESTIONS))
    for _ in range(10 * MT_TOKENS):
        if waiting and (run.stats.tree_nodes_per_step[-1:] > [0] or not len(run)):  # one joins while the rows draft
            k = waiting.pop(0)
            done.update(run.step([mt_prompts[k]], [params], [k]))
        else:
            done.update(run.step())
        if not len(run) and not waiting:
            break
    assert [done[k].token_ids for k in range(MT_QUESTIONS)] == mt_plain
    # joined while the running rows verified chains, where the direct loop runs
    assert max(mixed, default=0) > 1 if engine.target.direct is not None else not mixed
    assert run.stats.tree_nodes > 0


def test_bench_cli_runs_plain_vs_lookup_with_the_bundled_model(tmp_path, cli_env):
    r = run_distill(["bench", "--heads", "lookup", "--limit", "1", "--max-tokens", "12", "--modes", "greedy", "--out",
                     str(tmp_path / "b")], env=cli_env)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads((tmp_path / "b" / "bench.json").read_text())
    assert doc["tree"]["proposer"] == "lookup" and doc["heads"] == "lookup"
    assert {g["identical"] for g in doc["groups"]} == {1}


def test_the_adaptive_policy_observes_lookup_trees_smaller_than_the_size_it_chose(hf_model, tokenizer, mt_prompts, mt_plain,
                                                                                    monkeypatch):
    """A lookup tree holds as many nodes as the context offers, up to the chosen size (6 of 8, say): the policy learns
    per chosen size (regression: `distill serve`, adaptive by default, failed such steps with a KeyError)."""
    from distill.engine.policy import candidate_sizes

    # the policy's choice pinned at the full 8 nodes (measured step times would pick by this machine's costs), which the
    # context rarely fills exactly; its plain probe still runs. Trees: chains are priced node by node instead
    engine = Engine(hf_model, tokenizer, Lookup(max_nodes=8, chains=False), EngineConfig(adaptive=True, max_batch=1))
    assert engine.pricing.budget is None
    monkeypatch.setattr(engine.policy, "best", lambda batch, measured=True: 8)
    sizes = set(candidate_sizes(8))
    odd = []
    for prompt, plain in zip(mt_prompts, mt_plain):
        (res,), stats = engine.generate([prompt], SamplingParams(max_tokens=MT_TOKENS))
        assert res.token_ids == plain
        odd += [n for n in stats.tree_nodes_per_step if n not in sizes]
    assert odd  # such steps happened (and were observed without error)
    assert engine.policy.step_times.seen() and all(n in sizes for _, n in engine.policy.step_times.seen())
