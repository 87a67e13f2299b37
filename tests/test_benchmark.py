"""distill bench: statistics on synthetic runs, MT-Bench prompt selection, report files, a real tiny run, and the bare-vLLM
baseline (``--vllm``) run against the session's vLLM engine."""

from __future__ import annotations

import json

import pytest

from conftest import run_distill
from distill.bench import BenchConfig, BenchResult, Run, Sweep, SweepPoint, load_prompts
from distill.bench.report import write_all
from distill.bench.runner import summarize
from distill.errors import ConfigError


def run(pid, cat, mode, acc, tokens, steps, step_s, wall, ids=None) -> Run:
    return Run(pid, cat, mode, acc, prompt_tokens=10, tokens=tokens, step_tokens=tokens - 1, steps=steps, step_seconds=step_s,
               prefill_seconds=0.1, wall_seconds=wall, finish_reason="length", token_ids=ids or [1] * tokens)


def test_group_stats_are_ratios_of_sums_per_category_and_overall():
    runs = [
        run("a", "math", "plain", "greedy", 11, 10, 1.0, 2.0, [1, 2]), run("a", "math", "medusa", "greedy", 11, 4, 0.6, 1.0, [1, 2]),
        run("b", "code", "plain", "greedy", 21, 20, 2.0, 4.0, [3]), run("b", "code", "medusa", "greedy", 21, 5, 1.0, 2.0, [4]),
    ]
    groups = {g.category: g for g in summarize(runs)}
    assert list(groups) == ["math", "code", "all"]
    m = groups["math"]
    assert m.acceleration_rate == pytest.approx(10 / 4)
    assert m.plain_step_ms == pytest.approx(100) and m.medusa_step_ms == pytest.approx(150)
    assert m.step_overhead == pytest.approx(1.5) and m.speedup == pytest.approx(2.0) and m.identical == 1
    a = groups["all"]
    assert a.acceleration_rate == pytest.approx(30 / 9) and a.speedup == pytest.approx((32 / 3) / (32 / 6))
    assert a.identical == 1 and a.prompts == 2  # prompt b's Medusa output differs


def test_vllm_runs_give_each_group_its_ratios_against_vllm():
    runs = [
        run("a", "math", "plain", "greedy", 10, 9, 0.9, 2.0, [1, 2]), run("a", "math", "medusa", "greedy", 10, 4, 0.6, 1.0, [1, 2]),
        run("a", "math", "vllm", "greedy", 10, 0, 0.0, 1.6, [1, 2]),
        run("b", "code", "plain", "greedy", 20, 19, 1.9, 4.0, [3]), run("b", "code", "medusa", "greedy", 20, 6, 1.0, 2.0, [3]),
        run("b", "code", "vllm", "greedy", 20, 0, 0.0, 2.4, [4]),
        run("a", "math", "plain", "typical", 10, 9, 0.9, 2.0), run("a", "math", "medusa", "typical", 10, 4, 0.6, 1.0),
    ]
    groups = {(g.acceptance, g.category): g for g in summarize(runs)}
    m = groups["greedy", "math"]
    assert m.vllm_tokens_per_s == pytest.approx(10 / 1.6)
    assert m.plain_vs_vllm == pytest.approx(5 / 6.25) and m.medusa_vs_vllm == pytest.approx(10 / 6.25) and m.vllm_identical == 1
    a = groups["greedy", "all"]
    assert a.vllm_tokens_per_s == pytest.approx(30 / 4.0) and a.medusa_vs_vllm == pytest.approx((30 / 3.0) / (30 / 4.0))
    assert a.vllm_identical == 1 and a.identical == 2  # prompt b: vLLM's greedy output differs from ours
    assert groups["typical", "all"].vllm_tokens_per_s is None  # vLLM runs greedy only
    res = BenchResult(BenchConfig.from_options(heads="h").to_dict(), "m", "d", "model", "h", {"nodes": 4, "source": "x", "nodes_used_at_batch_1": 4},
                      summarize(runs), runs)
    from distill.bench.report import markdown

    md = markdown(res)
    assert "| vLLM tok/s | plain / vLLM | speculative / vLLM | identical to vLLM |" in md
    assert "| 7.5 | 0.67x | 1.33x | 1/2 |" in md  # greedy, all: vLLM 30 tokens in 4 s, plain 30 in 6 s, Medusa 30 in 3 s
    assert md.count("| typical |") == 2 and all(line.endswith("| | | | |") for line in md.splitlines() if "| typical |" in line)
    from distill.pipeline import _overall

    headline = _overall(res)  # what `distill run` prints: against vLLM where the bench measured it
    assert headline["greedy"]["plain_vs_vllm"] == pytest.approx(5 / 7.5) and headline["greedy"]["medusa_vs_vllm"] == pytest.approx(10 / 7.5)
    assert "vllm_tokens_per_s" not in headline["typical"]


