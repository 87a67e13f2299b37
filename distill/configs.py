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

import re
from dataclasses import MISSING, fields
from pathlib import Path, PurePath
from types import UnionType
from typing import Any, Literal, Sequence, TypeVar, Union, get_args, get_origin, get_type_hints

from distill.errors import ConfigError

C = TypeVar("C")


def config_from_options(cls: type[C], data: dict, stage: str) -> C:
    """``cls(**data)`` (``cls.from_options(**data)`` where the config nests another) with ``-`` in keys read as ``_``;
    an unknown key or a value of the wrong type (:func:`check_types`) is a one-line error naming the stage."""
    known = option_hints(cls)
    data = {k.replace("-", "_"): v for k, v in data.items()}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(f"unknown {stage} option(s): {', '.join(unknown)}")
    build = getattr(cls, "from_options", cls)
    return build(**check_types(cls, data, stage))


# -- configs that nest another -----------------------------------------------------------------------
# ServeConfig and BenchConfig hold an EngineConfig (their field ``decoding``) instead of copies of its fields, while
# their options stay flat (``--tree``, ``tree: ...``). Such a config says which keys are its options
# (``option_hints()``: key -> annotation), their defaults (``option_defaults()``, for --help), and builds itself from
# them (``from_options(**options)``): the one place where flat keys meet the nested config.
def option_hints(cls: type) -> dict[str, object]:
    """A stage's option keys and their annotations: the config's fields, or its ``option_hints()`` where it has one
    (an annotation that cannot be resolved is ``Any``: left to the config's own checks)."""
    own = getattr(cls, "option_hints", None)
    if own is not None:
        return own()
    hints = _hints(cls)
    return {f.name: hints.get(f.name, Any) for f in fields(cls)}


def nested_hints(cls: type, nested: str, keys: Sequence[str], leave_out: Sequence[str] = ()) -> dict[str, object]:
    """The flat option keys of ``cls``, whose field ``nested`` holds another dataclass: ``cls``'s other fields (less
    ``leave_out``) and the nested config's fields named in ``keys``."""
    hints = _hints(cls)
    inner = _hints(hints[nested])
    own = {f.name: hints.get(f.name, Any) for f in fields(cls) if f.name != nested and f.name not in leave_out}
    return own | {k: inner[k] for k in keys}


# -- the type check of option values ---------------------------------------------------------------
# A file's and a --set's values are YAML: ``steps: many`` is a string, and the configs' own checks
# (``self.steps < 0``) would end in a TypeError. Each value is checked against its field's annotation
# first. Values change only where the reading is lossless and has one meaning: an int stands for a float;
# a number YAML 1.1 leaves as text (``3e-3``: no dot) is that float; a list field takes a list, the
# comma-separated text the command line gives (``greedy,typical``) or one item; a mapping field takes a
# mapping or its JSON text (the command line's form, which the config parses).
_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
_INTEGER = re.compile(r"[-+]?\d+")


class _Mismatch(Exception):
    """A value that its annotation does not admit (turned into a ConfigError naming the field)."""


def check_types(cls: type, data: dict, stage: str) -> dict:
    """``data`` (keys that are fields of the dataclass ``cls``) with each value checked against its field's annotation,
    and read as described above; a mismatch is ``ConfigError("<stage> option <field>: expected <type>, got <value>")``."""
    hints = option_hints(cls)
    out = {}
    for key, value in data.items():
        hint = hints.get(key)
        if hint is None:
            out[key] = value
            continue
        try:
            out[key] = _admit(value, hint)
        except _Mismatch:
            raise ConfigError(f"{stage} option {key}: expected {_describe(hint)}, got {value!r}") from None
    return out


def _hints(cls: type) -> dict:
    """The dataclass's field annotations resolved (configs write them as strings: ``from __future__ import annotations``)."""
    try:
        return get_type_hints(cls)
    except Exception:  # noqa: BLE001 - an annotation that cannot be resolved here is left unchecked, never guessed
        return {}


