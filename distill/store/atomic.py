"""Writing files and folders so that a reader sees the old state or the complete new one.

Every writer in distill goes through these:

* one file: written to a temp file beside it, fsynced and renamed (:func:`atomic_file`,
  :func:`atomic_write_bytes`, :func:`atomic_write_json`);
* a new folder: built in a hidden staging folder beside its target and renamed into place
  when complete (:class:`StagedFolder`);
* a set of files inside a folder that holds other things too (a heads folder beside its
  training checkpoints): built in a hidden staging folder inside it and moved in as one set
  (:class:`StagedFiles`), its marker files removed first and moved in last, with a
  :data:`COMMIT_INCOMPLETE` file in the folder while the set is moved in.

A crash leaves at most a hidden temp entry, never a half-written target; a crash while a
file set is moved in leaves :data:`COMMIT_INCOMPLETE` behind, and a reader that checks
:func:`commit_incomplete` refuses that folder rather than read a mix of two writes.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from distill.errors import DistillError, StoreError


#: Present in a folder while :meth:`StagedFiles.commit` moves a set of files into it; left behind by a crash there.
COMMIT_INCOMPLETE = ".commit-incomplete"


def public_mode(path: Path, mode: int = 0o644) -> None:
    """Give a temp-created file (``mkstemp``: 0600) or folder (``mkdtemp``: 0700) the usual umask permissions."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, (0o755 if Path(path).is_dir() else mode) & ~umask)


#: What an OSError of these numbers says about the disk or the folder: a condition of the machine, not a bug, so it
#: is said in one line (:func:`write_errors`), never as a traceback.
CANNOT_WRITE = {
    errno.ENOSPC: ("no space left on the device", "free some space and run the same command again to go on from there"),
    errno.EDQUOT: ("the disk quota is exceeded", "free some space and run the same command again to go on from there"),
    errno.EROFS: ("the file system is read-only", "use a writable folder (or remount it read-write)"),
    errno.EACCES: ("permission denied", "the folder must be writable by this user"),
    errno.EPERM: ("operation not permitted", "the folder must be writable by this user"),
}


def cannot_write(exc: BaseException) -> tuple[str, str] | None:
    """(what is wrong, what to do) for an OSError that says the disk is full or the folder cannot be written
    (:data:`CANNOT_WRITE`); None for any other error, distill's own included."""
    if isinstance(exc, OSError) and not isinstance(exc, DistillError):
        return CANNOT_WRITE.get(exc.errno)
    return None


@contextmanager
def write_errors(where: object, doing: str) -> Iterator[None]:
    """Turn a full disk or a folder that cannot be written (:func:`cannot_write`) inside the block into a one-line
    :class:`StoreError`: ``WHERE: WHAT while DOING; what was written before is kept: ADVICE``. Every write distill
    makes is atomic or appended and fsynced, so what an earlier step committed is never touched by the failed one;
    other errors pass unchanged."""
    try:
        yield
    except OSError as exc:
        found = cannot_write(exc)
        if found is None:
            raise
        what, advice = found
        raise StoreError(f"{where}: {what} while {doing}; what was written before is kept: {advice}") from exc


