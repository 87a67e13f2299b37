"""EAGLE-3 training (``distill train-heads --arch eagle3``): target features, the training-time test, its loss.

Terms (the drafter's own are in :mod:`distill.heads.eagle`)
-----
target features
    computed online by the frozen target for every batch, as Medusa-1 computes its hidden
    states: the residual streams entering the aux layers, concatenated,
    (B, T, A·H), and the last hidden state after the final norm (for the feature loss).
    Nothing is stored per token: the shards stay as they are.
training-time test (TTT), n steps
    step 0 feeds the drafter the fused feature g_t and the embedding of token t+1 at
    position id t; step j >= 1 feeds its own step j-1 output at t and the embedding of
    token t+1+j, at position id t+j (the position that draft depth takes at inference,
    where vLLM advances the positions each draft step; SpecForge keeps t). Step j at t
    predicts token t+j+2: offset j+2, like Medusa head j+1, but knowing tokens t+1..t+j+1.
TTT attention
    a query at t in step j sees step 0's keys at positions <= t of its own window (the
    target-feature context an engine's drafter cache holds) and the keys its own chain
    wrote at t in steps 1..j (the drafts before it, itself included):
    :func:`ttt_keep_mask`. All steps' keys go into one transformers ``DynamicCache``,
    step after step, as an engine would fill its drafter cache.
loss
    ``Σ_j decay^j · CE_j`` (EAGLE-3: decay 0.8, step 0 weighs 1) over the positions whose
    target token the teacher generated; ``--targets hard``: the sampled token (positions
    whose token is outside the draft vocabulary cannot be trained and count as misses);
    ``--targets soft``: the stored teacher top-k of that token, restricted to the draft
    vocabulary and renormalized with its tail bucket. ``--feature-loss W`` adds
    ``W · Σ_j decay^j · smoothL1_j`` (EAGLE-1): the drafter's normed step-j output at t
    against the target's last hidden state at t+j+1 (the state whose LM head predicts
    the same token).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from distill.heads.accuracy import HeadAccuracy
from distill.heads.eagle import DrafterConfig, EagleDrafter, parse_aux_layers
from distill.heads.model import HEADS_MARKERS, portable_meta
from distill.heads.vocab import DraftVocab
from distill.store.atomic import StagedFiles
from distill.train.config import TrainConfig
from distill.train.data import decoder_inputs, iter_batches
from distill.train.draft_vocab import DraftVocabReport
from distill.train.losses import (
    STEP_COUNTS, Term, TermStats, chunked_term_losses, feature_l1, hard_ce, segment_valid, shift_left, shifted_targets, step_weights,
    term_counts,
)

DRAFT_VOCAB_FILE = "draft-vocab.json"


def step0_keep(attention_mask: torch.Tensor, segment_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Which step-0 keys each query may attend: (B, T) real-token mask, (B, T) window ids or None -> (B, T, T) bool.

    Causal, inside the query's window (packed rows), real keys only; every query keeps its
    own position so no attention row is empty (padding rows included).
    """
    B, T = attention_mask.shape
    causal = torch.ones(T, T, dtype=torch.bool, device=attention_mask.device).tril()  # (T, T)
    keep = causal[None] & attention_mask.bool()[:, None, :]  # (B, T, T)
    if segment_ids is not None:
        keep = keep & (segment_ids[:, :, None] == segment_ids[:, None, :])
    return keep | torch.eye(T, dtype=torch.bool, device=keep.device)[None]


def ttt_keep_mask(keep0: torch.Tensor, step: int) -> torch.Tensor:
    """Step ``step``'s keep-mask over the keys of steps 0..step: (B, T, T) -> (B, 1, T, (step+1)·T).

    Block 0 is ``keep0``; block i (1..step) is the diagonal: query t sees only the key its
    own chain wrote at t in step i.
    """
    B, T, _ = keep0.shape
    eye = torch.eye(T, dtype=torch.bool, device=keep0.device).expand(B, T, T)  # (B, T, T)
    return torch.cat([keep0, *([eye] * step)], dim=-1)[:, None]


