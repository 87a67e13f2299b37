"""Rotary position embeddings on vLLM's CPU kernel: one in-place call where transformers' function makes fourteen.

A Llama-style attention rotates its queries and keys with ``apply_rotary_pos_emb(q, k, cos, sin)``,
a function of the model's own module (``transformers.models.llama.modeling_llama`` and its copies
in other models): two ``rotate_half`` (two slices, a negation, a concatenation each), four
multiplies and two adds over (batch, heads, tokens, head size) views. At one decoding row each is a
few microseconds of dispatch, 30 times a forward of the bundled model; over a batch's padded
prefill they are passes over strided memory. vLLM's CPU build ships the same rotation as one
kernel, ``_C::rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)``, which
rotates the query and key rows in place (their rows may be strided, as the views of the fused
q/k/v product are). It takes a good part off the rotation's time at decoding sizes and nearly all
of it over a padded prefill, and its values agree with transformers' to float32 rounding.
Measured: BENCHMARKS.md, "The engine's step on a CPU".

How it is used. :func:`prepare_rotary` puts a :class:`KernelAttention` in the place of each
Llama-style attention module (by name; its projections are the same modules under the same names),
where the kernel reproduces the module's own output with the model's ``cos`` and ``sin`` (checked
once per class on random inputs). Its forward is the Llama attention's: the projections, the rotation,
the cache update, the attention function the model is set to, the output projection; the rotation
runs on the kernel when the call is one it computes: float32 CPU tensors, (batch, heads, tokens, head
size) queries and keys, a rotation over the whole head (``cos`` as wide as a head) whose two halves
repeat (GPT-NeoX style, as ``rotate_half`` implies), no autograd. Otherwise (training, a compiled
forward, another dtype) the original module computes. Nothing of transformers is changed: the
original modules are kept, and :func:`restore_rotary` puts them back. The ``cos``/``sin`` a forward
hands every layer are the same tensors, so the kernel's table of (cos | sin) rows is built once per
forward and shared by the model's attention modules.

What is relied on (checked per class before anything is replaced; a transformers release that
changes it leaves the module as it is, and ``tests/test_transformers_contract.py`` names what moved):
the module's children are exactly ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``; it has ``head_dim``,
``layer_idx``, ``scaling``, ``num_key_value_groups`` and ``config``; its forward takes
``(hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)``; its code's module
defines ``apply_rotary_pos_emb(q, k, cos, sin)`` and ``eager_attention_forward``.
"""

from __future__ import annotations

import inspect
import sys

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from distill.engine.cpu.linears import vllm_kernels
from distill.engine.cpu.place import put_back, put_in_place

FUNCTION = "apply_rotary_pos_emb"
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
SETTINGS = ("config", "layer_idx", "head_dim", "scaling", "num_key_value_groups", "attention_dropout", "is_causal")
FORWARD_ARGUMENTS = ("hidden_states", "position_embeddings", "attention_mask", "past_key_values")


def _kernel_applies(q, k, cos, sin, unsqueeze_dim) -> bool:
    return (unsqueeze_dim == 1 and q.dim() == 4 and k.dim() == 4 and cos.dim() == 3
            and q.dtype == k.dtype == cos.dtype == sin.dtype == torch.float32 and q.device.type == "cpu"
            and cos.shape[-1] == q.shape[-1] == k.shape[-1] and q.shape[-1] % 2 == 0
            and q.shape[0] == k.shape[0] and cos.shape[0] in (1, q.shape[0]) and q.shape[2] == k.shape[2] == cos.shape[1]
            and not torch.is_grad_enabled())


def _table(state: dict, cos: torch.Tensor, sin: torch.Tensor, B: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, cos_sin_cache) for the kernel: row b * T + t holds cos | sin of that token (first halves); ``cos``
    and ``sin`` (B or 1, T, head size)."""
    if state.get("cos") is not cos or state.get("sin") is not sin or state.get("rows") != B:
        state["positions"], state["table"] = kernel_table(cos, sin, B)
        state["cos"], state["sin"], state["rows"] = cos, sin, B  # held until the forward ends, so identity means the same tensors
    return state["positions"], state["table"]


def kernel_table(cos: torch.Tensor, sin: torch.Tensor, B: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, cos_sin_cache) for the kernel, built anew (:func:`_table` keeps it for a forward's layers)."""
    _, T, D = cos.shape
    half = D // 2
    table = torch.cat([cos[..., :half], sin[..., :half]], dim=-1).expand(B, T, D).reshape(B * T, D)
    return torch.arange(B * T, device=cos.device), table


def _rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, state: dict):
    """Queries and keys (B, heads, T, head size) rotated in place on the kernel; ``state`` holds the (cos | sin)
    table of the tensors it last saw."""
    B, H, T, D = q.shape
    positions, table = _table(state, cos, sin, B)
    rows_q = q.transpose(1, 2).reshape(B * T, H * D)  # a view of the projection's rows where they allow one
    rows_k = k.transpose(1, 2).reshape(B * T, k.shape[1] * D)
    rotate_rows(positions, rows_q, rows_k, D, table)
    return rows_q.view(B, T, H, D).transpose(1, 2), rows_k.view(B, T, k.shape[1], D).transpose(1, 2)


