"""``distill bench``: plain vs Medusa decoding on the same prompts, and the tree size chosen for the hardware."""

from distill import lazy_exports

# Exported lazily: ``distill.benchmark.config`` (what ``--help`` reads) must not import the engine and torch with it.
_EXPORTS = {"BenchConfig": "distill.benchmark.config", "BenchRunner": "distill.benchmark.runner",
            "load_prompts": "distill.benchmark.runner", "run_bench": "distill.benchmark.runner",
            **{name: "distill.benchmark.stats" for name in ("BenchResult", "Group", "Run", "Sweep", "SweepPoint")},
            "sweep_tree_sizes": "distill.benchmark.sweep", "time_tree_steps": "distill.benchmark.sweep"}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
