"""The lookup proposer's datastore: the suffix index over a dataset's generated text, its drafts merged with the
context's, greedy == plain with it on MT-Bench, and the errors a wrong dataset gets (real shards from the real generator)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import MT_QUESTIONS, MT_TOKENS, run_distill
from distill.engine import Engine, EngineConfig, SamplingParams
from distill.engine.proposers.datastore import Datastore
from distill.engine.proposers.lookup import Lookup, LookupState, _Context
from distill.errors import ConfigError
from distill.store.shards import iter_rows


# -- the index (pure) ---------------------------------------------------------------------------------
def conts(store, context, occurrences=8, min_ngram=1):
    """{match length: (continuations, occurrences in all)} of a store's levels."""
    return {lv.n: (lv.continuations, lv.total) for lv in store.levels(context, 3, occurrences, min_ngram)}


def test_every_matching_suffix_and_its_continuations_within_generated_text():
    #        context | generated
    docs = [([9, 1, 2], 2),           # position 2 (token 2) only: after (1), after (9, 1)
            ([5, 1, 2, 3, 4], 1),     # 1 2 3 4 generated
            ([7, 1, 2, 3, 8], 3)]     # 3 8 generated: (1, 2) is followed by 3 8 here, but 1 and 2 are context only
    store = Datastore(docs, max_ngram=4, depth=3)
    assert store.generated_tokens == 1 + 4 + 2 and store.documents == 3
    # (5, 1, 2): the second document only, and stops at its end; (1, 2) and (2): both, the newest first
    assert conts(store, [0, 5, 1, 2]) == {1: ([[3, 8], [3, 4]], 2), 2: ([[3, 8], [3, 4]], 2), 3: ([[3, 4]], 1)}
    assert conts(store, [6, 1, 2]) == {1: ([[3, 8], [3, 4]], 2), 2: ([[3, 8], [3, 4]], 2)}  # (6, 1, 2) never occurred
    assert conts(store, [4, 9, 1]) == {1: ([[2, 3, 4], [2]], 2), 2: ([[2]], 1)}  # (9, 1) precedes the first's 2
    assert conts(store, [4, 9, 1], min_ngram=2) == {2: ([[2]], 1)}
    assert conts(store, [6]) == {} and conts(store, [70_000]) == {}  # never occurred; an id no document holds
    # a token that is only context (7, 5, 9 at a document's start) is never a continuation
    for t in (1, 2, 3):
        assert not {5, 7, 9} & {x for cs, _ in conts(store, [t]).values() for c in cs for x in c}
    assert conts(store, [2], occurrences=1) == {1: ([[3, 4]], 2)}  # a sample of the range; the total stays
    assert Datastore([], max_ngram=3).levels([1, 2], 3, 4) == []
    # 2-byte keys for a vocabulary under 65,535 ids, 4-byte positions: 2 x max_ngram + 8 bytes an indexed token
    assert store.keys.dtype == np.uint16 and store.positions.dtype == np.int32
    assert Datastore([([70_000, 1, 2], 1)], max_ngram=2).keys.dtype == np.int32


def test_the_tree_merges_the_context_s_draft_and_the_datastore_s_and_the_datastore_drafts_where_the_context_cannot():
    store = Datastore([([1, 2, 3, 4, 5], 1), ([2, 3, 6], 1)], max_ngram=3, depth=3)
    lk = Lookup(max_nodes=4, depth=3, datastore=store, history_tokens=0, spec_factor=4.0)
    # row 0 repeats (2 3): the context says 9 0 2 (1/2 a node); in the datastore (2, 3) was followed by 4 5 and by 6
    # (1/3 each, the newer document's 6 first); row 1 has no repeat of its own
    state = LookupState([_Context([2, 3, 9, 0, 2, 3]), _Context([8, 2, 3])])
    prop = lk.propose(state, torch.tensor([3, 3]), torch.tensor([5, 2]), 5, 4)
    row0 = list(zip(prop.buffers.parent[0, 1:].tolist(), prop.tokens[0, 1:].tolist()))
    assert row0 == [(0, 9), (0, 6), (1, 0), (3, 2)]  # the context's chain (1/2) first, then the store's best (1/3)
    row1 = list(zip(prop.buffers.parent[1, 1:].tolist(), prop.tokens[1, 1:].tolist()))
    assert (0, 4) in row1 and (0, 6) in row1  # no context match: the datastore alone drafts
    assert Lookup(max_nodes=4, depth=3, history_tokens=0).propose(
        LookupState([_Context([8, 2, 3])]), torch.tensor([3]), torch.tensor([2]), 2, 4).tokens.shape == (1, 1)


