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
