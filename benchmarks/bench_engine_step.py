"""The engine's own step against bare vLLM: plain decoding tok/s side by side, verification step cost, profile.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_engine_step.py --out benchmarks/results/engine_step.json

One process, one machine (named in the output), float32, greedy, the bundled model unless --model:

plain decoding
    the first ``--prompts`` MT-Bench first turns (chat template) at batch 1, one request after
    the other, and the first ``--batch`` turns in one batch, ``--max-tokens`` new tokens each,
    decoded by ``distill.engine.Engine`` (``speculative=False``) and by bare vLLM
    (``vllm.LLM``: in-process engine core, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, its forward compiled as
    vLLM's server compiles it (``--vllm-eager``: ``enforce_eager``, the forward op by op as ours runs),
    ``detokenize=False``, the same prompt token ids and max tokens). The two engines alternate
    for ``--rounds`` rounds (vLLM first in even rounds, ours first in odd ones), so machine
    noise hits both alike; tok/s = generated tokens / wall seconds of the whole call (prefill
    included); the ratio is ours / vLLM per round, and its median is reported.
steady step
    each engine's decoding step alone, prefill excluded: every setting is also decoded to
    ``--max-tokens`` and to a quarter of it with EOS ignored, and a step's milliseconds are the
    difference of the two calls' seconds over the difference of their steps (medians over rounds).
verification step cost
    the engine's step with a tree of N nodes (``--nodes``; N = 0 is the plain step) over the
    first prompt, its proposal replaced by fixed tokens so that only verification is timed
    (tree bias, one forward over N + 1 tokens, acceptance, compaction, the host transfer).
    Sizes run round-robin for ``--rounds`` rounds; median step seconds per size; ratio = t(N) / t(0).
    The Medusa heads' proposal (4 random heads with a shared LM head) is timed on its own.
profile (``--profile``)
    torch.profiler over ``--profile-steps`` plain and 16- and 64-node verification steps: CPU
    milliseconds per step in the engine's labelled phases (``distill.*`` record_function
    ranges: propose, mask, forward, accept, compact, host) and, inside the model forward,
    matrix multiplies, attention, cache writes, other ops and the Python left over.
memory
    the process's peak RSS growth while our engine loads and runs (measured first), then
    while vLLM loads and runs; the engine's KV bytes per token.

``--no-vllm`` skips vLLM (step costs and profile only). ``--compile`` runs the engine compiled
(see ``EngineConfig.compile``). ``--device`` / ``--dtype`` as the CLI's (auto: distill.runtime's rule);
``--cuda-graphs on|off`` (auto: on for CUDA, ``EngineConfig.cuda_graphs``). ``--eagle-nodes N ...`` adds
EAGLE steps with a random drafter (fusing the default aux layers, full vocabulary): each step drafts a
dynamic tree of N nodes and verifies it, so its time is the drafter's proposal plus the verification.
``--random-weights`` builds the model from its config.json with random weights (step costs do not depend
on the weights: for a machine the weights cannot travel to, e.g. the GPU machine of BENCHMARKS.md).
``--shape llama-2-7b`` gives that random model Llama-2-7B's width and depth (the tokenizer's vocabulary is
kept), initialised on the device itself, nothing written to disk: the step costs of a 7B target.

On CUDA the engine syncs once per step (the host transfer), so the step times are the GPU's.

    python benchmarks/bench_engine_step.py --no-vllm --device cuda --dtype bfloat16 --cuda-graphs off --label h200-eager
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import platform
import resource
import statistics
import subprocess
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from distill.runtime import machine  # noqa: E402
from distill.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from distill.engine.config import ATTENTIONS  # noqa: E402
from distill.engine.target import Target  # noqa: E402
from bench_batching import mt_bench_prompts  # noqa: E402  (one MT-Bench first-turn prompt set for the engine benches)
from distill.store.atomic import atomic_write_bytes  # noqa: E402

MATMUL = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "mkl::", "mkldnn::", "_C::onednn_mm")
ATTENTION = ("scaled_dot_product", "flash_attention", "aten::_efficient_attention", "aten::baddbmm", "aten::softmax")
CACHE = ("aten::scatter_", "aten::index_copy_", "aten::cat")


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cpu_description() -> dict:
    info = {"machine": machine(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__}
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in lscpu.splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("Model name", "CPU family", "Model", "CPU(s)", "L3"):
                info[key.strip()] = value.strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    import transformers

    info["transformers"] = transformers.__version__
    return info


# -- plain decoding, ours and vLLM's ------------------------------------------------------------------
def ours(engine: Engine, prompts: list[list[int]], max_tokens: int, batch: int,
         ignore_eos: bool = False) -> tuple[int, float, list[list[int]]]:
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
    t0 = time.perf_counter()
    outs = []
    for lo in range(0, len(prompts), batch):
        res, _ = engine.generate(prompts[lo : lo + batch], sp, speculative=False)
        outs += [r.token_ids for r in res]
    return sum(map(len, outs)), time.perf_counter() - t0, outs


def vllm_llm(model_path: str, speculative_config: dict | None = None, eager: bool = True):
    """vLLM for the in-process comparisons. Their rounds resend the same prompts, so prefix caching is off: with it,
    every round after the first would skip the prompts' prefill, which no served prompt sent once does. ``eager``
    False: its forward compiled, as its server runs it."""
    from vllm import LLM

    extra = {"speculative_config": speculative_config} if speculative_config else {}
    return LLM(model=model_path, dtype="float32", enforce_eager=eager, seed=0, max_model_len=2048,
               enable_prefix_caching=False, **extra)


def vllm(llm, prompts: list[list[int]], max_tokens: int, batch: int, stop_ids: list[int]) -> tuple[int, float, list[list[int]]]:
    from vllm import SamplingParams as VSP
    from vllm.inputs import TokensPrompt

    sp = VSP(temperature=0.0, max_tokens=max_tokens, detokenize=False, stop_token_ids=stop_ids, ignore_eos=not stop_ids)
    t0 = time.perf_counter()
    outs = []
    for lo in range(0, len(prompts), batch):
        res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts[lo : lo + batch]], sp, use_tqdm=False)
        outs += [list(r.outputs[0].token_ids) for r in res]
    return sum(map(len, outs)), time.perf_counter() - t0, outs


def steady_step_ms(engine: Engine, llm, prompts: list[list[int]], max_tokens: int, rounds: int) -> dict:
    """Each engine's decoding step without its prefill (module docstring, "steady step") -> ms per step, medians."""
    short = max(2, max_tokens // 4)
    runs = {"ours": lambda n: ours(engine, prompts, n, len(prompts), ignore_eos=True)[1]}
    if llm is not None:
        runs["vllm"] = lambda n: vllm(llm, prompts, n, len(prompts), [])[1]
    got: dict = defaultdict(list)
    for r in range(rounds):
        for who, run in (runs.items() if r % 2 == 0 else reversed(runs.items())):
            got[who].append(1000 * (run(max_tokens) - run(short)) / (max_tokens - short))
    out = {f"{who}_step_ms": statistics.median(v) for who, v in got.items()}
    if "vllm_step_ms" in out:
        out["vllm_over_ours"] = out["vllm_step_ms"] / out["ours_step_ms"]
    return out | {"rounds": dict(got), "tokens": [short, max_tokens]}


def profile_batch(engine: Engine, llm, prompts: list[list[int]], steps: int) -> dict:
    """Both engines' breakdowns of plain decoding of ``prompts`` in one batch (torch profiler; vLLM's engine core runs in
    this process): the self CPU ms of each op per decoding step (a run of ``steps`` + 1 tokens less a run of 1, over
    ``steps``), and of the prefill (the run of 1)."""
    from vllm import SamplingParams as VSP
    from vllm.inputs import TokensPrompt

    def run_vllm(n: int) -> None:
        sp = VSP(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)

    def run_ours(n: int) -> None:
        engine.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True), speculative=False)

    out = {"batch": len(prompts), "steps": steps}
    for name, run in (("ours", run_ours), ("vllm", run_vllm)):
        out[name] = breakdown(run, steps)
        print(f"{name} per decoding step (ms):", out[name]["per_step_ms"])
    return out


