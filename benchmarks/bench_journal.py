"""The journal's cost on `distill generate` throughput (target: <= 2%).

One process, one in-process vLLM engine, the same seed conversations and sampling, run
alternately ``--repeats`` times with the journal on (every finished conversation appended to
``journal.arrow`` and fsynced, shards compacted from it: what `distill generate` does) and off
(the same code with ``Journal.append`` keeping the rows in memory only, i.e. durability per
shard as before the journal). Throughput is generated tokens over the run's wall time.
The journal's own time (append + fsync, and the compaction's extra read of the journal) is
also summed inside the "on" runs, a figure that does not depend on the machine's noise.

    python benchmarks/bench_journal.py --conversations 48 --shard-size 16 --max-new-tokens 64 --repeats 3 \
        --json benchmarks/results/journal.json

``--server URL`` measures the openai backend on a running vLLM server instead (``--concurrency``
conversations in flight; there the journal's fsync runs on the event loop between responses).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import pyarrow as pa


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=48)
    ap.add_argument("--shard-size", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--mode", default="multi-turn")
    ap.add_argument("--turns", type=int, default=None, help="multi-turn: replay at most N user turns (default all).")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--server", default=None, help="A running vLLM OpenAI server: measure the openai backend.")
    ap.add_argument("--concurrency", type=int, default=16)
    args = ap.parse_args()

    from distill.generate import GenerateConfig, Generator
    from distill.generate.backends import BackendOptions, VLLMBackend
    from distill.models import resolve_model
    from distill.runtime import machine
    from distill.store import journal as journal_mod

    opts = BackendOptions(dtype=args.dtype, max_model_len=2048, seed=0)
    if args.server:
        from distill.generate.openai_server import OpenAIBackend, ServerOptions, parse_servers

        backend = OpenAIBackend(resolve_model(None).path, opts, ServerOptions(parse_servers(args.server), args.concurrency))
    else:
        backend = VLLMBackend(resolve_model(None).path, opts)
    real_append = journal_mod.Journal.append
    spent = {"s": 0.0, "appends": 0}

    def timed_append(self, rows):
        t = time.perf_counter()
        real_append(self, rows)
        spent["s"] += time.perf_counter() - t
        spent["appends"] += 1

    def memory_append(self, rows):  # journal off: rows wait in memory for their shard, nothing is written
        if rows:
            self.batches.append(pa.RecordBatch.from_pylist(rows, schema=self.schema))

    def run(journal: bool) -> dict:
        journal_mod.Journal.append = timed_append if journal else memory_append
        spent.update(s=0.0, appends=0)
        with tempfile.TemporaryDirectory(prefix="bench-journal-") as tmp:
            cfg = GenerateConfig(seed="sharegpt", out=str(Path(tmp) / "out"), limit=args.conversations,
                                 shard_size=args.shard_size, max_new_tokens=args.max_new_tokens,
                                 temperature=args.temperature, dtype=args.dtype, concurrency=args.concurrency,
                                 mode=args.mode, turns=args.turns)
            t0 = time.perf_counter()
            summary = Generator(cfg, backend=backend).run()
            seconds = time.perf_counter() - t0
        return {"journal": journal, "seconds": seconds, "tokens": summary.new_tokens,
                "tok_per_s": summary.new_tokens / seconds, "journal_seconds": spent["s"], "appends": spent["appends"]}

    run(True)  # warm-up (engine caches, page cache)
    runs = []
    for i in range(args.repeats):
        for journal in ((True, False) if i % 2 == 0 else (False, True)):
            runs.append(run(journal))
            print(json.dumps(runs[-1]), flush=True)
    journal_mod.Journal.append = real_append
    on = [r["tok_per_s"] for r in runs if r["journal"]]
    off = [r["tok_per_s"] for r in runs if not r["journal"]]
    share = [r["journal_seconds"] / r["seconds"] for r in runs if r["journal"]]
    result = {
        "machine": machine("cpu"),
        "backend": backend.name,
        "options": vars(args) | {"json": str(args.json) if args.json else None},
        "runs": runs,
        "tok_per_s_on_median": statistics.median(on),
        "tok_per_s_off_median": statistics.median(off),
        "throughput_ratio_on_over_off": statistics.median(on) / statistics.median(off),
        "journal_time_share_median": statistics.median(share),
        "appends_per_run": runs[0]["appends"],
    }
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    backend.close()


if __name__ == "__main__":
    main()
