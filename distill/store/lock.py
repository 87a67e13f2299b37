"""One writer per dataset folder: ``OUT/.distill.lock`` held for the whole run.

A local folder (:class:`FolderLock`): an exclusive ``flock`` on the lock file. The file holds
the holder's pid, host and start time (JSON), so a second run refuses with a line naming who
writes the folder. The kernel releases a ``flock`` when its process dies, so a lock left by a
killed run is simply taken: the next run finds the old holder's record, sees the lock free,
and says it took over (a warning, not an error). A run that ends (finished or stopped by an
error) removes the file, so a ``.distill.lock`` in a folder means a run holds it or was killed.

Removing the file is safe because a lock counts only on the file the path names: a run that
opened the file just before its holder removed it gets the ``flock`` of an unlinked inode, sees
that the path no longer names it, and starts over on the file now there (or a new one).

An object store (:class:`ObjectLock`) has no ``flock``; see that class for what stands in.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
import uuid
from pathlib import Path

from distill.errors import StoreError
from distill.store.atomic import open_no_follow

LOCK_FILE = ".distill.lock"
log = logging.getLogger("distill.store")


class FolderLock:
    """``with FolderLock(root):`` or ``acquire()`` / ``release()``; not re-entrant."""

    def __init__(self, root: Path | str):
        self.path = Path(root) / LOCK_FILE
        self._fd: int | None = None

    def _holder(self, fd: int) -> dict:
        try:
            os.lseek(fd, 0, os.SEEK_SET)
            return json.loads(os.read(fd, 4096).decode() or "{}")
        except (OSError, ValueError):
            return {}

    def _locked_fd(self) -> int:
        """An open descriptor of the file at :attr:`path` holding its ``flock``; a StoreError while another run holds it."""
        while True:
            fd = open_no_follow(self.path, os.O_RDWR | os.O_CREAT)  # a symlink here would truncate its target
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = self._holder(fd)
                os.close(fd)
                raise StoreError(f"{self.path.parent} is being written by another run ({_holder_line(holder)}): wait for it "
                                 "to finish or use another --out") from None
            if self._names(fd):
                return fd
            os.close(fd)  # its holder removed the file between our open and our flock: lock the one there now

    def _names(self, fd: int) -> bool:
        """Whether :attr:`path` names the file open as ``fd``."""
        try:
            current = os.stat(self.path)
        except FileNotFoundError:
            return False
        mine = os.fstat(fd)
        return (current.st_dev, current.st_ino) == (mine.st_dev, mine.st_ino)

    def acquire(self) -> "FolderLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = self._locked_fd()
        previous = self._holder(fd)
        if previous.get("pid"):
            log.warning("%s: took over the lock of a run that is gone (pid %s on %s, started %s)", self.path.parent,
                        previous.get("pid"), previous.get("host"), previous.get("started"))
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, json.dumps(me).encode())
        os.fsync(fd)
        self._fd = fd
        return self

    def verify(self) -> None:
        """Nothing to check: a ``flock`` cannot be taken away from a live holder."""

    def release(self) -> None:
        """Remove the lock file while still holding it, then unlock (see the module docstring for why that is safe)."""
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)
            if self._names(self._fd):  # a file another run made after ours was removed by hand stays its own
                self.path.unlink(missing_ok=True)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "FolderLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _holder_line(holder: dict) -> str:
    return f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}, since {holder.get('started', '?')}"


def _pid_gone(pid: object) -> bool:
    """Whether no process ``pid`` runs on this machine."""
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (OSError, TypeError, ValueError):
        return False  # alive under another user, or not a pid: never taken for gone
    return False


class ObjectLock:
    """One writer per dataset prefix in an object store: ``OUT/.distill.lock`` made by a conditional create.

    The lock object is created with "create only if absent" (S3 ``If-None-Match: *``, GCS
    ``ifGenerationMatch=0``), so of two runs that start together exactly one gets it; it holds
    the holder's pid, host, start time and a random token, and :meth:`release` deletes it
    (only while it still holds this run's token).

    Nothing releases it when its process dies (there is no kernel to do it), so:

    * a lock left by a process of *this* host (hosts are told apart by host name) that is
      gone is taken over, with the same warning as a local folder's;
    * a lock left by *another* host is refused with a line naming it: only a person knows
      that host's run is over (no lease is guessed from clocks of different machines), and
      removes the lock object to go on;
    * :meth:`verify` (before every manifest commit) checks that the object still holds this
      run's token, so a run whose lock was removed by hand while it ran stops before it
      overwrites the manifest of the run that took the folder.

    A store that ignores the condition (some S3-compatible servers) cannot make this safe:
    there, run one writer per ``--out`` (every ``--part`` its own ``--out``).
    """

    def __init__(self, folder):
        self.folder = folder
        self.path = folder.where(LOCK_FILE)
        self._token: str | None = None

    def _holder(self) -> dict | None:
        try:
            return json.loads(self.folder.read_bytes(LOCK_FILE).decode() or "{}")
        except FileNotFoundError:
            return None
        except (ValueError, UnicodeDecodeError):
            return {}

    def _refuse(self, holder: dict) -> StoreError:
        here = holder.get("host") == socket.gethostname()
        hint = ("" if here else f"; if that run is gone (its machine stopped), remove {self.path} and run again")
        return StoreError(f"{self.folder} is being written by another run ({_holder_line(holder)}): wait for it to "
                          f"finish or use another --out{hint}")

    def acquire(self) -> "ObjectLock":
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "token": uuid.uuid4().hex}
        record = json.dumps(me).encode()
        try:
            self.folder.create(LOCK_FILE, record)
        except FileExistsError:
            holder = self._holder()
            if holder is None:  # released in between: try once more
                return self._create_or_refuse(record, me)
            if holder.get("host") != me["host"] or not _pid_gone(holder.get("pid")):
                raise self._refuse(holder) from None
            log.warning("%s: took over the lock of a run that is gone (pid %s on %s, started %s)", self.folder,
                        holder.get("pid"), holder.get("host"), holder.get("started"))
            self.folder.remove(LOCK_FILE)
            return self._create_or_refuse(record, me)
        self._token = me["token"]
        return self

    def _create_or_refuse(self, record: bytes, me: dict) -> "ObjectLock":
        try:
            self.folder.create(LOCK_FILE, record)
        except FileExistsError:
            raise self._refuse(self._holder() or {}) from None
        self._token = me["token"]
        return self

    def verify(self) -> None:
        """Refuse to go on when the lock object no longer holds this run's token."""
        if self._token is None:
            return
        holder = self._holder()
        if (holder or {}).get("token") != self._token:
            who = _holder_line(holder) if holder else "nobody"
            raise StoreError(f"{self.path} no longer holds this run's lock (now: {who}): it was removed while this run "
                             "wrote; stopping before the manifest is overwritten (what was written is kept and resumed)")

    def release(self) -> None:
        """Delete the lock object if it is still this run's."""
        if self._token is None:
            return
        try:
            if (self._holder() or {}).get("token") == self._token:
                self.folder.remove(LOCK_FILE)
        finally:
            self._token = None

    def __enter__(self) -> "ObjectLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
