"""Where a dataset folder lives: a local folder, or a prefix in an object store.

``distill generate --out`` and every command that reads a dataset take a local path, a
``file://`` URL (the same local folder), or an object-store URL read and written through
fsspec: ``s3://bucket/prefix`` (s3fs, installed with distill) or ``gs://bucket/prefix``
(gcsfs: ``pip install gcsfs``). :func:`open_folder` turns any of them into a folder object
with the few operations the shard store and the readers need, so each of them is written
once:

:class:`LocalFolder`
    plain files: atomic writes are a temp file + fsync + ``os.replace``
    (:mod:`distill.store.atomic`), the lock is a ``flock`` (:class:`distill.store.lock.FolderLock`).
:class:`ObjectFolder`
    objects: there is no rename and no append, but one PUT is atomic (a reader sees the old
    object or the whole new one, never part of it; a multipart upload appears only when
    completed), listings and reads after a write are strongly consistent (S3 since 2020,
    GCS always), and "create only if absent" is a conditional PUT (S3 ``If-None-Match: *``,
    GCS ``ifGenerationMatch=0``; fsspec's ``mode="create"``). So a file is written whole
    to a local temp file and uploaded under its final name; the lock is
    :class:`distill.store.lock.ObjectLock`; the journal is one object per entry
    (:class:`distill.store.journal.SegmentJournal`).

Credentials and endpoints are the store client's own (for S3: ``AWS_PROFILE``,
``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL_S3`` for an
S3-compatible server such as MinIO; for GCS: ``GOOGLE_APPLICATION_CREDENTIALS``); distill
never reads or stores them.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Union

import pyarrow.parquet as pq

from distill.errors import DistillError, StoreError
from distill.store.atomic import atomic_file, atomic_write_bytes, sha256_file

#: Object stores ``--out`` and the readers accept: URL scheme -> the fsspec package that serves it.
OBJECT_STORES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs"}
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def url_scheme(target: object) -> str | None:
    """The scheme of a URL (``s3``, ``file``, ...); None for a plain path."""
    m = _SCHEME.match(target) if isinstance(target, str) else None
    return m.group(1).lower() if m else None


def is_remote(target: object) -> bool:
    """Whether ``target`` names an object store (a URL other than ``file://``)."""
    return url_scheme(target) not in (None, "file")


def recorded_location(target: Path | str) -> str:
    """How a dataset is named in records: an absolute local path, or the URL as given."""
    return target.rstrip("/") if is_remote(target) else str(_local_path(target).resolve())


def _local_path(target: Path | str) -> Path:
    if url_scheme(target) == "file":
        from urllib.parse import unquote, urlparse

        url = urlparse(str(target))
        if url.netloc not in ("", "localhost"):
            raise StoreError(f"{target}: a file:// URL names this machine's files (file:///abs/path), not host {url.netloc!r}")
        return Path(unquote(url.path))
    return Path(target)


def open_folder(target: "Folder | Path | str") -> "Folder":
    """The folder ``target`` names (a folder object is returned as it is)."""
    if isinstance(target, (LocalFolder, ObjectFolder)):
        return target
    scheme = url_scheme(target)
    if scheme is None or scheme == "file":
        return LocalFolder(_local_path(target))
    supported = "a local folder, file:///PATH, s3://BUCKET/PREFIX or gs://BUCKET/PREFIX"
    if scheme not in OBJECT_STORES:
        raise StoreError(f"{target}: {scheme}:// is not a supported dataset location; use {supported}")
    import fsspec

    try:
        # No listing cache: another process (a resumed run, a reader) may have changed the prefix since.
        fs, base = fsspec.core.url_to_fs(target, use_listings_cache=False)
    except ImportError:
        package = OBJECT_STORES[scheme]
        raise StoreError(f"{target}: {scheme}:// needs the {package} package (pip install {package})") from None
    return ObjectFolder(target, fs, base)


class LocalFolder:
    """A dataset folder on this machine's file system."""

    remote = False

    def __init__(self, root: Path):
        self.root = Path(root)

    def __str__(self) -> str:
        return str(self.root)

    def where(self, name: str) -> Path:
        """The file ``name`` as a user (or another library) names it."""
        return self.root / name

    def child(self, name: str) -> "LocalFolder":
        return LocalFolder(self.root / name)

    def is_dir(self) -> bool:
        return self.root.is_dir()

    def is_file(self, name: str) -> bool:
        return (self.root / name).is_file()

    def size(self, name: str) -> int:
        return (self.root / name).stat().st_size

    def list(self, pattern: str) -> list[str]:
        """Names of the entries that match ``pattern`` (a glob), sorted."""
        return sorted(p.name for p in self.root.glob(pattern)) if self.root.is_dir() else []

    def read_bytes(self, name: str) -> bytes:
        return (self.root / name).read_bytes()

    def open(self, name: str) -> IO[bytes]:
        return open(self.root / name, "rb")

    def write_bytes(self, name: str, data: bytes) -> None:
        atomic_write_bytes(self.root / name, data)

    @contextmanager
    def new_file(self, name: str) -> Iterator[Path]:
        """A local temp file to write by name; it becomes ``name`` whole on a normal exit (nothing on an exception)."""
        with atomic_file(self.root / name) as tmp:
            yield tmp

    def remove(self, name: str) -> None:
        (self.root / name).unlink(missing_ok=True)

    def rename(self, src: str, dst: str) -> None:
        os.replace(self.root / src, self.root / dst)

    def sha256(self, name: str) -> str:
        return sha256_file(self.root / name)

    def parquet(self, name: str) -> pq.ParquetFile:
        return pq.ParquetFile(self.root / name)

    def read_table(self, name: str, columns: list[str] | None = None):
        return pq.read_table(self.root / name, columns=columns)

    def download(self, name: str, dest: Path) -> None:
        import shutil

        shutil.copyfile(self.root / name, dest)

    def lock(self):
        from distill.store.lock import FolderLock

        return FolderLock(self.root)


class ObjectFolder:
    """A prefix in an object store, through an fsspec file system (see the module docstring).

    ``root`` is the URL (what messages name); ``base`` the path the file system takes.
    Failures of the store itself (no credentials, no bucket, refused access, unreachable)
    become a one-line :class:`StoreError` naming the URL; a missing object stays
    ``FileNotFoundError`` and an existing one (a conditional create) ``FileExistsError``.
    """

    remote = True

    def __init__(self, url: str, fs, base: str):
        self.root = url.rstrip("/")
        self.fs = fs
        self.base = base.rstrip("/")

    def __str__(self) -> str:
        return self.root

    def where(self, name: str) -> str:
        return f"{self.root}/{name}"

    def child(self, name: str) -> "ObjectFolder":
        return ObjectFolder(self.where(name), self.fs, self._key(name))

    def _key(self, name: str) -> str:
        return f"{self.base}/{name}"

    @contextmanager
    def _store(self, what: str, write: bool = False) -> Iterator[None]:
        try:
            yield
        except FileNotFoundError as exc:
            if write:  # nothing is missing when an object is written but its bucket
                raise StoreError(f"{self.root}: {what} failed ({exc}): create the bucket first") from None
            raise
        except (FileExistsError, DistillError):
            raise
        except Exception as exc:  # noqa: BLE001 - credentials, permissions, network: one line naming the store
            detail = (str(exc).strip().splitlines() or [""])[0]
            raise StoreError(f"{self.root}: {what} failed ({type(exc).__name__}: {detail})") from exc

    def is_dir(self) -> bool:
        """Always true: a prefix needs no creating (whether a dataset is there is the manifest's business)."""
        return True

    def is_file(self, name: str) -> bool:
        with self._store(f"looking up {name}"):
            return self.fs.isfile(self._key(name))

    def size(self, name: str) -> int:
        with self._store(f"looking up {name}"):
            return int(self.fs.size(self._key(name)))

    def list(self, pattern: str) -> list[str]:
        with self._store("listing"):
            try:
                keys = self.fs.ls(self.base, detail=False)
            except FileNotFoundError:
                return []
        names = (k.rstrip("/").rsplit("/", 1)[-1] for k in keys)
        return sorted(n for n in names if fnmatch.fnmatchcase(n, pattern))

    def read_bytes(self, name: str) -> bytes:
        with self._store(f"reading {name}"):
            return self.fs.cat_file(self._key(name))

    def open(self, name: str) -> IO[bytes]:
        with self._store(f"reading {name}"):
            return self.fs.open(self._key(name), "rb")

    def write_bytes(self, name: str, data: bytes) -> None:
        """One PUT: readers see the old object or this one whole."""
        with self._store(f"writing {name}", write=True):
            self.fs.pipe_file(self._key(name), data)

    def create(self, name: str, data: bytes) -> None:
        """One conditional PUT that creates ``name`` only if it is absent (``FileExistsError`` otherwise)."""
        with self._store(f"creating {name}", write=True):
            self.fs.pipe_file(self._key(name), data, mode="create")

    @contextmanager
    def new_file(self, name: str) -> Iterator[Path]:
        """A local temp file to write by name, uploaded as the new object ``name`` on a normal exit.

        The upload is atomic and conditional (create only if absent): an object is never replaced,
        so two writers that picked one name (only possible when the lock was broken) cannot
        overwrite each other's shard; the second gets a :class:`StoreError`.
        """
        fd, tmp = tempfile.mkstemp(prefix=f".distill-{name}.", suffix=".tmp")
        os.close(fd)
        try:
            yield Path(tmp)
            with self._store(f"uploading {name}", write=True):
                try:
                    self.fs.put_file(tmp, self._key(name), mode="create")
                except FileExistsError:
                    raise StoreError(f"{self.where(name)} exists already: another run writes {self.root} "
                                     "(one writer per --out)") from None
        finally:
            Path(tmp).unlink(missing_ok=True)

    def remove(self, name: str) -> None:
        with self._store(f"removing {name}"):
            try:
                self.fs.rm_file(self._key(name))
            except FileNotFoundError:
                pass

    def rename(self, src: str, dst: str) -> None:
        """Copy, then delete (no rename in an object store: a crash in between leaves both, never neither)."""
        with self._store(f"moving {src} to {dst}"):
            self.fs.copy(self._key(src), self._key(dst))
            self.fs.rm_file(self._key(src))

    def sha256(self, name: str) -> str:
        with self._store(f"reading {name}"), self.fs.open(self._key(name), "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()

    def parquet(self, name: str) -> pq.ParquetFile:
        with self._store(f"reading {name}"):
            return pq.ParquetFile(self._key(name), filesystem=self.fs)

    def read_table(self, name: str, columns: list[str] | None = None):
        with self._store(f"reading {name}"):
            return pq.read_table(self._key(name), columns=columns, filesystem=self.fs)

    def download(self, name: str, dest: Path) -> None:
        with self._store(f"downloading {name}"):
            self.fs.get_file(self._key(name), str(dest))

    def lock(self):
        from distill.store.lock import ObjectLock

        return ObjectLock(self)


Folder = Union[LocalFolder, ObjectFolder]


def json_bytes(doc, indent: int | None = 2) -> bytes:
    """``doc`` as JSON text with a final newline, as :func:`write_json` writes it."""
    return (json.dumps(doc, indent=indent, default=str) + "\n").encode("utf-8")


def write_json(folder: Folder, name: str, doc, indent: int | None = 2) -> None:
    """``doc`` as JSON text with a final newline (as :func:`distill.store.atomic.atomic_write_json`), written atomically."""
    folder.write_bytes(name, json_bytes(doc, indent))
