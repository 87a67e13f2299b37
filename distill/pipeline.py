"""``distill run PIPELINE.yaml``: the whole loop as resumable, skippable stages.

Terms
-----
stage
    one step of the loop, run through the same library call as its command, writing
    into its own place under the pipeline's ``out`` folder:

    ========== ======================= ==========================================
    generate   ``out/data/``           ``distill generate`` (resumes by id)
    validate   ``out/validate.json``   ``distill data validate`` (must pass)
    split      ``out/split/{train,eval}`` ``distill data split``
    train      ``out/heads/``          ``distill train-heads`` (resumes from its checkpoints)
    calibrate  ``out/calibrate/``      ``distill calibrate`` on ``split/eval`` (tree.json)
    bench      ``out/bench/``          ``distill bench`` with the calibrated tree; with ``lookup: true``
                                       also the lookup proposer (``out/bench/lookup/``), with
                                       ``lookup: data`` drafting from ``split/train``'s n-grams too
    ========== ======================= ==========================================

fingerprint
    SHA-256 of a stage's resolved options, the model and the fingerprint of the
    stage before it: a stage is *up to date* when ``out/pipeline.json`` records it
    complete with the same fingerprint, and is then skipped. Paths inside the run's
    folder count relative to it, so the folder spelled another way (relative or
    absolute, through a link) or moved keeps its fingerprints. A changed option
    changes its stage's fingerprint and every later one's; their old outputs are
    moved aside to ``out/stale/`` (never deleted) and the stages run again.
resume
    a stage that was interrupted is run again: ``generate`` and ``train`` continue
    from what they wrote (ids already generated, the latest checkpoint), so the
    final artifacts are those of an uninterrupted run; the short stages
    (validate, split, calibrate, bench) start over from a clean folder.
check
    before the first stage starts (and before the ``out`` folder is made), every
    stage's config is built from its section (:meth:`Pipeline.check`): an unknown key
    or a bad value in a later stage's section fails the run at once, not after the
    stages before it ran.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from distill.configs import check_types, config_from_options, parse_value, read_yaml_mapping
from distill.errors import ConfigError, StoreError, check_choice
from distill.store.atomic import atomic_write_json

#: bench's ``lookup``: off, the lookup proposer on each prompt's context (true / "context"), or with the run's
#: training split as its datastore too ("data").
LOOKUP_CHOICES = (False, True, "context", "data")
STAGES = ("generate", "validate", "split", "train", "calibrate", "bench")
STATE_FILE = "pipeline.json"
# Where each stage writes, relative to the pipeline's out folder.
OUTPUTS = {"generate": "data", "validate": "validate.json", "split": "split", "train": "heads",
           "calibrate": "calibrate", "bench": "bench"}
# Options the pipeline decides itself (paths that chain the stages): a section may not set them.
OWNED = {"generate": {"out"}, "split": {"out"}, "train": {"data", "out", "resume"},
         "calibrate": {"heads", "data", "out"}, "bench": {"heads", "out"}}


def parse_set(item: str) -> tuple[str, str, object]:
    """``STAGE.KEY=VALUE`` -> (stage, key, value); the value is read as YAML (``2`` is an int, ``a,b`` a string)."""
    head, eq, raw = item.partition("=")
    stage, dot, key = head.strip().partition(".")
    if not eq or not dot or not stage or not key:
        raise ConfigError(f"--set takes STAGE.KEY=VALUE (e.g. train.steps=20); got '{item}'")
    sections = ("run", *STAGES)
    if stage not in sections:
        raise ConfigError(f"--set {item}: unknown section '{stage}'; options live in {', '.join(sections)}")
    return stage, key.strip().replace("-", "_"), parse_value(item, raw)


@dataclass
class PipelineConfig:
    """A pipeline file: ``run:`` (out, model) plus one section of options per stage."""

    out: str = "out/quickstart"
    model: str | None = None  # None: the bundled SmolLM2-135M-Instruct, for every stage
    generate: dict = field(default_factory=dict)
    split: dict = field(default_factory=lambda: {"eval_fraction": 0.1})
    train: dict = field(default_factory=dict)
    calibrate: dict = field(default_factory=dict)
    bench: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for stage, owned in OWNED.items():
            section = getattr(self, stage)
            if not isinstance(section, dict):
                raise ConfigError(f"pipeline section '{stage}' must be a mapping of options")
            setattr(self, stage, {k.replace("-", "_"): v for k, v in section.items()})
            clash = sorted(owned & set(getattr(self, stage)))
            if clash:
                raise ConfigError(f"pipeline section '{stage}' sets {', '.join(clash)}: the pipeline sets those itself under 'run: out'")
        check_choice("bench: lookup", self.bench.get("lookup", False), LOOKUP_CHOICES, repr_value=True,
                     note=" (data: the lookup proposer with the run's training split as its datastore)")

    @classmethod
    def from_yaml(cls, path: Path, overrides: dict | None = None, sets: Sequence[str] = ()) -> "PipelineConfig":
        """The file, then ``overrides`` of ``run:`` (out, model), then ``sets`` (``STAGE.KEY=VALUE``, value read as YAML)."""
        doc = read_yaml_mapping(path)
        for item in sets:
            stage, key, value = parse_set(item)
            if stage == "run":
                doc.setdefault("run", {})
            section = doc.get(stage) or {}
            if not isinstance(section, dict):
                raise ConfigError(f"{path}: section '{stage}' must be a mapping of options")
            section[key] = value
            doc[stage] = section
        unknown = sorted(set(doc) - {"run", *STAGES})
        if unknown:
            raise ConfigError(f"{path}: unknown section(s) {', '.join(unknown)}; sections are run, {', '.join(STAGES)}")
        if doc.get("validate"):
            raise ConfigError(f"{path}: the validate stage takes no options (it runs `distill data validate` on the "
                              "generated data); remove its section")
        run = doc.get("run") or {}
        if not isinstance(run, dict):
            raise ConfigError(f"{path}: section 'run' must be a mapping of options (out, model)")
        run = dict(run)
        run.update({k: v for k, v in (overrides or {}).items() if v is not None})
        bad = sorted(set(run) - {"out", "model"})
        if bad:
            raise ConfigError(f"{path}: unknown run option(s) {', '.join(bad)}; 'run:' takes out and model")
        return cls(**check_types(cls, run, "run"), **{s: doc.get(s) or {} for s in ("generate", "split", "train", "calibrate", "bench")})


@dataclass
class SplitOptions:
    """The split stage's section (``distill data split``'s options), checked with the other sections before any stage runs."""

    eval_fraction: float = 0.1
    by: str = "id"

    def __post_init__(self) -> None:
        from distill.data.transform import SPLIT_KEYS

        if not 0 < self.eval_fraction < 1:
            raise ConfigError(f"split: eval_fraction must be in (0, 1); got {self.eval_fraction}")
        check_choice("split: by", self.by, SPLIT_KEYS)


@dataclass
class StageReport:
    stage: str
    status: str  # "ran" | "skipped"
    seconds: float
    output: str
    summary: dict = field(default_factory=dict)


@dataclass
class PipelineReport:
    out: str
    stages: list[StageReport]
    result: dict  # the headline numbers: tokens/step, speedup, per acceptance mode


class Pipeline:
    """Runs the stages of a :class:`PipelineConfig` in order (see the module docstring)."""

    def __init__(self, cfg: PipelineConfig, progress: Callable[[str], None] | None = None):
        self.cfg = cfg
        self.out = Path(cfg.out)
        self.say = progress or (lambda msg: None)

    # -- paths and state ------------------------------------------------------------------
    def path(self, stage: str) -> Path:
        return self.out / OUTPUTS[stage]

    def options(self, stage: str) -> dict[str, Any]:
        """The stage's resolved options: its section plus the paths that chain the stages."""
        model = {"model": self.cfg.model}
        if stage == "generate":
            return {**self.cfg.generate, **model, "out": str(self.path("generate"))}
        if stage == "validate":
            return {"data": str(self.path("generate"))}
        if stage == "split":
            return {"eval_fraction": 0.1, "by": "id", **self.cfg.split, "data": str(self.path("generate")), "out": str(self.path("split"))}
        if stage == "train":
            return {**self.cfg.train, **model, "data": str(self.path("split") / "train"), "out": str(self.path("train"))}
        if stage == "calibrate":
            return {**self.cfg.calibrate, **model, "heads": str(self.path("train")), "data": str(self.path("split") / "eval"),
                    "out": str(self.path("calibrate"))}
        return {**self.cfg.bench, **model, "heads": str(self.path("train")), "tree": str(self.path("calibrate") / "tree.json"),
                "out": str(self.path("bench"))}

    def check(self) -> None:
        """Build every stage's config now, from its section and the paths that chain the stages (outputs not made yet
        stand there as the paths they will have): an unknown key or a bad value in any section is a one-line error
        before the first stage starts, not after the stages before it ran."""
        for stage in STAGES:
            self.stage_configs(stage)

    def stage_configs(self, stage: str) -> list:
        """The configs ``stage`` runs with (bench: with ``lookup``, a second one for the lookup proposer; validate: none)."""
        o = self.options(stage)
        if stage == "generate":
            from distill.generate import GenerateConfig

            return [GenerateConfig.from_dict(o)]
        if stage == "split":
            return [config_from_options(SplitOptions, self.cfg.split, "split")]
        if stage == "train":
            from distill.train.config import TrainConfig

            return [TrainConfig.from_dict({"save_every": 10, **o, "resume": True})]
        if stage == "calibrate":
            from distill.train.config import CalibrateConfig

            return [config_from_options(CalibrateConfig, o, "calibrate")]
        if stage == "bench":
            from distill.bench.config import BenchConfig

            if "modes" in o and isinstance(o["modes"], str):
                o["modes"] = tuple(m.strip() for m in o["modes"].split(",") if m.strip())
            lookup = o.pop("lookup", False)  # one of LOOKUP_CHOICES (checked with the file)
            configs = [config_from_options(BenchConfig, o, "bench")]
            if lookup:  # the same prompts with the lookup proposer, nothing trained: the context alone, or with the
                # n-grams of the data the heads trained on as its datastore
                store = {"lookup_data": str(self.path("split") / "train")} if lookup == "data" else {}
                o = dict(o, heads="lookup", tree=None, tree_acceptance=False, out=str(Path(o["out"]) / "lookup"), **store)
                configs.append(config_from_options(BenchConfig, o, "bench"))
            return configs
        return []

    def _portable(self, options: dict[str, Any]) -> dict[str, Any]:
        """``options`` with paths under the run's folder written as ``<out>/...`` (see fingerprint)."""
        out = str(self.out)
        return {k: "<out>" + v[len(out):] if isinstance(v, str) and (v == out or v.startswith(out + "/")) else v
                for k, v in options.items()}

    def fingerprints(self) -> dict[str, str]:
        prints, before = {}, ""
        for stage in STAGES:
            doc = json.dumps({"stage": stage, "options": self._portable(self.options(stage)), "before": before},
                             sort_keys=True, default=str)
            before = prints[stage] = hashlib.sha256(doc.encode()).hexdigest()
        return prints

    def _state(self) -> dict:
        p = self.out / STATE_FILE
        if not p.is_file():
            return {}
        try:
            return json.loads(p.read_text()).get("stages", {})
        except ValueError:
            raise StoreError(f"{p} is not valid JSON; move it aside to run every stage again") from None

    def _save_state(self, state: dict) -> None:
        doc = {"format": "distill-pipeline/v1", "config": asdict(self.cfg), "stages": state}
        atomic_write_json(self.out / STATE_FILE, doc)

    def _set_aside(self, stage: str, old_print: str) -> None:
        p = self.path(stage)
        if p.exists():
            dest = self.out / "stale" / f"{p.name}-{old_print[:12]}"
            dest.parent.mkdir(parents=True, exist_ok=True)
            if dest.exists():
                shutil.rmtree(dest) if dest.is_dir() else dest.unlink()
            p.rename(dest)
            self.say(f"{stage}: its config changed; the old {p.name} is kept in {dest}")

    def _clear(self, stage: str) -> None:
        p = self.path(stage)
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()

    # -- running --------------------------------------------------------------------------
    def run(self, stages: tuple[str, ...] = STAGES) -> PipelineReport:
        unknown = sorted(set(stages) - set(STAGES))
        if unknown:
            raise ConfigError(f"unknown stage(s) {', '.join(unknown)}; stages are {', '.join(STAGES)}")
        self.check()
        self.out.mkdir(parents=True, exist_ok=True)
        prints, state = self.fingerprints(), self._state()
        reports = []
        for stage in STAGES:
            if stage not in stages:
                continue
            rec = state.get(stage, {})
            if rec.get("complete") and rec.get("fingerprint") == prints[stage]:
                self.say(f"{stage}: up to date ({self.path(stage)})")
                reports.append(StageReport(stage, "skipped", 0.0, str(self.path(stage)), rec.get("summary", {})))
                continue
            if rec.get("fingerprint") and rec["fingerprint"] != prints[stage]:
                self._set_aside(stage, rec["fingerprint"])
            state[stage] = {"fingerprint": prints[stage], "complete": False}
            self._save_state(state)
            self.say(f"{stage}: running -> {self.path(stage)}")
            t0 = time.monotonic()
            summary = getattr(self, f"_{stage}")(self.options(stage), *self.stage_configs(stage))
            seconds = time.monotonic() - t0
            state[stage] = {"fingerprint": prints[stage], "complete": True, "seconds": round(seconds, 1), "summary": summary}
            self._save_state(state)
            reports.append(StageReport(stage, "ran", seconds, str(self.path(stage)), summary))
        return PipelineReport(str(self.out), reports, state.get("bench", {}).get("summary", {}))

    # -- the stages (each one library call) ---------------------------------------------------
    def _generate(self, o: dict, cfg) -> dict:
        from distill.generate import Generator

        s = Generator(cfg).run()
        if not s.balanced:
            raise StoreError(f"generate ended with {s.pending} conversations pending; run the pipeline again to continue")
        return {"generated": s.generated, "rejected": s.rejected, "generated_tokens": s.generated_tokens}

    def _validate(self, o: dict) -> dict:
        from distill.data.validate import validate_dataset

        report = validate_dataset(o["data"])
        summary = {"ok": report.ok, "problems": [str(p) for p in report.problems[:50]]}
        atomic_write_json(self.path("validate"), summary)
        if not report.ok:
            raise StoreError(f"{o['data']} failed validation ({len(report.problems)} problems, see {self.path('validate')})")
        return {"ok": True}

    def _split(self, o: dict, cfg: SplitOptions) -> dict:
        from distill.data.transform import split

        self._clear("split")  # an interrupted split starts over (it is deterministic)
        return split(o["data"], o["out"], eval_fraction=cfg.eval_fraction, by=cfg.by).to_dict()

    def _train(self, o: dict, cfg) -> dict:
        from distill.train import train
        from distill.train.checkpoint import latest_checkpoint

        out = Path(o["out"])
        if out.exists() and latest_checkpoint(out) is None:
            shutil.rmtree(out)  # interrupted before its first checkpoint: nothing to continue from
        s = train(cfg, progress=False)
        if s.stopped_early:
            raise StoreError(f"training stopped at step {s.steps}; run the pipeline again to continue")
        return {"steps": s.steps, "tokens": s.tokens, "final": s.final}

    def _calibrate(self, o: dict, cfg) -> dict:
        from distill.train.calibrate import calibrate

        self._clear("calibrate")
        r = calibrate(cfg)
        return {"nodes": r.nodes, "expected_acceptance_length": r.expected_acceptance_length, "top1": r.top1}

    def _bench(self, o: dict, cfg, lookup_cfg=None) -> dict:
        from distill.bench import run_benches

        self._clear("bench")
        # the lookup proposer on the same prompts (stage_configs) in the same pass: plain decoding (and vLLM) once
        results = run_benches([cfg] + ([lookup_cfg] if lookup_cfg is not None else []))
        result = results[0][0]
        summary = {"tree_nodes": result.tree.get("nodes"), "overall": _overall(result), "drafter": _drafter(result)}
        if lookup_cfg is not None:
            summary["lookup"] = _overall(results[1][0])
            summary["lookup_source"] = "context and data" if lookup_cfg.decoding.lookup_data else "context"
        return summary


