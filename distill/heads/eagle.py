"""The EAGLE-3 drafter and its vLLM ``llama_eagle3`` folder.

Terms
-----
aux layers
    the target layers whose hidden states feed the drafter. Id i in [0, N) names the
    residual stream after i of the target's N decoder layers: transformers'
    ``hidden_states[i]`` and vLLM's ``eagle_aux_hidden_state_layer_ids`` (id N is not
    allowed: transformers returns it after the final norm, vLLM before). Ascending,
    because vLLM concatenates them in layer order. Default ``(2, N // 2, N - 3)``:
    a low, a middle and a high layer, vLLM's own default.
fused feature
    ``g_t = fc([a_t^1 ; a_t^2 ; a_t^3])``: the aux hidden states of position t, (A·H_t) -> H.
drafter step
    at position t it reads e = the target's (frozen) embedding of the token after t and
    g = the fused feature (step 0) or its own previous output (later steps)::

        x   = [input_layernorm(e) ; hidden_norm(g)]              (B, q, 2H)
        r   = g + o_proj(attention(q/k/v_proj(x)))              (B, q, H)
        out = r + mlp(post_attention_layernorm(r))              (B, q, H)  the next step's g
        logits = lm_head(norm(out))                             (B, q, Vd) over the draft vocabulary

    which is vLLM's ``llama_eagle3`` layer 0 (``norm_before_residual`` false). The
    attention and MLP are transformers' own ``LlamaAttention`` / ``LlamaMLP`` built from
    the target's config; only q/k/v_proj are widened to read 2H.
step-by-step use
    :meth:`EagleDrafter.forward` takes embeddings, features, position ids, a boolean 4D
    keep-mask and a transformers ``Cache``: an engine drafts one depth per call with its
    own small KV cache; the trainer unrolls its training-time test the same way.

Files (vLLM's EAGLE-3 layout; loads with ``speculative_config={"method": "eagle3",
"model": DIR, "num_speculative_tokens": K}``): ``config.json`` (a Llama config with
``architectures: ["LlamaForCausalLMEagle3"]``, ``num_hidden_layers: 1``,
``draft_vocab_size``, ``target_hidden_size`` and ``eagle_config`` with the aux layer
ids) and ``model.safetensors`` with ``fc.weight``, ``midlayer.*``, ``norm.weight``,
``lm_head.weight`` and, for a reduced vocabulary, ``d2t`` / ``t2d``. No embedding is
stored: vLLM shares the target's. Our own fields go to ``distill-heads.json``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from distill.errors import ConfigError, ModelError
from distill.heads.model import DISTILL_HEADS_FILE, check_heads_folder, save_heads_folder
from distill.heads.vocab import DraftVocab

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"  # vLLM's registry maps it to llama_eagle3.Eagle3LlamaForCausalLM
#: The target config fields the drafter's one layer copies (the target's own architecture and width).
ARCH_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
             "rms_norm_eps", "rope_parameters", "rope_theta", "rope_scaling", "max_position_embeddings", "attention_bias",
             "mlp_bias", "vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")
SUPPORTED_TARGETS = ("llama",)  # vLLM's llama_eagle3 drafter layer is a Llama layer
INIT_STD = 0.02  # normal init of the drafter's linear layers (the Llama initializer_range)
#: A fresh drafter's logits are the target's logit lens at its highest aux layer divided by this (see init_from_target).
#: Measured: BENCHMARKS.md, "Medusa-1 against EAGLE-3".
INIT_LENS_TEMPERATURE = 5.0


def default_aux_layers(num_layers: int) -> list[int]:
    """vLLM's default EAGLE-3 aux layers for an N-layer target: (2, N // 2, N - 3)."""
    ids = [2, num_layers // 2, num_layers - 3]
    if num_layers < 6:
        raise ConfigError(f"the target has {num_layers} layers: too few for the default aux layers (2, N//2, N-3); pass --aux-layers")
    return ids


def parse_aux_layers_spec(spec) -> str:
    """``auto``, "2,15,27" or a list of ids -> the canonical string (``auto`` or ids joined by commas)."""
    if isinstance(spec, (list, tuple)):
        spec = ",".join(str(x) for x in spec)
    text = str(spec).replace(" ", "").strip()
    if text == "auto":
        return text
    try:
        return ",".join(str(int(x)) for x in text.split(",") if x)
    except ValueError:
        raise ConfigError(f"--aux-layers is auto or comma-separated layer ids like 2,15,27; got '{spec}'") from None


def parse_aux_layers(spec, num_layers: int) -> list[int]:
    """``auto`` or comma-separated layer ids -> validated ascending ids in [0, N)."""
    spec = parse_aux_layers_spec(spec)
    if spec == "auto":
        return default_aux_layers(num_layers)
    ids = [int(x) for x in spec.split(",")] if spec else []
    if not ids or any(b <= a for a, b in zip(ids, ids[1:])) or ids[0] < 0 or ids[-1] >= num_layers:
        raise ConfigError(f"--aux-layers must be distinct ascending ids in [0, {num_layers}) (the residual stream after that "
                          f"many of the target's {num_layers} layers); got '{spec}'")
    return ids


@dataclass
class DrafterConfig:
    """The drafter's shape: the target's Llama fields, the aux layers and the draft vocabulary size."""

    arch: dict  # ARCH_KEYS taken from the target's config.json
    aux_layer_ids: list[int]
    draft_vocab_size: int
    target_hidden_size: int = 0  # 0: the target's hidden_size (the drafter's width)
    extra: dict = field(default_factory=dict)  # vLLM config keys read back from a folder and written unchanged

    def __post_init__(self) -> None:
        if self.target_hidden_size == 0:
            self.target_hidden_size = int(self.arch["hidden_size"])
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ModelError(f"draft_vocab_size must be in [1, {self.vocab_size}]; got {self.draft_vocab_size}")
        if not self.aux_layer_ids:
            raise ModelError("an EAGLE-3 drafter needs at least one aux layer")

    @property
    def hidden_size(self) -> int:
        return int(self.arch["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.arch["vocab_size"])

    @classmethod
    def for_target(cls, target_config: dict, aux_layer_ids: list[int], draft_vocab_size: int) -> "DrafterConfig":
        """From the target's config.json (a dict); only Llama-architecture targets."""
        kind = target_config.get("model_type")
        if kind not in SUPPORTED_TARGETS:
            raise ConfigError(f"--arch eagle3 drafts for Llama-architecture targets (vLLM's llama_eagle3); this model is '{kind}'")
        return cls(arch={k: target_config[k] for k in ARCH_KEYS if target_config.get(k) is not None},
                   aux_layer_ids=list(aux_layer_ids), draft_vocab_size=draft_vocab_size)

    def llama_config(self):
        """A one-layer transformers LlamaConfig of the target's width (sdpa attention)."""
        from transformers import LlamaConfig

        conf = LlamaConfig(**self.arch, num_hidden_layers=1, tie_word_embeddings=False)
        conf._attn_implementation = "sdpa"
        return conf

    def vllm_config(self) -> dict:
        """config.json for vLLM's llama_eagle3 (only keys a Llama config or vLLM's EAGLE-3 loader reads)."""
        return {
            **self.extra,
            **self.arch,
            "architectures": [EAGLE3_ARCHITECTURE],
            "model_type": "llama",
            "num_hidden_layers": 1,
            "tie_word_embeddings": False,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids), "use_aux_hidden_state": True},
        }

    @classmethod
    def from_vllm_config(cls, d: dict) -> "DrafterConfig":
        if EAGLE3_ARCHITECTURE not in (d.get("architectures") or []):
            raise ModelError(f"config.json has architectures {d.get('architectures')}, expected ['{EAGLE3_ARCHITECTURE}']")
        if d.get("num_hidden_layers", 1) != 1:
            raise ModelError(f"only one-layer EAGLE-3 drafters are supported; config.json has {d.get('num_hidden_layers')}")
        ids = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or d.get("eagle_aux_hidden_state_layer_ids")
        if not ids:
            raise ModelError("config.json names no eagle_aux_hidden_state_layer_ids (eagle_config)")
        for flag in ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output"):
            if d.get(flag) or (d.get("eagle_config") or {}).get(flag):
                raise ModelError(f"config.json sets {flag}: that EAGLE-3 variant is not supported here")
        known = set(ARCH_KEYS) | {"architectures", "model_type", "num_hidden_layers", "tie_word_embeddings", "draft_vocab_size",
                                  "target_hidden_size", "eagle_config"}
        return cls(arch={k: d[k] for k in ARCH_KEYS if d.get(k) is not None}, aux_layer_ids=list(ids),
                   draft_vocab_size=int(d.get("draft_vocab_size") or d["vocab_size"]),
                   target_hidden_size=int(d.get("target_hidden_size") or d["hidden_size"]),
                   extra={k: v for k, v in d.items() if k not in known})


def causal_mask(q: int, device=None) -> torch.Tensor:
    """Boolean causal keep-mask (1, 1, q, q): True where a query may attend."""
    return torch.ones(q, q, dtype=torch.bool, device=device).tril()[None, None]


class EagleLayer(nn.Module):
    """One Llama decoder layer whose attention reads [input_layernorm(e) ; hidden_norm(g)] (2H wide)."""

    def __init__(self, conf):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm

        H, eps = conf.hidden_size, conf.rms_norm_eps
        self.self_attn = LlamaAttention(conf, layer_idx=0)
        attn = self.self_attn
        # vLLM's llama_eagle3 layer 0: q/k/v read the 2H concatenation (transformers' read H).
        attn.q_proj = nn.Linear(2 * H, attn.q_proj.out_features, bias=conf.attention_bias)  # (nh·hd, 2H)
        attn.k_proj = nn.Linear(2 * H, attn.k_proj.out_features, bias=conf.attention_bias)  # (nkv·hd, 2H)
        attn.v_proj = nn.Linear(2 * H, attn.v_proj.out_features, bias=conf.attention_bias)  # (nkv·hd, 2H)
        self.mlp = LlamaMLP(conf)
        self.input_layernorm = LlamaRMSNorm(H, eps=eps)
        self.hidden_norm = LlamaRMSNorm(H, eps=eps)
        self.post_attention_layernorm = LlamaRMSNorm(H, eps=eps)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, position_embeddings, attention_mask, past_key_values):
        """embeds, hidden (B, q, H) -> the prenorm output (B, q, H)."""
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # (B, q, 2H)
        a, _ = self.self_attn(x, position_embeddings=position_embeddings, attention_mask=attention_mask,
                              past_key_values=past_key_values)  # (B, q, H)
        r = hidden + a  # (B, q, H)
        return r + self.mlp(self.post_attention_layernorm(r))


