"""Containers: where seed rows come from (JSONL, JSON, Parquet, ``datasets`` folders, the Hub).

Terms
-----
raw row
    one seed row before its format is applied (:class:`RawRow`): its position, the
    decoded value, and for a JSONL line that could not be decoded, the problem.
reader
    a small object whose :meth:`rows` opens the container afresh and yields every raw
    row in order, so a source can be iterated again with the same result. Readers
    check at construction that the container can be opened (a :class:`SeedError`
    otherwise) and stream where the container allows it.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Protocol

from distill.errors import SeedError
from distill.seeds.normalize import Problem

_BOM = b"\xef\xbb\xbf"
BATCH_ROWS = 512  # rows per Arrow record batch when reading Parquet


@dataclass(frozen=True)
class RawRow:
    """One seed row as read from its container.

    ``index`` is its 0-based position among the rows; ``line`` its 1-based line in a
    JSONL file; ``key`` its key in a JSON-object file (its seed id); ``problem`` says
    why it could not be decoded (then ``value`` is None).
    """

    index: int
    value: object = None
    line: int | None = None
    key: str | None = None
    problem: Problem | None = None


class Reader(Protocol):
    location: str

    def rows(self) -> Iterator[RawRow]: ...


class UnreadableSeed(SeedError):
    """A seed file that cannot be read at all (the registry adds the registered seeds to the message)."""


def _unreadable(path: Path, exc: BaseException) -> UnreadableSeed:
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return UnreadableSeed(f"cannot read seed file '{path}': {reason}")


def _check_readable(path: Path) -> None:
    """Fail early, with the reason, on a file that cannot even be opened."""
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise _unreadable(path, exc) from exc


#: A JSON Lines row longer than this is rejected (``row_too_large``) instead of parsed: no chat turn needs it.
MAX_ROW_BYTES = 16 << 20


# -- JSON Lines ---------------------------------------------------------------------------------
class JsonlReader:
    """A JSON Lines file: one row per non-blank line (blank lines are not rows), read line by line as bytes."""

    def __init__(self, path: Path):
        self.path, self.location = path, str(path)
        _check_readable(path)

    def rows(self) -> Iterator[RawRow]:
        try:
            f = open(self.path, "rb")
        except OSError as exc:
            raise _unreadable(self.path, exc) from exc
        with f:
            index = 0
            lines = enumerate(f, start=1)
            while True:
                try:
                    lineno, raw = next(lines)
                except StopIteration:
                    return
                except OSError as exc:  # a read error mid-file (bad disk, a special file)
                    raise _unreadable(self.path, exc) from exc
                if lineno == 1 and raw.startswith(_BOM):
                    raw = raw[len(_BOM):]
                if not raw.strip():
                    continue
                yield self._decode(raw.rstrip(b"\r\n"), index, lineno)
                index += 1

    @staticmethod
    def _decode(raw: bytes, index: int, lineno: int) -> RawRow:
        if len(raw) > MAX_ROW_BYTES:
            return RawRow(index, line=lineno, problem=Problem(
                "row_too_large", f"line {lineno} holds {len(raw):,} bytes (a row may hold {MAX_ROW_BYTES:,})"))
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            bad = raw[exc.start:exc.start + 1].hex()
            return RawRow(index, line=lineno, problem=Problem("invalid_utf8", f"line {lineno} is not valid UTF-8 (byte 0x{bad} at offset {exc.start})"))
        try:
            value = json.loads(text)
        except ValueError as exc:
            return RawRow(index, line=lineno, problem=Problem("malformed_json", f"line {lineno} is not valid JSON: {exc}"))
        except RecursionError:
            return RawRow(index, line=lineno, problem=Problem("malformed_json", f"line {lineno} nests JSON too deeply to parse"))
        return RawRow(index, value, line=lineno)


# -- one JSON document --------------------------------------------------------------------------
class JsonReader:
    """A JSON file holding a list of rows, or an object ``{seed id: row}``; loaded whole.

    Bytes that are not valid UTF-8 are decoded with ``surrogateescape``: the rows holding
    them carry lone surrogates and are rejected as ``invalid_utf8``, the others are kept.
    """

    def __init__(self, path: Path):
        self.path, self.location = path, str(path)
        _check_readable(path)

    def _load(self) -> list | dict:
        try:
            data = self.path.read_bytes()
        except OSError as exc:
            raise _unreadable(self.path, exc) from exc
        if data.startswith(_BOM):
            data = data[len(_BOM):]
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            text = data.decode("utf-8", "surrogateescape")
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            hint = " (it looks like JSON Lines: name it .jsonl)" if exc.msg == "Extra data" else ""
            raise SeedError(f"seed file '{self.path}' is not valid JSON: {exc}{hint}") from exc
        except RecursionError:
            raise SeedError(f"seed file '{self.path}' nests JSON deeper than Python's parser allows: "
                            "not a list of conversations") from None
        if not isinstance(doc, (list, dict)):
            raise SeedError(f"seed file '{self.path}' holds a JSON {type(doc).__name__}; expected a list of rows or an object of rows")
        return doc

    def rows(self) -> Iterator[RawRow]:
        doc = self._load()
        if isinstance(doc, list):
            for index, value in enumerate(doc):
                yield RawRow(index, value)
        else:
            for index, (key, value) in enumerate(doc.items()):
                yield RawRow(index, value, key=key)


# -- Parquet ------------------------------------------------------------------------------------
class ParquetReader:
    """A Parquet file, read in record batches of :data:`BATCH_ROWS` rows."""

    def __init__(self, path: Path):
        self.path = path
        self.location = str(path)
        self._open().close()

    def _open(self):
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(self.path)
        except (OSError, pa.ArrowException) as exc:
            raise _unreadable(self.path, exc) from exc

    def rows(self) -> Iterator[RawRow]:
        import pyarrow as pa

        pf = self._open()
        try:
            index = 0
            batches = pf.iter_batches(batch_size=BATCH_ROWS)
            while True:
                try:
                    batch = next(batches, None)
                except (OSError, pa.ArrowException) as exc:
                    raise _unreadable(self.path, exc) from exc
                if batch is None:
                    return
                for value in batch.to_pylist():
                    yield RawRow(index, value)
                    index += 1
        finally:
            pf.close()


# -- datasets ------------------------------------------------------------------------------------
def is_saved_dataset(path: Path) -> bool:
    """True for a folder written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``."""
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


class SavedDatasetReader:
    """A folder written by ``datasets.Dataset.save_to_disk`` (memory-mapped Arrow, read row by row)."""

    def __init__(self, path: Path):
        import datasets

        self.path = path
        self.location = str(path)
        try:
            ds = datasets.load_from_disk(str(path))
        except (OSError, ValueError) as exc:
            raise _unreadable(path, exc) from exc
        if isinstance(ds, datasets.DatasetDict):
            splits = ", ".join(ds)
            raise SeedError(f"'{path}' holds a DatasetDict (splits: {splits}); pass one split's folder, e.g. '{path / next(iter(ds))}'")
        self._ds = ds

    def rows(self) -> Iterator[RawRow]:
        for index, value in enumerate(self._ds):
            yield RawRow(index, value)


def _truthy_env(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def hub_endpoint() -> str:
    """The Hub address ``datasets`` talks to (``HF_ENDPOINT``, else huggingface.co)."""
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def _hub_unreachable(spec: str, why: object) -> SeedError:
    return SeedError(
        f"cannot load seed '{spec}': the Hugging Face Hub ({hub_endpoint()}) cannot be reached ({why}); "
        "pass a local file instead (.jsonl, .json, .parquet or a save_to_disk folder made where the Hub is reachable)"
    )


class HubReader:
    """A ``datasets`` dataset streamed with ``load_dataset(id, split=split, streaming=True)``.

    ``dataset_id`` is a Hub id or a local folder of data files. For a Hub id, one HTTP
    request first checks that the Hub answers at all (any HTTP status counts), so an
    unreachable Hub fails at once instead of after the client's retries.
    """

    def __init__(self, dataset_id: str, split: str, spec: str):
        self.dataset_id = dataset_id
        self.split = split
        self.spec = spec
        local = Path(dataset_id).expanduser()
        self.is_local = local.is_dir()
        if self.is_local:
            self.dataset_id = str(local.resolve())
        self.location = f"hf:{self.dataset_id}:{split}"
        self.offline = _truthy_env("HF_HUB_OFFLINE") or _truthy_env("HF_DATASETS_OFFLINE")
        if not self.is_local and not self.offline:
            self._check_hub()
        self._ds = self._load()

    def _check_hub(self) -> None:
        url = f"{hub_endpoint()}/api/datasets/{self.dataset_id}"
        try:
            with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=10):
                pass
        except urllib.error.HTTPError:
            return  # the Hub answered; load_dataset reports what it said
        except (OSError, ValueError) as exc:
            raise _hub_unreachable(self.spec, getattr(exc, "reason", exc)) from exc

    def _load(self):
        import datasets

        try:
            return datasets.load_dataset(self.dataset_id, split=self.split, streaming=True)
        except ConnectionError as exc:
            why = "offline mode is on: HF_HUB_OFFLINE / HF_DATASETS_OFFLINE" if self.offline else exc
            raise _hub_unreachable(self.spec, why) from exc
        except FileNotFoundError as exc:
            where = "folder" if self.is_local else "dataset on the Hub (or it needs `hf auth login`)"
            raise SeedError(f"cannot load seed '{self.spec}': no such {where}: {exc}") from exc
        except (OSError, ValueError) as exc:
            raise SeedError(f"cannot load seed '{self.spec}': {exc}") from exc

    def rows(self) -> Iterator[RawRow]:
        it = iter(self._ds)
        index = 0
        while True:
            try:
                value = next(it, None)
            except ConnectionError as exc:
                raise _hub_unreachable(self.spec, exc) from exc
            except (OSError, ValueError) as exc:
                raise SeedError(f"cannot read seed '{self.spec}' after {index} rows: {exc}") from exc
            if value is None:
                return
            yield RawRow(index, value)
            index += 1
