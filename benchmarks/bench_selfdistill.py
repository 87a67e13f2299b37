"""What self-distillation buys: drafters trained on the seed's own replies against the model's regenerated ones.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/bench_selfdistill.py --work /tmp/selfdistill \\
        --out benchmarks/results/self-distillation.json

One pool of prompts (the first ``--chitchat`` chit-chat conversations and the bundled "ShareGPT" file, FastChat's
identity set, with its repeated conversations dropped; every conversation cut to its first ``--turns`` user turns,
the identity set's spread evenly through the pool), four training sets drawn from it, and Medusa-1 and EAGLE-3
trained on each with ``--seeds`` training seeds:

originals
    the seed's own assistant replies (``distill data convert POOL --format shards``: human chit-chat replies and the
    identity set's written answers), hard targets;
greedy
    the model's replies (``distill generate --mode multi-turn --temperature 0``), hard targets;
sampled
    its replies sampled at ``--temperature`` (0.7), hard targets;
soft
    the same rows as ``sampled``, trained on the stored teacher top-k (``--targets soft``).

Every set is the pool's conversations in pool order until ``--budget`` trained tokens (the tokens a row's loss
mask marks); the human replies are shorter, so ``originals`` takes more of the pool's conversations to fill the
same budget. Every drafter sees the same number of target tokens, ``--epochs`` passes; a training seed sets its
initialization and the order of its windows.

Acceptance is measured by ``distill calibrate`` (``--nodes``-node tree, the simulated acceptance length from the
held-out per-depth accuracy, the figure ``train-heads --eval-data`` logs) on the model's greedy answers to two
prompt sets no training row came from: MT-Bench's first turns and ``benchmarks/heldout-chat-prompts.json``. With
``--bench``, ``distill bench --tree-acceptance`` also runs the full tree on the first ``--bench-prompts`` of each
set (64 tokens, greedy) for the tokens/step the engine accepts.

Steps are skipped when their output is in ``--work`` already; ``--jobs 2`` runs two trainings (and two
calibrations) side by side, each process with the ``OMP_NUM_THREADS`` it inherits.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("originals", "greedy", "sampled", "soft")
ARCHS = {
    "medusa1": ["--arch", "medusa", "--medusa-mode", "medusa1", "--num-heads", "4", "--share-lm-head"],
    "eagle3": ["--arch", "eagle3", "--ttt-steps", "3", "--draft-vocab", "auto"],
}
HELDOUT_SETS = ("mt-bench", "heldout-chat")
#: the windows and learning rate of every training in the self-distillation and data-curve benches
WINDOWS = ["--max-len", "512", "--context", "128", "--batch-size", "4", "--pack", "--lr", "3e-3"]


def distill_cli() -> list[str]:
    return [sys.executable, "-c", "from distill.cli import main; main()"]


def run(args: list[str], log: Path) -> float:
    """Run one distill command, its output to ``log``; seconds taken. A failure stops the bench with the log's tail."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.call(distill_cli() + args, stdout=f, stderr=subprocess.STDOUT, cwd=REPO)
    if rc != 0:
        tail = log.read_text().splitlines()[-15:]
        raise SystemExit(f"distill {' '.join(args[:1])} failed (exit {rc}); {log}:\n" + "\n".join(tail))
    return time.perf_counter() - t0


def write_jsonl(path: Path, rows: list[dict]) -> None:
    tmp = path.with_suffix(".partial")
    with open(tmp, "w") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    tmp.replace(path)