def _admit(value: object, hint: object) -> object:
    """``value`` as the annotation ``hint`` admits it (see above), or :class:`_Mismatch`."""
    origin, args = get_origin(hint), get_args(hint)
    if hint is Any or isinstance(hint, TypeVar):
        return value
    if origin in (Union, UnionType):
        if value is None and type(None) in args:
            return None
        for alt in args:  # the first alternative that admits it, exact types first (``str | int`` keeps an int an int)
            if alt is not type(None) and _exact(value, alt):
                return value
        for alt in args:
            if alt is not type(None):
                try:
                    return _admit(value, alt)
                except _Mismatch:
                    pass
        raise _Mismatch
    if origin is Literal:
        if any(value == a and type(value) is type(a) for a in args):
            return value
        raise _Mismatch
    if origin in (tuple, list) or hint in (tuple, list):
        return _admit_sequence(value, origin or hint, args)
    if origin is dict or hint is dict:
        if isinstance(value, (dict, str)):  # a mapping, or its JSON text (the config reads it)
            return value
        raise _Mismatch
    if hint is type(None):
        if value is None:
            return None
        raise _Mismatch
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise _Mismatch
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _Mismatch
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
            return float(value)
        raise _Mismatch
    if hint is str:
        if isinstance(value, str):
            return value
        raise _Mismatch
    if isinstance(hint, type) and issubclass(hint, PurePath):
        if isinstance(value, (str, PurePath)):
            return value
        raise _Mismatch
    return value  # an annotation this check does not know: the config's own checks decide


def _exact(value: object, hint: object) -> bool:
    """Whether ``value`` is of the plain type ``hint`` as it stands (bool is not an int here)."""
    if not isinstance(hint, type) or get_origin(hint) is not None:
        return False
    if hint in (int, float) and isinstance(value, bool):
        return False
    return isinstance(value, hint)


def _admit_sequence(value: object, kind: type, args: tuple) -> object:
    """A tuple / list field: a list or tuple, comma-separated text, or one item; each item checked (-> ``kind``)."""
    homogeneous = len(args) == 2 and args[1] is Ellipsis or kind is list and len(args) == 1
    item = args[0] if homogeneous else None
    if isinstance(value, str):
        items = [_from_text(part.strip(), item) for part in value.split(",") if part.strip()]
    elif isinstance(value, (list, tuple)):
        items = list(value)
    elif homogeneous:  # one item for a list of them (``sweep_nodes: 8``)
        items = [value]
    else:
        raise _Mismatch
    if homogeneous:
        items = [_admit(x, item) for x in items]
    elif args:
        if len(items) != len(args):
            raise _Mismatch
        items = [_admit(x, a) for x, a in zip(items, args)]
    return kind(items)


def _from_text(text: str, hint: object) -> object:
    """One item of comma-separated text as the item type reads it (an int from ``16``); other text stays text."""
    if hint is int and _INTEGER.fullmatch(text):
        return int(text)
    if hint is float and _NUMBER.fullmatch(text):
        return float(text)
    return text


def _describe(hint: object) -> str:
    """An annotation in words for the error message: ``int``, ``float or null``, ``list of int``."""
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, UnionType):
        words = [_describe(a) for a in args if a is not type(None)]
        return " or ".join(words + (["null"] if type(None) in args else []))
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (tuple, list) or hint in (tuple, list):
        homogeneous = len(args) == 2 and args[1] is Ellipsis or origin is list and len(args) == 1
        if homogeneous:
            return f"a list of {_describe(args[0])} (or comma-separated text)"
        return f"a list of {', '.join(_describe(a) for a in args)}" if args else "a list"
    if origin is dict or hint is dict:
        return "a mapping (or its JSON text)"
    if isinstance(hint, type) and issubclass(hint, PurePath):
        return "a path"
    return getattr(hint, "__name__", str(hint))


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
    """Every option's default value: the config's ``option_defaults()`` where it nests another, else every field's
    (fields without one, or with a factory, are left out)."""
    own = getattr(cls, "option_defaults", None)
    if own is not None:
        return own()
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
