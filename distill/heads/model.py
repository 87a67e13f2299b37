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
    the residual blocks are trained. The copy stays although it is the base model's:
    vLLM's Medusa builds an LM head of its own for ``original_lm_head`` and fills it
    from ``lm_heads.0.weight`` of this folder only, never from the target model, and a
    folder without it loads with no error and that LM head left uninitialised.

Files (vLLM's Medusa format; loads with ``speculative_config={"method": "medusa",
"model": DIR, "num_speculative_tokens": K}``): ``config.json`` and ``model.safetensors``
with ``blocks.{h}.layers.{l}.weight|bias`` and ``lm_heads.{h}.weight``. Our own
fields go to ``distill-heads.json`` beside them, never into ``config.json``.

``distill-heads.json`` names no absolute path, so a heads folder can be moved, copied or shared:
the base model and the dataset it was trained on are recorded by a path relative to the heads
folder where they lie in the same tree (at most :data:`SAME_TREE_LEVELS` folders up: ``../data``),
otherwise by their folder's name and a content hash (the base model's ``revision``, the dataset's
``manifest_sha256``); the bundled model by its id alone (it lives in ``$DISTILL_HOME``, found again by
its name). :func:`base_model_location` reads them back, folders recorded with absolute paths too.

A save moves the files in as one set (:class:`~distill.store.atomic.StagedFiles`); every
reader here refuses a folder whose save did not complete (:func:`check_heads_folder`).
A folder with no ``distill-heads.json`` and no interrupted save holds heads written by
another tool (or saved without metadata): it loads, and its metadata is ``{}``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from distill.errors import ConfigError, ModelError
from distill.store.atomic import StagedFiles, commit_incomplete, sha256_file

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
        module.write_files(stage.path, None if extra is None else portable_meta(extra, folder))


def check_heads_folder(folder: Path) -> Path:
    """``folder`` as a Path, once it holds a whole set of heads or a drafter; a ModelError when a save into it did not
    complete, or it is missing, or it lacks ``config.json`` / ``model.safetensors``.

    It only looks at names on disk: every reader calls it before any weights (its own or the model's) are loaded.
    """
    folder = Path(folder)
    if commit_incomplete(folder):
        raise ModelError(f"{folder}: the save of its heads did not complete (the process was stopped while moving the files in); "
                         "run the same train-heads again with --resume to write them, or use another heads folder")
    if not folder.is_dir():
        raise ModelError(f"{folder} is not a heads folder: {'it is a file' if folder.exists() else 'no such folder'} "
                         "(give the folder written by `distill train-heads`)")
    missing = [name for name in ("config.json", "model.safetensors") if not (folder / name).is_file()]
    if missing:
        hint = ("its training has not written them yet: continue it with `distill train-heads --resume`"
                if (folder / "checkpoints").is_dir() else "give the folder written by `distill train-heads`")
        raise ModelError(f"{folder} is not a heads folder (it has no {' and no '.join(missing)}): {hint}")
    return folder


def read_distill_meta(folder: Path) -> dict:
    """distill's own fields of a heads or drafter folder (``distill-heads.json``; ``{}`` for heads without it)."""
    p = check_heads_folder(folder) / DISTILL_HEADS_FILE
    return json.loads(p.read_text()) if p.is_file() else {}


#: How many folders above a heads folder a recorded path may climb and still count as the same tree: ``../data`` (a
#: pipeline's folders side by side), ``../../models/m`` (a project's ``out/heads`` and ``models/``). Further away the
#: path says where the trainer's machine kept it, not where a copy of the folder finds it.
SAME_TREE_LEVELS = 2
#: The fields of train_config that name local files (written as the base model and the dataset are).
CONFIG_PATHS = ("data", "out", "model")


def _relative(target: Path, folder: Path) -> str | None:
    """``target`` relative to ``folder`` (POSIX form) when in the same tree (:data:`SAME_TREE_LEVELS`), else None."""
    rel = Path(os.path.relpath(target, folder))
    return None if rel.parts[:SAME_TREE_LEVELS + 1].count("..") > SAME_TREE_LEVELS else rel.as_posix()


