"""Sharded Parquet store: schema, atomic shard writes, manifest, resume by id.

Layout of a dataset folder::

    manifest.json          shards (rows, bytes, sha256, token counts), totals, config
    shard-00000.parquet    rows of the schema below, zstd; file metadata key b"distill"
    rejects.jsonl          every rejected row with its stage and reason

A shard is written to a hidden temporary file, fsynced and renamed into place;
the manifest is then rewritten the same way. Resume is by ``id``. On opening:

- one run at a time: an exclusive lock on ``.distill.lock`` and on the folder itself
  (:mod:`distill.store.lock`);
- every listed shard must have its recorded size and SHA-256, else the run refuses and
  names the shard (``distill data repair`` sets damaged shards aside);
- a shard file that is not in the manifest (a crash between the two renames) is adopted
  when it reads back whole, was written with this config and holds only new ids; it is
  moved aside otherwise (``*.corrupt``, logged with the reason);
- a folder that holds no row yet may be reused with another config (it is reset);
- the journal (:mod:`distill.store.journal`) is read back: its entries whose ids a shard
  already holds (a crash between a shard commit and the journal's removal) are dropped,
  the rest count as done and go into the next shard.

Finished conversations reach a shard through the journal: :meth:`ShardStore.append`
makes them durable at once, :meth:`ShardStore.flush` writes the journal's rows as one
shard, commits the manifest, then empties the journal. A full disk or a folder that cannot
be written at any of these steps is a one-line :class:`StoreError` naming the file
(:func:`distill.store.atomic.write_errors`); what earlier steps committed stays.

In an object store (``--out s3://...``, see :mod:`distill.store.location`) the same steps run
with what the store offers, and the manifest is the commit point as it is locally:

- a shard is written whole to a local temp file and uploaded under its final name (one
  atomic PUT that never replaces an object; there is no rename): a crash before the manifest
  leaves an unlisted shard, adopted or set aside as above (setting aside is a copy then a delete);
- the manifest and rejects.jsonl are single PUTs (readers see the old or the new one);
- the lock is a conditionally created object (:class:`distill.store.lock.ObjectLock`),
  the journal one object per entry (:class:`distill.store.journal.SegmentJournal`);
- on opening, a listed shard must have its recorded size and row count; its SHA-256 is not
  re-read (that would download the whole dataset at every resume: a PUT is never torn, and
  the store checks what it receives), ``distill data validate URL`` reads and checks every byte.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from distill.errors import StoreError
from distill.store.atomic import write_errors
from distill.store.journal import Journal, SegmentJournal, journal_schema
from distill.store.location import Folder, LocalFolder, json_bytes, open_folder

log = logging.getLogger("distill.store")

FORMAT = "distill-shards/v1"
META_KEY = b"distill"
MANIFEST = "manifest.json"
REJECTS = "rejects.jsonl"
SHARD_RE = re.compile(r"^shard-(\d{5,})\.parquet$")

MESSAGE_TYPE = pa.struct([("role", pa.string()), ("content", pa.string())])
TURN_TYPE = pa.struct(
    [
        ("role", pa.string()),
        ("start", pa.int32()),  # first token of the turn's span in input_ids (template tokens included)
        ("end", pa.int32()),  # one past its last token
        ("n_tokens", pa.int32()),  # tokens the teacher generated in this turn (0 for user turns)
        ("finish_reason", pa.string()),  # "stop" | "length" for assistant turns, null otherwise
    ]
)


def shard_schema(id_dtype: str) -> pa.Schema:
    id_type = pa.uint16() if id_dtype == "uint16" else pa.uint32()
    return pa.schema(
        [
            ("id", pa.string()),
            ("source", pa.string()),
            ("messages", pa.list_(MESSAGE_TYPE)),
            ("input_ids", pa.list_(pa.int32())),
            ("loss_mask", pa.list_(pa.bool_())),
            ("teacher_ids", pa.list_(id_type)),
            ("teacher_lp", pa.list_(pa.uint16())),
            ("turns", pa.list_(TURN_TYPE)),
            ("stop_reason", pa.string()),
            ("n_prompt_tokens", pa.int32()),
            ("n_generated_tokens", pa.int32()),
        ]
    )



def read_shard_meta(path: Path | str, folder: Folder | None = None) -> dict:
    """A shard's ``distill`` file metadata (``path``: a local file, or a name in ``folder``)."""
    schema = folder.parquet(str(path)).schema_arrow if folder is not None else pq.read_schema(path)
    md = schema.metadata or {}
    if META_KEY not in md:
        raise StoreError(f"{folder.where(str(path)) if folder is not None else path} has no distill metadata: not a distill shard")
    return json.loads(md[META_KEY])


