"""What a request's sampling options do to the target's logits, at every node of a verification step.

The order is vLLM's (``vllm/v1/sample/sampler.py``): on the raw logits, the logit bias and
``min_tokens`` (stop tokens masked until that many tokens are out), then the penalties
(repetition on prompt and output tokens, then frequency and presence on output tokens, as
OpenAI defines them); greedy decoding takes the argmax of the result. Sampled rows then go
through :func:`distill.sampling.warp`: temperature, ``min_p``, ``top_k``, ``top_p``.

Speculation stays lossless because every tree node's logits are processed exactly as plain
decoding would process them had the node's path been generated: node t's output so far is
the sequence's emitted tokens plus the tree tokens on t's path below the root (its ancestors
at depth >= 1, t included), so its penalties count those tokens and its ``min_tokens`` check
counts its depth. The acceptance rules then compare drafts with these distributions, so the
accepted tokens follow the processed distribution as plain decoding's do.

Logprobs (:func:`token_logprobs`) are the raw model's (vLLM's default ``raw_logprobs``):
log-softmax of the verified logits before any processing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from distill.engine.tree import TreeBuffers
from distill.sampling import repetition_penalty

#: vLLM clamps each logit bias to this range (OpenAI documents -100..100).
LOGIT_BIAS_LIMIT = 100.0


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted (or prompt) token's logprob under the raw model, and the ``top`` most likely tokens there."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@dataclass
class RowContext:
    """What processing row b needs: its options and the tokens it has seen (host lists, not copied)."""

    params: object  # distill.engine.SamplingParams
    prompt: Sequence[int]
    output: Sequence[int]  # emitted so far (the step's root included)
    stop: frozenset[int] | set[int]  # the tokens min_tokens holds back


def changes_logits(params) -> bool:
    """Whether ``params`` ask for anything :func:`process` does (most requests do not: zero cost for them)."""
    return bool(params.logit_bias) or params.min_tokens > 0 or params.repetition_penalty != 1.0 \
        or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0


def _path_counts(tokens: torch.Tensor, mask: torch.Tensor, depth: torch.Tensor, vocab: int) -> torch.Tensor:
    """Counts (T, V) of each node's path tokens below the root: node t counts its ancestors at depth >= 1 and itself."""
    on_path = (mask & (depth >= 1)[None, :]).float()  # (T, T): [t, a] = a is on t's path below the root
    T = tokens.shape[0]
    return torch.zeros(T, vocab, device=tokens.device).scatter_add_(1, tokens[None].expand(T, T), on_path)


def process(logits: torch.Tensor, tokens: torch.Tensor, buf: TreeBuffers, rows: dict[int, RowContext]) -> torch.Tensor:
    """logits (B, T, V) float32 -> the logits plain decoding would sample from at each node (a new tensor
    when a row changes; ``logits`` itself is never written). ``rows``: the rows to process, by batch index."""
    if not rows:
        return logits
    out = logits.clone()
    V = logits.shape[-1]
    dev = logits.device
    for b, row in rows.items():
        p = row.params
        x = out[b]  # (T, V) view
        mask = buf.mask[b] if buf.per_row else buf.mask  # (T, T)
        depth = buf.depth[b] if buf.per_row else buf.depth  # (T,)
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=dev)
            bias = torch.tensor(list(p.logit_bias.values()), dtype=x.dtype, device=dev).clamp(-LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT)
            x[:, ids] += bias
        if p.min_tokens > 0 and row.stop:
            early = (len(row.output) + depth) < p.min_tokens  # (T,): the token node t predicts would come too early
            if bool(early.any()):
                stop = torch.tensor(sorted(row.stop), dtype=torch.long, device=dev)
                x[early[:, None] & torch.isin(torch.arange(V, device=dev), stop)[None]] = float("-inf")
        if p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
            counts = torch.bincount(torch.tensor(list(row.output), dtype=torch.long, device=dev), minlength=V).float()
            counts = counts[None] + _path_counts(tokens[b], mask, depth, V)  # (T, V)
            if p.repetition_penalty != 1.0:
                seen = counts > 0
                seen[:, torch.tensor(list(row.prompt), dtype=torch.long, device=dev)] = True
                x.copy_(repetition_penalty(x, seen, p.repetition_penalty))
            if p.frequency_penalty != 0.0:
                x -= p.frequency_penalty * counts
            if p.presence_penalty != 0.0:
                x -= p.presence_penalty * (counts > 0).float()
    return out


def token_logprobs(logits: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, emitted: torch.Tensor,
                   top: int) -> tuple[list[list[float]], list[list[list[int]]], list[list[list[float]]]]:
    """Raw logprobs of emitted tokens: logits (B, T, V); for each of ``rows`` (R,), the positions (R, M)
    whose distributions emitted tokens (R, M) were drawn from -> per row and position: the token's
    logprob, and the ``top`` most likely ids and their logprobs (host lists; one transfer)."""
    lp = torch.log_softmax(logits[rows[:, None], positions].float(), dim=-1)  # (R, M, V)
    chosen = lp.gather(-1, emitted[..., None]).squeeze(-1)  # (R, M)
    if top > 0:
        vals, ids = lp.topk(top, dim=-1)  # (R, M, top)
        return chosen.tolist(), ids.tolist(), vals.tolist()
    empty = [[[] for _ in range(positions.shape[1])] for _ in range(rows.shape[0])]
    return chosen.tolist(), empty, empty
