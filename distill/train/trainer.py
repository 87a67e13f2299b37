"""The ``distill train-heads`` trainer: Medusa-1 / Medusa-2 heads or an EAGLE-3 drafter, with accelerate.

One loop serves every architecture (data, packing, optimizer, lr schedule, gradient
accumulation, checkpoints, exact resume, metrics, outputs); what differs is a *train
module* built by :func:`build_module`: :class:`HeadsTrainModule` here (Medusa) or
:class:`distill.train.eagle.EagleTrainModule`. A train module has

``forward(batch, step) -> (loss, [TermStats])``  the loss of one micro-batch at optimizer step ``step``: its share of
                                                the step's mean when the batch holds the step's counts (``STEP_COUNTS``)
``counts(batch, step) -> (n,)``                 the targets of each loss term in ``batch`` (what the mean divides by)
``term_names``                                  one name per stats entry (metrics ``{name}_loss``, ...)
``progress_metric``                             the record key the progress display shows
``param_groups() -> [dict]``                    optimizer groups of its trainable parameters
``record(step, sums) -> dict``                  its metrics from the summed stats of a step
``identity() -> dict``                          what a --resume must find unchanged beyond the config
``save(out, extra, final)``                     its files (``extra``: the shared metadata; ``final`` False: OUT/best,
                                                mid-run)

Terms
-----
Medusa-1
    the backbone is frozen (its hidden states are computed without grad); only the
    heads train, on ``L_medusa1 = Σ_k decay^k · CE_k`` (hard or soft targets).
Medusa-2
    LoRA adapters on the backbone train together with the heads on
    ``L = L_LM + λ0 · L_medusa1``; ``L_LM = KL(p_teacher || p_student)`` of the base
    LM head against the stored teacher top-k (tail bucket included). The heads'
    learning rate is ``heads_lr_ratio`` (4) × the backbone's.
λ0 schedule
    ``sine``: λ0 · sin(π/2 · min(1, (step + 1) / lambda0_warmup)) at 0-based optimizer step
    ``step``; ``two-stage``: for the
    first ``lambda0_warmup`` steps the backbone is frozen and only ``L_medusa1``
    trains the heads, then the joint loss with λ0; ``constant``: λ0 throughout.
step
    one optimizer step = ``grad_accum`` micro-batches on every process: the global batch, whose
    loss is the mean over all its targets however it is split across processes and micro-batches
    (:mod:`distill.train.distributed`, which also shards the frozen target under FSDP).
evaluation
    every ``eval_every`` steps and at the end, the drafter measured on held-out rows as
    ``distill calibrate`` measures it (:mod:`distill.train.evaluate`); the best weights by its
    simulated acceptance length are kept in ``OUT/best``.
divergence
    a step whose loss (or gradient norm) is not finite ends the run with a one-line error
    before the optimizer applies it; weights are checked finite before every checkpoint and
    the final save, and checkpoints are checked (SHA-256 per file, finite tensors) before a
    resume reads them (:mod:`distill.train.checkpoint`).
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import importlib.util
import json
import logging
import math
import os
import random
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from distill.errors import ConfigError
from distill.progress import Progress
from distill.heads.model import HEADS_MARKERS, TRAINED_FC_BIAS, HeadsConfig, MedusaHeads, portable_meta
from distill.store.atomic import StagedFiles, atomic_write_bytes
from distill.train import checkpoint as ckpt
from distill.runtime import Placement, dataset_dtype, stage_dtype
from distill.train.config import NO_EVAL, PRECISION_DTYPES, TrainConfig
from distill.train.evaluate import BEST, EvalResult, Evaluator, better, data_sides
from distill.train.draft_vocab import choose_draft_vocab, generated_token_counts, special_token_ids
from distill.train.eagle import build_eagle_module
from distill.store import manifest_encoding
from distill.store.location import recorded_location
from distill.store.shards import check_shards
from distill.train.data import collate, count_tokens, dataset_meta, decoder_inputs, iter_items
from distill.train.distributed import (
    all_sum, broadcast_module, move_except, same_everywhere, shard_target, sharding_plan, sum_gradients,
)
from distill.train.evaluate import drafter_of
from distill.train.losses import STEP_COUNTS, Term, TermStats, chunked_term_losses, head_weights, term_counts

METRICS_FILE = "metrics.jsonl"
TRAIN_META_FILE = "distill-train.json"
TENSORBOARD_DIR = "tensorboard"  # OUT/tensorboard: the TensorBoard tracker's event files
SPLIT_OPTIONS = ("batch_size", "grad_accum")  # how the global batch is split: a --resume may change them, not their product


def joint_at(cfg: TrainConfig, step: int) -> bool:
    """Whether step ``step`` trains the backbone (Medusa-2 outside stage 1 of the two-stage schedule)."""
    return cfg.mode == "medusa2" and not (cfg.lambda0_schedule == "two-stage" and step < cfg.lambda0_warmup)


def lambda0_at(cfg: TrainConfig, step: int) -> float:
    """λ0 at optimizer step ``step`` (0-based); 0 means stage 1 of the two-stage schedule."""
    w = cfg.lambda0_warmup
    if cfg.lambda0_schedule == "constant" or w == 0:
        return cfg.lambda0
    if cfg.lambda0_schedule == "two-stage":
        return 0.0 if step < w else cfg.lambda0
    return cfg.lambda0 * math.sin(0.5 * math.pi * min(1.0, (step + 1) / w))


def lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warm-up then cosine decay to 0 over ``total`` steps."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


class HeadsTrainModule(nn.Module):
    """Backbone + Medusa heads; ``forward(batch, step)`` returns the loss and per-term stats."""

    def __init__(self, backbone: nn.Module, heads: MedusaHeads, cfg: TrainConfig):
        super().__init__()
        self.backbone = backbone
        self.heads = heads
        self.cfg = cfg
        self.register_buffer("weights", head_weights(heads.config.num_heads, cfg.decay), persistent=False)
        self.term_names = [f"head{k + 1}" for k in range(heads.config.num_heads)] + (["lm"] if cfg.mode == "medusa2" else [])
        self.progress_metric = "head1_top1"

    def param_groups(self) -> list[dict]:
        """Heads at ``lr``; LoRA (Medusa-2) at ``lr / heads_lr_ratio``."""
        cfg = self.cfg
        groups = [{"params": [p for p in self.heads.parameters() if p.requires_grad], "lr": cfg.lr, "name": "heads"}]
        lora = [p for p in self.backbone.parameters() if p.requires_grad]
        if lora:
            groups.append({"params": lora, "lr": cfg.lr / cfg.heads_lr_ratio, "name": "lora"})
        return groups

    def identity(self) -> dict:
        return {}

    def hidden_states(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Last hidden state after the final norm (what the LM head reads): (B, T, H)."""
        decoder = self.backbone.get_decoder()
        return decoder(input_ids=batch["input_ids"], use_cache=False, **decoder_inputs(batch)).last_hidden_state

    def terms(self, with_lm: bool) -> list[Term]:
        kind = "soft" if self.cfg.targets == "soft" else "hard"
        out = [Term(lambda h, k=k: self.heads.head_logits(h, k), offset=k + 2, kind=kind) for k in range(self.heads.config.num_heads)]
        if with_lm:
            lm = self.backbone.get_output_embeddings()
            out.append(Term(lambda h: lm(h), offset=1, kind="kl"))
        return out

    def counts(self, batch: dict[str, torch.Tensor], step: int) -> torch.Tensor:
        """The targets of each term at step ``step`` in ``batch`` (the heads', then the LM's): (n,) float64."""
        return term_counts(self.terms(with_lm=joint_at(self.cfg, step)), batch["input_ids"], batch["loss_mask"],
                           batch["teacher_ids"], batch["teacher_lp"], segment_ids=batch.get("segment_ids"))

    def forward(self, batch: dict[str, torch.Tensor], step: int) -> tuple[torch.Tensor, list[TermStats]]:
        """Medusa-2 outside stage 1 (backbone trains, ``L_LM + λ0 · L_medusa1``); else ``L_medusa1`` on a frozen backbone."""
        joint = joint_at(self.cfg, step)
        lam = lambda0_at(self.cfg, step) if self.cfg.mode == "medusa2" else 1.0
        if joint:
            hidden = self.hidden_states(batch)  # (B, T, H)
        else:
            with torch.no_grad():
                hidden = self.hidden_states(batch).detach()  # (B, T, H)
        hidden = hidden.to(self.heads.lm_heads[0].weight.dtype)
        losses, stats = chunked_term_losses(
            hidden, self.terms(with_lm=joint), batch["input_ids"], batch["loss_mask"],
            batch["teacher_ids"], batch["teacher_lp"], chunk=self.cfg.loss_chunk, segment_ids=batch.get("segment_ids"),
            counts=batch.get(STEP_COUNTS),
        )  # (K,) or (K+1,) with the LM term last
        K = self.heads.config.num_heads
        medusa1 = (losses[:K] * self.weights).sum()
        loss = losses[K] + lam * medusa1 if joint else medusa1
        return loss, stats

    def record(self, step: int, sums: np.ndarray) -> dict:
        """Per-head loss / top-1 / top-5; Medusa-2 also λ0 and the LM's KL / top-1."""
        cfg, K = self.cfg, self.heads.config.num_heads
        rec = {}
        if cfg.mode == "medusa2":
            rec["lambda0"] = lambda0_at(cfg, step)
            if sums[K, 3] > 0:
                rec["lm_kl"] = sums[K, 0] / sums[K, 3]
                rec["lm_top1"] = sums[K, 1] / sums[K, 3]
        for k in range(K):
            n = max(sums[k, 3], 1.0)
            rec[f"head{k + 1}_loss"] = sums[k, 0] / n
            rec[f"head{k + 1}_top1"] = sums[k, 1] / n
            rec[f"head{k + 1}_top5"] = sums[k, 2] / n
        return rec

    def save(self, out: Path, extra: dict, final: bool = True) -> None:
        """The vLLM Medusa folder; Medusa-2 also its LoRA adapter (and, at the end of the run, the merged model with
        --merge-adapter: merging ends the training of the adapter, so a save during training never merges)."""
        cfg = self.cfg
        extra = {**extra, "arch": "medusa"}
        with StagedFiles(out, HEADS_MARKERS) as stage:
            if cfg.mode == "medusa2":
                backbone = self.backbone
                backbone.save_pretrained(str(stage.path / "adapter"), safe_serialization=True)
                extra["adapter"] = "adapter"
                if cfg.merge_adapter and final:
                    merged = backbone.merge_and_unload()
                    merged.save_pretrained(str(stage.path / "merged"), safe_serialization=True)
                    from transformers import AutoTokenizer

                    AutoTokenizer.from_pretrained(extra["base_model"]["path"]).save_pretrained(str(stage.path / "merged"))
                    extra["merged_model"] = "merged"
            self.heads.float().write_files(stage.path, extra=portable_meta(extra, out))


