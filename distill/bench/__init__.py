"""``distill bench``: plain vs Medusa decoding on the same prompts, and the tree size chosen for the hardware."""

from distill import lazy_exports

# Exported lazily: ``distill.bench.config`` (what ``--help`` reads) must not import the engine and torch with it.
_EXPORTS = {"BenchConfig": "distill.bench.config", "BenchRunner": "distill.bench.runner",
            "load_prompts": "distill.bench.runner", "run_bench": "distill.bench.runner", "run_benches": "distill.bench.runner",
            **{name: "distill.bench.stats" for name in ("BenchResult", "Group", "Run", "Sweep", "SweepPoint")},
            "sweep_tree_sizes": "distill.bench.sweep", "time_tree_steps": "distill.bench.sweep"}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
