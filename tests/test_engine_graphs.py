"""Decoding steps and EAGLE's drafter passes as CUDA graphs (distill.engine.graphs): graphed decoding is eager decoding.

On a CPU the bucket logic runs without capturing (``Graphs(capture=False)``: the same calls with the same
static windows, run eagerly); the CUDA tests record and replay real graphs and are
skipped where torch sees no GPU (they ran on an H200 through the device tool, BENCHMARKS.md).
Models: the tiny random Llamas (vocabulary 8) of the Medusa and EAGLE engine tests (tests/helpers.py), with their heads.
"""

from __future__ import annotations

import pytest
import torch

from distill.engine import Engine, EngineConfig, SamplingParams
from distill.engine import cache as kv
from distill.engine.graphs import Graphs
from distill.errors import ConfigError
from helpers import tiny_eagle, tiny_medusa

PROMPTS = [[1, 5, 2], [3, 3, 7, 0, 1, 4], [6], [2, 4, 6, 1, 3, 5, 7, 0, 2], [5, 5]]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")


def engines(device: str, graphs: bool | None = None, **config):
    """(name, engine): Medusa and EAGLE engines of the tiny models on ``device`` (plain decoding: speculative=False)."""
    medusa_model, heads = tiny_medusa()
    eagle_model, drafter = tiny_eagle()
    common = dict(max_batch=len(PROMPTS), speculate_max_batch=len(PROMPTS), acceptance="greedy", cuda_graphs=graphs,
                  **config)
    return [
        ("medusa", Engine(medusa_model.to(device), None, heads.to(device), EngineConfig(tree="2,2,2", **common))),
        ("eagle", Engine(eagle_model.to(device), None, drafter.to(device),
                         EngineConfig(draft_nodes=6, draft_depth=3, draft_topk=2, **common))),
    ]


def decode(engine: Engine, speculative: bool) -> list[list[int]]:
    results, _ = engine.generate(PROMPTS, [SamplingParams(max_tokens=12 + 3 * i) for i in range(len(PROMPTS))],
                                 speculative=speculative)
    return [r.token_ids for r in results]


def continuous(engine: Engine) -> dict[int, list[int]]:
    """Rows join a running batch two at a time and leave when done (the rows in use change between steps)."""
    run, done = engine.running_batch(), {}
    for k in range(0, len(PROMPTS), 2):
        keys = list(range(k, min(k + 2, len(PROMPTS))))
        done.update(run.add([PROMPTS[i] for i in keys], [SamplingParams(max_tokens=6 + 2 * i) for i in keys], keys))
        done.update(run.step())
    while len(run):
        done.update(run.step())
    return {k: r.token_ids for k, r in done.items()}


def test_static_window_calls_decode_as_the_eager_calls_batched_and_continuous():
    for name, engine in engines("cpu", None):
        assert engine.graphs is None  # CPU default: eager steps
        plain, spec, cont = decode(engine, False), decode(engine, True), continuous(engine)
        assert spec == plain, name
        steps, drafts = [], []
        forward = engine.target.forward

        def spy(ids, positions, bias, cache, keep=0, layers=None, step=False, chunks=None):
            if step:
                steps.append((bias.shape[-1], cache.slots, ids.shape, chunks))
            return forward(ids, positions, bias, cache, keep, layers, step, chunks)

        engine.target.forward = spy
        if name == "eagle":  # the drafter's keep-mask (B, 1, q, W) and its cache
            engine.heads.register_forward_pre_hook(lambda m, args: drafts.append((args[3].shape[-1], args[4].slots)))
        engine.use_graphs(Graphs(capture=False))
        assert decode(engine, False) == plain, name
        assert decode(engine, True) == plain, name
        assert continuous(engine) == cont, name
        # every graphed step attended over all the cache's slots; buckets: rows in use x tree sizes
        assert steps and all(w == s and chunks is None for w, s, _, chunks in steps)  # one call over the whole window
        assert {shape[1] for _, _, shape, _ in steps} == {1, engine.max_tree_size}
        assert len({shape[0] for _, _, shape, _ in steps}) > 1  # rows left the batch: new buckets
        kinds = {key[0] for key in engine.graphs.keys()}
        if name == "eagle":  # catch-ups and expansions graphed too (prompt catch-ups stay eager: their window is short)
            assert kinds == {"step", "eagle catch-up", "eagle expansion"}
            assert sum(w == s for w, s in drafts) > len(drafts) // 2
        else:
            assert kinds == {"step"}
        assert 2 <= len(engine.graphs) <= engine.graphs.max_buckets
        # later requests write the pooled storage of earlier ones: nothing new to record
        buckets = len(engine.graphs)
        assert decode(engine, True) == plain and decode(engine, False) == plain, name
        assert len(engine.graphs) == buckets and engine.kv_pool.reused >= 3, name


