"""`accelerate launch` training: two processes train what one process does at the same global batch (Medusa-1,
Medusa-2, EAGLE-3), a checkpoint resumes in another number of processes, and the frozen target trains sharded
across the processes (FSDP2).

Two CPU processes talk over gloo: `accelerate launch --multi_gpu --num_processes 2` (without --multi_gpu and
without GPUs accelerate starts one process), or `--use_fsdp --fsdp_version 2`. Each launch is one short training
(3 steps of 32-token windows) on the shared ``real_shards``; the launches are most of this module's time.

Tolerances: one process at ``--batch-size 4`` and two at ``--batch-size 2`` see the same windows per step but pad
them to other lengths, so their matmuls round differently. Measured here, per-step losses agree within 3e-7
(relative) and final weights within 0.01% of the run's own update from step 1 (Medusa-2's LoRA, where Adam's
normalized step turns the rounding of near-zero gradients into steps of their own; up to 0.5% on other data;
Medusa-1 and EAGLE-3 within 0.001%). Two processes at ``--batch-size 2`` and one at ``--batch-size 2 --grad-accum 2``
run the same shapes, and agree bit for bit; so do two processes with and without the target sharded.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from conftest import free_port, run_distill
from distill.errors import ConfigError
from distill.train import TrainConfig, read_metrics, train
from distill.train.checkpoint import checkpoints

pytestmark = pytest.mark.slow

ACCELERATE = Path(sys.executable).with_name("accelerate")
LAUNCHERS = {"ddp": ["--multi_gpu"], "fsdp": ["--use_fsdp", "--fsdp_version", "2"]}
COMMON = ["--max-len", "32", "--steps", "3", "--save-every", "1", "--keep-checkpoints", "0", "--report-to", "none", "-q"]
ARCHS = {
    "medusa1": ["--num-heads", "2", "--share-lm-head"],
    # no LoRA dropout: each process draws its own masks, so with dropout two processes train alike only in distribution
    "medusa2": ["--medusa-mode", "medusa2", "--num-heads", "2", "--share-lm-head", "--targets", "soft", "--lora-r", "4",
                "--lora-dropout", "0", "--lora-targets", "q_proj,v_proj"],
    "eagle3": ["--arch", "eagle3", "--targets", "soft", "--feature-loss", "0.1", "--ttt-steps", "2", "--eval-every", "2",
               "--eval-tokens", "64", "--eval-nodes", "4"],
}
LOSS_RTOL = 1e-5  # per-step losses, relative (measured <= 3e-7)
WEIGHT_RTOL = 0.02  # |final weights' difference| / |the run's own update from step 1 to 3|, per tensor (measured <= 5e-3)
NOISY = ("tokens_per_s", "eval_seconds")  # wall-clock figures


def launch(how: str, args: list, timeout: int = 900) -> subprocess.CompletedProcess:
    """``accelerate launch`` of ``distill train-heads ARGS`` on two CPU processes, one thread each."""
    cmd = [str(ACCELERATE), "launch", *LAUNCHERS[how], "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no", "--main_process_port", str(free_port()), "-m", "distill.cli", "train-heads", *map(str, args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}"
    return proc


class Runs:
    """The module's trainings, each run once when a test first asks for it: ``(arch, how)``, how = ``one`` (this
    process, --batch-size 4), ``ddp`` or ``fsdp`` (two processes, --batch-size 2 each)."""

    def __init__(self, root: Path, data: Path):
        self.root, self.data, self.done, self.stdout = root, data, {}, {}

    def args(self, arch: str, out: Path) -> list:
        held_out = ["--eval-data", self.data] if arch == "eagle3" else []
        return ["--data", self.data, "--out", out, *COMMON, *ARCHS[arch], *held_out]

    def __call__(self, arch: str, how: str) -> Path:
        out = self.root / f"{arch}-{how}"
        if (arch, how) not in self.done:
            if how == "one":
                r = run_distill(["train-heads", *self.args(arch, out), "--batch-size", "4"])
                assert r.returncode == 0, r.stderr[-4000:]
            else:
                self.stdout[arch, how] = launch(how, [*self.args(arch, out), "--batch-size", "2"]).stdout
            self.done[arch, how] = out
        return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, real_shards) -> Runs:
    return Runs(tmp_path_factory.mktemp("distributed"), real_shards)


def weights(out: Path, step: int | None = None) -> dict[str, torch.Tensor]:
    """The trainable tensors of ``out``'s checkpoint at ``step`` (the last one by default)."""
    found = checkpoints(out)
    folder = found[-1] if step is None else next(p for p in found if p.name == f"step-{step:06d}")
    return load_file(str(folder / "trainable.safetensors"))


