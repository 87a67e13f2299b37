"""The steps' direct forward (distill.engine.cpu.direct): which models it runs, the engine's check that it gives
the modules' numbers exactly, its equality with the modules over whole generations (logprobs, EAGLE-3 features), and
the modules computing again once the model changes or gains a hook. The engines here run a model of their own: the
session's has been through other tests' engines, restores and hooks, which the direct forward declines."""

from __future__ import annotations

import pytest
import torch

from distill.engine import Engine, EngineConfig, SamplingParams
from distill.engine.cpu import prepare
from distill.engine.cpu.direct import DirectDecoder
from distill.engine.cpu.linears import vllm_kernels
from conftest import mt_bench_prompts
from helpers import bundled_drafter, tiny_llama

needs_vllm = pytest.mark.skipif(vllm_kernels() != "", reason=f"vLLM's CPU kernels unavailable: {vllm_kernels()}")


@pytest.fixture(scope="module")
def own_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def uneven(tokenizer) -> list[list[int]]:
    """A long prompt between two of the shortest MT-Bench turns."""
    by_length = sorted(mt_bench_prompts(tokenizer, 60), key=len)
    return [by_length[0], by_length[-1], by_length[1]]


def prepared_tiny(**config):
    model = tiny_llama(tied=True, **config)
    prepare(model, lambda: model(torch.tensor([[1, 2]])).logits, None)  # fused q/k/v and gate/up: the example forward
    return model


@needs_vllm
def test_the_kernel_argmax_gives_torchs_indices_with_ties_to_the_first():
    from distill.engine.cpu.argmax import _kernel_agrees, argmax

    assert _kernel_agrees()  # the kernel is what runs here, not torch's fallback
    x = torch.randn(16, 3, 1000, generator=torch.Generator().manual_seed(1))
    x[:, :, 5] = x.max(-1).values  # every row ties: the first maximum wins
    x[3, 1] = 0.0
    assert torch.equal(argmax(x), x.argmax(-1)) and argmax(x).shape == (16, 3)
    assert torch.equal(argmax(x[:, 1]), x[:, 1].argmax(-1))  # a strided view: torch's path
    assert torch.equal(argmax(x.double()), x.argmax(-1))


@needs_vllm
def test_a_prepared_llama_runs_direct_and_other_models_say_why_not():
    model = prepared_tiny(layers=3)
    direct = DirectDecoder.of(model)
    assert isinstance(direct, DirectDecoder) and len(direct.layers) == 3 and direct.current()
    assert [layer.qkv_order for layer in direct.layers] == [(0, 1, 2)] * 3
    assert "not on the kernels" in DirectDecoder.of(tiny_llama(tied=True))  # as loaded: nothing prepared
    handle = model.model.layers[1].mlp.register_forward_hook(lambda *args: None)
    assert DirectDecoder.of(model) == "layer 1 has hooks" and not direct.current()
    handle.remove()
    assert direct.current()
    assert "sliding-window" in DirectDecoder.of(prepared_tiny(sliding_window=8))


@needs_vllm
def test_a_direct_forward_that_differs_from_the_modules_is_not_used(own_model, tokenizer, monkeypatch):
    forward = DirectDecoder.forward

    def off_by_a_little(self, *args):
        logits, features = forward(self, *args)
        return logits + 1e-6, features

    monkeypatch.setattr(DirectDecoder, "forward", off_by_a_little)
    engine = Engine(own_model, tokenizer, None, EngineConfig(max_batch=2))
    assert engine.target.direct is None and engine.target.prep["direct_steps"] == 0
    assert engine.target.direct_problem == "its step differs from the modules' (logits, 2 token(s) a row)"
    assert engine.target.paged_problem == ""  # the kernel attention stays
    monkeypatch.setattr(DirectDecoder, "forward", forward)
    packed = DirectDecoder.packed
    monkeypatch.setattr(DirectDecoder, "packed", lambda self, *args: (lambda lf: (lf[0], lf[1] + 1e-6))(packed(self, *args)))
    engine = Engine(own_model, tokenizer, None, EngineConfig(max_batch=2))
    assert engine.target.direct is None and engine.target.direct_problem == "its prefill differs from the modules'"


