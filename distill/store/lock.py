"""One writer per dataset folder: ``OUT/.distill.lock`` held for the whole run.

A local folder (:class:`FolderLock`): an exclusive ``flock`` on the lock file. The file holds
the holder's pid, host and start time (JSON), so a second run refuses with a line naming who
writes the folder. The kernel releases a ``flock`` when its process dies, so a lock left by a
killed run is simply taken: the next run finds the old holder's record, sees the lock free,
and says it took over (a warning, not an error).

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

    def acquire(self) -> "FolderLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._holder(fd)
            os.close(fd)
            raise StoreError(f"{self.path.parent} is being written by another run ({_holder_line(holder)}): wait for it to finish "
                             "or use another --out") from None
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
        """Clear the holder record and unlock (the file stays: removing it could let two runs lock two inodes)."""
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)
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