@dataclass
class ShardInfo:
    file: str
    rows: int
    bytes: int
    sha256: str
    prompt_tokens: int
    generated_tokens: int
    ids_first: str = ""
    rejects: list[dict] = field(default_factory=list)  # rows rejected while generating this shard's chunk

    @classmethod
    def of_file(cls, path: Path, rejects: list[dict] | None = None, name: str | None = None) -> "ShardInfo":
        """The entry of a local shard file (``name``: the name it is listed under, if not its own)."""
        path = Path(path)
        info = cls.in_folder(LocalFolder(path.parent), path.name, rejects)
        info.file = name or path.name
        return info

    @classmethod
    def in_folder(cls, folder: Folder, name: str, rejects: list[dict] | None = None) -> "ShardInfo":
        """The entry of the shard ``name`` of ``folder`` (reads it whole: size, SHA-256, ids and token sums)."""
        table = folder.read_table(name, columns=["id", "n_prompt_tokens", "n_generated_tokens"])
        return cls(
            file=name,
            rows=table.num_rows,
            bytes=folder.size(name),
            sha256=folder.sha256(name),
            prompt_tokens=int(pc.sum(table["n_prompt_tokens"]).as_py() or 0),
            generated_tokens=int(pc.sum(table["n_generated_tokens"]).as_py() or 0),
            ids_first=table["id"][0].as_py() if table.num_rows else "",
            rejects=list(rejects or []),
        )


def shard_problem(root: Folder | Path | str, info: ShardInfo, checksum: bool = True) -> str | None:
    """What is wrong with a listed shard file (None: present, with its recorded size, SHA-256 and row count).

    ``checksum=False`` leaves the SHA-256 out (a resume in an object store, see the module docstring).
    """
    folder = open_folder(root)
    if not folder.is_file(info.file):
        return "listed in the manifest but missing"
    size = folder.size(info.file)
    if size != info.bytes:
        return f"{size} bytes, the manifest says {info.bytes} (truncated or altered)"
    if checksum and folder.sha256(info.file) != info.sha256:
        return "SHA-256 differs from the manifest (altered or damaged)"
    try:
        rows = folder.parquet(info.file).metadata.num_rows
    except Exception as exc:  # noqa: BLE001 - unreadable is the finding
        return f"not readable Parquet ({exc})"
    if rows != info.rows:
        return f"{rows} rows, the manifest says {info.rows}"
    return None


