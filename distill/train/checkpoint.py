"""Checkpoints without pickles: safetensors for tensors, JSON for everything else.

A checkpoint folder ``checkpoints/step-NNNNNN/`` holds

``trainable.safetensors``  every trainable parameter (heads, LoRA) by name
``optimizer.safetensors``  optimizer state tensors, keyed ``{param index}.{name}``
``rng.safetensors``        torch CPU (and CUDA) RNG states
``state.json``             step, data position, scheduler state, optimizer scalars and
                           param groups, python/numpy RNG states, the run config
``checksums.json``         the SHA-256 of each file above, written last

It is written to a hidden ``.step-NNNNNN.*.partial`` folder beside it and renamed into place, so
a crash never leaves a half checkpoint that counts; such a folder left by a kill during a save is
removed when the next run starts (:func:`remove_partials`). A checkpoint is read only when every
file matches its SHA-256 and every tensor is finite: a changed byte or a NaN is a one-line error
naming the file, never weights trained on.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from distill.errors import ConfigError
from distill.store.atomic import StagedFolder, sha256_file

CHECKPOINTS = "checkpoints"
CHECKSUMS = "checksums.json"
FILES = ("trainable.safetensors", "optimizer.safetensors", "rng.safetensors", "state.json")  # what CHECKSUMS covers


def _optimizer_to_files(sd: dict) -> tuple[dict[str, torch.Tensor], dict]:
    tensors, scalars = {}, {}
    for idx, st in sd["state"].items():
        for name, v in st.items():
            if torch.is_tensor(v):
                tensors[f"{idx}.{name}"] = v.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(idx), {})[name] = v
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _optimizer_from_files(tensors: dict[str, torch.Tensor], doc: dict) -> dict:
    state: dict[int, dict] = {}
    for key, v in tensors.items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = v
    for idx, st in doc["scalars"].items():
        state.setdefault(int(idx), {}).update(st)
    return {"state": state, "param_groups": doc["param_groups"]}


def rng_state() -> tuple[dict[str, torch.Tensor], dict]:
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = s
    py = random.getstate()
    np_state = np.random.get_state()
    doc = {"python": [py[0], list(py[1]), py[2]],
           "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])]}
    return tensors, doc


def set_rng_state(tensors: dict[str, torch.Tensor], doc: dict) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    cuda = [tensors[k] for k in sorted(k for k in tensors if k.startswith("torch_cuda_"))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    v, st, g = doc["python"]
    random.setstate((v, tuple(st), g))
    name, keys, pos, has_gauss, cached = doc["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


def save_checkpoint(out: Path, step: int, trainable: dict[str, torch.Tensor], optimizer_sd: dict, state: dict) -> Path:
    root = Path(out) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    with StagedFolder(final, overwrite=True) as stage:
        tmp = stage.path
        save_file({k: v.detach().cpu().contiguous() for k, v in trainable.items()}, str(tmp / "trainable.safetensors"))
        opt_tensors, opt_doc = _optimizer_to_files(optimizer_sd)
        save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
        rng_tensors, rng_doc = rng_state()
        save_file(rng_tensors, str(tmp / "rng.safetensors"))
        doc = {**state, "step": step, "optimizer": opt_doc, "rng": rng_doc}
        (tmp / "state.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
        sums = {name: sha256_file(tmp / name) for name in FILES}
        (tmp / CHECKSUMS).write_text(json.dumps({"sha256": sums}, indent=1) + "\n")
    return final


def checkpoints(out: Path) -> list[Path]:
    """Complete checkpoints of the run in ``out``, oldest first."""
    root = Path(out) / CHECKPOINTS
    return sorted(p for p in root.glob("step-*") if p.is_dir() and (p / "state.json").is_file()) if root.is_dir() else []


def latest_checkpoint(out: Path) -> Path | None:
    found = checkpoints(out)
    return found[-1] if found else None


def prune_checkpoints(out: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` checkpoints (0 keeps all); -> the deleted folders.

    Called after a new checkpoint is in place, so a crash here still leaves the
    newest one to resume from.
    """
    found = checkpoints(out)
    gone = found[:-keep] if keep > 0 else []
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    return gone


def remove_partials(out: Path) -> list[str]:
    """Remove the staging folders of checkpoint saves a kill interrupted (never a checkpoint) -> their names."""
    root = Path(out) / CHECKPOINTS
    if not root.is_dir():
        return []
    gone = sorted(p.name for p in root.glob(".step-*.partial") if p.is_dir() and not p.is_symlink())
    for name in gone:
        shutil.rmtree(root / name, ignore_errors=True)
    if gone:
        logging.getLogger("distill.train").warning("removed %d unfinished checkpoint save(s) left by an interrupted run in %s: %s",
                                                   len(gone), root, ", ".join(gone))
    return gone


def verify_checkpoint(path: Path) -> None:
    """Every file of the checkpoint ``path`` matches the SHA-256 written when it was saved, or a one-line error naming it."""
    path = Path(path)
    again = f"delete {path} to resume from an earlier checkpoint"
    try:
        sums = json.loads((path / CHECKSUMS).read_text())["sha256"]
    except FileNotFoundError:
        raise ConfigError(f"checkpoint {path} has no {CHECKSUMS} (saved by an older distill, or damaged): {again}") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"checkpoint {path}: {CHECKSUMS} is unreadable ({exc}): {again}") from None
    for name in FILES:
        file = path / name
        if not isinstance(sums, dict) or not isinstance(sums.get(name), str):
            raise ConfigError(f"checkpoint {path}: {CHECKSUMS} lists no SHA-256 for {name}: {again}")
        if not file.is_file() or file.is_symlink():
            raise ConfigError(f"checkpoint {path}: {name} is missing: {again}")
        if sha256_file(file) != sums[name]:
            raise ConfigError(f"checkpoint {file} does not match the SHA-256 written when it was saved (changed or damaged since): {again}")


def non_finite(tensors: dict[str, torch.Tensor]) -> str | None:
    """The name of the first floating-point tensor of ``tensors`` holding NaN or inf (None when all are finite)."""
    for name, t in tensors.items():
        if torch.is_tensor(t) and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return name
    return None


def load_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """-> (trainable tensors, optimizer state dict, state document); restores nothing by itself.

    Refused with a one-line error when a file differs from its SHA-256 or a weight or optimizer moment is not finite."""
    path = Path(path)
    verify_checkpoint(path)
    try:
        doc = json.loads((path / "state.json").read_text())
        trainable = load_file(str(path / "trainable.safetensors"))
        opt_tensors = load_file(str(path / "optimizer.safetensors"))
        opt = _optimizer_from_files(opt_tensors, doc["optimizer"])
        doc["rng_tensors"] = load_file(str(path / "rng.safetensors"))
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"checkpoint {path} is unreadable ({exc}); delete it to resume from an earlier one") from None
    for name, tensors in (("trainable.safetensors", trainable), ("optimizer.safetensors", opt_tensors)):
        bad = non_finite(tensors)
        if bad is not None:
            raise ConfigError(f"checkpoint {path / name}: {bad} holds non-finite values (NaN or inf): the run it saved had diverged; "
                              "delete the checkpoint to resume from an earlier one")
    return trainable, opt, doc
