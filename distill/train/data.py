"""Streaming training data from shards: windows of ``max_len`` tokens, padded batches.

Terms
-----
example
    one window of at most ``max_len`` consecutive tokens of a conversation (a long
    conversation becomes several windows) with its ``loss_mask`` and the teacher
    top-k aligned to ``input_ids`` (decoded by :func:`distill.store.decode_row_dense`).
    Windows without any generated token are dropped.
pack
    several windows laid end to end in one row of at most ``max_len`` tokens
    (``--pack``): ``position_ids`` restart at 0 for each window and ``segment_ids``
    number them, so attention stays inside a window (transformers builds the
    block-diagonal causal mask from the restarting positions when no 2D attention
    mask is passed) and no target crosses into the next window. No compute is spent
    on padding, which on short chat turns is most of a padded batch.
item
    what a batch holds ``batch_size`` of: a window, or a packed row of windows (:func:`iter_items`).
data position
    ``(epoch, items)``: how many items of this epoch were consumed, by every process together; a
    resumed run re-streams the epoch and skips that many (the order, including the seeded
    shuffle buffer, is a pure function of the data, the config and the epoch, never of the
    number of processes).

Memory stays bounded: shards are read one record batch at a time, and at most
``shuffle_buffer`` examples (or one batch) are held.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from distill.store import TeacherEncoding, decode_row_dense, iter_rows, load_manifest, manifest_encoding

COLUMNS = ["id", "input_ids", "loss_mask", "teacher_ids", "teacher_lp"]


@dataclass
class Example:
    input_ids: np.ndarray  # (T,) int64
    loss_mask: np.ndarray  # (T,) bool
    teacher_ids: np.ndarray  # (T, Kt) int64, -1 where the teacher did not generate
    teacher_lp: np.ndarray  # (T, Kt) float32, -inf where the teacher did not generate
    segment_ids: np.ndarray | None = None  # (T,) int64: which window of a pack each token is from
    position_ids: np.ndarray | None = None  # (T,) int64: restarting at 0 for each window of a pack


def teacher_encoding(root: Path | str) -> TeacherEncoding | None:
    """The dataset's teacher encoding; ``None`` when it has no teacher (hard targets only)."""
    return manifest_encoding(load_manifest(root).get("meta", {}))


def dataset_meta(root: Path | str) -> dict:
    return load_manifest(root).get("meta", {})


def iter_examples(root: Path | str, max_len: int, context: int = 0) -> Iterator[Example]:
    """Every window of every row, in shard order.

    With ``context`` > 0, each window after a row's first starts ``context`` tokens
    before the previous window's end, and those tokens carry no target (the previous
    window trained them): the model sees some history instead of a cold start.
    """
    if not 0 <= context < max_len:
        raise ValueError(f"context must be in [0, max_len); got {context} for max_len {max_len}")
    enc = teacher_encoding(root)
    for row in iter_rows(root, columns=COLUMNS, batch_size=16):
        ids = np.asarray(row["input_ids"], dtype=np.int64)
        mask = np.asarray(row["loss_mask"], dtype=bool)
        if enc is None:  # no teacher: (T, 0) candidates
            t_ids, t_lp = np.zeros((len(ids), 0), np.int64), np.zeros((len(ids), 0), np.float32)
        else:
            t_ids, t_lp = decode_row_dense(ids, mask, row["teacher_ids"], row["teacher_lp"], enc)
        start, fresh = 0, 0  # window start; tokens before ``fresh`` were targets of an earlier window
        while True:
            e = min(len(ids), start + max_len)
            m = mask[start:e].copy()
            m[: fresh - start] = False
            if m[1:].any():  # a target needs a token before it in the window
                yield Example(ids[start:e], m, t_ids[start:e], t_lp[start:e])
            if e >= len(ids):
                break
            start, fresh = e - context, e


def shuffled(it: Iterator[Example], buffer: int, seed: int) -> Iterator[Example]:
    """A seeded shuffle buffer (``buffer`` 0 or 1: unchanged order)."""
    if buffer <= 1:
        yield from it
        return
    rng = random.Random(seed)
    pool: list[Example] = []
    for ex in it:
        pool.append(ex)
        if len(pool) >= buffer:
            yield pool.pop(rng.randrange(len(pool)))
    rng.shuffle(pool)
    yield from pool


