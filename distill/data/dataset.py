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
    shards made by ``distill data convert --to shards`` from seed data that has no
    teacher: ``meta.teacher`` is ``null`` and every row's ``teacher_ids`` and
    ``teacher_lp`` are empty lists (the shard schema is unchanged, with
    ``id_dtype`` uint16). :func:`distill.store.manifest_encoding` returns ``None`` for it; such
    data trains with hard targets only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from distill.errors import StoreError
from distill.store.shards import FORMAT, MANIFEST, REJECTS, load_manifest
from distill.store.teacher import TeacherEncoding, manifest_encoding

SPLITS = ("train", "eval")
BATCH_ROWS = 64  # rows per record batch when streaming (a shard's row group holds 256)


@dataclass
class Dataset:
    """One dataset folder opened for reading (the manifest is read once)."""

    root: Path
    manifest: dict

    @classmethod
    def open(cls, root: Path | str) -> "Dataset":
        root = Path(root)
        if not root.is_dir():
            raise StoreError(f"{root} is not a folder")
        try:
            manifest = load_manifest(root)
        except ValueError as exc:
            raise StoreError(f"{root / MANIFEST} is not valid JSON ({exc})") from None
        if manifest.get("format") != FORMAT:
            raise StoreError(f"{root} holds a '{manifest.get('format')}' dataset, not {FORMAT}")
        return cls(root, manifest)

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
    def files(self) -> list[Path]:
        return [self.root / s["file"] for s in self.manifest.get("shards", []) if s.get("file")]

    @property
    def rows(self) -> int:
        return sum(int(s.get("rows", 0)) for s in self.manifest.get("shards", []) if s.get("file"))

    def iter_batches(self, columns: list[str] | None = None, batch_rows: int = BATCH_ROWS) -> Iterator[pa.RecordBatch]:
        """Record batches of every listed shard in order (memory bounded by one batch)."""
        for path in self.files:
            if not path.is_file():
                raise StoreError(f"manifest lists {path.name} but it is missing from {self.root}; run `distill data validate {self.root}`")
            try:
                pf = pq.ParquetFile(path)
                yield from pf.iter_batches(batch_size=batch_rows, columns=columns)
            except (OSError, pa.ArrowException) as exc:
                raise StoreError(f"{path} cannot be read ({exc}); run `distill data validate {self.root}`") from None

    def iter_rows(self, columns: list[str] | None = None) -> Iterator[dict]:
        for batch in self.iter_batches(columns):
            yield from batch.to_pylist()

    def rejects(self) -> Iterator[dict]:
        """The rejected rows recorded beside the shards (``rejects.jsonl``), one dict per line."""
        path = self.root / REJECTS
        if not path.is_file():
            return
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield json.loads(line)
                    except ValueError:
                        raise StoreError(f"{path} line {n} is not valid JSON") from None


def split_folders(root: Path | str) -> dict[str, Path]:
    """``{"train": root}`` for a dataset folder, ``{"train": root/train, "eval": root/eval}`` for a split folder."""
    root = Path(root)
    if (root / MANIFEST).is_file():
        return {"train": root}
    found = {s: root / s for s in SPLITS if (root / s / MANIFEST).is_file()}
    if "train" not in found:
        raise StoreError(f"{root} has no {MANIFEST} and no train/{MANIFEST}: not a distill dataset or split folder")
    return found