@dataclass
class TrainSummary:
    out: str
    steps: int
    tokens: int
    seconds: float
    tokens_per_s: float
    peak_memory_mb: float
    final: dict = field(default_factory=dict)
    stopped_early: bool = False
    draft_vocab: dict = field(default_factory=dict)  # eagle3: the draft vocabulary's report (size, coverage, ...)
    eval_seconds: float = 0.0  # spent on held-out evaluations (not in ``seconds`` nor in the rate)
    last_eval: dict = field(default_factory=dict)  # the last evaluation: step, tree, chain (expected tokens/step)
    best_eval: dict = field(default_factory=dict)  # the best one, whose weights are in ``best``
    best: str = ""  # OUT/best when an evaluation ran
    processes: int = 1  # that trained together (accelerate launch)
    sharded_target: bool = False  # the frozen target sharded across them (FSDP2)


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def load_backbone(model_path: Path, device: torch.device, bf16: bool):
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if bf16 else torch.float32
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device)


def build_heads(backbone, cfg: TrainConfig) -> MedusaHeads:
    """Fresh heads for ``backbone`` (biased residual layers, every LM head a copy of the backbone's)."""
    conf = backbone.config
    lm = backbone.get_output_embeddings().weight
    hcfg = HeadsConfig(hidden_size=conf.hidden_size, vocab_size=lm.shape[0], num_heads=cfg.heads,
                       num_layers=cfg.layers, share_lm_head=cfg.share_lm_head, bias=TRAINED_FC_BIAS)
    return MedusaHeads(hcfg, lm_head_weight=lm.detach().float())