def unroll(drafter: EagleDrafter, feature: torch.Tensor, embeds: torch.Tensor, position_ids: torch.Tensor,
           keep0: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The TTT unroll: fused feature (B, T, H), target embeddings of tokens x_t (B, T, H), position ids (B, T),
    step-0 keep-mask (B, T, T) -> ``steps`` prenorm outputs (B, T, H); step j's at t predicts token t+j+2."""
    from transformers import DynamicCache

    cache = DynamicCache()
    g, outs = feature, []
    for j in range(steps):
        e = shift_left(embeds, 1 + j, 0.0)  # (B, T, H): embedding of token t+1+j
        g = drafter(e, g, position_ids + j, ttt_keep_mask(keep0, j), cache)  # (B, T, H)
        outs.append(g)
    return outs


def target_features(backbone, batch: dict[str, torch.Tensor], aux_layer_ids: list[int]):
    """The frozen target on a batch -> aux features (B, T, A·H), last hidden state (B, T, H), token embeddings (B, T, H).

    Aux feature i is the residual stream entering decoder layer i (transformers' ``hidden_states[i]``), taken as that
    layer's input: only the A states are kept, not every layer's, and it holds for a target sharded with FSDP2,
    whose wrapped classes transformers' ``output_hidden_states`` recording does not know."""
    decoder = backbone.get_decoder()
    entering: dict[int, torch.Tensor] = {}

    def keep(i: int):
        def hook(module, args, kwargs):
            entering[i] = args[0] if args else kwargs["hidden_states"]  # (B, T, H)
        return hook

    handles = [decoder.layers[i].register_forward_pre_hook(keep(i), with_kwargs=True) for i in aux_layer_ids]
    try:
        out = decoder(input_ids=batch["input_ids"], use_cache=False, **decoder_inputs(batch))
    finally:
        for h in handles:
            h.remove()
    aux = torch.cat([entering[i] for i in aux_layer_ids], dim=-1)  # (B, T, A·H)
    embeds = backbone.get_input_embeddings()(batch["input_ids"])  # (B, T, H)
    return aux, out.last_hidden_state, embeds


def _vocab_digest(vocab: DraftVocab) -> str:
    return hashlib.sha256(vocab.target_ids.numpy().tobytes()).hexdigest()


class EagleTrainModule(nn.Module):
    """Frozen target + EAGLE-3 drafter; ``forward(batch, step)`` returns the TTT loss and per-term stats."""

    def __init__(self, backbone: nn.Module, drafter: EagleDrafter, cfg: TrainConfig, report: DraftVocabReport):
        super().__init__()
        self.backbone = backbone
        self.drafter = drafter
        self.cfg = cfg
        self.report = report
        self.register_buffer("weights", step_weights(cfg.ttt_steps, cfg.decay), persistent=False)
        self.term_names = [f"step{j + 1}" for j in range(cfg.ttt_steps)] + (["feature"] if cfg.feature_loss > 0 else [])
        self.progress_metric = "step1_top1"

    def param_groups(self) -> list[dict]:
        return [{"params": [p for p in self.drafter.parameters() if p.requires_grad], "lr": self.cfg.lr, "name": "drafter"}]

    def identity(self) -> dict:
        """What a --resume must find unchanged beyond the config: the draft vocabulary."""
        return {"draft_vocab_sha256": _vocab_digest(self.drafter.vocab)}

    def terms(self) -> list[Term]:
        """Step j's cross-entropy over the draft vocabulary (token t+j+2), j = 0..ttt_steps-1."""
        kind = "soft" if self.cfg.targets == "soft" else "hard"
        return [Term(self.drafter.logits, offset=j + 2, kind=kind) for j in range(self.cfg.ttt_steps)]

    def feature_valid(self, batch: dict[str, torch.Tensor], j: int) -> torch.Tensor:
        """Where step j's feature loss is taken: (B, T) bool, step j's generated targets inside their window."""
        _, valid = shifted_targets(batch["input_ids"], batch["loss_mask"], j + 2)  # (B, T)
        return segment_valid(valid, batch.get("segment_ids"), j + 2)

    def counts(self, batch: dict[str, torch.Tensor], step: int) -> torch.Tensor:
        """The loss normalizers of ``batch`` (:data:`distill.train.losses.STEP_COUNTS`): each step's cross-entropy
        targets, then (with the feature loss) each step's feature positions: (n,) float64."""
        out = term_counts(self.terms(), batch["input_ids"], batch["loss_mask"], batch["teacher_ids"], batch["teacher_lp"],
                          segment_ids=batch.get("segment_ids"), vocab_map=self.drafter.draft_index)
        if self.cfg.feature_loss > 0:
            out = torch.cat([out, torch.stack([self.feature_valid(batch, j).sum() for j in range(self.cfg.ttt_steps)]).to(out)])
        return out

    def forward(self, batch: dict[str, torch.Tensor], step: int) -> tuple[torch.Tensor, list[TermStats]]:
        cfg, drafter = self.cfg, self.drafter
        ids = drafter.config.aux_layer_ids
        with torch.no_grad():
            aux, last, embeds = target_features(self.backbone, batch, ids)
        dtype = drafter.fc.weight.dtype
        feature = drafter.fuse(aux.detach().to(dtype))  # (B, T, H)
        position_ids = batch.get("position_ids")
        if position_ids is None:
            position_ids = torch.arange(batch["input_ids"].shape[1], device=feature.device).expand_as(batch["input_ids"])
        keep0 = step0_keep(batch["attention_mask"], batch.get("segment_ids"))  # (B, T, T)
        outs = unroll(drafter, feature, embeds.detach().to(dtype), position_ids, keep0, cfg.ttt_steps)
        counts = batch.get(STEP_COUNTS)  # (n,): the step's, over every process; None: this batch's own
        losses, stats = [], []
        for j, (out, term) in enumerate(zip(outs, self.terms())):
            loss, st = chunked_term_losses(
                out, [term], batch["input_ids"], batch["loss_mask"],
                batch["teacher_ids"], batch["teacher_lp"], chunk=cfg.loss_chunk, segment_ids=batch.get("segment_ids"),
                vocab_map=drafter.draft_index, counts=None if counts is None else counts[j : j + 1],
            )
            losses.append(loss[0])
            stats.append(st[0])
        total = (torch.stack(losses) * self.weights).sum()
        if cfg.feature_loss > 0:
            feat, fstats = self.feature_term(outs, last.detach(), batch, None if counts is None else counts[cfg.ttt_steps :])
            total = total + cfg.feature_loss * feat
            stats.append(fstats)
        return total, stats

    def feature_term(self, outs: list[torch.Tensor], last: torch.Tensor, batch,
                     counts: torch.Tensor | None = None) -> tuple[torch.Tensor, TermStats]:
        """``Σ_j decay^j · mean smoothL1(norm(out_j)_t, last_{t+j+1})`` over step j's CE positions (the mean over
        ``counts[j]`` positions when given)."""
        total, loss_sum, count = 0.0, 0.0, 0.0
        for j, out in enumerate(outs):
            valid = self.feature_valid(batch, j)  # (B, T)
            target = shift_left(last, j + 1, 0.0)  # (B, T, H): the target state predicting token t+j+2
            per = feature_l1(self.drafter.norm(out[valid]), target[valid].to(out.dtype))  # (N,)
            n = float(valid.sum())
            total = total + self.weights[j] * per.sum() / max(n if counts is None else float(counts[j]), 1.0)
            loss_sum += float(per.detach().sum())
            count += n
        return total, TermStats(loss_sum=loss_sum, top1=0.0, top5=0.0, count=count)

    def record(self, step: int, sums: np.ndarray) -> dict:
        rec = {}
        for i, name in enumerate(self.term_names):
            loss_sum, top1, top5, count, excluded = sums[i]
            rec[f"{name}_loss"] = loss_sum / max(count, 1.0)
            if name != "feature":  # over every generated target: one outside the draft vocabulary is a miss
                rec[f"{name}_top1"] = top1 / max(count + excluded, 1.0)
                rec[f"{name}_top5"] = top5 / max(count + excluded, 1.0)
        return rec

    def save(self, out: Path, extra: dict, final: bool = True) -> None:
        """The vLLM EAGLE-3 folder (config.json + model.safetensors), distill-heads.json and draft-vocab.json; the same
        during training (``final`` False: OUT/best) as at its end."""
        report = self.report.to_dict()
        with StagedFiles(out, HEADS_MARKERS) as stage:
            self.drafter.float().write_files(stage.path, extra=portable_meta({**extra, "arch": "eagle3", "draft_vocab": report}, out))
            (stage.path / DRAFT_VOCAB_FILE).write_text(json.dumps(report, indent=2) + "\n")


def build_eagle_module(backbone, cfg: TrainConfig, vocab: DraftVocab, report: DraftVocabReport) -> EagleTrainModule:
    """A fresh drafter for this target (LM head and final norm started from the target's) in its train module."""
    conf = backbone.config
    aux = parse_aux_layers(cfg.aux_layers, conf.num_hidden_layers)
    dconf = DrafterConfig.for_target(conf.to_dict(), aux, vocab.size)
    drafter = EagleDrafter(dconf, vocab)
    drafter.init_from_target(backbone.get_output_embeddings().weight.detach().float(),
                             backbone.get_decoder().norm.weight.detach().float())
    backbone.eval()
    return EagleTrainModule(backbone, drafter, cfg, report)


@dataclass
class DrafterAccuracy(HeadAccuracy):
    """Per TTT step ("head" j = draft depth j+1): rank hits over every generated target, CE over those in the draft vocabulary."""

    in_vocab: list[int] = field(default_factory=list)  # per step: positions whose target is in the draft vocabulary

    @property
    def loss(self) -> list[float]:
        return [s / max(n, 1) for s, n in zip(self.loss_sum, self.in_vocab)]


@torch.no_grad()
def drafter_accuracy(backbone, drafter: EagleDrafter, data: Path | str, max_len: int = 512, batch_size: int = 4, ranks: int = 10,
                     max_tokens: int = 0, steps: int = 3, chunk: int = 512, progress=None) -> DrafterAccuracy:
    """Teacher-forced per-depth accuracy on ``data`` (up to ``max_tokens`` input tokens; 0: all).

    ``progress``: told each batch's tokens (a :class:`distill.progress.Progress`), when given.

    Depth j+1 is TTT step j: the drafter runs on its own features with the true tokens, so
    its rank-i hit at t is the chance that depth j+1 drafts token t+j+2 right when the
    depths before it were right. A target outside the draft vocabulary is a miss.
    """
    device = drafter.fc.weight.device
    dtype = drafter.fc.weight.dtype
    acc = DrafterAccuracy(ranks=ranks, counts=[0] * steps, hits=[[0] * ranks for _ in range(steps)], loss_sum=[0.0] * steps,
                          in_vocab=[0] * steps)
    target_ids = drafter.vocab.target_ids.to(device)  # (Vd,)
    for batch in iter_batches(data, max_len, batch_size, epoch=0):
        batch = {k: v.to(device) for k, v in batch.items()}
        aux, _, embeds = target_features(backbone, batch, drafter.config.aux_layer_ids)
        ids = batch["input_ids"]
        positions = torch.arange(ids.shape[1], device=device).expand_as(ids)
        outs = unroll(drafter, drafter.fuse(aux.to(dtype)), embeds.to(dtype), positions, step0_keep(batch["attention_mask"]), steps)
        n = int(batch["attention_mask"].sum())
        acc.tokens += n
        for j, out in enumerate(outs):
            tgt, valid = shifted_targets(ids, batch["loss_mask"], j + 2)  # (B, T)
            rows, t_all = out[valid], tgt[valid]  # (N, H), (N,)
            for s in range(0, rows.shape[0], chunk):
                logits = drafter.logits(rows[s : s + chunk])  # (n, Vd)
                t = t_all[s : s + chunk]  # (n,)
                top = target_ids[logits.topk(min(ranks, logits.shape[-1]), -1).indices]  # (n, ranks) target ids
                hit = (top == t[:, None]).sum(0)  # (ranks,)
                for i in range(hit.shape[0]):
                    acc.hits[j][i] += int(hit[i])
                acc.counts[j] += int(t.numel())
                d = drafter.draft_index[t]  # (n,) draft ids, -1 outside
                inside = d >= 0
                acc.in_vocab[j] += int(inside.sum())
                if inside.any():
                    acc.loss_sum[j] += float(hard_ce(logits[inside], d[inside]).sum())
        if progress is not None:
            progress.update(n, tokens=n)
        if max_tokens and acc.tokens >= max_tokens:
            break
    return acc
