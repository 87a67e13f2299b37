"""The replay backend: a dataset's stored replies through the real pipeline; vLLM's candidates read as arrays."""

from __future__ import annotations

import types

import numpy as np
import pyarrow.parquet as pq
import pytest

from distill.errors import BackendError
from distill.generate import GenerateConfig, Generator
from distill.generate.backends import ReplayBackend, Request, VLLMBackend, best_distinct_rows, replay_config
from distill.store import TeacherEncoding, decode_topk, encode_topk, iter_rows, load_manifest

SOURCE = dict(seed="sharegpt", mode="multi-turn", limit=6, shard_size=4, max_new_tokens=12, temperature=0.7,
              dtype="float32", sampling_seed=3)
CONTEXT = 2048  # the session backends' max_model_len


@pytest.fixture(scope="module")
def source(tmp_path_factory, hf_backend):
    """Six ShareGPT conversations from the transformers backend, top-20 teacher, shards of four rows: two shards.

    Their first turns repeat ("Who are you?" four times), so one prompt has several stored replies."""
    out = tmp_path_factory.mktemp("replay-source") / "out"
    summary = Generator(GenerateConfig(out=str(out), **SOURCE), backend=hf_backend).run()
    assert summary.generated == 6 and summary.balanced
    return out


def _tables(root):
    return [pq.read_table(root / s["file"]) for s in load_manifest(root)["shards"] if s["file"]]


def _replay(source, model_dir, out, **overrides):
    cfg = replay_config(source, str(out), **overrides)
    backend = ReplayBackend(source, model_dir, max_model_len=CONTEXT)
    return Generator(cfg, backend=backend).run(), backend


def test_replay_writes_the_rows_of_the_run_it_replays(source, model_dir, tmp_path):
    cfg = replay_config(source, str(tmp_path / "replay"))
    assert (cfg.seed, cfg.limit, cfg.shard_size, cfg.max_new_tokens, cfg.topk, cfg.sampling_seed) == ("sharegpt", 6, 4, 12, 20, 3)
    summary, backend = _replay(source, model_dir, tmp_path / "replay")
    assert any(len(replies) > 1 for replies in backend.replies.values())  # the request seed told them apart
    want, got = _tables(source), _tables(tmp_path / "replay")
    assert [t.num_rows for t in got] == [t.num_rows for t in want] == [4, 2]
    for a, b in zip(got, want):
        assert a.column_names == b.column_names
        for name in a.column_names:  # every column, teacher ids and logprob codes included, value for value
            assert a[name].equals(b[name]), name
    src, rep = load_manifest(source), load_manifest(tmp_path / "replay")
    drop = lambda totals: {k: v for k, v in totals.items() if k != "bytes"}  # noqa: E731 - the metadata names the backend
    assert drop(rep["totals"]) == drop(src["totals"]) and summary.generated_tokens == src["totals"]["generated_tokens"]
    assert rep["meta"]["backend"]["name"] == "replay" and rep["meta"]["backend"]["version"].startswith("replay of transformers")
    assert rep["meta"]["backend"]["dtype"] == "float32"


def test_replay_with_a_smaller_teacher_keeps_the_first_candidates(source, model_dir, tmp_path):
    _replay(source, model_dir, tmp_path / "top5", topk=5)
    enc20 = load_manifest(source)["meta"]["teacher"]
    enc5 = load_manifest(tmp_path / "top5")["meta"]["teacher"]
    assert (enc20["k"], enc5["k"]) == (20, 5)
    wide, narrow = TeacherEncoding.from_dict(enc20), TeacherEncoding.from_dict(enc5)
    rows = {r["id"]: r for r in iter_rows(source)}
    for row in iter_rows(tmp_path / "top5"):
        ids5, lps5 = decode_topk(row["teacher_ids"], row["teacher_lp"], narrow)
        ids20, lps20 = decode_topk(rows[row["id"]]["teacher_ids"], rows[row["id"]]["teacher_lp"], wide)
        np.testing.assert_array_equal(ids5, ids20[:, :5])
        np.testing.assert_array_equal(lps5, lps20[:, :5])
        assert row["input_ids"] == rows[row["id"]]["input_ids"]