def assert_same_metrics(a: Path, b: Path, rtol: float, resumed: bool = False, held_out: bool = True) -> None:
    """Every step's record alike: losses and figures within ``rtol`` (0: bit for bit), token counts exactly (those of
    the invocation so far: not compared for a run ``resumed`` at another step). ``held_out`` False: not the held-out
    figures (``eval_*``), which measure whole batches of --batch-size windows, other rows at another --batch-size.
    Top-k rates are compared bit for bit only: within a tolerance, a near-tie may rank otherwise."""
    ra, rb = read_metrics(a), read_metrics(b)
    assert [r["step"] for r in ra] == [r["step"] for r in rb] == [1, 2, 3]
    for x, y in zip(ra, rb):
        assert set(x) == set(y)
        for key in set(x) - set(NOISY) - ({"tokens"} if resumed else set()):
            if (key.startswith("eval_") and not held_out) or (rtol and key.endswith(("_top1", "_top5"))):
                continue
            assert math.isclose(x[key], y[key], rel_tol=rtol, abs_tol=rtol), (x["step"], key, x[key], y[key])


def assert_same_weights(a: Path, b: Path) -> float:
    """Final weights alike within WEIGHT_RTOL of ``a``'s own update from step 1 to its end; -> the worst ratio."""
    first, wa, wb = weights(a, 1), weights(a), weights(b)
    assert set(wa) == set(wb)
    worst = 0.0
    for name in wa:
        update = float((wa[name] - first[name]).norm())
        diff = float((wa[name] - wb[name]).norm())
        assert diff <= WEIGHT_RTOL * update, (name, diff, update)
        worst = max(worst, diff / update if update else 0.0)
    return worst


def interrupt(run: Path, to: Path) -> Path:
    """A copy of ``run`` without its step-3 checkpoint: a --resume continues from step 2 (and drops step 3's record)."""
    shutil.copytree(run, to)
    shutil.rmtree(to / "checkpoints" / "step-000003")
    return to


@pytest.mark.parametrize("arch", list(ARCHS))
def test_two_processes_train_what_one_process_does_at_the_same_global_batch(runs, arch):
    one, two = runs(arch, "one"), runs(arch, "ddp")
    assert f"{two}: 3 steps on 2 processes, " in runs.stdout[arch, "ddp"]
    assert_same_metrics(one, two, LOSS_RTOL, held_out=False)
    assert_same_weights(one, two)


def test_the_target_sharded_across_two_processes_trains_what_one_process_does(runs):
    """FSDP2 over the frozen target (transformers loads its weights on process 0 only, the default of --use_fsdp, and
    they are broadcast into the shards); the drafter, its evaluation and checkpoints as without sharding."""
    sharded, one = runs("eagle3", "fsdp"), runs("eagle3", "one")
    assert f"{sharded}: 3 steps on 2 processes (target sharded), " in runs.stdout["eagle3", "fsdp"]
    assert_same_metrics(one, sharded, LOSS_RTOL, held_out=False)
    assert_same_weights(one, sharded)
    # sharding the target changes no bit of the run, nor of its held-out figures (evaluated on every process)
    assert_same_metrics(runs("eagle3", "ddp"), sharded, 0.0)
    assert "eval_tree_acceptance" in read_metrics(sharded)[1]
    assert all(torch.equal(a, b) for a, b in zip(weights(runs("eagle3", "ddp")).values(), weights(sharded).values()))
    from distill.heads.model import read_distill_meta

    meta = read_distill_meta(sharded)["metrics"]
    assert meta["processes"] == 2 and meta["sharded_target"] is True
    assert (sharded / "best" / "model.safetensors").is_file()


@pytest.mark.parametrize("how", ["ddp", "fsdp"])
def test_a_checkpoint_written_by_two_processes_resumes_in_one(runs, how, tmp_path):
    """Resumed in one process at --batch-size 2 --grad-accum 2 (the same global batch): the run ends as the
    two-process run did, bit for bit."""
    two = runs("eagle3", how)
    resumed = interrupt(two, tmp_path / "resumed")
    r = run_distill(["train-heads", *runs.args("eagle3", resumed), "--batch-size", "2", "--grad-accum", "2", "--resume"])
    assert r.returncode == 0, r.stderr[-4000:]
    assert_same_metrics(two, resumed, 0.0, resumed=True)
    final = weights(resumed)
    assert all(torch.equal(final[n], t) for n, t in weights(two).items())


