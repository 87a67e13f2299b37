"""The generation pipeline's own ceiling: generated tokens per second per process with no model cost.

A real ``distill generate`` run (templating, teacher encoding, journal, shards, manifest) is fed
by :class:`distill.generate.backends.ReplayBackend`, which answers every prompt with the reply and
teacher top-k a finished dataset (``--source``) stores for it. ``--samples N`` replays each stored
conversation N times as N samples (rows ``<id>#s<i>``), so one run pushes N times the source's
tokens through the pipeline; a source whose prompts repeat (two seed rows with the same first
turn) holds several replies per prompt, which only the original request seeds tell apart, and
cannot be replayed with ``--samples`` above 1: the default source, made from MT-Bench, has none.
Two parts cost less per token with ``--samples`` above 1 than on distinct conversations, as they do in
a real ``--samples N`` run: the samples of a conversation send the same prompts, whose ids the chat
format keeps from the first (a lookup instead of the tokenizer), and a shard holding N copies of
each reply compresses faster than N distinct replies. ``--samples 1`` (with more ``--repeats``)
measures the pipeline on distinct conversations only.

Per run: tokens per second over the whole ``Generator.run`` (store opening and seed reading
included) and over the generation loop alone, each by the wall clock and by this process's CPU
time (``cpu_``: what the process does on a core of its own; on a shared machine the wall clock
also counts the time it waits for one), and microseconds per generated token by part, each
part's own time (a part called inside another is not counted twice):

    backend          the replay's lookups (a real run spends the model's time here instead)
    templating       ConversationState.open_turn / add_reply: list appends, with
    chat template    ChatFormat.render (Jinja), and
    tokenizer        ChatFormat.encode / generated_text / decode_reply / closing
    rows             ConversationState.result: each row's columns
    teacher encoding encode_topk
    journal          ShardStore.append: the rows to one Arrow batch, written, with
    journal checksum the SHA-256 of each batch
    shards           ShardStore.flush: the journal's rows sorted into one shard, with
    parquet write    pyarrow.parquet.write_table (zstd level 9)
    shard readback   ShardInfo.of_file (row counts, size, SHA-256)
    manifest         ShardStore.commit
    fsync            every os.fsync (journal appends, shards, manifest)
    other            the rest of the run (store opening, seed rows, requests, accounting)

The vLLM backend's own conversion (``VLLMBackend._completions``: vLLM's flat logprob lists to
the (N, K) arrays) is timed beside it on the same replies, as is the part of vLLM's output
processing that builds those lists (``append_logprobs_for_next_position``, which runs in the
process that calls ``LLM.generate``): both sit on the same core as the pipeline in a real run.

    python benchmarks/bench_pipeline.py --source /tmp/mtb --samples 8 --repeats 5 --json benchmarks/results/pipeline-zen4.json
    python benchmarks/bench_pipeline.py --source /tmp/mtb --samples 8 --repeats 1 --profile 30

A ``--source`` folder without a manifest is first made there (untimed) by the vLLM backend when it
is installed, else transformers: MT-Bench, multi-turn, ``--source-max-tokens`` per turn, top-20.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

PARTS = ("backend", "templating", "chat template", "tokenizer", "rows", "teacher encoding", "journal",
         "journal checksum", "shards", "parquet write", "shard readback", "manifest", "fsync", "other")


class Parts:
    """Exclusive time per label, wall clock and this process's CPU time (all its threads): entering a labelled call
    pauses the label it was called from. On a shared machine the CPU time is the steadier figure; the wall clock
    holds what the CPU time does not see (fsync, waiting for a core)."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.stack: list[list] = []  # [label, wall clock and CPU time at the start of its current segment]
        self.undo: list[tuple] = []

    def wrap(self, owner, attr: str, label: str) -> None:
        real = getattr(owner, attr)
        parts = self

        def pause(now: float, cpu: float) -> None:
            if parts.stack:
                top = parts.stack[-1]
                parts.wall[top[0]] += now - top[1]
                parts.cpu[top[0]] += cpu - top[2]

        @functools.wraps(real)
        def timed(*args, **kwargs):
            now, cpu = time.perf_counter(), time.process_time()
            pause(now, cpu)
            parts.stack.append([label, now, cpu])
            try:
                return real(*args, **kwargs)
            finally:
                end, cpu_end = time.perf_counter(), time.process_time()
                pause(end, cpu_end)
                parts.stack.pop()
                if parts.stack:
                    parts.stack[-1][1:] = [end, cpu_end]

        setattr(owner, attr, timed)
        self.undo.append((owner, attr, real))

    def restore(self) -> None:
        for owner, attr, real in reversed(self.undo):
            setattr(owner, attr, real)
        self.undo.clear()