def packed(it: Iterator[Example], max_len: int) -> Iterator[Example]:
    """Lay consecutive windows end to end into rows of at most ``max_len`` tokens (see ``pack``)."""
    group: list[Example] = []
    size = 0

    def emit() -> Example:
        return Example(
            np.concatenate([e.input_ids for e in group]), np.concatenate([e.loss_mask for e in group]),
            np.concatenate([e.teacher_ids for e in group]), np.concatenate([e.teacher_lp for e in group]),
            segment_ids=np.concatenate([np.full(len(e.input_ids), i, np.int64) for i, e in enumerate(group)]),
            position_ids=np.concatenate([np.arange(len(e.input_ids), dtype=np.int64) for e in group]),
        )

    for ex in it:
        if group and size + len(ex.input_ids) > max_len:
            yield emit()
            group, size = [], 0
        group.append(ex)
        size += len(ex.input_ids)
    if group:
        yield emit()


def collate(examples: list[Example], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Pad to the longest example: input_ids, attention_mask, loss_mask (B, T); teacher_ids, teacher_lp (B, T, Kt).

    Packed examples also give ``position_ids`` and ``segment_ids`` (B, T); padding gets
    segment -1 and positions that start a segment of its own.
    """
    B, T, K = len(examples), max(len(e.input_ids) for e in examples), examples[0].teacher_ids.shape[1]
    ids = np.full((B, T), pad_id, dtype=np.int64)
    att = np.zeros((B, T), dtype=np.int64)
    mask = np.zeros((B, T), dtype=bool)
    t_ids = np.full((B, T, K), -1, dtype=np.int64)
    t_lp = np.full((B, T, K), -np.inf, dtype=np.float32)
    for b, e in enumerate(examples):
        n = len(e.input_ids)
        ids[b, :n], att[b, :n], mask[b, :n] = e.input_ids, 1, e.loss_mask
        t_ids[b, :n], t_lp[b, :n] = e.teacher_ids, e.teacher_lp
    out = {
        "input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(att), "loss_mask": torch.from_numpy(mask),
        "teacher_ids": torch.from_numpy(t_ids), "teacher_lp": torch.from_numpy(t_lp),
    }
    if examples[0].segment_ids is not None:
        seg = np.full((B, T), -1, dtype=np.int64)
        pos = np.tile(np.arange(T, dtype=np.int64), (B, 1))
        for b, e in enumerate(examples):
            n = len(e.input_ids)
            seg[b, :n], pos[b, :n] = e.segment_ids, e.position_ids
            pos[b, n:] -= n  # the padding restarts at 0: a segment of its own, attending only to itself
        out["segment_ids"], out["position_ids"] = torch.from_numpy(seg), torch.from_numpy(pos)
    return out


def decoder_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a transformers decoder is given besides ``input_ids`` for this batch.

    A packed batch passes its restarting ``position_ids`` and no 2D mask: transformers then
    masks attention block-diagonally per window (``masking_utils``' packed-sequence path).
    A padded batch passes its ``attention_mask``.
    """
    if "position_ids" in batch:
        return {"position_ids": batch["position_ids"]}
    return {"attention_mask": batch["attention_mask"]}


def iter_items(root: Path | str, max_len: int, epoch: int, seed: int = 0, shuffle_buffer: int = 0, context: int = 0,
               pack: bool = False) -> Iterator[Example]:
    """The items of one epoch in training order: windows, or packed rows of windows (``pack``); a batch is
    ``batch_size`` consecutive items, whatever process or micro-batch it goes to."""
    stream = shuffled(iter_examples(root, max_len, context), shuffle_buffer, seed * 100003 + epoch)
    return packed(stream, max_len) if pack else stream


def iter_batches(root: Path | str, max_len: int, batch_size: int, epoch: int, seed: int = 0, shuffle_buffer: int = 0,
                 skip: int = 0, context: int = 0, pack: bool = False) -> Iterator[dict[str, torch.Tensor]]:
    """Batches of one epoch, skipping the first ``skip`` batches."""
    stream = iter_items(root, max_len, epoch, seed, shuffle_buffer, context, pack)
    pending: list[Example] = []
    index = 0
    for ex in stream:
        pending.append(ex)
        if len(pending) == batch_size:
            if index >= skip:
                yield collate(pending)
            index += 1
            pending = []
    if pending and index >= skip:
        yield collate(pending)


def count_tokens(root: Path | str) -> dict:
    """Generated and total tokens of a dataset (from its manifest)."""
    m = load_manifest(root)
    t = m.get("totals", {})
    return {"rows": t.get("rows", 0), "generated_tokens": t.get("generated_tokens", 0), "prompt_tokens": t.get("prompt_tokens", 0)}
