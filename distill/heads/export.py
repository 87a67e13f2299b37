"""``distill export``: write trained heads in other layouts.

Formats
-------
``vllm``
    a clean copy of the vLLM Medusa folder (``config.json`` + ``model.safetensors``)
    plus our side files (``distill-heads.json``, its paths recorded again from the copy, ``tree.json``,
    ``calibration.json``).
``medusa-repo``
    the layout of the FasterDecoding/Medusa repository: ``config.json`` with
    ``medusa_num_heads``, ``medusa_num_layers`` and ``base_model_name_or_path``, and
    ``medusa_lm_head.safetensors`` whose head h is a ``Sequential`` of L residual
    blocks and an output layer: keys ``{h}.{l}.linear.weight|bias`` and
    ``{h}.{L}.weight``. A shared LM head is written out once per head (that layout
    has no sharing).
``vllm-eagle3``
    a clean copy of an EAGLE-3 drafter folder in vLLM's ``llama_eagle3`` layout
    (``config.json`` + ``model.safetensors`` with ``fc``, ``midlayer.*``, ``norm``,
    ``lm_head``, ``d2t``, ``t2d``), loaded and re-written so a bad folder fails here,
    plus our side files (``distill-heads.json``, ``draft-vocab.json``, ...).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from distill.errors import ConfigError, check_choice
from distill.heads.eagle import EagleDrafter, is_eagle3_folder
from distill.heads.model import DISTILL_HEADS_FILE, MedusaHeads, read_distill_meta, relocated_meta
from distill.store.atomic import StagedFolder

FORMATS = ("vllm", "medusa-repo", "vllm-eagle3")
SIDE_FILES = (DISTILL_HEADS_FILE, "tree.json", "calibration.json", "tree.png", "acceptance.png", "metrics.jsonl", "draft-vocab.json")


def medusa_repo_state_dict(heads: MedusaHeads) -> dict:
    sd = {}
    L = heads.config.num_layers
    for h, block in enumerate(heads.blocks):
        for l, layer in enumerate(block.layers):
            sd[f"{h}.{l}.linear.weight"] = layer.weight
            if layer.bias is not None:
                sd[f"{h}.{l}.linear.bias"] = layer.bias
        sd[f"{h}.{L}.weight"] = heads.lm_head(h).weight
    return {k: v.detach().contiguous().clone() for k, v in sd.items()}


def export_heads(heads_dir: Path, out: Path, fmt: str = "medusa-repo", base_model: str | None = None) -> Path:
    """Write ``heads_dir`` (Medusa heads or an EAGLE-3 drafter) to ``out`` in ``fmt`` (atomically: a temp folder renamed into place)."""
    from safetensors.torch import save_file

    check_choice("--format", fmt, FORMATS)
    heads_dir, out = Path(heads_dir), Path(out)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out} exists and is not empty: choose a new --out")
    eagle = is_eagle3_folder(heads_dir)
    if eagle != (fmt == "vllm-eagle3"):
        raise ConfigError(f"{heads_dir} holds {'an EAGLE-3 drafter' if eagle else 'Medusa heads'}: "
                          + ("use --format vllm-eagle3" if eagle else f"--format {fmt} is for EAGLE-3 drafters (use vllm or medusa-repo)"))
    heads = EagleDrafter.load(heads_dir) if eagle else MedusaHeads.load(heads_dir)
    meta = read_distill_meta(heads_dir)
    with StagedFolder(out) as stage:
        tmp = stage.path
        if fmt in ("vllm", "vllm-eagle3"):
            heads.write_files(tmp)
        else:
            base = base_model or meta.get("base_model", {}).get("id")
            if not base:
                raise ConfigError(f"{heads_dir} does not record its base model: pass --base-model")
            save_file(medusa_repo_state_dict(heads), str(tmp / "medusa_lm_head.safetensors"))
            conf = {"medusa_num_heads": heads.config.num_heads, "medusa_num_layers": heads.config.num_layers,
                    "base_model_name_or_path": base, "hidden_size": heads.config.hidden_size,
                    "vocab_size": heads.config.vocab_size}
            (tmp / "config.json").write_text(json.dumps(conf, indent=2) + "\n")
        for name in SIDE_FILES:
            if name == DISTILL_HEADS_FILE and meta:  # its paths are relative to the heads folder: recorded again from out
                (tmp / name).write_text(json.dumps(relocated_meta(meta, heads_dir, out), indent=2, default=str) + "\n")
            elif (heads_dir / name).is_file():
                shutil.copy2(heads_dir / name, tmp / name)
    return out
