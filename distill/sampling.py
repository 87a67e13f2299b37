"""The one sampling rule: what a request's temperature, ``min_p``, ``top_k``, ``top_p`` and repetition
penalty do to a model's logits, in vLLM's order.

It sits below both users, the decoding engine (which warps the verified logits into the target
distributions its acceptance rules compare drafts with, and applies the penalty at every tree node
in :mod:`distill.engine.logits`) and the transformers backend of :mod:`distill.generate`, so plain
generation and speculative decoding sample from the same distribution without either package
importing the other.
"""

from __future__ import annotations

import torch


def warp(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor | None = None,
         min_p: torch.Tensor | None = None) -> torch.Tensor:
    """Logits (B, T, V) -> target distributions (B, T, V) in float32, in vLLM's order.

    ``temperature`` (B,): 0 gives the one-hot argmax; then ``min_p`` (B,): drop tokens less
    likely than min_p times the most likely one (0 keeps everything); ``top_k`` (B,) long:
    keep the k most likely (0 or less keeps everything); ``top_p`` (B,): keep the smallest set
    of most likely tokens whose mass reaches top_p (1 keeps everything), renormalised.
    """
    logits = logits.float()
    greedy = temperature <= 0  # (B,)
    t = torch.where(greedy, torch.ones_like(temperature), temperature).float()
    probs = torch.softmax(logits / t[:, None, None], dim=-1)  # (B, T, V)
    if min_p is not None and bool((min_p > 0).any()):
        floor = min_p.float()[:, None, None] * probs.amax(-1, keepdim=True)  # (B, T, 1)
        probs = probs.masked_fill(probs < floor, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    if top_k is not None and bool(((top_k > 0) & (top_k < probs.shape[-1])).any()):
        k = torch.where((top_k > 0) & (top_k < probs.shape[-1]), top_k, probs.shape[-1]).long()  # (B,)
        vals = probs.topk(int(k.max()), dim=-1).values  # (B, T, kmax), descending
        kth = vals.gather(-1, (k - 1).clamp(max=vals.shape[-1] - 1)[:, None, None].expand(-1, probs.shape[1], 1))
        kth = torch.where((k >= probs.shape[-1])[:, None, None], torch.zeros_like(kth), kth)
        probs = probs.masked_fill(probs < kth, 0.0)  # ties at the k-th value are all kept (as vLLM does)
        probs = probs / probs.sum(-1, keepdim=True)
    if bool((top_p < 1).any()):
        sorted_p, order = probs.sort(dim=-1, descending=True)  # (B, T, V)
        before = sorted_p.cumsum(-1) - sorted_p  # mass strictly above each token
        drop = before >= top_p.float()[:, None, None]
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    if bool(greedy.any()):
        onehot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None, None], onehot, probs)
    return probs


def repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """vLLM's repetition penalty: the logits (..., V) of ``seen`` tokens (..., V) bool divided by ``penalty``
    where positive, multiplied by it where not (a new tensor)."""
    return torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)


__all__ = ["repetition_penalty", "warp"]