def test_typical_groups_do_not_claim_identity():
    runs = [run("a", "x", "plain", "typical", 5, 4, 0.4, 0.5), run("a", "x", "medusa", "typical", 5, 2, 0.3, 0.4)]
    assert all(g.identical is None for g in summarize(runs))


def test_mt_bench_prompts_round_robin_over_categories():
    prompts = load_prompts("mt-bench", limit=8)
    assert len({p.category for p in prompts}) == 8
    assert all(p.messages[-1]["role"] == "user" for p in prompts)
    assert len(load_prompts("mt-bench")) == 80


@pytest.mark.parametrize("options", [{"modes": ("fast",)}, {"limit": 0}, {"temperature": 0.0}, {"sweep_nodes": (0, 4)},
                                     {"vllm": True, "modes": ("typical",)}])
def test_bench_config_rejects_bad_options(options):
    with pytest.raises(ConfigError):
        BenchConfig.from_options(heads="h", **options)


def test_report_files_are_written_from_stats(tmp_path):
    runs = [run("a", "math", "plain", "greedy", 11, 10, 1.0, 2.0), run("a", "math", "medusa", "greedy", 11, 4, 0.6, 1.0)]
    pts = [SweepPoint(0, 1, 0.01, 1.0, 1.0, 1.0), SweepPoint(4, 5, 0.012, 1.2, 2.0, 2.0 / 1.2)]
    sweep = Sweep(128, 3, "test", [[0.5, 0.2]], pts, 4, 2.0 / 1.2, 0.05, "cpu")
    res = BenchResult(BenchConfig.from_options(heads="h").to_dict(), "m", "d", "model", "h", {"nodes": 4, "source": "x", "nodes_used_at_batch_1": 4},
                      summarize(runs), runs, sweep)
    paths = write_all(res, tmp_path)
    assert json.loads(paths["json"].read_text())["groups"][0]["speedup"] == pytest.approx(2.0)
    md = paths["markdown"].read_text()
    assert "| greedy | math |" in md and "Chosen node budget: **4**" in md
    for key in ("plot", "sweep_plot"):
        assert paths[key].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_policy_that_decoded_plain_says_so_first_and_the_outputs_name_the_proposer(tmp_path, monkeypatch):
    """bench.md's first line: the full tree's tokens/step against the break-even; the columns and the plot title name
    the proposer (the lookup here, a union as its parts)."""
    from distill.bench import report
    from distill.bench.report import markdown

    runs = [run("a", "math", "plain", "greedy", 11, 10, 1.0, 2.0), run("a", "math", "medusa", "greedy", 11, 10, 1.1, 2.2)]
    even = {"nodes": 24, "expected": 1.31, "expected_measured": None, "tokens_per_step": 1.46}
    tree = {"nodes": 24, "source": "x", "proposer": "lookup", "nodes_used_at_batch_1": 0, "break_even_at_batch_1": even}
    res = BenchResult(BenchConfig.from_options(heads="lookup").to_dict(), "m", "d", "model", "lookup", tree, summarize(runs), runs)
    first, blank, header = markdown(res).splitlines()[:3]
    assert first == ("The policy decoded plain at batch 1: the lookup proposer's full tree (24 nodes) makes 1.31 tokens/step "
                     "(expected from its acceptance table, not measured: `--tree-acceptance` measures it), this machine breaks "
                     "even at 1.46 tokens/step (a step of 24 nodes costs 1.46x a plain one).")
    assert blank == "" and header.startswith("Model `model`") and "0 used at batch 1" in header
    assert "| plain tok/s | lookup tok/s |" in markdown(res) and "Medusa" not in markdown(res)
    titles = []
    monkeypatch.setattr(report, "_save", lambda fig, path: titles.append(fig._suptitle.get_text()))
    report.plot(res, tmp_path / "bench.png")
    assert titles == ["model: lookup vs plain decoding, batch 1 (m)"]

    res.tree = dict(tree, proposer="lookup+medusa", break_even_at_batch_1=dict(even, expected_measured=1.12))
    md = markdown(res)
    assert md.startswith("The policy decoded plain at batch 1: the lookup + Medusa proposer's full tree (24 nodes) makes 1.31 "
                         "tokens/step (expected from its acceptance table, not measured: `--tree-acceptance` measures it; 1.12 with "
                         "the acceptance the policy measured in this run), this machine breaks even at 1.46 tokens/step")
    assert "| lookup + Medusa tok/s |" in md
    res.tree = dict(tree, nodes_used_at_batch_1=12)  # the policy speculated: the header comes first, as before
    assert markdown(res).startswith("Model `model`, heads `lookup`, tree 24 nodes")


