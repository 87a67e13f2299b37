"""Medusa and EAGLE-3 training losses: pure tensor functions, computed in chunks over time.

Terms
-----
offset
    how far ahead a term predicts: the base LM head reads h_t and predicts token
    t+1 (offset 1); Medusa head k (1-based) predicts token t+k+1 (offset k+1).
    For hidden state h_t the term's target is ``input_ids[t + offset]``, valid where
    ``loss_mask[t + offset]`` (the teacher generated that token) and t + offset < T.
teacher row
    the stored teacher top-k at position s is the distribution token s was drawn
    from; the term's teacher target for h_t is teacher row t + offset.
bucketed teacher distribution
    the teacher's top-k probabilities plus one *tail bucket* holding the remaining
    mass ``1 - Σ top-k`` (0 below ``TAIL_EPS``), renormalized to sum to one (quantization can push the sum
    a hair above 1). The student is scored on the same K+1 buckets: its
    probabilities of the K ids plus the total of every other id.
hard CE
    ``-log p_student(target)``.
soft CE
    ``-Σ_b q_b log s_b`` over the K+1 buckets (equals hard CE for a one-hot teacher).
KL
    ``Σ_b q_b (log q_b - log s_b)``, the Medusa-2 ``L_LM`` on self-distilled data
    (equals the dense KL when K is the whole vocabulary: the tail bucket is empty).
Medusa-1 loss
    ``Σ_k decay^k · CE_k`` over heads k = 1..K (decay 0.8), each CE the mean over
    that head's valid positions.
draft vocabulary (EAGLE-3)
    a term may score a reduced vocabulary: ``vocab_map`` (V,) gives each target id's
    draft id (-1 outside, :class:`distill.heads.vocab.DraftVocab`). Hard targets outside
    it cannot be trained and are counted as ``excluded``; teacher candidates outside it
    are dropped and the remaining buckets (kept top-k + tail) renormalized: the teacher
    conditioned on the draft vocabulary.
TTT loss (EAGLE-3)
    ``Σ_j decay^j · CE_j`` over unrolled steps j = 0..n-1 (EAGLE-3's 0.8^j: step 0
    weighs 1); step j at position t predicts token t+j+2 (offset j+2, as Medusa head j+1).
feature loss (EAGLE-1)
    smooth-L1 between the drafter's normed output and the target's last hidden state
    that predicts the same token (:func:`feature_l1`).

Memory: no function here builds (B, T, K, V). :func:`chunked_term_losses` gathers, per
term, the positions that have a target (prompt, context and padding positions cost no
logits) and walks them in chunks of ``chunk * B`` rows; each chunk's logits are made
inside ``torch.utils.checkpoint`` so autograd keeps only the hidden chunk and recomputes
the logits during backward. Peak memory grows with the chunk, not with T·K·V.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from distill.errors import check_choice

LOSS_KINDS = ("hard", "soft", "kl")
#: The batch key of a train module's loss normalizers, (n,) float64: its ``counts(batch, step)`` summed over every
#: micro-batch of the optimizer step on every process. Without it a batch's loss is the mean over that batch alone.
STEP_COUNTS = "step_counts"


TAIL_EPS = 1e-6  # tail mass below this is float rounding of a top-k that covers the distribution


def _up(x: torch.Tensor) -> torch.Tensor:
    """Half-precision inputs are computed in float32; float32/64 stay as they are."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def head_weights(num_heads: int, decay: float = 0.8) -> torch.Tensor:
    """Medusa-1 weights ``decay^k`` for heads k = 1..K: (K,)."""
    return torch.tensor([decay ** k for k in range(1, num_heads + 1)], dtype=torch.float32)


def step_weights(num_steps: int, decay: float = 0.8) -> torch.Tensor:
    """EAGLE-3 training-time-test weights ``decay^j`` for steps j = 0..n-1: (n,)."""
    return torch.tensor([decay ** j for j in range(num_steps)], dtype=torch.float32)


def shift_left(x: torch.Tensor, offset: int, fill) -> torch.Tensor:
    """``out[:, t] = x[:, t + offset]``, ``fill`` where t + offset >= T. x: (B, T, ...)."""
    out = torch.full_like(x, fill)
    if offset < x.shape[1]:
        out[:, : x.shape[1] - offset] = x[:, offset:]
    return out


