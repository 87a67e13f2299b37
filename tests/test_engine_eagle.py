"""EAGLE drafting in the engine: per-row tree buffers, the dynamic tree, greedy EAGLE == plain greedy, lossless sampling.

Pure parts run on tiny synthetic tensors; the decoding tests run a tiny random Llama (vocabulary 8, where drafts are
often right) and the bundled SmolLM2 on real MT-Bench first turns with untrained, random and trained drafters.
Losslessness: as tests/test_engine_sampling.py does for Medusa, 6,000 three-token continuations drawn with EAGLE +
tree rejection sampling are compared with the exact continuation distribution by a chi-square test at the 0.1% level.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import MT_QUESTIONS, MT_TOKENS
from distill.engine import Engine, EngineConfig, SamplingParams
from distill.engine.acceptance import greedy_accept, rejection_accept, typical_accept
from distill.sampling import warp
from distill.engine.cache import step_allowed
from distill.engine.proposers import eagle as eagle_module
from distill.engine.proposers.eagle import Eagle
from distill.engine.tree import build_buffers, row_buffers
from distill.errors import ConfigError
from helpers import (ALPHA, CONT, SAMPLES, bundled_drafter, chi2_pvalue, chi2_sf, exact_distribution, generate_watching_drafts,
                     joining_rows_decode_as_plain, tiny_eagle)

HAND = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]  # root=0, (0,)=1, (1,)=2, (0,0)=3, (0,1)=4, (1,0)=5, (0,0,0)=6
V = 8


def _parents(buf):
    return buf.parent[None].clone(), buf.depth[None].clone()


# -- per-row trees (pure) ---------------------------------------------------------------------------
def test_row_buffers_from_parent_arrays_equal_the_shared_tree_buffers():
    shared = build_buffers(HAND)
    parent, depth = _parents(shared)
    rows = row_buffers(parent.repeat(2, 1), depth.repeat(2, 1), max_depth=3, max_children=2)
    assert rows.per_row and rows.size == shared.size and rows.nodes == 6
    assert torch.equal(rows.mask, shared.mask.expand(2, 7, 7))
    assert torch.equal(rows.children, shared.children.expand(2, 7, 2))
    # retrieve lists the path to every position: the leaves' rows are the shared tree's retrieval rows
    leaves = {tuple(r) for r in shared.retrieve.tolist()}
    assert leaves <= {tuple(r) for r in rows.retrieve[0].tolist()}
    assert rows.retrieve[0, 6].tolist() == [0, 1, 3, 6] and rows.retrieve[0, 2].tolist() == [0, 2, -1, -1]


def test_verification_with_per_row_trees_equals_each_row_verified_alone():
    g = torch.Generator().manual_seed(0)
    trees = [build_buffers(HAND), build_buffers([(0,), (0, 0), (0, 0, 0), (0, 0, 1), (0, 1), (1,)])]
    parent = torch.cat([_parents(t)[0] for t in trees])
    depth = torch.cat([_parents(t)[1] for t in trees])
    both = row_buffers(parent, depth, max_depth=3, max_children=2)
    same = row_buffers(*(x.repeat(2, 1) for x in _parents(trees[0])), max_depth=3, max_children=2)
    for _ in range(100):
        tokens = torch.stack([torch.randperm(V, generator=g)[:7] for _ in range(2)])  # siblings distinct, as drafted
        logits = torch.randn(2, 7, V, generator=g) * 3
        probs = warp(logits, torch.ones(2), torch.ones(2))
        seeds = [int(torch.randint(0, 1 << 30, (1,), generator=g)) for _ in range(2)]

        def gens(rows=(0, 1)):
            return [torch.Generator().manual_seed(seeds[b]) for b in rows]

        greedy, typical = greedy_accept(tokens, logits, both), typical_accept(tokens, probs, both, gens())
        for b, tree in enumerate(trees):
            a = greedy_accept(tokens[b : b + 1], logits[b : b + 1], tree)
            L = int(a.length)
            assert int(greedy.length[b]) == L and int(greedy.next_token[b]) == int(a.next_token)
            assert int(greedy.last[b]) == int(a.last) and greedy.path[b, : L + 1].tolist() == a.path[0, : L + 1].tolist()
            # typical: the same longest length (equally long paths may be tied differently: lowest position here)
            assert int(typical.length[b]) == int(typical_accept(tokens[b : b + 1], probs[b : b + 1], tree, gens([b])).length)
        # rejection draws per step for the whole batch: one tree in both forms gives the same draws
        r_rows, r_shared = rejection_accept(tokens, probs, same, gens()), rejection_accept(tokens, probs, trees[0], gens())
        for name in ("length", "path", "next_token", "last"):
            assert torch.equal(getattr(r_rows, name), getattr(r_shared, name))


def test_step_mask_with_per_row_trees():
    trees = [build_buffers(HAND), build_buffers([(0,), (1,), (2,), (0, 0), (0, 0, 0), (2, 0)])]
    end = torch.tensor([3, 5])
    per_row = step_allowed(end, torch.stack([t.mask for t in trees]), 12)
    for b, t in enumerate(trees):
        assert torch.equal(per_row[b], step_allowed(end[b : b + 1], t.mask, 12)[0])


# -- a tiny random target and drafter ------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    return tiny_eagle()


def tiny_engine(tiny, acceptance="greedy", **tree) -> Engine:
    model, drafter = tiny
    tree = {"draft_nodes": 6, "draft_depth": 3, "draft_topk": 2, **tree}
    cfg = EngineConfig(acceptance=acceptance, max_batch=SAMPLES, speculate_max_batch=SAMPLES, **tree)
    return Engine(model, None, drafter, cfg, model_name="tiny")


@pytest.mark.usefixtures("one_torch_thread")
def test_dynamic_tree_is_a_prefix_closed_tree_within_the_budget_drafted_from_the_drafter(tiny):
    engine = tiny_engine(tiny, draft_nodes=5, draft_depth=3, draft_topk=2)
    eagle = engine.proposer
    assert isinstance(eagle, Eagle) and eagle.feature_layers == (0, 1, 2)
    prompts = [[1, 5, 2], [3, 3, 7, 0, 1, 4]]
    seen = {}

    def spy(state, root, end, longest, nodes, sampling=None):
        out = Eagle.propose(eagle, state, root, end, longest, nodes, sampling)
        seen.setdefault("first", (out, state.logp.clone(), root.clone()))
        return out

    eagle.propose = spy
    engine.generate(prompts, SamplingParams(max_tokens=4))
    prop, logp, root = seen["first"]
    buf = prop.buffers
    assert buf.per_row and prop.tokens.shape == (2, 6) and torch.equal(prop.tokens[:, 0], root)
    for b in range(2):
        parent, depth = buf.parent[b].tolist(), buf.depth[b].tolist()
        assert parent[0] == -1 and all(0 <= parent[i] < i and depth[i] == depth[parent[i]] + 1 for i in range(1, 6))
        assert max(depth) <= 3 and all(parent.count(i) <= 2 for i in range(6))
        # depth 1: the drafter's top tokens after the root, most probable first; scores never grow with depth
        kids = [i for i in range(1, 6) if parent[i] == 0]
        top = logp[b].topk(len(kids)).indices.tolist()
        assert [int(prop.tokens[b, i]) for i in kids] == top
        q = prop.draft_prob[b]
        path_p = [1.0] * 6
        for i in range(1, 6):
            path_p[i] = path_p[parent[i]] * float(q[i])
            assert path_p[i] <= path_p[parent[i]] + 1e-6


@pytest.mark.usefixtures("one_torch_thread")
def test_tiny_greedy_eagle_equals_plain_greedy_batched_and_joining(tiny):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (1, 4, 9, 2, 6, 3, 12, 5)]
    engine = tiny_engine(tiny)
    engine.config.max_batch = 8
    sp = SamplingParams(max_tokens=20)
    plain = [engine.generate([p], sp, speculative=False)[0][0].token_ids for p in prompts]
    batched, _ = engine.generate(prompts, [sp] * len(prompts))
    assert [r.token_ids for r in batched] == plain
    assert max(a for r in batched for a in r.accepted) >= 3  # the trees were accepted deep
    one = [engine.generate([p], sp)[0][0].token_ids for p in prompts]
    assert one == plain
    joining_rows_decode_as_plain(engine, prompts, plain)


@pytest.mark.usefixtures("one_torch_thread")
def test_plain_steps_defer_the_drafters_catch_up_and_the_drafts_stay_the_same(tiny, monkeypatch):
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (3, 7, 5)]
    params = [SamplingParams(max_tokens=n) for n in (6, 14, 30)]  # rows leave one by one: 3, 2, then 1 row decoding

    def run(defer_steps):
        monkeypatch.setattr(eagle_module, "DEFER_STEPS", defer_steps)
        engine = tiny_engine(tiny)
        engine.config.speculate_max_batch = 1  # plain steps while 2 or 3 rows decode, trees once one is left
        tokens, drafts, passes, _ = generate_watching_drafts(engine, engine.proposer, prompts, params)
        return tokens, drafts, passes

    tokens, drafts, passes = run(eagle_module.DEFER_STEPS)
    tokens_each, drafts_each, passes_each = run(1)  # a catch-up after every step, as before deferring
    assert tokens == tokens_each and len(drafts) == len(drafts_each) > 0
    for (tree, logp), (tree_each, logp_each) in zip(drafts, drafts_each):
        assert torch.equal(tree, tree_each) and torch.allclose(logp, logp_each, atol=1e-5)
    assert passes_each - passes >= 10  # the plain steps' catch-ups: one pass when a row leaves or a tree comes, not one each


def test_multi_round_speculative_sampling_with_iid_drafts_emits_the_target_distribution():
    """Three root children drawn i.i.d. from q (repeats allowed), one child with its own drawn child: 200,000 rows.

    The first emitted token (accepted child or residual draw) ~ p_root, and the second token after an
    accepted child ~ that child's p; chi-square at the 0.1% level. Point-mass treatment of the same
    drafts is biased here (q is not a deterministic choice), which the same test catches.
    """
    g = torch.Generator().manual_seed(0)
    n = 200_000
    tree = build_buffers([(0,), (1,), (2,), (0, 0)])  # positions: root 0, children 1-3, grandchild 4 under 1
    p = torch.softmax(torch.randn(5, V, generator=g) * 1.5, -1)  # (T, V) target distribution after each position
    q = torch.softmax(torch.randn(5, V, generator=g) * 1.5, -1)  # (T, V) draft distribution of each position's children
    kids = torch.multinomial(q[0], 3 * n, replacement=True, generator=g).view(n, 3)
    grand = torch.multinomial(q[1], n, replacement=True, generator=g)
    tokens = torch.cat([torch.zeros(n, 1, dtype=torch.long), kids, grand[:, None]], 1)  # (n, T)
    probs, draft = p.expand(n, 5, V), q.expand(n, 5, V)
    torch.manual_seed(1)

    def first_tokens(acc):
        return torch.where(acc.length > 0, tokens.gather(1, acc.path[:, 1:2]).squeeze(1), acc.next_token)

    def pvalue(x, dist):
        counts = torch.bincount(x, minlength=V).double()
        exp = dist.double() * x.numel()
        return chi2_sf(float(((counts - exp) ** 2 / exp).sum()), V - 1)

    acc = rejection_accept(tokens, probs, tree, [None] * n, draft)
    assert 0 < float((acc.length == 2).float().mean()) and pvalue(first_tokens(acc), p[0]) > 1e-3
    second = acc.length >= 1
    after_first = torch.where(acc.length == 2, tokens[:, 4], acc.next_token)[second & (acc.path[:, 1] == 1)]
    assert pvalue(after_first, p[1]) > 1e-3
    biased = rejection_accept(tokens, probs, tree, [None] * n)  # the same drafts as point masses
    assert pvalue(first_tokens(biased), p[0]) < 1e-3


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("sample_drafts", [True, False], ids=["drafts-from-q", "top-k-point-masses"])
@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_eagle_rejection_sampling_is_lossless(tiny, temperature, top_p, sample_drafts):
    prompt = [1, 5, 2]
    exact = exact_distribution(tiny[0], prompt, temperature, top_p)
    params = [SamplingParams(max_tokens=CONT, temperature=temperature, top_p=top_p, seed=i) for i in range(SAMPLES)]
    engine = tiny_engine(tiny, "rejection")
    engine.config.sample_drafts = sample_drafts
    results, _ = engine.generate([prompt] * SAMPLES, params)
    assert all(len(r.token_ids) == CONT for r in results)
    assert max(a for r in results for a in r.accepted) >= 2  # the tree did accept candidates
    assert chi2_pvalue([r.token_ids for r in results], exact) > ALPHA
    # the same test catches a biased sampler: typical acceptance on the same draws
    typical, _ = tiny_engine(tiny, "typical").generate([prompt] * SAMPLES, params)
    assert chi2_pvalue([r.token_ids for r in typical], exact) < ALPHA


@pytest.mark.usefixtures("one_torch_thread")
def test_typical_eagle_accepts_and_greedy_rows_stay_greedy(tiny):
    prompts = [[1, 5, 2], [3, 3, 7, 0, 1]]
    engine = tiny_engine(tiny, "typical")
    greedy = [engine.generate([p], SamplingParams(max_tokens=16), speculative=False)[0][0].token_ids for p in prompts]
    params = [SamplingParams(max_tokens=16), SamplingParams(max_tokens=16, temperature=1.0, seed=4)]
    out, _ = engine.generate(prompts, params)
    assert out[0].token_ids == greedy[0] and len(out[1].token_ids) == 16
    assert sum(out[1].accepted) / len(out[1].accepted) > 1.0


def test_eagle_settings_are_checked(tiny):
    model, drafter = tiny
    with pytest.raises(ConfigError, match="dynamic tree"):
        Engine(model, None, drafter, EngineConfig(tree="sparse-8"))
    with pytest.raises(ConfigError, match="draft_nodes"):
        EngineConfig(draft_nodes=0)
    with pytest.raises(ConfigError, match="top-k"):
        Engine(model, None, drafter, EngineConfig(draft_topk=9))


# -- the bundled model on MT-Bench ---------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["fresh", "random"])
def test_greedy_eagle_equals_plain_greedy_on_mt_bench(hf_model, tokenizer, mt_prompts, mt_plain, kind):
    engine = Engine(hf_model, tokenizer, bundled_drafter(hf_model, kind),
                    EngineConfig(speculate_max_batch=8, draft_nodes=16, draft_depth=4, draft_topk=4))
    results, stats = engine.generate(mt_prompts, SamplingParams(max_tokens=MT_TOKENS))  # batch 3
    assert [r.token_ids for r in results] == mt_plain
    assert stats.tree_nodes == 16 and stats.batch_size == MT_QUESTIONS
    one, _ = engine.generate([mt_prompts[0]], SamplingParams(max_tokens=MT_TOKENS))
    assert one[0].token_ids == mt_plain[0]


def test_trained_drafter_folder_serves_through_from_pretrained_and_equals_plain_greedy(tmp_path_factory, real_shards,
                                                                                       model_dir, mt_prompts, mt_plain):
    from distill.train import TrainConfig, train

    out = tmp_path_factory.mktemp("eagle-engine") / "drafter"
    train(TrainConfig(data=str(real_shards), out=str(out), arch="eagle3", steps=6, max_len=64, batch_size=4, lr=3e-3,
                      warmup_steps=1, seed=0, progress=False))
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    engine = Engine.from_pretrained(str(model_dir), out, EngineConfig(speculate_max_batch=8, draft_nodes=12))
    assert engine.proposer.name == "eagle3" and engine.tree is None
    results, stats = engine.generate(mt_prompts, SamplingParams(max_tokens=MT_TOKENS))
    assert [r.token_ids for r in results] == mt_plain
    assert stats.steps < sum(len(r) for r in mt_plain)  # the drafter got some tokens right

    # --tree with a drafter: a calibration file's per-depth accuracy for the policy (its paths unused); a preset is refused
    import re

    from distill.engine.engine import EAGLE_TREE, load_heads
    from distill.heads.tree import save_tree

    accuracy = [[0.5, 0.2], [0.4, 0.1], [0.3, 0.1]]
    calibration = tmp_path_factory.mktemp("eagle-calibration") / "tree.json"
    save_tree(calibration, [(0,), (1,), (0, 0), (0, 0, 0)], 3, accuracy=accuracy, source="calibrate")
    drafter, tree = load_heads(out, EngineConfig(tree=str(calibration), device="cpu", dtype="float32"))
    assert tree.paths == [] and tree.accuracy == accuracy and tree.source == str(calibration)
    assert Engine(engine.model, engine.tokenizer, drafter, EngineConfig(tree=str(calibration), draft_depth=3, draft_nodes=8, draft_topk=2),
                  tree=tree).proposer.accuracy == accuracy
    with pytest.raises(ConfigError, match=re.escape(EAGLE_TREE)):
        load_heads(out, EngineConfig(tree="sparse-8", device="cpu", dtype="float32"))