class EagleDrafter(nn.Module):
    """fc + one decoder layer + final norm + draft LM head; the target embedding stays outside (frozen, shared)."""

    def __init__(self, config: DrafterConfig, vocab: DraftVocab):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

        if vocab.size != config.draft_vocab_size or vocab.vocab_size != config.vocab_size:
            raise ModelError(f"draft vocabulary ({vocab.size} of {vocab.vocab_size}) does not match the config "
                             f"({config.draft_vocab_size} of {config.vocab_size})")
        self.config = config
        conf = config.llama_config()
        H = config.hidden_size
        self.fc = nn.Linear(len(config.aux_layer_ids) * config.target_hidden_size, H, bias=False)  # (H, A·Ht)
        self.midlayer = EagleLayer(conf)
        self.norm = LlamaRMSNorm(H, eps=conf.rms_norm_eps)
        self.lm_head = nn.Linear(H, config.draft_vocab_size, bias=False)  # (Vd, H)
        self.rotary = LlamaRotaryEmbedding(conf)  # non-persistent buffers only
        self.register_buffer("d2t", vocab.d2t())  # (Vd,) int64
        self.register_buffer("t2d", vocab.t2d())  # (V,) bool
        self.register_buffer("draft_index", vocab.draft_index(), persistent=False)  # (V,) int64, -1 outside
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Linear layers ~ N(0, 0.02), norms 1 (the Llama initialisation)."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=INIT_STD)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)

    @torch.no_grad()
    def init_from_target(self, lm_head_weight: torch.Tensor, norm_weight: torch.Tensor) -> None:
        """Start as the target's logit lens at the highest aux layer, tempered (as a fresh Medusa head starts as the LM head).

        ``fc`` passes the last aux block through unchanged (the others at 0), the layer's
        residual branches start at 0 (``o_proj`` and ``down_proj`` zero), the draft LM head
        is the target's rows (V, H) of the draft vocabulary and the final norm the target's
        (H,) divided by :data:`INIT_LENS_TEMPERATURE`: ``logits = lm_head(norm(a^A)) / 5``.
        The lens predicts token t+1 where step 0 must predict t+2, so untempered its
        confident misses dominate the first steps, and it learns more slowly than from a
        random start; tempered, it starts ahead of both. Training then moves every weight,
        the norm included.
        """
        H, Ht = self.config.hidden_size, self.config.target_hidden_size
        if H != Ht:
            raise ModelError(f"the drafter ({H}) and the target ({Ht}) differ in width: no identity start for fc")
        ids = self.vocab.target_ids.to(lm_head_weight.device)
        self.lm_head.weight.copy_(lm_head_weight[ids])
        self.norm.weight.copy_(norm_weight / INIT_LENS_TEMPERATURE)
        self.fc.weight.zero_()
        self.fc.weight[:, -Ht:].copy_(torch.eye(H))  # (H, A·Ht): the last aux layer, unchanged
        self.midlayer.self_attn.o_proj.weight.zero_()
        self.midlayer.mlp.down_proj.weight.zero_()

    @property
    def vocab(self) -> DraftVocab:
        return DraftVocab.from_maps(self.d2t.cpu(), self.t2d.cpu())

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """Concatenated aux hidden states (..., A·Ht) -> the fused feature (..., H)."""
        return self.fc(aux)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None, past_key_values=None) -> torch.Tensor:
        """One drafter pass over q positions.

        embeds (B, q, H): the target embedding of the token after each position;
        hidden (B, q, H): the fused feature or the previous step's output;
        position_ids (B, q); attention_mask (B, 1, q, k) bool, True where a query may
        attend, over the k keys the attention sees (the cache's, after this call's q are
        appended; every query must keep at least one key), or None for a causal mask over
        these q positions without a cache; past_key_values: a transformers ``Cache``
        (e.g. ``DynamicCache``) this call's keys are appended to, or None.
        Returns the prenorm output (B, q, H).
        """
        if attention_mask is None:
            if past_key_values is not None and past_key_values.get_seq_length() > 0:
                raise ValueError("pass an attention_mask when the cache already holds keys")
            attention_mask = causal_mask(hidden.shape[1], hidden.device)
        if attention_mask.dtype != torch.bool:
            raise ValueError(f"attention_mask must be a boolean keep-mask; got {attention_mask.dtype}")
        position_embeddings = self.rotary(hidden, position_ids)  # cos, sin: (B, q, hd)
        return self.midlayer(embeds, hidden, position_embeddings, attention_mask, past_key_values)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Prenorm output (..., H) -> draft-vocabulary logits (..., Vd)."""
        return self.lm_head(self.norm(out))

    # -- files ---------------------------------------------------------------------------
    def state_dict_vllm(self) -> dict[str, torch.Tensor]:
        """The weights under vLLM's names (no rotary buffers; d2t/t2d only for a reduced vocabulary)."""
        sd = {k: v for k, v in self.state_dict().items() if not k.startswith("rotary.")}
        if self.config.draft_vocab_size == self.config.vocab_size:
            sd.pop("d2t")
            sd.pop("t2d")
        return {k: v.detach().contiguous().cpu() for k, v in sd.items()}

    def save(self, folder: Path, extra: dict | None = None) -> None:
        """Write the drafter folder as one set (:func:`~distill.heads.model.save_heads_folder`)."""
        save_heads_folder(self, folder, extra)

    def write_files(self, folder: Path, extra: dict | None = None) -> None:
        """config.json + model.safetensors (+ distill-heads.json) into a staging ``folder`` (callers: :meth:`save`)."""
        from safetensors.torch import save_file

        folder = Path(folder)
        sd = self.state_dict_vllm()
        sd = {k: (v.float() if v.is_floating_point() else v) for k, v in sd.items()}
        save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
        conf = dict(self.config.vllm_config(), dtype="float32")
        (folder / "config.json").write_text(json.dumps(conf, indent=2) + "\n")
        if extra is not None:
            (folder / DISTILL_HEADS_FILE).write_text(json.dumps(extra, indent=2, default=str) + "\n")

    @classmethod
    def load(cls, folder: Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> "EagleDrafter":
        from safetensors.torch import load_file

        folder = check_heads_folder(folder)
        if not (folder / "config.json").is_file() or not (folder / "model.safetensors").is_file():
            raise ModelError(f"{folder} is not a drafter folder (needs config.json and model.safetensors)")
        config = DrafterConfig.from_vllm_config(json.loads((folder / "config.json").read_text()))
        sd = load_file(str(folder / "model.safetensors"))
        if config.draft_vocab_size == config.vocab_size:
            vocab = DraftVocab.full(config.vocab_size)
            sd = {**sd, "d2t": vocab.d2t(), "t2d": vocab.t2d()}
        elif "d2t" not in sd or "t2d" not in sd:
            raise ModelError(f"{folder}: a {config.draft_vocab_size}-token draft vocabulary needs d2t and t2d in model.safetensors")
        else:
            vocab = DraftVocab.from_maps(sd["d2t"], sd["t2d"])
        drafter = cls(config, vocab)
        own = {k for k in drafter.state_dict() if not k.startswith("rotary.")}
        missing, unexpected = sorted(own - set(sd)), sorted(set(sd) - own)
        if missing or unexpected:
            raise ModelError(f"{folder}: weights do not match config (missing {missing[:4]}, unexpected {unexpected[:4]})")
        drafter.load_state_dict(sd)
        drafter.draft_index.copy_(vocab.draft_index())
        return drafter.to(device=device, dtype=dtype)


def is_eagle3_folder(folder: Path) -> bool:
    """Whether a heads folder holds an EAGLE-3 drafter (by its config.json's architectures); a ModelError when
    a save into it did not complete (:func:`~distill.heads.model.check_heads_folder`)."""
    p = check_heads_folder(folder) / "config.json"
    return p.is_file() and EAGLE3_ARCHITECTURE in (json.loads(p.read_text()).get("architectures") or [])
