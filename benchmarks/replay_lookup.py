"""Tokens per step of the lookup proposer on the model's own greedy replies: replayed, and in the real engine.

    OMP_NUM_THREADS=2 PYTHONPATH=.:benchmarks .venv/bin/python benchmarks/replay_lookup.py --engine \\
        --out benchmarks/results/lookup-replay-heldout.json

Prompts (``--prompts``): ``heldout`` (default; ``benchmarks/heldout-chat-prompts.json``, chat requests in nine
categories that no default of the proposer was chosen on) or ``mt-bench`` (its 80 first turns, on which they were).
The bundled model's greedy replies (``--max-tokens`` each, plain decoding in our engine) are saved to
``--replies`` and read from there when it exists.

Replay (always): at each step the proposer (:class:`distill.engine.proposers.lookup.Lookup`) drafts its tree of
``nodes`` nodes from the reply's context so far, the step accepts the longest drafted path the reply follows, then
the next token, as the engine would greedily with that budget every step. No model runs, so every source and budget
is measured on the same text, in seconds. Rows: ``context`` (the prompt and the reply so far), ``+history`` (the
replies to the prompts before it, in the file's order; ``+history-shuffled`` in a seeded random order),
``+data`` (``--lookup-data``: a dataset's replies as the datastore) and their combinations. Columns: ``--nodes``
budgets and reply lengths (``--lengths``: the first N tokens of each reply). ``lookup_us_per_step``: the median
CPU time of one row's draft (matching, scoring, the tree) over the replays.

``--engine``: the real engine at batch 1 with the default proposer (context and history, the datastore when given),
greedy, ``--engine-tokens`` a prompt, the full tree of ``--engine-nodes`` every step (so that tokens per step do not
depend on the machine's timings), checking every output against plain decoding's. Wall times are indicative
(they depend on the machine's load).

``--arctic``: SuffixDecoding itself (ArcticInference's ``SuffixDecodingCache``, called as vLLM's ``suffix`` proposer
calls it, with its defaults) replayed on the same replies. ``--vllm ngram,suffix``: vLLM's own speculation on the
same prompts, batch 1, greedy, its tokens per step from its spec-decode counters. Both need the ``arctic-inference``
package importable for ``suffix`` (it is not a dependency of distill).

``--odds``: the chains' odds (:class:`distill.engine.proposers.lookup.ChainOdds`) measured on the replies: chains of
16 nodes from the context and the history, replayed over the first of ``--lengths`` tokens, and for every drafted node
whose parent was accepted, whether it was, by the chain's match bucket and the node's depth (the source of
``DEFAULT_CHAIN_ODDS``).

``memory``: bytes a million stored tokens take in a store's index (built from the replies), and in a row's context.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import statistics
import time
from pathlib import Path

import numpy as np

from distill.engine.proposers.datastore import Datastore
from distill.engine.proposers.lookup import (DEFAULT_HISTORY_TOKENS, DEFAULT_NODES, MATCH_BUCKETS, ODDS_DEPTHS, ChainOdds,
                                             Lookup, LookupState, _Context)
from distill.store.atomic import atomic_write_bytes

HELDOUT = Path(__file__).with_name("heldout-chat-prompts.json")


def chat_prompts(tokenizer, which: str) -> list[list[int]]:
    """The chat-templated first turns of the held-out file or of MT-Bench (token ids)."""
    if which == "heldout":
        texts = [q for qs in json.loads(HELDOUT.read_text())["categories"].values() for q in qs]
    else:
        from distill.seeds import load_seed

        texts = [next(m.content for m in conv.messages if m.role == "user") for conv in load_seed("mt-bench")
                 if hasattr(conv, "messages")]
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                               tokenize=True, return_dict=True)["input_ids"]) for t in texts]


def load_model(model: str | None):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from distill.models import resolve_model

    resolved = resolve_model(model)
    tok = AutoTokenizer.from_pretrained(resolved.path)
    return resolved, AutoModelForCausalLM.from_pretrained(resolved.path, dtype=torch.float32).eval(), tok


def plain_replies(lm, tok, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Plain greedy decoding, 16 prompts at a time (the replay needs the model's replies, not their step times)."""
    from distill.engine import Engine, EngineConfig, SamplingParams

    engine = Engine(lm, tok, None, EngineConfig(max_batch=16, dtype="float32", device="cpu"))
    return [r.token_ids for r in engine.generate(prompts, SamplingParams(max_tokens=max_tokens))[0]]


def accepted(paths: set[tuple[int, ...]], truth: list[int]) -> int:
    a = 0
    while a < len(truth) and tuple(truth[: a + 1]) in paths:
        a += 1
    return a