def test_a_pool_hands_out_the_storage_of_a_cache_that_is_gone():
    shape = kv.KVShape(2, 1, 4, 4, torch.float32, torch.device("cpu"))
    pool = kv.SlotPool(shape, keep=2)
    a = kv.SlotCache(shape, 2, 100, pool=pool)
    assert (a.capacity_rows, a.slots, pool.allocated) == (2, 256, 1)  # slots rounded up to a power of two
    first = a.keys.data_ptr()
    del a  # no reference cycle: back to the pool at once
    assert len(pool) == 1
    b = kv.SlotCache(shape, 1, 200, pool=pool)  # fits in the first storage
    assert b.keys.data_ptr() == first and pool.reused == 1 and len(pool) == 0
    c = kv.SlotCache(shape, 1, 300, pool=pool)  # too long for any free one: a new storage
    assert c.slots == 512 and pool.allocated == 2
    c.keys[:, 0, :, :300] = 1.0
    c.reserve(3, 300)  # grows into a new storage (its rows copied); the old one goes back to the pool
    assert c.capacity_rows == 3 and len(pool) == 1 and bool((c.keys[:, 0, :, :300] == 1.0).all())
    del b, c
    assert len(pool) == 2  # keep=2: the oldest of three dropped


def test_graphs_replay_their_buckets_and_forget_the_oldest():
    calls = []

    def fn(x):
        calls.append(x.shape)
        return (x * 2,)

    graphs = Graphs(capture=False, max_buckets=2)
    for n in (1, 2, 1, 3):
        (y,) = graphs(("double", n), fn, torch.ones(n))
        assert torch.equal(y, torch.full((n,), 2.0))
    assert len(calls) == 4 and graphs.keys() == [("double", 1), ("double", 3)]  # bucket 2 was the least recently used


def test_compiled_steps_decode_as_eager_steps_trees_batches_and_features():
    """Every step's forward compiled (weights as loaded, as on a GPU), through the graph buckets run eagerly: the
    same tokens as eager steps, plain and speculative, Medusa and EAGLE-3 (whose feature layers come from hooks
    registered once); prefills stay eager."""
    torch._dynamo.reset()  # no compiled code of another test's model to guard against
    eager = {name: (decode(e, False), decode(e, True)) for name, e in engines("cpu", None)}
    try:
        for name, engine in engines("cpu", None, compile=True, weight_layout="as-loaded"):
            engine.use_graphs(Graphs(capture=False))
            assert (decode(engine, False), decode(engine, True)) == eager[name], name
            assert engine.compiled_forwards > 12, name
    finally:
        torch._dynamo.reset()


def test_cuda_graph_settings_are_checked():
    with pytest.raises(ConfigError, match="CUDA device"):
        engines("cpu", True)


@cuda
def test_cuda_graphs_decode_as_eager_steps_and_replay_their_buckets():
    eager = {name: (decode(e, False), decode(e, True), continuous(e)) for name, e in engines("cuda", False)}
    for name, engine in engines("cuda", None):  # the CUDA default: graphs on
        assert engine.graphs is not None and engine.graphs.capture, name
        plain, spec, cont = eager[name]
        assert spec == plain, name
        assert decode(engine, False) == plain, name
        recorded = engine.graphs.recorded
        assert recorded >= 1 and engine.graphs.replays > recorded, name
        assert decode(engine, True) == plain, name
        assert continuous(engine) == cont, name
        assert engine.graphs.recorded > recorded  # the trees' buckets (and the drafter's)
        kinds = {key[0] for key in engine.graphs.keys()}
        assert kinds == ({"step", "eagle catch-up", "eagle expansion"} if name == "eagle" else {"step"}), name
        recorded = engine.graphs.recorded  # a later request replays on the pooled storage: nothing recorded
        assert decode(engine, True) == plain and engine.graphs.recorded == recorded, name


@cuda
def test_cuda_graphs_keep_sampled_decoding_seeded():
    """Typical acceptance at temperature 0.8: the same seeds give the same tokens, graphed or eager, in a batch of 5."""
    for (name, eager), (_, graphed) in zip(engines("cuda", False), engines("cuda", True)):
        for cfg in (eager.config, graphed.config):
            cfg.acceptance = "typical"
        sp = [SamplingParams(max_tokens=10, temperature=0.8, seed=i) for i in range(len(PROMPTS))]
        a = [r.token_ids for r in eager.generate(PROMPTS, sp)[0]]
        b = [r.token_ids for r in graphed.generate(PROMPTS, sp)[0]]
        assert a == b, name


@cuda
def test_compiled_cuda_graphs_decode_as_eager_steps():
    """The GPU's fastest step: each step's forward compiled, then recorded as a CUDA graph and replayed."""
    eager = {name: (decode(e, False), decode(e, True)) for name, e in engines("cuda", False)}
    for name, engine in engines("cuda", None, compile=True):
        assert engine.graphs is not None, name
        assert (decode(engine, False), decode(engine, True)) == eager[name], name
        assert engine.compiled_forwards >= engine.graphs.recorded >= 2, name
