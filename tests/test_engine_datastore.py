"""The lookup proposer's datastore: the n-gram index over a dataset's generated text, its merge with the context's
matches, greedy == plain with it on MT-Bench, and the errors a wrong dataset gets (real shards from the real generator)."""

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
def test_the_longest_matching_suffix_and_its_continuations_within_generated_text():
    #        context | generated
    docs = [([9, 1, 2], 2),           # position 2 (token 2) only: after (1), after (9, 1)
            ([5, 1, 2, 3, 4], 1),     # 1 2 3 4 generated
            ([7, 1, 2, 3, 8], 3)]     # 3 8 generated: (1, 2) is followed by 3 8 here, but 1 and 2 are context only
    store = Datastore(docs, max_ngram=4, depth=3)
    assert store.generated_tokens == 1 + 4 + 2 and store.documents == 3
    n, found = store.continuations([0, 5, 1, 2], occurrences=8)
    assert n == 3 and found == [(3, 4)]  # (5, 1, 2): the second document only; stops at its end
    n, found = store.continuations([6, 1, 2], occurrences=8)  # (6, 1, 2) never occurred: (1, 2) did, twice
    assert n == 2 and sorted(found) == [(3, 4), (3, 8)]
    n, found = store.continuations([4, 9, 1], occurrences=8)  # (9, 1) precedes the first document's 2
    assert n == 2 and found == [(2,)]
    assert store.continuations([4, 9, 1], occurrences=8, min_ngram=3) == (0, [])
    assert store.continuations([6], occurrences=8) == (0, [])  # 6 never occurred
    # a token that is only context (7, 5, 9 at a document's start) is never a continuation
    for t in (1, 2, 3):
        assert not {5, 7, 9} & {x for cont in store.continuations([t], 8)[1] for x in cont}
    n, few = store.continuations([2], occurrences=1)  # at most `occurrences`, evenly spread over the range
    assert n == 1 and len(few) == 1
    assert Datastore([], max_ngram=3).continuations([1, 2], 4) == (0, [])


def test_the_merged_tree_ranks_the_context_first_and_drafts_from_the_datastore_where_the_context_has_no_match():
    store = Datastore([([1, 2, 3, 4, 5], 1), ([2, 3, 6], 1)], max_ngram=3, depth=3)
    lk = Lookup(max_nodes=4, depth=3, datastore=store, store_weight=0.5)
    # row 0 repeats (2 3): the context says 9, the datastore 4 5 and 6; row 1 has no repeat of its own
    state = LookupState([_Context([2, 3, 9, 0, 2, 3], 6), _Context([8, 2, 3], 6)])
    prop = lk.propose(state, torch.tensor([3, 3]), torch.tensor([5, 2]), 5, 4)
    row0 = list(zip(prop.buffers.parent[0, 1:].tolist(), prop.tokens[0, 1:].tolist()))
    # the context's own continuation 9 0 2 (weight 1 a node) is kept whole; the datastore's two, 6 and 4 5 (0.5 shared:
    # 0.25 each), fill the budget in the index's order (6 first); parents come before children
    assert row0 == [(0, 9), (0, 6), (1, 0), (3, 2)]
    row1 = list(zip(prop.buffers.parent[1, 1:].tolist(), prop.tokens[1, 1:].tolist()))
    assert (0, 4) in row1 and (0, 6) in row1  # no context match: the datastore alone drafts
    assert Lookup(max_nodes=4, depth=3).propose(LookupState([_Context([8, 2, 3], 6)]), torch.tensor([3]),
                                                torch.tensor([2]), 2, 4).tokens.shape == (1, 1)  # without it: plain
    with pytest.raises(ConfigError, match="weight"):
        Lookup(datastore=store, store_weight=0)


# -- from a dataset ------------------------------------------------------------------------------------
def test_a_dataset_s_generated_spans_are_indexed_and_a_wrong_dataset_is_refused(real_shards, tmp_path):
    store = Datastore.from_dataset(real_shards, vocab_size=49152)
    generated = sum(int(np.sum(r["loss_mask"])) for r in iter_rows(real_shards, columns=["loss_mask"]))
    assert store.generated_tokens == generated and store.documents >= 16  # every reply of the 16 conversations
    row = next(iter_rows(real_shards, columns=["input_ids", "loss_mask"]))
    ids, mask = np.asarray(row["input_ids"]), np.asarray(row["loss_mask"], bool)
    first = int(np.argmax(mask))  # the first reply's first token, after its assistant header
    n, found = store.continuations(ids[:first].tolist(), occurrences=64)
    assert n == store.max_ngram and tuple(ids[first:first + store.depth]) in found
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