def instrument(parts: Parts) -> None:
    import pyarrow.parquet as pq

    from distill.generate import backends, runner
    from distill.store import journal, shards
    from distill.templating import ChatFormat

    parts.wrap(backends.ReplayBackend, "generate", "backend")
    for name in ("open_turn", "add_reply"):
        parts.wrap(runner.ConversationState, name, "templating")
    parts.wrap(ChatFormat, "render", "chat template")
    for name in ("encode", "generated_text", "decode_reply", "closing"):
        parts.wrap(ChatFormat, name, "tokenizer")
    parts.wrap(runner.ConversationState, "result", "rows")
    parts.wrap(runner, "encode_topk", "teacher encoding")
    parts.wrap(shards.ShardStore, "append", "journal")
    parts.wrap(journal, "_checksum", "journal checksum")
    parts.wrap(shards.ShardStore, "flush", "shards")
    parts.wrap(pq, "write_table", "parquet write")
    parts.wrap(shards.ShardInfo, "of_file", "shard readback")
    parts.wrap(shards.ShardStore, "commit", "manifest")
    parts.wrap(os, "fsync", "fsync")


def make_source(path: Path, max_tokens: int) -> None:
    from distill.generate.backends import vllm_available

    cmd = [str(Path(sys.executable).with_name("distill")), "generate", "--seed", "mt-bench", "--mode", "multi-turn",
           "--max-tokens", str(max_tokens), "--teacher-topk", "20", "--temperature", "0.7", "--dtype", "float32",
           "--backend", "vllm" if vllm_available() else "hf", "--out", str(path), "-q"]
    print("making the source:", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True)


def run_once(cfg, backend, parts: Parts | None, profile: cProfile.Profile | None) -> dict:
    from distill.generate import Generator, runner

    loop = [0.0, 0.0]
    real_loop = runner.Generator._run_chunks

    def timed_loop(self, *args):
        t, c = time.perf_counter(), time.process_time()
        try:
            return real_loop(self, *args)
        finally:
            loop[0] += time.perf_counter() - t
            loop[1] += time.process_time() - c

    runner.Generator._run_chunks = timed_loop
    if parts is not None:
        instrument(parts)
    try:
        gen = Generator(cfg, backend=backend)  # the model's config and tokenizer: not the pipeline's per-token work
        if profile is not None:
            profile.enable()
        t0, c0 = time.perf_counter(), time.process_time()
        summary = gen.run()
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        if profile is not None:
            profile.disable()
    finally:
        if parts is not None:
            parts.restore()
        runner.Generator._run_chunks = real_loop
    tokens = summary.new_tokens
    out = {"tokens": tokens, "rows": summary.generated, "seconds": round(seconds, 4), "cpu_seconds": round(cpu, 4),
           "tok_per_s": round(tokens / seconds), "cpu_tok_per_s": round(tokens / cpu),
           "loop_tok_per_s": round(tokens / loop[0]), "loop_cpu_tok_per_s": round(tokens / loop[1])}
    if parts is not None:
        for name, spent, total in (("us_per_token", parts.wall, seconds), ("cpu_us_per_token", parts.cpu, cpu)):
            spent = dict(spent, other=total - sum(spent.values()))
            out[name] = {p: round(spent.get(p, 0.0) / tokens * 1e6, 3) for p in PARTS}
    return out


def vllm_output_costs(backend, k: int, repeats: int) -> dict:
    """µs per generated token: VLLMBackend._completions on the replies as vLLM reports them, and vLLM's own
    building of those lists. Each position: the sampled token first, then the top-k (vLLM's order)."""
    import itertools
    import types

    import numpy as np

    from distill.generate.backends import VLLMBackend

    try:
        from vllm.logprobs import FlatLogprobs, append_logprobs_for_next_position
    except ImportError:
        FlatLogprobs = append_logprobs_for_next_position = None
    replies = [rep for reps in backend.replies.values() for rep in reps]
    blocks = []  # per reply: (sampled ids, (N, K + 1) ids, (N, K + 1) logprobs) as the engine core hands them over
    for rep in replies:
        sampled = np.asarray(rep.token_ids, dtype=np.int64)  # (N,)
        hit = rep.topk_ids[:, :k] == sampled[:, None]  # (N, K)
        lp_sampled = np.where(hit.any(1), (rep.topk_logprobs[:, :k] * hit).sum(1), rep.topk_logprobs[:, k - 1] - 1.0)
        ids = np.concatenate([sampled[:, None], rep.topk_ids[:, :k]], axis=1)
        lps = np.concatenate([lp_sampled[:, None], rep.topk_logprobs[:, :k]], axis=1).astype(np.float32)
        blocks.append((sampled, ids, lps))
    tokens = sum(len(s) for s, _, _ in blocks)

    def build_lists():
        """vLLM's LogprobsProcessor for a request that asks for logprobs without detokenizing."""
        outs = []
        for sampled, ids, lps in blocks:
            flat = FlatLogprobs() if FlatLogprobs is not None else None
            if flat is None:
                return None
            for i in range(len(sampled)):
                append_logprobs_for_next_position(flat, ids[i].tolist(), lps[i].tolist(), itertools.repeat(None), 1, k)
            outs.append(types.SimpleNamespace(token_ids=sampled.tolist(), finish_reason="stop", logprobs=flat))
        return outs

    result = {"positions": tokens}
    outs, best = None, []
    for _ in range(repeats):
        t = time.process_time()
        outs = build_lists()
        best.append(time.process_time() - t)
    if outs is None:
        return result | {"note": "vllm is not installed: only the pipeline was measured"}
    result["vllm_lists_us_per_token"] = round(min(best) / tokens * 1e6, 3)
    times = []
    for _ in range(repeats):  # one engine call that returns every reply
        t = time.process_time()
        VLLMBackend._completions(outs, [k] * len(outs))
        times.append(time.process_time() - t)
    result["completion_us_per_token"] = round(min(times) / tokens * 1e6, 3)
    return result