def test_a_checkpoint_written_by_one_process_resumes_in_two(runs, tmp_path):
    one = runs("medusa1", "one")
    resumed = interrupt(one, tmp_path / "resumed")
    launch("ddp", [*runs.args("medusa1", resumed), "--batch-size", "2", "--resume"])
    assert_same_metrics(one, resumed, LOSS_RTOL, resumed=True)
    assert_same_weights(one, resumed)


def test_the_global_batch_is_dealt_alike_to_any_number_of_processes(plain_shards):
    """Two processes at --batch-size 2 take the windows one process takes at 4, step after step across the end of an
    epoch, and a dealer started at a saved position (epoch, items) goes on from there in any process count."""
    from distill.train.trainer import _Dealer, count_items

    cfg = TrainConfig(data=str(plain_shards), max_len=12, batch_size=2, heads=2)
    n = count_items(plain_shards, 12)
    assert n % 4  # the epoch ends inside a global batch

    def rows(batch) -> list[list[int]]:
        return [ids[mask.bool()].tolist() for ids, mask in zip(batch["input_ids"], batch["attention_mask"])]

    one = _Dealer(replace(cfg, batch_size=4), plain_shards, 1, 0, 0, 0)
    two = [_Dealer(cfg, plain_shards, 2, rank, 0, 0) for rank in range(2)]
    for _ in range(n // 4 + 2):
        assert rows(two[0].next()) + rows(two[1].next()) == rows(one.next())
    assert one.epoch == two[0].epoch == 1 and one.items == two[0].items == two[1].items == (n // 4 + 2) * 4 - n
    later = _Dealer(replace(cfg, batch_size=4), plain_shards, 1, 0, two[0].epoch, two[0].items)
    assert rows(later.next()) == rows(two[0].next()) + rows(two[1].next())


def test_a_resume_may_split_the_global_batch_otherwise_but_not_change_it(plain_shards, tmp_path):
    opts = dict(data=str(plain_shards), heads=2, share_lm_head=True, max_len=32, steps=2, report_to="none", progress=False)
    whole = train(TrainConfig(out=str(tmp_path / "whole"), batch_size=2, **opts))
    out = str(tmp_path / "split")
    train(TrainConfig(out=out, batch_size=2, stop_after=1, **opts))
    with pytest.raises(ConfigError, match=r"trains on 2 windows a step \(--batch-size x --grad-accum x processes\) but this launch on "
                                          r"4 \(4 x 1 x 1\)"):
        train(TrainConfig(out=out, batch_size=4, resume=True, **opts))
    resumed = train(TrainConfig(out=out, batch_size=1, grad_accum=2, resume=True, **opts))
    assert resumed.steps == 2 and resumed.tokens == read_metrics(tmp_path / "whole")[-1]["tokens"] - read_metrics(out)[0]["tokens"]
    assert math.isclose(resumed.final["loss"], whole.final["loss"], rel_tol=LOSS_RTOL)


def test_a_launch_asking_for_a_sharding_train_heads_does_not_do_is_one_line(monkeypatch):
    from accelerate.utils import DistributedType

    from distill.train.distributed import sharding_plan

    for name in [k for k in os.environ if k.startswith("FSDP_") or k == "ACCELERATE_USE_FSDP"]:
        monkeypatch.delenv(name)
    two_cpus = SimpleNamespace(distributed_type=DistributedType.MULTI_CPU, num_processes=2)
    cfg = TrainConfig(data="data")
    assert sharding_plan(two_cpus, cfg) is None  # a plain launch: DDP
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "true")
    plan = sharding_plan(two_cpus, cfg)
    assert plan.broadcast and plan.reshard_after_forward
    assert sharding_plan(SimpleNamespace(distributed_type=DistributedType.MULTI_CPU, num_processes=1), cfg) is None
    with pytest.raises(ConfigError, match="medusa2 trains the target"):
        sharding_plan(two_cpus, TrainConfig(data="data", mode="medusa2"))
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(ConfigError, match=r"launch with `accelerate launch --use_fsdp --fsdp_version 2`.*asks for FSDP version 1"):
        sharding_plan(two_cpus, cfg)
    with pytest.raises(ConfigError, match="not DeepSpeed"):
        sharding_plan(SimpleNamespace(distributed_type=DistributedType.DEEPSPEED, num_processes=2), cfg)
