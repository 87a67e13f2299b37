"""Plain vs Medusa decoding on the same prompts, in one run, with one engine.

Each prompt (the first user turn of each MT-Bench question, in the model's chat
template) is decoded at batch 1 by plain decoding and by Medusa decoding, one right
after the other (the order alternates from prompt to prompt so slow drifts of the
machine hit both alike), under each acceptance mode: ``greedy`` (temperature 0; Medusa
must reproduce plain decoding token for token) and ``typical`` (sampling at
``temperature`` with the same seed for both). See :mod:`distill.bench.stats`
for the measured quantities.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from distill.bench.config import BenchConfig
from distill.bench.stats import BenchResult, Group, Run
from distill.errors import ConfigError
from distill.models import DEFAULT_MODEL, load_chat_template
from distill.runtime import machine

log = logging.getLogger("distill.bench")


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    messages: tuple[dict, ...]


def load_prompts(spec: str, limit: int | None = None) -> list[Prompt]:
    """The first user turn (with any system message) of each seed conversation; ``limit`` round-robin over categories."""
    from distill.conversation import Conversation
    from distill.seeds import load_seed

    by_cat: dict[str, list[Prompt]] = defaultdict(list)
    for item in load_seed(spec):
        if not isinstance(item, Conversation):
            continue
        msgs = []
        for m in item.messages:
            msgs.append({"role": m.role, "content": m.content})
            if m.role == "user":
                break
        category = str((item.meta or {}).get("category") or item.source)
        by_cat[category].append(Prompt(item.id, category, tuple(msgs)))
    if not by_cat:
        raise ConfigError(f"prompts '{spec}' hold no usable conversation")
    prompts: list[Prompt] = []
    queues = [list(v) for v in by_cat.values()]
    while any(queues) and (limit is None or len(prompts) < limit):
        for q in queues:
            if q and (limit is None or len(prompts) < limit):
                prompts.append(q.pop(0))
    return prompts


def chat_ids(tokenizer, messages, chat_template: str | None = None, template_kwargs: dict | None = None) -> list[int]:
    """A prompt's token ids through the chat template (``chat_template``, else the model's) and its extra variables."""
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True,
                                         chat_template=chat_template, **(template_kwargs or {}))
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def describe_proposer(proposer) -> str:
    """What drafts, in words, for the results (the tree's source): Medusa's tree, EAGLE's dynamic tree, the lookup's
    sources, or each part of a union."""
    from distill.engine.proposers.union import Union

    if isinstance(proposer, Union):
        return " + ".join(describe_proposer(p) for p in proposer.parts) + " (their trees merged per row)"
    if proposer.name == "medusa":
        return f"medusa tree of {proposer.max_nodes} nodes ({proposer.tree.source})"
    if proposer.name == "lookup":  # a tree of up to max_nodes nodes from n-gram matches in the context
        store = f" and a datastore of {proposer.datastore.describe()}" if proposer.datastore is not None else ""
        if proposer.history is not None:
            store += f", and the replies before it in the pass (history of {proposer.history.max_tokens:,} tokens)"
        return f"lookup (n-gram matches in the context{store}, depth {proposer.depth}, up to {proposer.max_nodes} nodes)"
    return f"{proposer.name} dynamic (up to {proposer.max_nodes} nodes, depth {proposer.depth}, top-{proposer.topk})"


def break_even(engine, batch: int = 1) -> dict | None:
    """What the speculation policy weighed at ``batch`` for the full tree: the tokens per step it expects of it
    (``expected``: the proposer's acceptance table; ``expected_measured``: scaled by the acceptance the adaptive policy
    measured, when it runs) and the tokens per step at which it breaks even (``tokens_per_step``: the full tree's step
    cost over a plain step's, priced as :meth:`Engine.tree_size_for` prices it). None for an engine without a policy's
    tables."""
    from distill.engine.policy import step_cost

    try:
        nodes, taus, policy = engine.proposer.max_nodes, engine.pricing.taus, engine.policy
        if policy is not None:
            ratio, measured = policy.cost(batch, nodes) / policy.cost(batch, 0), policy.tau(nodes)
        else:
            cost = engine.pricing.cost
            ratio, measured = step_cost(batch, nodes, cost, engine.pricing.proposal) / step_cost(batch, 0, cost), None
    except AttributeError:
        return None
    if nodes not in taus:
        return None
    return {"nodes": nodes, "expected": taus[nodes], "expected_measured": measured, "tokens_per_step": ratio}


class _Lines:
    """The calls of a :class:`distill.progress.Progress` told as message lines to ``say(message)`` (or to nobody)."""

    def __init__(self, say: Callable[[str], None] | None):
        self.say = say or (lambda message: None)
        self.done, self.total, self.unit = 0, None, ""

    def stage(self, message: str) -> None:
        self.say(message)

    def begin(self, total: int | None = None, done: int | None = None, unit: str | None = None) -> None:
        self.total, self.done, self.unit = total, done or 0, unit or self.unit

    def update(self, advance: int = 1, tokens: int = 0, total: int | None = None, fields: dict | None = None) -> None:
        self.done += advance
        self.say(f"{self.done}/{self.total} {self.unit}")


def _progress(progress):
    """``progress`` as a :class:`distill.progress.Progress`-like object: itself, or a ``say(message)`` callable wrapped."""
    return progress if hasattr(progress, "update") and hasattr(progress, "stage") else _Lines(progress)


class BenchRunner:
    """Loads the engine once; :meth:`run` measures every prompt in every mode, :meth:`sweep` the tree sizes."""

    def __init__(self, config: BenchConfig, engine=None, progress=None, baseline=None):
        """``baseline``: a :class:`~distill.bench.baseline.VllmBaseline` to use for ``--vllm`` (default: started here).

        ``progress``: a :class:`distill.progress.Progress` (prompts done per pass, stage lines), or a callable
        that takes message lines."""
        from distill.engine import Engine

        self.config = config
        self.progress = _progress(progress)
        if engine is None:
            self.progress.stage(f"loading {config.model or DEFAULT_MODEL} with {config.heads}")
            engine = Engine.from_pretrained(config.model, config.heads, config.decoding)
            self.progress.stage(f"warming up the engine on {engine.device}" + (" (compiling)" if engine.compile else ""))
            engine.warmup()  # compiles first (--compile): no run is timed with the compiler in it
        if engine.proposer is None:
            raise ConfigError("the benchmark compares plain and speculative (Medusa, EAGLE or lookup) decoding: "
                              "pass --heads DIR or --heads lookup")
        self.engine = engine
        self.baseline = baseline
        if config.vllm and baseline is None:
            from distill.bench.baseline import VllmBaseline
            from distill.models import context_limit, resolve_model

            self.progress.stage("starting bare vLLM for the --vllm baseline")
            self.baseline = VllmBaseline.start(resolve_model(config.model).path, str(engine.dtype).removeprefix("torch."),
                                               engine.device.type, context_limit(engine.model.config), config.seed)
        if self.baseline is not None:
            self.baseline.check_stops(engine.stop_ids)

    def _vllm(self, prompt: Prompt, ids: list[int]) -> Run:
        tokens, wall, finish = self.baseline.generate(ids, self.config.max_tokens)
        return Run(prompt_id=prompt.id, category=prompt.category, mode="vllm", acceptance="greedy", prompt_tokens=len(ids),
                   tokens=len(tokens), step_tokens=0, steps=0, step_seconds=0.0, prefill_seconds=0.0, wall_seconds=wall,
                   finish_reason=finish, token_ids=tokens)

    def _one(self, prompt: Prompt, ids: list[int], acceptance: str, speculative: bool, seed: int) -> Run:
        from distill.engine import SamplingParams

        cfg = self.config
        temp = 0.0 if acceptance == "greedy" else cfg.temperature
        params = SamplingParams(max_tokens=cfg.max_tokens, temperature=temp, seed=seed)
        t0 = time.perf_counter()
        (res,), stats = self.engine.generate([ids], [params], speculative=speculative)
        wall = time.perf_counter() - t0
        return Run(
            prompt_id=prompt.id, category=prompt.category, mode="medusa" if speculative else "plain", acceptance=acceptance,
            prompt_tokens=len(ids), tokens=len(res.token_ids), step_tokens=sum(res.accepted), steps=len(res.accepted),
            step_seconds=sum(stats.step_seconds), prefill_seconds=stats.prefill_seconds, wall_seconds=wall,
            finish_reason=res.finish_reason, token_ids=list(res.token_ids),
        )

    def run(self) -> BenchResult:
        return self.run_with([])[0]

    def run_with(self, others: Sequence["BenchRunner"]) -> list[BenchResult]:
        """This runner's proposer and each of ``others``' (their engines: the same model, other proposers) on the same
        prompts in one pass: per prompt, plain decoding (this engine's), each proposer and bare vLLM (this runner's
        baseline) in turn, each first as often as the others. Plain decoding and vLLM run once per prompt and count
        for every proposer's result -> one result per runner, this one's first."""
        cfg = self.config
        check_one_pass([cfg, *(other.config for other in others)])
        runners = [self, *others]
        prompts = load_prompts(cfg.prompts, cfg.limit)
        tok = self.engine.tokenizer
        template = load_chat_template(cfg.chat_template)
        encoded = [chat_ids(tok, p.messages, template, cfg.chat_template_kwargs) for p in prompts]
        if cfg.warmup:
            self.progress.stage(f"{cfg.warmup} untimed warm-up run{'s' if cfg.warmup > 1 else ''} of each decoding")
        for _ in range(cfg.warmup):  # untimed: first calls pay for allocations and lazy init
            self._one(prompts[0], encoded[0], "greedy", False, cfg.seed)
            for r in runners:
                r._one(prompts[0], encoded[0], "greedy", True, cfg.seed)
            if self.baseline is not None:
                self._vllm(prompts[0], encoded[0])
        runs: list[list[Run]] = [[] for _ in runners]  # per runner; plain and vLLM runs in each
        for acceptance in cfg.modes:
            for r in runners:  # each pass starts from none: no prompt drafts from its own warm-up or earlier reply
                r._forget()
            self.progress.begin(total=len(prompts), done=0, unit=f"{acceptance} prompts")
            for i, (p, ids) in enumerate(zip(prompts, encoded)):
                order: list[tuple[str, int | None]] = [("plain", None), *(("medusa", k) for k in range(len(runners)))]
                if acceptance == "greedy" and self.baseline is not None:
                    order.append(("vllm", None))
                shift = i % len(order)  # each engine goes first as often as the others
                tokens = 0
                for mode, k in order[shift:] + order[:shift]:
                    if mode == "vllm":
                        run = self._vllm(p, ids)
                    else:
                        run = (self if k is None else runners[k])._one(p, ids, acceptance, mode == "medusa", cfg.seed + i)
                    tokens += run.tokens
                    for j, mine in enumerate(runs):
                        if k is None or k == j:
                            mine.append(run)
                self.progress.update(1, tokens=tokens)  # every decoding's tokens
        return [r._result(mine, prompts, encoded) for r, mine in zip(runners, runs)]

    def _forget(self) -> None:
        """Empty the lookup proposer's history of earlier replies (other proposers keep none)."""
        forget = getattr(self.engine.proposer, "forget", None)
        if forget is not None:
            forget()

    def _result(self, runs: list[Run], prompts: list[Prompt], encoded: list[list[int]]) -> BenchResult:
        cfg = self.config
        groups = summarize(runs)
        proposer = self.engine.proposer
        nodes, source = proposer.max_nodes, describe_proposer(proposer)
        full_tree = self._tree_acceptance(prompts, encoded) if cfg.tree_acceptance and not cfg.full_tree else None
        return BenchResult(
            config=dict(cfg.to_dict(), device=str(self.engine.device), dtype=str(self.engine.dtype).removeprefix("torch."),
                        cuda_graphs=self.engine.graphs is not None),
            machine=machine(str(self.engine.device)), date=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            model=self.engine.model_name, heads=str(cfg.heads),
            tree={"nodes": nodes, "source": source, "proposer": proposer.name, "depth": getattr(proposer, "depth", None),
                  "nodes_used_at_batch_1": self.engine.tree_size_for(1) if hasattr(self.engine, "tree_size_for") else None,
                  "break_even_at_batch_1": break_even(self.engine, 1),
                  "full_tree_tokens_per_step": full_tree,
                  "step_costs": costs.to_dict() if (costs := getattr(self.engine, "step_costs", None)) is not None else None,
                  "step_costs_kept_in": costs.source if costs is not None else None},  # None: timed at this start
            groups=groups, runs=runs,
        )

    def _tree_acceptance(self, prompts: list[Prompt], encoded: list[list[int]]) -> float:
        """Tokens per step of the whole tree on the greedy prompts (untimed; the lookup's history forgotten first, as
        before each timed pass)."""
        self._forget()
        self.progress.begin(total=len(prompts), done=0, unit="prompts with the full tree")
        tokens = steps = 0
        with self.engine.full_tree():
            for i, (p, ids) in enumerate(zip(prompts, encoded)):
                run = self._one(p, ids, "greedy", True, self.config.seed + i)
                tokens, steps = tokens + run.step_tokens, steps + run.steps
                self.progress.update(1, tokens=run.tokens)
        return tokens / max(steps, 1)

    def sweep(self):
        """The tree-size sweep (:mod:`distill.bench.sweep`) on this engine's model and heads."""
        from distill.bench.sweep import sweep_tree_sizes

        cfg = self.config
        if self.engine.tree is None:
            raise ConfigError("--sweep-tree sweeps Medusa's static trees; an EAGLE or lookup tree is drafted per step "
                              "(size it with the engine's draft_nodes)")
        acc, source = accuracy_table(Path(cfg.heads), self.engine.heads.config.num_heads)
        return sweep_tree_sizes(self.engine.model, self.engine.heads, acc, cfg.sweep_nodes, cfg.sweep_context,
                                cfg.sweep_repeats, source)


def accuracy_table(heads: Path, num_heads: int) -> tuple[list[list[float]], str]:
    """The calibrated accuracy table of a heads folder (its tree.json), else the engine's default table."""
    from distill.engine.tree import default_accuracy
    from distill.heads.tree import load_tree

    tree_file = Path(heads) / "tree.json"
    if tree_file.is_file():
        doc = load_tree(tree_file)
        if doc.get("accuracy"):
            return [list(map(float, r)) for r in doc["accuracy"]], f"calibrated ({tree_file})"
    return default_accuracy(num_heads), "default (uncalibrated: distill.engine.tree.default_accuracy; run `distill calibrate`)"


def summarize(runs: list[Run]) -> list[Group]:
    """Per acceptance mode: one group per category and one over all prompts (``category == "all"``)."""
    groups = []
    for acceptance in dict.fromkeys(r.acceptance for r in runs):
        mine = [r for r in runs if r.acceptance == acceptance]
        cats = list(dict.fromkeys(r.category for r in mine))
        for cat in cats + ["all"]:
            sel = [r for r in mine if cat == "all" or r.category == cat]
            groups.append(Group.of(acceptance, cat, [r for r in sel if r.mode == "plain"], [r for r in sel if r.mode == "medusa"],
                                   [r for r in sel if r.mode == "vllm"]))
    return groups


def check_one_pass(configs: Sequence[BenchConfig]) -> None:
    """Benchmarks measured in one pass decode the same prompts the same way, or it is a one-line error."""
    def shared(c: BenchConfig) -> tuple:
        return c.prompts, c.limit, c.max_tokens, c.modes, c.temperature, c.seed, c.chat_template, c.chat_template_kwargs

    if any(shared(c) != shared(configs[0]) for c in configs[1:]):
        raise ConfigError("benchmarks run in one pass must share their prompts, limit, max_tokens, modes, temperature, "
                          "seed and chat template")


def run_benches(configs: Sequence[BenchConfig], progress=None) -> list[tuple[BenchResult, dict[str, Path]]]:
    """Several proposers (one config each, the same model and prompts) against plain decoding in one interleaved pass
    (:meth:`BenchRunner.run_with`): plain decoding and bare vLLM (the first config's ``vllm``) run once per prompt for
    all of them. Each result is written into its config's ``out``."""
    from distill.bench.report import write_all

    check_one_pass(configs)  # before any engine loads
    first = BenchRunner(configs[0], progress=progress)
    others = [BenchRunner(c, progress=progress, baseline=first.baseline) for c in configs[1:]]  # one vLLM, the first's
    results = first.run_with(others)
    return [(result, write_all(result, Path(c.out))) for result, c in zip(results, configs)]


def run_bench(config: BenchConfig, progress=None, engine=None, baseline=None) -> tuple[BenchResult, dict[str, Path]]:
    """Plain vs Medusa (and bare vLLM, and the tree-size sweep, when asked); writes the artifacts into ``config.out``."""
    from distill.bench.report import write_all, write_tree

    runner = BenchRunner(config, engine=engine, progress=progress, baseline=baseline)
    result = runner.run()
    if config.sweep_tree:
        runner.progress.stage("timing the tree-size sweep")
        result.sweep = runner.sweep()
    paths = write_all(result, Path(config.out))
    if result.sweep is not None and result.sweep.best_nodes > 0:
        paths["tree"] = Path(config.out) / "tree.json"
        write_tree(result.sweep, paths["tree"], runner.engine.heads.config.num_heads)
    return result, paths
