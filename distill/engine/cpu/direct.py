"""A decoding step's forward with the prepared kernels called layer by layer, not through the model's modules.

Where the attention runs on vLLM's kernel (:mod:`.paged`), a step through the model's modules spends
milliseconds in Python around the same kernels: module calls, the model's output records, the
attention interface, the fused linears' bookkeeping. :class:`DirectDecoder` computes the same numbers
(its logits, features and cache writes equal the modules' bit for bit) over the tokens' rows flat, calling
the kernels itself: each product by the kernel its module picks for so many rows, the attention, and
two vLLM kernels that do in one call what the modules do in several with the same results: each residual
sum with the norm after it (``_C::fused_add_rms_norm``), and the cache writes (vLLM's writer, which takes the
keys and values as the q/k/v product leaves them). Measured: BENCHMARKS.md, "Against vLLM as its server runs it".

It applies to a Llama-style decoder that :func:`distill.engine.cpu.prepare` prepared whole
(:meth:`DirectDecoder.of` says why not): embedding, rotary embedding, decoder layers of an attention
(:class:`.rotary.KernelAttention` over one fused q/k/v product), a gated SiLU MLP (one fused gate/up
product) and two :class:`.norms.KernelRMSNorm`, a final kernel norm and an LM head; full attention in
every layer, no hooks on any of these modules. :class:`distill.engine.target.Target` then checks once
that it reproduces the modules' step and prefill exactly, and uses it for the steps whose attention runs
on the kernel and for prefills, whose prompts it takes packed, one after another without padding (only the
last tokens' logits computed), also after a step's rows in that step's forward (:meth:`DirectDecoder.packed`);
steps over branching trees attend under the tree's mask instead of on the kernel; prefills that want every
position's logits (prompt logprobs) keep the modules. Before each forward it checks, in tens
of microseconds, that the model still holds those modules and that none has gained a hook
(:meth:`DirectDecoder.current`); where not, the modules compute.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from distill.engine.cpu import rotary
from distill.engine.cpu.linears import DualLinear, _hooked
from distill.engine.cpu.norms import KernelRMSNorm
from distill.engine.cpu.paged import PagedPlan, attend_packed, write_packed
from distill.engine.cpu.rotary import KernelAttention

LAYER_CHILDREN = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
MLP_CHILDREN = {"gate_proj", "up_proj", "down_proj", "act_fn"}


@dataclass
class _Layer:
    index: int
    norm_in: KernelRMSNorm
    attention: KernelAttention
    qkv: DualLinear  # the fused q/k/v product
    qkv_sizes: list[int]
    qkv_order: tuple[int, int, int]  # where q, k and v are among its outputs
    o_proj: DualLinear
    norm_post: KernelRMSNorm
    gate_up: DualLinear  # the fused gate/up product
    gate_up_sizes: list[int]
    gate_up_order: tuple[int, int]
    down: DualLinear


def _fused_order(members: list[nn.Module], wanted: list[nn.Module]) -> tuple[int, ...] | None:
    """Where each wanted module is among a fused group's members, or None when they are not exactly its members."""
    if len(members) != len(wanted) or {id(m) for m in members} != {id(m) for m in wanted}:
        return None
    return tuple(next(i for i, m in enumerate(members) if m is w) for w in wanted)


def _layer(index: int, layer: nn.Module) -> _Layer | str:
    """One decoder layer's parts, or why it is not a layer :class:`DirectDecoder` runs."""
    name = type(layer).__name__
    children = dict(layer.named_children())
    if not name.endswith("DecoderLayer") or set(children) != LAYER_CHILDREN or "forward" in layer.__dict__:
        return f"layer {index} ({name}) is not a Llama-style decoder layer"
    attn, mlp = children["self_attn"], children["mlp"]
    norms = children["input_layernorm"], children["post_attention_layernorm"]
    if not isinstance(attn, KernelAttention) or not all(isinstance(n, KernelRMSNorm) for n in norms):
        return f"layer {index}'s attention or norms are not on the kernels"
    if set(dict(mlp.named_children())) != MLP_CHILDREN or "SiLU" not in type(mlp.act_fn).__name__:
        return f"layer {index}'s MLP is not a gated SiLU MLP"
    linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    if not all(isinstance(m, DualLinear) for m in linears):
        return f"layer {index}'s linears are not prepared"
    qkv, gate_up = attn.q_proj.fused, mlp.gate_proj.fused
    if qkv is None or gate_up is None or attn.o_proj.fused is not None or mlp.down_proj.fused is not None:
        return f"layer {index}'s q/k/v or gate/up are not one product each"
    qkv_order = _fused_order(qkv.members, [attn.q_proj, attn.k_proj, attn.v_proj])
    gate_up_order = _fused_order(gate_up.members, [mlp.gate_proj, mlp.up_proj])
    if qkv_order is None or gate_up_order is None:
        return f"layer {index}'s fused products hold other linears"
    if any(_hooked(m) for m in [layer, attn, mlp, *norms, *linears, mlp.act_fn]):
        return f"layer {index} has hooks"
    return _Layer(index, norms[0], attn, qkv.module, qkv.sizes, qkv_order, attn.o_proj, norms[1], gate_up.module,
                  gate_up.sizes, gate_up_order, mlp.down_proj)


