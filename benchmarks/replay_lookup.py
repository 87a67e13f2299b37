"""Tokens per step of the lookup proposer's sources, replayed on the model's own greedy replies.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 PYTHONPATH=.:bench .venv/bin/python benchmarks/replay_lookup.py \\
        --lookup-data DATA --replies benchmarks/results/mt-bench-replies.json --out benchmarks/results/lookup-replay.json

The bundled model's greedy replies to the 80 MT-Bench first turns (``--max-tokens`` each, by vLLM in
this process, batch 80; saved to ``--replies`` and read from there when it exists) are replayed through
the lookup proposer (:class:`distill.engine.proposers.lookup.Lookup`, its own merge and tree code): at each step
the tree of ``nodes`` nodes is drafted from the reply's context so far, the step accepts the longest
drafted path the reply follows, then the next token. No model runs in the replay, so every source and
budget is measured on the same text, in seconds, as the engine would accept it greedily with the full
tree of that budget every step (the static policy may draft fewer nodes).

Sources (rows): ``context`` (the prompt and the reply so far), ``+data`` (``--lookup-data``: a dataset's
replies as the datastore), ``+history`` (the replies to the prompts before it, in MT-Bench's order, one
category after the other; ``+history-shuffled`` in a seeded random order), and their combinations.
Columns: ``--nodes`` budgets, and the reply length (``--lengths``: the first N tokens of each reply).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import time
from pathlib import Path

from distill.engine.proposers.datastore import Datastore
from distill.engine.proposers.lookup import DEFAULT_HISTORY_TOKENS, Lookup, LookupState, _Context, _tree
from distill.store.atomic import atomic_write_bytes


def greedy_replies(model_path: str, tokenizer, max_tokens: int) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from bench_engine_step import mt_bench_prompts, vllm, vllm_llm

    prompts = mt_bench_prompts(tokenizer, 80)
    _, _, replies = vllm(vllm_llm(model_path), prompts, max_tokens, len(prompts), [tokenizer.eos_token_id])
    return {"prompts": prompts, "replies": replies}


def accepted(paths: set[tuple[int, ...]], truth: list[int]) -> int:
    a = 0
    while a < len(truth) and tuple(truth[: a + 1]) in paths:
        a += 1
    return a


def replay(lookup: Lookup, prompts: list[list[int]], replies: list[list[int]], order: list[int], nodes: int,
           length: int) -> float:
    """Tokens per step of ``lookup`` with a full tree of ``nodes`` nodes, the replies taken in ``order``."""
    steps = tokens = 0
    for k in order:
        prompt, reply = prompts[k], replies[k][:length]
        if not reply:
            continue
        ctx = _Context(prompt + reply[:1], lookup.max_ngram, first=len(prompt))  # reply[0]: the prefill's token
        i = 1
        while i < len(reply):
            paths, where = set(), [()]
            for parent, tok in _tree(lookup._weighted(ctx), nodes):
                where.append(where[parent] + (tok,))
                paths.add(where[-1])
            new = reply[i : i + accepted(paths, reply[i : i + lookup.depth]) + 1]
            ctx.extend(new)
            i += len(new)
            steps += 1
            tokens += len(new)
        LookupState([ctx], lookup.history).keep([], 0)  # the row leaves: its reply joins the history (if any)
    return tokens / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--replies", type=Path, default=Path("benchmarks/results/mt-bench-replies.json"),
                    help="the greedy replies (written here when missing)")
    ap.add_argument("--max-tokens", type=int, default=192, help="reply length when generating them")
    ap.add_argument("--lookup-data", type=Path, default=None, help="a dataset this model generated, as the datastore")
    ap.add_argument("--history-tokens", type=int, default=DEFAULT_HISTORY_TOKENS)
    ap.add_argument("--nodes", default="1,2,4,8,16")
    ap.add_argument("--lengths", default="64,128")
    ap.add_argument("--out", default="benchmarks/results/lookup-replay.json")
    args = ap.parse_args()

    from transformers import AutoConfig, AutoTokenizer

    from bench_engine_step import cpu_description

    from distill.models import resolve_model

    resolved = resolve_model(args.model)
    if args.replies.is_file():
        data = json.loads(args.replies.read_text())
    else:
        data = greedy_replies(str(resolved.path), AutoTokenizer.from_pretrained(resolved.path), args.max_tokens)
        args.replies.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(args.replies, (json.dumps(data) + "\n").encode())
    prompts, replies = data["prompts"], data["replies"]
    store = None
    if args.lookup_data is not None:
        store = Datastore.from_dataset(args.lookup_data, AutoConfig.from_pretrained(resolved.path).vocab_size)
    nodes = [int(x) for x in args.nodes.split(",")]
    lengths = [int(x) for x in args.lengths.split(",")]
    in_order = list(range(len(prompts)))
    shuffled = in_order[:]
    random.Random(0).shuffle(shuffled)
    sources = {"context": (None, 0, in_order), "+history": (None, args.history_tokens, in_order),
               "+history-shuffled": (None, args.history_tokens, shuffled)}
    if store is not None:
        sources.update({"+data": (store, 0, in_order), "+data+history": (store, args.history_tokens, in_order),
                        "+data+history-shuffled": (store, args.history_tokens, shuffled)})
    table: dict[str, dict[str, float]] = {}
    t0 = time.perf_counter()
    for name, (ds, history, order) in sources.items():
        for n in nodes:
            for length in lengths:
                lk = Lookup(max_nodes=max(nodes), datastore=ds, history_tokens=history)  # a fresh history per replay
                table.setdefault(name, {})[f"{n} nodes, {length} tokens"] = round(
                    replay(lk, prompts, replies, order, n, length), 4)
        print(name, json.dumps(table[name]), flush=True)
    result = {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "cpu": cpu_description(),
              "model": resolved.name, "replies": str(args.replies), "reply_tokens": sum(map(len, replies)),
              "datastore": store.describe() if store is not None else None, "history_tokens": args.history_tokens,
              "seconds": round(time.perf_counter() - t0, 1), "tokens_per_step": table}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(Path(args.out), (json.dumps(result, indent=1) + "\n").encode())


if __name__ == "__main__":
    main()
