"""How the model's linear layers multiply on CPU: the weights' layout, and a packed copy for multi-token products.

Terms
-----
tokens of a product
    ``M`` = the rows of ``x`` in ``F.linear(x, W)`` (batch × tokens per row): 1 in a plain
    decoding step at batch 1, the batch in a plain step, batch × tree size in a verification step.
output-major weight
    a linear weight ``W`` (out, in) whose storage is the contiguous (in, out) transpose,
    i.e. strides ``(1, out)``. ``F.linear(x, W)`` then multiplies ``x`` by a row-major
    (in, out) matrix. The values, the shape and the ``Parameter`` object are unchanged; only
    the strides differ, so every caller of ``F.linear`` takes it as is. At ``M = 1``, MKL's
    float32 product streams an output-major weight faster when the weight is at least as wide
    as it is tall (``out >= in``: attention query/output, MLP gate/up, the LM head) and slower
    otherwise (key/value, MLP down) (:func:`wants_output_major`).
packed copy
    a oneDNN-packed (blocked) copy of the weight (``torch.ops.mkldnn._reorder_linear_weight``,
    packed for ``PACK_ROWS`` rows), which :class:`DualLinear` multiplies with whenever
    ``M > 1``: MKL takes a slow path for small ``M > 1`` on this CPU, oneDNN's packed kernels
    do not (1.7-2.5x faster at M = 8-17; BENCHMARKS.md, issue 19). It doubles the memory of
    the linear weights; it is built once and never updated, so a weight changed after packing
    is a clear error, not a stale product.
why not one of the two
    at ``M = 1`` MKL on an output-major weight beats the packed copy (the LM head: 4.9 vs
    7.6 ms); at ``M >= 2`` the packed copy wins everywhere. Measured on an AMD EPYC (family 25,
    model 17); the rule applies to float32 weights on CPU only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

#: Rows the packed copies are packed for (oneDNN picks its blocking for this M; 8 served M = 1..65 well).
PACK_ROWS = 8


def wants_output_major(weight: torch.Tensor) -> bool:
    """The layout rule: float32 CPU weights (out, in) with out >= in are stored output-major."""
    return on_cpu_float32(weight) and weight.ndim == 2 and weight.shape[0] >= weight.shape[1]


def on_cpu_float32(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32


def is_output_major(weight: torch.Tensor) -> bool:
    return weight.ndim == 2 and weight.stride() == (1, weight.shape[0])


class DualLinear(nn.Linear):
    """An ``nn.Linear`` (same parameters) whose products with ``M > 1`` rows use a packed copy of its weight.

    Made from an existing ``nn.Linear`` by :func:`prepare_linears` (the module object, its
    parameters and hooks stay; only its class changes). Under autograd it is a plain ``nn.Linear``.
    """

    packed: torch.Tensor  # (out, in) oneDNN-packed, opaque
    packed_version: int  # the weight's version counter when packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() or x.numel() == x.shape[-1]:  # training, or a single row: MKL on the weight itself
            return F.linear(x, self.weight, self.bias)
        if self.weight._version != self.packed_version:
            raise RuntimeError("this linear weight changed after the engine packed it: build a new Engine after training")
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


@torch.no_grad()
def prepare_linears(model: nn.Module) -> dict[str, int]:
    """Re-lay out (rule above) and pack every float32 CPU ``nn.Linear`` of ``model``, in place, each shared weight once.

    Returns the bytes re-laid out and the bytes of the packed copies.
    """
    relaid, packed = 0, 0
    copies: dict[int, tuple[torch.Tensor, int]] = {}
    for module in model.modules():
        if type(module) is DualLinear:  # prepared before
            copies.setdefault(id(module.weight), (module.packed, module.packed_version))
            continue
        if type(module) is not nn.Linear:
            continue
        w = module.weight
        if not on_cpu_float32(w) or not torch.backends.mkldnn.is_available():
            continue
        if id(w) not in copies:
            if wants_output_major(w) and not is_output_major(w):
                w.data = w.data.t().contiguous().t()  # (out, in) values, (in, out) storage
                relaid += w.numel() * w.element_size()
            copies[id(w)] = (torch.ops.mkldnn._reorder_linear_weight(w.detach(), PACK_ROWS), w._version)
            packed += w.numel() * w.element_size()
        module.__class__ = DualLinear
        module.packed, module.packed_version = copies[id(w)]
    return {"relaid_bytes": relaid, "packed_bytes": packed}


__all__ = ["PACK_ROWS", "DualLinear", "is_output_major", "prepare_linears", "wants_output_major"]
