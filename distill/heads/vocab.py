"""The draft vocabulary of an EAGLE-3 drafter and its two stored maps (vLLM's layout).

Terms
-----
draft vocabulary
    the Vd target token ids the drafter's LM head scores, in ascending target-id order;
    draft id i is the i-th of them. Vd == V (the target vocabulary) is the full vocabulary.
d2t
    (Vd,) int64 offsets: ``target_id = draft_id + d2t[draft_id]`` (what vLLM's
    ``llama_eagle3`` loads into ``draft_id_to_target_id``; EAGLE-3 checkpoints store it so).
t2d
    (V,) bool: whether a target id is in the draft vocabulary (stored beside d2t; vLLM
    skips it, our code derives the reverse map from it).
draft index
    (V,) int64: the draft id of each target id, -1 where the target id is not in the
    draft vocabulary (``cumsum(t2d) - 1`` where t2d holds).
coverage
    the fraction of generated tokens whose id is in the draft vocabulary: a draft can
    never propose the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distill.errors import ModelError


@dataclass(frozen=True)
class DraftVocab:
    """A sorted set of target ids (the draft vocabulary) of a V-token target."""

    target_ids: torch.Tensor  # (Vd,) int64, strictly ascending, in [0, V)
    vocab_size: int  # V

    def __post_init__(self) -> None:
        ids = self.target_ids
        if ids.dtype != torch.int64 or ids.dim() != 1 or ids.numel() == 0:
            raise ModelError(f"a draft vocabulary is a non-empty (Vd,) int64 tensor; got {tuple(ids.shape)} {ids.dtype}")
        if int(ids[0]) < 0 or int(ids[-1]) >= self.vocab_size or (ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all())):
            raise ModelError(f"draft vocabulary ids must be distinct, ascending and in [0, {self.vocab_size})")

    @classmethod
    def from_target_ids(cls, ids, vocab_size: int) -> "DraftVocab":
        """Any collection of distinct target ids -> the sorted draft vocabulary."""
        t = torch.as_tensor(list(ids) if not torch.is_tensor(ids) else ids, dtype=torch.int64).flatten()
        if t.unique().numel() != t.numel():
            raise ModelError("draft vocabulary ids repeat a token")
        return cls(t.sort().values, vocab_size)

    @classmethod
    def full(cls, vocab_size: int) -> "DraftVocab":
        return cls(torch.arange(vocab_size, dtype=torch.int64), vocab_size)

    @classmethod
    def from_maps(cls, d2t: torch.Tensor, t2d: torch.Tensor) -> "DraftVocab":
        """The stored maps -> the vocabulary; they must describe the same ids."""
        d2t, t2d = d2t.to(torch.int64), t2d.to(torch.bool)  # (Vd,), (V,)
        ids = torch.arange(d2t.numel(), dtype=torch.int64) + d2t  # (Vd,)
        listed = t2d.nonzero().flatten()  # (Vd,) ascending
        if ids.numel() != listed.numel() or not bool((ids == listed).all()):
            raise ModelError(f"d2t ({d2t.numel()} ids) and t2d ({listed.numel()} ids) do not describe the same draft vocabulary")
        return cls(ids, t2d.numel())

    @property
    def size(self) -> int:
        return self.target_ids.numel()

    @property
    def is_full(self) -> bool:
        return self.size == self.vocab_size

    def d2t(self) -> torch.Tensor:
        """(Vd,) int64 offsets: target_id = draft_id + d2t[draft_id]."""
        return self.target_ids - torch.arange(self.size, dtype=torch.int64)

    def t2d(self) -> torch.Tensor:
        """(V,) bool: the target ids in the draft vocabulary."""
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        mask[self.target_ids] = True
        return mask

    def draft_index(self) -> torch.Tensor:
        """(V,) int64: draft id of each target id, -1 outside the draft vocabulary."""
        index = torch.full((self.vocab_size,), -1, dtype=torch.int64)
        index[self.target_ids] = torch.arange(self.size, dtype=torch.int64)
        return index

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids (...) -> target ids (...)."""
        return self.target_ids.to(draft_ids.device)[draft_ids]

    def to_draft(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Target ids (...) -> draft ids (...), -1 where a target id is not in the draft vocabulary."""
        return self.draft_index().to(target_ids.device)[target_ids]