def test_the_break_even_is_the_engines_own_pricing_of_the_full_tree(hf_model, tokenizer):
    """What the report states is what tree_size_for decided on: plain exactly when the full tree's expected tokens per
    step do not beat its step cost over a plain step's (a lookup engine drafting trees on the bundled model, fixed step
    cost ratio). Drafting chains, each step's nodes are priced by the node budget, within the proposer's budget."""
    from distill.bench.runner import break_even
    from distill.engine import Engine, EngineConfig
    from distill.engine.proposers.lookup import Lookup

    chains = Engine(hf_model, tokenizer, Lookup(chains=True), EngineConfig(max_batch=1, step_cost_ratio=0.5))
    assert chains.pricing.budget is not None and chains.tree_size_for(1) == chains.proposer.max_nodes
    for ratio in (0.02, 0.5):
        engine = Engine(hf_model, tokenizer, Lookup(chains=False), EngineConfig(max_batch=1, step_cost_ratio=ratio))
        even = break_even(engine, 1)
        assert even["nodes"] == engine.proposer.max_nodes and even["expected"] == engine.proposer.taus()[even["nodes"]]
        assert even["tokens_per_step"] == pytest.approx(1 + ratio * even["nodes"])  # c(n + 1) over c(1), no proposal cost
        plain = engine.tree_size_for(1) == 0
        assert plain == (even["expected"] <= even["tokens_per_step"])
        if ratio == 0.5:
            assert plain  # a step of many nodes at half a plain step per token: the lookup cannot pay for it


@pytest.mark.slow
def test_bench_cli_runs_plain_vs_medusa_and_the_sweep_with_the_bundled_model(tmp_path, model_dir, cli_env):
    """Fresh heads (zero residual blocks): greedy Medusa output must still equal plain decoding."""
    from distill.heads import HeadsConfig, MedusaHeads
    from distill.heads.tree import load_tree

    cfg = json.loads((model_dir / "config.json").read_text())
    from safetensors.torch import load_file

    lm = load_file(str(model_dir / "model.safetensors"))["model.embed_tokens.weight"]
    MedusaHeads(HeadsConfig(cfg["hidden_size"], cfg["vocab_size"], num_heads=2), lm_head_weight=lm).save(tmp_path / "heads")
    out = tmp_path / "bench"
    r = run_distill(["bench", "--heads", str(tmp_path / "heads"), "--limit", "2", "--max-tokens", "6", "--modes", "greedy",
                     "--sweep-tree", "--sweep-nodes", "1,3", "--sweep-repeats", "1", "--sweep-context", "16", "--out", str(out), "-q"],
                     env=cli_env)
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads((out / "bench.json").read_text())
    overall = next(g for g in data["groups"] if g["category"] == "all")
    assert overall["prompts"] == 2 and overall["identical"] == 2
    medusa = [r for r in data["runs"] if r["mode"] == "medusa"]
    assert all(r["step_tokens"] >= r["steps"] > 0 for r in medusa)  # every verification step emits at least its root token
    assert overall["acceleration_rate"] == pytest.approx(sum(r["step_tokens"] for r in medusa) / sum(r["steps"] for r in medusa))
    assert overall["plain_tokens_per_s"] > 0
    assert {g["category"] for g in data["groups"]} == {"writing", "roleplay", "all"}
    assert [p["nodes"] for p in data["sweep"]["points"]] == [0, 1, 3]
    points = data["sweep"]["points"]
    best = max(points, key=lambda p: (p["predicted_speedup"], -p["nodes"]))  # the rule: best predicted speedup, the smaller on a tie
    assert data["sweep"]["best_nodes"] == best["nodes"]
    for p in points:
        assert p["predicted_speedup"] == pytest.approx(p["expected_acceptance_length"] / p["overhead"])
    # a tree.json exactly when speculation pays (best > plain), ready for `distill serve --tree`
    assert (out / "tree.json").exists() == (best["nodes"] > 0)
    if best["nodes"] > 0:
        assert load_tree(out / "tree.json")["nodes"] == best["nodes"]
    assert "| greedy | **all** |" in r.stdout


