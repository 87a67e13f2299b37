"""The dataset card (``README.md``) of a pushed dataset, rendered from ``data_cards/dataset_card.md.j2``.

The YAML header is built with ``huggingface_hub.DatasetCardData`` (what the Hub
reads: license, task categories, language, size category, ``configs`` with
``data_files`` per split, and ``dataset_info`` with the features and split sizes
from ``datasets``), the body from the manifest metadata and :class:`DatasetStats`.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

from distill.store.teacher import manifest_encoding
from distill.data.stats import DatasetStats
from distill.errors import ConfigError
from distill.store.shards import shard_schema

CARDS_DIR = Path(__file__).resolve().parents[2] / "data_cards"
TEMPLATE = "dataset_card.md.j2"
SIZE_CATEGORIES = ((1_000, "n<1K"), (10_000, "1K<n<10K"), (100_000, "10K<n<100K"), (1_000_000, "100K<n<1M"),
                   (10_000_000, "1M<n<10M"), (100_000_000, "10M<n<100M"), (1_000_000_000, "100M<n<1B"))


def size_category(rows: int) -> str:
    return next((name for limit, name in SIZE_CATEGORIES if rows < limit), "n>1T")


@dataclass
class CardOptions:
    """What the card says beyond the data itself."""

    repo_id: str
    license: str = "other"
    language: list[str] = field(default_factory=lambda: ["en"])
    pretty_name: str | None = None

    def __post_init__(self) -> None:
        if self.repo_id.count("/") != 1 or not all(self.repo_id.split("/")):
            raise ConfigError(f"--repo must be OWNER/NAME; got {self.repo_id!r}")
        if not self.language:
            raise ConfigError("--language needs at least one language code")


@dataclass
class SplitCard:
    name: str  # split name on the Hub ("train", "eval")
    stats: DatasetStats
    bytes: int  # Parquet bytes of its shards
    files_glob: str  # data_files pattern, relative to the repo root

    @property
    def finish(self) -> str:
        return ", ".join(f"{k} {v:,}" for k, v in self.stats.finish_reasons.items()) or "none"

    @property
    def stops(self) -> str:
        return ", ".join(f"{k} {v:,}" for k, v in self.stats.stop_reasons.items()) or "none"

    @property
    def rejects(self) -> str:
        return ", ".join(f"{k} {v:,}" for k, v in self.stats.rejects_by_reason.items())


def model_argument(meta: dict) -> tuple[str, str | None]:
    """The ``--model`` that makes this data again, as the run resolved it, and a note on it (None: none needed).

    The bundled model is named by its own name: its weights are a conversion of a GGUF, not the Hub model whose id the
    metadata records (passing that id resolves to the same conversion, but a reader would take it for the Hub weights).
    A Hub model is its id; a local folder is its folder's name (its path is the machine's that made the data), with its
    content hash to check a copy by.
    """
    from distill.models import BUNDLED_GGUF, BUNDLED_HUB_ID, DEFAULT_MODEL, LOCAL_REVISIONS

    model = meta.get("model") or {}
    name, model_id = model.get("name"), model.get("id") or (meta.get("config_key") or {}).get("model_id")
    revision = str(model.get("revision") or "")
    local = revision.startswith(LOCAL_REVISIONS)
    if name == DEFAULT_MODEL or (name is None and model_id == BUNDLED_HUB_ID and local):  # data made before "name" was kept
        return DEFAULT_MODEL, f"distill's bundled conversion of {Path(BUNDLED_GGUF).name}"
    if local:
        return Path(str(name or model_id)).name, f"a local folder, revision {revision}"
    return str(model_id), None


def reproduce_command(meta: dict, totals: dict | None = None) -> str:
    """The shell command(s) that rebuild the dataset from its recorded config (``totals``: its manifest's,
    from which a ``--limit`` is recovered: rows past the limit are counted as skipped, ``samples`` rows per seed row)."""
    totals = totals or {}
    samples = totals.get("samples", 1)
    limit = totals["seed_rows"] - totals["skipped"] // samples if totals.get("skipped") and "seed_rows" in totals else None
    derived = meta.get("derived") or {}
    chain = []
    d = derived
    while d:
        chain.append(d)
        d = d.get("from") or {}
    origin = chain[-1] if chain else {}
    model, note = model_argument(meta)
    if origin.get("op") == "convert" or meta.get("teacher") is None:
        seed = (meta.get("seed") or {}).get("spec", "SEED")
        limit = (meta.get("generation") or {}).get("limit")
        lines = [f"distill data convert {shlex.quote(str(seed))} --format shards --model {shlex.quote(model)}"
                 + (f" --limit {limit}" if limit is not None else "") + " --out data"]
    else:
        key = meta.get("config_key") or {}
        opts = [("model", model), ("seed", key.get("seed")), ("seed-format", key.get("seed_format")),
                ("mode", key.get("mode")), ("turns", key.get("turns")), ("temperature", key.get("temperature")),
                ("top-p", key.get("top_p")), ("max-tokens", key.get("max_new_tokens")),
                ("max-model-len", key.get("max_model_len")), ("teacher-topk", key.get("topk")),
                ("top-k", key.get("top_k")), ("min-p", key.get("min_p")),
                ("repetition-penalty", key.get("repetition_penalty")), ("samples", samples if samples > 1 else None),
                ("random-seed", key.get("sampling_seed")), ("system-prompt", key.get("system_prompt")),
                ("backend", key.get("backend")), ("dtype", key.get("dtype"))]
        opts.append(("limit", limit))
        args = " ".join(f"--{k} {shlex.quote(str(v))}" for k, v in opts if v is not None)
        lines = [f"distill generate {args} --out data"]
    if note:
        lines[0] += f"  # --model: {note}"
    for step in reversed(chain[:-1] if origin.get("op") == "convert" else chain):
        op = step.get("op")
        if op == "split":
            lines.append(f"distill data split data --eval-fraction {step.get('eval_fraction')} --out data-split")
        elif op == "dedupe":
            lines.append(f"distill data dedupe data --match {step.get('mode')} --out data-deduped")
        elif op == "merge":
            lines.append(f"distill data merge {' '.join(shlex.quote(i['path']) for i in step.get('inputs', []))} --out data-merged"
                         "  # inputs made as above")
    return "\n".join(lines)


def card_data(opts: CardOptions, meta: dict, splits: list[SplitCard]):
    """The YAML header as ``huggingface_hub.DatasetCardData``."""
    import datasets
    from datasets.info import DatasetInfo
    from datasets.splits import SplitDict, SplitInfo
    from huggingface_hub import DatasetCardData

    enc = manifest_encoding(meta)
    features = datasets.Features.from_arrow_schema(shard_schema(enc.id_dtype if enc else "uint16"))
    split_dict = SplitDict()
    for s in splits:
        split_dict.add(SplitInfo(name=s.name, num_bytes=s.bytes, num_examples=s.stats.rows))
    info = DatasetInfo(features=features, splits=split_dict, download_size=sum(s.bytes for s in splits),
                       dataset_size=sum(s.bytes for s in splits))
    rows = sum(s.stats.rows for s in splits)
    return DatasetCardData(
        license=opts.license,
        language=opts.language,
        task_categories=["text-generation"],
        size_categories=[size_category(rows)],
        pretty_name=opts.pretty_name or opts.repo_id.split("/")[1],
        tags=["synthetic", "self-distillation", "medusa", "speculative-decoding", "distill"],
        configs=[{"config_name": "default", "data_files": [{"split": s.name, "path": s.files_glob} for s in splits]}],
        dataset_info=info._to_yaml_dict(),
    )


def render_card(opts: CardOptions, meta: dict, splits: list[SplitCard], totals: dict | None = None) -> str:
    """The full README.md: YAML header + body from the template in ``data_cards/``."""
    import jinja2

    template_path = CARDS_DIR / TEMPLATE
    if not template_path.is_file():
        raise ConfigError(f"dataset card template {template_path} is missing")
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(CARDS_DIR), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, autoescape=False)
    data = card_data(opts, meta, splits)
    model = dict({"id": None, "revision": None, "tokenizer_sha256": None, "chat_template_sha256": None}, **(meta.get("model") or {}))
    return env.get_template(TEMPLATE).render(
        yaml_header=data.to_yaml(),
        pretty_name=data.pretty_name,
        repo_id=opts.repo_id,
        model=model,
        model_note=model_argument(meta)[1],
        seed=dict({"spec": None, "format": None}, **(meta.get("seed") or {})),
        sampling=meta.get("sampling"),
        generation=meta.get("generation"),
        backend=meta.get("backend"),
        teacher=meta.get("teacher") if manifest_encoding(meta) else None,
        tool=meta.get("tool", "distill"),
        reproduce=reproduce_command(meta, totals),
        splits=splits,
    )
