"""Output-major weights on a tiny model: same values and outputs, new strides, tied weights re-laid out once."""

from __future__ import annotations

import torch

from distill.engine.weights import is_output_major, output_major, wants_output_major


def tiny_llama(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied)
    return LlamaForCausalLM(cfg).eval()


def test_the_rule_picks_wide_float32_cpu_weights():
    assert wants_output_major(torch.zeros(32, 16)) and wants_output_major(torch.zeros(16, 16))
    assert not wants_output_major(torch.zeros(8, 16))  # taller than wide: MKL streams it faster as loaded
    assert not wants_output_major(torch.zeros(32, 16, dtype=torch.bfloat16))  # measured for float32 only


def test_relayout_keeps_values_and_outputs_and_moves_each_shared_weight_once():
    model = tiny_llama(tied=True)
    ids = torch.randint(0, 64, (1, 7))
    with torch.no_grad():
        before = model(ids).logits
        values = {n: p.detach().clone() for n, p in model.named_parameters()}
        params = {n: p for n, p in model.named_parameters()}
        moved = output_major(model)
        after = model(ids).logits
    lm = model.get_output_embeddings().weight
    assert lm is model.get_input_embeddings().weight and is_output_major(lm)  # still tied, re-laid out
    layer = model.model.layers[0]
    assert is_output_major(layer.mlp.up_proj.weight) and is_output_major(layer.self_attn.q_proj.weight)
    assert not is_output_major(layer.self_attn.k_proj.weight) and layer.self_attn.k_proj.weight.is_contiguous()  # 8 x 16
    assert not is_output_major(layer.mlp.down_proj.weight)  # 16 x 32
    for n, p in model.named_parameters():
        assert p is params[n] and torch.equal(p, values[n]), n  # same Parameter objects, same values
    per_layer = 2 * 16 * 16 + 2 * 32 * 16  # q, o, gate, up
    assert moved == 4 * (2 * per_layer + 64 * 16)  # the tied LM head counted once
    assert torch.allclose(before, after, atol=1e-5)
    assert output_major(model) == 0  # idempotent


def test_an_untied_input_embedding_is_left_as_loaded():
    model = tiny_llama(tied=False)
    output_major(model)
    assert is_output_major(model.get_output_embeddings().weight)
    assert model.get_input_embeddings().weight.is_contiguous()