def rotate_rows(positions: torch.Tensor, rows_q: torch.Tensor, rows_k: torch.Tensor, head_size: int,
                table: torch.Tensor) -> None:
    """Rotate query and key rows (tokens, heads · head size) in place on the kernel, row i by ``table[positions[i]]``
    (:func:`_table`)."""
    torch.ops._C.rotary_embedding(positions, rows_q, rows_k, head_size, table, True)


class KernelAttention(nn.Module):
    """A Llama-style attention whose queries and keys rotate on ``_C::rotary_embedding`` (module docstring).

    ``original``: the attention module it replaces (kept, not as a child: its projections are this
    module's); ``table``: the (cos | sin) table state every attention module of one model shares.
    """

    def __init__(self, original: nn.Module, table: dict):
        super().__init__()
        for name in PROJECTIONS:
            setattr(self, name, getattr(original, name))
        for name in SETTINGS:
            self.__dict__[name] = getattr(original, name, None)
        code = sys.modules[type(original).__module__]
        self.__dict__.update(original=original, table=table, rotate=getattr(code, FUNCTION),
                             eager=getattr(code, "eager_attention_forward"))

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs):
        if torch.is_grad_enabled() or torch.compiler.is_compiling() or position_embeddings is None:
            return self.original(hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        cos, sin = position_embeddings
        if _kernel_applies(q, k, cos, sin, 1):
            q, k = _rotate(q, k, cos, sin, self.table)
        else:
            q, k = self.rotate(q, k, cos, sin)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, self.eager)
        out, weights = attend(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs)
        return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1).contiguous()), weights

    def extra_repr(self) -> str:
        return f"{type(self.original).__name__}, rotation on vLLM's kernel"


def contract_problem(module: nn.Module) -> str | None:
    """Why :class:`KernelAttention` cannot stand in for ``module`` (what it relies on, module docstring), or None."""
    children = {name for name, _ in module.named_children()}
    if children != set(PROJECTIONS):
        return f"children {sorted(children)}, not {sorted(PROJECTIONS)}"
    missing = [name for name in SETTINGS[:5] if getattr(module, name, None) is None]
    if missing:
        return f"no {', '.join(missing)}"
    params = list(inspect.signature(module.forward).parameters)
    if params[: len(FORWARD_ARGUMENTS)] != list(FORWARD_ARGUMENTS):
        return f"forward takes {params}, not {list(FORWARD_ARGUMENTS)} first"
    code = sys.modules.get(type(module).__module__)
    for name in (FUNCTION, "eager_attention_forward"):
        if not callable(getattr(code, name, None)):
            return f"{type(module).__module__} has no {name}"
    return None


def _attentions(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules(remove_duplicate=False)
            if type(m).__name__.endswith("Attention") and not isinstance(m, KernelAttention) and contract_problem(m) is None
            and not any((m._forward_hooks, m._forward_pre_hooks))]


def _rotary_module(model: nn.Module) -> nn.Module | None:
    """The model's rotary embedding module (class name ending in ``RotaryEmbedding``), whose forward gives (cos, sin)."""
    return next((m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")), None)


def _reproduces(module: nn.Module, rotary: nn.Module) -> bool:
    """Does a :class:`KernelAttention` give ``module``'s own output with the model's cos/sin (two rows at different
    positions, causal attention without a cache)?"""
    g = torch.Generator().manual_seed(0)
    B, T = 2, 5
    width = module.q_proj.in_features
    x = torch.randn(B, T, width, generator=g)
    positions = torch.arange(T)[None].expand(B, T) + torch.tensor([[0], [37]])
    with torch.inference_mode():
        try:
            cos, sin = rotary(x, positions)
            want = module(x, (cos, sin), None, None)[0]
            replaced = KernelAttention(module, {})
            if not _kernel_applies(*(t.view(B, T, -1, replaced.head_dim).transpose(1, 2) for t in (
                    module.q_proj(x), module.k_proj(x))), cos, sin, 1):
                return False
            return torch.allclose(replaced(x, (cos, sin), None, None)[0], want, rtol=1e-5, atol=1e-5)
        except (RuntimeError, TypeError, ValueError, IndexError, AttributeError):
            return False


def prepare_rotary(model: nn.Module) -> dict[str, int]:
    """Put a :class:`KernelAttention` in the place of each of ``model``'s Llama-style attention modules where vLLM's
    kernel reproduces its rotation -> ``{"rotary_vllm": modules replaced}``. Nothing where the kernels do not load or
    the model is not float32 on a CPU."""
    named = _attentions(model)
    weight = next(model.parameters(), None)
    rotary = _rotary_module(model)
    if (not named or rotary is None or weight is None or weight.dtype != torch.float32 or weight.device.type != "cpu"
            or vllm_kernels() or not hasattr(torch.ops._C, "rotary_embedding")):
        return {"rotary_vllm": 0}
    table: dict = {}  # one (cos | sin) table for the model's attention modules: built once per forward
    replaced = put_in_place(model, named, lambda m: KernelAttention(m, table), lambda m: _reproduces(m, rotary))
    return {"rotary_vllm": replaced}


def restore_rotary(model: nn.Module) -> int:
    """Put every replaced attention module back -> how many."""
    return put_back(model, KernelAttention)


__all__ = ["KernelAttention", "contract_problem", "prepare_rotary", "restore_rotary"]