def replay(lookup: Lookup, prompts: list[list[int]], replies: list[list[int]], order: list[int], nodes: int,
           length: int, seconds: list[float] | None = None, drafted: list[int] | None = None) -> float:
    """Tokens per step of ``lookup`` with a tree of up to ``nodes`` nodes, the replies taken in ``order``; ``seconds``
    collects each draft's time, ``drafted`` each tree's nodes."""
    steps = tokens = 0
    for k in order:
        prompt, reply = prompts[k], replies[k][:length]
        if not reply:
            continue
        ctx = _Context(prompt + reply[:1], lookup.max_match, first=len(prompt))  # reply[0]: the prefill's token
        i = 1
        while i < len(reply):
            t0 = time.thread_time()  # the lookup's own CPU time: a loaded machine's waits are not its cost
            tree = lookup.draft(ctx, nodes)
            if seconds is not None:
                seconds.append(time.thread_time() - t0)
            if drafted is not None:
                drafted.append(len(tree))
            paths, where = set(), [()]
            for parent, tok in tree:
                where.append(where[parent] + (tok,))
                paths.add(where[-1])
            new = reply[i : i + accepted(paths, reply[i : i + nodes]) + 1]
            ctx.extend(new)
            i += len(new)
            steps += 1
            tokens += len(new)
        LookupState([ctx], lookup.history).keep([], 0)  # the row leaves: its reply joins the history (if any)
    return tokens / steps


def replay_odds(prompts: list[list[int]], replies: list[list[int]], length: int, history: int,
                nodes: int = 16) -> dict:
    """P(node accepted | its parent accepted) per match bucket and depth, and how many nodes each figure rests on."""
    lk = Lookup(max_nodes=nodes, history_tokens=history, chains=True)
    seen = [[0] * ODDS_DEPTHS for _ in MATCH_BUCKETS]
    hits = [[0] * ODDS_DEPTHS for _ in MATCH_BUCKETS]
    for prompt, reply in zip(prompts, replies):
        reply = reply[:length]
        ctx = _Context(prompt + reply[:1], lk.max_match, first=len(prompt))
        i = 1
        while i < len(reply):
            tree, match = lk.chain(ctx, nodes)
            truth = reply[i : i + len(tree)]
            a = 0
            while a < len(truth) and truth[a] == tree[a][1]:
                a += 1
            b = ChainOdds.bucket(match)
            for depth in range(min(a + 1, len(truth))):
                seen[b][min(depth, ODDS_DEPTHS - 1)] += 1
                hits[b][min(depth, ODDS_DEPTHS - 1)] += depth < a
            new = reply[i : i + a + 1]
            ctx.extend(new)
            i += len(new)
        LookupState([ctx], lk.history).keep([], 0)
    return {f"match >= {m}": {"odds": [round(h / s, 2) if s else None for h, s in zip(hr, sr)], "nodes": sr}
            for m, hr, sr in zip(MATCH_BUCKETS, hits, seen)}


def replay_arctic(prompts: list[list[int]], replies: list[list[int]], length: int, depth: int = 24,
                  factor: float = 1.0, min_prob: float = 0.1, cached: int = 10_000) -> float:
    """Tokens per step of SuffixDecoding as vLLM's ``suffix`` proposer runs it (ArcticInference's SuffixDecodingCache
    with vLLM's defaults: tree depth and speculated tokens 24, factor 1, floor 0.1, one chain, 10,000 cached
    responses), replayed like :func:`replay` on the same replies taken in order at batch 1."""
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    cache = SuffixDecodingCache(max_tree_depth=depth, max_cached_requests=cached)
    steps = tokens = 0
    for k, (prompt, reply) in enumerate(zip(prompts, replies)):
        reply = reply[:length]
        if not reply:
            continue
        cache.start_request(k, prompt)
        cache.add_active_response(k, reply[:1])  # the prefill's token
        seen, i = prompt + reply[:1], 1
        while i < len(reply):
            draft = cache.speculate(k, seen[-depth:], max_spec_tokens=depth, max_spec_factor=factor,
                                    min_token_prob=min_prob).token_ids
            a = 0
            while a < len(draft) and i + a < len(reply) and draft[a] == reply[i + a]:
                a += 1
            new = reply[i : i + a + 1]
            cache.add_active_response(k, new)
            seen += new
            i += len(new)
            steps += 1
            tokens += len(new)
        cache.stop_request(k)
    return tokens / steps


