"""The teacher top-k encoding: exact ids, bounded logprob error, rank-order contract."""

import numpy as np
import pytest
import torch

from distill.store.teacher import TeacherEncoding, decode_row_dense, decode_topk, encode_topk


def _real_like_topk(n: int, k: int, vocab: int, seed: int = 0):
    """Top-k of log-softmax over random peaked logits, like a language model's."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=g) * 3
    logits[torch.arange(n), torch.randint(0, vocab, (n,), generator=g)] += torch.rand(n, generator=g) * 25  # peaked rows
    top = torch.log_softmax(logits, -1).topk(k, -1)
    return top.indices.numpy(), top.values.numpy()


def test_roundtrip_keeps_ids_exact_and_logprobs_within_half_a_step():
    enc = TeacherEncoding.for_vocab(20, 49152)
    ids, lps = _real_like_topk(500, 20, 49152)
    flat_ids, flat_lp = encode_topk(ids, lps, enc)
    assert flat_ids.dtype == np.uint16 and flat_lp.dtype == np.uint16 and flat_ids.shape == (500 * 20,)
    out_ids, out_lps = decode_topk(flat_ids, flat_lp, enc)
    np.testing.assert_array_equal(out_ids, ids)
    err = np.abs(out_lps - lps).max()
    assert err <= enc.max_error + 1e-6, err
    assert enc.max_error < 0.02  # the benchmark's bound, with a 40x margin


def test_large_vocab_uses_uint32_ids():
    enc = TeacherEncoding.for_vocab(4, 128256)
    ids = np.array([[128000, 5, 70000, 1]])
    lps = np.array([[-0.1, -2.0, -3.5, -9.0]])
    flat_ids, _ = encode_topk(ids, lps, enc)
    assert flat_ids.dtype == np.uint32
    np.testing.assert_array_equal(decode_topk(flat_ids, encode_topk(ids, lps, enc)[1], enc)[0], ids)


def test_values_below_the_floor_are_clipped_not_wrapped():
    enc = TeacherEncoding.for_vocab(3, 100)
    _, lps = decode_topk(*encode_topk(np.array([[1, 2, 3]]), np.array([[-0.5, -70.0, -200.0]]), enc), enc)
    floor = -65535 / enc.scale
    assert lps[0, 0] == pytest.approx(-0.5, abs=enc.max_error)
    assert lps[0, 1] == pytest.approx(floor) and lps[0, 2] == pytest.approx(floor)


def test_candidates_out_of_rank_order_are_refused():
    enc = TeacherEncoding.for_vocab(2, 100)
    with pytest.raises(ValueError, match="rank order"):
        encode_topk(np.array([[1, 2]]), np.array([[-3.0, -1.0]]), enc)


def test_dense_decode_aligns_rows_with_input_ids():
    enc = TeacherEncoding.for_vocab(2, 100)
    input_ids = [5, 6, 7, 8, 9]
    mask = [False, False, True, True, False]
    flat = encode_topk(np.array([[7, 1], [8, 2]]), np.array([[-0.1, -3.0], [-0.2, -2.0]]), enc)
    ids, lps = decode_row_dense(input_ids, mask, *flat, enc)
    assert ids.shape == (5, 2)
    assert ids[2].tolist() == [7, 1] and ids[3].tolist() == [8, 2]
    assert (ids[[0, 1, 4]] == -1).all() and np.isneginf(lps[[0, 1, 4]]).all()
    with pytest.raises(ValueError, match="loss_mask marks"):
        decode_row_dense(input_ids, [True] * 5, *flat, enc)
