"""One writer per dataset folder: an exclusive ``flock`` on ``OUT/.distill.lock`` for the whole run.

The lock file holds the holder's pid, host and start time (JSON), so a second run refuses
with a line naming who writes the folder. The kernel releases a ``flock`` when its process
dies, so a lock left by a killed run is simply taken: the next run finds the old holder's
record, sees the lock free, and says it took over (a warning, not an error).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
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
            who = f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}, since {holder.get('started', '?')}"
            raise StoreError(f"{self.path.parent} is being written by another run ({who}): wait for it to finish "
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