def run_engine(lm, tok, prompts, tokens: int, nodes: int, store) -> dict:
    """The real engine at batch 1, the full tree every step: tokens per step, outputs against plain, lookup time."""
    from distill.engine import Engine, EngineConfig, SamplingParams

    plain = Engine(lm, tok, None, EngineConfig(max_batch=1, dtype="float32", device="cpu"))
    lk = Lookup(max_nodes=nodes, datastore=store)
    spent: dict[str, list[float]] = {"propose": [], "commit": []}
    for name in spent:  # the lookup's own CPU time
        inner = getattr(lk, name)

        def timed(*a, _inner=inner, _into=spent[name], **k):
            t0 = time.thread_time()
            out = _inner(*a, **k)
            _into.append(time.thread_time() - t0)
            return out
        setattr(lk, name, timed)
    engine = Engine(lm, tok, lk, EngineConfig(max_batch=1, dtype="float32", device="cpu", speculate_max_batch=1))
    sp = SamplingParams(max_tokens=tokens)
    same = steps = emitted = 0
    wall = {"plain": 0.0, "lookup": 0.0}
    for p in prompts:
        out = {}
        for name, e in (("plain", plain), ("lookup", engine)):
            t0 = time.perf_counter()
            (out[name],), _ = e.generate([p], sp)
            wall[name] += time.perf_counter() - t0
        same += out["lookup"].token_ids == out["plain"].token_ids
        steps += len(out["lookup"].accepted)
        emitted += sum(out["lookup"].accepted)
    return {"prompts": len(prompts), "tokens": tokens, "nodes": nodes, "identical_to_plain": same,
            "tokens_per_step": round(emitted / steps, 4), "steps": steps,
            "lookup_us_per_step": round(1e6 * sum(map(sum, spent.values())) / steps, 1),  # propose and commit, mean
            "propose_us_median": round(1e6 * statistics.median(spent["propose"]), 1),
            "commit_us_median": round(1e6 * statistics.median(spent["commit"]), 1),
            "wall_s_indicative": {k: round(v, 2) for k, v in wall.items()},
            "history_tokens": lk.history.tokens if lk.history is not None else 0}


def run_vllm(model_path: str, prompts, replies, tokens: int, method: str, num_spec: int) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams as VSP
    from vllm.inputs import TokensPrompt

    spec = {"method": method} | ({"num_speculative_tokens": num_spec} if num_spec else {})  # 0: vLLM's default
    if method == "ngram":
        from distill.engine.proposers.lookup import DEFAULT_MAX_NGRAM, DEFAULT_MIN_NGRAM

        spec.update(prompt_lookup_max=DEFAULT_MAX_NGRAM, prompt_lookup_min=DEFAULT_MIN_NGRAM)
    llm = LLM(model=model_path, dtype="float32", enforce_eager=True, seed=0, max_model_len=2048, max_num_seqs=1,
              speculative_config=spec, disable_log_stats=False)
    sp = VSP(temperature=0.0, max_tokens=tokens, detokenize=False)

    def counter(name: str) -> float:
        return sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == name)

    before = counter("vllm:spec_decode_num_accepted_tokens")
    same = emitted = 0
    t0 = time.perf_counter()
    for p, ref in zip(prompts, replies):
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=p)], sp, use_tqdm=False)
        ids = list(out.outputs[0].token_ids)
        same += ids == ref[:tokens]  # our engine's plain replies (vLLM's float sums may break a tie otherwise)
        emitted += len(ids) - 1  # after the prefill's token
    seconds = time.perf_counter() - t0
    acc = counter("vllm:spec_decode_num_accepted_tokens") - before
    # a decoding step emits its accepted drafts and one token of its own
    return {"method": method, "spec": spec, "identical_to_replies": same, "prompts": len(prompts),
            "tokens_per_step": round(emitted / (emitted - acc), 4), "accepted": acc,
            "wall_s_indicative": round(seconds, 2)}


