"""The engine on the bundled model (float32): greedy Medusa == plain greedy, batched == batch 1, stops."""

from __future__ import annotations


import pytest
import torch

from conftest import mt_bench_prompts
from distill.engine import Engine, EngineConfig, GenerationResult, SamplingParams, StepStats
from distill.engine.policy import DEFAULT_COST_RATIO, choose_tree_size
from distill.engine.target import Target
from distill.errors import ConfigError
from helpers import make_heads

NEW_TOKENS = 24
QUESTIONS = 4


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    """Chat-templated first turns of the first MT-Bench questions."""
    out = mt_bench_prompts(tokenizer, QUESTIONS)
    assert len({len(p) for p in out}) > 1  # different lengths: left padding is exercised
    return out


@pytest.fixture(scope="module")
def plain_reference(hf_model, tokenizer, prompts) -> list[GenerationResult]:
    """Plain greedy decoding, one prompt at a time."""
    engine = Engine(hf_model, tokenizer, None, EngineConfig())
    out = []
    for p in prompts:
        res, stats = engine.generate([p], [SamplingParams(max_tokens=NEW_TOKENS)])
        assert stats.tree_nodes == 0 and res[0].accepted == [1] * res[0].steps
        out.append(res[0])
    return out


@pytest.mark.parametrize("random_w1", [True, False], ids=["random-heads", "lm-head-heads"])
def test_greedy_medusa_equals_plain_greedy_on_mt_bench(hf_model, tokenizer, prompts, plain_reference, random_w1):
    engine = Engine(hf_model, tokenizer, make_heads(hf_model, random_w1),
                    EngineConfig(tree="sparse-16", max_batch=QUESTIONS, speculate_max_batch=QUESTIONS))
    results, stats = engine.generate(prompts, [SamplingParams(max_tokens=NEW_TOKENS)] * len(prompts))
    assert stats.tree_nodes == 16 and stats.batch_size == QUESTIONS
    assert max(a for r in results for a in r.accepted) >= 2  # candidates were accepted: the commit path ran
    for res, ref in zip(results, plain_reference):
        assert res.token_ids == ref.token_ids
        assert res.finish_reason == ref.finish_reason
        assert sum(res.accepted) >= len(res.token_ids) - 1  # every emitted token counted (last step may be cut)
        assert res.steps <= ref.steps


@pytest.fixture(scope="module")
def trained_heads_dir(real_shards, tmp_path_factory):
    """Heads briefly trained by distill.train (Medusa-1, 3 heads, shared LM head, a few steps) on the real shards."""
    from distill.train import TrainConfig, train

    out = tmp_path_factory.mktemp("engine-trained-heads") / "heads"
    train(TrainConfig(data=str(real_shards), out=str(out), heads=3, share_lm_head=True, max_len=96, batch_size=2, steps=4,
                      progress=False))
    return out


@pytest.mark.slow
@pytest.mark.vllm
def test_greedy_medusa_with_trained_heads_equals_plain_greedy(trained_heads_dir, model_dir, prompts, plain_reference):
    engine = Engine.from_pretrained(str(model_dir), trained_heads_dir,
                                    EngineConfig(tree="3,2,2", max_batch=QUESTIONS, speculate_max_batch=QUESTIONS))
    assert engine.heads is not None and engine.heads.config.num_heads == 3
    assert any(float(layer.weight.detach().abs().max()) > 0 for b in engine.heads.blocks for layer in b.layers)  # trained
    results, stats = engine.generate(prompts, [SamplingParams(max_tokens=NEW_TOKENS)] * len(prompts))
    assert stats.tree_nodes == 3 + 6 + 12
    for res, ref in zip(results, plain_reference):
        assert res.token_ids == ref.token_ids


def test_batched_decoding_equals_batch_one(hf_model, tokenizer, prompts, plain_reference):
    """Medusa batch 1 per prompt and batch 4 (different accepted lengths, different max_tokens), plain batch 4."""
    heads = make_heads(hf_model, random_w1=True, seed=1)
    engine = Engine(hf_model, tokenizer, heads, EngineConfig(tree="3,2,1", max_batch=QUESTIONS, speculate_max_batch=QUESTIONS))
    budgets = [16, 9, 16, 12]  # sequences leave the batch at different steps
    params = [SamplingParams(max_tokens=n) for n in budgets]
    single = [engine.generate([p], [sp])[0][0] for p, sp in zip(prompts, params)]
    batched, stats = engine.generate(prompts, params)
    plain, _ = engine.generate(prompts, params, speculative=False)
    for one, many, flat, ref, n in zip(single, batched, plain, plain_reference, budgets):
        assert one.token_ids == many.token_ids == flat.token_ids == ref.token_ids[:n]
        assert one.accepted == many.accepted
    assert stats.tree_nodes == 3 + 6 + 6


