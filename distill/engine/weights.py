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
single rows: measured, not assumed
    at ``M >= 2`` the packed copy wins everywhere it was measured. At ``M = 1`` the winner
    depends on the machine and the thread count: on one thread MKL on an output-major weight
    beats the packed copy (the LM head: 4.4 vs 7.6 ms, AMD EPYC family 25 model 17), but there MKL's
    single-row product runs on one thread however many torch has, while oneDNN's uses them all
    (two threads, same CPU: the LM head 4.5 ms MKL vs 3.5 ms packed, a decoder layer's seven
    products 0.80 vs 0.59 ms). So :func:`prepare_linears` times both kernels once per weight
    shape, over all the model's weights of that shape (so they stream from memory as in a
    forward), at the thread count it runs with, and each :class:`DualLinear` multiplies single
    rows with the faster one (``single_packed``). The probe costs one pass of the linears per
    kernel and round (about 0.1 s for the bundled model). The rule applies to float32 weights
    on CPU only.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import nn

#: Rows the packed copies are packed for (oneDNN picks its blocking for this M; 8 served M = 1..65 well).
PACK_ROWS = 8
#: Timed rounds per kernel in the single-row probe (the fastest round counts, so a noisy round does not decide).
PROBE_ROUNDS = 3


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
    single_packed: bool = False  # single rows multiply with the packed copy too (the probe found it faster)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        single = x.numel() == x.shape[-1]
        if torch.is_grad_enabled() or (single and (not self.single_packed or torch.compiler.is_compiling())):
            # training; a single row where MKL on the weight is faster; or a compiled single-row forward (the
            # compiler cannot trace the opaque packed copy, and hiding it in a custom op measured 0.80x eager)
            return F.linear(x, self.weight, self.bias)
        if self.weight._version != self.packed_version:
            raise RuntimeError("this linear weight changed after the engine packed it: build a new Engine after training")
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


@torch.no_grad()
def prepare_linears(model: nn.Module) -> dict[str, int]:
    """Re-lay out (rule above) and pack every float32 CPU ``nn.Linear`` of ``model``, in place, each shared weight once.

    Then :func:`choose_single_row_kernels` for the modules prepared here. Returns the bytes
    re-laid out, the bytes of the packed copies, and how many prepared modules multiply single
    rows with the packed copy (``single_packed``) and with the weight (``single_weight``).
    """
    relaid, packed = 0, 0
    prepared: list[DualLinear] = []
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
        prepared.append(module)
    choose_single_row_kernels(prepared)
    single = sum(m.single_packed for m in prepared)
    return {"relaid_bytes": relaid, "packed_bytes": packed, "single_packed": single, "single_weight": len(prepared) - single}


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@torch.no_grad()
def probe(unique: list[DualLinear]) -> tuple[float, float]:
    """Seconds to multiply one row by every weight of ``unique`` (one shape): with MKL on the weights, and on the packed copies.

    One untimed warm-up round, then ``PROBE_ROUNDS`` rounds; the fastest round of each kernel.
    """
    x = torch.randn(1, unique[0].in_features, dtype=unique[0].weight.dtype)

    def on_weight():
        for m in unique:
            F.linear(x, m.weight)

    def on_packed():
        for m in unique:
            torch.ops.mkldnn._linear_pointwise(x, m.packed, None, "none", [], "")

    on_weight(), on_packed()
    return min(_seconds(on_weight) for _ in range(PROBE_ROUNDS)), min(_seconds(on_packed) for _ in range(PROBE_ROUNDS))


def choose_single_row_kernels(modules: list[DualLinear]) -> None:
    """Set ``single_packed`` on each module: whether its single-row product is faster on the packed copy (module docstring).

    Modules are grouped by weight shape, and each group is :func:`probe`-d once over its
    distinct weights (a shared weight counts once), so a forward's weights stream from memory
    in the probe as they do in a forward.
    """
    groups: dict[tuple[int, ...], list[DualLinear]] = defaultdict(list)
    for m in modules:
        groups[tuple(m.weight.shape)].append(m)
    for members in groups.values():
        weight_s, packed_s = probe(list({id(m.weight): m for m in members}.values()))
        for m in members:
            m.single_packed = packed_s < weight_s


__all__ = ["PACK_ROWS", "DualLinear", "choose_single_row_kernels", "is_output_major", "prepare_linears", "wants_output_major"]