@pytest.mark.slow
@pytest.mark.vllm
def test_bench_against_bare_vllm_interleaves_the_engines_on_the_same_prompts(tmp_path, vllm_backend):
    """--vllm: bare vLLM (the session's engine) decodes the greedy prompts between our plain and lookup runs, in turn first."""
    from distill.bench import run_bench
    from distill.bench.baseline import VllmBaseline
    from distill.engine import Engine, EngineConfig

    engine = Engine.from_pretrained(None, "lookup", EngineConfig(max_batch=1))
    cfg = BenchConfig.from_options(heads="lookup", limit=3, max_tokens=8, modes=("greedy",), vllm=True, out=str(tmp_path / "bench"))
    result, paths = run_bench(cfg, engine=engine, baseline=VllmBaseline(vllm_backend))
    assert [r.mode for r in result.runs] == ["plain", "medusa", "vllm", "medusa", "vllm", "plain", "vllm", "plain", "medusa"]
    vllm_runs = [r for r in result.runs if r.mode == "vllm"]
    assert all(r.tokens == len(r.token_ids) == 8 and r.wall_seconds > 0 for r in vllm_runs)
    overall = result.overall("greedy")
    assert overall.identical == 3 and overall.vllm_identical == 3  # float32 greedy: vLLM's tokens are ours
    assert overall.vllm_tokens_per_s == pytest.approx(24 / sum(r.wall_seconds for r in vllm_runs))
    assert overall.plain_vs_vllm == pytest.approx(overall.plain_tokens_per_s / overall.vllm_tokens_per_s)
    assert overall.medusa_vs_vllm == pytest.approx(overall.medusa_tokens_per_s / overall.vllm_tokens_per_s)
    data = json.loads(paths["json"].read_text())
    assert next(g for g in data["groups"] if g["category"] == "all")["vllm_identical"] == 3
    assert "| lookup / vLLM | identical to vLLM |" in paths["markdown"].read_text()


def test_vllm_needs_the_greedy_mode_on_the_command_line(tmp_path):
    r = run_distill(["bench", "--heads", "lookup", "--vllm", "--modes", "typical", "--out", str(tmp_path / "b")])
    assert r.returncode == 2 and r.stderr.strip() == "error: --vllm compares greedy decoding with bare vLLM's: add greedy to --modes"
    assert not (tmp_path / "b").exists()


def test_a_baseline_whose_stop_tokens_differ_from_the_engines_is_refused():
    """vLLM ending replies at other tokens than the engine would decode other lengths: a clear error, not a skewed ratio."""
    from types import SimpleNamespace

    from distill.bench.baseline import VllmBaseline

    baseline = VllmBaseline(SimpleNamespace(stop_ids=frozenset({2})))
    baseline.check_stops({2})
    with pytest.raises(ConfigError, match=r"the engine stops at tokens \[2, 7\], vLLM at \[2\]"):
        baseline.check_stops({2, 7})