def build_module(backbone, cfg: TrainConfig, data: Path | str, model_path: Path) -> nn.Module:
    """The train module of ``cfg.arch`` around a frozen backbone (Medusa-2 adds its LoRA adapters here)."""
    if cfg.arch == "eagle3":
        vocab_size = backbone.get_output_embeddings().weight.shape[0]
        vocab, report = choose_draft_vocab(generated_token_counts(data, vocab_size), cfg.draft_vocab, special_token_ids(model_path))
        return build_eagle_module(backbone, cfg, vocab, report)
    heads = build_heads(backbone, cfg)
    if cfg.mode == "medusa2":
        backbone = add_lora(backbone, cfg)
        if cfg.gradient_checkpointing:
            backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        backbone.train()
    else:
        backbone.eval()
    return HeadsTrainModule(backbone, heads, cfg)


def add_lora(backbone, cfg: TrainConfig):
    from peft import LoraConfig, get_peft_model

    targets = cfg.lora_targets if cfg.lora_targets == "all-linear" else [t.strip() for t in cfg.lora_targets.split(",") if t.strip()]
    lcfg = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout, target_modules=targets,
                      task_type="CAUSAL_LM")
    return get_peft_model(backbone, lcfg)


def _make_optimizer(groups: list[dict], cfg: TrainConfig, device: torch.device):
    if cfg.optimizer == "adamw8bit":  # only when asked: "auto" is AdamW whatever happens to be installed
        if not _has_bnb() or device.type != "cuda":
            raise ConfigError("--optimizer adamw8bit needs bitsandbytes and a GPU (pip install bitsandbytes)")
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(groups, weight_decay=cfg.weight_decay), "adamw8bit"
    return torch.optim.AdamW(groups, weight_decay=cfg.weight_decay), "adamw"


def _has_bnb() -> bool:
    import importlib.util

    return importlib.util.find_spec("bitsandbytes") is not None


def count_items(data: Path | str, max_len: int, context: int = 0, pack: bool = False, shuffle_buffer: int = 0, seed: int = 0) -> int:
    """Items (windows, or packed rows) in epoch 0 (packed epochs can differ by a row or so: the shuffle changes the packing)."""
    return sum(1 for _ in iter_items(data, max_len, 0, seed, shuffle_buffer, context, pack))


def step_seed(seed: int, step: int, rank: int) -> int:
    """The torch seed of optimizer step ``step`` on process ``rank``: what it draws (Medusa-2's LoRA dropout) is its own,
    and the same after a resume, whatever process count the run had before."""
    return int(np.random.SeedSequence([seed, step, rank]).generate_state(1)[0])