def open_no_follow(path: Path, flags: int, mode: int = 0o644) -> int:
    """``os.open(path, flags | O_NOFOLLOW)``: a file distill opens in place (a lock, a journal, a marker) is never
    reached through a symlink, which could point anywhere (writing through it would truncate or overwrite the
    target); a symlink there is a one-line StoreError naming it."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW, mode)
    except OSError as exc:
        if os.path.islink(path):
            raise StoreError(f"{path} is a symbolic link; distill does not write through links: remove it "
                             "(or move the folder aside) and run again") from None
        raise


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
        fsync_dir(path.parent)  # the new name is durable too
    finally:
        if tmp.exists():
            tmp.unlink()


def sha256_file(path: Path) -> str:
    """The hex SHA-256 of a file's bytes (what manifests record and resume verifies)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temp file in the same folder + fsync + os.replace."""
    with atomic_file(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_json(path: Path, doc, indent: int | None = 2) -> None:
    """``doc`` as JSON text (non-JSON values as ``str``) with a final newline, written atomically."""
    atomic_write_bytes(path, (json.dumps(doc, indent=indent, default=str) + "\n").encode("utf-8"))


def atomic_write_figure(path: Path, fig, dpi: int = 110) -> None:
    """A matplotlib figure as a PNG file, written atomically (the figure is left open)."""
    with atomic_file(path) as tmp:
        fig.savefig(tmp, format="png", dpi=dpi)


class _Staging:
    """A hidden staging folder (``self.path``) that :meth:`commit` brings into view; as a context
    manager it commits on a normal exit and removes the staging folder on an exception."""

    path: Path

    def commit(self) -> Path:
        raise NotImplementedError

    def abort(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


class StagedFolder(_Staging):
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
        """Give the files the usual permissions, flush them to disk and rename the staging folder to ``target``."""
        for p in [self.path, *self.path.rglob("*")]:
            public_mode(p)
        _fsync_tree(self.path)
        if self.target.exists():
            if self.overwrite:
                shutil.rmtree(self.target)
            else:
                self.target.rmdir()  # fails on a non-empty folder: nothing is overwritten
        os.replace(self.path, self.target)
        fsync_dir(self.target.parent)  # the new name is durable too
        return self.target



class StagedFiles(_Staging):
    """Files written into a hidden staging folder inside ``folder`` and moved into it as one set.

    :meth:`commit` first writes :data:`COMMIT_INCOMPLETE` into ``folder`` (fsynced), then
    removes the ``markers`` (the names a reader needs to take the set as present, a heads
    folder's ``config.json`` and ``distill-heads.json``), moves every other staged entry
    over its namesake, then the markers in order, and removes :data:`COMMIT_INCOMPLETE`
    last. The guarantee: a crash before the commit leaves the old set; a crash during it
    leaves :data:`COMMIT_INCOMPLETE`, which stays until a later commit into ``folder``
    completes, and :func:`commit_incomplete` readers refuse the folder; after it, the new
    set. A reader that does not check (vLLM) finds the old set, no marker (no set), or the
    new files, never new files under old markers. Other entries of ``folder``
    (checkpoints, metrics) are left alone. As a context manager it commits on a normal
    exit and removes the staging folder on an exception.
    """

    def __init__(self, folder: Path, markers: tuple[str, ...]):
        self.folder = Path(folder)
        self.markers = markers
        self.folder.mkdir(parents=True, exist_ok=True)
        for stray in self.folder.glob(".staged.*.partial"):  # an interrupted earlier write (one writer per folder)
            shutil.rmtree(stray, ignore_errors=True)
        self.path = Path(tempfile.mkdtemp(prefix=".staged.", suffix=".partial", dir=self.folder))

    def commit(self) -> Path:
        names = sorted(p.name for p in self.path.iterdir())
        for p in [self.path, *self.path.rglob("*")]:
            public_mode(p)
        _fsync_tree(self.path)
        incomplete = self.folder / COMMIT_INCOMPLETE
        fd = open_no_follow(incomplete, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        with open(fd, "wb") as f:  # from here until the last marker is in, readers refuse the folder
            f.write(b"a set of files was being moved into this folder and did not finish: its files may mix two writes\n")
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(self.folder)
        for name in self.markers:
            (self.folder / name).unlink(missing_ok=True)
        fsync_dir(self.folder)
        for name in [n for n in names if n not in self.markers] + [n for n in self.markers if n in names]:
            target = self.folder / name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            os.replace(self.path / name, target)
        fsync_dir(self.folder)
        incomplete.unlink()
        fsync_dir(self.folder)
        self.path.rmdir()
        return self.folder


def commit_incomplete(folder: Path) -> bool:
    """Whether a :class:`StagedFiles` commit into ``folder`` was interrupted (its files may mix two writes)."""
    return (Path(folder) / COMMIT_INCOMPLETE).exists()



def _fsync_tree(root: Path) -> None:
    """Flush every file and folder under ``root`` (``root`` too) to disk, before it is renamed into view."""
    for p in [root, *root.rglob("*")]:
        if p.is_symlink():
            continue
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
        elif p.is_dir():
            fsync_dir(p)


def fsync_dir(path: Path) -> None:
    """Make the renames and new names inside ``path`` durable (POSIX; a no-op where folders cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
