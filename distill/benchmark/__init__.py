"""``distill bench``: plain vs Medusa decoding on the same prompts, and the tree size chosen for the hardware."""

from importlib import import_module

# Exported lazily: ``distill.benchmark.config`` (what ``--help`` reads) must not import the engine and torch with it.
_EXPORTS = {"BenchConfig": "distill.benchmark.config", "BenchRunner": "distill.benchmark.runner",
            "load_prompts": "distill.benchmark.runner", "run_bench": "distill.benchmark.runner",
            **{name: "distill.benchmark.stats" for name in ("BenchResult", "Group", "Run", "Sweep", "SweepPoint")},
            "sweep_tree_sizes": "distill.benchmark.sweep", "time_tree_steps": "distill.benchmark.sweep"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