def breakdown(run, steps: int) -> dict:
    from collections import defaultdict

    from torch.profiler import ProfilerActivity, profile

    def ops(n: int) -> dict[str, float]:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run(n)
        out: dict[str, float] = defaultdict(float)
        for ev in prof.events():
            out[ev.name] += ev.self_cpu_time_total / 1000
        return out

    first, many = ops(1), ops(steps + 1)
    per_step = {k: (v - first.get(k, 0.0)) / steps for k, v in many.items()}
    top = sorted(per_step.items(), key=lambda kv: -kv[1])[:12]
    return {"per_step_ms": {k: round(v, 2) for k, v in top},
            "prefill_ms": {k: round(v, 1) for k, v in sorted(first.items(), key=lambda kv: -kv[1])[:8]}}


def same_prefix(a: list[list[int]], b: list[list[int]]) -> list[int]:
    """Per sequence: how many leading tokens two greedy decodings share."""
    out = []
    for x, y in zip(a, b):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        out.append(n)
    return out


# -- verification steps --------------------------------------------------------------------------------
def fixed_proposal(engine: Engine) -> None:
    """Replace the proposer's work by fixed tokens (root, then ids 1..N): only verification is left to time."""

    def tree_tokens(hidden, root, buf):
        tokens = torch.arange(buf.size, device=root.device)[None].repeat(root.shape[0], 1)  # (B, T)
        tokens[:, 0] = root
        return tokens

    if hasattr(engine.proposer, "tree_tokens"):  # the proposer interface (engine/proposers/base.py): Medusa's token layout
        engine.proposer.tree_tokens = tree_tokens
    elif hasattr(engine, "proposer"):  # the proposer before the interface
        engine.proposer.propose = tree_tokens
    else:  # the engine before the proposer class
        engine._propose = tree_tokens