def test_replay_answers_only_what_the_dataset_holds(source, model_dir):
    from distill.generate.runner import _request_seed

    backend = ReplayBackend(source, model_dir, max_model_len=CONTEXT)
    with pytest.raises(BackendError, match="no reply"):
        backend.generate([Request([1, 2, 3], 12, 0, 20)])
    row = next(r for r in iter_rows(source) if r["id"] == "sharegpt:identity_0")
    turn = next(t for t in row["turns"] if t["role"] == "assistant")
    prompt, reply = row["input_ids"][: turn["start"]], row["input_ids"][turn["start"] : turn["start"] + turn["n_tokens"]]
    assert len(backend.replies[backend._key(prompt)]) == 4  # "Who are you?" opens four of the six conversations
    seed = _request_seed(SOURCE["sampling_seed"], row["id"], 0, "assistant")
    comp = backend.generate([Request(prompt, 12, seed, 20)])[0]
    assert comp.token_ids == reply and comp.topk_ids.shape == (len(reply), 20)
    with pytest.raises(BackendError, match="4 replies, none drawn with this request's seed"):
        backend.generate([Request(prompt, 12, seed + 1, 20)])
    with pytest.raises(BackendError, match="top-21"):
        backend.generate([Request(prompt, 12, seed, 21)])
    with pytest.raises(BackendError, match="asks for 2 tokens"):
        backend.generate([Request(prompt, 2, seed, 20)])


def test_replay_refuses_a_dataset_of_another_model(source, model_dir, tmp_path):
    other = tmp_path / "other-model"  # the same model but for one byte of its tokenizer
    other.mkdir()
    for f in model_dir.iterdir():
        if f.name != "tokenizer.json":
            (other / f.name).symlink_to(f)
    (other / "tokenizer.json").write_text((model_dir / "tokenizer.json").read_text() + "\n")
    with pytest.raises(BackendError, match="replay it with the model that made it"):
        ReplayBackend(source, other)


# -- vLLM's candidates as arrays -----------------------------------------------------------------
def _reference(ids: list[int], lps: list[float], k: int) -> tuple[list[int], list[float]]:
    """One position by the rule's words: each id once (its first logprob), by logprob, ties by id, the first k."""
    first: dict[int, float] = {}
    for i, lp in zip(ids, lps):
        first.setdefault(i, lp)
    ranked = sorted(first.items(), key=lambda item: (-item[1], item[0]))[:k]
    return [i for i, _ in ranked], [lp for _, lp in ranked]


def test_best_distinct_rows_follows_the_rule_at_every_position():
    rng = np.random.default_rng(0)
    n, m, k = 300, 9, 6
    ids = rng.integers(0, 12, size=(n, m))  # a small id range: many repeats
    lps = -rng.integers(0, 5, size=(n, m)).astype(np.float32) / 4  # a few values: many ties
    widths = rng.integers(k, m + 1, size=n)
    valid = np.arange(m) < widths[:, None]
    for r in range(n):  # every row keeps at least k distinct ids
        ids[r, :k] = rng.permutation(12)[:k]
    got_ids, got_lps = best_distinct_rows(np.where(valid, ids, 999), lps, k, valid)
    assert got_ids.shape == got_lps.shape == (n, k)
    for r in range(n):
        want_ids, want_lps = _reference(ids[r, : widths[r]].tolist(), lps[r, : widths[r]].tolist(), k)
        assert got_ids[r].tolist() == want_ids and got_lps[r].tolist() == want_lps, r
    with pytest.raises(BackendError, match="fewer than 6 distinct"):
        best_distinct_rows(np.zeros((2, 9), np.int64), np.zeros((2, 9), np.float32), k)


def _vllm_output(positions, finish="stop"):
    """A vLLM ``CompletionOutput`` as the in-process backend receives it (``flat_logprobs=True``)."""
    flat = types.SimpleNamespace(start_indices=[], end_indices=[], token_ids=[], logprobs=[])
    for sampled, lp, top, top_lps in positions:
        flat.start_indices.append(len(flat.token_ids))
        flat.token_ids += [sampled, *top]
        flat.logprobs += [lp, *top_lps]
        flat.end_indices.append(len(flat.token_ids))
    return types.SimpleNamespace(token_ids=[p[0] for p in positions], finish_reason=finish, logprobs=flat)