@pytest.mark.parametrize("speculative", [True, False], ids=["medusa", "plain"])
def test_sequences_joining_a_running_batch_decode_as_in_batch_one(hf_model, tokenizer, prompts, plain_reference, speculative):
    """Continuous batching: prompts join a running batch in a step (a longer prompt into a shorter cache and the
    reverse), rows leave as they finish, and every greedy sequence still equals its batch-1 decoding. Plain steps on the
    direct loop prefill the joiners in their own forward; Medusa's branching trees prefill them apart first."""
    heads = make_heads(hf_model, random_w1=True, seed=2)
    engine = Engine(hf_model, tokenizer, heads, EngineConfig(tree="3,2,1", max_batch=QUESTIONS, speculate_max_batch=QUESTIONS))
    budgets = {"a": 20, "b": 6, "c": 16, "d": 12}
    seen: dict[str, list[int]] = {k: [] for k in budgets}

    def on_tokens(key, new):
        seen[key].extend(new)
        return True

    batch = engine.running_batch(speculative, on_tokens)
    results: dict[str, GenerationResult] = {}
    order = sorted(range(QUESTIONS), key=lambda i: len(prompts[i]))  # shortest prompt first: later ones are longer
    keys = list(budgets)
    assert dict(batch.add([prompts[order[0]]], [SamplingParams(max_tokens=budgets["a"])], ["a"])) == {}
    joined_at = {}
    for step in range(200):
        if step in (2, 5) and len(joined_at) < 3:  # one joins alone, then two together (with different lengths)
            group = keys[1:2] if step == 2 else keys[2:4]
            idx = [order[keys.index(k)] for k in group]
            joined_at.update({k: step for k in group})
            results.update(batch.step([prompts[i] for i in idx], [SamplingParams(max_tokens=budgets[k]) for k in group],
                                      group))
        else:
            results.update(batch.step())
        used, allocated = batch.kv_slots  # a running row holds its prompt and its tokens but the newest (the next step's root)
        assert used == sum(len(prompts[order[keys.index(k)]]) + len(seen[k]) - 1 for k in joined_at.keys() | {"a"} if k not in results)
        assert used <= allocated
        if not len(batch) and len(joined_at) == 3:
            break
    assert set(results) == set(keys) and len(batch) == 0 and batch.kv_slots == (0, 0)
    mixed = not speculative and engine.target.direct is not None
    stats = batch.stats
    assert sum(1 for n in stats.joined_per_step if n) == (2 if mixed else 0)  # the joining steps prefilled them
    assert len(stats.prefill_tokens) == (1 if mixed else 3)  # else forwards of their own
    pool = engine.target.kv_pool  # on vLLM's kernel: prefill caches apart and outgrown storage come back
    assert engine.target.paged_problem or mixed or (pool.key_order == "dims" and pool.reused >= 1)
    for k in keys:
        ref = plain_reference[order[keys.index(k)]]
        assert results[k].token_ids == ref.token_ids[: budgets[k]] == seen[k], k
        # the budget decides: cut at it ("length") unless the plain run ended sooner (its own reason)
        assert results[k].finish_reason == ("length" if len(ref.token_ids) >= budgets[k] else ref.finish_reason), k
    assert batch.stats.steps > 0
    if speculative:
        assert max(a for r in results.values() for a in r.accepted) >= 2  # speculation ran in the mixed batch


@pytest.fixture(scope="module")
def uneven(tokenizer) -> list[list[int]]:
    """A long prompt between two of the shortest MT-Bench turns."""
    by_length = sorted(mt_bench_prompts(tokenizer, 60), key=len)
    chosen = [by_length[0], by_length[-1], by_length[1]]
    assert len(chosen[1]) > 4 * len(chosen[0])
    return chosen


def test_rows_of_very_different_lengths_attend_in_chunks_and_decode_as_in_batch_one(hf_model, tokenizer, uneven, monkeypatch):
    """SDPA attention: the prefill and every plain step attend in row chunks (engine.attention), and each greedy row
    still equals its batch-1 decoding."""
    import distill.engine.target as target_module

    engine = Engine(hf_model, tokenizer, None, EngineConfig(max_batch=3, attention="sdpa"))
    assert engine.target.paged_problem and engine.target.new_cache(1, 8).key_order == "slots"
    params = SamplingParams(max_tokens=12)
    single = [engine.generate([p], params)[0][0].token_ids for p in uneven]
    plans = []
    real = target_module.plan_row_chunks
    monkeypatch.setattr(target_module, "plan_row_chunks", lambda q, k: plans.append(real(q, k)) or plans[-1])
    batched, stats = engine.generate(uneven, params)
    assert [r.token_ids for r in batched] == single
    assert len(plans) == stats.steps + 1 and all(p is not None for p in plans)
    assert [(r0, r1) for r0, r1, _, _ in plans[0]] == [(0, 1), (1, 3)]  # the prefill: the long prompt first, alone