def _add_norm(x: torch.Tensor, residual: torch.Tensor, norm: KernelRMSNorm) -> torch.Tensor:
    """``residual += x``, then ``norm(residual)`` into x's memory -> x: ``_C::fused_add_rms_norm``, the same numbers as
    the modules' sum and :class:`KernelRMSNorm` in one call (the start-up check compares them bit for bit)."""
    torch.ops._C.fused_add_rms_norm(x, residual, norm.weight, norm.eps)
    return x


def _held(parent: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, name, child) of ``parent``'s submodules, itself included as the first's parent."""
    return [(owner, name, child) for owner in parent.modules() for name, child in owner._modules.items() if child is not None]


class DirectDecoder:
    """The step forward of module docstring, over ``model``'s own (prepared) modules; build with :meth:`of`."""

    def __init__(self, model: nn.Module, layers: list[_Layer]):
        decoder = model.get_decoder()
        self.embed, self.rotary, self.norm = decoder.embed_tokens, decoder.rotary_emb, decoder.norm
        self.lm_head = model.get_output_embeddings()
        self.layers = layers
        self._held = _held(model)  # what the model holds now: current() compares
        self._modules = [model] + [child for _, _, child in self._held]

    def current(self) -> bool:
        """Does the model still hold the modules this forward runs, none of them with a hook (module docstring)?"""
        hooks = nn.modules.module
        if hooks._global_forward_hooks or hooks._global_forward_pre_hooks:
            return False
        return (all(owner._modules.get(name) is child for owner, name, child in self._held)
                and not any(m._forward_hooks or m._forward_pre_hooks for m in self._modules))

    @classmethod
    def of(cls, model: nn.Module) -> "DirectDecoder | str":
        """The direct forward of ``model``, or why it has none (module docstring)."""
        decoder = model.get_decoder()
        config = model.config.get_text_config()
        parts = {name: getattr(decoder, name, None) for name in ("embed_tokens", "rotary_emb", "norm", "layers")}
        if any(p is None for p in parts.values()):
            return "not a decoder with embed_tokens, rotary_emb, norm and layers"
        if not isinstance(parts["norm"], KernelRMSNorm):
            return "the final norm is not on the kernels"
        if not hasattr(torch.ops._C, "fused_add_rms_norm") or not hasattr(torch.ops._C, "cpu_attn_reshape_and_cache"):
            return "vLLM's library has no fused add-and-norm or cache writer"
        if getattr(config, "sliding_window", None) or any(t != "full_attention" for t in getattr(config, "layer_types", None) or ()):
            return "a model with sliding-window layers"
        if len(parts["layers"]) != config.num_hidden_layers:
            return "the decoder runs a part of its layers"
        if any(_hooked(m) for m in (model, decoder, parts["embed_tokens"], parts["rotary_emb"], parts["norm"],
                                    model.get_output_embeddings())):
            return "the model has hooks"
        layers = []
        for i, layer in enumerate(parts["layers"]):
            got = _layer(i, layer)
            if isinstance(got, str):
                return got
            layers.append(got)
        return cls(model, layers)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, plan: PagedPlan,
                feature_layers: tuple[int, ...] | None, index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """ids/positions (B, T), written at ``plan``'s slots and attending on it -> (logits (B, T, V), features
        (B, T, F)): the hidden state, or the hidden states entering ``feature_layers``.

        The tokens' rows go through the layers flat, (B·T, width): the modules' products, norms and kernels see the
        same rows in the same order (their (B, T, ...) views are of the same memory), without the views between.
        ``index`` (B, T): ids/positions are (1, N), rows of uneven lengths packed one after another (``plan``'s
        queries), and position t of row b is packed token ``index[b, t]``."""
        B, T = ids.shape
        hidden, entering = self._layers(ids, positions, plan, feature_layers)
        logits = self._head(hidden)
        features = hidden if feature_layers is None else torch.cat([entering[i] for i in feature_layers], dim=-1)
        if index is not None:
            return logits[index], features[index]
        return logits.view(B, T, -1), features.view(B, T, -1)

    def packed(self, ids: torch.Tensor, positions: torch.Tensor, plan: PagedPlan, feature_layers: tuple[int, ...] | None,
               heads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows' tokens of uneven counts packed one after another, ids/positions (1, N), each row's written at ``plan``'s
        slots and attending causally over its own keys -> (logits of the packed tokens ``heads`` (R, V) only, features
        (N, F)). A prefill's prompts (queries of their lengths, ends 0; ``heads`` their last tokens) take the same
        operations on the same rows as a padded prefill through the modules, less the padding's; a step's rows and
        prompts may share one forward (:meth:`distill.engine.target.Target.mixed_step`)."""
        hidden, entering = self._layers(ids, positions, plan, feature_layers)
        features = hidden if feature_layers is None else torch.cat([entering[i] for i in feature_layers], dim=-1)
        return self._head(hidden[heads]), features

    def _layers(self, ids, positions, plan: PagedPlan, feature_layers) -> tuple[torch.Tensor, dict]:
        """The decoder over ids/positions (B, T) -> (the hidden state after the final norm (B·T, width), the hidden
        states entering ``feature_layers`` (B·T, width) each); each layer's keys and values go to ``plan``'s slots."""
        B, T = ids.shape
        n = B * T
        h = self.embed.forward(ids)
        cos, sin = self.rotary.forward(h, positions)
        h = h.view(n, -1)
        where, table = rotary.kernel_table(cos, sin, B)  # the (cos | sin) rows the attention modules' kernel reads
        entering = {}
        x = self.layers[0].norm_in.forward(h)
        for layer, after in zip(self.layers, [*(layer.norm_in for layer in self.layers[1:]), self.norm]):
            if feature_layers is not None and layer.index in feature_layers:
                entering[layer.index] = h.clone()  # h is added to in place below
            x = _add_norm(self._attention(layer, x, where, table, plan, n), h, layer.norm_post)
            x = _add_norm(self._mlp(layer, x, n), h, after)
        return x, entering

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.lm_head
        return head.product(hidden, len(hidden)) if isinstance(head, DualLinear) else head.forward(hidden)

    @staticmethod
    def _attention(layer: _Layer, x, where, table, plan: PagedPlan, n: int) -> torch.Tensor:
        attn = layer.attention
        D = attn.head_dim
        outs = layer.qkv.product(x, n).split(layer.qkv_sizes, dim=-1)
        q, k, v = (outs[i] for i in layer.qkv_order)  # (B·T, heads·D) views of one product
        rotary.rotate_rows(where, q, k, D, table)  # as KernelAttention rotates them, in place
        write_packed(plan, attn.layer_idx, k.view(n, -1, D), v.view(n, -1, D))
        if plan.masked is not None:  # a branching tree: its queries attend under its mask (B = rows of the plan)
            B = len(plan.seq_lens)
            out = plan.masked.attend(attn.layer_idx, q.reshape(n, -1, D), B, n // B, attn.scaling)
        else:
            out = attend_packed(plan, attn.layer_idx, q.reshape(n, -1, D), attn.scaling)
        return layer.o_proj.product(out.view(n, -1), n)

    @staticmethod
    def _mlp(layer: _Layer, x, n: int) -> torch.Tensor:
        outs = layer.gate_up.product(x, n).split(layer.gate_up_sizes, dim=-1)
        gate, up = (outs[i] for i in layer.gate_up_order)
        return layer.down.product(torch.mul(F.silu(gate, inplace=True), up), n)  # gate: a view of this product's own output


__all__ = ["DirectDecoder"]
