"""Writing files and folders so that a reader sees the old state or the complete new one.

Every writer in distill goes through these: a file is written to a temp file beside it,
fsynced and renamed (:func:`atomic_file`, :func:`atomic_write_bytes`); a folder is built in a hidden staging
folder beside its target and renamed into place when complete (:class:`StagedFolder`).
A crash leaves at most a hidden temp entry, never a half-written target.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def public_mode(path: Path, mode: int = 0o644) -> None:
    """Give a temp-created file (``mkstemp``: 0600) or folder (``mkdtemp``: 0700) the usual umask permissions."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, (0o755 if Path(path).is_dir() else mode) & ~umask)


@contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """A temp file beside ``path`` to write by name; fsynced and renamed to ``path`` on a normal exit.

    For writers that want a file name (``pq.write_table``, ``save_file``); on an
    exception the temp file is removed and ``path`` is left as it was.
    """
    path = Path(path)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        public_mode(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temp file in the same folder + fsync + os.replace."""
    with atomic_file(path) as tmp:
        tmp.write_bytes(data)


class StagedFolder:
    """A hidden folder beside ``target`` that becomes ``target`` in one rename.

    ``overwrite``: an existing ``target`` is removed at commit (checkpoints, the converted
    model); otherwise only an empty one may be there (outputs are never overwritten).
    As a context manager it commits on a normal exit and removes the staging folder on
    an exception::

        with StagedFolder(out) as stage:
            write_things(stage.path)
    """

    def __init__(self, target: Path, overwrite: bool = False, suffix: str = ".partial"):
        self.target = Path(target)
        self.overwrite = overwrite
        self.target.parent.mkdir(parents=True, exist_ok=True)
        self.path = Path(tempfile.mkdtemp(prefix=f".{self.target.name}.", suffix=suffix, dir=self.target.parent))

    def commit(self) -> Path:
        """Give the files the usual permissions and rename the staging folder to ``target``."""
        for p in [self.path, *self.path.rglob("*")]:
            public_mode(p)
        if self.target.exists():
            if self.overwrite:
                shutil.rmtree(self.target)
            else:
                self.target.rmdir()  # fails on a non-empty folder: nothing is overwritten
        os.replace(self.path, self.target)
        return self.target

    def abort(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def __enter__(self) -> "StagedFolder":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()
