"""How the model's linear layers multiply on CPU: the weights' layout, and a packed copy for the products.

A decoding step multiplies a few rows (``M``: batch × tokens per row) by every weight, so its cost
is streaming the weights from memory plus each kernel's fixed cost per call, and which kernel does
that fastest depends on ``M``, the weight's shape, the CPU and torch's thread count.
:func:`prepare_linears` puts a :class:`DualLinear` in the place of every float32 CPU ``nn.Linear``
(by name, over the same parameters and values; the original module object is left as it was), so
that each product takes the kernel that suits it; under autograd a prepared linear multiplies as
a plain ``nn.Linear``. Measured: BENCHMARKS.md, "The engine's step on a CPU".

Terms
-----
output-major weight
    a weight ``W`` (out, in) stored as the contiguous (in, out) transpose, strides ``(1, out)``:
    every caller of ``F.linear`` takes it as is. At ``M = 1`` MKL streams it faster where the
    weight is at least as wide as it is tall (query/output, gate/up, the LM head) and slower
    otherwise (:func:`wants_output_major`).
packed copy
    the weight in oneDNN's blocked layout, used whenever ``M > 1``: MKL takes a slow path for
    small ``M > 1``, oneDNN's packed kernels do not. It doubles the linear weights' memory and is
    never updated, so a weight changed after packing is a clear error, not a stale product. One
    kind for every weight: vLLM's CPU matmul handler (``vllm``, :class:`VllmMatmul`), the same
    oneDNN kernels with less overhead per call, wherever the kernel library of vLLM's CPU build
    loads (:func:`vllm_kernels`, without importing vLLM); torch's own (``onednn``) otherwise.
single rows
    which kernel multiplies one row fastest is timed, not assumed: MKL's single-row product runs
    on one thread however many torch has, while oneDNN's uses them all, and oneDNN can be slower
    at one row than at a few. :func:`probe` times, per weight shape and over all the weights of
    that shape, MKL on the weight (``weight``), the packed copy (``packed``) and the packed copy
    with the row repeated to ``PAD_ROWS`` rows (``padded``: rows are independent, so the first
    row of the product is the row's own); each weight takes the fastest (``DualLinear.single``),
    and where that is ``padded``, products of fewer than ``PAD_ROWS`` rows are padded too. The
    times are kept per machine, threads, kind and shape (``$DISTILL_HOME/kernels``, engine.kept),
    so a later start skips the probe and its picks do not flip on noise.
a padded prefill
    a batch's right-padded prompts: inside :func:`distill.engine.rows.valid_rows` the products take
    the prompts' rows only and give the padding zeros (the causal mask never lets a prompt token
    attend to the padding that follows it). Packing the prompts into one row with a
    block-diagonal mask would save less, as the attention would then span every prompt.
linears that read one input (fused)
    query/key/value and gate/up read the same tensor. :func:`prepare_linears` finds such groups
    in one ``example`` forward and gives each one product over the concatenated weight
    (:class:`FusedLinears`): fewer calls, each with its overhead, for the same weight bytes. The
    members' weights become views of it (memory unchanged); unless the example forward then gives
    the same logits, the groups are undone.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import platform
import time
import weakref
from collections import defaultdict
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from distill.engine.rows import VALID_ROWS

#: Rows torch's packed copies are packed for (oneDNN picks its blocking for this M; one blocking serves every M a
#: decoding step has). Measured: BENCHMARKS.md, "The engine's step on a CPU".
PACK_ROWS = 8
#: Rows a single row is repeated to for the ``padded`` single-row kernel (module docstring, "single rows").
#: Measured: BENCHMARKS.md, "The engine's step on a CPU".
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
class DualLinear(nn.Linear):
    """An ``nn.Linear`` (same parameters) whose products with ``M > 1`` rows use a packed copy of its weight.

    Built over an existing linear's parameters (:meth:`over`) and put in its place by
    :func:`prepare_linears`. Under autograd it multiplies as a plain ``nn.Linear``.
    """

    packed: torch.Tensor | None  # kind "onednn": (out, in) oneDNN-packed by torch, opaque
    vllm: VllmMatmul | None  # kind "vllm": vLLM's handler
    packed_version: int  # the weight's version counter when packed
    single: str = WEIGHT  # how single rows multiply: WEIGHT, PACKED or PADDED (the probe's choice, module docstring)
    fused: "FusedLinears | None" = None  # a group of linears fed one input: the group multiplies for this one
    fused_index: int = 0  # this module's place in its group

    @classmethod
    def over(cls, weight: nn.Parameter, bias: nn.Parameter | None) -> "DualLinear":
        """A linear over these parameters (the same objects, nothing allocated), not yet packed."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.out_features, self.in_features = weight.shape
        self.weight = weight
        self.register_parameter("bias", bias)
        self.packed, self.vllm, self.packed_version = None, None, weight._version
        return self

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
        if not self._single_rows(count):
            rows = VALID_ROWS.get()
            if rows is not None and rows.covers(x):  # a padded prefill: the prompts' rows only
                return rows.scatter(self._packed_product(rows.select(x)), x.shape[:-1])
        return self.product(x, count)

    def _single_rows(self, count: int) -> bool:
        """Whether ``count`` rows take the probe's single-row kernel: one row where MKL on the weight is faster, or a
        few rows where a padded product is."""
        return (count == 1 and self.single == WEIGHT) or (0 < count < PAD_ROWS and self.single == PADDED)

    def product(self, x: torch.Tensor, count: int) -> torch.Tensor:
        """The inference product of ``x``, ``count`` rows, by the kernel this linear picks for so many rows (the probe's
        single-row choice, else the packed copy); no autograd, no fused group, no padded prefill's row selection."""
        if self.vllm is None and self.packed is None:
            return F.linear(x, self.weight, self.bias)
        if self._single_rows(count):
            if self.single == WEIGHT:
                return F.linear(x, self.weight, self.bias)
            return self._padded_product(x, count)
        return self._packed_product(x)

    def _traced_product(self, x: torch.Tensor) -> torch.Tensor:
        """The product as a compiled forward multiplies it. The compiler traces vLLM's matmul (an operator with a shape
        function, registered with the library) but not torch's opaque packed copy (hidden in a custom op, it makes the
        compiled forward slower than eager): MKL on the weight where there is no vLLM copy. A single row (its count is
        fixed in the graph: the engine compiles single-token forwards, and the compiler specializes sizes of 1) takes
        the probe's kernel, as an eager one does, so a compiled step keeps what the probe found fastest on this machine.
        It calls vLLM's copy itself, without :meth:`_packed_product`'s check of the weight's version counter: the
        compiler guards on that counter, and with the check it compiles graph after graph where one would do.
        Measured: BENCHMARKS.md, "The engine's step on a CPU"."""
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
    """Re-lay out (rule above) and pack every float32 CPU ``nn.Linear`` of ``model``, each shared weight once: a
    :class:`DualLinear` over its parameters takes its place (under every name it has). A linear with hooks of its own
    (an offloading library's, say) is left as it is.

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
    replaced: dict[int, DualLinear] = {}
    for name, module in list(model.named_modules(remove_duplicate=False)):
        if type(module) is DualLinear:  # prepared before
            seen.add(id(module.weight))
            continue
        if type(module) is not nn.Linear or _hooked(module) or not name:  # the model itself has no place to be put in
            continue
        w = module.weight
        if not on_cpu_float32(w) or not torch.backends.mkldnn.is_available():
            continue
        if id(module) in replaced:  # one module under a second name: the same replacement
            model.set_submodule(name, replaced[id(module)])
            continue
        if id(w) not in seen:
            seen.add(id(w))
            if wants_output_major(w) and not is_output_major(w):
                w.data = w.data.t().contiguous().t()  # (out, in) values, (in, out) storage
                relaid += w.numel() * w.element_size()
            packed += w.numel() * w.element_size()
        new = replaced[id(module)] = DualLinear.over(module.weight, module.bias)
        model.set_submodule(name, new)
        prepared.append(new)
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


def _hooked(module: nn.Module) -> bool:
    return any(getattr(module, name, None) for name in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                                                          "_backward_pre_hooks"))


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
    weight = weight.t().contiguous().t() if wants_output_major(weight) else weight
    module = DualLinear.over(nn.Parameter(weight), None if bias is None else nn.Parameter(bias))
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
    for every weight. A probe of both kinds per shape is not a good judge: shape by shape the two
    often differ by less than the probe's noise, so its picks would flip from run to run, while in
    a whole forward torch's copies cost more than vLLM's at every row count (vLLM's handler has
    less per-call overhead on the same oneDNN kernels). The probe then decides single rows only:
    MKL on the weight or the packed copy or the packed copy padded (``single``), per shape,
    whichever was fastest.
    Measured: BENCHMARKS.md, "The engine's step on a CPU".
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