def _drafter(result) -> dict:
    """The trained drafter as the policy saw it: its proposer, the full tree's measured tokens per step (with the
    bench's ``tree_acceptance``), this machine's break-even, the nodes the policy used at batch 1, and what the tree's
    tokens per step would give at a GPU's measured step costs (:mod:`distill.bench.predict`, a prediction)."""
    from distill.bench.predict import predict

    tree = result.tree
    even = tree.get("break_even_at_batch_1") or {}
    tau = tree.get("full_tree_tokens_per_step")
    out = {"proposer": tree.get("proposer"), "nodes": tree.get("nodes"), "depth": tree.get("depth"),
           "full_tree_tokens_per_step": tau, "break_even_tokens_per_step": even.get("tokens_per_step"),
           "nodes_used_at_batch_1": tree.get("nodes_used_at_batch_1")}
    if tau is not None and tree.get("proposer") and tree.get("nodes"):
        p = predict(tree["proposer"], tree["nodes"], tau, tree.get("depth"))
        out["gpu_prediction"] = {"step_ratio": p.step_ratio, "speedup": p.speedup, "text": p.describe()}
    return out


def _overall(result) -> dict:
    """The bench's "all prompts" figures per acceptance mode (with ``vllm: true``: against bare vLLM too)."""
    out = {}
    for g in result.groups:
        if g.category == "all":
            out[g.acceptance] = {"tokens_per_step": g.acceleration_rate, "step_overhead": g.step_overhead, "speedup": g.speedup,
                                 "plain_tokens_per_s": g.plain_tokens_per_s, "medusa_tokens_per_s": g.medusa_tokens_per_s}
            if g.vllm_tokens_per_s is not None:
                out[g.acceptance].update(vllm_tokens_per_s=g.vllm_tokens_per_s, plain_vs_vllm=g.plain_vs_vllm,
                                         medusa_vs_vllm=g.medusa_vs_vllm)
    return out
