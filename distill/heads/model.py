"""Medusa heads (docs/architecture.md, "Medusa heads folder").

Terms
-----
head k (k = 1..K)
    maps the backbone's last hidden state h_t (after the final norm, the state
    the LM head reads) to logits for token t+k+1 — the LM head itself predicts t+1.
residual block
    ``x + SiLU(W x + b)``, L of them per head; W is zero-initialised so a fresh
    head starts as exactly the LM head (it predicts t+1 for t+k+1).
shared LM head
    ``original_lm_head: true`` in vLLM's Medusa config: every head reads through one
    LM head (a copy of the base model's, stored once as ``lm_heads.0.weight``); only
    the residual blocks are trained.

Files (vLLM's Medusa format; loads with ``speculative_config={"method": "medusa",
"model": DIR, "num_speculative_tokens": K}``): ``config.json`` and ``model.safetensors``
with ``blocks.{h}.layers.{l}.weight|bias`` and ``lm_heads.{h}.weight``. Our own
fields go to ``distill-heads.json`` beside them, never into ``config.json``.

A save moves the files in as one set (:class:`~distill.store.atomic.StagedFiles`); every
reader here refuses a folder whose save did not complete (:func:`check_heads_folder`).
A folder with no ``distill-heads.json`` and no interrupted save holds heads written by
another tool (or saved without metadata): it loads, and its metadata is ``{}``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from distill.errors import ModelError
from distill.store.atomic import StagedFiles, commit_incomplete

DISTILL_HEADS_FILE = "distill-heads.json"
#: ``medusa_fc_bias`` where a config.json lacks it: vLLM's Medusa reads no bias (``getattr(config, "medusa_fc_bias",
#: False)``). :class:`HeadsConfig`'s default too, so a HeadsConfig and the config.json it is read from mean the same.
VLLM_FC_BIAS = False
#: Heads that ``train-heads`` builds have a bias in every residual layer (Medusa's ResBlock); config.json records it.
TRAINED_FC_BIAS = True
#: The names a reader needs to take a folder as holding heads: removed first and written last on a save.
HEADS_MARKERS = ("config.json", DISTILL_HEADS_FILE)


@dataclass
class HeadsConfig:
    hidden_size: int
    vocab_size: int
    num_heads: int = 4
    num_layers: int = 1  # residual blocks per head
    share_lm_head: bool = False  # vLLM original_lm_head
    bias: bool = VLLM_FC_BIAS  # medusa_fc_bias, always written to config.json (trained heads: TRAINED_FC_BIAS)

    def __post_init__(self) -> None:
        if self.num_heads < 1 or self.num_layers < 1:
            raise ValueError(f"need at least one head and one layer; got {self.num_heads} heads, {self.num_layers} layers")

    def vllm_config(self) -> dict:
        """The config.json vLLM's MedusaConfig reads (only keys it understands)."""
        return {
            "model_type": "medusa",
            "architectures": ["MedusaModel"],
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "num_heads": self.num_heads,
            "num_hidden_layers": self.num_layers,
            "medusa_fc_bias": self.bias,
            "original_lm_head": self.share_lm_head,
        }

    @classmethod
    def from_vllm_config(cls, d: dict) -> "HeadsConfig":
        return cls(
            hidden_size=d["hidden_size"], vocab_size=d["vocab_size"], num_heads=d["num_heads"],
            num_layers=d.get("num_hidden_layers", 1), share_lm_head=bool(d.get("original_lm_head", False)),
            bias=bool(d.get("medusa_fc_bias", VLLM_FC_BIAS)),
        )


class ResidualBlock(nn.Module):
    def __init__(self, hidden_size: int, num_layers: int, bias: bool):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden_size, hidden_size, bias=bias) for _ in range(num_layers))
        self.act = nn.SiLU()
        for layer in self.layers:
            nn.init.zeros_(layer.weight)
            if layer.bias is not None:
                nn.init.zeros_(layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., H) -> (..., H)
        for layer in self.layers:
            x = x + self.act(layer(x))
        return x


