"""The lookup proposer's history: the engine's own earlier replies as a third source of drafts.

The index over them (rebuilt as replies accumulate, oldest dropped past the budget), rows that leave a
batch giving their replies to it, the real model drafting a repeated prompt's reply from its first answer
with the output unchanged, and `distill bench` clearing it so that no measured pass drafts from itself.
"""

from __future__ import annotations

import pytest
import torch

from conftest import MT_TOKENS
from distill.bench import BenchConfig
from distill.bench.runner import BenchRunner
from distill.engine import Engine, EngineConfig, SamplingParams
from distill.engine.proposers.datastore import History
from distill.engine.proposers.lookup import DEFAULT_HISTORY_TOKENS, Lookup
from distill.errors import ConfigError


# -- the index of replies (pure) ----------------------------------------------------------------------
def longest(h: History, context: list[int]) -> tuple[int, list]:
    """(n, continuations) of the longest suffix of ``context`` the history holds ((0, []) when none)."""
    levels = h.levels(context, depth=2, occurrences=4)
    return (levels[-1].n, [tuple(c) for c in levels[-1].continuations]) if levels else (0, [])


def test_replies_are_indexed_as_they_accumulate_and_the_oldest_go_first_past_the_budget():
    h = History(max_tokens=12, max_ngram=3, depth=2)
    assert longest(h, [1, 2]) == (0, []) and h.tokens == 0
    h.add([1, 2, 3, 4], first=2)  # 1 2 is the prompt's tail: only 3 4 are continuations
    assert h.rebuilds == 1 and longest(h, [9, 1, 2]) == (2, [(3, 4)])
    assert longest(h, [0, 1]) == (0, [])  # 2 is context, never drafted
    h.add([5, 6, 7, 8], first=1)  # a second reply, 8 tokens held, 4 queued >= 4/16 indexed: rebuilt at once
    assert h.rebuilds == 2 and longest(h, [5, 6]) == (2, [(7, 8)])
    h.add([9, 3, 4, 10, 11], first=1)  # 13 tokens > 12: the first reply is dropped
    assert h.tokens == 9
    assert longest(h, [2]) == (0, [])  # its n-grams are gone with it
    assert longest(h, [3, 4]) == (2, [(10, 11)])
    h.add(list(range(100, 130)), first=25)  # longer than the budget: its last 12 tokens, the generated 5 among them
    assert h.tokens == 12 and longest(h, [124]) == (1, [(125, 126)])
    assert longest(h, [5, 6]) == (0, [])
    h.add([1, 2], first=2)  # nothing generated: nothing added
    assert h.tokens == 12
    h.clear()
    assert h.tokens == 0 and longest(h, [124]) == (0, [])
    with pytest.raises(ConfigError, match=">= 0"):
        History(-1)


def test_large_histories_rebuild_only_once_a_sixteenth_more_has_queued():
    h = History(max_tokens=10_000, max_ngram=3, depth=2)
    h.add(list(range(100, 1700)), first=0)
    assert h.rebuilds == 1
    for i in range(9):  # 9 x 10 = 90 queued tokens < 1599 / 16: not yet indexed
        h.add([7, 8] * 5, first=0)
    assert h.rebuilds == 1 and longest(h, [7]) == (0, [])
    h.add([7, 8] * 5, first=0)  # 100 queued: rebuilt, the queued replies searchable
    assert h.rebuilds == 2 and (8, 7) in longest(h, [7])[1]


def test_rows_that_leave_the_batch_give_their_replies_and_later_rows_draft_from_them():
    lk = Lookup(max_nodes=4, depth=3)
    assert lk.history is not None and lk.history.max_tokens == DEFAULT_HISTORY_TOKENS
    prompt = [11, 12, 13]
    state = lk.start(torch.zeros(2, 3, 1), torch.tensor([prompt, [21, 22, 0]]), [3, 2], torch.tensor([40, 50]), 16)
    state.rows[0].extend([41, 42, 43])  # row 0 replied 40 41 42 43
    state.keep([1], used=3)  # row 0 finished
    assert lk.history.tokens == 7  # its prompt's tail (3 tokens here) and its reply
    new = lk.start(torch.zeros(1, 3, 1), torch.tensor([prompt]), [3], torch.tensor([40]), 16)
    prop = lk.propose(new, torch.tensor([40]), torch.tensor([3]), 3, 4)
    assert prop.tokens[0, 1:4].tolist() == [41, 42, 43]  # the earlier reply, though this context never repeats
    sampled = lk.start(torch.zeros(1, 3, 1), torch.tensor([prompt]), [3], torch.tensor([40]), 16, greedy=[False])
    assert lk.propose(sampled, torch.tensor([40]), torch.tensor([3]), 3, 4).tokens.shape == (1, 1)  # a sampled row: not
    sampled.keep([], 0)  # from the history (other requests' replies would change its text); its reply still joins
    assert lk.history.tokens == 7 + 4
    assert Lookup(history_tokens=0).history is None
    with pytest.raises(ConfigError, match=">= 0"):
        Lookup(history_tokens=-5)
    lk.forget()
    assert lk.history.tokens == 0


