"""``distill push``: a dataset (or a train/eval split folder) to a Hub dataset repo, with its card.

Repo layout (also what ``--dry-run OUT`` writes)::

    README.md                        the dataset card (YAML header + body, see distill.hub.card)
    data/train/shard-*.parquet       the shards of each split, as they are locally
    data/train/manifest.json         their manifest (checksums, counts, config) and
    data/train/rejects.jsonl         rejected seed rows; data/eval/... the same for an eval split

Every split is validated first; an invalid dataset is never uploaded. Nothing uploaded
holds a local path: the manifest, the shards' file metadata and the card go through
:func:`public`, which keeps a path's last component only (new datasets record none; older
ones recorded the seed file's location). A shard whose metadata had to change is rewritten,
and its manifest entry gets the new size and checksum. The upload
goes through ``HfApi.upload_folder``, which (with ``hf_xet``, a dependency of
``huggingface_hub``) streams files in batches of commits and resumes an interrupted
upload when run again: files already on the Hub with the same content are skipped.
The token comes from ``HF_TOKEN`` or the user's ``hf auth login``; it is passed to
``huggingface_hub`` only, never printed, logged, or written to the card.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from distill.data.dataset import Dataset, local_copy, split_folders
from distill.data.stats import compute_stats
from distill.data.validate import validate_dataset
from distill.errors import ConfigError, PushError
from distill.hub.card import CardOptions, SplitCard, render_card
from distill.store.atomic import StagedFolder
from distill.store.location import is_remote
from distill.store.shards import MANIFEST, META_KEY, REJECTS, ShardInfo

#: Metadata keys whose values may be a local path (seed file, model folder, input dataset).
PATH_KEYS = frozenset({"location", "path", "spec", "seed", "name", "id", "model_id"})

HUB_SPLIT = {"train": "train", "eval": "eval"}


@dataclass
class PushSummary:
    repo_id: str
    files: list[str]  # paths in the repo
    rows: dict[str, int]
    bytes: int
    dry_run: str | None = None  # the folder written instead of uploading
    commit_url: str | None = None
    commit_oid: str | None = None
    private: bool = False
    skipped_splits: list[str] = field(default_factory=list)  # empty splits (no rows) left out

    def to_dict(self) -> dict:
        return self.__dict__.copy()


def _local_path(value: object) -> bool:
    """Whether ``value`` is a local path, or an ``hf:`` spec of one."""
    if isinstance(value, str) and value.startswith("hf:"):
        value = value[len("hf:"):]
    return isinstance(value, str) and (os.path.isabs(value) or value.startswith(("~", "./", "../", ".\\")))


def _last_component(value: str) -> str:
    """A local path's last component; ``hf:`` + a local folder (and its split) -> ``hf:`` + the folder's name (and split)."""
    if value.startswith("hf:"):
        return "hf:" + Path(value[len("hf:"):]).name
    return Path(value).name


def public(obj):
    """A copy of a metadata tree whose path-like values (under :data:`PATH_KEYS`), ``hf:`` specs of a local
    folder among them, keep only their last component."""
    if isinstance(obj, dict):
        return {k: (_last_component(v) if k in PATH_KEYS and _local_path(v) else public(v)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [public(v) for v in obj]
    return obj


def _place_shard(src: Path, dst: Path, link: bool) -> ShardInfo | None:
    """Copy a shard; rewrite it when its file metadata holds a local path -> its new info (None: unchanged)."""
    import pyarrow.parquet as pq

    raw = (pq.read_schema(src).metadata or {}).get(META_KEY)
    meta = json.loads(raw) if raw else None
    if meta is None or public(meta) == meta:
        _place(src, dst, link)
        return None
    table = pq.read_table(src)
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), META_KEY: json.dumps(public(meta), sort_keys=True).encode()})
    dst.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, dst, compression="zstd", compression_level=9, row_group_size=256)
    return ShardInfo.of_file(dst)


def _place(src: Path, dst: Path, link: bool) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    if link:
        try:
            os.link(src, dst)
            return
        except OSError:
            pass
    shutil.copyfile(src, dst)


def stage(root: Path | str, out: Path, opts: CardOptions, link: bool = False) -> PushSummary:
    """Validate ``root`` and write the repo layout into the empty folder ``out``."""
    folders = split_folders(root)
    splits: list[SplitCard] = []
    summary = PushSummary(opts.repo_id, [], {}, 0)
    meta = totals = None
    for name, folder in folders.items():
        report = validate_dataset(folder)
        if not report.ok:
            first = report.problems[0]
            raise PushError(f"{folder} is not valid ({report.count} problem(s), first: {first}); "
                            f"run `distill data validate {folder}` and fix it before pushing")
        ds = Dataset.open(folder)
        if not ds.rows:
            summary.skipped_splits.append(name)
            continue
        if meta is None:
            meta, totals = public(ds.meta), ds.manifest.get("totals")
        split = HUB_SPLIT[name]
        manifest = public(ds.manifest)
        for entry in manifest.get("shards", []):
            if entry.get("file"):
                rewritten = _place_shard(folder / entry["file"], out / "data" / split / entry["file"], link)
                if rewritten is not None:
                    entry.update(bytes=rewritten.bytes, sha256=rewritten.sha256)
        (out / "data" / split / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")  # out: a staging folder
        if (folder / REJECTS).is_file():
            _place(folder / REJECTS, out / "data" / split / REJECTS, link)
        splits.append(SplitCard(split, compute_stats(folder), sum(f.stat().st_size for f in ds.files),
                                f"data/{split}/*.parquet"))
        summary.rows[split] = ds.rows
    if not splits:
        raise PushError(f"{root} holds no rows to push")
    (out / "README.md").write_text(render_card(opts, meta, splits, totals), encoding="utf-8")
    summary.files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    summary.bytes = sum((out / f).stat().st_size for f in summary.files)
    return summary


def push(root: Path | str, opts: CardOptions, private: bool = False, dry_run: Path | str | None = None) -> PushSummary:
    """Push ``root`` to the dataset repo ``opts.repo_id`` (or, with ``dry_run``, write what would be uploaded).

    A dataset in an object store (``s3://...``) is first copied into a temporary local folder
    (what its manifest lists) and pushed from there.
    """
    if is_remote(root):
        with tempfile.TemporaryDirectory(prefix="distill-push-source-") as source:
            return push(local_copy(root, Path(source)), opts, private=private, dry_run=dry_run)
    if dry_run is not None:
        out = Path(dry_run)
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise ConfigError(f"--dry-run folder {out} already exists and is not empty; choose a new one")
        with StagedFolder(out) as staged:  # built beside it, renamed into place when whole
            summary = stage(root, staged.path, opts)
        summary.dry_run, summary.private = str(out), private
        return summary

    from huggingface_hub import HfApi, get_token
    from huggingface_hub.errors import HfHubHTTPError

    if not get_token():
        raise PushError("no Hugging Face token: set HF_TOKEN or run `hf auth login` (a token with write access)")
    check_reachable()
    with tempfile.TemporaryDirectory(prefix="distill-push-") as tmp:
        summary = stage(root, Path(tmp), opts, link=True)
        summary.private = private
        api = HfApi()
        try:
            api.create_repo(opts.repo_id, repo_type="dataset", private=private, exist_ok=True)
            info = api.upload_folder(
                repo_id=opts.repo_id, repo_type="dataset", folder_path=tmp,
                commit_message=f"distill push: {sum(summary.rows.values()):,} conversations ({', '.join(summary.rows)})",
            )
        except HfHubHTTPError as exc:
            status = getattr(getattr(exc, "response", None), "status_code", None)
            raise PushError(f"the Hub refused the upload to {opts.repo_id} (HTTP {status}): "
                            f"{str(exc).splitlines()[0]}; re-run the same command to resume") from None
        except ValueError as exc:  # e.g. the Hub's metadata validation of README.md
            raise PushError(f"the Hub rejected the upload to {opts.repo_id}: {exc}") from None
        except connection_errors() as exc:
            raise PushError(f"cannot reach the Hub ({_endpoint()}): {_first_line(exc)}; re-run the same command to resume") from None
        summary.commit_url, summary.commit_oid = info.commit_url, info.oid
    return summary


def connection_errors() -> tuple[type[BaseException], ...]:
    """What a request through ``huggingface_hub`` raises when the Hub cannot be reached: OSError, and the transport
    errors of the HTTP client it talks through (httpx, or the httpx2 fork that newer releases use), which are not
    OSErrors."""
    import importlib

    errors: list[type[BaseException]] = [OSError]
    for name in ("httpx", "httpx2"):
        try:
            errors.append(importlib.import_module(name).TransportError)
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


def check_reachable(timeout: float = 10.0) -> None:
    """One request to the Hub's endpoint (``HF_ENDPOINT``) through ``huggingface_hub``'s own session (its proxies and
    certificates) before anything is validated, staged or uploaded; any HTTP answer counts as reachable."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    try:
        get_session().head(constants.ENDPOINT, timeout=timeout)
    except connection_errors() as exc:
        raise PushError(f"cannot reach the Hub ({_endpoint()}): {_first_line(exc)}; nothing was uploaded: "
                        "run the same command again where it is reachable") from None


def _endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0]
