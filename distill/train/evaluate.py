"""Held-out evaluation while ``train-heads`` trains: the figure ``calibrate`` gives, every ``--eval-every`` steps.

Terms
-----
eval data
    ``--eval-data``: a dataset folder, or a split folder's eval side (``distill data split``);
    by default the eval side of ``--data`` when ``--data`` is a split folder (``train/`` and
    ``eval/``), which then trains on its ``train/`` side.
evaluation
    the drafter being trained, measured on the first ``--eval-tokens`` input tokens of the eval
    data (whole batches of ``--batch-size`` windows of ``--max-len``) by the functions
    ``calibrate`` measures with (:func:`distill.train.calibrate.held_out_accuracy`, then
    :func:`distill.train.calibrate.acceptance`): per-depth top-1 / top-5 / CE and the simulated
    acceptance length, expected tokens per step of the top-1 chain and of the greedy sparse tree
    of ``--eval-nodes`` nodes. The frozen target already loaded for training computes the
    features; nothing else is loaded, and no random state is drawn (training continues exactly
    as it would without it).
best
    the weights of the evaluation with the highest tree figure so far (the earliest on a tie),
    written as a heads or drafter folder of the same layout as the run's own in ``OUT/best``.
    Medusa-2 keeps its adapter there, never a merged backbone (merging would end the training of
    its LoRA weights).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from distill.errors import ConfigError
from distill.train.calibrate import EAGLE_CALIBRATED_DEPTHS, acceptance, check_tree_nodes, held_out_accuracy
from distill.train.config import NO_EVAL, TREE_RANKS, TrainConfig
from distill.train.data import iter_batches
from distill.train.losses import shifted_targets

BEST = "best"  # OUT/best: the best evaluated weights
TOPK = 5  # the top-k logged beside top-1 (the training records' top5)


def data_sides(cfg: TrainConfig) -> tuple[Path | str, Path | str | None]:
    """(the dataset trained on, the one evaluated on or None) for ``--data`` and ``--eval-data`` (see the module docstring)."""
    from distill.data.dataset import split_folders  # the one reading of a split folder's layout

    sides = split_folders(cfg.data)
    if cfg.eval_data == NO_EVAL:
        return sides["train"], None
    if not cfg.eval_data:
        return sides["train"], sides.get("eval")
    held_out = split_folders(cfg.eval_data)
    return sides["train"], held_out.get("eval", held_out["train"])


def drafter_of(core: nn.Module):
    """The heads or drafter of a train module (what is measured and saved)."""
    return core.drafter if hasattr(core, "drafter") else core.heads


@dataclass
class EvalResult:
    step: int
    tree: float  # expected tokens/step of the --eval-nodes sparse tree
    chain: float  # expected tokens/step of the top-1 chain
    record: dict  # the eval_* metrics

    def brief(self) -> dict:
        return {"step": self.step, "tree": self.tree, "chain": self.chain}


class Evaluator:
    """Measures the train module's drafter on ``data`` (see the module docstring)."""

    def __init__(self, cfg: TrainConfig, data: Path | str):
        self.cfg, self.data = cfg, data
        self.depths = cfg.heads if cfg.arch == "medusa" else EAGLE_CALIBRATED_DEPTHS  # held_out_accuracy's rows
        check_tree_nodes(cfg.eval_nodes, self.depths, TREE_RANKS, option="--eval-nodes")
        self.check_positions()

    def due(self, step: int, total: int) -> bool:
        """Whether the evaluation runs after optimizer step ``step`` (1-based) of ``total``."""
        every = self.cfg.eval_every
        return step == total or (every > 0 and step % every == 0)

    def check_positions(self) -> None:
        """The rows an evaluation reads hold a generated token at every measured depth, or a one-line error now
        (before the model trains, not at the first evaluation)."""
        cfg, deepest = self.cfg, self.depths + 1  # depth j (0-based) predicts the token j+2 ahead
        tokens = 0
        for batch in iter_batches(self.data, cfg.max_len, cfg.batch_size, epoch=0):
            _, valid = shifted_targets(batch["input_ids"], batch["loss_mask"], deepest)  # (B, T)
            if valid.any():
                return
            tokens += int(batch["attention_mask"].sum())
            if cfg.eval_tokens and tokens >= cfg.eval_tokens:
                break
        budget = f" in its first {cfg.eval_tokens:,} tokens (--eval-tokens)" if cfg.eval_tokens else ""
        raise ConfigError(f"--eval-data {self.data} has no generated token {deepest} positions ahead{budget}: "
                          "use more held-out data, or --eval-data none")

    @torch.no_grad()
    def run(self, core: nn.Module, step: int, autocast) -> EvalResult:
        """Measure ``core``'s drafter now (eval mode, restored after) -> the figures and the ``eval_*`` record."""
        cfg = self.cfg
        modes = {m: m.training for m in core.modules()}
        core.eval()
        t0 = time.monotonic()
        try:
            with autocast():
                stats = held_out_accuracy(core.backbone, drafter_of(core), self.data, cfg.max_len, cfg.batch_size, TREE_RANKS,
                                          cfg.eval_tokens)
        finally:
            for m, training in modes.items():
                m.train(training)
        measured = acceptance(stats.table, cfg.eval_nodes)
        record = {"eval_tree_acceptance": measured.tree_length, "eval_chain_acceptance": measured.chain_length,
                  "eval_tokens": stats.tokens, "eval_seconds": time.monotonic() - t0}
        top1, topk = stats.topk(1), stats.topk(TOPK)
        for j in range(len(top1)):
            record[f"eval_depth{j + 1}_top1"] = top1[j]
            record[f"eval_depth{j + 1}_top{TOPK}"] = topk[j]
            record[f"eval_depth{j + 1}_loss"] = stats.loss[j]
        return EvalResult(step, measured.tree_length, measured.chain_length, record)


def better(result: EvalResult, best: dict | None) -> bool:
    """Whether ``result`` beats the best so far (``best``: :meth:`EvalResult.brief` of it, or None)."""
    return best is None or result.tree > best["tree"]