@pytest.mark.slow
def test_tree_acceptance_measures_what_the_full_tree_bench_measures_and_leaves_the_policy_as_it_was(tmp_path):
    """--tree-acceptance: one untimed greedy pass with the whole tree on the running engine, after the policy's timed
    passes; its tokens/step are those of a bench that verifies the full tree every step (--full-tree), prompt for prompt."""
    from distill.bench import run_bench
    from distill.bench.report import markdown
    from distill.engine import Engine, EngineConfig

    engine = Engine.from_pretrained(None, "lookup", EngineConfig(max_batch=1))
    before = engine.config.speculate_max_batch
    cfg = BenchConfig.from_options(heads="lookup", limit=3, max_tokens=24, modes=("greedy",), tree_acceptance=True,
                                   warmup=0, out=str(tmp_path / "policy"))
    result, _ = run_bench(cfg, engine=engine)
    assert engine.config.speculate_max_batch == before  # the policy decides again once the pass is done
    full = BenchConfig.from_options(heads="lookup", limit=3, max_tokens=24, modes=("greedy",), full_tree=True, warmup=0,
                                    out=str(tmp_path / "full"))
    reference = run_bench(full)[0]
    tau = result.tree["full_tree_tokens_per_step"]
    assert tau == pytest.approx(reference.overall("greedy").acceleration_rate) and tau > 1  # MT-Bench: the lookup drafts
    assert reference.tree["full_tree_tokens_per_step"] is None  # --full-tree measures the tree in its timed passes
    first = markdown(result).splitlines()[0]
    assert f"proposer's full tree ({result.tree['nodes']} nodes) makes {tau:.2f} tokens/step (measured on these prompts" in first


def test_the_gpu_prediction_divides_the_measured_tokens_per_step_by_the_measured_gpu_step():
    from distill.bench import predict as p

    assert p.step_ratio("medusa", 16) == pytest.approx(1.12 + 0.38 / 8.56)
    assert p.step_ratio("eagle3", 24, 5) == pytest.approx(14.77 / 8.56)  # the whole measured EAGLE step
    assert p.step_ratio("eagle3", 24, 3) < p.step_ratio("eagle3", 24, 5) < p.step_ratio("eagle3", 24, 7) == pytest.approx(16.45 / 8.56)
    assert p.step_ratio("eagle3", 16, 5) < p.step_ratio("eagle3", 24, 5)  # fewer nodes verified
    assert p.step_ratio("lookup", 2) == 1.08 and p.step_ratio("lookup", 64) == p.step_ratio("lookup", 200) == 1.20
    assert 1.08 < p.step_ratio("lookup", 8) < 1.12 and p.step_ratio("lookup+eagle3", 24, 5) == p.step_ratio("eagle3", 24, 5)
    prediction = p.predict("medusa", 16, 1.41)
    assert prediction.speedup == pytest.approx(1.41 / (1.12 + 0.38 / 8.56))
    assert "(a prediction, not measured): 1.41 tokens/step / a step of 1.16x = 1.21x" in prediction.describe()


@pytest.mark.slow
def test_two_proposers_in_one_pass_share_each_prompts_plain_run_and_take_turns_first(tmp_path):
    """run_benches: per prompt plain decoding once, then each proposer, each first as often as the others; every
    proposer's result counts the same plain runs, and greedy output equals plain decoding for both."""
    from distill.bench import run_benches

    options = dict(heads="lookup", limit=3, max_tokens=12, modes=("greedy",), warmup=0)
    configs = [BenchConfig.from_options(**options, out=str(tmp_path / "wide")),
               BenchConfig.from_options(**options, draft_nodes=2, out=str(tmp_path / "narrow"))]
    (wide, wide_paths), (narrow, _) = run_benches(configs)
    # turns: (plain, wide, narrow), (wide, narrow, plain), (narrow, plain, wide)
    assert [r.mode for r in wide.runs] == ["plain", "medusa", "medusa", "plain", "plain", "medusa"]
    assert [r.mode for r in narrow.runs] == ["plain", "medusa", "medusa", "plain", "medusa", "plain"]
    plain = [r for r in wide.runs if r.mode == "plain"]
    assert plain == [r for r in narrow.runs if r.mode == "plain"] and len(plain) == 3  # the same runs, decoded once
    assert wide.tree["nodes"] > narrow.tree["nodes"] == 2
    assert wide.overall("greedy").identical == narrow.overall("greedy").identical == 3
    assert json.loads(wide_paths["json"].read_text())["tree"]["nodes"] == wide.tree["nodes"]
    assert (tmp_path / "narrow" / "bench.json").is_file()
    with pytest.raises(ConfigError, match="must share their prompts"):
        run_benches([configs[0], BenchConfig.from_options(**dict(options, limit=2), out=str(tmp_path / "other"))])