def lscpu() -> dict:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return {k: fields[k].strip() for k in ("Model name", "CPU family", "Model", "CPU(s)") if k in fields}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", type=Path, required=True,
                    help="A finished dataset folder to replay (made here when it has no manifest).")
    ap.add_argument("--source-max-tokens", type=int, default=128, help="Max new tokens per turn when the source is made here.")
    ap.add_argument("--samples", type=int, default=8, help="Replays of each stored conversation per run (as samples).")
    ap.add_argument("--topk", type=int, default=20, help="Teacher candidates stored (up to the source's).")
    ap.add_argument("--shard-size", type=int, default=1000, help="Conversations per shard and per engine round "
                    "(generate's default: rounds as large as a GPU node's).")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--profile", type=int, default=0,
                    help="Also print the N functions of most own time in one more run (cProfile).")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    from distill.generate.backends import ReplayBackend, replay_config
    from distill.models import resolve_model
    from distill.runtime import machine

    if not (args.source / "manifest.json").is_file():
        make_source(args.source, args.source_max_tokens)
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as tmp:
        cfg = replay_config(args.source, str(Path(tmp) / "out"), samples=args.samples, topk=args.topk,
                            shard_size=args.shard_size)
        backend = ReplayBackend(args.source, resolve_model(cfg.model).path, cfg.max_model_len)
        replies = [rep for reps in backend.replies.values() for rep in reps]
        source = {"seed": cfg.seed, "mode": cfg.mode, "conversations": cfg.limit, "replies": len(replies),
                  "tokens_per_reply": round(sum(len(r.token_ids) for r in replies) / max(1, len(replies)), 1)}
        print(f"replaying {len(replies)} stored replies x {args.samples} samples", flush=True)

        def fresh(i: int):
            from dataclasses import replace

            return replace(cfg, out=str(Path(tmp) / f"out-{i}"))

        run_once(fresh(-1), backend, None, None)  # warm-up: imports, caches, the page cache
        runs = []
        for i in range(args.repeats):
            runs.append(run_once(fresh(i), backend, Parts(), None))
            print(json.dumps(runs[-1]), flush=True)
        plain = run_once(fresh(args.repeats), backend, None, None)  # uninstrumented: what the timers cost
        print(json.dumps({"uninstrumented": plain}), flush=True)
        if args.profile:
            profile = cProfile.Profile()
            run_once(fresh(args.repeats + 1), backend, None, profile)
            pstats.Stats(profile).sort_stats("tottime").print_stats(args.profile)
        vllm = vllm_output_costs(backend, args.topk, max(1, min(args.repeats, 3)))
        backend.close()

    rates, cpu_rates = [r["tok_per_s"] for r in runs], [r["cpu_tok_per_s"] for r in runs]
    result = {
        "machine": machine("cpu"),
        "lscpu": lscpu(),
        "options": vars(args) | {"source": str(args.source), "json": str(args.json) if args.json else None},
        "source": source,
        "runs": runs,
        "uninstrumented": plain,
        "tok_per_s_best": max(rates),
        "tok_per_s_median": statistics.median(rates),
        "cpu_tok_per_s_best": max(cpu_rates),
        "cpu_tok_per_s_median": statistics.median(cpu_rates),
        "loop_tok_per_s_median": statistics.median(r["loop_tok_per_s"] for r in runs),
        "loop_cpu_tok_per_s_median": statistics.median(r["loop_cpu_tok_per_s"] for r in runs),
        "us_per_token_median": {p: round(statistics.median(r["us_per_token"][p] for r in runs), 3) for p in PARTS},
        "cpu_us_per_token_median": {p: round(statistics.median(r["cpu_us_per_token"][p] for r in runs), 3) for p in PARTS},
        "vllm_output": vllm,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