class MedusaHeads(nn.Module):
    """K independent heads (no shared module instances except the LM head when shared)."""

    def __init__(self, config: HeadsConfig, lm_head_weight: torch.Tensor | None = None):
        super().__init__()
        self.config = config
        H, V = config.hidden_size, config.vocab_size
        self.blocks = nn.ModuleList(ResidualBlock(H, config.num_layers, config.bias) for _ in range(config.num_heads))
        n_lm = 1 if config.share_lm_head else config.num_heads
        self.lm_heads = nn.ModuleList(nn.Linear(H, V, bias=False) for _ in range(n_lm))
        if lm_head_weight is not None:
            self.init_lm_heads(lm_head_weight)

    @torch.no_grad()
    def init_lm_heads(self, weight: torch.Tensor) -> None:
        """Copy the base model's LM head (V, H) into every head's output layer."""
        for lm in self.lm_heads:
            if lm.weight.shape != weight.shape:
                raise ModelError(f"LM head shape {tuple(weight.shape)} does not match heads {tuple(lm.weight.shape)}")
            lm.weight.copy_(weight)
        if self.config.share_lm_head:
            self.lm_heads[0].weight.requires_grad_(False)

    def lm_head(self, k: int) -> nn.Linear:
        return self.lm_heads[0 if self.config.share_lm_head else k]

    def head_states(self, hidden: torch.Tensor) -> list[torch.Tensor]:
        """hidden (..., H) -> K states (..., H), one per head, before the LM head."""
        return [block(hidden) for block in self.blocks]

    def head_logits(self, hidden: torch.Tensor, k: int) -> torch.Tensor:
        """Logits of head k (0-based; predicts token t+k+2 from h_t): (..., H) -> (..., V)."""
        return self.lm_head(k)(self.blocks[k](hidden))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (B, T, H) -> logits (K, B, T, V). Materializes all K heads: use head_logits for big T."""
        return torch.stack([self.head_logits(hidden, k) for k in range(self.config.num_heads)])

    # -- files ---------------------------------------------------------------------------
    def state_dict_vllm(self) -> dict[str, torch.Tensor]:
        sd = {}
        for h, block in enumerate(self.blocks):
            for l, layer in enumerate(block.layers):
                sd[f"blocks.{h}.layers.{l}.weight"] = layer.weight
                if layer.bias is not None:
                    sd[f"blocks.{h}.layers.{l}.bias"] = layer.bias
        for h, lm in enumerate(self.lm_heads):
            sd[f"lm_heads.{h}.weight"] = lm.weight
        return {k: v.detach().contiguous().cpu() for k, v in sd.items()}

    def save(self, folder: Path, extra: dict | None = None) -> None:
        """Write the heads folder as one set (:func:`save_heads_folder`)."""
        save_heads_folder(self, folder, extra)

    def write_files(self, folder: Path, extra: dict | None = None) -> None:
        """model.safetensors + config.json (+ distill-heads.json) into a staging ``folder`` (callers: :meth:`save`)."""
        from safetensors.torch import save_file

        save_file(self.state_dict_vllm(), str(Path(folder) / "model.safetensors"))
        (Path(folder) / "config.json").write_text(json.dumps(self.config.vllm_config(), indent=2) + "\n")
        if extra is not None:
            (Path(folder) / DISTILL_HEADS_FILE).write_text(json.dumps(extra, indent=2, default=str) + "\n")

    @classmethod
    def load(cls, folder: Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> "MedusaHeads":
        from safetensors.torch import load_file

        folder = check_heads_folder(folder)
        if not (folder / "config.json").is_file() or not (folder / "model.safetensors").is_file():
            raise ModelError(f"{folder} is not a heads folder (needs config.json and model.safetensors)")
        raw = json.loads((folder / "config.json").read_text())
        if raw.get("model_type") != "medusa":
            raise ModelError(f"{folder}/config.json has model_type {raw.get('model_type')!r}, expected 'medusa'")
        heads = cls(HeadsConfig.from_vllm_config(raw))
        sd = load_file(str(folder / "model.safetensors"))
        own = {k: v for k, v in heads.state_dict().items()}
        missing = sorted(set(own) - set(sd))
        unexpected = sorted(set(sd) - set(own))
        if missing or unexpected:
            raise ModelError(f"{folder}: weights do not match config (missing {missing[:4]}, unexpected {unexpected[:4]})")
        heads.load_state_dict(sd)
        return heads.to(device=device, dtype=dtype)


def save_heads_folder(module, folder: Path, extra: dict | None = None) -> None:
    """``module.write_files(stage, extra)`` (Medusa heads, an EAGLE-3 drafter) moved into ``folder`` as one set
    (:class:`~distill.store.atomic.StagedFiles` with :data:`HEADS_MARKERS`)."""
    with StagedFiles(folder, HEADS_MARKERS) as stage:
        module.write_files(stage.path, extra)


def check_heads_folder(folder: Path) -> Path:
    """``folder`` as a Path; a ModelError when a save of heads or a drafter into it did not complete."""
    folder = Path(folder)
    if commit_incomplete(folder):
        raise ModelError(f"{folder}: the save of its heads did not complete (the process was stopped while moving the files in); "
                         "run the same train-heads again with --resume to write them, or use another heads folder")
    return folder


def read_distill_meta(folder: Path) -> dict:
    """distill's own fields of a heads or drafter folder (``distill-heads.json``; ``{}`` for heads without it)."""
    p = check_heads_folder(folder) / DISTILL_HEADS_FILE
    return json.loads(p.read_text()) if p.is_file() else {}
