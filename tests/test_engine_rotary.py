"""Llama-style attention whose rotary embedding runs on vLLM's CPU kernel (distill.engine.cpu.rotary): the same
logits, the kernel only where it applies (no autograd, float32 on a CPU), nothing of transformers changed, and
nothing replaced where the kernel does not reproduce the model's rotation."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama import modeling_llama

from distill.engine import Engine, EngineConfig, SamplingParams
from distill.engine.cpu import rotary
from distill.engine.cpu.linears import prepare_linears, vllm_kernels
from distill.engine.cpu.rotary import KernelAttention, prepare_rotary, restore_rotary
from helpers import tiny_llama

needs_vllm = pytest.mark.skipif(vllm_kernels() != "", reason=f"vLLM's CPU kernels unavailable: {vllm_kernels()}")
ORIGINAL = modeling_llama.apply_rotary_pos_emb


@pytest.fixture
def counted(monkeypatch):
    """Calls of the kernel (rotary.rotate_rows, which the modules' and the direct steps' rotations call): the query
    rows' shapes."""
    calls = []
    rotate = rotary.rotate_rows
    monkeypatch.setattr(rotary, "rotate_rows", lambda *a: calls.append(a[1].shape) or rotate(*a))
    return calls


def attentions(model):
    return [layer.self_attn for layer in model.model.layers]


@needs_vllm
def test_a_llamas_attention_rotates_on_the_kernel_with_the_same_logits(counted):
    model = tiny_llama(tied=True)
    prepare_linears(model, lambda: model(torch.tensor([[1, 2]])).logits)  # q/k/v one product: strided query/key rows
    ids = torch.randint(0, 64, (2, 7))
    positions = torch.arange(7)[None].expand(2, 7) + torch.tensor([[0], [21]])
    originals = attentions(model)
    params = dict(model.named_parameters())
    with torch.inference_mode():
        before = model(ids, position_ids=positions).logits
    assert prepare_rotary(model) == {"rotary_vllm": 2}
    assert prepare_rotary(model) == {"rotary_vllm": 0}  # replaced once
    assert all(isinstance(a, KernelAttention) and a.original is o for a, o in zip(attentions(model), originals))
    assert dict(model.named_parameters()) == params  # the same parameters under the same names
    assert modeling_llama.apply_rotary_pos_emb is ORIGINAL and type(originals[0]).forward is modeling_llama.LlamaAttention.forward
    counted.clear()
    with torch.inference_mode():
        after = model(ids, position_ids=positions).logits
    assert counted == [torch.Size([2 * 7, 4 * 4])] * 2  # one kernel call per layer: (rows x tokens, heads x head size)
    assert torch.allclose(after, before, rtol=1e-5, atol=1e-5)
    counted.clear()
    model(ids, position_ids=positions)  # autograd on (training): the original module, which does not write into its inputs
    assert not counted
    assert restore_rotary(model) == 2 and attentions(model) == originals
    with torch.inference_mode():
        assert torch.equal(model(ids, position_ids=positions).logits, before)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """Another convention (GPT-J style pairs), as some models have."""
    def pairs(x):
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + pairs(q) * sin, k * cos + pairs(k) * sin


eager_attention_forward = modeling_llama.eager_attention_forward


class PairwiseAttention(modeling_llama.LlamaAttention):
    """A Llama attention that rotates pairs (this module's apply_rotary_pos_emb): what the kernel does not compute."""

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q, k, v = (p(hidden_states).view(shape).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        out, w = eager_attention_forward(self, q, k, v, attention_mask, scaling=self.scaling)
        return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1)), w


@needs_vllm
def test_an_attention_whose_rotation_the_kernel_does_not_reproduce_is_left_alone():
    model = tiny_llama(tied=True)
    llama = model.model.layers[0].self_attn
    pairwise = PairwiseAttention(model.config, 0)
    assert rotary.contract_problem(llama) is None and rotary.contract_problem(pairwise) is None
    assert rotary._reproduces(llama, model.model.rotary_emb)
    assert not rotary._reproduces(pairwise, model.model.rotary_emb)
    model.model.layers[1].self_attn = pairwise
    assert prepare_rotary(model) == {"rotary_vllm": 1} and model.model.layers[1].self_attn is pairwise
    assert prepare_rotary(tiny_llama(tied=True).to(torch.bfloat16)) == {"rotary_vllm": 0}  # float32 only


def test_without_vllms_kernels_nothing_is_replaced(monkeypatch):
    monkeypatch.setattr(rotary, "vllm_kernels", lambda: "vLLM is not installed")
    model = tiny_llama(tied=True)
    before = attentions(model)
    assert prepare_rotary(model) == {"rotary_vllm": 0} and attentions(model) == before


@needs_vllm
def test_the_engine_rotates_on_the_kernel_with_the_outputs_of_transformers_rotation(model_dir, tokenizer, counted):
    from transformers import AutoModelForCausalLM

    # a model of its own: the session's has been through other tests' engines and hooks
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    engine = Engine(hf_model, tokenizer, None, EngineConfig(max_batch=4))
    assert engine.linear_prep["rotary_vllm"] == hf_model.config.num_hidden_layers
    prompts = [tokenizer.encode(t) for t in ("Name three colours.", "Hi", "Write a haiku about the sea and the moon, please.")]
    params = SamplingParams(max_tokens=10, logprobs=2)
    on, _ = engine.generate(prompts, params, speculative=False)
    assert len(counted) >= 10 * hf_model.config.num_hidden_layers  # the prefill and every step, each layer
    assert restore_rotary(hf_model) == hf_model.config.num_hidden_layers  # the same engine with transformers' rotation
    counted.clear()
    off, _ = engine.generate(prompts, params, speculative=False)
    assert not counted
    assert [r.token_ids for r in on] == [r.token_ids for r in off]
    for a, b in zip(on, off):
        assert all(abs(x.logprob - y.logprob) < 1e-4 for x, y in zip(a.logprobs, b.logprobs))
