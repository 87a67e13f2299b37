"""The one path from options to a stage's config dataclass.

Every stage command (generate, train-heads, calibrate, bench, serve) and every pipeline
stage builds its config the same way (:func:`stage_options` then :func:`config_from_options`):

1. the stage's section of ``--config FILE`` (a flat file is taken as that section);
2. ``--set KEY=VALUE`` items (the value read as YAML), in order;
3. the options given on the command line (never their defaults);

and an unknown key anywhere is a one-line error naming the stage. The config dataclass
holds every default (``--help`` shows them), so a command never restates one.
"""

from __future__ import annotations

from dataclasses import MISSING, fields
from pathlib import Path
from typing import Sequence, TypeVar

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


def stage_section(path: Path | None, stage: str) -> dict:
    """One stage's section of a pipeline YAML (a flat file is taken as that section); {} without a file."""
    if path is None:
        return {}
    data = read_yaml_mapping(path)
    section = data.get(stage, data)
    if not isinstance(section, dict):
        raise ConfigError(f"{path}: '{stage}' must be a mapping of options")
    return section


def parse_value(item: str, raw: str) -> object:
    """A ``--set`` value read as YAML (``2`` is an int, ``a,b`` a string, empty is None)."""
    import yaml

    try:
        return yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        raise ConfigError(f"--set {item}: the value is not valid YAML") from None


def parse_key_value(item: str) -> tuple[str, object]:
    """``KEY=VALUE`` -> (key with ``_`` for ``-``, value read as YAML)."""
    key, eq, raw = item.partition("=")
    if not eq or not key.strip():
        raise ConfigError(f"--set takes KEY=VALUE (e.g. max_len=256); got '{item}'")
    return key.strip().replace("-", "_"), parse_value(item, raw)


def stage_options(stage: str, config: Path | None, sets: Sequence[str] | None, given: dict) -> dict:
    """The file's section, then ``--set`` items, then the options given on the command line (paths as str)."""
    options = dict(stage_section(config, stage))
    options.update(parse_key_value(item) for item in sets or ())
    options.update({k: str(v) if isinstance(v, Path) else v for k, v in given.items()})
    return options


def defaults(cls: type) -> dict:
    """Every field's default value (fields without one, or with a factory, are left out)."""
    return {f.name: f.default for f in fields(cls) if f.default is not MISSING}


def check_lookup_options(heads: object, lookup_data: object, lookup_history: int | None, engine: str = "distill",
                         lookup: bool = False, lookup_nodes: int | None = None) -> None:
    """``--lookup-data`` / ``--lookup-history`` / ``--lookup-nodes`` / ``--lookup`` (``distill serve`` and ``distill bench``): the lookup
    proposer's own options; ``--lookup`` merges its trees with the heads' or drafter's (``--heads FOLDER``)."""
    if lookup:
        if heads is None or str(heads) == "lookup":
            raise ConfigError("--lookup merges the lookup proposer's trees with trained heads' or an EAGLE drafter's: "
                              "give their folder with --heads (or --heads lookup alone)")
        if engine == "vllm":
            raise ConfigError("--lookup is for --engine distill: vLLM drafts with one method at a time")
    for option, value in (("--lookup-data", lookup_data), ("--lookup-history", lookup_history), ("--lookup-nodes", lookup_nodes)):
        if value is None:
            continue
        if str(heads) != "lookup" and not lookup:
            raise ConfigError(f"{option} is the lookup proposer's option: it needs --heads lookup (or --lookup)")
        if engine == "vllm":
            raise ConfigError(f"{option} is for --engine distill: vLLM's ngram method drafts one chain from the context only "
                              "(--num-speculative-tokens sets its length)")
    if lookup_nodes is not None and lookup_nodes < 1:
        raise ConfigError(f"--lookup-nodes must be >= 1; got {lookup_nodes}")
    if lookup_history is not None and lookup_history < 0:
        raise ConfigError(f"--lookup-history must be >= 0 tokens; got {lookup_history}")
