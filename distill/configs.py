"""Building a stage's config dataclass from options (a pipeline section merged with CLI flags)."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import TypeVar

from distill.errors import ConfigError

C = TypeVar("C")


def config_from_options(cls: type[C], data: dict, stage: str) -> C:
    """``cls(**data)`` with ``-`` in keys read as ``_``; an unknown key is a one-line error naming the stage."""
    known = {f.name for f in fields(cls)}
    data = {k.replace("-", "_"): v for k, v in data.items()}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown {stage} option(s): {', '.join(unknown)}")
    return cls(**data)


def read_yaml_mapping(path: Path) -> dict:
    """A pipeline file's top-level mapping; a missing file, bad YAML or a non-mapping is a one-line error."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"pipeline file {path} not found")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of options (one section per stage)")
    return data
