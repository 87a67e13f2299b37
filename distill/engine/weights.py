"""The memory layout of the model's linear weights for decoding on CPU.

Terms
-----
output-major weight
    a linear weight ``W`` (out, in) whose storage is the contiguous (in, out) transpose,
    i.e. strides ``(1, out)``. ``F.linear(x, W)`` then multiplies ``x`` by a row-major
    (in, out) matrix. The values, the shape and the ``Parameter`` object are unchanged; only
    the strides differ, so every caller of ``F.linear`` (any transformers model) takes it as is.
why
    a decoding step at small batch is a chain of matrix-vector products bound by how fast
    the weights stream from memory. MKL's float32 product streams an output-major weight
    faster when the weight is at least as wide as it is tall (``out >= in``: attention
    query/output, MLP gate/up, the LM head) and slower otherwise (key/value, MLP down), on
    the AMD EPYC (family 25, model 17) we measured (BENCHMARKS.md, issue 19: 1.6x for
    1536x576, 1.9x for the 49152x576 LM head, 0.7x for 192x576). Hence the rule
    :func:`wants_output_major`. A tied input embedding shares the storage; looking a row up
    becomes a strided gather, a few microseconds per token.
"""

from __future__ import annotations

import torch
from torch import nn


def wants_output_major(weight: torch.Tensor) -> bool:
    """The rule: float32 CPU weights (out, in) with out >= in are stored output-major."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.ndim == 2 and weight.shape[0] >= weight.shape[1]


def is_output_major(weight: torch.Tensor) -> bool:
    return weight.ndim == 2 and weight.stride() == (1, weight.shape[0])


@torch.no_grad()
def output_major(model: nn.Module) -> int:
    """Re-lay out, in place, every ``nn.Linear`` weight the rule picks (each shared weight once); -> bytes re-laid out."""
    done: set[int] = set()
    moved = 0
    for module in model.modules():
        if not isinstance(module, nn.Linear):
            continue
        w = module.weight
        if id(w) in done or is_output_major(w) or not wants_output_major(w):
            continue
        done.add(id(w))
        w.data = w.data.t().contiguous().t()  # (out, in) values, (in, out) storage
        moved += w.numel() * w.element_size()
    return moved


__all__ = ["is_output_major", "output_major", "wants_output_major"]