class ShardStore:
    """A dataset folder being written by one run (one config).

    ``meta`` is the file-level metadata written into every shard and the manifest;
    ``config_key`` the part of it that must match to resume.
    """

    def __init__(self, root: Folder | Path | str, meta: dict, config_key: dict, id_dtype: str):
        self.folder = open_folder(root)
        self.root = self.folder.root  # a Path, or the URL of an object-store prefix
        self.meta = meta
        self.config_key = config_key
        self.schema = shard_schema(id_dtype).with_metadata({META_KEY: json.dumps(meta, sort_keys=True).encode()})
        self.shards: list[ShardInfo] = []
        self.totals: dict[str, Any] = {}
        self.seed_rejects: list[dict] = []
        self._committed: dict[str, bytes] = {}  # what the manifest and rejects files hold (read once, then as written)
        self._lock = self.folder.lock()
        schema = journal_schema(shard_schema(id_dtype), config_key)
        self.journal = SegmentJournal(self.folder, schema) if self.folder.remote else Journal(self.root, schema)

    # -- opening / resuming -------------------------------------------------------------
    def open(self) -> "ShardStore":
        """Lock the folder for this run, then check and resume what it holds (see the module docstring)."""
        self._lock.acquire()
        self._committed.clear()  # another run may have written since an earlier open
        try:
            with write_errors(self.root, "opening it for this run"):
                self._open()
        except BaseException:
            self._lock.release()
            raise
        return self

    def close(self) -> None:
        """Close the journal and release the folder's lock (what was appended stays in the journal)."""
        self.journal.close()
        self._lock.release()

    def __enter__(self) -> "ShardStore":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    def _open(self) -> None:
        folder = self.folder
        for stray in folder.list(".*.tmp"):  # local temp files of an interrupted write (an object store has none)
            folder.remove(stray)
        if folder.is_file(MANIFEST):
            try:
                manifest = json.loads(self._read(MANIFEST))
            except ValueError as exc:
                raise StoreError(f"{folder.where(MANIFEST)} is not valid JSON ({exc}); move the folder aside or fix it") from None
            manifest = checked_manifest(folder, manifest)
            if manifest.get("format") != FORMAT:
                raise StoreError(f"{self.root} holds a '{manifest.get('format')}' dataset, not {FORMAT}")
            shards = [ShardInfo(**s) for s in manifest.get("shards", [])]
            old_key = manifest.get("config_key", {})
            if old_key != self.config_key:
                if any(s.file or s.rejects for s in shards) or folder.list("shard-*.parquet"):
                    diff = sorted(k for k in set(old_key) | set(self.config_key) if old_key.get(k) != self.config_key.get(k))
                    raise StoreError(
                        f"{self.root} was generated with a different config (differs in: {', '.join(diff)}); "
                        "use another --out, or the same options to resume"
                    )
                log.warning("%s holds no row yet: reusing it with the new config", self.root)
                shards = []  # nothing was generated: the folder starts over
            else:
                self.totals = manifest.get("totals", {})
            self.shards = shards
        self._check_listed()
        self._adopt_unlisted()
        self._recover_journal()

    def _check_listed(self) -> None:
        """Every listed shard is there, whole and unaltered, or the run refuses (see :func:`shard_problem`)."""
        for s in self.shards:
            if s.file and (problem := shard_problem(self.folder, s, checksum=not self.folder.remote)):
                raise StoreError(f"{self.folder.where(s.file)}: {problem}; run `distill data repair {self.root}` to set "
                                 "damaged shards aside (their conversations are generated again)")

    def _adopt_unlisted(self) -> None:
        listed = {s.file for s in self.shards if s.file}
        known = self.done_ids()
        changed = False
        for name in self.folder.list("shard-*.parquet"):
            if name in listed or not SHARD_RE.match(name):
                continue
            try:
                meta = read_shard_meta(name, self.folder)
                if {k: meta.get("config_key", {}).get(k) for k in self.config_key} != self.config_key:
                    raise StoreError("written with another config")
                ids = self.folder.read_table(name)["id"].to_pylist()  # reads back whole, or raises
                if len(set(ids)) != len(ids) or known & set(ids):
                    raise StoreError("holds ids that are already in the dataset")
                self.shards.append(ShardInfo.in_folder(self.folder, name, rejects=meta.get("chunk_rejects", [])))
                known.update(ids)
                log.warning("%s: adopted %s (written but not yet listed when a run stopped)", self.root, name)
            except Exception as exc:  # noqa: BLE001 - any leftover that cannot count is set aside, never counted
                self.folder.rename(name, name + ".corrupt")
                log.warning("%s: set %s aside as %s.corrupt: %s", self.root, name, name, exc)
            changed = True
        if changed:
            self.shards.sort(key=lambda s: s.file)
            self.commit()

    def _recover_journal(self) -> None:
        """Keep the journal's entries that no shard holds yet (see the module docstring)."""
        batches = self.journal.recover()
        if batches:
            known = self.shard_ids()
            kept, dropped = [], 0
            for b in batches:
                ids = b.column("id").to_pylist()
                if known.isdisjoint(ids):
                    kept.append(b)
                    known.update(ids)
                else:  # compacted into a shard already, or a repeat: never counted twice
                    dropped += 1
            if dropped:
                log.info("%s: %d journal entries are already in shards; dropped them", self.root, dropped)
            if kept:
                log.warning("%s: resumed %d finished conversations from the journal", self.root, sum(b.num_rows for b in kept))
            batches = kept
        self.journal.start(batches)

    # -- what is done -------------------------------------------------------------------
    def shard_ids(self) -> set[str]:
        """Ids in shards or in the manifest's generation rejects (not the journal's)."""
        ids: set[str] = set()
        for s in self.shards:
            if s.file:
                ids.update(self.folder.read_table(s.file, columns=["id"])["id"].to_pylist())
            ids.update(r["id"] for r in s.rejects)
        return ids

    def shard_id_lists(self) -> list[list[str]]:
        """The ids of every listed shard, in order (duplicates kept: the caller counts them)."""
        return [self.folder.read_table(s.file, columns=["id"])["id"].to_pylist() for s in self.shards if s.file]

    def done_ids(self) -> set[str]:
        """Ids already written (in shards or the journal) or rejected while generating."""
        ids = self.shard_ids()
        for b in self.journal.batches:
            ids.update(b.column("id").to_pylist())
        return ids

    def _next_index(self) -> int:
        used = [int(m.group(1)) for n in self.folder.list("shard-*") if (m := SHARD_RE.match(n.removesuffix(".corrupt")))]
        return max(used, default=-1) + 1

    # -- writing ------------------------------------------------------------------------
    def write_shard(self, rows: list[dict], chunk_rejects: Iterable[dict] = ()) -> ShardInfo | None:
        """Write one shard (atomically) and commit it to the manifest.

        A chunk whose conversations were all rejected writes no file; its rejects
        still go into the manifest (as an empty entry) so resume skips them.
        """
        return self._write(pa.Table.from_pylist(rows, schema=self.schema), list(chunk_rejects))

    def _write(self, table: pa.Table, chunk_rejects: list[dict]) -> ShardInfo | None:
        if not table.num_rows and not chunk_rejects:
            return None
        name = f"shard-{self._next_index():05d}.parquet"
        if table.num_rows:
            meta = dict(self.meta, chunk_rejects=chunk_rejects)
            schema = self.schema.with_metadata({META_KEY: json.dumps(meta, sort_keys=True).encode()})
            table = table.cast(schema)
            with write_errors(self.folder.where(name), "writing this shard"), self.folder.new_file(name) as tmp:
                # ``tmp`` becomes ``name`` whole, or not at all
                pq.write_table(table, tmp, compression="zstd", compression_level=9, row_group_size=256)
                info = ShardInfo.of_file(tmp, rejects=chunk_rejects, name=name)
        else:
            info = ShardInfo(file="", rows=0, bytes=0, sha256="", prompt_tokens=0, generated_tokens=0, rejects=chunk_rejects)
        self.shards.append(info)
        self.commit()
        return info

    # -- the journal -----------------------------------------------------------------------
    def append(self, rows: list[dict], rejects: Iterable[dict] = ()) -> None:
        """Make finished rows and generation rejects durable now (one fsynced journal entry)."""
        entries = [dict(r, reject=None) for r in rows]
        entries += [{"id": r["id"], "source": r.get("source"), "reject": json.dumps(r)} for r in rejects]
        with write_errors(self.journal.path, "appending finished conversations"):
            self.journal.append(entries)

    @property
    def pending(self) -> int:
        """Entries (rows and rejects) in the journal, waiting for the next shard."""
        return len(self.journal)

    def flush(self, order: dict[str, int] | None = None) -> ShardInfo | None:
        """Compact the journal into one shard (rows sorted by ``order[id]`` when given), then empty it.

        The shard and the manifest are committed before the journal is removed, so a crash
        in between leaves entries that :meth:`open` finds in a shard and drops.
        """
        if not len(self.journal):
            return None
        table = self.journal.table()
        is_reject = pc.is_valid(table["reject"])
        rejects = [json.loads(r) for r in table.filter(is_reject)["reject"].to_pylist()]
        rows = table.drop_columns(["reject"])
        # filter and take copy every column (the teacher's are most of the bytes): only when they change something
        if rejects:
            rows = rows.filter(pc.invert(is_reject))
        if order is not None and rows.num_rows:
            rank = pa.array([order.get(i, len(order)) for i in rows["id"].to_pylist()], pa.int64())
            if not pc.all(pc.less_equal(rank[:-1], rank[1:]), min_count=0).as_py():  # else the sort keeps the order
                rows = rows.take(pc.array_sort_indices(rank))  # stable: ties keep journal order
        info = self._write(rows, rejects)
        with write_errors(self.journal.path, "removing the journal its shard now holds"):
            self.journal.clear()
        return info

    @property
    def generation_rejects(self) -> list[dict]:
        return [r for s in self.shards for r in s.rejects]

    def commit(self, **totals: Any) -> None:
        """Rewrite manifest.json and rejects.jsonl atomically from the in-memory state."""
        self.totals.update(totals)
        files = [s for s in self.shards if s.file]
        self.totals.update(
            rows=sum(s.rows for s in files),
            shards=len(files),
            prompt_tokens=sum(s.prompt_tokens for s in files),
            generated_tokens=sum(s.generated_tokens for s in files),
            bytes=sum(s.bytes for s in files),
        )
        rejects = self.seed_rejects + self.generation_rejects
        by_reason: dict[str, int] = {}
        for r in rejects:
            by_reason[r.get("reason", "unknown")] = by_reason.get(r.get("reason", "unknown"), 0) + 1
        self.totals.update(rejects=len(rejects), rejects_by_reason=by_reason)  # what rejects.jsonl must hold
        manifest = {
            "format": FORMAT,
            "config_key": self.config_key,
            "meta": self.meta,
            "shards": [s.__dict__ for s in self.shards],
            "totals": self.totals,
        }
        self._lock.verify()  # still this run's (see ObjectLock, FolderLock.verify)
        listed, body = "".join(json.dumps(r) + "\n" for r in rejects).encode(), json_bytes(manifest)
        if self._holds(REJECTS, listed) and self._holds(MANIFEST, body):
            return  # a rerun with nothing to do leaves the files as they were
        with write_errors(self.folder.where(MANIFEST), "writing the manifest"):
            self.folder.write_bytes(REJECTS, listed)
            self._committed[REJECTS] = listed
            self.folder.write_bytes(MANIFEST, body)  # the commit point
            self._committed[MANIFEST] = body

    def _read(self, name: str) -> bytes | None:
        """The folder's file ``name`` (None if absent), read once; this run's writes keep it current (the lock makes
        this run the folder's only writer)."""
        if name not in self._committed:
            self._committed[name] = self.folder.read_bytes(name) if self.folder.is_file(name) else None
        return self._committed[name]

    def _holds(self, name: str, data: bytes) -> bool:
        """Whether the folder's file ``name`` holds exactly ``data``."""
        return self._read(name) == data