# -- the real model -------------------------------------------------------------------------------------
def test_a_repeated_prompt_drafts_from_its_first_reply_and_decodes_the_same(hf_model, tokenizer, mt_prompts, mt_plain):
    with_history = Engine(hf_model, tokenizer, Lookup(max_nodes=8), EngineConfig(speculate_max_batch=8))
    without = Engine(hf_model, tokenizer, Lookup(max_nodes=8, history_tokens=0), EngineConfig(speculate_max_batch=8))
    params = SamplingParams(max_tokens=MT_TOKENS)
    steps = {}
    for name, engine in (("with", with_history), ("without", without)):
        for k in ("first", "again"):
            (res,), _ = engine.generate([mt_prompts[0]], params)
            assert res.token_ids == mt_plain[0]
            steps[name, k] = len(res.accepted)
    assert steps["without", "first"] == steps["without", "again"] == steps["with", "first"]
    # the second time the whole reply is in the history: a few steps of up to 7 tokens
    assert steps["with", "again"] <= MT_TOKENS // 3 < steps["with", "first"]
    assert with_history.proposer.history.tokens >= 2 * MT_TOKENS


def test_a_seeded_sampled_request_repeats_its_sample_whatever_the_history_holds(hf_model, tokenizer, mt_prompts):
    engine = Engine(hf_model, tokenizer, Lookup(max_nodes=8), EngineConfig(speculate_max_batch=8, acceptance="typical"))
    params = SamplingParams(max_tokens=MT_TOKENS, temperature=1.0, seed=1234)
    (first,), _ = engine.generate([mt_prompts[1]], params)
    engine.generate([mt_prompts[1]], SamplingParams(max_tokens=MT_TOKENS))  # a greedy reply to the same prompt joins
    (again,), _ = engine.generate([mt_prompts[1]], params)
    assert engine.proposer.history.tokens >= 3 * MT_TOKENS and again.token_ids == first.token_ids


def test_the_bench_clears_the_history_so_no_measured_run_drafts_from_its_own_warm_up(hf_model, tokenizer):
    engine = Engine(hf_model, tokenizer, Lookup(), EngineConfig(max_batch=1))
    fresh = Engine(hf_model, tokenizer, Lookup(history_tokens=0), EngineConfig(max_batch=1))
    cfg = BenchConfig.from_options(heads="lookup", limit=1, max_tokens=MT_TOKENS, modes=("greedy",), warmup=1, out="unused")
    result = BenchRunner(cfg, engine=engine).run()
    (run,) = [r for r in result.runs if r.mode == "medusa"]  # the speculative run
    from distill.bench.runner import chat_ids, load_prompts

    (ref,), _ = fresh.generate([chat_ids(tokenizer, load_prompts("mt-bench", 1)[0].messages)],
                               SamplingParams(max_tokens=MT_TOKENS))
    assert run.token_ids == list(ref.token_ids) and run.steps == len(ref.accepted)  # as an engine that saw nothing
    assert engine.proposer.history.tokens > 0 and "history" in result.tree["source"]


def test_the_option_is_the_lookup_proposer_s():
    from distill.serve.config import ServeConfig

    with pytest.raises(ConfigError, match="lookup"):
        Engine.from_pretrained(None, None, EngineConfig(lookup_history=0))
    with pytest.raises(ConfigError, match=">= 0"):
        EngineConfig(lookup_history=-1)
    with pytest.raises(ConfigError, match="--heads lookup"):
        BenchConfig.from_options(heads="some/heads", lookup_history=1000)
    with pytest.raises(ConfigError, match="--heads lookup"):
        ServeConfig.from_options(heads=None, lookup_history=1000)
    with pytest.raises(ConfigError, match="ngram"):
        ServeConfig.from_options(heads="lookup", engine="vllm", lookup_history=1000)
    with pytest.raises(ConfigError, match=">= 0"):
        ServeConfig.from_options(heads="lookup", lookup_history=-1)
