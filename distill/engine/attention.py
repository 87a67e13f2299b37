"""The attention the engine's forwards use: transformers' SDPA attention, grouped key/value heads read in place.

Terms
-----
grouped key/value heads (GQA)
    ``heads`` query heads share ``kv_heads`` key/value heads (groups = heads / kv_heads).
    transformers' ``sdpa`` attention copies each key/value head ``groups`` times
    (``repeat_kv``) whenever an attention mask is given, and the engine always gives one
    (tree and padding masks). On CPU, ``F.scaled_dot_product_attention(enable_gqa=True)``
    reads the shared heads in place, much faster than copy + attention at decoding sizes,
    with identical results. Measured: BENCHMARKS.md, "The engine's step on a CPU".
``distill_sdpa``
    the attention implementation registered here through transformers' public
    ``AttentionInterface`` / ``AttentionMaskInterface``: :func:`sdpa_gqa` for the
    attention, transformers' own ``sdpa`` mask builder for masks. Everything but the
    masked-GQA case goes to transformers' ``sdpa_attention_forward`` unchanged, so a model
    switched to it behaves as with ``sdpa`` everywhere else.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

NAME = "distill_sdpa"


def sdpa_gqa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None, **kwargs):
    """query (B, heads, T, d), key/value (B, kv_heads, S, d), mask (B | 1, 1, T, S) -> ((B, T, heads, d), None)."""
    groups = query.shape[1] // key.shape[1]
    if groups == 1 or attention_mask is None or kwargs.get("position_bias") is not None or kwargs.get("cache") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                                           scale=scaling, enable_gqa=True)  # (B, heads, T, d)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, sdpa_gqa)
AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def use_gqa_sdpa(model) -> bool:
    """Switch a model that runs transformers' ``sdpa`` attention to ``distill_sdpa``; -> whether it was switched."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    model.set_attn_implementation(NAME)
    return model.config._attn_implementation == NAME


__all__ = ["NAME", "sdpa_gqa", "use_gqa_sdpa"]
