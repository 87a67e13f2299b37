"""Held-out head accuracy and the calibrated sparse tree (``distill calibrate``).

Terms
-----
rank-i hit of head j
    at a held-out position t (hidden state h_t) whose token t+j+2 the teacher
    generated, head j+1's i-th most likely token (0-based rank) equals that token.
accuracy table ``acc[j][i]``
    rank-i hits of head j+1 / evaluated positions of head j+1 (shape K x ranks).
    Tree terms (paths, expected acceptance length, sparse tree) are defined in
    :mod:`distill.heads.tree`.

An EAGLE-3 drafter folder is calibrated the same way, its draft depths 1..5 in the place of
heads: ``acc[j][i]`` = the drafter's rank-i hit at depth j+1 when depths 1..j were right
(:func:`distill.train.eagle.drafter_accuracy`); the engine's EAGLE policy reads that table.

Outputs (in ``out``, default the heads folder): ``tree.json`` (the ``distill-tree/v1``
contract with ``accuracy``), ``calibration.json`` (table, counts, losses, expected
acceptance length vs node count and of the top-1 chain, the Cartesian comparison),
``tree.png`` and ``acceptance.png``.

:func:`held_out_accuracy` and :func:`acceptance` are also what ``train-heads`` evaluates its
drafter with while it trains (:mod:`distill.train.evaluate`): one figure for one drafter.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from distill.errors import ConfigError
from distill.heads.accuracy import HeadAccuracy
from distill.heads.eagle import EagleDrafter, is_eagle3_folder
from distill.heads.model import MedusaHeads, base_model_location, read_distill_meta
from distill.runtime import stage_dtype
from distill.heads.tree import cartesian_tree, expected_acceptance_length, save_tree, sparse_tree
from distill.store.atomic import atomic_write_figure, atomic_write_json
from distill.store.shards import check_shards
from distill.train.data import count_tokens, iter_batches
from distill.train.config import CalibrateConfig  # noqa: F401 - its home is the torch-free config module
from distill.train.losses import hard_ce, shifted_targets

CALIBRATION_FILE = "calibration.json"
#: Draft depths measured for an EAGLE-3 drafter (its "heads"): depth j's rank-i hit given a correct prefix (teacher
#: forced), what the engine's dynamic tree needs to predict its expected tokens per step.
EAGLE_CALIBRATED_DEPTHS = 5


@torch.no_grad()
def head_accuracy(backbone, heads: MedusaHeads, data: Path | str, max_len: int = 512, batch_size: int = 4, ranks: int = 10,
                  max_tokens: int = 0, chunk: int = 128, progress=None) -> HeadAccuracy:
    """Per-head rank hits and CE on ``data`` (up to ``max_tokens`` input tokens; 0: all).

    ``progress``: told each batch's tokens (a :class:`distill.progress.Progress`), when given.
    """
    K = heads.config.num_heads
    device = next(heads.parameters()).device
    acc = HeadAccuracy(ranks=ranks, counts=[0] * K, hits=[[0] * ranks for _ in range(K)], loss_sum=[0.0] * K)
    decoder = backbone.get_decoder()
    for batch in iter_batches(data, max_len, batch_size, epoch=0):
        ids = batch["input_ids"].to(device)
        hidden = decoder(input_ids=ids, attention_mask=batch["attention_mask"].to(device), use_cache=False).last_hidden_state
        hidden = hidden.to(heads.lm_heads[0].weight.dtype)  # (B, T, H)
        n = int(batch["attention_mask"].sum())
        acc.tokens += n
        for k in range(K):
            tgt, valid = shifted_targets(ids, batch["loss_mask"].to(device), k + 2)  # (B, T)
            for s in range(0, ids.shape[1], chunk):
                v = valid[:, s : s + chunk]
                if not v.any():
                    continue
                logits = heads.head_logits(hidden[:, s : s + chunk][v], k)  # (N, V)
                t = tgt[:, s : s + chunk][v]  # (N,)
                top = logits.topk(ranks, -1).indices  # (N, ranks)
                hit = (top == t[:, None]).sum(0)  # (ranks,)
                for i in range(ranks):
                    acc.hits[k][i] += int(hit[i])
                acc.counts[k] += int(v.sum())
                acc.loss_sum[k] += float(hard_ce(logits, t).sum())
        if progress is not None:
            progress.update(n, tokens=n)
        if max_tokens and acc.tokens >= max_tokens:
            break
    return acc


def held_out_accuracy(backbone, drafter: MedusaHeads | EagleDrafter, data: Path | str, max_len: int, batch_size: int, ranks: int,
                      max_tokens: int, progress=None) -> HeadAccuracy:
    """The accuracy counts of Medusa heads (per head) or an EAGLE-3 drafter (per draft depth, the first
    :data:`EAGLE_CALIBRATED_DEPTHS`) on ``data``: what ``calibrate`` measures and ``train-heads`` evaluates while it trains."""
    if isinstance(drafter, EagleDrafter):
        from distill.train.eagle import drafter_accuracy

        return drafter_accuracy(backbone, drafter, data, max_len, batch_size, ranks, max_tokens, steps=EAGLE_CALIBRATED_DEPTHS,
                                progress=progress)
    return head_accuracy(backbone, drafter, data, max_len, batch_size, ranks, max_tokens, progress=progress)


def measured_depths(drafter: MedusaHeads | EagleDrafter) -> int:
    """The depths :func:`held_out_accuracy` measures for ``drafter`` (the accuracy table's rows)."""
    return EAGLE_CALIBRATED_DEPTHS if isinstance(drafter, EagleDrafter) else drafter.config.num_heads


def check_tree_nodes(nodes: int, depths: int, ranks: int, option: str = "--nodes") -> None:
    """A sparse tree of ``nodes`` nodes must fit in the paths ``depths`` depths x top-``ranks`` hold."""
    capacity = sum(ranks ** d for d in range(1, depths + 1))
    if nodes > capacity:
        raise ConfigError(f"{option} {nodes} exceeds the {capacity} paths of {depths} heads x top-{ranks}")


@dataclass
class Acceptance:
    """What an accuracy table predicts: expected tokens per step (the root's included) of the greedy sparse tree of
    ``nodes`` nodes and of a chain (every depth's top-1 guess)."""

    tree: list  # the sparse tree's paths
    tree_length: float
    chain_length: float


def acceptance(acc: list[list[float]], nodes: int) -> Acceptance:
    """The simulated acceptance lengths of the accuracy table ``acc`` (K depths x I ranks): the one figure
    ``calibrate`` writes and ``train-heads`` picks its best checkpoint by."""
    tree = sparse_tree(acc, nodes)
    chain = [(0,) * d for d in range(1, len(acc) + 1)]
    return Acceptance(tree=tree, tree_length=expected_acceptance_length(tree, acc),
                      chain_length=expected_acceptance_length(chain, acc))


@dataclass
class CalibrationResult:
    out: str
    nodes: int
    expected_acceptance_length: float
    cartesian: dict  # {"spec": [...], "nodes": n, "expected_acceptance_length": x} of the same size when one exists
    accuracy: list[list[float]]
    top1: list[float]
    positions: list[int]
    curve: list[float] = field(default_factory=list)  # EAL of the greedy tree with n = 1..nodes nodes
    chain: float = 0.0  # EAL of the chain of every depth's top-1 guess


def best_cartesian_of_size(acc: list[list[float]], nodes: int) -> tuple[list[int], float] | None:
    """The Cartesian tree (non-increasing top-k per head) with exactly ``nodes`` nodes and the best EAL."""
    K, R = len(acc), len(acc[0])
    best = None

    def size(ks):
        total, prod = 0, 1
        for k in ks:
            prod *= k
            total += prod
        return total

    def rec(prefix):
        nonlocal best
        if prefix and size(prefix) == nodes:
            e = expected_acceptance_length(cartesian_tree(prefix), acc)
            if best is None or e > best[1]:
                best = (list(prefix), e)
        if len(prefix) == K or (prefix and size(prefix) >= nodes):
            return
        top = prefix[-1] if prefix else R
        for k in range(1, top + 1):
            if size(prefix + [k]) <= nodes:
                rec(prefix + [k])

    rec([])
    return best


def calibrate(cfg: CalibrateConfig, progress=None) -> CalibrationResult:
    """``progress``: a :class:`distill.progress.Progress` shown the held-out tokens measured (and a line while the
    model loads), when given."""
    from transformers import AutoModelForCausalLM

    from distill.models import resolve_model

    heads_dir = Path(cfg.heads)
    meta = read_distill_meta(heads_dir)  # not a heads folder: one line before any model loads
    check_shards(cfg.data)  # a damaged shard: likewise
    model = cfg.model
    if model is None:
        if meta.get("merged_model"):
            model = str(heads_dir / meta["merged_model"])
        elif meta.get("adapter"):
            raise ConfigError(f"{heads_dir} holds Medusa-2 heads with an unmerged adapter: train with --merge-adapter or pass --model")
        else:
            model = base_model_location(meta, heads_dir)
    resolved = resolve_model(model)
    where = stage_dtype(resolved.path, cfg.device, cfg.dtype, meta.get("teacher_dtype"), what=f"the heads in {heads_dir}")
    eagle = is_eagle3_folder(heads_dir)
    if progress is not None:
        progress.stage(f"loading {resolved.name} ({where.device}, {where.dtype})")
    if eagle:  # per draft depth, the drafter unrolled on its own features (teacher-forced tokens)
        heads = EagleDrafter.load(heads_dir, device=where.device, dtype=where.torch_dtype())
    else:
        heads = MedusaHeads.load(heads_dir, device=where.device, dtype=where.torch_dtype())
    depths = measured_depths(heads)
    check_tree_nodes(cfg.nodes, depths, cfg.ranks)
    backbone = AutoModelForCausalLM.from_pretrained(resolved.path, dtype=where.torch_dtype()).to(where.device).eval()
    if backbone.get_output_embeddings().weight.shape[0] != heads.config.vocab_size:
        raise ConfigError(f"the heads have a {heads.config.vocab_size}-token vocabulary but {resolved.name} has another: pass the right --model")
    if progress is not None:
        # the tokens ahead: the budget, or at most every input token the manifest counts (a window without a target,
        # a prompt's start, is never read: the count is settled when the data ends)
        size = sum(count_tokens(cfg.data)[k] for k in ("prompt_tokens", "generated_tokens"))
        progress.begin(total=min(cfg.max_tokens, size) if cfg.max_tokens and size else cfg.max_tokens or size or None)
    stats = held_out_accuracy(backbone, heads, cfg.data, cfg.max_len, cfg.batch_size, cfg.ranks, cfg.max_tokens, progress=progress)
    if progress is not None:
        progress.update(0, total=stats.tokens)  # what was measured is the whole of it
    if min(stats.counts) == 0:
        raise ConfigError(f"{cfg.data} has no generated token {depths + 1} positions ahead: use more held-out data")
    acc = stats.table
    nodes = cfg.nodes
    measured = acceptance(acc, nodes)
    tree, eal = measured.tree, measured.tree_length
    curve = [expected_acceptance_length(sparse_tree(acc, n), acc) for n in range(1, nodes + 1)]
    cart = best_cartesian_of_size(acc, nodes)
    cart_doc = {"spec": cart[0], "nodes": nodes, "expected_acceptance_length": cart[1]} if cart else {}
    out = Path(cfg.out) if cfg.out else heads_dir
    out.mkdir(parents=True, exist_ok=True)
    save_tree(out / "tree.json", tree, depths, accuracy=acc, expected_acceptance_length=eal, source="calibrate")
    result = CalibrationResult(out=str(out), nodes=nodes, expected_acceptance_length=eal, cartesian=cart_doc, accuracy=acc,
                               top1=stats.topk(1), positions=stats.counts, curve=curve, chain=measured.chain_length)
    doc = {"heads": str(heads_dir), "data": str(cfg.data), "model": resolved.model_id,
           "config": dict(asdict(cfg), device=where.device, dtype=where.dtype),
           "ranks": cfg.ranks, "accuracy": acc, "positions": stats.counts, "tokens": stats.tokens,
           "top1": stats.topk(1), "top5": stats.topk(5), "loss": stats.loss, "nodes": nodes,
           "expected_acceptance_length": eal, "chain_expected_acceptance_length": measured.chain_length, "cartesian": cart_doc,
           "curve": curve}
    atomic_write_json(out / CALIBRATION_FILE, doc, indent=1)
    if cfg.plots:
        plot_tree(tree, acc, out / "tree.png")
        plot_curve(curve, out / "acceptance.png", cart_doc)
    return result


def plot_tree(tree, acc, path: Path) -> None:
    """Nodes by depth (x) in tree order (y), edges parent -> child, labelled with the rank, shaded by path probability."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from distill.heads.tree import path_probability

    by_depth: dict[int, list] = {}
    for p in tree:
        by_depth.setdefault(len(p), []).append(p)
    pos = {(): (0, 0.0)}
    for d in sorted(by_depth):
        n = len(by_depth[d])
        for i, p in enumerate(by_depth[d]):
            pos[p] = (d, (i - (n - 1) / 2))
    fig, ax = plt.subplots(figsize=(2 + 2 * max(by_depth), max(4, 0.22 * max(len(v) for v in by_depth.values()))))
    for p in tree:
        (x0, y0), (x1, y1) = pos[p[:-1]], pos[p]
        ax.plot([x0, x1], [y0, y1], color="0.7", lw=0.8, zorder=1)
    probs = [path_probability(p, acc) for p in tree]
    sc = ax.scatter([pos[p][0] for p in tree], [pos[p][1] for p in tree], c=probs, cmap="viridis", s=40, zorder=2)
    for p in tree:
        ax.annotate(str(p[-1]), pos[p], fontsize=6, ha="center", va="center", color="white", zorder=3)
    ax.scatter([0], [0], c="black", s=60, zorder=2)
    ax.set_xticks(range(0, max(by_depth) + 1), ["root"] + [f"head {d}" for d in range(1, max(by_depth) + 1)])
    ax.set_yticks([])
    fig.colorbar(sc, ax=ax, label="path probability")
    ax.set_title(f"sparse tree, {len(tree)} nodes (label: rank)")
    fig.tight_layout()
    atomic_write_figure(Path(path), fig, dpi=120)
    plt.close(fig)


def plot_curve(curve: list[float], path: Path, cart: dict | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(range(1, len(curve) + 1), curve, label="greedy sparse tree")
    if cart:
        ax.scatter([cart["nodes"]], [cart["expected_acceptance_length"]], color="red", zorder=3,
                   label=f"best Cartesian {cart['spec']}")
    ax.set_xlabel("nodes")
    ax.set_ylabel("expected acceptance length (tokens/step)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    atomic_write_figure(Path(path), fig, dpi=120)
    plt.close(fig)