def memory(replies: list[list[int]], prompts: list[list[int]]) -> dict:
    """Bytes per million stored tokens: a store's index built from the replies (its arrays), and a row's context (the
    Python objects it allocates, traced)."""
    import tracemalloc

    store = Datastore([(p[-8:] + r, min(8, len(p))) for p, r in zip(prompts, replies)])
    tokens = [t for r in replies for t in r]
    tracemalloc.start()
    ctx = _Context(tokens)
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return {"store_bytes_per_million_tokens": round(1e6 * store.memory_bytes() / store.generated_tokens),
            "store_tokens": store.generated_tokens,
            "context_bytes_per_million_tokens": round(1e6 * held / len(ctx.tokens))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", choices=("heldout", "mt-bench"), default="heldout")
    ap.add_argument("--replies", type=Path, default=None,
                    help="the greedy replies (default benchmarks/results/<prompts>-replies.json; written when missing)")
    ap.add_argument("--max-tokens", type=int, default=192, help="reply length when generating them")
    ap.add_argument("--limit", type=int, default=None, help="only the first N prompts (a quick check)")
    ap.add_argument("--lookup-data", type=Path, default=None, help="a dataset this model generated, as the datastore")
    ap.add_argument("--history-tokens", type=int, default=DEFAULT_HISTORY_TOKENS)
    ap.add_argument("--nodes", default="1,2,4,8,16")
    ap.add_argument("--lengths", default="64,128")
    ap.add_argument("--engine", action="store_true", help="also run the real engine (batch 1, full tree)")
    ap.add_argument("--engine-tokens", type=int, default=64)
    ap.add_argument("--engine-nodes", type=int, default=DEFAULT_NODES)
    ap.add_argument("--arctic", action="store_true",
                    help="also replay SuffixDecoding as vLLM's suffix method runs it (needs arctic-inference importable)")
    ap.add_argument("--vllm", default="", help="vLLM speculation methods to run on the same prompts: ngram,suffix")
    ap.add_argument("--vllm-tokens", type=int, default=0,
                    help="vLLM's num_speculative_tokens (0: suffix's default, its tree depth; --engine-nodes for others)")
    ap.add_argument("--shape", choices=("tree", "chain"), default="tree",
                    help="what the proposer drafts: trees, or one path a step (the engine's choice where chains are cheaper)")
    ap.add_argument("--odds", action="store_true", help="also measure the chains' odds by match length and depth")
    ap.add_argument("--out", default="benchmarks/results/lookup-replay-heldout.json")
    args = ap.parse_args()

    from bench_engine_step import cpu_description

    resolved, lm, tok = load_model(args.model)
    path = args.replies or Path(f"benchmarks/results/{args.prompts}-replies.json")
    if path.is_file():
        data = json.loads(path.read_text())
    else:
        prompts = chat_prompts(tok, args.prompts)
        data = {"prompts": prompts, "replies": plain_replies(lm, tok, prompts, args.max_tokens)}
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, (json.dumps(data) + "\n").encode())
    prompts, replies = data["prompts"][: args.limit], data["replies"][: args.limit]
    store = None
    if args.lookup_data is not None:
        store = Datastore.from_dataset(args.lookup_data, lm.config.vocab_size)
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
    seconds: list[float] = []
    t0 = time.perf_counter()
    for name, (ds, history, order) in sources.items():
        for n in nodes:
            for length in lengths:
                lk = Lookup(max_nodes=max(nodes), datastore=ds, history_tokens=history,  # a fresh history per replay
                            chains=args.shape == "chain")
                table.setdefault(name, {})[f"{n} nodes, {length} tokens"] = round(
                    replay(lk, prompts, replies, order, n, length, seconds), 4)
        print(name, json.dumps(table[name]), flush=True)
    result = {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "cpu": cpu_description(),
              "model": resolved.name, "prompts": args.prompts, "replies": str(path), "shape": args.shape,
              "reply_tokens": sum(map(len, replies)),
              "datastore": store.describe() if store is not None else None, "history_tokens": args.history_tokens,
              "seconds": round(time.perf_counter() - t0, 1), "tokens_per_step": table,
              "lookup_us_per_step": round(1e6 * statistics.median(seconds), 1), "memory": memory(replies, prompts)}
    print("lookup µs per step (replay, median):", result["lookup_us_per_step"], "| memory:", result["memory"], flush=True)
    if args.odds:
        result["chain_odds"] = replay_odds(prompts, replies, lengths[0], args.history_tokens)
        for name, row in result["chain_odds"].items():
            print(f"chain odds, {name}: {row['odds']} (nodes {row['nodes']})", flush=True)
    if args.arctic:
        result["arctic_suffix_decoding"] = {f"{length} tokens": round(replay_arctic(prompts, replies, length), 4)
                                            for length in lengths}
        print("SuffixDecoding (ArcticInference, vLLM's defaults):", json.dumps(result["arctic_suffix_decoding"]), flush=True)
    if args.engine:
        result["engine"] = run_engine(lm, tok, prompts, args.engine_tokens, args.engine_nodes, store)
        print("engine:", json.dumps(result["engine"]), flush=True)
    for method in filter(None, args.vllm.split(",")):
        result.setdefault("vllm", {})[method] = run_vllm(str(resolved.path), prompts, replies, args.engine_tokens, method,
                                                         args.vllm_tokens or (0 if method == "suffix" else args.engine_nodes))
        print("vllm:", json.dumps(result["vllm"][method]), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(Path(args.out), (json.dumps(result, indent=1) + "\n").encode())


if __name__ == "__main__":
    main()