def test_vllm_completions_read_the_flat_logprobs_as_vllm_reports_them():
    """The sampled token first, then the top-k: twice when it is among them, k + 1 entries when it is not; the outputs
    of one engine call that share a k are read together, whatever their lengths."""
    first = _vllm_output([  # (sampled id, its logprob, top-k ids, their logprobs)
        (5, -0.1, [5, 7, 2], [-0.1, -2.0, -3.0]),
        (9, -4.5, [1, 3, 2], [-0.5, -1.0, -1.0]),  # sampled outside the top-k; a tie (3 and 2) goes to the lower id
        (4, -1.0, [8, 4, 6], [-0.7, -1.0, -1.0]),
    ])
    user = types.SimpleNamespace(token_ids=[11, 12], finish_reason="length", logprobs=None)  # no teacher asked for
    second = _vllm_output([(6, -0.2, [6, 1, 0], [-0.2, -0.9, -0.9])], finish="length")
    narrow = _vllm_output([(3, -2.0, [1, 2], [-0.3, -1.5]), (1, -0.1, [1, 4], [-0.1, -2.5])])
    comps = VLLMBackend._completions([first, user, second, narrow], [3, 0, 3, 2])
    assert [c.token_ids for c in comps] == [[5, 9, 4], [11, 12], [6], [3, 1]]
    assert [c.finish_reason for c in comps] == ["stop", "length", "length", "stop"]
    assert comps[1].topk_ids is None and comps[1].topk_logprobs is None
    assert comps[0].topk_ids.dtype == np.int64 and comps[0].topk_logprobs.dtype == np.float32
    assert comps[0].topk_ids.tolist() == [[5, 7, 2], [1, 2, 3], [8, 4, 6]]
    np.testing.assert_array_equal(comps[0].topk_logprobs,
                                  np.float32([[-0.1, -2.0, -3.0], [-0.5, -1.0, -1.0], [-0.7, -1.0, -1.0]]))
    assert comps[2].topk_ids.tolist() == [[6, 0, 1]]
    assert comps[3].topk_ids.tolist() == [[1, 2], [1, 4]]
    np.testing.assert_array_equal(comps[3].topk_logprobs, np.float32([[-0.3, -1.5], [-0.1, -2.5]]))


def test_teacher_codes_of_float32_logprobs_are_those_of_float64():
    """encode_topk scales float32 logprobs in float32 (exact by a power of two): the codes must not change."""
    rng = np.random.default_rng(1)
    lps = -np.sort(rng.exponential(rng.choice([0.001, 1.0, 30.0], size=(400, 1)), (400, 20)), axis=1).astype(np.float32)
    lps[0, :4], lps[1, 18:] = [0.0, -0.0, -1e-30, -0.00048828125], [-70.0, -np.inf]  # a tie at half a step, the floor
    ids = rng.integers(0, 49152, (400, 20))
    enc = TeacherEncoding.for_vocab(20, 49152)
    codes32, codes64 = encode_topk(ids, lps, enc)[1], encode_topk(ids, lps.astype(np.float64), enc)[1]
    np.testing.assert_array_equal(codes32, codes64)
    assert codes64.reshape(400, 20)[1, 18:].tolist() == [65535 - codes64.reshape(400, 20)[1, :18].sum(), 0]


@pytest.mark.vllm
def test_replay_of_the_engines_dataset_writes_its_rows(real_shards, model_dir, tmp_path):
    """The session's vLLM dataset (its teacher read through ``VLLMBackend._completions``), replayed."""
    _replay(real_shards, model_dir, tmp_path / "replay")
    want, got = _tables(real_shards), _tables(tmp_path / "replay")
    assert [t.num_rows for t in got] == [t.num_rows for t in want]
    for a, b in zip(got, want):
        for name in a.column_names:
            assert a[name].equals(b[name]), name