def shifted_targets(input_ids: torch.Tensor, loss_mask: torch.Tensor, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Hard targets and their validity for a term of ``offset``: (B, T) ids, (B, T) bool."""
    return shift_left(input_ids, offset, 0), shift_left(loss_mask.bool(), offset, False)


def teacher_buckets(teacher_lp: torch.Tensor) -> torch.Tensor:
    """Teacher top-k logprobs (..., K) -> bucket probabilities (..., K+1), tail last, summing to 1.

    Rows with no teacher (all -inf) come out as all zeros; callers mask them.
    """
    p = _up(teacher_lp).exp()  # (..., K); exp(-inf) = 0
    tail = 1.0 - p.sum(-1, keepdim=True)  # (..., 1)
    tail = torch.where(tail > TAIL_EPS, tail, torch.zeros_like(tail))  # rounding noise is no mass
    q = torch.cat([p, tail], -1)  # (..., K+1)
    total = q.sum(-1, keepdim=True)
    return torch.where(total > 0, q / total.clamp_min(1e-30), torch.zeros_like(q))


def restrict_buckets(q: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Drop the candidates not kept and renormalize: q (..., K+1), keep (..., K) bool -> (..., K+1).

    Rows where every candidate is kept come back unchanged; a row left without mass is all zeros.
    """
    kept = torch.cat([q[..., :-1] * keep, q[..., -1:]], -1)  # (..., K+1)
    total = kept.sum(-1, keepdim=True)
    renorm = torch.where(total > 0, kept / total.clamp_min(1e-30), torch.zeros_like(kept))
    return torch.where(keep.all(-1, keepdim=True), q, renorm)


def student_bucket_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Student log-probabilities of the teacher's K ids and of the tail: logits (..., V), ids (..., K) -> (..., K+1).

    An id < 0 is no candidate (no teacher, or outside the draft vocabulary): its entry is
    -inf and it takes nothing from the tail. The tail is ``logsumexp`` of every id not
    among ``ids`` (-inf when the ids cover the vocabulary).
    """
    logits = _up(logits)
    lse = torch.logsumexp(logits, -1, keepdim=True)  # (..., 1)
    padded = torch.cat([logits, torch.full_like(logits[..., :1], float("-inf"))], -1)  # (..., V+1): column V is "none"
    safe = torch.where(ids >= 0, ids, torch.full_like(ids, logits.shape[-1]))
    top = padded.gather(-1, safe) - lse  # (..., K)
    masked = padded.scatter(-1, safe, float("-inf"))  # (..., V+1): the tail ids only
    tail = torch.logsumexp(masked, -1, keepdim=True) - lse  # (..., 1)
    return torch.cat([top, tail], -1)


def _xlogy(q: torch.Tensor, logs: torch.Tensor) -> torch.Tensor:
    """q * logs with 0 * anything = 0 (the empty tail bucket has log 0 = -inf)."""
    return torch.where(q > 0, q * logs, torch.zeros_like(q))


def hard_ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-position ``-log p(target)``: logits (..., V), targets (...) -> (...)."""
    flat = _up(logits.reshape(-1, logits.shape[-1]))
    return F.cross_entropy(flat, targets.reshape(-1), reduction="none").reshape(targets.shape)


def soft_ce(logits: torch.Tensor, teacher_ids: torch.Tensor, teacher_lp: torch.Tensor) -> torch.Tensor:
    """Per-position CE against the bucketed teacher: (..., V), (..., K), (..., K) -> (...).

    Candidates with id < 0 (outside a draft vocabulary) are dropped and the rest renormalized.
    """
    q = restrict_buckets(teacher_buckets(teacher_lp), teacher_ids >= 0)  # (..., K+1)
    s = student_bucket_logprobs(logits, teacher_ids)  # (..., K+1)
    return -_xlogy(q, s).sum(-1)


def sparse_kl(logits: torch.Tensor, teacher_ids: torch.Tensor, teacher_lp: torch.Tensor) -> torch.Tensor:
    """Per-position ``KL(teacher || student)`` over the K+1 buckets: (..., V), (..., K), (..., K) -> (...)."""
    q = teacher_buckets(teacher_lp)  # (..., K+1)
    s = student_bucket_logprobs(logits, teacher_ids)  # (..., K+1)
    return (_xlogy(q, q.clamp_min(1e-30).log()) - _xlogy(q, s)).sum(-1)


def feature_l1(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """EAGLE-1 feature regression: per-position smooth-L1 summed over H: (..., H), (..., H) -> (...)."""
    return F.smooth_l1_loss(_up(pred), _up(target), reduction="none").sum(-1)


def topk_hits(logits: torch.Tensor, targets: torch.Tensor, ks: Sequence[int] = (1, 5)) -> list[torch.Tensor]:
    """Per-position hit indicators (target within the top-k) for each k: (..., V), (...) -> [(...) bool]."""
    top = logits.topk(min(max(ks), logits.shape[-1]), dim=-1).indices  # (..., max k), at most V
    eq = top == targets.unsqueeze(-1)
    return [eq[..., :k].any(-1) for k in ks]


@dataclass
class Term:
    """One loss term: a logits function on hidden states, how far ahead it predicts, and its loss kind."""

    logits_fn: Callable[[torch.Tensor], torch.Tensor]  # (B, c, H) -> (B, c, V)
    offset: int
    kind: str = "hard"  # hard | soft | kl

    def __post_init__(self) -> None:
        check_choice("loss kind", self.kind, LOSS_KINDS, repr_value=True, error=ValueError)
        if self.offset < 1:
            raise ValueError(f"offset must be >= 1; got {self.offset}")


@dataclass
class TermStats:
    """Sums over valid positions for one term (detached), to be averaged by the caller."""

    loss_sum: float
    top1: float
    top5: float
    count: float
    excluded: float = 0.0  # positions with a target outside the draft vocabulary (no loss; a miss for any draft)


def _chunk_fn(term: Term, with_stats: bool):
    def run(h, tgt, valid, t_ids, t_lp):
        logits = term.logits_fn(h)  # (B, c, V)
        if term.kind == "hard":
            per = hard_ce(logits, tgt)
        elif term.kind == "soft":
            per = soft_ce(logits, t_ids, t_lp)
        else:
            per = sparse_kl(logits, t_ids, t_lp)
        v = valid.to(per.dtype)
        loss = (per * v).sum()
        if not with_stats:
            return loss, loss.new_zeros(()), loss.new_zeros(())
        with torch.no_grad():
            h1, h5 = topk_hits(logits.detach(), tgt)
            return loss, (h1 & valid).sum().float(), (h5 & valid).sum().float()

    return run


def segment_valid(valid: torch.Tensor, segment_ids: torch.Tensor | None, offset: int) -> torch.Tensor:
    """``valid`` (B, T) less the positions whose target ``offset`` ahead is in another window of a packed row, or padding."""
    if segment_ids is None:
        return valid
    return valid & (segment_ids == shift_left(segment_ids, offset, -2)) & (segment_ids >= 0)


def _term_targets(term: Term, needs_teacher: bool, input_ids, loss_mask, teacher_ids, teacher_lp, segment_ids, vocab_map):
    """A term's targets: (B, T) ids (draft ids with ``vocab_map``), (B, T) validity, the teacher rows (B, T, Kt) or
    None, and the count of hard targets outside the draft vocabulary (``excluded``)."""
    tgt, valid = shifted_targets(input_ids, loss_mask, term.offset)  # (B, T), (B, T)
    valid = segment_valid(valid, segment_ids, term.offset)  # no target across a packed window boundary
    t_ids = t_lp = None
    if needs_teacher:
        t_ids = shift_left(teacher_ids, term.offset, -1)  # (B, T, Kt)
        t_lp = shift_left(teacher_lp, term.offset, float("-inf"))  # (B, T, Kt)
        valid = valid & (t_ids[..., 0] >= 0)
    excluded = 0.0
    if vocab_map is not None:
        tgt = vocab_map[tgt]  # (B, T) draft ids, -1 outside
        if needs_teacher:
            t_ids = torch.where(t_ids >= 0, vocab_map[t_ids.clamp_min(0)], t_ids)  # (B, T, Kt)
            q = restrict_buckets(teacher_buckets(t_lp), t_ids >= 0)  # (B, T, Kt+1)
            valid = valid & (q.sum(-1) > 0)
        if term.kind == "hard":
            excluded = float((valid & (tgt < 0)).sum())
            valid = valid & (tgt >= 0)
    return tgt, valid, t_ids, t_lp, excluded


def _needs_teacher(terms: Sequence[Term], teacher_ids, teacher_lp) -> bool:
    needs = any(t.kind != "hard" for t in terms)
    if needs and (teacher_ids is None or teacher_lp is None):
        raise ValueError("soft and kl terms need the teacher top-k")
    return needs


def term_counts(terms: Sequence[Term], input_ids: torch.Tensor, loss_mask: torch.Tensor, teacher_ids: torch.Tensor | None = None,
                teacher_lp: torch.Tensor | None = None, segment_ids: torch.Tensor | None = None,
                vocab_map: torch.Tensor | None = None) -> torch.Tensor:
    """The valid positions of every term on this batch, as :func:`chunked_term_losses` counts them: (n_terms,) float64.

    Summed over every micro-batch of an optimizer step on every process, they are the ``counts`` that make the
    step's loss the mean over the whole global batch, however it is split."""
    needs_teacher = _needs_teacher(terms, teacher_ids, teacher_lp)
    out = [_term_targets(t, needs_teacher, input_ids, loss_mask, teacher_ids, teacher_lp, segment_ids, vocab_map)[1].sum()
           for t in terms]
    return torch.stack(out).to(torch.float64)


def chunked_term_losses(
    hidden: torch.Tensor,
    terms: Sequence[Term],
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    teacher_ids: torch.Tensor | None = None,
    teacher_lp: torch.Tensor | None = None,
    chunk: int = 128,
    recompute: bool = True,
    with_stats: bool = True,
    segment_ids: torch.Tensor | None = None,
    vocab_map: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[TermStats]]:
    """Mean loss of every term over its valid positions, walking T in chunks.

    hidden (B, T, H); input_ids, loss_mask (B, T); teacher_ids, teacher_lp (B, T, Kt)
    aligned with input_ids (needed by soft and kl terms). Returns (n_terms,) mean
    losses (0 for a term with no valid position) and per-term summed stats.
    With ``recompute`` and grad enabled, each chunk's logits are rebuilt in backward.
    ``segment_ids`` (B, T) (packed rows): a position and its target must be in the same segment.
    ``vocab_map`` (V,) (a draft vocabulary): the terms' logits are over draft ids; targets
    and teacher candidates are mapped through it (see "draft vocabulary").
    ``counts`` (n_terms,): divide each term's loss sum by this instead of its own count here
    (:func:`term_counts` summed over a global batch: this batch's share of that batch's mean).
    """
    B, T, _ = hidden.shape
    needs_teacher = _needs_teacher(terms, teacher_ids, teacher_lp)
    losses, stats = [], []
    for i, term in enumerate(terms):
        tgt, valid, t_ids, t_lp, excluded = _term_targets(term, needs_teacher, input_ids, loss_mask, teacher_ids, teacher_lp,
                                                          segment_ids, vocab_map)
        count = valid.sum()
        fn = _chunk_fn(term, with_stats)
        total = hidden.new_zeros((), dtype=torch.float64 if hidden.dtype == torch.float64 else torch.float32)
        h1 = h5 = 0.0
        # Only positions with a target cost a logits row: gather them (prompt, context and
        # padding positions are skipped), then walk them in chunks of ``chunk * B`` rows.
        rows = valid.nonzero(as_tuple=True)
        g_hidden, g_tgt = hidden[rows].unsqueeze(0), tgt[rows].unsqueeze(0)  # (1, N, H), (1, N)
        g_valid = torch.ones_like(g_tgt, dtype=torch.bool)
        g_ids = t_ids[rows].unsqueeze(0) if needs_teacher else None  # (1, N, Kt)
        g_lp = t_lp[rows].unsqueeze(0) if needs_teacher else None
        N, step = g_tgt.shape[1], max(1, chunk * B)
        for s in range(0, N, step):
            e = min(N, s + step)
            args = (g_hidden[:, s:e], g_tgt[:, s:e], g_valid[:, s:e],
                    g_ids[:, s:e] if needs_teacher else None, g_lp[:, s:e] if needs_teacher else None)
            if recompute and torch.is_grad_enabled():
                loss, c1, c5 = checkpoint(fn, *args, use_reentrant=False)
            else:
                loss, c1, c5 = fn(*args)
            total = total + loss
            h1 += float(c1)
            h5 += float(c5)
        n = float(count)
        losses.append(total / max(n if counts is None else float(counts[i]), 1.0))
        stats.append(TermStats(loss_sum=float(total.detach()), top1=h1, top5=h5, count=n, excluded=excluded))
    return torch.stack(losses), stats

