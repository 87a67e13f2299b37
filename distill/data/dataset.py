"""Reading a shard folder for the dataset tools: manifest, teacher encoding, streamed batches.

Terms
-----
dataset folder
    a folder written by :class:`distill.store.ShardStore`: ``manifest.json``,
    ``shard-*.parquet``, ``rejects.jsonl`` (see ``distill/store/shards.py``).
split folder
    a folder holding ``train/`` (and optionally ``eval/``) dataset folders, as
    written by ``distill data split``. ``distill push`` uploads each as a split.
teacher-less dataset
    shards made by ``distill data convert --format shards`` from seed data that has no
    teacher: ``meta.teacher`` is ``null`` and every row's ``teacher_ids`` and
    ``teacher_lp`` are empty lists (the shard schema is unchanged, with
    ``id_dtype`` uint16). :func:`distill.store.manifest_encoding` returns ``None`` for it; such
    data trains with hard targets only.
location
    a dataset folder is a local path, a ``file://`` URL, or an object-store URL
    (``s3://``, ``gs://``): :func:`distill.store.location.open_folder`. Every reader here
    streams from any of them; the writers (merge, dedupe, split, convert) write local folders.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pyarrow as pa

from distill.errors import StoreError
from distill.store.location import Folder, open_folder
from distill.store.shards import FORMAT, MANIFEST, REJECTS, load_manifest
from distill.store.teacher import TeacherEncoding, manifest_encoding

SPLITS = ("train", "eval")
BATCH_ROWS = 64  # rows per record batch when streaming (a shard's row group holds 256)


@dataclass
class Dataset:
    """One dataset folder opened for reading (the manifest is read once).

    ``root``: a local folder's Path, or the URL of an object-store prefix.
    """

    root: Path | str
    manifest: dict
    folder: Folder = field(repr=False, default=None)

    def __post_init__(self) -> None:
        if self.folder is None:
            self.folder = open_folder(self.root)

    @classmethod
    def open(cls, root: Path | str) -> "Dataset":
        folder = open_folder(root)
        if not folder.is_dir():
            raise StoreError(f"{folder} is not a folder")
        try:
            manifest = load_manifest(folder)
        except ValueError as exc:
            raise StoreError(f"{folder.where(MANIFEST)} is not valid JSON ({exc})") from None
        if manifest.get("format") != FORMAT:
            raise StoreError(f"{folder} holds a '{manifest.get('format')}' dataset, not {FORMAT}")
        return cls(folder.root, manifest, folder)

    @property
    def meta(self) -> dict:
        return self.manifest.get("meta") or {}

    @property
    def encoding(self) -> TeacherEncoding | None:
        return manifest_encoding(self.meta)

    @property
    def id_dtype(self) -> str:
        enc = self.encoding
        return enc.id_dtype if enc else "uint16"

    @property
    def shards(self) -> list[str]:
        """The listed shard files' names, in order."""
        return [s["file"] for s in self.manifest.get("shards", []) if s.get("file")]

    @property
    def files(self) -> list[Path | str]:
        """The listed shard files as other libraries open them: local paths, or URLs."""
        return [self.folder.where(name) for name in self.shards]

    def shard_bytes(self) -> int:
        return sum(self.folder.size(name) for name in self.shards)

    @property
    def rows(self) -> int:
        return sum(int(s.get("rows", 0)) for s in self.manifest.get("shards", []) if s.get("file"))

    def iter_batches(self, columns: list[str] | None = None, batch_rows: int = BATCH_ROWS) -> Iterator[pa.RecordBatch]:
        """Record batches of every listed shard in order (memory bounded by one batch)."""
        for name in self.shards:
            if not self.folder.is_file(name):
                raise StoreError(f"manifest lists {name} but it is missing from {self.root}; run `distill data validate {self.root}`")
            try:
                pf = self.folder.parquet(name)
                yield from pf.iter_batches(batch_size=batch_rows, columns=columns)
            except (OSError, pa.ArrowException) as exc:
                raise StoreError(f"{self.folder.where(name)} cannot be read ({exc}); run `distill data validate {self.root}`") from None

    def shard_batches(self, name: str, columns: list[str] | None = None, batch_rows: int = BATCH_ROWS) -> Iterator[pa.RecordBatch]:
        """Record batches of one listed shard."""
        yield from self.folder.parquet(name).iter_batches(batch_size=batch_rows, columns=columns)

    def iter_rows(self, columns: list[str] | None = None) -> Iterator[dict]:
        for batch in self.iter_batches(columns):
            yield from batch.to_pylist()

    def rejects(self) -> Iterator[dict]:
        """The rejected rows recorded beside the shards (``rejects.jsonl``), one dict per line."""
        if not self.folder.is_file(REJECTS):
            return
        with self.folder.open(REJECTS) as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield json.loads(line)
                    except ValueError:
                        raise StoreError(f"{self.folder.where(REJECTS)} line {n} is not valid JSON") from None


def split_folders(root: Path | str) -> dict[str, Path | str]:
    """``{"train": root}`` for a dataset folder, ``{"train": root/train, "eval": root/eval}`` for a split folder
    (local paths, or URLs for an object-store prefix)."""
    folder = open_folder(root)
    if folder.is_file(MANIFEST):
        return {"train": folder.root}
    found = {s: folder.child(s).root for s in SPLITS if folder.child(s).is_file(MANIFEST)}
    if "train" not in found:
        raise StoreError(f"{folder} has no {MANIFEST} and no train/{MANIFEST}: not a distill dataset or split folder")
    return found


def local_copy(root: Path | str, dest: Path) -> Path:
    """A dataset or split folder in an object store copied into the empty local folder ``dest``
    (the manifest, rejects.jsonl and the listed shards: what a finished run committed) -> ``dest``."""
    folder = open_folder(root)
    for split, where in split_folders(folder).items():
        ds = Dataset.open(where)
        target = dest if where == folder.root else dest / split
        target.mkdir(parents=True, exist_ok=True)
        for name in [MANIFEST, *([REJECTS] if ds.folder.is_file(REJECTS) else []), *ds.shards]:
            ds.folder.download(name, target / name)
    return dest