@dataclass
class _Setup:
    """What one run trains with: the accelerator's view, the module and its optimizer, the step budget."""

    accelerator: object
    module: nn.Module  # as prepared by accelerate (DDP-wrapped on several processes unless the target is sharded)
    core: nn.Module  # the train module itself
    optimizer: torch.optim.Optimizer
    opt_name: str
    base_lrs: list[float]
    trainable: dict[str, torch.Tensor]
    total: int  # optimizer steps of the whole run
    sharded: bool = False  # the frozen target sharded across the processes (FSDP2); the drafter replicated, not DDP-wrapped

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    @property
    def world(self) -> int:
        return self.accelerator.num_processes

    @property
    def global_batch(self) -> int:
        """Items per optimizer step, all processes together."""
        return self.core.cfg.batch_size * self.core.cfg.grad_accum * self.world


class _Dealer:
    """Deals the global batch (:mod:`distill.train.distributed`): each micro-batch takes the next ``batch_size`` x
    processes items of the stream, of which this process collates its ``batch_size``; epochs follow one another
    without a seam.

    ``epoch`` and ``items`` (consumed in this epoch, all processes together) are what a checkpoint stores to resume the
    stream, in any number of processes.
    """

    def __init__(self, cfg: TrainConfig, data: Path | str, world: int, rank: int, epoch: int, items: int):
        self.cfg, self.data, self.world, self.rank = cfg, data, world, rank
        self.epoch, self.items = epoch, items
        self.stream = self._stream(skip=items)

    def _stream(self, skip: int = 0):
        c = self.cfg
        return itertools.islice(iter_items(self.data, c.max_len, self.epoch, c.seed, c.shuffle_buffer, c.context, c.pack), skip, None)

    def _item(self):
        item = next(self.stream, None)
        if item is None:
            self.epoch, self.items = self.epoch + 1, 0
            self.stream = self._stream()
            item = next(self.stream, None)
            if item is None:
                raise ConfigError(f"{self.data} holds no training window with a generated token")
        self.items += 1
        return item

    def next(self) -> dict:
        """This process's next micro-batch."""
        size, mine = self.cfg.batch_size, []
        for i in range(size * self.world):
            item = self._item()
            if i // size == self.rank:
                mine.append(item)
        return collate(mine)


class _Log:
    """Where a step's record goes on the main process: metrics.jsonl, accelerate's trackers (--report-to), the progress display."""

    def __init__(self, out: Path, accelerator, progress: Progress):
        self.path = out / METRICS_FILE
        self.accelerator = accelerator
        self.main = accelerator.is_main_process
        self.progress = progress

    def record(self, record: dict, write: bool, tokens: int, shown: dict) -> None:
        """``tokens``: this step's, all processes; ``shown``: the fields the progress display carries beside the count."""
        if self.main and write:
            with open(self.path, "a") as f:  # one line per logged step, on disk before the next step starts
                f.write(json.dumps(record) + "\n")
                f.flush()
                os.fsync(f.fileno())
            self.accelerator.log({k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}, step=record["step"])
        self.progress.update(1, tokens=tokens, fields=shown)

    def close(self) -> None:
        self.progress.close()
        for tracker in self.accelerator.trackers:  # not accelerator.end_training(): that also ends the process group
            tracker.finish()


