"""The rotary embedding on vLLM's CPU kernel (distill.engine.rotary): the same logits inside an engine forward, the
original function everywhere else, and nothing replaced where the kernel does not reproduce the model's rotation."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama import modeling_llama

from distill.engine import Engine, EngineConfig, SamplingParams, rotary
from distill.engine.rotary import prepare_rotary, restore_rotary, rotary_kernel
from distill.engine.weights import prepare_linears, vllm_kernels
from helpers import tiny_llama

needs_vllm = pytest.mark.skipif(vllm_kernels() != "", reason=f"vLLM's CPU kernels unavailable: {vllm_kernels()}")


@pytest.fixture
def counted(monkeypatch):
    """Calls of the kernel path (rotary._rotate), and the module's original function back afterwards."""
    original = modeling_llama.apply_rotary_pos_emb
    original = getattr(original, "__wrapped__", original)
    calls = []
    rotate = rotary._rotate
    monkeypatch.setattr(rotary, "_rotate", lambda *a: calls.append(a[0].shape) or rotate(*a))
    yield calls
    modeling_llama.apply_rotary_pos_emb = original


@needs_vllm
def test_a_llamas_rotation_runs_on_the_kernel_inside_an_engine_forward_only(counted):
    model = tiny_llama(tied=True)
    prepare_linears(model, lambda: model(torch.tensor([[1, 2]])).logits)  # q/k/v one product: strided query/key rows
    ids = torch.randint(0, 64, (2, 7))
    positions = torch.arange(7)[None].expand(2, 7) + torch.tensor([[0], [21]])
    with torch.inference_mode():
        before = model(ids, position_ids=positions).logits
    assert prepare_rotary(model) == {"rotary_vllm": 2}
    assert prepare_rotary(model) == {"rotary_vllm": 2}  # wrapped once: the function is not wrapped again
    assert modeling_llama.apply_rotary_pos_emb.__wrapped__ is not None
    counted.clear()
    with torch.inference_mode():
        outside = model(ids, position_ids=positions).logits
        assert not counted  # no engine forward running: transformers' own function
        with rotary_kernel():
            inside = model(ids, position_ids=positions).logits
    assert counted == [torch.Size([2, 4, 7, 4])] * 2  # one kernel call per layer
    assert torch.equal(outside, before)
    assert torch.allclose(inside, before, rtol=1e-5, atol=1e-5)
    counted.clear()
    with rotary_kernel():  # autograd on (training): the original, which does not write into its inputs
        model(ids, position_ids=positions)
    assert not counted
    assert restore_rotary(model) == 1 and not hasattr(modeling_llama.apply_rotary_pos_emb, "__wrapped__")


@needs_vllm
def test_a_rotation_the_kernel_does_not_reproduce_is_left_alone(counted):
    model = tiny_llama(tied=True)
    rotary_module = model.model.rotary_emb

    def swapped_halves(q, k, cos, sin, unsqueeze_dim=1):  # another convention (GPT-J style pairs), as some models have
        def pairs(x):
            return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return q * cos + pairs(q) * sin, k * cos + pairs(k) * sin

    assert rotary._reproduces(modeling_llama.apply_rotary_pos_emb, rotary_module, 4, 2, 4)
    assert not rotary._reproduces(swapped_halves, rotary_module, 4, 2, 4)
    assert prepare_rotary(tiny_llama(tied=True).to(torch.bfloat16)) == {"rotary_vllm": 0}  # float32 only


def test_without_vllms_kernels_nothing_is_replaced(monkeypatch, counted):
    monkeypatch.setattr(rotary, "vllm_kernels", lambda: "vLLM is not installed")
    before = modeling_llama.apply_rotary_pos_emb
    assert prepare_rotary(tiny_llama(tied=True)) == {"rotary_vllm": 0}
    assert modeling_llama.apply_rotary_pos_emb is before


@needs_vllm
def test_the_engine_rotates_on_the_kernel_with_the_outputs_of_transformers_rotation(hf_model, tokenizer, monkeypatch):
    engine = Engine(hf_model, tokenizer, None, EngineConfig(max_batch=4))
    assert engine.linear_prep["rotary_vllm"] == hf_model.config.num_hidden_layers
    prompts = [tokenizer.encode(t) for t in ("Name three colours.", "Hi", "Write a haiku about the sea and the moon, please.")]
    params = SamplingParams(max_tokens=10, logprobs=2)
    calls = []
    rotate = rotary._rotate
    monkeypatch.setattr(rotary, "_rotate", lambda *a: calls.append(1) or rotate(*a))
    on, _ = engine.generate(prompts, params, speculative=False)
    assert len(calls) >= 10 * hf_model.config.num_hidden_layers  # the prefill and every step, each layer
    engine._rotary = False  # the same engine with transformers' rotation
    off, _ = engine.generate(prompts, params, speculative=False)
    assert [r.token_ids for r in on] == [r.token_ids for r in off]
    for a, b in zip(on, off):
        assert all(abs(x.logprob - y.logprob) < 1e-4 for x, y in zip(a.logprobs, b.logprobs))