def shard_entry_problem(index: int, entry: object) -> str | None:
    """What makes the manifest's shard entry ``index`` unsafe to follow, naming it, or None.

    A shard's ``file`` must be a plain file name: one inside the dataset folder, whatever the
    manifest says, so that no command reads, renames, copies or overwrites a file elsewhere
    (``../x.parquet``, ``/etc/x``). The same rule holds for an object-store prefix.
    """
    if not isinstance(entry, dict):
        return f"shards[{index}] is not an object"
    name = entry.get("file", "")
    if not isinstance(name, str):
        return f"shards[{index}].file is not a string ({name!r})"
    if name and ("/" in name or "\\" in name or "\0" in name or name in (".", "..")):
        return f"shards[{index}].file {name!r} is not a plain file name inside the dataset folder"
    return None


def checked_manifest(folder: Folder, manifest: object) -> dict:
    """``manifest`` if it is an object whose shard entries all name files inside ``folder``, else a StoreError
    naming the first entry that does not (:func:`shard_entry_problem`)."""
    if not isinstance(manifest, dict) or not isinstance(manifest.get("shards", []), list):
        raise StoreError(f"{folder.where(MANIFEST)} is not a distill manifest (no list of shards)")
    for i, entry in enumerate(manifest.get("shards", [])):
        if problem := shard_entry_problem(i, entry):
            raise StoreError(f"{folder.where(MANIFEST)}: {problem}; refusing to touch it")
        where = folder.where(entry.get("file", "")) if entry.get("file") else None
        if isinstance(where, Path) and where.is_symlink():  # a link would lead a reader or writer out of the folder
            raise StoreError(f"{where} is a symbolic link, not a shard of this folder; refusing to touch it")
    return manifest