class Trainer:
    """Runs one training run described by a :class:`TrainConfig` (``run()`` returns a :class:`TrainSummary`).

    ``run`` reads as its parts: check the data (:meth:`_check_data`), set up the accelerator,
    model and optimizer (:meth:`_setup`), restore a checkpoint (:meth:`_resume`), then per
    step one optimizer update (:meth:`_step`), its record (:class:`_Log`) and checkpoints
    (:meth:`_checkpoint`); at the end the heads folder (:meth:`_write_outputs`).
    """

    def __init__(self, cfg: TrainConfig, progress: bool | None = None):
        self.cfg = cfg
        self.progress = cfg.progress if progress is None else progress

    def run(self) -> TrainSummary:
        from distill.models import resolve_model

        cfg = self.cfg
        out = Path(cfg.out)
        data, eval_data = data_sides(cfg)  # local folders or object-store URLs; a split folder trains on its train side
        self.data = data
        ds_meta = self._check_data(data, eval_data)
        evaluator = Evaluator(cfg, eval_data) if eval_data is not None else None
        log_with = _log_with(cfg.report_to)
        resolved = resolve_model(cfg.model)
        # The one dtype rule: the data's teacher dtype, bf16 on CPUs only where native (distill.runtime).
        where = stage_dtype(resolved.path, "auto", PRECISION_DTYPES[cfg.precision], dataset_dtype(ds_meta), what=f"the data in {data}",
                            option=f"--precision {cfg.precision}:",
                            effect="the frozen target computes the features the heads learn from in another dtype than "
                                   "the teacher's (serving runs the teacher's dtype)")
        out.mkdir(parents=True, exist_ok=True)
        resume_from = ckpt.latest_checkpoint(out)
        if resume_from is not None and not cfg.resume:
            raise ConfigError(f"{out} already holds checkpoints of a run: pass --resume to continue it or choose another --out")
        if resume_from is not None:
            ckpt.verify_checkpoint(resume_from)  # a changed byte: one line now, before the model loads or anything is written
        main = int(os.environ.get("RANK", "0")) == 0  # under `accelerate launch` RANK says which process is, before the accelerator
        if main:
            ckpt.remove_partials(out)

        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        # the main process shows progress
        progress = Progress("train-heads", "steps", quiet=not self.progress or not main)
        progress.stage(f"loading {resolved.name} ({where.dtype}) to train {cfg.mode if cfg.arch == 'medusa' else cfg.arch} "
                       f"on {data}")
        run = self._setup(resolved.path, ds_meta, where.dtype == "bfloat16", log_with)
        acc = run.accelerator
        if not same_everywhere(int(resume_from.name.split("-")[-1]) if resume_from is not None else -1, run.device, run.world):
            raise ConfigError(f"the processes see different checkpoints in {out} (a copy of it on each machine?): "
                              "--out must be on storage every machine of the run shares")
        step, epoch, items, best = self._resume(run, resume_from) if resume_from is not None else (0, 0, 0, None)
        if resume_from is None:
            bad = ckpt.non_finite(run.trainable)
            if bad is not None:
                raise ConfigError(f"the weights training starts from hold non-finite values (NaN or inf) in {bad}, made from "
                                  f"{resolved.name}'s: its weights are damaged")
            if acc.is_main_process:
                (out / METRICS_FILE).unlink(missing_ok=True)
        _start_trackers(acc, cfg, out, step)

        dealer = _Dealer(cfg, data, acc.num_processes, acc.process_index, epoch, items)
        log = _Log(out, acc, progress)
        t0, tokens_run, last, eval_seconds, last_eval = time.monotonic(), 0, {}, 0.0, None
        stop_at = min(run.total, step + cfg.stop_after) if cfg.stop_after else run.total
        progress.begin(total=run.total, done=step)  # rates from the first step: loading the model is no part of them
        try:
            while step < stop_at:
                step_loss, step_tokens, sums = self._step(run, dealer, step)
                step += 1
                tokens_run += step_tokens
                seconds = time.monotonic() - t0 - eval_seconds
                last = {**_record(step, step_loss, run.optimizer, tokens_run, seconds), **run.core.record(step - 1, sums)}
                evaluated = evaluator is not None and evaluator.due(step, run.total)
                if evaluated:
                    started = time.monotonic()
                    result = self._evaluate(run, evaluator, last, best, (resolved, ds_meta, where))
                    eval_seconds += time.monotonic() - started
                    if result is not None:  # the main process
                        last.update(result.record)
                        last_eval = result.brief()
                        best = last_eval if better(result, best) else best
                log.record(last, write=step % cfg.log_every == 0 or step == stop_at or evaluated, tokens=step_tokens,
                           shown={"loss": f"{step_loss:.3f}", "top-1": f"{last.get(run.core.progress_metric, 0):.3f}"})
                if (cfg.save_every and step % cfg.save_every == 0) or step == stop_at:
                    self._checkpoint(run, step, dealer, best)
        finally:  # the bar ends (off a terminal, the last line) also when a step fails
            log.close()
        seconds = time.monotonic() - t0 - eval_seconds
        summary = TrainSummary(out=str(out), steps=step, tokens=tokens_run, seconds=seconds,
                               tokens_per_s=tokens_run / seconds if seconds > 0 else 0.0,
                               peak_memory_mb=_peak_memory_mb(run.device), final=last, stopped_early=step < run.total,
                               draft_vocab=run.core.report.to_dict() if cfg.arch == "eagle3" else {},
                               eval_seconds=eval_seconds, last_eval=last_eval or {}, best_eval=best or {},
                               best=str(out / BEST) if best else "", processes=run.world, sharded_target=run.sharded)
        if acc.is_main_process and step >= run.total:
            self._write_outputs(run, resolved, ds_meta, summary, where)
        acc.wait_for_everyone()
        return summary

    def _check_data(self, data: Path | str, eval_data: Path | str | None) -> dict:
        """The dataset's metadata, refused where it lacks the teacher top-k the options need (the held-out set checked too)."""
        cfg = self.cfg
        check_shards(data)  # a damaged shard: named in one line now, not as pyarrow's error once the model is loaded
        ds_meta = dataset_meta(data)
        if eval_data is not None:
            check_shards(eval_data)
            vocab, held_out = (m.get("model", {}).get("vocab_size") for m in (ds_meta, dataset_meta(eval_data)))
            if None not in (vocab, held_out) and vocab != held_out:
                raise ConfigError(f"--eval-data {eval_data} was generated with a {held_out}-token vocabulary but {data} with {vocab}: "
                                  "evaluate on data of the same model")
        if manifest_encoding(ds_meta) is None and (cfg.targets == "soft" or cfg.mode == "medusa2"):
            raise ConfigError(
                f"{data} has no teacher top-k (made from seed text): train it with --targets hard"
                + (" --medusa-mode medusa1" if cfg.arch == "medusa" else "")
                + ", or regenerate it with `distill generate` for soft targets and Medusa-2's KL"
            )
        return ds_meta

    def _setup(self, model_path: Path, ds_meta: dict, bf16: bool, log_with: str | None) -> _Setup:
        """The accelerator, the frozen backbone inside the train module, its optimizer, and the run's step budget."""
        from accelerate import Accelerator
        from accelerate.utils import DistributedDataParallelKwargs

        cfg, data = self.cfg, self.data
        on_gpu = torch.cuda.is_available()
        # Medusa-2's two-stage schedule leaves the LoRA parameters without grads in stage 1.
        ddp = DistributedDataParallelKwargs(find_unused_parameters=cfg.mode == "medusa2")
        # bf16 on CPU is autocast (fp32 master weights): faster matmuls on CPUs with AVX512-BF16/AMX.
        accelerator = Accelerator(mixed_precision="bf16" if bf16 else "no", cpu=not on_gpu, kwargs_handlers=[ddp], log_with=log_with,
                                  project_dir=str(cfg.out))
        device = accelerator.device
        sharding = sharding_plan(accelerator, cfg)
        # A target to be sharded is loaded into host memory (with cpu_ram_efficient_loading, on one process of each
        # machine): sharding puts each process's part on its device.
        backbone = load_backbone(model_path, torch.device("cpu") if sharding else device, bf16 and on_gpu)
        vocab = backbone.get_output_embeddings().weight.shape[0]
        ds_vocab = ds_meta.get("model", {}).get("vocab_size")
        if ds_vocab is not None and ds_vocab != vocab:
            raise ConfigError(f"{data} was generated with a {ds_vocab}-token vocabulary but the model has {vocab}: pass the --model that made the data")
        for p in backbone.parameters():
            p.requires_grad_(False)
        module = build_module(backbone, cfg, data, model_path)
        if sharding is not None:
            shard_target(module.backbone, sharding, device, accelerator.num_processes)
            move_except(module, module.backbone, device)
            broadcast_module(drafter_of(module))  # built from the target's weights, which other processes may not have loaded
        else:
            module = module.to(device)
        optimizer, opt_name = _make_optimizer(module.param_groups(), cfg, device)
        base_lrs = [g["lr"] for g in optimizer.param_groups]
        items = count_items(data, cfg.max_len, cfg.context, cfg.pack, cfg.shuffle_buffer, cfg.seed)
        total = cfg.steps or math.ceil(items * cfg.epochs / (cfg.batch_size * cfg.grad_accum * accelerator.num_processes))
        if total < 1 or items == 0:
            raise ConfigError(f"{data} holds no training window with a generated token")
        if sharding is None:
            module, optimizer = accelerator.prepare(module, optimizer)
        core = accelerator.unwrap_model(module)
        trainable = {n: p for n, p in core.named_parameters() if p.requires_grad}
        return _Setup(accelerator, module, core, optimizer, opt_name, base_lrs, trainable, total, sharded=sharding is not None)

    def _resume(self, run: _Setup, checkpoint: Path) -> tuple[int, int, int, dict | None]:
        """Load ``checkpoint`` (same options and data, the same global batch in any number of processes) into the run;
        -> (step, epoch, items dealt in it, best evaluation)."""
        cfg, out = self.cfg, Path(self.cfg.out)
        tensors, opt_sd, doc = ckpt.load_checkpoint(checkpoint)
        saved = {**_defaults(), **doc["config"]}  # a checkpoint from before an option existed ran at its default
        now = cfg.run_key()
        changed = sorted(k for k in now if k not in SPLIT_OPTIONS and saved.get(k) != now[k])
        if changed:
            raise ConfigError(f"--resume: {out} holds a run with different options ({', '.join(changed)}); use the same options or another --out")
        was = doc.get("global_batch", saved["batch_size"] * saved["grad_accum"])
        if was != run.global_batch:
            raise ConfigError(f"--resume: {out} trains on {was} windows a step (--batch-size x --grad-accum x processes) but this launch on "
                              f"{run.global_batch} ({cfg.batch_size} x {cfg.grad_accum} x {run.world}): keep the product the same")
        for key, value in run.core.identity().items():
            if doc.get(key) != value:
                raise ConfigError(f"--resume: {out} was trained with another {key.replace('_', ' ')} (the data changed?); "
                                  "use the same data or another --out")
        with torch.no_grad():
            for n, p in run.trainable.items():
                p.copy_(tensors[n].to(p.device, p.dtype))
        run.optimizer.load_state_dict(opt_sd)
        ckpt.set_rng_state(doc["rng_tensors"], doc["rng"])
        _truncate_metrics(out / METRICS_FILE, doc["step"])
        items = doc["items"] if "items" in doc else doc["batches"] * saved["batch_size"]  # saved before positions counted items
        return doc["step"], doc["epoch"], items, doc.get("best_eval")

    def _step(self, run: _Setup, dealer: _Dealer, step: int) -> tuple[float, int, np.ndarray]:
        """One optimizer update over the global batch (``grad_accum`` micro-batches on every process);
        -> (loss, real tokens, per-term sums), all processes together."""
        cfg, acc = self.cfg, run.accelerator
        torch.manual_seed(step_seed(cfg.seed, step, acc.process_index))
        factor = lr_factor(step, cfg.warmup_steps, run.total)
        for g, base in zip(run.optimizer.param_groups, run.base_lrs):
            g["lr"] = base * factor
        batches = [{k: v.to(run.device) for k, v in dealer.next().items()} for _ in range(cfg.grad_accum)]
        counts = all_sum(sum(run.core.counts(b, step) for b in batches), run.world)  # (n,): each term's targets in the step
        # DDP averages the processes' gradients, so each scales its share of the mean by their number; a sharded
        # target's drafter sums them (sum_gradients).
        scale = 1 if run.sharded else run.world
        sums = np.zeros((len(run.core.term_names), 5))  # per term: loss_sum, top1, top5, count, excluded
        step_loss, step_tokens = 0.0, 0
        for micro, batch in enumerate(batches):
            batch[STEP_COUNTS] = counts
            step_tokens += int(batch["attention_mask"].sum())  # real tokens (padding excluded, packed or not)
            sync = micro == cfg.grad_accum - 1
            with (acc.no_sync(run.module) if not sync and run.world > 1 and not run.sharded else contextlib.nullcontext()), \
                    (acc.autocast() if run.sharded else contextlib.nullcontext()):  # a prepared module autocasts itself
                loss, stats = run.module(batch, step)
                if not loss.requires_grad:  # no term has a target here (e.g. a window whose only reply tokens are its
                    # first two: beyond every head's reach): a zero that still reaches every parameter, so each
                    # process's backward takes part in the gradient exchange
                    loss = loss + sum(p.sum() for p in run.trainable.values()) * 0.0
                acc.backward(loss * scale)
            step_loss += float(loss.detach())
            for i, st in enumerate(stats):
                sums[i] += (st.loss_sum, st.top1, st.top5, st.count, st.excluded)
        if run.sharded:
            sum_gradients(list(run.trainable.values()))
        # One collective for what the step reports: every process's loss share, tokens and term sums (a loss that is not
        # finite anywhere is not finite here, so every process stops at the same step).
        totals = all_sum(torch.tensor([step_loss, step_tokens, *sums.ravel()], dtype=torch.float64, device=run.device), run.world)
        step_loss, step_tokens, sums = float(totals[0]), int(totals[1]), totals[2:].cpu().numpy().reshape(sums.shape)
        if not math.isfinite(step_loss):
            raise ConfigError(_diverged(step + 1, f"the loss is {step_loss}"))
        if not bool(torch.as_tensor(counts).any()):  # nothing to learn in the whole global batch: the weights and the
            run.optimizer.zero_grad(set_to_none=True)  # optimizer's moments stay as they were (Adam would still move)
            return step_loss, step_tokens, sums
        if cfg.max_grad_norm > 0:
            params = list(run.trainable.values())
            clip = torch.nn.utils.clip_grad_norm_ if run.sharded else acc.clip_grad_norm_
            norm = float(clip(params, cfg.max_grad_norm))
            if not math.isfinite(norm):  # the same on every process: the gradients are already averaged
                raise ConfigError(_diverged(step + 1, f"the gradient norm is {norm}"))
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        return step_loss, step_tokens, sums

    def _checkpoint(self, run: _Setup, step: int, dealer: _Dealer, best: dict | None) -> None:
        cfg = self.cfg
        _check_finite(run, step)
        run.accelerator.wait_for_everyone()
        if run.accelerator.is_main_process:
            ckpt.save_checkpoint(Path(cfg.out), step, run.trainable, run.optimizer.state_dict(),
                                 {"epoch": dealer.epoch, "items": dealer.items, "global_batch": run.global_batch,
                                  "processes": run.world, "config": cfg.run_key(), "optimizer_name": run.opt_name,
                                  "best_eval": best, **run.core.identity()})
            ckpt.prune_checkpoints(Path(cfg.out), cfg.keep_checkpoints)

    def _evaluate(self, run: _Setup, evaluator: Evaluator, record: dict, best: dict | None, context: tuple) -> EvalResult | None:
        """After the step of ``record``, the main process measures the drafter and, when it beats ``best``, writes it to
        OUT/best; -> its result (None on the other processes, which wait, or measure alike where the target is sharded:
        its forward needs them all)."""
        acc, result, step = run.accelerator, None, record["step"]
        if acc.is_main_process or run.sharded:
            result = evaluator.run(run.core, step, acc.autocast)
        if acc.is_main_process:
            if better(result, best):
                _check_finite(run, step)
                resolved, ds_meta, where = context
                metrics = {"steps": step, "final": {**record, **result.record}, "best_eval": result.brief()}
                folder = Path(self.cfg.out) / BEST
                run.core.save(folder, self._extra(folder, resolved, ds_meta, where, run.opt_name, metrics), final=False)
        acc.wait_for_everyone()
        return result if acc.is_main_process else None

    def _extra(self, folder: Path, resolved, ds_meta: dict, where: Placement, opt_name: str, metrics: dict) -> dict:
        """distill-heads.json's fields of ``folder``, a folder this run writes (OUT, or OUT/best)."""
        cfg = self.cfg
        config = cfg.to_dict()
        if config["eval_data"] not in ("", NO_EVAL):  # a local path is recorded as --data is: near the folder, or by its name
            config["eval_data"] = portable_meta({"train_config": {"data": config["eval_data"]}}, folder)["train_config"]["data"]
        return {
            "base_model": {"id": resolved.model_id, "revision": resolved.revision, "path": str(resolved.path)},
            "dataset": {"path": recorded_location(self.data), "model": ds_meta.get("model"), "teacher": ds_meta.get("teacher"),
                        **count_tokens(self.data)},
            "train_config": config,
            # Later stages (calibrate, bench, serve) run the model in the teacher's dtype by default.
            "teacher_dtype": dataset_dtype(ds_meta) or where.dtype,
            "precision": {"device": where.device, "dtype": where.dtype, "reason": where.reason},
            "optimizer": opt_name,
            "metrics": metrics,
        }

    def _write_outputs(self, run: _Setup, resolved, ds_meta: dict, summary: TrainSummary, where: Placement) -> None:
        _check_finite(run, summary.steps)
        metrics = {k: v for k, v in summary.__dict__.items() if k != "out"}
        run.core.save(Path(self.cfg.out), self._extra(Path(self.cfg.out), resolved, ds_meta, where, run.opt_name, metrics))