def test_kernel_attention_runs_prefills_plain_steps_and_chains_and_decodes_as_sdpa(hf_model, tokenizer, uneven, monkeypatch):
    """vLLM's CPU kernel (engine.cpu.paged) attends in the prefill and every plain step of rows of uneven lengths and in
    chain steps; branching trees attend in distill_sdpa over the same keys. Every greedy row equals its batch-1
    decoding and SDPA's."""
    from distill.engine.cpu import paged

    sdpa = Engine(hf_model, tokenizer, None, EngineConfig(max_batch=3, attention="sdpa"))
    engine = Engine(hf_model, tokenizer, None, EngineConfig(max_batch=3))
    assert engine.target.paged_problem == "" and engine.target.new_cache(1, 8).key_order == "dims"
    params = SamplingParams(max_tokens=12)
    want = [sdpa.generate([p], params)[0][0].token_ids for p in uneven]
    assert [engine.generate([p], params)[0][0].token_ids for p in uneven] == want
    plans = []
    real = paged.plan
    monkeypatch.setattr(paged, "plan", lambda *a, **k: plans.append(real(*a, **k)) or plans[-1])
    batched, stats = engine.generate(uneven, params)
    assert [r.token_ids for r in batched] == want
    assert len(plans) == stats.steps + 1 and all(p.pack is None for p in plans[1:])
    # the prefill's queries: every prompt token, packed by the direct loop, else right-padded and packed for the kernel
    assert int(plans[0].starts[-1]) == sum(map(len, uneven)) and (plans[0].pack is None) == (engine.target.direct is not None)
    for tree in ("chain", "sparse-8"):
        medusa = Engine(hf_model, tokenizer, make_heads(hf_model, random_w1=False), EngineConfig(max_batch=3, tree=tree, speculate_max_batch=3))
        plans.clear()  # from here: the generation's (the engine's start-up check plans its own steps)
        results, stats = medusa.generate(uneven, params)
        assert [r.token_ids for r in results] == want and stats.tree_nodes > 0
        steps = plans[1:]
        if medusa.target.direct is not None:  # every step planned; a branching tree's attends under its mask, not the kernel
            assert len(steps) == stats.steps and all((p.masked is None) == (tree == "chain") for p in steps)
        else:
            assert (len(steps) == stats.steps) == (tree == "chain")  # a branching tree's steps are not the kernel's


def test_stop_tokens_cancellation_and_callbacks(hf_model, tokenizer, prompts, plain_reference):
    engine = Engine(hf_model, tokenizer, make_heads(hf_model, random_w1=True), EngineConfig(tree="chain", speculate_max_batch=2))
    ref = plain_reference[0].token_ids
    stop_at = 5
    seen: dict[int, list[int]] = {0: [], 1: []}

    def on_tokens(i: int, new: list[int]) -> bool:
        seen[i].extend(new)
        return not (i == 1 and len(seen[1]) >= 3)

    params = [SamplingParams(max_tokens=NEW_TOKENS, stop_token_ids=(ref[stop_at],)), SamplingParams(max_tokens=NEW_TOKENS)]
    results, stats = engine.generate([prompts[0], prompts[0]], params, on_tokens=on_tokens)
    first = ref.index(ref[stop_at])
    assert results[0].finish_reason == "stop" and results[0].token_ids == ref[:first]
    assert seen[0] == results[0].token_ids
    assert results[1].finish_reason == "cancelled" and results[1].token_ids == seen[1] and len(seen[1]) >= 3
    assert results[1].token_ids == ref[: len(seen[1])]
    assert isinstance(stats, StepStats) and stats.tokens == len(results[0].token_ids) + len(results[1].token_ids)
    assert len(stats.step_seconds) == stats.steps and stats.prefill_seconds > 0


