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

How it is used. :func:`prepare_rotary` replaces the module-level ``apply_rotary_pos_emb`` of each
model module the model's attention classes come from, once per process, with a wrapper that calls
the original unless an engine forward is running (:func:`rotary_kernel`, a context variable the
engine sets around its eager forwards) and the call is one the kernel computes: float32 CPU
tensors, (batch, heads, tokens, head size) queries and keys, ``unsqueeze_dim`` 1, a rotation over
the whole head (``cos`` as wide as a head) whose two halves repeat (GPT-NeoX style, as
``rotate_half`` implies). Every other caller in the process (training, transformers' own
``generate``, the EAGLE drafter's layer, a compiled forward) gets the original, unchanged. The
replacement is made only where the kernel reproduces the original on the model's own ``cos`` and
``sin`` (checked once per module on random queries and keys); :func:`restore_rotary` puts the
originals back. The engine's ``cos``/``sin`` are the same tensors for every layer of a forward, so
the kernel's table of (cos | sin) rows is built once per forward.
"""

from __future__ import annotations

import contextlib
import sys
from contextvars import ContextVar

import torch
from torch import nn

from distill.engine.weights import vllm_kernels

FUNCTION = "apply_rotary_pos_emb"

#: Set by :func:`rotary_kernel` for the duration of an engine forward: the (cos, sin) it last saw and their table.
_ACTIVE: ContextVar[dict | None] = ContextVar("distill_rotary_kernel", default=None)


@contextlib.contextmanager
def rotary_kernel():
    """Inside, the wrapped ``apply_rotary_pos_emb`` functions use vLLM's kernel where they can (module docstring)."""
    token = _ACTIVE.set({})
    try:
        yield
    finally:
        _ACTIVE.reset(token)


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
        _, T, D = cos.shape
        half = D // 2
        state["table"] = torch.cat([cos[..., :half], sin[..., :half]], dim=-1).expand(B, T, D).reshape(B * T, D)
        state["positions"] = torch.arange(B * T, device=cos.device)
        state["cos"], state["sin"], state["rows"] = cos, sin, B  # held until the forward ends, so identity means the same tensors
    return state["positions"], state["table"]


def _rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, state: dict):
    B, H, T, D = q.shape
    positions, table = _table(state, cos, sin, B)
    rows_q = q.transpose(1, 2).reshape(B * T, H * D)  # a view of the projection's rows where they allow one
    rows_k = k.transpose(1, 2).reshape(B * T, k.shape[1] * D)
    torch.ops._C.rotary_embedding(positions, rows_q, rows_k, D, table, True)
    return rows_q.view(B, T, H, D).transpose(1, 2), rows_k.view(B, T, k.shape[1], D).transpose(1, 2)


def _wrap(original):
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1, *args, **kwargs):
        if torch.compiler.is_compiling():  # a compiled forward: the original, traced (the compiler cannot read a ContextVar)
            return original(q, k, cos, sin, unsqueeze_dim, *args, **kwargs)
        state = _ACTIVE.get()
        if state is None or args or kwargs or not _kernel_applies(q, k, cos, sin, unsqueeze_dim):
            return original(q, k, cos, sin, unsqueeze_dim, *args, **kwargs)
        return _rotate(q, k, cos, sin, state)

    apply_rotary_pos_emb.__wrapped__ = original
    apply_rotary_pos_emb.__distill_rotary__ = True
    apply_rotary_pos_emb.__doc__ = original.__doc__
    return apply_rotary_pos_emb


def _rotary_module(model: nn.Module) -> nn.Module | None:
    """The model's rotary embedding module (class name ending in ``RotaryEmbedding``), whose forward gives (cos, sin)."""
    return next((m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")), None)


def _reproduces(original, rotary: nn.Module, heads: int, kv_heads: int, head: int) -> bool:
    """Does the kernel give ``original``'s rotation with the model's own cos/sin, on strided rows as the engine has them?"""
    g = torch.Generator().manual_seed(0)
    B, T = 2, 5
    x = torch.randn(B, T, 8, generator=g)
    positions = torch.arange(T)[None].expand(B, T) + torch.tensor([[0], [37]])
    with torch.inference_mode():
        try:
            cos, sin = rotary(x, positions)
            rows = torch.randn(B, T, (heads + 2 * kv_heads) * head, generator=g)

            def views(rows):  # query and key as the attention has them: views of one q/k/v product's rows
                q, k, _ = rows.split([heads * head, kv_heads * head, kv_heads * head], dim=-1)
                return q.view(B, T, heads, head).transpose(1, 2), k.view(B, T, kv_heads, head).transpose(1, 2)

            q, k = views(rows)
            want_q, want_k = original(q, k, cos, sin)
            if not _kernel_applies(q, k, cos, sin, 1):
                return False
            with rotary_kernel():
                got_q, got_k = _rotate(*views(rows.clone()), cos, sin, _ACTIVE.get())
            return (torch.allclose(got_q, want_q, rtol=1e-5, atol=1e-5)
                    and torch.allclose(got_k, want_k, rtol=1e-5, atol=1e-5))
        except (RuntimeError, TypeError, ValueError, IndexError):
            return False


def prepare_rotary(model: nn.Module) -> dict[str, int]:
    """Wrap the ``apply_rotary_pos_emb`` of ``model``'s attention modules' code where vLLM's kernel reproduces it
    -> ``{"rotary_vllm": attention modules covered}``. Nothing where the kernels do not load or the model is not
    float32 on a CPU."""
    attentions = [m for m in model.modules() if type(m).__name__.endswith("Attention")
                  and callable(getattr(sys.modules.get(type(m).__module__), FUNCTION, None))]
    weight = next(model.parameters(), None)
    rotary = _rotary_module(model)
    config = getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if (not attentions or rotary is None or config is None or weight is None or weight.dtype != torch.float32
            or weight.device.type != "cpu" or vllm_kernels() or not hasattr(torch.ops._C, "rotary_embedding")):
        return {"rotary_vllm": 0}
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head = getattr(config, "head_dim", None) or config.hidden_size // heads
    covered = 0
    for name in {type(m).__module__ for m in attentions}:
        module = sys.modules[name]
        function = getattr(module, FUNCTION)
        if not getattr(function, "__distill_rotary__", False):
            if not _reproduces(function, rotary, heads, kv_heads, head):
                continue
            setattr(module, FUNCTION, _wrap(function))
        covered += sum(type(m).__module__ == name for m in attentions)
    return {"rotary_vllm": covered}


def restore_rotary(model: nn.Module) -> int:
    """Put back the original ``apply_rotary_pos_emb`` of ``model``'s attention modules' code -> how many modules."""
    restored = 0
    for name in {type(m).__module__ for m in model.modules() if type(m).__name__.endswith("Attention")}:
        module = sys.modules.get(name)
        function = getattr(module, FUNCTION, None)
        if getattr(function, "__distill_rotary__", False):
            setattr(module, FUNCTION, function.__wrapped__)
            restored += 1
    return restored