def load_manifest(root: Folder | Path | str) -> dict:
    """The manifest of the dataset at ``root`` (a local folder or an object-store URL), its shard entries checked
    to name files inside it (:func:`checked_manifest`)."""
    folder = open_folder(root)
    if not folder.is_file(MANIFEST):
        raise StoreError(f"{folder} has no {MANIFEST}: not a distill dataset folder")
    return checked_manifest(folder, json.loads(folder.read_bytes(MANIFEST)))


def shard_files(root: Folder | Path | str) -> list[Path | str]:
    """The shard files a manifest lists, in order (local paths, or URLs in an object store)."""
    folder = open_folder(root)
    return [folder.where(s["file"]) for s in load_manifest(folder)["shards"] if s["file"]]


def damaged_shard(folder: Folder, name: str, problem: str) -> StoreError:
    """The one-line error of a listed shard that cannot be read as recorded, naming it and the way out."""
    return StoreError(f"{folder.where(name)}: {problem}; run `distill data repair {folder.root}` to set damaged shards "
                      "aside (a rerun of `distill generate` with the same options redoes their conversations)")


def check_shards(root: Folder | Path | str) -> None:
    """Every listed shard present with its recorded size and a readable Parquet footer and row count, else a
    :class:`StoreError` naming the first damaged one (:func:`damaged_shard`).

    For readers about to start long work on a dataset (training, calibration): it reads each shard's footer,
    not its pages, nor its SHA-256 (``distill data validate`` does both); :func:`iter_rows` reports a damaged
    page the same way when it reaches it.
    """
    folder = open_folder(root)
    for entry in load_manifest(folder).get("shards", []):
        if not entry.get("file"):
            continue
        try:
            info = ShardInfo(**entry)
        except TypeError:
            raise StoreError(f"{folder.where(MANIFEST)} lists a shard entry distill cannot read ({entry}); "
                             f"run `distill data validate {folder.root}`") from None
        problem = shard_problem(folder, info, checksum=False)
        if problem:
            raise damaged_shard(folder, info.file, problem)


