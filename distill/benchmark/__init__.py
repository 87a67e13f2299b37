"""``distill bench``: plain vs Medusa decoding on the same prompts, and the tree size chosen for the hardware."""

from distill.benchmark.config import BenchConfig
from distill.benchmark.runner import BenchRunner, load_prompts, run_bench
from distill.benchmark.stats import BenchResult, Group, Run, Sweep, SweepPoint
from distill.benchmark.sweep import sweep_tree_sizes, time_tree_steps

__all__ = ["BenchConfig", "BenchResult", "BenchRunner", "Group", "Run", "Sweep", "SweepPoint", "load_prompts", "run_bench",
           "sweep_tree_sizes", "time_tree_steps"]
