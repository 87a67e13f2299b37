"""Greedy decoding's argmax on vLLM's CPU kernel.

A verification step takes the argmax of every position's logits, (rows, vocabulary). torch's
argmax over the last axis runs one thread at a time over each row; vLLM's ``_C::greedy_argmax``
(the one its CPU sampler calls) takes a third of its time from four rows on and returns the same
indices, ties going to the first. :func:`argmax` uses it where the library loads and a probe with
ties agrees with torch; else torch's. Measured: BENCHMARKS.md, "Against vLLM as its server runs it".
"""

from __future__ import annotations

import torch

from distill.engine.cpu.linears import vllm_kernels

_agrees: bool | None = None


def _kernel_agrees() -> bool:
    """Does the kernel load and give torch's indices on rows with ties (checked once per process)?"""
    global _agrees
    if _agrees is None:
        _agrees = False
        if not vllm_kernels() and hasattr(torch.ops._C, "greedy_argmax"):
            g = torch.Generator().manual_seed(0)
            probe = torch.randn(6, 1000, generator=g)
            probe[1::2, 17] = probe[1::2].max(-1).values  # ties: the first index wins
            probe[2, :] = 0.0
            try:
                _agrees = torch.equal(torch.ops._C.greedy_argmax(probe), probe.argmax(-1))
            except (RuntimeError, TypeError):
                _agrees = False
    return _agrees


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` for logits (..., V), on the kernel where it applies (module docstring)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous() and _kernel_agrees():
        return torch.ops._C.greedy_argmax(logits.view(-1, logits.shape[-1])).view(logits.shape[:-1])
    return logits.argmax(-1)


__all__ = ["argmax"]
