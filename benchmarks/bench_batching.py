"""Continuous vs whole-batch decoding of the same requests, side by side in one process.

N greedy requests (MT-Bench first turns, chat template) with a seeded mix of ``max_tokens``
between ``--min-tokens`` and ``--max-tokens`` all arrive at t=0 and are decoded at most
``--max-batch`` at a time in two ways, in alternating order for ``--repeats`` rounds:

whole batches
    ``Engine.generate`` on consecutive groups of ``max_batch`` (how ``distill serve``
    worked before continuous batching): a group ends when its longest request ends.
continuous
    ``Engine.running_batch``: between two steps waiting requests take the rows that
    finished requests freed (what ``distill serve`` does now).

Reported per mode: wall seconds, generated tokens per second, mean and p90 request
completion time (from t=0), and whether every output equals the other mode's (greedy).

    .venv/bin/python benchmarks/bench_batching.py --requests 24 --max-batch 8 --out benchmarks/results/batching.json
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

import torch

from distill.engine import Engine, EngineConfig, SamplingParams
from distill.seeds import load_seed


def mt_bench_prompts(tokenizer, n: int) -> list[list[int]]:
    out = []
    for conv in load_seed("mt-bench"):
        first = next((m for m in getattr(conv, "messages", []) if m.role == "user"), None)
        if first is None:
            continue
        out.append(list(tokenizer.apply_chat_template([{"role": "user", "content": first.content}], add_generation_prompt=True,
                                                      tokenize=True, return_dict=True)["input_ids"]))
        if len(out) == n:
            break
    return out


def whole_batches(engine: Engine, prompts, params, speculative: bool) -> tuple[float, list[float], list[list[int]]]:
    t0 = time.perf_counter()
    done, outputs = [], []
    B = engine.config.max_batch
    for lo in range(0, len(prompts), B):
        results, _ = engine.generate(prompts[lo : lo + B], params[lo : lo + B], speculative=speculative)
        t = time.perf_counter() - t0  # every request of the group is answered when the group ends
        done += [t] * len(results)
        outputs += [r.token_ids for r in results]
    return time.perf_counter() - t0, done, outputs


def continuous(engine: Engine, prompts, params, speculative: bool) -> tuple[float, list[float], list[list[int]]]:
    t0 = time.perf_counter()
    batch = engine.running_batch(speculative)
    done: dict[int, float] = {}
    outputs: dict[int, list[int]] = {}
    nxt = 0
    while len(done) < len(prompts):
        free = engine.config.max_batch - len(batch)
        if free and nxt < len(prompts):
            keys = list(range(nxt, min(len(prompts), nxt + free)))
            finished = batch.add([prompts[k] for k in keys], [params[k] for k in keys], keys)
            nxt = keys[-1] + 1
        else:
            finished = batch.step()
        for k, r in finished:
            done[k], outputs[k] = time.perf_counter() - t0, r.token_ids
    return time.perf_counter() - t0, [done[k] for k in range(len(prompts))], [outputs[k] for k in range(len(prompts))]


def summary(wall: float, done: list[float], outputs: list[list[int]]) -> dict:
    tokens = sum(len(o) for o in outputs)
    q = sorted(done)
    return {"wall_s": round(wall, 2), "tokens": tokens, "tokens_per_s": round(tokens / wall, 2),
            "mean_completion_s": round(statistics.mean(done), 2), "p90_completion_s": round(q[int(0.9 * (len(q) - 1))], 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model folder or id (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--heads", default=None, help="heads folder: Medusa decoding under the engine's policy (default: plain)")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--min-tokens", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    engine = Engine.from_pretrained(args.model, args.heads, EngineConfig(max_batch=args.max_batch))
    prompts = mt_bench_prompts(engine.tokenizer, args.requests)
    rng = random.Random(args.seed)
    params = [SamplingParams(max_tokens=rng.randint(args.min_tokens, args.max_tokens)) for _ in prompts]
    speculative = args.heads is not None
    engine.generate(prompts[:2], [SamplingParams(max_tokens=4)] * 2, speculative=speculative)  # warm-up

    runs: dict[str, list[dict]] = {"whole_batches": [], "continuous": []}
    outputs: dict[str, list[list[int]]] = {}
    for r in range(args.repeats):
        order = ["whole_batches", "continuous"] if r % 2 == 0 else ["continuous", "whole_batches"]
        for mode in order:
            wall, done, outs = (whole_batches if mode == "whole_batches" else continuous)(engine, prompts, params, speculative)
            runs[mode].append(summary(wall, done, outs))
            outputs[mode] = outs
            print(mode, runs[mode][-1], flush=True)

    def mean(mode: str, key: str) -> float:
        return statistics.mean(x[key] for x in runs[mode])

    result = {
        "date": dt.date.today().isoformat(),
        "machine": f"{os.cpu_count()} CPU cores, torch threads {torch.get_num_threads()}",
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "requests": len(prompts),
        "max_tokens": [p.max_tokens for p in params],
        "runs": runs,
        "identical_outputs": outputs["whole_batches"] == outputs["continuous"],
        "throughput_ratio": round(mean("continuous", "tokens_per_s") / mean("whole_batches", "tokens_per_s"), 3),
        "mean_completion_ratio": round(mean("continuous", "mean_completion_s") / mean("whole_batches", "mean_completion_s"), 3),
    }
    print(json.dumps({k: result[k] for k in ("identical_outputs", "throughput_ratio", "mean_completion_ratio")}))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
