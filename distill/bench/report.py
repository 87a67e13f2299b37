"""Benchmark results as files: ``bench.json``, ``bench.md`` (markdown tables), ``bench.png``,
and with the sweep ``sweep.png`` and ``tree.json`` (the sparse tree of the chosen node budget)."""

from __future__ import annotations

from pathlib import Path

from distill.bench.stats import BenchResult, Sweep
from distill.store.atomic import atomic_write_bytes, atomic_write_figure, atomic_write_json


#: the speculative columns' name per proposer (bench.json keeps its medusa_* field names for every proposer)
PROPOSER_NAMES = {"medusa": "Medusa", "eagle3": "EAGLE-3", "lookup": "lookup"}


def proposer_name(tree: dict) -> str:
    """The speculative columns' name: the proposer's, each part's for a union (``lookup+medusa``: "lookup + Medusa")."""
    name = tree.get("proposer")
    return " + ".join(PROPOSER_NAMES.get(part, part) for part in name.split("+")) if name else "speculative"


def policy_used(used: int) -> str:
    """What the speculation policy did at batch 1, as the report and the pipeline's summary say it."""
    return "the policy decoded plain at batch 1" if used == 0 else f"the policy used {used} node{'s' if used > 1 else ''} at batch 1"


def plain_line(result: BenchResult) -> str | None:
    """The first line when the speculation policy decoded plain at batch 1, or when the full tree's acceptance was
    measured (``--tree-acceptance``): what the full tree makes per step against what it has to make to pay for its
    step (None otherwise)."""
    tree = result.tree
    tree_tau = tree.get("full_tree_tokens_per_step")
    used = tree.get("nodes_used_at_batch_1")
    if used != 0 and tree_tau is None:
        return None
    who = f"the {proposer_name(tree)} proposer's full tree"
    even = tree.get("break_even_at_batch_1")
    said = policy_used(used).capitalize()
    if not even:
        made = f"; the full tree made {tree_tau:.2f} tokens/step on these prompts" if tree_tau is not None else ""
        return f"{said}: it priced {who} above what it makes per step{made}." if used == 0 else f"{said}{made}."
    nodes, expected, measured = even["nodes"], even["expected"], even.get("expected_measured")
    if tree_tau is not None:
        makes, source = tree_tau, "measured on these prompts, greedy, untimed"
    else:
        makes, source = expected, "expected from its acceptance table, not measured: `--tree-acceptance` measures it"
        if measured is not None and abs(measured - expected) > 0.005:
            source += f"; {measured:.2f} with the acceptance the policy measured in this run"
    return (f"{said}: {who} ({nodes} nodes) makes {makes:.2f} tokens/step ({source}), "
            f"this machine breaks even at {even['tokens_per_step']:.2f} tokens/step (a step of {nodes} nodes costs "
            f"{even['tokens_per_step']:.2f}x a plain one).")


def _costs_note(costs: dict | None) -> str:
    """The measured step-cost curve the policy priced trees with, as the header's aside."""
    if not costs:
        return ""
    rows = [m for m in costs if m != "1"]
    return (f", priced by the step costs measured at start: {' / '.join(rows)} rows "
            f"{' / '.join(f'{costs[m]:.2f}' for m in rows)}x a plain step")


def markdown(result: BenchResult) -> str:
    spec = proposer_name(result.tree)
    against = any(g.vllm_tokens_per_s is not None for g in result.groups)  # --vllm: bare vLLM's columns
    plain = plain_line(result)
    lines = ([plain, ""] if plain else []) + [
        f"Model `{result.model}`, heads `{result.heads}`, tree {result.tree.get('nodes')} nodes ({result.tree.get('source')}; "
        f"{result.tree.get('nodes_used_at_batch_1')} used at batch 1{_costs_note(result.tree.get('step_costs'))}), batch 1, "
        f"max_tokens {result.config['max_tokens']}, "
        f"prompts `{result.config['prompts']}`; {result.machine}; {result.date}.",
        "",
        f"| acceptance | category | prompts | plain tok/s | {spec} tok/s | tokens/step | plain step ms | {spec} step ms | step overhead | "
        "speedup | identical to plain |" + (f" vLLM tok/s | plain / vLLM | {spec} / vLLM | identical to vLLM |" if against else ""),
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |" + (" ---: | ---: | ---: | ---: |" if against else ""),
    ]
    for g in result.groups:
        ident = "" if g.identical is None else f"{g.identical}/{g.prompts}"
        cat = f"**{g.category}**" if g.category == "all" else g.category
        row = (f"| {g.acceptance} | {cat} | {g.prompts} | {g.plain_tokens_per_s:.1f} | {g.medusa_tokens_per_s:.1f} | "
               f"{g.acceleration_rate:.2f} | {g.plain_step_ms:.1f} | {g.medusa_step_ms:.1f} | {g.step_overhead:.2f}x | "
               f"{g.speedup:.2f}x | {ident} |")
        if against:
            row += (" | | | |" if g.vllm_tokens_per_s is None else
                    f" {g.vllm_tokens_per_s:.1f} | {g.plain_vs_vllm:.2f}x | {g.medusa_vs_vllm:.2f}x | {g.vllm_identical}/{g.prompts} |")
        lines.append(row)
    if result.sweep is not None:
        lines += ["", sweep_markdown(result.sweep)]
    return "\n".join(lines) + "\n"