def _record(step, step_loss, optimizer, tokens, seconds) -> dict:
    """The metrics every architecture logs; the train module adds its own (``record``)."""
    return {"step": step, "loss": step_loss, "lr": optimizer.param_groups[0]["lr"], "tokens": tokens,
            "tokens_per_s": tokens / seconds if seconds > 0 else 0.0}


def _defaults() -> dict:
    """Every TrainConfig field's default (the value of an option a checkpoint predates)."""
    from dataclasses import MISSING, fields

    return {f.name: f.default for f in fields(TrainConfig) if f.default is not MISSING}


def _metric_records(path: Path) -> list[dict]:
    """The records of a metrics.jsonl; a torn last line (a run killed while appending it) is dropped with a warning."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(lines) - 1:
                raise
            logging.getLogger("distill.train").warning("%s: dropped its torn last line (the run was killed while writing it): %.60s",
                                                       path, line)
    return records


def _truncate_metrics(path: Path, step: int) -> None:
    """Keep the records of steps up to ``step`` (the checkpoint a resume continues from)."""
    if not path.exists():
        return
    keep = [json.dumps(r) for r in _metric_records(path) if r["step"] <= step]
    atomic_write_bytes(path, "".join(line + "\n" for line in keep).encode())


def read_metrics(out: Path) -> list[dict]:
    """The records of ``out``'s metrics.jsonl, one per logged step ([] when there is none)."""
    path = Path(out) / METRICS_FILE
    return _metric_records(path) if path.exists() else []