@needs_vllm
def test_direct_steps_give_the_modules_tokens_logprobs_and_features_exactly(own_model, tokenizer, uneven):
    """Where the attention runs on the kernel, every plain step of rows of uneven lengths and every chain an EAGLE-3
    drafter verifies runs the prepared kernels layer by layer (engine.cpu.direct), and gives exactly what the modules
    give: the same tokens and logprobs, and features (the hidden states entering the drafter's layers) so equal that
    the drafter proposes and accepts the same tokens every step."""

    def engines(heads, **config):
        pair = [Engine(own_model, tokenizer, heads, EngineConfig(max_batch=3, **config)) for _ in range(2)]
        assert pair[0].target.direct is not None and pair[0].target.prep["direct_steps"] == 1
        pair[1].target.direct = None  # the same engine through the model's modules
        calls, prefills = [], []
        direct = pair[0].target.direct
        forward, packed = direct.forward, direct.packed
        direct.forward = lambda *args: calls.append(args[3]) or forward(*args)
        # the packed forwards' rows (prefills: the prompts' lengths)
        direct.packed = lambda *args: prefills.append(args[2].starts.diff().tolist()) or packed(*args)
        return pair, calls, prefills

    (direct, modules), calls, prefills = engines(None)
    params = SamplingParams(max_tokens=12, logprobs=3)
    got, stats = direct.generate(uneven, params)
    want, _ = modules.generate(uneven, params)
    assert len(calls) == stats.steps > 0 and all(layers is None for layers in calls)
    (lengths,) = prefills  # one prefill, the prompts packed, longest first
    assert len(lengths) == len(uneven) and lengths == sorted(lengths, reverse=True) and len(set(lengths)) > 1
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert [r.logprobs for r in got] == [r.logprobs for r in want]

    def joined(engine):  # two prompts join a running row in a step: on the direct loop, prefilled in its forward
        run = engine.running_batch()
        done = dict(run.add(uneven[:1], [params], [0]))
        done.update(run.step())
        done.update(run.step(uneven[1:], [params] * (len(uneven) - 1), list(range(1, len(uneven)))))
        while len(run):
            done.update(run.step())
        return [done[k] for k in range(len(uneven))], run.stats

    prefills.clear()
    (got, stats), (want, want_stats) = joined(direct), joined(modules)
    assert prefills[1] == [1] + [len(p) for p in uneven[1:]]  # the running row's token, then the prompts'
    assert sum(map(bool, stats.joined_per_step)) == 1 and not any(want_stats.joined_per_step)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    # the running row's products ran over more rows in the joining step: rounded as another batch's are (not bit for bit)
    pairs = [(a, b) for r, s in zip(got, want) for a, b in zip(r.logprobs, s.logprobs)]
    assert len(pairs) == sum(len(r.token_ids) for r in got) and all(abs(a.logprob - b.logprob) < 1e-4 for a, b in pairs)
    (direct, modules), calls, prefills = engines(bundled_drafter(own_model, "fresh"), draft_topk=1, draft_depth=3,
                                                 draft_nodes=3, speculate_max_batch=3)
    got, stats = direct.generate(uneven, SamplingParams(max_tokens=12))
    want, want_stats = modules.generate(uneven, SamplingParams(max_tokens=12))
    layers = direct.decoding.proposer.feature_layers
    assert stats.tree_nodes == 3 and len(layers) == 3 and calls and all(c == layers for c in calls)
    assert len(prefills) == 1  # the drafter's features of the prompts come out of the packed prefill
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert stats.accepted_per_step == want_stats.accepted_per_step
    # rows joining the drafter's chain steps: its state starts from the prompts' features of that step's forward
    (got, stats), (want, want_stats) = joined(direct), joined(modules)
    assert sum(map(bool, stats.joined_per_step)) == 1 and not any(want_stats.joined_per_step)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert stats.accepted_per_step == want_stats.accepted_per_step and stats.tree_nodes == 3
    # branching trees (two children a node): the direct loop too, its queries attending under the tree's mask
    (direct, modules), calls, prefills = engines(bundled_drafter(own_model, "fresh"), draft_topk=2, draft_depth=3,
                                                 draft_nodes=4, speculate_max_batch=3)
    params = SamplingParams(max_tokens=12, logprobs=2)
    got, stats = direct.generate(uneven, params)
    want, want_stats = modules.generate(uneven, params)
    assert stats.tree_nodes == 4 and len(calls) == stats.steps  # every step, the trees' included
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert [r.logprobs for r in got] == [r.logprobs for r in want]
    assert stats.accepted_per_step == want_stats.accepted_per_step


@needs_vllm
def test_the_modules_compute_again_once_one_gains_a_hook(model_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()  # hooks: a model of its own
    engine = Engine(model, tokenizer, None, EngineConfig(max_batch=2))
    assert engine.target.direct is not None
    prompts = [tokenizer.encode(t) for t in ("Name three colours.", "Write a haiku about the sea, please.")]
    params = SamplingParams(max_tokens=8)
    before, _ = engine.generate(prompts, params)
    seen = []
    model.model.layers[3].mlp.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    after, stats = engine.generate(prompts, params)
    assert len(seen) == stats.steps + 1  # the prefill and every step ran the layer's module
    assert engine.target.direct is None and "hooks" in engine.target.direct_problem
    assert engine.linear_prep["direct_steps"] == 0
    assert [r.token_ids for r in after] == [r.token_ids for r in before]