def sweep_markdown(s: Sweep) -> str:
    lines = [
        f"Tree-size sweep on {s.device}: one decoding step (heads' proposal + verification forward of N+1 tokens) at a "
        f"{s.context}-token context, median of {s.repeats}; tau(N) from the {s.accuracy_source} accuracy table.",
        "",
        "| nodes N | step ms | overhead | tau(N) (tokens/step) | predicted speedup |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for p in s.points:
        mark = " **(best)**" if p.nodes == s.best_nodes else ""
        lines.append(f"| {p.nodes} | {1000 * p.seconds:.2f} | {p.overhead:.2f}x | {p.expected_acceptance_length:.2f} | "
                     f"{p.predicted_speedup:.2f}x{mark} |")
    choice = (f"Chosen node budget: **{s.best_nodes}** (predicted {s.best_predicted_speedup:.2f}x)" if s.best_nodes
              else "Chosen node budget: **0**: no tree beats plain decoding on this hardware with these heads")
    lines += ["", f"{choice}; fitted step cost ratio r = {s.step_cost_ratio:.4f} per extra token (EngineConfig.step_cost_ratio)."]
    return "\n".join(lines)


def plot(result: BenchResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(dict.fromkeys(g.acceptance for g in result.groups))
    cats = list(dict.fromkeys(g.category for g in result.groups))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.8 / max(len(modes), 1)
    for ax, field, title in ((axes[0], "acceleration_rate", "acceleration rate (tokens / step)"), (axes[1], "speedup", "wall-clock speedup vs plain")):
        for j, mode in enumerate(modes):
            vals = [next((getattr(g, field) for g in result.groups if g.acceptance == mode and g.category == c), 0.0) for c in cats]
            ax.bar([i + j * width for i in range(len(cats))], vals, width, label=mode)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xticks([i + width * (len(modes) - 1) / 2 for i in range(len(cats))], cats, rotation=30, ha="right")
        ax.set_title(title)
        ax.legend()
    fig.suptitle(f"{result.model}: {proposer_name(result.tree)} vs plain decoding, batch 1 ({result.machine})", fontsize=10)
    fig.tight_layout()
    _save(fig, path)


def plot_sweep(s: Sweep, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [max(p.nodes, 0.5) for p in s.points]  # plain (0 nodes) drawn at 0.5 on the log axis
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(xs, [p.overhead for p in s.points], "o-", label="step overhead t(N)/t(0) (measured)")
    ax.plot(xs, [p.expected_acceptance_length for p in s.points], "s-", label="tau(N) tokens/step (calibrated)")
    ax.plot(xs, [p.predicted_speedup for p in s.points], "^-", label="predicted speedup tau/overhead")
    best = next(p for p in s.points if p.nodes == s.best_nodes)
    ax.annotate(f"best N={best.nodes}\n{best.predicted_speedup:.2f}x", (max(best.nodes, 0.5), best.predicted_speedup),
                textcoords="offset points", xytext=(10, 10))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tree nodes N (plain decoding at 0.5)")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_title(f"step cost vs tree size on {s.device}, context {s.context}", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path)


def _save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    atomic_write_figure(Path(path), fig)
    plt.close(fig)


def write_all(result: BenchResult, out: Path) -> dict[str, Path]:
    """Write every artifact into ``out``; returns name -> path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "bench.json", "markdown": out / "bench.md"}
    atomic_write_json(paths["json"], result.to_dict(), indent=1)
    atomic_write_bytes(paths["markdown"], markdown(result).encode())
    if result.groups:
        paths["plot"] = out / "bench.png"
        plot(result, paths["plot"])
    if result.sweep is not None:
        paths["sweep_plot"] = out / "sweep.png"
        plot_sweep(result.sweep, paths["sweep_plot"])
    return paths


def write_tree(s: Sweep, path: Path, num_heads: int) -> None:
    """The sparse tree of the chosen budget as ``tree.json`` (``distill serve --tree PATH``)."""
    from distill.heads.tree import save_tree, sparse_tree

    if s.best_nodes < 1:
        return
    best = next(p for p in s.points if p.nodes == s.best_nodes)
    save_tree(path, sparse_tree(s.accuracy, s.best_nodes), num_heads, accuracy=s.accuracy,
              expected_acceptance_length=best.expected_acceptance_length, source=f"distill bench --sweep-tree ({s.device})")