def _log_with(report_to: str) -> str | None:
    """accelerate's tracker for --report-to (None: metrics.jsonl only); a missing tensorboard is a warning (the run goes
    on), a missing wandb, asked for by name, an error before the model loads."""
    if report_to == "none":
        return None
    if report_to == "tensorboard":
        try:
            importlib.import_module("torch.utils.tensorboard")  # what accelerate's tracker writes with
        except ImportError:
            logging.getLogger("distill.train").warning("tensorboard is not installed: metrics go to %s only (pip install tensorboard)",
                                                       METRICS_FILE)
            return None
        return "tensorboard"
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError("--report-to wandb needs the wandb package (pip install wandb); or --report-to tensorboard or none")
    return "wandb"


def _start_trackers(acc, cfg: TrainConfig, out: Path, step: int) -> None:
    """Start the trackers of ``acc`` (none: nothing): TensorBoard's event files in OUT/tensorboard (on a resume, the
    events after ``step`` a killed run left are dropped), a W&B run named after OUT; the run's options as their config."""
    if not acc.log_with:
        return
    hparams = {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in cfg.to_dict().items()}
    tensorboard = {"purge_step": step + 1} if step else {}
    acc.init_trackers(TENSORBOARD_DIR if cfg.report_to == "tensorboard" else "distill", config=hparams,
                      init_kwargs={"tensorboard": tensorboard, "wandb": {"name": out.name, "dir": str(out)}})


def _diverged(step: int, what: str) -> str:
    """The one line a diverged run ends with (``step``: 1-based, the step whose loss, gradients or weights were not finite)."""
    return (f"training diverged at step {step}: {what}; nothing was saved from it "
            "(train again into another --out with a lower --lr or more --warmup-steps)")


def _check_finite(run: _Setup, step: int) -> None:
    """Weights about to be saved must be finite: a NaN is an error, never a checkpoint or a drafter folder."""
    bad = ckpt.non_finite(run.trainable)
    if bad is not None:
        raise ConfigError(_diverged(step, f"{bad} holds non-finite values (NaN or inf)"))


def train(cfg: TrainConfig, progress: bool | None = None) -> TrainSummary:
    return Trainer(cfg, progress).run()
