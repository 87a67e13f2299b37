"""One layer's attention three ways: SDPA over slot-order keys, vLLM's CPU kernel and ``attend_dims`` over the kernel's key order.

    OMP_NUM_THREADS=2 PYTHONPATH=.:benchmarks .venv/bin/python benchmarks/bench_vllm_attention.py --out benchmarks/results/vllm-attention.json

The engine's own code on random keys, values and queries of the bundled model's shapes (9 query heads, 3
key/value heads of 64, float32), 30 layers' storage cycled so the cache is as cold as in a forward:

sdpa
    ``distill.engine.attention.sdpa_gqa`` over a slot cache with keys in slot order, in row chunks where
    :func:`plan_row_chunks` plans them (what a GPU, compiled steps and ``attention="sdpa"`` run);
kernel
    ``distill.engine.cpu.paged.paged_attention`` over a cache with keys in the kernel's order (prefills,
    plain steps and chains: what the kernel computes);
dims
    ``sdpa_gqa`` over that same cache, i.e. ``attend_dims`` (branching trees on a CPU with the kernel).

Cases: plain steps, chains and trees of rows whose lengths are MT-Bench first turns (with 32 tokens generated;
questions 0-15, 40-55 longest first, and single rows), and the prefill of questions 40-55. A tree is Medusa's
``sparse-N`` shape. Microseconds per layer call (median of rounds) and the largest difference from ``sdpa``
at the real queries.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine_step import cpu_description  # noqa: E402
from bench_row_chunks import DIM, HEADS, KV_HEADS, LAYERS, mt_bench_lengths, timed  # noqa: E402

from distill.engine import cache as kv  # noqa: E402
from distill.engine.attention import plan_row_chunks, sdpa_gqa  # noqa: E402
from distill.engine.cpu import paged  # noqa: E402
from distill.engine.tree import build_buffers, resolve_tree  # noqa: E402

GENERATED = 32
SCALE = DIM ** -0.5


def caches(B: int, slots: int, g: torch.Generator) -> dict[str, kv.SlotCache]:
    """The same random keys and values in a slot-order and a kernel-order cache."""
    shape = kv.KVShape(LAYERS, KV_HEADS, DIM, DIM, torch.float32, torch.device("cpu"))
    out = {order: kv.SlotCache(shape, B, slots, key_order=order) for order in kv.KEY_ORDERS}
    keys, values = torch.randn(LAYERS, B, KV_HEADS, slots, DIM, generator=g), torch.randn(LAYERS, B, KV_HEADS, slots, DIM, generator=g)
    for cache in out.values():
        cache.keys[:, :, :, :slots] = keys
        cache.values[:, :, :, :slots] = values
    return out


def case(name: str, lengths: list[int], T: int, tree: str | None, prefill: bool, args, g) -> dict:
    B = len(lengths)
    ends = [0] * B if prefill else [n + GENERATED for n in lengths]
    queries = lengths if prefill else [T] * B
    W = max(e + q for e, q in zip(ends, queries))
    Q = max(queries)
    store = caches(B, -(-(W + 1) // 64) * 64, g)
    if prefill:
        allowed = (torch.arange(W)[None] <= torch.arange(Q)[:, None])[None, None]
    else:
        mask = build_buffers(resolve_tree(tree, 8).paths).mask if tree else torch.ones(T, T, dtype=torch.bool).tril()
        allowed = kv.step_allowed(torch.tensor(ends), mask, W)
    bias = kv.attention_bias(allowed, torch.float32)
    chunks = plan_row_chunks(queries, [e + q for e, q in zip(ends, queries)])
    query = torch.randn(B, HEADS, Q, DIM, generator=g)
    def over(order: str):
        c = store[order]
        return lambda i: sdpa_gqa(None, query, c.keys[i, :B, :, :W], c.values[i, :B, :, :W], bias, scaling=SCALE,
                                  row_chunks=chunks)[0]

    paths = {"sdpa": over("slots"), "dims": over("dims")}
    if tree is None:
        plan = paged.plan(store["dims"], queries, ends, HEADS, padded=prefill)
        paths["kernel"] = lambda i: paged.paged_attention(plan, i, query, SCALE)
    real = torch.arange(Q)[None] < torch.tensor(queries)[:, None]  # (B, Q)
    row = {"case": name, "rows": B, "queries": Q, "keys": W}
    want = paths["sdpa"](0)
    layer = iter(range(10**9))
    for p, fn in paths.items():
        calls = max(3, args.calls // (Q if prefill else 1))
        out = fn(0)
        row[f"{p}_us"] = round(statistics.median(timed(lambda: fn(next(layer) % LAYERS), calls, args.rounds)), 1)
        row[f"{p}_diff"] = float((out - want)[real].abs().max()) if p != "sdpa" else 0.0
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    why = paged.paged_problem(kv.KVShape(1, KV_HEADS, DIM, DIM, torch.float32, torch.device("cpu")), HEADS)
    if why:
        raise SystemExit(f"vLLM's attention kernel is not available here: {why}")
    g = torch.Generator().manual_seed(0)
    lengths = mt_bench_lengths(56)
    short, tail = lengths[:16], sorted(lengths[40:56], reverse=True)
    rows = [case("batch 1, plain step", lengths[40:41], 1, None, False, args, g),
            case("batch 4, plain step", sorted(lengths[40:44], reverse=True), 1, None, False, args, g),
            case("batch 1, chain of 8", lengths[40:41], 9, None, False, args, g),
            case("batch 1, tree of 16", lengths[40:41], 17, "sparse-16", False, args, g),
            case("questions 0-15, plain step", short, 1, None, False, args, g),
            case("questions 40-55, plain step", tail, 1, None, False, args, g),
            case("questions 40-55, chain of 4", tail, 5, None, False, args, g),
            case("questions 0-15, tree of 8", short, 9, "sparse-8", False, args, g),
            case("questions 40-55, tree of 8", tail, 9, "sparse-8", False, args, g),
            case("questions 40-55, prefill", tail, 0, None, True, args, g)]
    if args.out:
        Path(args.out).write_text(json.dumps({"cpu": cpu_description(), "cases": rows}, indent=1) + "\n")
        print("wrote", args.out)


if __name__ == "__main__":
    main()
