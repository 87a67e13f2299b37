"""The journal: finished conversations that are not in a shard yet, durable one append at a time.

A shard holds many conversations (``--shard-size``, 1,000 by default) so that the dataset
stays a few large files; waiting for a whole shard before anything is durable would lose up
to a shard of work to a crash. So every finished conversation (or generation reject) is first
appended to ``OUT/journal.arrow`` and fsynced; the next shard commit compacts the journal into
the shard and removes it.

Format: one Arrow IPC stream. The schema is the shard schema plus ``reject`` (the reject
record as JSON for a rejected conversation, null for a row) and carries the run's
``config_key`` in its metadata. Each append is one record batch whose custom metadata holds
the SHA-256 of the batch as Arrow serializes it, so a batch that reads back different is
never taken for a good one.

Recovery (:meth:`Journal.recover`): batches are read in order up to the first one that is
torn, unreadable or fails its checksum; that point and everything after it is cut off with
a warning (only the batch being written when the process died can be torn, since every
earlier one was fsynced). A journal written with another config is an error, as a shard
would be. The surviving batches are rewritten into a fresh journal (temp file + rename) and
appending continues after them.

An object store has no append: there the journal is one object per entry
(:class:`SegmentJournal`), with the same schema, checksums and recovery rules.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import pyarrow as pa

from distill.errors import StoreError
from distill.store.atomic import atomic_file, fsync_dir, open_no_follow

log = logging.getLogger("distill.store")

JOURNAL = "journal.arrow"
JOURNAL_FORMAT = "distill-journal/v1"
JOURNAL_KEY = b"distill-journal"
_SUM = b"sha256"


def journal_schema(shard_schema: pa.Schema, config_key: dict) -> pa.Schema:
    """The shard schema plus the ``reject`` column, with the config in the schema metadata."""
    fields = [f for f in shard_schema] + [pa.field("reject", pa.string())]
    header = {"format": JOURNAL_FORMAT, "config_key": config_key}
    return pa.schema(fields, metadata={JOURNAL_KEY: json.dumps(header, sort_keys=True).encode()})


def _checksum(batch: pa.RecordBatch) -> bytes:
    return hashlib.sha256(batch.serialize()).hexdigest().encode()


class Journal:
    """Append-only, fsynced journal of one dataset folder (held under the folder's lock).

    ``batches`` holds every good entry (recovered and appended) until :meth:`clear`.
    """

    def __init__(self, root: Path, schema: pa.Schema):
        self.path = Path(root) / JOURNAL
        self.schema = schema
        self.batches: list[pa.RecordBatch] = []
        self._file = None
        self._writer = None

    # -- reading back ----------------------------------------------------------------------
    def _check_header(self, schema: pa.Schema, where) -> None:
        """A journal of this format and this run's config, or a :class:`StoreError` naming ``where``."""
        header = json.loads((schema.metadata or {}).get(JOURNAL_KEY, b"{}"))
        if header.get("format") != JOURNAL_FORMAT:
            raise StoreError(f"{where} is not a distill journal (format {header.get('format')!r}); move it aside")
        key = json.loads((self.schema.metadata or {})[JOURNAL_KEY])["config_key"]
        if header.get("config_key") != key:
            diff = sorted(k for k in set(key) | set(header.get("config_key", {})) if key.get(k) != header["config_key"].get(k))
            raise StoreError(f"{where} holds conversations generated with a different config (differs in: "
                             f"{', '.join(diff)}); use the same options to resume, or another --out")

    def recover(self) -> list[pa.RecordBatch]:
        """Read the journal a previous run left (see the module docstring); -> its good batches."""
        if self.path.is_symlink():  # its target is no journal of this folder, and is never removed nor written
            raise StoreError(f"{self.path} is a symbolic link; distill does not write through links: remove it "
                             "(or move the folder aside) and run again")
        if not self.path.exists():
            return []
        data = self.path.read_bytes()
        source = pa.BufferReader(data)
        good: list[pa.RecordBatch] = []
        end = 0
        problem = None
        try:
            reader = pa.ipc.RecordBatchStreamReader(source)
        except (pa.ArrowInvalid, OSError) as exc:  # torn before its first entry was ever fsynced
            log.warning("%s: no readable header (%s); nothing in it was committed, removing it", self.path, exc)
            self.path.unlink()
            return []
        self._check_header(reader.schema, self.path)
        end = source.tell()
        while True:
            try:
                batch, meta = reader.read_next_batch_with_custom_metadata()
            except StopIteration:
                break
            except (pa.ArrowInvalid, OSError) as exc:
                problem = f"a torn entry ({exc})"
                break
            if meta is None or meta.get(_SUM) != _checksum(batch):
                problem = "an entry whose checksum does not match"
                break
            if not batch.schema.equals(self.schema, check_metadata=False):
                problem = "an entry with another schema"
                break
            good.append(batch)
            end = source.tell()
        if problem is None and end < len(data):
            problem = f"{len(data) - end} bytes after the end-of-stream marker"
        if problem is not None:
            log.warning("%s: cut off %s at byte %d of %d; %d entries kept (the cut one was being written when the "
                        "run stopped, so its conversations are generated again)", self.path, problem, end, len(data), len(good))
        return good

    # -- writing ---------------------------------------------------------------------------
    def start(self, batches: list[pa.RecordBatch]) -> None:
        """Rewrite the journal to hold exactly ``batches`` (none: no file), then accept appends.

        The batches go to a temp file, fsynced and renamed over the journal; that file stays
        open and later appends go to its end.
        """
        self.close()
        self.batches = list(batches)
        if not self.batches:
            if self.path.exists():
                self.path.unlink()
                fsync_dir(self.path.parent)
            return
        try:
            with atomic_file(self.path) as tmp:  # the handle stays open on the renamed file for the appends
                self._file = open(tmp, "wb", buffering=0)
                self._writer = pa.ipc.new_stream(self._file, self.schema)
                for b in self.batches:
                    self._writer.write_batch(b, custom_metadata={_SUM: _checksum(b)})
        except BaseException:
            self.close()
            raise

    def append(self, rows: list[dict]) -> None:
        """Append rows (dicts of the journal schema) as one entry; durable when this returns."""
        if not rows:
            return
        batch = pa.RecordBatch.from_pylist(rows, schema=self.schema)
        created = self._writer is None
        if created:  # the first entry since the last compaction: a new file
            fd = open_no_follow(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            self._file = open(fd, "wb", buffering=0)
            self._writer = pa.ipc.new_stream(self._file, self.schema)
        self._writer.write_batch(batch, custom_metadata={_SUM: _checksum(batch)})
        os.fsync(self._file.fileno())
        if created:
            fsync_dir(self.path.parent)  # the file's name is durable too
        self.batches.append(batch)

    def table(self) -> pa.Table:
        return pa.Table.from_batches(self.batches, schema=self.schema)

    def __len__(self) -> int:
        return sum(b.num_rows for b in self.batches)

    def clear(self) -> None:
        """Forget every entry and remove the file (after a shard commit holds them)."""
        self.start([])

    def close(self) -> None:
        """Stop appending (no end-of-stream marker is written: the file stays appendable)."""
        if self._file is not None:
            self._file.close()
        self._file = self._writer = None


class SegmentJournal(Journal):
    """The journal in an object store, where nothing can be appended to: one object per entry.

    Each append is one new object ``journal-<n>.arrow`` (an Arrow IPC stream: the journal
    schema with its config header and one checksummed batch), created by a conditional PUT
    (create only if absent: a second writer's entry never replaces one). A PUT is atomic, so
    no entry is ever torn: :meth:`recover` reads every entry in order and keeps each whole one;
    an entry that cannot be read or fails its checksum (damaged in the store) is dropped with
    a warning and its conversations are generated again. :meth:`start` deletes the entries
    it is not given (those a shard already holds); :meth:`clear`, after a shard commit, deletes
    them all, so a crash in between leaves entries the next run finds in a shard and drops.
    An append costs one PUT (tens of milliseconds), where the local journal costs one fsync.
    """

    PREFIX, SUFFIX = "journal-", ".arrow"

    def __init__(self, folder, schema: pa.Schema):
        self.folder = folder
        self.path = folder.where(f"{self.PREFIX}*{self.SUFFIX}")
        self.schema = schema
        self.batches: list[pa.RecordBatch] = []
        self._entries: list[tuple[str, pa.RecordBatch]] = []  # (object name, batch) of every live entry
        self._next = 0

    def _number(self, name: str) -> int | None:
        digits = name[len(self.PREFIX):-len(self.SUFFIX)]
        return int(digits) if digits.isdigit() else None

    def recover(self) -> list[pa.RecordBatch]:
        names = [n for n in self.folder.list(f"{self.PREFIX}*{self.SUFFIX}") if self._number(n) is not None]
        names.sort(key=self._number)
        self._next = max((self._number(n) for n in names), default=-1) + 1
        self._entries = []
        for name in names:
            where = self.folder.where(name)
            try:
                data = self.folder.read_bytes(name)
            except FileNotFoundError:
                continue
            problem = None
            try:
                reader = pa.ipc.RecordBatchStreamReader(pa.BufferReader(data))
                self._check_header(reader.schema, where)
                batch, meta = reader.read_next_batch_with_custom_metadata()
                if meta is None or meta.get(_SUM) != _checksum(batch):
                    problem = "its checksum does not match"
                elif not batch.schema.equals(self.schema, check_metadata=False):
                    problem = "it has another schema"
            except StoreError:
                raise
            except (StopIteration, pa.ArrowException, OSError) as exc:
                problem = f"it is not readable ({exc or 'no entry'})"
            if problem is not None:
                log.warning("%s: %s; dropped, its conversations are generated again", where, problem)
                self.folder.remove(name)
                continue
            self._entries.append((name, batch))
        return [b for _, b in self._entries]

    def start(self, batches: list[pa.RecordBatch]) -> None:
        """Keep exactly the entries holding ``batches`` (from :meth:`recover`); delete the others."""
        keep = {id(b) for b in batches}
        for name, b in self._entries:
            if id(b) not in keep:
                self.folder.remove(name)
        self._entries = [(n, b) for n, b in self._entries if id(b) in keep]
        self.batches = [b for _, b in self._entries]

    def append(self, rows: list[dict]) -> None:
        """Append rows as one new entry object; durable (in the store) when this returns."""
        if not rows:
            return
        batch = pa.RecordBatch.from_pylist(rows, schema=self.schema)
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, self.schema) as writer:
            writer.write_batch(batch, custom_metadata={_SUM: _checksum(batch)})
        name = f"{self.PREFIX}{self._next:08d}{self.SUFFIX}"
        try:
            self.folder.create(name, sink.getvalue().to_pybytes())
        except FileExistsError:
            raise StoreError(f"{self.folder.where(name)} was written by another run: one writer per --out "
                             "(check that no other run writes this prefix)") from None
        self._next += 1
        self._entries.append((name, batch))
        self.batches.append(batch)

    def close(self) -> None:
        """Nothing is open: every entry is a whole object already."""
