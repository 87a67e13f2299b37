"""Writing a new dataset folder from rows (merge, dedupe, split, convert): never touching the inputs.

Rows go through :class:`distill.store.ShardStore` (atomic shards + manifest) into a
hidden staging folder beside ``out``; when every shard is written the staging
folder is renamed to ``out`` in one step, so ``out`` either does not exist or is a
complete dataset.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import distill
from distill.errors import ConfigError
from distill.store.atomic import StagedFolder
from distill.store.location import is_remote
from distill.store.shards import ShardStore

DEFAULT_SHARD_ROWS = 1000


def check_new_output(out: Path | str, inputs: list[Path | str] = ()) -> None:
    """Refuse an existing non-empty ``out`` (or one inside/equal to an input): outputs are always new folders.

    They are local: an object-store URL is refused (``distill generate --out`` is what writes there).
    """
    if is_remote(out):
        raise ConfigError(f"--out {out}: this command writes a local folder or file; only `distill generate --out` "
                          "writes to an object store (the inputs may be URLs)")
    out = Path(out)
    for inp in inputs:
        if is_remote(inp):
            continue
        if out.resolve() == Path(inp).resolve() or Path(inp).resolve() in out.resolve().parents:
            raise ConfigError(f"--out {out} is inside the input {inp}; write to a new folder")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} already exists; choose a new --out (inputs are never modified, outputs never overwritten)")


def derived_meta(meta: dict | None, op: str, **details: Any) -> dict:
    """A copy of an input's file-level metadata with a ``derived`` record of the operation that made it."""
    out = dict(meta or {})
    out["derived"] = {"op": op, "tool": f"distill {distill.__version__}", **details, "from": (meta or {}).get("derived")}
    return out


class ShardWriter:
    """Collects rows into shards of ``shard_rows`` and publishes the folder atomically on :meth:`close`."""

    def __init__(self, out: Path, meta: dict, id_dtype: str, shard_rows: int = DEFAULT_SHARD_ROWS):
        if shard_rows < 1:
            raise ConfigError(f"--shard-size must be >= 1; got {shard_rows}")
        check_new_output(out)
        self.out = Path(out)
        self.staged = StagedFolder(self.out)
        self.stage = self.staged.path
        self.store = ShardStore(self.stage, meta, {"derived": meta.get("derived", {}).get("op")}, id_dtype).open()
        self.shard_rows = shard_rows
        self.rows: list[dict] = []
        self.rejects: list[dict] = []
        self.count = 0

    def add(self, row: dict) -> None:
        self.rows.append(row)
        self.count += 1
        if len(self.rows) >= self.shard_rows:
            self.flush()

    def flush(self) -> None:
        if self.rows:
            self.store.write_shard(self.rows)
            self.rows = []

    def close(self, **totals: Any) -> Path:
        """Write the last shard, the manifest (with ``totals``) and rejects; move the folder into place."""
        self.flush()
        self.store.seed_rejects = self.rejects
        self.store.commit(complete=True, pending=0, rejected=len(self.rejects), **totals)
        self.store.close()
        return self.staged.commit()  # ``out`` was checked empty in __init__

    def abort(self) -> None:
        self.store.close()
        self.staged.abort()

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is not None:
            self.abort()
