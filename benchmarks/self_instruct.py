"""Task-style seed prompts written by the model itself (self-instruct), for heads that serve task prompts.

The bundled ShareGPT file is FastChat's identity set (52 distinct openers such as "Who are
you?") and chitchat is casual talk: neither looks like MT-Bench's writing, reasoning, math,
coding or extraction tasks, and heads trained on them transfer poorly there (BENCHMARKS.md).
With no task data to hand, the model writes the requests:

1. ``meta``: a seed file of meta-prompts ("write one request a user could send to an AI
   assistant about <topic>"), over topics from MT-Bench's eight categories (the topics,
   never MT-Bench's questions); generate them with ``distill generate --temperature 1``.
2. ``seeds``: the model's requests, cleaned (one line, length-filtered, exact duplicates
   dropped), written as an OpenAI-messages seed file for a second ``distill generate``.

    python benchmarks/self_instruct.py meta --copies 4 --out out/si-meta.jsonl
    distill generate --seed out/si-meta.jsonl --mode single-turn --temperature 1.0 --max-new-tokens 64 --out out/si-requests
    python benchmarks/self_instruct.py seeds out/si-requests --out out/si-seeds.jsonl
    distill generate --seed out/si-seeds.jsonl --mode single-turn --temperature 0 --max-new-tokens 192 --out out/si-greedy
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pyarrow.parquet as pq

TOPICS = {
    "writing": ["a travel blog post", "a persuasive essay", "a short story", "a product description", "a formal email",
                "a poem", "a speech", "a cover letter"],
    "roleplay": ["pretending to be a historical figure", "acting as a job interviewer", "playing a detective",
                 "acting as a personal trainer", "pretending to be a tour guide", "acting as a chef"],
    "reasoning": ["a logic puzzle", "a riddle", "ordering events in time", "family relationships",
                  "comparing quantities", "cause and effect"],
    "math": ["algebra", "geometry", "probability", "percentages", "a word problem about money", "sequences"],
    "coding": ["a Python function", "a SQL query", "a bug in JavaScript code", "sorting algorithms",
               "regular expressions", "a C++ class"],
    "extraction": ["pulling names and dates out of a paragraph", "summarizing a news article", "turning text into JSON",
                   "listing the key points of a report", "classifying reviews as positive or negative"],
    "stem": ["physics", "chemistry", "biology", "astronomy", "computer networks", "climate science"],
    "humanities": ["history", "philosophy", "economics", "literature", "law", "music"],
}
KINDS = ["a question", "a task", "an instruction", "a request for help"]


def meta(copies: int, out: Path) -> int:
    rows = []
    for category, topics in TOPICS.items():
        for topic in topics:
            for kind in KINDS:
                for i in range(copies):
                    text = (f"Write {kind} that a user might send to an AI assistant, about {topic} ({category}). "
                            f"Reply with the user's message only, nothing else. Variant {i + 1}.")
                    rows.append({"messages": [{"role": "user", "content": text}]})
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return len(rows)


def clean(reply: str) -> str | None:
    text = reply.strip().strip('"').strip()
    text = re.sub(r"^(user|request|question|task|instruction|message)\s*:\s*", "", text, flags=re.I).strip().strip('"')
    text = " ".join(text.split())
    return text if 20 <= len(text) <= 500 else None


def seeds(folder: Path, out: Path) -> tuple[int, int]:
    seen, rows, total = set(), [], 0
    for shard in sorted(folder.glob("shard-*.parquet")):
        for msgs in pq.read_table(shard, columns=["messages"]).column(0).to_pylist():
            total += 1
            text = clean(next((m["content"] for m in msgs if m["role"] == "assistant"), ""))
            if text and text.lower() not in seen:
                seen.add(text.lower())
                rows.append({"messages": [{"role": "user", "content": text}]})
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return total, len(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("meta")
    m.add_argument("--copies", type=int, default=4)
    m.add_argument("--out", type=Path, required=True)
    s = sub.add_parser("seeds")
    s.add_argument("folder", type=Path)
    s.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.cmd == "meta":
        print(f"{meta(args.copies, args.out)} meta-prompts -> {args.out}")
    else:
        total, kept = seeds(args.folder, args.out)
        print(f"{kept} distinct requests of {total} replies -> {args.out}")


if __name__ == "__main__":
    main()
