"""``distill data repair DIR``: set damaged shards aside so that a rerun of ``distill generate`` redoes them.

A listed shard that is missing, truncated, altered (size, SHA-256 or row count differ from
the manifest) or unreadable is renamed ``*.corrupt`` and dropped from the manifest, with
the rejects recorded for its chunk; the dataset is marked incomplete. Nothing else changes:
the same ``distill generate`` command then regenerates exactly those conversations (resume is
by id). The folder is locked while it is repaired, like a generate run. A dataset in an object
store (``s3://...``) is repaired the same way (its shards are read whole to check their SHA-256).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from distill.data.dataset import Dataset
from distill.errors import StoreError
from distill.store.atomic import write_errors
from distill.store.location import open_folder
from distill.store.shards import ShardInfo, ShardStore, shard_problem


@dataclass
class RepairReport:
    root: str
    kept: int  # shards left as they were
    set_aside: dict[str, str] = field(default_factory=dict)  # shard file -> what was wrong with it
    rows_dropped: int = 0  # rows the manifest listed in the shards set aside

    def to_dict(self) -> dict:
        return asdict(self)


def repair(root: Path | str) -> RepairReport:
    folder = open_folder(root)
    root = folder.root
    with folder.lock():
        ds = Dataset.open(folder)
        manifest = ds.manifest
        shards = [ShardInfo(**s) for s in manifest.get("shards", [])]
        keep, report = [], RepairReport(root=str(root), kept=0)
        for info in shards:
            problem = shard_problem(folder, info) if info.file else None
            if problem is None:
                keep.append(info)
                continue
            report.set_aside[info.file] = problem
            report.rows_dropped += info.rows
            if folder.is_file(info.file):
                with write_errors(folder.where(info.file), "setting it aside"):
                    folder.rename(info.file, info.file + ".corrupt")
        report.kept = sum(1 for s in keep if s.file)
        if not report.set_aside:
            return report
        generation = {json.dumps(r, sort_keys=True) for s in shards for r in s.rejects}
        store = ShardStore(folder, manifest.get("meta") or {}, manifest.get("config_key") or {}, ds.id_dtype)
        store.shards, store.totals = keep, dict(manifest.get("totals") or {})
        try:
            store.seed_rejects = [r for r in ds.rejects() if json.dumps(r, sort_keys=True) not in generation]
        except StoreError:
            store.seed_rejects = []  # an unreadable rejects.jsonl: rewritten from the manifest's own records
        store.commit(complete=False)
        return report