def _is_local(value) -> bool:
    return isinstance(value, str) and "://" not in value and (os.path.isabs(value) or Path(value).exists())


def portable_meta(extra: dict, folder: Path) -> dict:
    """``extra`` (distill-heads.json's fields) with every local path recorded from ``folder``, the heads folder (see
    the module docstring): ``base_model.path`` and ``dataset.path`` relative to it or left out, with the dataset's
    folder name and ``manifest_sha256`` in their place and a local model's ``id`` its folder's name; the local paths
    of ``train_config`` relative to it, else their folder's name. Paths already relative to it pass unchanged."""
    from distill.models import DEFAULT_MODEL, distill_home

    folder = Path(folder).resolve()
    meta = dict(extra)
    if isinstance(extra.get("base_model"), dict):
        base = meta["base_model"] = dict(extra["base_model"])
        path = base.get("path")
        if path and os.path.isabs(path):
            bundled = Path(path).resolve() == (distill_home() / "models" / DEFAULT_MODEL).resolve()
            rel = None if bundled else _relative(Path(path), folder)  # the bundled model: found again by its id
            if rel is None:
                base.pop("path")
            else:
                base["path"] = rel
        if isinstance(base.get("id"), str) and os.path.isabs(base["id"]):
            base["id"] = Path(base["id"]).name  # its revision is the content hash
    if isinstance(extra.get("dataset"), dict):
        data = meta["dataset"] = dict(extra["dataset"])
        path = data.get("path")
        if isinstance(path, str) and os.path.isabs(path):
            rel = _relative(Path(path), folder)
            if rel is None:
                data.pop("path")
                data["name"] = Path(path).name
                manifest = Path(path) / "manifest.json"
                if manifest.is_file():  # it lists every shard's SHA-256: its own hash pins the data
                    data["manifest_sha256"] = sha256_file(manifest)
            else:
                data["path"] = rel
    if isinstance(extra.get("train_config"), dict):
        config = meta["train_config"] = dict(extra["train_config"])
        for key in CONFIG_PATHS:
            if _is_local(config.get(key)):
                target = Path(config[key]).resolve()
                config[key] = _relative(target, folder) or target.name
    return meta


def relocated_meta(meta: dict, source: Path, folder: Path) -> dict:
    """distill-heads.json's fields of heads in ``source`` as a copy of them in ``folder`` records them (``distill
    export``): its paths relative to ``source`` taken as they point and recorded again from ``folder``."""
    meta = json.loads(json.dumps(meta))
    for section in ("base_model", "dataset"):
        entry = meta.get(section)
        if isinstance(entry, dict) and isinstance(entry.get("path"), str) and "://" not in entry["path"]:
            entry["path"] = str((Path(source) / entry["path"]).resolve())
    return portable_meta(meta, folder)


def base_model_location(meta: dict, folder: Path) -> str | None:
    """What to pass to :func:`distill.models.resolve_model` for the base model the heads in ``folder`` record (None:
    they record none). A path relative to the folder, or an absolute one (folders written before paths were made
    relative), is taken where it exists; otherwise the id: the Hub id (the bundled model's too), or a local folder's
    name, which resolves only where a folder of that name is at hand: a clear error names it and asks for --model."""
    base = meta.get("base_model") or {}
    path = base.get("path")
    if path:
        where = os.path.normpath(Path(folder) / path)  # an absolute path stays itself
        if os.path.isdir(where):
            return where
    model_id = base.get("id")
    from distill.models import BUNDLED_HUB_ID, LOCAL_REVISIONS

    if model_id and str(base.get("revision") or "").startswith(LOCAL_REVISIONS) and not Path(model_id).is_dir():
        if model_id != BUNDLED_HUB_ID:
            raise ConfigError(f"{folder} was trained on the local model folder '{model_id}' (revision {base['revision']}), "
                              "which is not where its metadata says: pass --model with that folder")
    return model_id