def build_pool(work: Path, chitchat: int, turns: int) -> Path:
    """The prompt pool as an OpenAI-messages seed file (the seed's replies kept: ``originals`` trains on them,
    ``distill generate`` replays only the user turns)."""
    path = work / "pool.jsonl"
    if path.exists():
        return path
    from distill.seeds import load_seed

    def cut(conv) -> list[dict] | None:
        out, users = [], 0
        for m in conv.messages:
            if m.role == "user":
                if users == turns:
                    break
                users += 1
            if m.role in ("user", "assistant"):
                out.append({"role": m.role, "content": m.content})
        while out and out[-1]["role"] != "assistant":
            out.pop()
        return out or None

    chat = []
    for conv in load_seed("chitchat"):
        if len(chat) == chitchat:
            break
        msgs = cut(conv) if hasattr(conv, "messages") else None
        if msgs:
            chat.append(("chitchat", conv.id, msgs))
    ident, seen = [], set()
    for conv in load_seed("sharegpt"):
        msgs = cut(conv) if hasattr(conv, "messages") else None
        key = tuple(m["content"].strip().lower() for m in msgs or [] if m["role"] == "user")
        if msgs and key not in seen:
            seen.add(key)
            ident.append(("sharegpt", conv.id, msgs))
    # the identity set spread evenly through the pool, so that every budget draws both in the same proportion
    step = max(1, len(chat) // max(1, len(ident)))
    pool, it = [], iter(ident)
    for i, item in enumerate(chat):
        pool.append(item)
        if (i + 1) % step == 0:
            nxt = next(it, None)
            if nxt is not None:
                pool.append(nxt)
    pool.extend(it)
    write_jsonl(path, [{"id": f"pool-{i:05d}", "source": f"{src}:{cid}", "messages": msgs}
                       for i, (src, cid, msgs) in enumerate(pool)])
    return path


def heldout_seed(work: Path) -> Path:
    path = work / "heldout-chat.jsonl"
    if not path.exists():
        cats = json.loads((REPO / "benchmarks" / "heldout-chat-prompts.json").read_text())["categories"]
        write_jsonl(path, [{"id": f"{cat}-{i}", "messages": [{"role": "user", "content": p}]}
                           for cat, prompts in cats.items() for i, p in enumerate(prompts)])
    return path


def complete(folder: Path) -> bool:
    try:
        return bool(json.loads((folder / "manifest.json").read_text())["totals"]["complete"])
    except (OSError, KeyError, ValueError):
        return False


def pool_index(row_id: str) -> int:
    from distill.conversation import conversation_id, seed_conversation_id

    return int(seed_conversation_id(conversation_id(row_id)).split("-")[1])


def budget_subset(src: Path, out: Path, budget: int, order=None) -> dict:
    """The rows of ``src`` (sorted by ``order``, a row -> key function; None: as stored) until ``budget`` trained
    tokens (the tokens a loss mask marks), as a derived dataset folder, and what it holds; made again when ``src``
    has gained rows since or the budget differs. ``short_of_budget``: the tokens missing when ``src`` holds fewer."""
    from distill.conversation import conversation_id
    from distill.data.dataset import Dataset
    from distill.data.write import ShardWriter, derived_meta

    d = Dataset.open(src)
    if (out / "subset.json").exists():
        info = json.loads((out / "subset.json").read_text())
        if info.get("source_rows") == d.rows and info.get("budget") == budget:
            return info
    if out.exists():  # made from fewer rows, or published and stopped before its subset.json
        shutil.rmtree(out)
    rows = d.iter_rows() if order is None else sorted(d.iter_rows(), key=order)
    taken, tokens = [], 0
    for r in rows:
        if tokens >= budget:
            break
        taken.append(r)
        tokens += int(sum(r["loss_mask"]))
    with ShardWriter(out, derived_meta(d.meta, "subset", budget_tokens=budget), d.id_dtype, 256) as w:
        for r in taken:
            w.add(r)
        w.close()
    replies = sum(1 for r in taken for t in r["turns"] if t["role"] == "assistant")
    info = {"budget": budget, "rows": len(taken), "conversations": len({conversation_id(r["id"]) for r in taken}),
            "trained_tokens": tokens, "tokens": int(sum(len(r["input_ids"]) for r in taken)),
            "mean_reply_tokens": round(tokens / max(1, replies), 1), "short_of_budget": max(0, budget - tokens),
            "source_rows": d.rows}
    (out / "subset.json").write_text(json.dumps(info, indent=1))
    return info


def full_tree_bench(heads: Path, prompts: str, limit: int, nodes: int, out: Path) -> list[str]:
    """The ``distill bench`` command that decodes the first ``limit`` prompts (64 tokens, greedy) with the drafter's
    whole ``nodes``-node tree: the tokens/step the engine accepts."""
    return ["bench", "--heads", str(heads), "--prompts", prompts, "--limit", str(limit), "--max-tokens", "64", "--modes",
            "greedy", "--draft-nodes", str(nodes), "--full-tree", "--no-vllm", "--out", str(out), "--quiet"]


def calibration(folder: Path) -> dict:
    c = json.loads((folder / "calibration.json").read_text())
    return {"tree": c["expected_acceptance_length"], "chain": c["chain_expected_acceptance_length"],
            "top1": c["top1"], "positions": c["positions"][0]}


def summarize(results: list[dict]) -> dict:
    """Mean and spread (min, max) over the training seeds per arch, variant and held-out set; gains against
    ``originals`` and of ``soft`` against ``sampled``."""
    table: dict = {}
    for arch in ARCHS:
        table[arch] = {}
        for held in HELDOUT_SETS:
            per = {}
            for v in VARIANTS:
                xs = [r["acceptance"][held]["tree"] for r in results if r["arch"] == arch and r["variant"] == v]
                cs = [r["acceptance"][held]["chain"] for r in results if r["arch"] == arch and r["variant"] == v]
                if xs:
                    per[v] = {"tree_mean": statistics.mean(xs), "tree_min": min(xs), "tree_max": max(xs),
                              "chain_mean": statistics.mean(cs), "n": len(xs)}
            if "originals" in per:
                base = per["originals"]["tree_mean"]
                for v in per:
                    # acceptance length counts the target's own token too: the gain in tokens/step, and in the
                    # drafted tokens above the one every step makes
                    per[v]["gain_vs_originals"] = per[v]["tree_mean"] / base - 1
                    per[v]["drafted_gain_vs_originals"] = (per[v]["tree_mean"] - 1) / max(1e-9, base - 1) - 1
            if "soft" in per and "sampled" in per:
                per["soft"]["gain_vs_sampled"] = per["soft"]["tree_mean"] / per["sampled"]["tree_mean"] - 1
            table[arch][held] = per
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "self-distillation.json")
    ap.add_argument("--chitchat", type=int, default=1600, help="chit-chat conversations in the pool")
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--generate", type=int, default=320, help="pool conversations the model regenerates")
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--budget", type=int, default=32768, help="trained tokens per training set")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--archs", nargs="+", default=list(ARCHS), choices=list(ARCHS))
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--precision", default="auto")
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--bench-prompts", type=int, default=8)
    args = ap.parse_args()
    work = args.work
    (work / "logs").mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    seconds: dict = {}

    pool = build_pool(work, args.chitchat, args.turns)
    gen = ["--turns", str(args.turns), "--max-tokens", str(args.max_new_tokens), "--teacher-topk", "20",
           "--shard-size", "64", "--dtype", "float32", "--quiet"]
    data = {
        "originals": (work / "data-originals", ["data", "convert", str(pool), "--format", "shards", "--shard-size", "256"]),
        "greedy": (work / "data-greedy", ["generate", "--seed", str(pool), "--mode", "multi-turn", "--limit",
                                          str(args.generate), "--temperature", "0", *gen]),
        "sampled": (work / "data-sampled", ["generate", "--seed", str(pool), "--mode", "multi-turn", "--limit",
                                            str(args.generate), "--temperature", str(args.temperature),
                                            "--random-seed", "0", *gen]),
        "mt-bench": (work / "heldout-mt-bench", ["generate", "--seed", "mt-bench", "--mode", "single-turn",
                                                 "--temperature", "0", *gen]),
        "heldout-chat": (work / "heldout-heldout-chat", ["generate", "--seed", str(heldout_seed(work)), "--mode",
                                                         "single-turn", "--temperature", "0", *gen]),
    }
    for name, (folder, cmd) in data.items():
        if not complete(folder):  # an interrupted generate resumes where it stopped
            seconds[f"data:{name}"] = run(cmd + ["--out", str(folder)], work / "logs" / f"data-{name}.log")
    sets = {"originals": "data-originals", "greedy": "data-greedy", "sampled": "data-sampled", "soft": "data-sampled"}
    subsets = {v: budget_subset(work / src, work / f"train-{src.split('-')[1]}", args.budget,
                                order=lambda r: (pool_index(r["id"]), r["id"])) for v, src in sets.items()}
    short = {v: x["short_of_budget"] for v, x in subsets.items() if x["short_of_budget"]}
    if short:
        raise SystemExit(f"trained tokens missing under --budget {args.budget}: {short}; raise --generate or --chitchat")

    # the seed sets the initialization and, through the shuffle buffer, the order of the windows (Medusa-1's blocks
    # start at zero, so without shuffling its seeds would train the same heads)
    train_common = [*WINDOWS, "--shuffle-buffer", "256", "--epochs", str(args.epochs), "--warmup-steps", "4", "--precision",
                    args.precision, "--eval-every", "0", "--save-every", "100000", "--quiet"]
    jobs = [(arch, v, s) for arch in args.archs for v in VARIANTS for s in args.seeds]

    def heads_dir(arch, v, s) -> Path:
        return work / "heads" / f"{arch}-{v}-s{s}"

    def train(job) -> None:
        arch, v, s = job
        out = heads_dir(*job)
        if (out / "distill-heads.json").exists():
            return
        src = work / f"train-{sets[v].split('-')[1]}"
        cmd = ["train-heads", "--data", str(src), "--out", str(out), *ARCHS[arch], *train_common,
               "--targets", "soft" if v == "soft" else "hard", "--random-seed", str(s)]
        seconds[f"train:{out.name}"] = run(cmd, work / "logs" / f"train-{out.name}.log")

    def measure(job) -> None:
        out = heads_dir(*job)
        for held in HELDOUT_SETS:
            cal = work / "calibrate" / f"{out.name}-{held}"
            if not (cal / "calibration.json").exists():
                seconds[f"calibrate:{cal.name}"] = run(
                    ["calibrate", "--heads", str(out), "--data", str(work / f"heldout-{held}"), "--nodes",
                     str(args.nodes), "--out", str(cal), "--no-plots", "--quiet"], work / "logs" / f"cal-{cal.name}.log")
            if args.bench:
                b = work / "bench" / f"{out.name}-{held}"
                if not (b / "bench.json").exists():
                    seed = "mt-bench" if held == "mt-bench" else str(heldout_seed(work))
                    seconds[f"bench:{b.name}"] = run(full_tree_bench(out, seed, args.bench_prompts, args.nodes, b),
                                                     work / "logs" / f"bench-{b.name}.log")

    with ThreadPoolExecutor(args.jobs) as ex:
        list(ex.map(lambda j: (train(j), measure(j)), jobs))

    from distill.data.dataset import Dataset

    results = []
    for job in jobs:
        arch, v, s = job
        out = heads_dir(*job)
        meta = json.loads((out / "distill-heads.json").read_text())
        results.append({"arch": arch, "variant": v, "seed": s, "heads": str(out),
                        "draft_vocab": meta.get("draft_vocab"), "train_seconds": seconds.get(f"train:{out.name}"),
                        "acceptance": {h: calibration(work / "calibrate" / f"{out.name}-{h}") for h in HELDOUT_SETS}})
    report = {
        "command": " ".join(sys.argv),
        "threads": os.environ.get("OMP_NUM_THREADS"),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "training_sets": subsets,
        "heldout": {h: {"rows": Dataset.open(work / f"heldout-{h}").rows} for h in HELDOUT_SETS},
        "results": results,
        "summary": summarize(results),
        "seconds": seconds,
        "wall_seconds": time.perf_counter() - t_start,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    for arch, per_set in report["summary"].items():
        for held, per in per_set.items():
            line = "  ".join(f"{v} {x['tree_mean']:.3f} [{x['tree_min']:.3f}-{x['tree_max']:.3f}]" for v, x in per.items())
            print(f"{arch:8s} {held:13s} {line}")


if __name__ == "__main__":
    main()
