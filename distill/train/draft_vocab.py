"""Choosing an EAGLE-3 draft vocabulary from the training shards (``--draft-vocab N|auto``).

Terms
-----
generated token
    a position the teacher generated (``loss_mask``): the tokens a drafter must propose.
draft vocabulary of size N
    the N most frequent generated tokens (ties: lower id first) plus the special tokens
    (bos/eos/pad, the tokenizer's special tokens, which hold the chat template's
    markers), so its size is N plus the specials not already among them.
``auto``
    the smallest N whose most frequent tokens cover at least :data:`AUTO_COVERAGE` of
    the generated tokens.
``0``
    the full target vocabulary (no reduction; vLLM then needs no d2t).
coverage
    generated tokens whose id is in the draft vocabulary / all generated tokens.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from distill.errors import ConfigError
from distill.heads.vocab import DraftVocab
from distill.store import iter_token_rows

AUTO_COVERAGE = 0.99


@dataclass
class DraftVocabReport:
    """How a draft vocabulary was chosen and what it covers (stats only)."""

    requested: str  # "auto", "0" or N
    size: int  # Vd: draft ids
    frequent: int  # N: most frequent generated tokens taken
    special_ids: list[int] = field(default_factory=list)  # always included
    special_added: int = 0  # specials that were not among the N
    target_vocab: int = 0  # V
    generated_tokens: int = 0
    distinct_generated: int = 0
    covered_tokens: int = 0

    @property
    def coverage(self) -> float:
        return self.covered_tokens / self.generated_tokens if self.generated_tokens else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "coverage": self.coverage}


def generated_token_counts(data: Path | str, vocab_size: int) -> np.ndarray:
    """How often each token id was generated in a dataset: (V,) int64."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for ids, mask in iter_token_rows(data, vocab_size, "a draft vocabulary from it (--model)"):
        counts += np.bincount(ids[mask], minlength=vocab_size)
    return counts


def special_token_ids(model_path: Path) -> list[int]:
    """bos/eos/pad and every special token of the model's tokenizer (the chat template's markers among them)."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(model_path)
    ids = set(tok.all_special_ids)
    ids |= {i for i, t in getattr(tok, "added_tokens_decoder", {}).items() if getattr(t, "special", False)}
    conf = AutoConfig.from_pretrained(model_path)
    sources = [conf]
    try:
        sources.append(GenerationConfig.from_pretrained(model_path))
    except OSError:  # no generation_config.json: the model config's ids are all there is
        pass
    for src in sources:
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            v = getattr(src, name, None)
            ids |= set(v) if isinstance(v, (list, tuple)) else ({v} if v is not None else set())
    return sorted(i for i in ids if i is not None and i >= 0)


def parse_draft_vocab(spec) -> str:
    """``auto`` | N (>= 0; 0 = the full vocabulary) -> its canonical string."""
    text = str(spec).strip().lower()
    if text == "auto":
        return text
    try:
        n = int(text)
    except ValueError:
        raise ConfigError(f"--draft-vocab is auto or a token count N (0: the full vocabulary); got '{spec}'") from None
    if n < 0:
        raise ConfigError(f"--draft-vocab must be >= 0; got {n}")
    return str(n)


def choose_draft_vocab(counts: np.ndarray, spec: str, special_ids: list[int]) -> tuple[DraftVocab, DraftVocabReport]:
    """Generated-token counts (V,) and ``auto`` | N -> the draft vocabulary and its report."""
    spec = parse_draft_vocab(spec)
    V = counts.shape[0]
    total = int(counts.sum())
    if total == 0:
        raise ConfigError("the training data holds no generated token to choose a draft vocabulary from")
    distinct = int((counts > 0).sum())
    if spec == "0":
        vocab = DraftVocab.full(V)
        return vocab, DraftVocabReport(requested=spec, size=V, frequent=V, special_ids=list(special_ids), target_vocab=V,
                                       generated_tokens=total, distinct_generated=distinct, covered_tokens=total)
    ranked = np.argsort(-counts, kind="stable")[:distinct]  # generated ids, most frequent first (ties: lower id)
    if spec == "auto":
        share = np.cumsum(counts[ranked]) / total  # (distinct,) coverage of the n most frequent, n = 1..distinct
        n = int(np.argmax(share >= AUTO_COVERAGE - 1e-12)) + 1  # 1e-12: float rounding of an exact 99%
    else:
        n = min(int(spec), distinct)
    frequent = set(ranked[:n].tolist())
    specials = [i for i in special_ids if 0 <= i < V]
    ids = frequent | set(specials)
    vocab = DraftVocab.from_target_ids(torch.tensor(sorted(ids), dtype=torch.int64), V)
    report = DraftVocabReport(requested=spec, size=vocab.size, frequent=n, special_ids=specials,
                              special_added=len(set(specials) - frequent), target_vocab=V, generated_tokens=total,
                              distinct_generated=distinct, covered_tokens=int(counts[sorted(ids)].sum()))
    return vocab, report
