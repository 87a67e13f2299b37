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
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import pyarrow as pa

from distill.errors import StoreError
from distill.store.atomic import atomic_file, fsync_dir

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
    def recover(self) -> list[pa.RecordBatch]:
        """Read the journal a previous run left (see the module docstring); -> its good batches."""
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
        header = json.loads((reader.schema.metadata or {}).get(JOURNAL_KEY, b"{}"))
        if header.get("format") != JOURNAL_FORMAT:
            raise StoreError(f"{self.path} is not a distill journal (format {header.get('format')!r}); move it aside")
        key = json.loads((self.schema.metadata or {})[JOURNAL_KEY])["config_key"]
        if header.get("config_key") != key:
            diff = sorted(k for k in set(key) | set(header.get("config_key", {})) if key.get(k) != header["config_key"].get(k))
            raise StoreError(f"{self.path} holds conversations generated with a different config (differs in: "
                             f"{', '.join(diff)}); use the same options to resume, or another --out")
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
            self._file = open(self.path, "wb", buffering=0)
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