def test_heads_folder_with_tree_json_loads_through_from_pretrained(hf_model, tmp_path, model_dir, prompts, plain_reference):
    from distill.heads.tree import save_tree

    heads = make_heads(hf_model, random_w1=True, num_heads=3)
    heads.save(tmp_path / "heads")
    save_tree(tmp_path / "heads" / "tree.json", [(0,), (1,), (0, 0), (0, 0, 0)], num_heads=3,
              accuracy=[[0.5, 0.2], [0.3, 0.1], [0.2, 0.1]], source="calibrate")
    engine = Engine.from_pretrained(str(model_dir), tmp_path / "heads", EngineConfig(speculate_max_batch=1))
    assert engine.tree is not None and engine.tree.paths == [(0,), (1,), (0, 0), (0, 0, 0)]
    res, stats = engine.generate([prompts[1]], [SamplingParams(max_tokens=8)])
    assert stats.tree_nodes == 4 and res[0].token_ids == plain_reference[1].token_ids[:8]


def test_bad_requests_are_clear_errors(hf_model, tokenizer):
    engine = Engine(hf_model, tokenizer, None, EngineConfig())
    with pytest.raises(ConfigError, match="empty"):
        engine.generate([[]], [SamplingParams()])
    with pytest.raises(ConfigError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ConfigError, match="acceptance"):
        EngineConfig(acceptance="lenient")
    with pytest.raises(ConfigError, match="2 prompts but 1"):
        engine.generate([[1], [2]], [SamplingParams()])


def test_policy_shrinks_the_tree_as_the_batch_grows_and_turns_speculation_off(hf_model, tokenizer, prompts):
    # the cost model given as the line 1 + r(m - 1), r the CPU default: a tree's share of a step grows with the batch
    heads = make_heads(hf_model, random_w1=True)
    engine = Engine(hf_model, tokenizer, heads, EngineConfig(tree="sparse-24", step_cost_ratio=DEFAULT_COST_RATIO["cpu"]))
    batches = (1, 2, 4, 8, 16, 32, 64)
    sizes = [engine.tree_size_for(b) for b in batches]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > 0 and sizes[-1] == 0
    # the curve measured on this machine (the default on a CPU) need not fall with the batch: on some CPUs at one thread
    # 2 rows cost 1.5x one row and 14 rows 1.5x 2 rows, so a 6-node tree pays at batch 2 and not at batch 1.
    # The policy is the best size by that curve at every batch, and at 64 no tree pays (a one-node tree doubles the rows)
    measured = Engine(hf_model, tokenizer, heads, EngineConfig(tree="sparse-24"))
    assert measured.step_costs is not None
    assert [measured.tree_size_for(b) for b in batches] == [
        choose_tree_size(b, measured.pricing.taus, measured.step_costs, None, measured.pricing.proposal) for b in batches]
    assert measured.tree_size_for(64) == 0
    forced = Engine(hf_model, tokenizer, engine.heads, EngineConfig(tree="chain", speculate_max_batch=1, max_batch=2))
    assert forced.tree_size_for(1) == 4 and forced.tree_size_for(2) == 0
    results, stats = forced.generate(prompts[:2], [SamplingParams(max_tokens=4)] * 2)
    assert stats.tree_nodes == 0 and all(r.accepted == [1] * r.steps for r in results)


def test_adaptive_policy_turns_off_heads_that_guess_wrong_and_stays_lossless(hf_model, tokenizer, prompts, plain_reference):
    # heads that always guess wrong: each predicts the token the model finds least likely (negated LM heads). Random
    # residuals guess right now and then, and then whether a 1-node tree still pays hung on the step times measured.
    heads = make_heads(hf_model, random_w1=False, num_heads=4)
    with torch.no_grad():
        for lm in heads.lm_heads:
            lm.weight.neg_()
    engine = Engine(hf_model, tokenizer, heads, EngineConfig(tree="chain", adaptive=True, step_cost_ratio=0.0))
    assert engine.policy is not None and engine.tree_size_for(1) > 0  # calibrated default accuracy: speculate
    engine.policy._decay = 0.01  # forget the prior (and each step) almost at once, for a short test
    res, stats = engine.generate([prompts[0]], [SamplingParams(max_tokens=NEW_TOKENS)])
    assert res[0].token_ids == plain_reference[0].token_ids[:NEW_TOKENS]
    assert res[0].accepted == [1] * res[0].steps  # no guess was accepted
    nodes = stats.tree_nodes_per_step
    # plain steps until plain decoding's cost is measured (the first is never timed), then the tree, then plain again
    assert nodes[:2] == [0, 0] and nodes[2] > 0 and nodes[-1] == 0, nodes
    # after one tree step ρ = 0.08 / 0.64: a tree no longer pays by the cost model, which scales the measured plain
    # step (a pair's first step is never timed, so the single tree step's own time does not enter the choice)
    assert engine.policy.acceptance_ratio < 0.5, engine.policy.acceptance_ratio
    assert engine.tree_size_for(1) == 0


