"""The steps' direct forward (distill.engine.cpu.direct): which models it runs, the engine's check that it gives
the modules' numbers exactly, and the modules computing again once the model changes or gains a hook. Its equality
with the modules over whole generations, with logprobs and EAGLE-3 features: test_engine_decoding.py."""

from __future__ import annotations

import pytest
import torch

from distill.engine import Engine, EngineConfig, SamplingParams
from distill.engine.cpu import prepare
from distill.engine.cpu.direct import DirectDecoder
from distill.engine.cpu.linears import vllm_kernels
from helpers import tiny_llama

needs_vllm = pytest.mark.skipif(vllm_kernels() != "", reason=f"vLLM's CPU kernels unavailable: {vllm_kernels()}")


def prepared_tiny(**config):
    model = tiny_llama(tied=True, **config)
    prepare(model, lambda: model(torch.tensor([[1, 2]])).logits, None)  # fused q/k/v and gate/up: the example forward
    return model


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
def test_a_direct_forward_that_differs_from_the_modules_is_not_used(hf_model, tokenizer, monkeypatch):
    forward = DirectDecoder.forward

    def off_by_a_little(self, *args):
        logits, features = forward(self, *args)
        return logits + 1e-6, features

    monkeypatch.setattr(DirectDecoder, "forward", off_by_a_little)
    engine = Engine(hf_model, tokenizer, None, EngineConfig(max_batch=2))
    assert engine.target.direct is None and engine.target.prep["direct_steps"] == 0
    assert engine.target.direct_problem == "its step differs from the modules' (logits, 2 token(s) a row)"
    assert engine.target.paged_problem == ""  # the kernel attention stays


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
    assert [r.token_ids for r in after] == [r.token_ids for r in before]