def label_old_engine(engine: Engine) -> None:
    """The engine before this benchmark had no distill.* ranges: wrap its phases in them (profile only)."""
    from torch.profiler import record_function

    from distill.engine import cache as kv

    def wrap(fn, name):
        def run(*a, **k):
            with record_function(name):
                return fn(*a, **k)
        return run

    engine._prefill = wrap(engine._prefill, "distill.prefill")
    engine._forward = wrap(engine._forward, "distill.forward")
    engine._accept = wrap(engine._accept, "distill.accept")
    engine._propose = wrap(engine._propose, "distill.propose")
    if not getattr(kv, "_labelled", False):
        kv.step_mask = wrap(kv.step_mask, "distill.mask")
        kv.commit = wrap(kv.commit, "distill.compact")
        kv._labelled = True


def random_heads(model, num_heads: int = 4):
    from distill.heads import HeadsConfig, MedusaHeads
    from distill.heads.model import TRAINED_FC_BIAS

    lm = model.get_output_embeddings().weight.detach()
    torch.manual_seed(0)
    heads = MedusaHeads(HeadsConfig(lm.shape[1], lm.shape[0], num_heads=num_heads, share_lm_head=True, bias=TRAINED_FC_BIAS), lm_head_weight=lm)
    return heads.to(device=lm.device, dtype=lm.dtype).eval()


