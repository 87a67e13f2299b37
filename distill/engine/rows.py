"""A padded prefill's rows: the prompts' tokens of right-padded rows, for products and row-wise blocks that skip the padding.

Terms
-----
a padded prefill
    a batch's right-padded prompts in one forward. The causal mask never lets a prompt token
    attend to the padding that follows it, so nothing a prompt's row computes depends on the
    padding's rows; products need not compute them.
valid rows
    the rows (batch x positions, flattened) that hold tokens (:class:`ValidRows`), set for the
    duration of a prefill by :func:`valid_rows`: the CPU kernels' linears read them
    (:data:`VALID_ROWS`), and each layer's dense MLP (:func:`rowwise_modules`) takes the prompts'
    rows once at its input (forward hooks for the call), its output padded back with zeros.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ValidRows:
    """The rows of a padded input that hold tokens: ``index`` into its ``total`` rows (batch x positions, flattened),
    ``pad`` the others."""

    index: torch.Tensor
    pad: torch.Tensor
    total: int

    def covers(self, x: torch.Tensor) -> bool:
        """Is ``x`` (..., features) a padded input of these rows?"""
        return x.shape[:-1].numel() == self.total

    def select(self, x: torch.Tensor) -> torch.Tensor:
        """The prompts' rows of a padded ``x`` -> (tokens, features)."""
        return x.reshape(-1, x.shape[-1]).index_select(0, self.index)

    def scatter(self, y: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """The prompts' rows ``y`` (tokens, features) back in padded rows of ``shape`` (the padding zeros)."""
        out = y.new_empty(self.total, y.shape[-1])
        out.index_copy_(0, self.index, y)
        out.index_fill_(0, self.pad, 0)  # the padding's rows only: filling all of them first cost a second pass
        return out.view(*shape, y.shape[-1])


#: Set by :func:`valid_rows` around a padded forward: the products of :class:`DualLinear` then skip the padding.
VALID_ROWS: ContextVar[ValidRows | None] = ContextVar("distill_valid_rows", default=None)

#: Names of a decoder layer's feed-forward block (transformers' models).
MLP_NAMES = ("mlp", "feed_forward")


def rowwise_modules(layers) -> list[nn.Module]:
    """The dense MLP of each decoder layer in ``layers``: a child named as in :data:`MLP_NAMES` whose modules are linears
    and parameter-free activations only. Such a block maps each row on its own (a mixture of experts, whose router
    and experts are other modules, is not one)."""
    out = []
    for layer in layers:
        for name in MLP_NAMES:
            block = getattr(layer, name, None)
            if isinstance(block, nn.Module) and _dense(block):
                out.append(block)
                break
    return out


def _dense(block: nn.Module) -> bool:
    inner = [m for m in block.modules() if m is not block]
    return next(block.parameters(recurse=False), None) is None and any(isinstance(m, nn.Linear) for m in inner) and all(
        isinstance(m, nn.Linear) or next(m.parameters(), None) is None for m in inner)


@contextlib.contextmanager
def valid_rows(lengths: list[int], width: int, device: torch.device | str = "cpu", rowwise: list[nn.Module] = ()):
    """Right-padded rows of ``width`` positions, row b holding ``lengths[b]`` tokens: the CPU kernels' linears of any
    forward run inside multiply those rows only and give the padding zeros (a batch's prefill of prompts of different
    lengths). Only products whose input has ``len(lengths) * width``
    rows are affected; a forward without padding needs no selection and gets none. The ``rowwise`` modules (each
    maps every row on its own: :func:`rowwise_modules`) are given the prompts' rows and their output padded back."""
    total = len(lengths) * width
    if sum(lengths) == total:
        yield
        return
    valid = torch.zeros(total, dtype=torch.bool)
    for b, n in enumerate(lengths):
        valid[b * width : b * width + n] = True
    rows = ValidRows(valid.nonzero()[:, 0].to(device), (~valid).nonzero()[:, 0].to(device), total)
    shapes: dict[int, torch.Size] = {}

    def enter(module, args):
        x = args[0]
        if not (isinstance(x, torch.Tensor) and rows.covers(x)):
            return None
        shapes[id(module)] = x.shape[:-1]
        return (rows.select(x), *args[1:])

    def leave(module, args, output):
        shape = shapes.pop(id(module), None)
        return output if shape is None else rows.scatter(output, shape)

    handles = [h for m in rowwise for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    token = VALID_ROWS.set(rows)
    try:
        yield
    finally:
        VALID_ROWS.reset(token)
        for h in handles:
            h.remove()


__all__ = ["MLP_NAMES", "VALID_ROWS", "ValidRows", "rowwise_modules", "valid_rows"]
