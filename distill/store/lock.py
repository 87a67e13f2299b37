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

A file can be removed by hand while its run goes on, though, and a lock on a removed file stops
nobody. So a run also holds a ``flock`` on the folder itself, which no ``rm`` of a file inside
takes away: a second run refuses on it first, naming the holder from the lock file, or, when
that file is gone, the pid the kernel lists for the folder's lock (``/proc/locks``). A file
system without locks on folders (NFS emulates ``flock`` with byte-range locks, which a folder
cannot take) has the lock file alone; there, before each manifest commit, a run whose lock file
was replaced by another run's stops (:meth:`FolderLock.verify`).

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
from distill.store.atomic import open_no_follow, write_errors

LOCK_FILE = ".distill.lock"
log = logging.getLogger("distill.store")


class FolderLock:
    """``with FolderLock(root):`` or ``acquire()`` / ``release()``; not re-entrant."""

    def __init__(self, root: Path | str):
        self.path = Path(root) / LOCK_FILE
        self._fd: int | None = None
        self._folder_fd: int | None = None  # the folder's own flock (None where folders cannot be locked)

    def _holder(self, fd: int) -> dict:
        try:
            os.lseek(fd, 0, os.SEEK_SET)
            record = json.loads(os.read(fd, 4096).decode() or "{}")
        except (OSError, ValueError):
            return {}
        return record if isinstance(record, dict) else {}

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

    def _make_folder(self) -> None:
        """The folder, made if missing; a path that is a file or a link to nothing is a one-line StoreError."""
        root = self.path.parent
        if root.is_symlink() and not root.exists():
            raise StoreError(f"{root} is a symbolic link to {os.readlink(root)}, which does not exist: make that folder "
                             "or give another path")
        if root.exists() and not root.is_dir():
            raise StoreError(f"{root} is a file, not a folder: give the path of a folder (or of one to make)")
        try:
            root.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise StoreError(f"{root}: cannot make this folder: a part of its path is a file") from None

    def _lock_folder(self) -> int | None:
        """The folder's own ``flock`` (see the module docstring), as an open descriptor; None where the file system
        cannot lock a folder; a StoreError naming the holder while another run holds it."""
        root = self.path.parent
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._recorded_holder()
            if holder.get("pid"):
                who = _holder_line(holder)
            else:
                pid = _folder_lock_pid(fd)
                who = f"pid {pid if pid is not None else '?'}; its {LOCK_FILE} was removed by hand"
            os.close(fd)
            raise StoreError(f"{root} is being written by another run ({who}): wait for it to finish or use another "
                             "--out") from None
        except OSError:  # no flock on folders here (NFS): the lock file alone
            os.close(fd)
            return None
        return fd

    def _recorded_holder(self) -> dict:
        """The record in the lock file without creating, locking or following it ({} when there is none)."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return {}
        try:
            return self._holder(fd)
        finally:
            os.close(fd)

    def acquire(self) -> "FolderLock":
        root = self.path.parent
        with write_errors(root, "making the folder"):
            self._make_folder()
        with write_errors(root, "taking the folder's lock"):
            self._folder_fd = self._lock_folder()
        try:
            with write_errors(root, "taking the folder's lock"):
                fd = self._locked_fd()
                try:
                    self._record(fd)
                except BaseException:
                    if self._names(fd):  # held by this run and unwritten (a full or failing disk): no lock file stays
                        self.path.unlink(missing_ok=True)  # behind to look like a run that was killed
                    os.close(fd)
                    raise
        except BaseException:
            self._unlock_folder()
            raise
        self._fd = fd
        return self

    def _record(self, fd: int) -> None:
        """Write this run's record into the lock file open as ``fd`` (held), saying so when it takes a killed run's."""
        previous = self._holder(fd)
        if previous.get("pid"):
            log.warning("%s: took over the lock of a run that is gone (pid %s on %s, started %s)", self.path.parent,
                        previous.get("pid"), previous.get("host"), previous.get("started"))
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, json.dumps(me).encode())
        os.fsync(fd)

    def verify(self) -> None:
        """Refuse to go on when another run holds the lock file now at :attr:`path` (this run's was removed by hand,
        and a run that does not lock the folder itself took a new one); a lock file that is merely gone, or
        replaced by one nobody holds, leaves this run the writer."""
        if self._fd is None or self._names(self._fd):
            return
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._holder(fd)
            raise StoreError(f"{self.path} is no longer this run's lock (now: {_holder_line(holder)}): it was removed "
                             "while this run wrote; stopping before the manifest is overwritten (what was written is kept "
                             "and resumed)") from None
        except OSError:
            pass
        finally:
            os.close(fd)

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
            self._unlock_folder()

    def _unlock_folder(self) -> None:
        if self._folder_fd is not None:
            try:
                fcntl.flock(self._folder_fd, fcntl.LOCK_UN)
            finally:
                os.close(self._folder_fd)
                self._folder_fd = None

    def __enter__(self) -> "FolderLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _holder_line(holder: dict) -> str:
    return f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}, since {holder.get('started', '?')}"


def _folder_lock_pid(fd: int) -> int | None:
    """The pid the kernel lists as holding a ``flock`` on the file open as ``fd`` (Linux's ``/proc/locks``: lines
    ``N: FLOCK ADVISORY WRITE PID MAJOR:MINOR:INODE ...``, the device numbers in hex); None when it is not listed."""
    st = os.fstat(fd)
    here = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    try:
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) < 6 or fields[1] != "FLOCK":  # "->" marks a waiter, not a holder
            continue
        try:
            major, minor, inode = fields[5].split(":")
            if (int(major, 16), int(minor, 16), int(inode)) == here:
                return int(fields[4])
        except ValueError:
            continue
    return None


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
