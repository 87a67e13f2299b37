"""The engine's attention (distill_sdpa) on a tiny GQA model: identical outputs, masks built as with sdpa."""

from __future__ import annotations

import torch

from distill.engine.attention import NAME, use_gqa_sdpa
from helpers import tiny_llama


def tiny_gqa(attn: str = "sdpa"):
    model = tiny_llama(vocab=64, hidden=32, intermediate=64, layers=2, heads=4, kv_heads=2, positions=64)
    model.set_attn_implementation(attn)
    return model


def test_switching_keeps_every_output_and_reads_shared_heads_in_place(monkeypatch):
    model = tiny_gqa()
    ids = torch.randint(0, 64, (2, 7))
    pad = torch.ones(2, 7, dtype=torch.long)
    pad[1, :2] = 0  # a 2D padding mask: transformers builds the 4D mask itself
    tree = torch.zeros(2, 1, 7, 7).masked_fill_(~torch.ones(7, 7, dtype=torch.bool).tril(), torch.finfo(torch.float32).min)
    import transformers.integrations.sdpa_attention as sdpa

    copies: list[int] = []
    real = sdpa.repeat_kv
    monkeypatch.setattr(sdpa, "repeat_kv", lambda x, n: copies.append(n) or real(x, n))
    with torch.no_grad():
        before = [model(ids).logits, model(ids, attention_mask=pad).logits, model(ids, attention_mask=tree).logits]
        assert copies  # transformers' sdpa copies the shared heads under a mask
        assert use_gqa_sdpa(model) and model.config._attn_implementation == NAME
        copies.clear()
        after = [model(ids).logits, model(ids, attention_mask=pad).logits, model(ids, attention_mask=tree).logits]
    for b, a in zip(before, after):
        assert torch.equal(a, b)
    assert not copies  # with a 4D mask or not, no key/value head was copied


def test_a_model_on_another_attention_is_left_alone():
    model = tiny_gqa("eager")
    assert not use_gqa_sdpa(model) and model.config._attn_implementation == "eager"


def test_row_chunk_plan_isolates_outliers_and_covers_every_row_once():
    from distill.engine.attention import plan_row_chunks

    assert plan_row_chunks([1], [500]) is None  # one row: nothing to split
    assert plan_row_chunks([1] * 8, [100] * 8) is None  # equal rows: one call
    assert plan_row_chunks([1] * 4, [100, 101, 99, 100]) is None  # what a split would save is less than a call
    keys = [60, 400, 62, 58, 390, 61]
    plan = plan_row_chunks([1] * 6, keys, overhead=64)
    assert [(r0, r1) for r0, r1, _, _ in plan] == [(0, 1), (1, 2), (2, 4), (4, 5), (5, 6)]
    assert all(q == 1 and k == max(keys[r0:r1]) for r0, r1, q, k in plan)
    # a dearer call merges neighbours: the long rows stay apart from the short ones, the short ones share
    plan = plan_row_chunks([1] * 6, sorted(keys, reverse=True), overhead=1000)
    assert [(r0, r1) for r0, r1, _, _ in plan] == [(0, 2), (2, 6)]
    # a prefill: queries and keys are the prompts' lengths, so a long prompt costs its square
    plan = plan_row_chunks([300, 20, 20], [300, 20, 20])
    assert [(r0, r1, q, k) for r0, r1, q, k in plan] == [(0, 1, 300, 300), (1, 3, 20, 20)]


def test_row_chunks_give_the_same_outputs_on_each_row_and_zeros_past_a_runs_queries():
    model = tiny_gqa()
    assert use_gqa_sdpa(model)
    lengths = [12, 3, 5, 11]
    P = max(lengths)
    ids = torch.randint(0, 64, (4, P))
    causal = torch.zeros(1, 1, P, P).masked_fill_(~torch.ones(P, P, dtype=torch.bool).tril(), torch.finfo(torch.float32).min)
    chunks = [(0, 1, 12, 12), (1, 3, 5, 5), (3, 4, 11, 11)]
    seen = []
    from distill.engine import attention

    real = attention._sdpa

    def counting(q, k, v, mask, dropout, scaling):
        seen.append((q.shape[0], q.shape[2], k.shape[2]))
        return real(q, k, v, mask, dropout, scaling)

    into_o_proj = []
    hook = model.model.layers[0].self_attn.o_proj.register_forward_pre_hook(lambda m, args: into_o_proj.append(args[0]))
    with torch.no_grad():
        whole = model(ids, attention_mask=causal)
        attention._sdpa = counting
        try:
            split = model(ids, attention_mask=causal, row_chunks=chunks)
        finally:
            attention._sdpa = real
            hook.remove()
    assert seen[:3] == [(1, 12, 12), (2, 5, 5), (1, 11, 11)]  # each run over its own queries and keys
    for b, n in enumerate(lengths):  # a row's real positions: the same numbers
        torch.testing.assert_close(split.logits[b, :n], whole.logits[b, :n], rtol=1e-5, atol=1e-5)
    # rows 1 and 2 share a run of 5 queries: their padding queries past it are not attended, zeros go into o_proj
    before, after = into_o_proj
    assert after[1:3, 5:].abs().sum() == 0 and before[1:3, 5:].abs().sum() > 0
    torch.testing.assert_close(after[1:3, :5], before[1:3, :5], rtol=1e-5, atol=1e-6)