def random_drafter(model):
    """An EAGLE-3 drafter of the model's width (default aux layers, full vocabulary), initialised as training starts."""
    from distill.heads.eagle import DrafterConfig, EagleDrafter, default_aux_layers
    from distill.heads.vocab import DraftVocab

    cfg = model.config.to_dict()
    torch.manual_seed(0)
    vocab = DraftVocab.full(cfg["vocab_size"])
    drafter = EagleDrafter(DrafterConfig.for_target(cfg, default_aux_layers(cfg["num_hidden_layers"]), vocab.size), vocab)
    drafter.init_from_target(model.get_output_embeddings().weight.detach().float().cpu(), model.get_decoder().norm.weight.detach().float().cpu())
    p = next(model.parameters())
    return drafter.to(device=p.device, dtype=p.dtype).eval()


def eagle_engines(base: Engine, nodes: list[int], depth: int) -> dict[int, Engine]:
    """One EAGLE engine per node budget, whole tree every step (random drafter: the step is proposal + verification)."""
    drafter = random_drafter(base.model)
    return {n: Engine(base.model, base.tokenizer, drafter, EngineConfig(draft_nodes=n, draft_depth=depth, speculate_max_batch=1,
                                                                         max_batch=1, cuda_graphs=base.graphs is not None),
                      model_name=base.model_name) for n in nodes}


def random_weights_model(folder: str | None, dtype: torch.dtype | None = None) -> str:
    """A copy of the model folder (config, tokenizer) with random weights in place of its own; -> its path.
    ``dtype``: the weights saved in it, and the config's dtype (None: as the config says)."""
    import shutil
    import tempfile

    from transformers import AutoConfig, AutoModelForCausalLM

    from distill.models import resolve_model

    src = resolve_model(folder).path
    dst = Path(tempfile.mkdtemp(prefix="random-weights-"))
    for f in Path(src).iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".bin")) and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(src)
    if dtype is not None:
        config.dtype = dtype
    model = AutoModelForCausalLM.from_config(config)
    (model.to(dtype) if dtype is not None else model).save_pretrained(dst)
    return str(dst)


