"""The CPU kernels the target model runs on, behind one interface: :func:`prepare` and :func:`restore`.

On a CPU, a decoding step is bound by streaming weights and by each operation's fixed cost, and
vLLM's CPU build ships kernels that cut both. :func:`prepare` puts modules of this package in the
place of the model's own, by name (each one holds the original's parameters, the same objects, so
no value or parameter name changes, and falls back to the original module wherever its kernel does
not apply):

- linears (:mod:`.linears`): a packed copy of each float32 weight for products of several rows,
  the single-row kernel a start-up probe found fastest, one product for linears that read one input;
- RMS normalisations (:mod:`.norms`) on one kernel call;
- Llama-style attention (:mod:`.rotary`) whose rotary embedding runs on one kernel call.

Nothing of transformers is patched: its classes and functions stay as they are, and :func:`restore`
puts the original modules back. The GPU path never imports this package.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from torch import nn

from distill.engine.cpu.linears import DualLinear, prepare_linears, vllm_kernels
from distill.engine.cpu.norms import KernelRMSNorm, prepare_norms, restore_norms
from distill.engine.cpu.rotary import KernelAttention, prepare_rotary, restore_rotary


def prepare(model: nn.Module, example: Callable[[], torch.Tensor] | None, kept: Path | None,
            attention: bool = True) -> dict[str, int]:
    """Prepare ``model`` for the CPU kernels (module docstring) -> what was prepared (:func:`.linears.prepare_linears`'s
    figures, ``rms_norms_vllm``, ``rotary_vllm``). ``example``: one forward of the model, to find linears that read one
    input (None: none fused); ``kept``: where the single-row probe's times are kept (None: timed now); ``attention``:
    the attention modules too (a drafter's layer, which keeps its own, says False)."""
    report = prepare_linears(model, example, kept)
    report.update(prepare_norms(model) | (prepare_rotary(model) if attention else {}))
    return report


def restore(model: nn.Module) -> int:
    """Put back the norm and attention modules :func:`prepare` replaced -> how many (linears keep their packed copies)."""
    return restore_norms(model) + restore_rotary(model)


__all__ = ["DualLinear", "KernelAttention", "KernelRMSNorm", "prepare", "restore", "vllm_kernels"]
