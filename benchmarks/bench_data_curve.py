"""What more data buys: a drafter's acceptance length against the training tokens it has seen.

    OMP_NUM_THREADS=2 PYTHONPATH=. python benchmarks/bench_data_curve.py --work /tmp/curve --tokens 2000000 \\
        --out benchmarks/results/data-curve.json

The data is the model's own, on requests it wrote itself (``benchmarks/self_instruct.py``: meta-prompts over
MT-Bench's categories, never its questions, sampled ``--samples`` times each at temperature 1, cleaned and
deduplicated), answered greedily (``distill generate --temperature 0 --max-tokens 192``). Each drafter
(EAGLE-3, Medusa-1) trains one pass over the first ``--tokens`` trained tokens of it, with ``train-heads
--eval-data`` measuring the simulated acceptance length of its ``--nodes``-node tree on the model's greedy
answers to MT-Bench's first turns every ``--eval-every`` steps: the curve is that series, against the
tokens seen at each evaluation (one run, one learning-rate schedule over the whole budget, so a point in the
middle of the run is a drafter still at a high learning rate, not one trained to that budget). At the end
``distill bench --full-tree`` decodes the first ``--bench-prompts`` MT-Bench first turns (64 tokens, greedy)
with the best checkpoint for the tokens/step the engine accepts.

Every step resumes: the generation runs are resumable, training continues from its latest checkpoint
(``--resume``), so the bench can be stopped and started again (``--stop-after-seconds`` stops it on its own
between steps; a training killed by hand loses the steps since its last checkpoint, every ``--eval-every``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_selfdistill import ARCHS, WINDOWS, budget_subset, complete, full_tree_bench, run  # noqa: E402
import self_instruct  # noqa: E402


def curve(heads: Path, trained_tokens: int) -> list[dict]:
    """The run's evaluations from its metrics.jsonl: the window tokens it has read (``tokens``: replies, prompts and
    re-read context), the share of the budget's trained tokens seen (``trained_tokens``: the budget times the share
    of the run's steps done), simulated tree and chain acceptance."""
    points, tokens_at = [], {}
    for line in (heads / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "tokens" in rec:
            tokens_at[rec["step"]] = rec["tokens"]
        if "eval_tree_acceptance" in rec:
            step = rec["step"]
            seen = tokens_at.get(step) or max((t for s, t in tokens_at.items() if s <= step), default=0)
            points.append({"step": step, "tokens": seen, "tree": rec["eval_tree_acceptance"],
                           "chain": rec["eval_chain_acceptance"]})
    last = max(tokens_at, default=0)
    for p in points:
        p["trained_tokens"] = round(trained_tokens * p["step"] / last) if last else 0
    return points


def plot(report: dict, png: Path) -> None:
    """Tokens/step of each drafter's tree against the trained tokens seen, log-scaled (the curve's shape in a picture)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    for arch, r in report["runs"].items():
        pts = [p for p in r["curve"] if p["trained_tokens"]]
        ax.plot([p["trained_tokens"] for p in pts], [p["tree"] for p in pts], marker="o", label=f"{arch}, tree")
        ax.plot([p["trained_tokens"] for p in pts], [p["chain"] for p in pts], linestyle="--", label=f"{arch}, chain")
    ax.set_xscale("log")
    ax.set_xlabel("trained tokens seen (one pass, one schedule)")
    ax.set_ylabel("expected tokens/step, MT-Bench answers")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "data-curve.json")
    ap.add_argument("--tokens", type=int, default=2_000_000, help="trained tokens of the longest run")
    ap.add_argument("--copies", type=int, default=4, help="meta-prompts per topic and kind")
    ap.add_argument("--samples", type=int, default=12,
                    help="requests sampled per meta-prompt (fixed once a --work folder holds its requests)")
    ap.add_argument("--replies", type=int, default=0,
                    help="answer only the first N requests (0: all); raise it and run again to add data")
    ap.add_argument("--archs", nargs="+", default=["eagle3", "medusa1"], choices=list(ARCHS))
    ap.add_argument("--eval-every", type=int, default=24, help="optimizer steps between evaluations")
    ap.add_argument("--nodes", type=int, default=24)
    ap.add_argument("--precision", default="auto")
    ap.add_argument("--bench-prompts", type=int, default=8)
    ap.add_argument("--stop-after-seconds", type=float, default=0, help="stop between steps after this long (0: never)")
    args = ap.parse_args()
    work = args.work
    (work / "logs").mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    seconds: dict = {}

    def out_of_time() -> bool:
        return bool(args.stop_after_seconds) and time.perf_counter() - t0 > args.stop_after_seconds

    gen = ["--mode", "single-turn", "--teacher-topk", "20", "--dtype", "float32", "--shard-size", "256", "--quiet"]
    meta = work / "si-meta.jsonl"
    if not meta.exists():
        self_instruct.meta(args.copies, meta)
    steps = [
        (work / "si-requests", ["generate", "--seed", str(meta), "--temperature", "1.0", "--max-tokens", "64",
                                "--samples", str(args.samples), *gen]),
        (work / "heldout-mt-bench", ["generate", "--seed", "mt-bench", "--temperature", "0", "--max-tokens", "160", *gen]),
    ]
    for folder, cmd in steps:
        if not complete(folder):
            seconds[f"generate:{folder.name}"] = run(cmd + ["--out", str(folder)], work / "logs" / f"{folder.name}.log")
    seeds = work / "si-seeds.jsonl"
    if not seeds.exists():
        total, kept = self_instruct.seeds(work / "si-requests", seeds)
        print(f"{kept} distinct requests of {total}")
    replies = work / "si-greedy"
    if not out_of_time():  # a finished folder is left as it is; a raised --replies adds rows
        limit = ["--limit", str(args.replies)] if args.replies else []
        seconds["generate:si-greedy"] = run(["generate", "--seed", str(seeds), "--temperature", "0", "--max-tokens", "192",
                                             *limit, *gen, "--out", str(replies)], work / "logs" / "si-greedy.log")
    if not complete(replies):
        raise SystemExit(f"stopped after {time.perf_counter() - t0:.0f} s with {replies} unfinished: run again to resume")
    data = budget_subset(replies, work / "train", args.tokens)
    if data["short_of_budget"]:  # the trainings start only on the whole budget (a run cannot grow its data)
        raise SystemExit(f"{replies} holds {data['trained_tokens']} trained tokens of --tokens {args.tokens}: "
                         "raise --replies (up to the distinct requests), or use a new --work with more --samples")

    report: dict = {"command": " ".join(sys.argv), "threads": os.environ.get("OMP_NUM_THREADS"),
                    "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                    "data": data, "runs": {}}
    for arch in args.archs:
        heads = work / f"heads-{arch}"
        done = (heads / "distill-heads.json").exists()
        if not done and not out_of_time():
            cmd = ["train-heads", "--data", str(work / "train"), "--out", str(heads), *ARCHS[arch], *WINDOWS, "--epochs",
                   "1", "--warmup-steps", "20", "--precision", args.precision, "--eval-data", str(work / "heldout-mt-bench"), "--eval-every",
                   str(args.eval_every), "--eval-nodes", str(args.nodes), "--save-every", str(args.eval_every),
                   "--keep-checkpoints", "2", "--report-to", "none", "--quiet"]
            if (heads / "checkpoints").exists():
                cmd.append("--resume")
            seconds[f"train:{arch}"] = run(cmd, work / "logs" / f"train-{arch}.log")
            done = (heads / "distill-heads.json").exists()
        if not done:
            continue
        bench = work / f"bench-{arch}"
        best = heads / "best" if (heads / "best").exists() else heads
        if not (bench / "bench.json").exists():
            seconds[f"bench:{arch}"] = run(full_tree_bench(best, "mt-bench", args.bench_prompts, args.nodes, bench),
                                           work / "logs" / f"bench-{arch}.log")
        report["runs"][arch] = {"heads": str(heads), "best": str(best), "curve": curve(heads, data["trained_tokens"]),
                                "bench": json.loads((bench / "bench.json").read_text())}
    report["seconds"] = seconds
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    if report["runs"]:
        plot(report, args.out.with_suffix(".png"))
    for arch, r in report["runs"].items():
        print(arch, " ".join(f"{p['trained_tokens'] // 1000}k:{p['tree']:.2f}" for p in r["curve"]))


if __name__ == "__main__":
    main()