def first_layers(model_dir, layers: int):
    """The bundled model cut to its first ``layers`` decoder layers: its own weights, embeddings and LM head."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    return model


def _pin_single_row_kernels(model) -> dict[str, int]:
    """Give the prepared linears of ``model`` single-row kernels by name, in turn: MKL on the weight, vLLM's packed copy,
    the packed copy padded (MKL on the weight only where there is no vLLM copy) -> how many linears got each."""
    from distill.engine.cpu.linears import PACKED, PADDED, WEIGHT, DualLinear

    count = {WEIGHT: 0, PACKED: 0, PADDED: 0}
    linears = sorted((name, m) for name, m in model.named_modules() if type(m) is DualLinear)
    for i, (_, m) in enumerate(linears):
        m.single = (WEIGHT, PACKED, PADDED)[i % 3] if m.vllm is not None else WEIGHT
        count[m.single] += 1
    return count


def test_compiled_single_token_forwards_decode_as_eager(model_dir, tokenizer, prompts, monkeypatch):
    """EngineConfig.compile: plain batch-1 steps run the compiled model and give plain decoding's tokens; a
    Medusa run on the same engine (its trees and its batch of two stay eager) gives them too. Each single-row
    product in the graph is the kernel the probe chose for its linear, as eagerly (here pinned, the same linear
    by linear in both engines: MKL on the weight, vLLM's matmul, vLLM's matmul padded).

    On the bundled model's first 2 layers: compiling all 30 took 100 s of the suite (4 layers: 39 s, 2: 31 s), and what is checked (the
    compiled single-token path, the eager fallbacks around it) does not depend on the depth."""
    from torch.profiler import ProfilerActivity, profile

    from distill.engine.cpu.linears import PACKED, PADDED

    reference_model = first_layers(model_dir, 2)
    with monkeypatch.context() as m:  # the reference's linears unfused, as the compiled engine's: the same products
        m.setattr(Target, "_example", lambda self: None)
        reference = Engine(reference_model, tokenizer, None, EngineConfig())
    pinned = _pin_single_row_kernels(reference_model)
    vllm_products = pinned[PACKED] + pinned[PADDED]
    plain_reference = [reference.generate([p], [SamplingParams(max_tokens=NEW_TOKENS)])[0][0] for p in prompts[:2]]
    assert all(len(r.token_ids) > 4 for r in plain_reference)
    from torch._dynamo.utils import counters

    counters.clear()
    model = first_layers(model_dir, 2)  # its own: compile hooks its decoder
    engine = Engine(model, tokenizer, make_heads(model, random_w1=True), EngineConfig(tree="sparse-16", speculate_max_batch=2, compile=True))
    assert _pin_single_row_kernels(model) == pinned
    engine.warmup()
    warm = engine.compiled_forwards
    assert warm == 2  # the warm-up's two single-token steps (3 tokens: one from the prefill)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        res, stats = engine.generate([prompts[0]], [SamplingParams(max_tokens=NEW_TOKENS)], speculative=False)
    assert res[0].token_ids == plain_reference[0].token_ids and stats.tree_nodes == 0
    compiled = engine.compiled_forwards - warm
    in_graph = [e for e in prof.events() if e.name == "_C::onednn_mm" and _inside_compiled_region(e)]
    assert compiled == len(res[0].token_ids) - 1 and len(in_graph) == compiled * vllm_products, (compiled, len(in_graph), pinned)
    res, stats = engine.generate([prompts[1]], [SamplingParams(max_tokens=NEW_TOKENS)], speculative=False)
    assert res[0].token_ids == plain_reference[1].token_ids and stats.tree_nodes == 0
    assert engine.compiled_forwards - warm == sum(len(r.token_ids) - 1 for r in plain_reference)  # every step compiled
    before = engine.compiled_forwards
    results, stats = engine.generate(prompts[:2], [SamplingParams(max_tokens=NEW_TOKENS)] * 2)
    assert [r.token_ids for r in results] == [r.token_ids for r in plain_reference] and stats.tree_nodes == 16
    assert engine.compiled_forwards == before  # two rows, trees of 17 tokens: never a single-token forward
    # one graph for the whole model, compiled once: no break sends a layer back to eager, and the KV storage
    # growing from the warm-up's short prompt to these longer ones did not recompile it
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def _inside_compiled_region(event) -> bool:
    """Did the profiled ``event`` run inside a compiled graph (the profiler's "Torch-Compiled Region" range)?"""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("Torch-Compiled Region"):
            return True
        parent = parent.cpu_parent
    return False
