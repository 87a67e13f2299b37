"""Prepared linear layers on a tiny model: same values and outputs, output-major strides, packed multi-row products."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distill.engine import weights
from distill.engine.weights import DualLinear, is_output_major, prepare_linears, wants_output_major


def tiny_llama(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied)
    return LlamaForCausalLM(cfg).eval()


def test_the_layout_rule_picks_wide_float32_cpu_weights():
    assert wants_output_major(torch.zeros(32, 16)) and wants_output_major(torch.zeros(16, 16))
    assert not wants_output_major(torch.zeros(8, 16))  # taller than wide: MKL streams it faster as loaded
    assert not wants_output_major(torch.zeros(32, 16, dtype=torch.bfloat16))  # measured for float32 only


def test_preparing_keeps_parameters_values_and_outputs():
    model = tiny_llama(tied=True)
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        before_many, before_one = model(ids).logits, model(ids[:1, :1]).logits
        values = {n: p.detach().clone() for n, p in model.named_parameters()}
        params = dict(model.named_parameters())
        sizes = prepare_linears(model)
    with torch.inference_mode():
        after_many, after_one = model(ids).logits, model(ids[:1, :1]).logits  # packed copies / the weights themselves
    lm = model.get_output_embeddings().weight
    assert lm is model.get_input_embeddings().weight and is_output_major(lm)  # still tied, re-laid out
    layer = model.model.layers[0]
    assert is_output_major(layer.mlp.up_proj.weight) and is_output_major(layer.self_attn.q_proj.weight)
    assert layer.self_attn.k_proj.weight.is_contiguous() and layer.mlp.down_proj.weight.is_contiguous()  # 8x16, 16x32
    assert all(type(m) is DualLinear for m in model.modules() if isinstance(m, nn.Linear))
    for n, p in model.named_parameters():
        assert p is params[n] and torch.equal(p, values[n]), n  # same Parameter objects, same values
    linear = 2 * (16 * 16 + 8 * 16 + 8 * 16 + 16 * 16 + 3 * 32 * 16)
    assert sizes["relaid_bytes"] == 4 * (2 * (2 * 16 * 16 + 2 * 32 * 16) + 64 * 16)  # the tied LM head once
    assert sizes["packed_bytes"] == 4 * (linear + 64 * 16)
    assert sizes["single_packed"] + sizes["single_weight"] == 2 * 7 + 1  # every linear got a single-row kernel
    assert torch.allclose(before_many, after_many, atol=1e-5) and torch.allclose(before_one, after_one, atol=1e-5)
    for single_packed in (False, True):  # either single-row kernel gives the same logits
        for m in model.modules():
            if type(m) is DualLinear:
                m.single_packed = single_packed
        with torch.inference_mode():
            assert torch.allclose(before_one, model(ids[:1, :1]).logits, atol=1e-5)
    assert prepare_linears(model) == {"relaid_bytes": 0, "packed_bytes": 0, "single_packed": 0, "single_weight": 0}


def test_multi_row_products_use_the_packed_copy_and_single_rows_the_kernel_the_probe_chose(monkeypatch):
    layer = nn.Linear(16, 32)
    prepare_linears(layer)
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(a[0].shape) or real(*a), raising=False)
    x = torch.randn(3, 16)
    layer.single_packed = False
    with torch.inference_mode():
        assert torch.allclose(layer(x), x @ layer.weight.T + layer.bias, atol=1e-5)
        layer(x[:1])
    assert calls == [torch.Size([3, 16])]  # the single row went to F.linear
    layer.single_packed = True
    with torch.inference_mode():
        assert torch.allclose(layer(x[:1]), x[:1] @ layer.weight.T + layer.bias, atol=1e-5)
    assert calls == [torch.Size([3, 16]), torch.Size([1, 16])]  # now to the packed copy
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with torch.inference_mode():
        layer(x[:1])  # a compiled single-row forward multiplies the weight (the packed copy is opaque to the compiler)
    assert len(calls) == 2
    monkeypatch.undo()
    with torch.enable_grad():
        layer(x).sum().backward()  # training goes through F.linear, with gradients
    assert layer.weight.grad is not None and len(calls) == 2


@pytest.mark.parametrize("packed_faster", [True, False])
def test_the_probe_gives_each_weight_shape_the_faster_single_row_kernel(monkeypatch, packed_faster):
    model = tiny_llama(tied=True)
    probed = []

    def probe(unique):  # a stand-in for the timed probe: which kernel wins is the test's choice, per shape
        probed.append(tuple(unique[0].weight.shape))
        packed_wins = packed_faster != (unique[0].out_features == 64)  # the LM head (64 rows) gets the other kernel
        return (2.0, 1.0) if packed_wins else (1.0, 2.0)

    monkeypatch.setattr(weights, "probe", probe)
    sizes = prepare_linears(model)
    lm = model.get_output_embeddings()
    others = [m for m in model.modules() if type(m) is DualLinear and m is not lm]
    assert all(m.single_packed is packed_faster for m in others) and lm.single_packed is not packed_faster
    assert sizes["single_packed"] == (len(others) if packed_faster else 1)
    assert sorted(probed) == sorted({tuple(m.weight.shape) for m in others} | {(64, 16)})  # each shape probed once


def test_the_probe_times_both_kernels_on_real_weights():
    model = tiny_llama(tied=True)
    prepare_linears(model)
    weight_s, packed_s = weights.probe([model.model.layers[0].mlp.up_proj, model.model.layers[1].mlp.up_proj])
    assert 0 < weight_s < 1 and 0 < packed_s < 1


def test_a_weight_changed_after_packing_is_an_error_not_a_stale_product():
    layer = nn.Linear(16, 32)
    prepare_linears(layer)
    with torch.no_grad():
        layer.weight.add_(1.0)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="changed after the engine packed it"):
        layer(torch.randn(2, 16))


def test_an_untied_input_embedding_is_left_as_loaded():
    model = tiny_llama(tied=False)
    prepare_linears(model)
    assert is_output_major(model.get_output_embeddings().weight)
    assert model.get_input_embeddings().weight.is_contiguous()
