"""What the engine relies on in transformers, named: a release that moves any of it fails here, with what moved.

The engine composes with transformers' models and never patches them: it registers an attention function through
``AttentionInterface``, builds its KV cache on the public cache-layer API, calls the model's forward with a 4-D
additive mask, position ids, ``logits_to_keep`` and its own cache, and on a CPU puts modules of its own in the place
of the model's RMS norms and Llama-style attention (distill.engine.cpu), each relying on the attributes named below.
The model classes checked are those the engine is used with most (Llama and its copies).
"""

from __future__ import annotations

import inspect

import pytest
import torch
import transformers

from distill.engine.cpu import norms, rotary
from helpers import tiny_sizes

MODELS = ("Llama", "Qwen2", "Mistral")


def tiny(name: str):
    more = {"sliding_window": None} if name == "Mistral" else {}  # full attention, the engine's cache (engine.cache)
    config = getattr(transformers, f"{name}Config")(**tiny_sizes(vocab=64, hidden=16, intermediate=32, layers=2, heads=4,
                                                                  kv_heads=2, positions=64), **more)
    torch.manual_seed(0)
    return getattr(transformers, f"{name}ForCausalLM")(config).eval()


@pytest.mark.parametrize("name", MODELS)
def test_attention_modules_keep_what_the_cpu_kernels_attention_relies_on(name):
    model = tiny(name)
    attention = model.model.layers[0].self_attn
    problem = rotary.contract_problem(attention)
    assert problem is None, (f"transformers {transformers.__version__}: {type(attention).__name__} no longer has what "
                             f"distill.engine.cpu.rotary.KernelAttention relies on: {problem}")
    rope = rotary._rotary_module(model)
    assert rope is not None, f"{name}: no module named *RotaryEmbedding gives (cos, sin)"
    cos, sin = rope(torch.zeros(1, 3, 16), torch.arange(3)[None])
    assert cos.shape == sin.shape == (1, 3, attention.head_dim), f"{name}'s rotary module gives cos {tuple(cos.shape)}"


@pytest.mark.parametrize("name", MODELS)
def test_rms_norms_keep_a_weight_and_an_epsilon(name):
    model = tiny(name)
    found = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert len(found) == 2 * 2 + 1, f"{name}: {len(found)} modules named *RMSNorm (the CPU kernels find them by name)"
    for m in found:
        assert isinstance(m.weight, torch.nn.Parameter) and m.weight.ndim == 1, f"{type(m).__name__}.weight moved"
        assert norms._epsilon(m) is not None, f"{type(m).__name__} has neither variance_epsilon nor eps as a float"


def test_the_attention_and_cache_interfaces_the_engine_registers_with():
    from transformers import AttentionInterface, AttentionMaskInterface, DynamicCache
    from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert callable(AttentionInterface.register) and callable(AttentionMaskInterface.register)
    assert "sdpa" in ALL_MASK_ATTENTION_FUNCTIONS and callable(sdpa_attention_forward)
    assert callable(ALL_ATTENTION_FUNCTIONS.get_interface)
    assert list(inspect.signature(Cache.update).parameters)[:4] == ["self", "key_states", "value_states", "layer_idx"]
    assert issubclass(DynamicLayer, CacheLayerMixin) and "config" in inspect.signature(DynamicCache).parameters


@pytest.mark.parametrize("name", MODELS)
def test_the_forward_takes_what_the_engine_passes(name):
    """A 4-D additive float mask, position ids, the engine's cache and logits_to_keep; the decoder's output is what the
    LM head reads; modules can be put in place by name."""
    from distill.engine import cache as kv

    model = tiny(name)
    forward = inspect.signature(model.forward).parameters
    for arg in ("input_ids", "position_ids", "attention_mask", "past_key_values", "use_cache", "logits_to_keep"):
        assert arg in forward, f"{type(model).__name__}.forward no longer takes {arg}"
    shape = kv.KVShape.of(model)
    cache = kv.SlotCache(shape, 1, 64)
    ids, positions = torch.tensor([[1, 2, 3]]), torch.arange(3)[None]
    cache.prepare(positions, 3)
    bias = kv.attention_bias(kv.prefill_allowed(3, torch.device("cpu")), torch.float32)
    with torch.inference_mode():
        out = model(input_ids=ids, position_ids=positions, attention_mask=bias, past_key_values=cache, use_cache=True,
                    logits_to_keep=1)
        plain = model(input_ids=ids).logits[:, -1:]
    assert out.logits.shape == (1, 1, 64) and torch.allclose(out.logits, plain, atol=1e-5)
    assert model.get_decoder() is model.model and hasattr(torch.nn.Module, "set_submodule")


@pytest.mark.parametrize("name", MODELS)
def test_a_forward_keyword_reaches_the_attention_function(name):
    """The engine's row chunks (distill.engine.attention) travel as a keyword of the model's forward, which the decoder
    layers hand down to the registered attention function untouched."""
    from transformers import AttentionInterface

    from distill.engine.attention import sdpa_gqa

    seen = []

    def spy(module, query, key, value, attention_mask, row_chunks=None, **kwargs):
        seen.append(row_chunks)
        return sdpa_gqa(module, query, key, value, attention_mask, row_chunks=row_chunks, **kwargs)

    AttentionInterface.register("distill_contract_spy", spy)
    model = tiny(name)
    model.set_attn_implementation("distill_contract_spy")
    bias = torch.zeros(2, 1, 3, 3).masked_fill_(~torch.ones(3, 3, dtype=torch.bool).tril(), torch.finfo(torch.float32).min)
    with torch.inference_mode():
        model(input_ids=torch.tensor([[1, 2, 3], [4, 5, 0]]), attention_mask=bias, row_chunks=[(0, 1, 3, 3), (1, 2, 2, 2)])
    assert seen == [[(0, 1, 3, 3), (1, 2, 2, 2)]] * 2, f"{name}: the forward's keyword did not reach the attention ({seen})"