def _dims_cache(keys: torch.Tensor, values: torch.Tensor):
    """A one-layer ``"dims"`` slot cache holding keys/values (B, kv_heads, S, d) at slots 0 .. S - 1."""
    from distill.engine.cache import KVShape, SlotCache

    B, H, S, d = keys.shape
    cache = SlotCache(KVShape(1, H, d, d, torch.float32, torch.device("cpu")), B, S, key_order="dims")
    cache.prepare(torch.arange(S)[None].expand(B, S), S, from_start=True)
    cache.update(keys, values, 0)
    return cache


def _reference(query, keys, values, allowed):
    return torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=allowed, enable_gqa=True)


def test_keys_in_dimension_order_attend_as_sdpa_with_and_without_row_chunks():
    from distill.engine.attention import plan_row_chunks, sdpa_gqa

    g = torch.Generator().manual_seed(0)
    B, S, T = 4, 40, 3
    keys, values, query = torch.randn(B, 2, S, 32, generator=g), torch.randn(B, 2, S, 32, generator=g), torch.randn(B, 6, T, 32, generator=g)
    cache = _dims_cache(keys, values)
    ends = [37, 5, 9, 20]
    allowed = torch.arange(S)[None, None, None] <= (torch.tensor(ends)[:, None, None, None] + torch.arange(T)[None, None, :, None])
    bias = torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)
    want = _reference(query, keys, values, allowed).transpose(1, 2)
    dims_keys, dims_values = cache.keys[0, :B, :, :S], cache.values[0, :B, :, :S]  # the window a forward gets
    assert dims_keys.stride(-1) != 1
    whole, _ = sdpa_gqa(None, query, dims_keys, dims_values, bias)
    plan = plan_row_chunks([T] * B, [e + T for e in ends], overhead=1)
    assert plan is not None and len(plan) > 1
    chunked, _ = sdpa_gqa(None, query, dims_keys, dims_values, bias, row_chunks=plan)
    torch.testing.assert_close(whole, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chunked, want, rtol=1e-5, atol=1e-5)


def test_vllm_kernel_attends_causally_per_row_over_the_dims_cache():
    """A prefill of right-padded prompts (padding queries give zeros), a plain step and a chain of three tokens, rows of
    different lengths: the kernel's outputs are SDPA's over the same keys."""
    from distill.engine.cache import KVShape
    from distill.engine.cpu import paged

    assert paged.paged_problem(KVShape(1, 2, 32, 32, torch.float32, torch.device("cpu")), 6) == ""
    assert "float32" in paged.paged_problem(KVShape(1, 2, 32, 32, torch.bfloat16, torch.device("cpu")), 6)
    g = torch.Generator().manual_seed(1)
    B, S = 3, 64
    keys, values = torch.randn(B, 2, S, 32, generator=g), torch.randn(B, 2, S, 32, generator=g)
    cache = _dims_cache(keys, values)
    lengths = [30, 7, 12]
    query = torch.randn(B, 6, 30, 32, generator=g)
    out = paged.paged_attention(paged.plan(cache, lengths, [0] * B, 6, padded=True), 0, query, 0.25)
    assert out.shape == (B, 30, 6, 32)
    for b, n in enumerate(lengths):
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        want = torch.nn.functional.scaled_dot_product_attention(query[b : b + 1, :, :n], keys[b : b + 1, :, :n],
                                                                values[b : b + 1, :, :n], attn_mask=causal, scale=0.25,
                                                                enable_gqa=True)
        torch.testing.assert_close(out[b, :n], want[0].transpose(0, 1), rtol=1e-4, atol=1e-5)
        assert out[b, n:].abs().sum() == 0
    ends = [40, 3, 17]
    for T in (1, 3):
        q = query[:, :, :T].contiguous()
        out = paged.paged_attention(paged.plan(cache, [T] * B, ends, 6, padded=False), 0, q, 0.25)
        for b, e in enumerate(ends):
            allowed = torch.arange(e + T)[None] <= torch.arange(e, e + T)[:, None]
            want = torch.nn.functional.scaled_dot_product_attention(q[b : b + 1], keys[b : b + 1, :, : e + T],
                                                                    values[b : b + 1, :, : e + T], attn_mask=allowed,
                                                                    scale=0.25, enable_gqa=True)
            torch.testing.assert_close(out[b], want[0].transpose(0, 1), rtol=1e-4, atol=1e-5)


def test_kernel_attention_is_for_models_on_distill_sdpa_only():
    """The kernel's plan reaches only distill_sdpa: a model on another attention keeps slot-order keys and SDPA."""
    from distill.engine import EngineConfig
    from distill.engine.target import Target

    def target(attn: str, **config) -> Target:
        model = tiny_llama(vocab=64, hidden=128, intermediate=64, layers=2, heads=4, kv_heads=2, positions=64)
        model.set_attn_implementation(attn)
        return Target(model, EngineConfig(**config))

    on_sdpa = target("sdpa")
    assert on_sdpa.paged_problem == "" and on_sdpa.new_cache(1, 8).key_order == "dims"
    for t in (target("eager"), target("sdpa", attention="sdpa")):
        assert t.paged_problem and t.new_cache(1, 8).key_order == "slots"
