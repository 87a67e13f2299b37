"""Streaming windows and batches from real shards: alignment, targets only where the teacher generated."""

from __future__ import annotations

import numpy as np

from distill.store import decode_row_dense, iter_rows
from distill.train.data import iter_batches, iter_examples, teacher_encoding


def test_windows_cover_each_row_in_order_with_the_decoded_teacher(real_shards):
    enc = teacher_encoding(real_shards)
    rows = list(iter_rows(real_shards))
    examples = iter_examples(real_shards, max_len=48)
    for row in rows[:5]:
        ids = np.asarray(row["input_ids"])
        mask = np.asarray(row["loss_mask"], dtype=bool)
        t_ids, t_lp = decode_row_dense(ids, mask, row["teacher_ids"], row["teacher_lp"], enc)
        for s in range(0, len(ids), 48):
            if not mask[s + 1 : s + 48].any():
                continue
            ex = next(examples)
            assert len(ex.input_ids) <= 48
            assert np.array_equal(ex.input_ids, ids[s : s + 48])
            assert np.array_equal(ex.loss_mask, mask[s : s + 48])
            assert np.array_equal(ex.teacher_ids, t_ids[s : s + 48])
            assert np.array_equal(ex.teacher_lp, t_lp[s : s + 48])


def test_batches_pad_without_targets_and_skip_resumes_the_same_order(real_shards):
    batches = list(iter_batches(real_shards, max_len=64, batch_size=3, epoch=0))
    for b in batches:
        pad = b["attention_mask"] == 0
        assert not b["loss_mask"][pad].any()
        assert (b["teacher_ids"][pad] == -1).all()
        # teacher rows exist exactly where the teacher generated
        assert torch_equal(b["teacher_ids"][..., 0] >= 0, b["loss_mask"])
    skipped = list(iter_batches(real_shards, max_len=64, batch_size=3, epoch=0, skip=2))
    assert len(skipped) == len(batches) - 2
    assert all((a["input_ids"] == b["input_ids"]).all() for a, b in zip(batches[2:], skipped))


def test_shuffle_buffer_is_seeded_per_epoch(real_shards):
    def order(epoch, seed):
        return [tuple(b["input_ids"][0, :8].tolist()) for b in iter_batches(real_shards, 64, 1, epoch, seed, shuffle_buffer=8)]

    plain = [tuple(b["input_ids"][0, :8].tolist()) for b in iter_batches(real_shards, 64, 1, 0)]
    assert order(0, 0) == order(0, 0)
    assert order(0, 0) != order(1, 0)
    assert sorted(order(0, 0)) == sorted(plain) and order(0, 0) != plain


def torch_equal(a, b) -> bool:
    return bool((a == b).all())


def test_windows_with_context_target_every_generated_token_exactly_once(real_shards):
    """Without context a window's first token has no predecessor and is lost; with context each
    following window re-reads history without targets, so every generated token (after a row's
    first token) is a target exactly once."""
    generated = sum(int(np.asarray(r["loss_mask"][1:]).sum()) for r in iter_rows(real_shards, columns=["loss_mask"]))
    per_window = lambda ctx: [int(ex.loss_mask[1:].sum()) for ex in iter_examples(real_shards, max_len=40, context=ctx)]
    assert sum(per_window(16)) == generated
    assert sum(per_window(0)) < generated
    long_rows = [ex for ex in iter_examples(real_shards, max_len=40, context=16)]
    assert len(long_rows) > len(list(iter_rows(real_shards, columns=["id"])))  # some rows span several windows


def test_teacherless_shards_train_with_hard_targets_and_refuse_soft_ones(real_shards, tmp_path):
    import pytest

    from distill.data.convert import export, seed_to_shards
    from distill.errors import ConfigError
    from distill.train import TrainConfig, train

    export(real_shards, "openai", tmp_path / "c.jsonl")
    seed_to_shards(str(tmp_path / "c.jsonl"), tmp_path / "plain", limit=4)
    assert teacher_encoding(tmp_path / "plain") is None
    ex = next(iter_examples(tmp_path / "plain", max_len=64))
    assert ex.teacher_ids.shape == (len(ex.input_ids), 0) and ex.loss_mask.any()
    for bad in ({"targets": "soft"}, {"mode": "medusa2"}):
        with pytest.raises(ConfigError, match="no teacher top-k"):
            train(TrainConfig(data=str(tmp_path / "plain"), out=str(tmp_path / "heads"), progress=False, **bad))
    summary = train(TrainConfig(data=str(tmp_path / "plain"), out=str(tmp_path / "heads"), heads=2, share_lm_head=True,
                                max_len=64, batch_size=2, steps=1, progress=False))
    assert summary.steps == 1 and (tmp_path / "heads" / "model.safetensors").is_file()


def test_packed_rows_give_each_window_the_hidden_states_and_losses_it_has_alone(real_shards, hf_model):
    import torch

    from distill.train.data import collate, packed
    from distill.train.losses import Term, chunked_term_losses

    windows = list(iter_examples(real_shards, max_len=64))[:7]
    packs = list(packed(iter(windows), 160))
    assert len(packs) < len(windows) and all(len(p.input_ids) <= 160 for p in packs)
    assert sum(int(p.segment_ids.max()) + 1 for p in packs) == len(windows)
    batch, alone = collate(packs), collate(windows)
    assert int(batch["attention_mask"].sum()) == int(alone["attention_mask"].sum())  # the same real tokens
    decoder, lm = hf_model.get_decoder(), hf_model.get_output_embeddings()
    with torch.no_grad():
        h_packed = decoder(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).last_hidden_state
        h_alone = decoder(input_ids=alone["input_ids"], attention_mask=alone["attention_mask"], use_cache=False).last_hidden_state
        i = 0
        for r, p in enumerate(packs):
            for s in range(int(p.segment_ids.max()) + 1):
                cols = np.flatnonzero(p.segment_ids == s)
                n = len(windows[i].input_ids)
                assert torch.allclose(h_packed[r, cols], h_alone[i, :n], atol=2e-4), (r, s)
                i += 1
        # Targets never cross a window boundary: every head sees the same (position, target) pairs either way.
        terms = [Term(lambda h: lm(h), offset=k + 2) for k in range(3)]
        loss_p, stats_p = chunked_term_losses(h_packed, terms, batch["input_ids"], batch["loss_mask"], segment_ids=batch["segment_ids"])
        loss_a, stats_a = chunked_term_losses(h_alone, terms, alone["input_ids"], alone["loss_mask"])
    assert [s.count for s in stats_p] == [s.count for s in stats_a] and stats_p[0].count > 0
    assert torch.allclose(loss_p, loss_a, atol=1e-4)
    # Without segment ids the packed rows would pair positions with the next window's tokens.
    _, leaky = chunked_term_losses(h_packed, terms, batch["input_ids"], batch["loss_mask"])
    assert leaky[2].count > stats_p[2].count