# -- from a dataset ------------------------------------------------------------------------------------
def test_a_dataset_s_generated_spans_are_indexed_and_a_wrong_dataset_is_refused(real_shards, tmp_path):
    store = Datastore.from_dataset(real_shards, vocab_size=49152)
    generated = sum(int(np.sum(r["loss_mask"])) for r in iter_rows(real_shards, columns=["loss_mask"]))
    assert store.generated_tokens == generated and store.documents >= 16  # every reply of the 16 conversations
    row = next(iter_rows(real_shards, columns=["input_ids", "loss_mask"]))
    ids, mask = np.asarray(row["input_ids"]), np.asarray(row["loss_mask"], bool)
    first = int(np.argmax(mask))  # the first reply's first token, after its assistant header
    (*_, deepest) = store.levels(ids[:first].tolist(), store.depth, occurrences=64)
    assert deepest.n == store.max_ngram and ids[first:first + store.depth].tolist() in deepest.continuations
    with pytest.raises(ConfigError, match="vocabulary"):
        Datastore.from_dataset(real_shards, vocab_size=1000)
    with pytest.raises(ConfigError, match="another tokenizer"):
        Datastore.from_dataset(real_shards, vocab_size=49152, tokenizer_sha256="0" * 16)
    recorded = json.loads((real_shards / "manifest.json").read_text())["meta"]["model"]["tokenizer_sha256"]
    assert Datastore.from_dataset(real_shards, 49152, tokenizer_sha256=recorded).generated_tokens == generated


def test_greedy_lookup_with_a_datastore_equals_plain_greedy_on_mt_bench(hf_model, tokenizer, mt_prompts, mt_plain,
                                                                        real_shards):
    store = Datastore.from_dataset(real_shards, vocab_size=hf_model.config.vocab_size)
    engine = Engine(hf_model, tokenizer, Lookup(max_nodes=8, datastore=store), EngineConfig(speculate_max_batch=8))
    results, stats = engine.generate(mt_prompts, SamplingParams(max_tokens=MT_TOKENS))  # batch 3
    assert [r.token_ids for r in results] == mt_plain
    assert stats.batch_size == MT_QUESTIONS and stats.tree_nodes > 0
    one, _ = engine.generate([mt_prompts[2]], SamplingParams(max_tokens=MT_TOKENS))
    assert one[0].token_ids == mt_plain[2]


def test_engine_options_and_the_bench_cli_with_a_datastore(real_shards, tmp_path, cli_env):
    with pytest.raises(ConfigError, match="lookup"):
        Engine.from_pretrained(None, None, EngineConfig(lookup_data=str(real_shards)))
    from distill.bench.config import BenchConfig
    from distill.serve.config import ServeConfig

    with pytest.raises(ConfigError, match="--heads lookup"):
        BenchConfig.from_options(heads="some/heads", lookup_data=str(real_shards))
    with pytest.raises(ConfigError, match="--heads lookup"):
        ServeConfig.from_options(heads=None, lookup_data=str(real_shards))
    with pytest.raises(ConfigError, match="ngram"):
        ServeConfig.from_options(heads="lookup", engine="vllm", lookup_data=str(real_shards))
    r = run_distill(["bench", "--heads", "lookup", "--lookup-data", str(real_shards), "--limit", "1", "--max-tokens", "12", "--modes",
                     "greedy", "--out", str(tmp_path / "b")], env=cli_env)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads((tmp_path / "b" / "bench.json").read_text())
    assert doc["config"]["decoding"]["lookup_data"] == str(real_shards) and "datastore" in doc["tree"]["source"]
    assert {g["identical"] for g in doc["groups"]} == {1}
