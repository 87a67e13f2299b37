"""RMS normalisations on vLLM's CPU kernel (distill.engine.cpu.norms): the same outputs, one kernel call per module,
and modules the kernel does not reproduce (another formula, another dtype) left as they are."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distill.engine import Engine, EngineConfig
from distill.engine.cpu import norms
from distill.engine.cpu.linears import vllm_kernels
from distill.engine.cpu.norms import KernelRMSNorm, prepare_norms, restore_norms
from helpers import tiny_llama

needs_vllm = pytest.mark.skipif(vllm_kernels() != "", reason=f"vLLM's CPU kernels unavailable: {vllm_kernels()}")


class OffsetRMSNorm(nn.Module):
    """Gemma's formula: the scale is (1 + weight). Named like the others, computed otherwise."""

    def __init__(self, size: int):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.randn(size) * 0.1), 1e-6

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight)


def swapped(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, KernelRMSNorm)]


@needs_vllm
def test_a_llamas_norms_run_on_the_kernel_with_the_same_logits(monkeypatch):
    model = tiny_llama(tied=True)
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__ == "LlamaRMSNorm":
                m.weight.normal_()  # not the ones they start with: the weight must enter the product
    ids = torch.randint(0, 64, (2, 7))
    with torch.inference_mode():
        before = model(ids).logits
    assert prepare_norms(model) == {"rms_norms_vllm": 2 * 2 + 1}  # two per layer and the final one
    assert prepare_norms(model) == {"rms_norms_vllm": 0}  # once only
    calls = []
    kernel = torch.ops._C.rms_norm
    monkeypatch.setattr(torch.ops._C, "rms_norm", lambda *a: calls.append(1) or kernel(*a), raising=False)
    restore_norms(model)
    prepare_norms(model)  # the forwards now hold the counting kernel
    calls.clear()  # the one call that checked the class
    with torch.inference_mode():
        after = model(ids).logits
        strided = torch.randn(7, 2, 16).transpose(0, 1)  # a non-contiguous input
        on_kernel = model.model.norm(strided)
    assert len(calls) == 5 + 1
    assert torch.allclose(before, after, rtol=1e-5, atol=1e-5)
    assert restore_norms(model) == 5 and not swapped(model)
    with torch.inference_mode():
        assert torch.allclose(on_kernel, model.model.norm(strided), rtol=1e-5, atol=1e-6)
        assert torch.equal(model(ids).logits, before)  # restored: the module's own forward again


@needs_vllm
def test_a_norm_the_kernel_does_not_reproduce_keeps_its_forward():
    model = nn.Sequential(OffsetRMSNorm(16), nn.Linear(16, 16))
    assert prepare_norms(model) == {"rms_norms_vllm": 0} and not swapped(model)
    half = tiny_llama(tied=True).to(torch.bfloat16)  # float32 only: the kernel's and the rule's domain
    assert prepare_norms(half) == {"rms_norms_vllm": 0} and not swapped(half)


def test_without_vllms_kernels_nothing_is_swapped(monkeypatch):
    monkeypatch.setattr(norms, "vllm_kernels", lambda: "vLLM is not installed")
    model = tiny_llama(tied=True)
    assert prepare_norms(model) == {"rms_norms_vllm": 0} and not swapped(model)


@needs_vllm
def test_the_engine_swaps_the_bundled_models_norms_unless_told_to_leave_the_modules_as_loaded(hf_model, tokenizer,
                                                                                              model_dir):
    from transformers import AutoModelForCausalLM

    restore_norms(hf_model)  # the session's model: an earlier engine may have prepared it
    engine = Engine(hf_model, tokenizer)
    assert engine.linear_prep["rms_norms_vllm"] == 2 * hf_model.config.num_hidden_layers + 1
    assert len(swapped(hf_model)) == 2 * hf_model.config.num_hidden_layers + 1
    as_loaded = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    Engine(as_loaded, tokenizer, None, EngineConfig(weight_layout="as-loaded"))
    assert not swapped(as_loaded)
    ids = torch.tensor([tokenizer.encode("The capital of France is")])
    # the prepared model (packed linears, norms on the kernel) and the model as loaded: the same function, summed in
    # another order (max |diff| about 1e-4 on logits up to ~16 on a CPU with AMX)
    with torch.inference_mode():
        assert torch.allclose(hf_model(ids).logits, as_loaded(ids).logits, rtol=1e-4, atol=5e-4)