def iter_rows(root: Folder | Path | str, columns: list[str] | None = None, batch_size: int = 64) -> Iterator[dict]:
    """Stream rows from every listed shard, one record batch at a time (memory bounded); a shard that cannot be
    read is a :class:`StoreError` naming it (:func:`damaged_shard`)."""
    folder = open_folder(root)
    for s in load_manifest(folder)["shards"]:
        if s["file"]:
            try:
                for batch in folder.parquet(s["file"]).iter_batches(batch_size=batch_size, columns=columns):
                    yield from batch.to_pylist()
            except (OSError, pa.ArrowException) as exc:
                if isinstance(exc, StoreError):
                    raise
                if not folder.is_file(s["file"]):
                    raise damaged_shard(folder, s["file"], "listed in the manifest but missing") from None
                detail = (str(exc).splitlines() or [type(exc).__name__])[0]
                raise damaged_shard(folder, s["file"], f"not readable Parquet ({detail})") from None


def iter_token_rows(root: Folder | Path | str, vocab_size: int, needs: str) -> Iterator[tuple[Any, Any]]:
    """Each row's ``(input_ids, loss_mask)`` as numpy arrays (int64, bool), checked against a ``vocab_size`` vocabulary.

    A row whose ids fall outside it raises :class:`~distill.errors.ConfigError` saying what
    ``needs`` the model that generated the data (e.g. "its datastore"): the usual cause is
    another model's dataset.
    """
    import numpy as np

    from distill.errors import ConfigError

    for row in iter_rows(root, columns=["input_ids", "loss_mask"], batch_size=256):
        ids = np.asarray(row["input_ids"], dtype=np.int64)
        mask = np.asarray(row["loss_mask"], dtype=bool)
        if ids.shape != mask.shape:
            raise ConfigError(f"{root}: a row's input_ids and loss_mask differ in length")
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise ConfigError(f"{root} holds token ids outside the model's {vocab_size}-token vocabulary: "
                              f"{needs} needs the model that generated it")
        yield ids, mask
