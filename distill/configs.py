"""Building a stage's config dataclass from options (a pipeline section merged with CLI flags)."""

from __future__ import annotations

from dataclasses import fields
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