#: Llama-2-7B's shape (hidden 4096, 32 layers, 32 heads of 128, MLP 11008, untied LM head), for ``--shape``.
SHAPES = {"llama-2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                             num_key_value_heads=32, head_dim=128, tie_word_embeddings=False, max_position_embeddings=4096)}


def shaped_engine(folder: str | None, shape: str, config: EngineConfig, layers: int | None = None) -> Engine:
    """An engine over a random model of ``SHAPES[shape]`` with the folder's tokenizer and vocabulary, built on the
    configured device in its dtype (a 7B model is never materialised in float32 or saved)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from distill.models import resolve_model
    from distill.runtime import stage_dtype

    src = resolve_model(folder)
    where = stage_dtype(src.path, config.device, config.dtype, None, what="the shaped model")
    config = dataclasses.replace(config, device=where.device, dtype=where.dtype)
    lm_config = AutoConfig.from_pretrained(src.path)
    for key, value in {**SHAPES[shape], **({"num_hidden_layers": layers} if layers else {})}.items():
        setattr(lm_config, key, value)
    torch.manual_seed(0)
    with torch.device(config.device):
        lm = AutoModelForCausalLM.from_config(lm_config, dtype=config.torch_dtype).eval()
    return Engine(lm, AutoTokenizer.from_pretrained(src.path), None, config, model_name=f"{src.name} as {shape}, random")


def tree_engines(base: Engine, nodes: list[int], heads) -> dict[int, Engine]:
    """One engine per tree size, all forced to use their whole tree (sparse-N under the default accuracy).
    Their steps are multi-token forwards, which run eager under --compile too: only ``base`` compiles."""
    out = {0: base}
    for n in nodes:
        cfg = EngineConfig(tree=f"sparse-{n}", speculate_max_batch=1, max_batch=1, cuda_graphs=base.graphs is not None)
        out[n] = Engine(base.model, base.tokenizer, heads, cfg, model_name=base.model_name)
        fixed_proposal(out[n])
    return out


def step_costs(engines: dict[int, Engine], prompt: list[int], steps: int, rounds: int, tree_nodes: bool = True) -> dict[int, float]:
    """Median step seconds per tree size (round 0 warms up; each run's first step is left out).
    ``tree_nodes``: check each step verified exactly n nodes (a dynamic tree may hold fewer)."""
    times: dict[int, list[float]] = defaultdict(list)
    sp = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    for r in range(rounds + 1):
        for n, eng in engines.items():
            _, st = eng.generate([prompt], sp, speculative=n > 0)
            assert st.tree_nodes == n or (not tree_nodes and 0 < st.tree_nodes <= n), (n, st.tree_nodes)
            if r:  # round 0 warms up
                times[n] += st.step_seconds[1:]
    return {n: statistics.median(ts) for n, ts in times.items()}


def proposal_ms(engines: dict[int, Engine], heads, rounds: int = 20) -> dict[int, float]:
    """Median milliseconds of the heads' proposal alone per tree size (batch 1)."""
    from distill.engine.proposers.medusa import Medusa

    out = {}
    H = heads.config.hidden_size
    p = next(heads.parameters())
    hidden = torch.randn(1, H, dtype=p.dtype, device=p.device)
    root = torch.zeros(1, dtype=torch.long, device=p.device)
    sync = torch.cuda.synchronize if p.device.type == "cuda" else (lambda: None)
    with torch.inference_mode():
        for n, eng in engines.items():
            if not n:
                continue
            med = Medusa(heads, eng.tree, eng.device)
            buf = med.buffers(n)
            ts = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                med.tree_tokens(hidden, root, buf)
                sync()
                ts.append(time.perf_counter() - t0)
            out[n] = 1000 * statistics.median(ts)
    return out


# -- profile --------------------------------------------------------------------------------------------
def op_kind(name: str) -> str:
    if any(name.startswith(p) or p in name for p in MATMUL):
        return "matmul"
    if any(p in name for p in ATTENTION):
        return "attention"
    if any(name.startswith(p) for p in CACHE):
        return "cache write"
    return "other ops"


def profile_steps(engine: Engine, prompt: list[int], nodes: int, steps: int) -> dict:
    """CPU ms per step by phase (distill.* ranges) and, inside the forward, by kind of op."""
    from torch.profiler import ProfilerActivity, profile

    sp = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    if not hasattr(engine, "proposer"):
        label_old_engine(engine)
    engine.generate([prompt], sp, speculative=nodes > 0)  # warm
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _, st = engine.generate([prompt], sp, speculative=nodes > 0)
    n = st.steps
    phases: dict[str, float] = defaultdict(float)
    inside: dict[str, float] = defaultdict(float)
    for ev in prof.events():
        labels, p = [], ev.cpu_parent
        while p is not None:
            if p.name.startswith("distill."):
                labels.append(p.name)
            p = p.cpu_parent
        if "distill.prefill" in labels or ev.name == "distill.prefill":
            continue
        if ev.name.startswith("distill."):
            if not labels:  # outermost phase ranges only
                phases[ev.name[len("distill."):]] += ev.cpu_time_total / 1000 / n
        elif labels and labels[0] == "distill.forward":
            inside[op_kind(ev.name)] += ev.self_cpu_time_total / 1000 / n  # self time: nested ops are not counted twice
    inside["python and dispatch"] = max(phases.get("forward", 0.0) - sum(inside.values()), 0.0)
    mean_ms = 1000 * sum(st.step_seconds) / n
    return {"nodes": nodes, "steps": n, "step_ms_median": 1000 * statistics.median(st.step_seconds), "step_ms_mean": mean_ms,
            "phases_ms": dict(phases), "forward_ms": dict(inside), "unlabelled_ms": max(mean_ms - sum(phases.values()), 0.0)}


def report(runs: dict) -> str:
    """Markdown tables of the runs in a results file (one column per label)."""
    labels = list(runs)
    lines = ["| | " + " | ".join(labels) + " |", "| --- |" + " --- |" * len(labels)]

    def row(name, get):
        cells = []
        for lab in labels:
            try:
                cells.append(get(runs[lab]))
            except (KeyError, IndexError, TypeError, StopIteration):
                cells.append("-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")

    for i, setting in enumerate(("batch 1", "batch 8")):
        row(f"{setting}: vLLM tok/s", lambda r, i=i: f"{r['plain'][i]['vllm_tok_s']:.1f}")
        row(f"{setting}: ours tok/s", lambda r, i=i: f"{r['plain'][i]['ours_tok_s']:.1f}")
        row(f"{setting}: ours / vLLM (median of rounds)", lambda r, i=i: f"**{r['plain'][i]['ratio_median']:.2f}x** "
            f"({min(x['ratio'] for x in r['plain'][i]['rounds']):.2f}-{max(x['ratio'] for x in r['plain'][i]['rounds']):.2f})")
    row("linears with vLLM's CPU matmul / all", lambda r: f"{r['linear_prep']['packed_vllm']} / "
        f"{sum(v for k, v in r['linear_prep'].items() if k.startswith('single_'))}")
    nodes = sorted({int(n) for r in runs.values() for n in r.get("step_cost", {}).get("step_ms", {})})
    for n in nodes:
        row(f"step ms, {n} nodes" if n else "step ms, plain", lambda r, n=n: f"{r['step_cost']['step_ms'][str(n)]:.1f}")
    for n in nodes:
        if n:
            row(f"verification / plain step, {n} nodes", lambda r, n=n: f"{r['step_cost']['ratio'][str(n)]:.2f}x")
    lines.append("")
    for lab in labels:
        for prof in runs[lab].get("profile", []):
            lines.append(f"{lab}, {prof['nodes']} nodes: step {prof['step_ms_mean']:.1f} ms = "
                         + ", ".join(f"{k} {v:.2f}" for k, v in sorted(prof["phases_ms"].items(), key=lambda kv: -kv[1]))
                         + f", unlabelled {prof['unlabelled_ms']:.2f}; forward = "
                         + ", ".join(f"{k} {v:.2f}" for k, v in sorted(prof["forward_ms"].items(), key=lambda kv: -kv[1])))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", type=int, default=3, help="batch-1 prompts (MT-Bench first turns)")
    ap.add_argument("--batch", type=int, default=8, help="the batched run's batch size (0: skip it)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--first", type=int, default=0, help="the prompt sets start at this MT-Bench question (40: the c = 16 "
                    "level of bench_vs_vllm.py --prompts-per-level 16,24,40, with its long prompts)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--nodes", type=int, nargs="*", default=[2, 16, 64])
    ap.add_argument("--steps", type=int, default=12, help="steps per verification timing run")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--profile-steps", type=int, default=8)
    ap.add_argument("--profile-batch", action="store_true", help="both engines' per-op breakdown of the batched run's steps")
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--compile", action="store_true", help="EngineConfig(compile=True)")
    ap.add_argument("--vllm-eager", action="store_true", help="vLLM with enforce_eager (default: compiled, as its server)")
    ap.add_argument("--attention", choices=ATTENTIONS, default="auto", help="EngineConfig(attention=...): sdpa for the "
                    "engine without vLLM's attention kernel")
    ap.add_argument("--no-fuse", action="store_true", help="every linear its own product (the engine without the fusion)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--cuda-graphs", choices=("auto", "on", "off"), default="auto")
    ap.add_argument("--eagle-nodes", type=int, nargs="*", default=[], help="EAGLE step costs with a random drafter")
    ap.add_argument("--eagle-depth", type=int, default=5)
    ap.add_argument("--random-weights", action="store_true", help="the model's config with random weights")
    ap.add_argument("--shape", choices=sorted(SHAPES), help="a random model of this shape (implies --random-weights)")
    ap.add_argument("--layers", type=int, help="--shape with this many decoder layers (a smoke test on a small machine)")
    ap.add_argument("--label", default="", help="a name for this run in the JSON (e.g. before / after)")
    ap.add_argument("--out", default="benchmarks/results/engine_step.json", help="JSON file of runs by --label (the entry is replaced)")
    ap.add_argument("--report", metavar="JSON", help="print markdown tables of a results file and exit")
    args = ap.parse_args()
    if args.report:
        print(report(json.loads(Path(args.report).read_text())))
        return

    result: dict = {"label": args.label, "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                    "cpu": cpu_description(), "load_average_start": os.getloadavg(), "args": vars(args)}
    print(json.dumps(result["cpu"]))
    rss0 = peak_rss_mib()
    extra = {"compile": True} if args.compile else {}
    if args.cuda_graphs != "auto":
        extra["cuda_graphs"] = args.cuda_graphs == "on"
    config = EngineConfig(max_batch=max(args.batch, 1), device=args.device, dtype=args.dtype, attention=args.attention, **extra)
    if args.no_fuse:  # no example forward: prepare_linears finds no linears that read one input
        Target._example = lambda self: None
    if args.shape:
        engine = shaped_engine(args.model, args.shape, config, args.layers)
    else:
        model = random_weights_model(args.model) if args.random_weights else args.model
        engine = Engine.from_pretrained(model, None, config)
    result["engine"] = {"device": str(engine.device), "dtype": str(engine.dtype).replace("torch.", ""),
                        "cuda_graphs": engine.graphs is not None, "random_weights": args.random_weights or bool(args.shape),
                        "shape": args.shape, "parameters": sum(p.numel() for p in engine.model.parameters())}
    if engine.device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(engine.device)
        torch.cuda.reset_peak_memory_stats(engine.device)
    print(json.dumps(result["engine"]), result.get("gpu", ""))
    prompts = mt_bench_prompts(engine.tokenizer, args.first + max(args.prompts, args.batch))[args.first :]
    one, many = prompts[: args.prompts], prompts[: args.batch]
    engine.warmup()  # --compile: compiled here, before anything is timed
    ours(engine, one[:1], args.max_tokens, 1)  # warm-up
    kv_mib = None
    if args.batch:
        _, st = engine.generate(many, SamplingParams(max_tokens=args.max_tokens), speculative=False)
        kv_mib = getattr(st, "kv_bytes", 0) / 2**20 or None
    rss1 = peak_rss_mib()
    memory = {"ours_peak_rss_growth_mib": rss1 - rss0, "ours_rss_mib": rss_mib(), "weights_mib": sum(
        {id(p): p.numel() * p.element_size() for p in engine.model.parameters()}.values()) / 2**20,
        f"ours_kv_cache_mib_batch_{args.batch}": kv_mib}
    if hasattr(engine, "kv_shape"):
        memory["kv_bytes_per_token"] = engine.kv_shape.slot_bytes
    if engine.device.type == "cuda":
        memory["ours_cuda_peak_allocated_mib"] = torch.cuda.max_memory_allocated(engine.device) / 2**20
    result["linear_prep"] = getattr(engine, "linear_prep", None)  # packed kinds and single-row kernels (engine.cpu.linears)
    print("linear preparation", result["linear_prep"])
    llm = None
    if not args.no_vllm:
        llm = vllm_llm(str(engine.model.config._name_or_path), eager=args.vllm_eager)
        stop = sorted(engine.stop_ids)
        vllm(llm, one[:1], args.max_tokens, 1, stop)
        if args.batch:
            vllm(llm, many, args.max_tokens, args.batch, stop)
        memory["vllm_peak_rss_growth_mib"] = peak_rss_mib() - rss1
        memory["rss_with_both_mib"] = rss_mib()
        memory["vllm_kv_cache_space_gib"] = float(os.environ["VLLM_CPU_KVCACHE_SPACE"])
    result["memory"] = memory

    runs = []
    settings = [("batch 1", one, 1)] + ([(f"batch {args.batch}", many, args.batch)] if args.batch else [])
    for name, ps, b in settings:
        rows = []
        for r in range(args.rounds):
            if llm is None:  # ours alone (--no-vllm)
                to, so, _ = ours(engine, ps, args.max_tokens, b)
                rows.append({"ours_tok_s": to / so, "ours_tokens": to})
                continue
            order = ("vllm", "ours") if r % 2 == 0 else ("ours", "vllm")
            got = {}
            for who in order:
                got[who] = (vllm(llm, ps, args.max_tokens, b, stop) if who == "vllm" else ours(engine, ps, args.max_tokens, b))
            (tv, sv, ov), (to, so, oo) = got["vllm"], got["ours"]
            rows.append({"vllm_tok_s": tv / sv, "ours_tok_s": to / so, "ratio": (to / so) / (tv / sv),
                         "vllm_tokens": tv, "ours_tokens": to, "same_prefix": same_prefix(oo, ov)})
            print(name, f"round {r}", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in rows[-1].items()})
        runs.append({"setting": name, "batch": b, "prompts": len(ps), "rounds": rows,
                     "ours_tok_s": statistics.median(x["ours_tok_s"] for x in rows)})
        if llm is not None:
            runs[-1]["vllm_tok_s"] = statistics.median(x["vllm_tok_s"] for x in rows)
            runs[-1]["ratio_median"] = statistics.median(x["ratio"] for x in rows)
            print(name, "median ratio ours/vLLM", round(runs[-1]["ratio_median"], 3))
        else:
            print(name, "ours tok/s (median of rounds)", round(runs[-1]["ours_tok_s"], 1))
        runs[-1]["steady_step"] = steady_step_ms(engine, llm, ps[:b], args.max_tokens, args.rounds)
        print(name, "steady step", {k: round(v, 3) for k, v in runs[-1]["steady_step"].items() if isinstance(v, float)})
    result["plain"] = runs

    heads = random_heads(engine.model)
    engines = tree_engines(engine, args.nodes, heads)
    secs = step_costs(engines, one[0], args.steps, args.rounds)
    result["step_cost"] = {"step_ms": {n: 1000 * s for n, s in secs.items()},
                           "ratio": {n: s / secs[0] for n, s in secs.items()},
                           "proposal_ms": proposal_ms(engines, heads) if hasattr(engine, "proposer") else None}
    print("step ms", {n: round(1000 * s, 2) for n, s in secs.items()}, "ratio", {n: round(s / secs[0], 3) for n, s in secs.items()})
    if args.eagle_nodes:
        esecs = step_costs({0: engine, **eagle_engines(engine, args.eagle_nodes, args.eagle_depth)}, one[0], args.steps,
                           args.rounds, tree_nodes=False)
        result["eagle_step_cost"] = {"depth": args.eagle_depth, "step_ms": {n: 1000 * s for n, s in esecs.items()},
                                     "ratio": {n: s / esecs[0] for n, s in esecs.items()}}
        print("EAGLE step ms (proposal + verification)", {n: round(1000 * s, 2) for n, s in esecs.items()})
    if engine.graphs is not None:
        result["cuda_graphs"] = {"recorded": engine.graphs.recorded, "replays": engine.graphs.replays}
    if args.profile_batch and llm is not None:
        result["batch_profile"] = profile_batch(engine, llm, many if args.batch else one, 64)
    if args.profile:
        result["profile"] = [profile_steps(engines[n], one[0], n, args.profile_steps) for n in [0] + [n for n in (16, 64) if n in engines]]
        for p in result["profile"]:
            print(json.dumps(p))
    result["load_average_end"] = os.getloadavg()
    result["python"] = platform.python_version()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    runs = json.loads(out.read_text()) if out.is_file() else {}
    runs[args.label or "run"] = result  # one file, one entry per label (before / after / ...)
    atomic_write_bytes(out, (json.dumps(runs, indent=1, default=str) + "\n").encode())
    print("wrote", out, "entry", args.label or "run")


if __name__ == "__main__":
    main()
