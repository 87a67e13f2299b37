"""Training on real shards: loss goes down, resume is exact, outputs are vLLM heads without pickles."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from distill.errors import ConfigError
from distill.heads.model import MedusaHeads, read_distill_meta
from distill.train import TrainConfig, read_metrics, train
from distill.train.calibrate import head_accuracy
from distill.train.trainer import _make_optimizer, _truncate_metrics, build_heads, lambda0_at, load_backbone, lr_factor

TINY = dict(heads=2, share_lm_head=True, max_len=32, batch_size=2, lr=3e-3, seed=0, progress=False)


def test_training_lowers_head_loss_and_raises_head1_top1(trained_heads, real_shards, hf_model):
    """Evaluated on the first ~1000 training tokens before (fresh heads) and after 12 steps (seeded).
    Margins: head-1 CE drops by at least 1 nat, head-1 top-1 at least doubles and gains 5 points."""
    from conftest import TRAINED_HEADS_OPTIONS

    cfg = TrainConfig(data=str(real_shards), **TRAINED_HEADS_OPTIONS)
    before = head_accuracy(hf_model, build_heads(hf_model, cfg), real_shards, max_len=64, ranks=5, max_tokens=1000)
    after = head_accuracy(hf_model, MedusaHeads.load(trained_heads), real_shards, max_len=64, ranks=5, max_tokens=1000)
    assert after.loss[0] < before.loss[0] - 1.0, (before.loss, after.loss)
    assert after.topk(1)[0] >= max(2 * before.topk(1)[0], before.topk(1)[0] + 0.05), (before.topk(1), after.topk(1))
    assert after.loss[1] < before.loss[1]


def test_metrics_log_has_per_head_loss_and_accuracy_for_every_step(trained_heads):
    rows = read_metrics(trained_heads)
    assert [r["step"] for r in rows] == list(range(1, 13))
    for r in rows:
        for k in (1, 2):
            assert 0 <= r[f"head{k}_top1"] <= r[f"head{k}_top5"] <= 1 and math.isfinite(r[f"head{k}_loss"])
        assert r["tokens_per_s"] > 0
    assert rows[-1]["loss"] < rows[0]["loss"]


def test_heads_folder_is_vllm_format_with_our_metadata_beside_it_and_no_pickles(trained_heads):
    conf = json.loads((trained_heads / "config.json").read_text())
    assert conf["model_type"] == "medusa" and conf["architectures"] == ["MedusaModel"]
    assert conf["num_heads"] == 2 and conf["original_lm_head"] is True and conf["num_hidden_layers"] == 1
    assert set(conf) == {"model_type", "architectures", "hidden_size", "vocab_size", "num_heads", "num_hidden_layers",
                         "medusa_fc_bias", "original_lm_head"}
    meta = read_distill_meta(trained_heads)
    assert meta["base_model"]["id"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and meta["base_model"]["revision"]
    assert meta["train_config"]["heads"] == 2 and meta["metrics"]["steps"] == 12
    suffixes = {p.suffix for p in trained_heads.rglob("*") if p.is_file()}
    assert not suffixes & {".pt", ".pth", ".bin", ".pkl", ".pickle"}, suffixes
    heads = MedusaHeads.load(trained_heads)
    assert len(heads.lm_heads) == 1 and heads.blocks[0].layers[0].weight.abs().sum() > 0


def test_resume_from_a_checkpoint_reproduces_the_uninterrupted_run(real_shards, tmp_path):
    opts = dict(data=str(real_shards), steps=6, warmup_steps=2, **TINY)
    straight = train(TrainConfig(out=str(tmp_path / "straight"), **opts))
    first = train(TrainConfig(out=str(tmp_path / "resumed"), stop_after=3, **opts))
    assert first.stopped_early and first.steps == 3
    assert not (tmp_path / "resumed" / "model.safetensors").exists()
    with open(tmp_path / "resumed" / "metrics.jsonl", "a") as f:  # killed while logging step 4, after checkpoint 3
        f.write('{"step": 4, "loss": 2.')
    second = train(TrainConfig(out=str(tmp_path / "resumed"), resume=True, **opts))
    assert straight.steps == second.steps == 6
    a, b = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "resumed")
    assert [r["step"] for r in b] == list(range(1, 7))
    for ra, rb in zip(a, b):
        assert abs(ra["loss"] - rb["loss"]) <= 1e-6 * max(1.0, abs(ra["loss"])), (ra["step"], ra["loss"], rb["loss"])
        assert abs(ra["head2_top1"] - rb["head2_top1"]) < 1e-9
    wa = MedusaHeads.load(tmp_path / "straight").state_dict()
    wb = MedusaHeads.load(tmp_path / "resumed").state_dict()
    assert all(torch.allclose(wa[k], wb[k], atol=1e-6) for k in wa)


def test_a_metrics_log_whose_last_line_is_torn_is_read_and_truncated_on_resume(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 3.0 - s / 10}) + "\n" for s in (1, 2, 3)) + '{"step": 4, "lo')
    with caplog.at_level("WARNING", logger="distill.train"):
        assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    assert [r.getMessage() for r in caplog.records] == [f"{path}: dropped its torn last line (the run was killed while writing it): "
                                                       '{"step": 4, "lo']
    _truncate_metrics(path, 2)  # what a resume from checkpoint 2 does
    assert path.read_text() == "".join(json.dumps({"step": s, "loss": 3.0 - s / 10}) + "\n" for s in (1, 2))
    path.write_text('{"step": 1, "lo\n{"step": 2, "loss": 1.0}\n')  # a damaged line before the end is not a torn append
    with pytest.raises(json.JSONDecodeError):
        read_metrics(tmp_path)


def test_only_the_newest_checkpoints_are_kept_and_the_run_resumes_from_them(real_shards, tmp_path):
    from distill.train.checkpoint import checkpoints

    opts = dict(data=str(real_shards), steps=5, save_every=1, **TINY)
    train(TrainConfig(out=str(tmp_path / "all"), keep_checkpoints=0, stop_after=4, **opts))
    assert [p.name for p in checkpoints(tmp_path / "all")] == [f"step-{i:06d}" for i in range(1, 5)]
    train(TrainConfig(out=str(tmp_path / "kept"), keep_checkpoints=2, stop_after=4, **opts))
    assert [p.name for p in checkpoints(tmp_path / "kept")] == ["step-000003", "step-000004"]
    assert sorted(p.name for p in (tmp_path / "kept" / "checkpoints").iterdir()) == ["step-000003", "step-000004"]
    # keep_checkpoints is not part of the run's identity: the resume may change it
    done = train(TrainConfig(out=str(tmp_path / "kept"), keep_checkpoints=1, resume=True, **opts))
    assert done.steps == 5 and [p.name for p in checkpoints(tmp_path / "kept")] == ["step-000005"]
    with pytest.raises(ConfigError, match="--keep-checkpoints"):
        TrainConfig(data="x", keep_checkpoints=-1)


@pytest.mark.parametrize("arch", ["medusa", "eagle3"])
def test_a_step_with_no_target_in_the_drafters_reach_trains_on_and_leaves_weights_and_optimizer_as_they_were(
        tmp_path, arch):
    """A window whose only reply tokens are its first two (a short reply cut by --max-len) gives the base model a
    target but no head or drafter step one: the run goes on, and that step changes neither the weights nor the
    optimizer's moments (Adam would otherwise move them by its momentum alone)."""
    import pyarrow.parquet as pq
    from safetensors.torch import load_file

    from distill.data.convert import seed_to_shards
    from distill.train.checkpoint import checkpoints
    from distill.train.trainer import count_items

    chats = [("Say something about the sea.", "Here is a sentence about the sea, and another one that goes on a little longer."),
             ("Answer with one word: is the sea wet?", "Yes")]  # the second ends the epoch
    seed = tmp_path / "seed.jsonl"
    seed.write_text("".join(json.dumps({"messages": [{"role": "user", "content": u}, {"role": "assistant", "content": a}]}) + "\n"
                            for u, a in chats))
    seed_to_shards(str(seed), tmp_path / "ds")
    rows = pq.read_table(sorted((tmp_path / "ds").glob("*.parquet"))[0]).to_pylist()
    last = rows[-1]["loss_mask"]
    first_target = last.index(True)  # a window from here holds the reply's token and its end: targets at 0 and 1 only
    opts = dict(data=str(tmp_path / "ds"), out=str(tmp_path / "run"), arch=arch, batch_size=1, max_len=first_target,
                context=0, lr=3e-3, warmup_steps=0, seed=0, save_every=1, keep_checkpoints=2, progress=False,
                report_to="none", eval_data="none")
    steps = count_items(opts["data"], first_target)
    assert steps >= 2
    done = train(TrainConfig(steps=steps, **opts))
    assert done.steps == steps
    metrics = read_metrics(tmp_path / "run")
    assert metrics[-1]["loss"] == 0.0 and all(m["loss"] > 0 for m in metrics[:-1]), metrics
    before, after = checkpoints(tmp_path / "run")[-2:]
    assert after.name == f"step-{steps:06d}"
    for name in ("trainable.safetensors", "optimizer.safetensors"):
        a, b = load_file(before / name), load_file(after / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


def test_a_second_run_into_the_same_folder_needs_resume_and_the_same_options(real_shards, tmp_path):
    opts = dict(data=str(real_shards), out=str(tmp_path / "run"), steps=2, **TINY)
    train(TrainConfig(stop_after=1, **opts))
    with pytest.raises(ConfigError, match="--resume"):
        train(TrainConfig(**opts))
    with pytest.raises(ConfigError, match="different options.*lr"):
        train(TrainConfig(resume=True, **{**opts, "lr": 1e-2}))


def test_medusa2_trains_lora_with_the_teacher_kl_and_writes_adapter_and_merged_model(real_shards, tmp_path):
    out = tmp_path / "m2"
    opts = {**TINY, "heads": 1}
    s = train(TrainConfig(data=str(real_shards), out=str(out), mode="medusa2", steps=3, lambda0=0.2,
                          lambda0_schedule="two-stage", lambda0_warmup=1, merge_adapter=True, lora_r=4,
                          eval_data=str(real_shards), eval_every=2, eval_tokens=200, eval_nodes=5, **opts))
    rows = read_metrics(out)
    assert rows[0]["lambda0"] == 0.0 and "lm_kl" not in rows[0]  # stage 1: heads only
    assert rows[1]["lambda0"] == 0.2 and 0 <= rows[1]["lm_kl"] < 5.0 and rows[1]["loss"] > rows[1]["lm_kl"]
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    assert (out / "merged" / "model.safetensors").is_file() and (out / "merged" / "tokenizer.json").is_file()
    meta = read_distill_meta(out)
    assert meta["merged_model"] == "merged" and s.steps == 3
    # evaluated through the LoRA backbone at step 2 and at the end; the best keeps its adapter, never merges mid-run
    assert [r["step"] for r in rows if "eval_tree_acceptance" in r] == [2, 3] and s.best_eval["step"] in (2, 3)
    assert (out / "best" / "adapter" / "adapter_model.safetensors").is_file() and not (out / "best" / "merged").exists()
    assert read_distill_meta(out / "best")["adapter"] == "adapter"


def test_optimizer_auto_is_adamw_even_where_bitsandbytes_imports(monkeypatch):
    import importlib.machinery
    import types

    made = []

    class AdamW8bit(torch.optim.AdamW):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    bnb = types.ModuleType("bitsandbytes")
    bnb.__spec__ = importlib.machinery.ModuleSpec("bitsandbytes", None)
    bnb.optim = types.SimpleNamespace(AdamW8bit=AdamW8bit)
    monkeypatch.setitem(sys.modules, "bitsandbytes", bnb)

    def groups():
        return [{"params": [torch.nn.Parameter(torch.zeros(3))], "lr": 1e-3}]

    gpu = torch.device("cuda")  # where adamw8bit could run: only its type is read
    opt, name = _make_optimizer(groups(), TrainConfig(data="x", optimizer="auto"), gpu)
    assert type(opt) is torch.optim.AdamW and name == "adamw" and made == []
    opt, name = _make_optimizer(groups(), TrainConfig(data="x", optimizer="adamw8bit"), gpu)  # the module is seen when asked for
    assert made == [opt] and name == "adamw8bit"


def test_a_run_without_tensorboard_warns_once_and_trains_on(real_shards, tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # its import fails
    out = tmp_path / "run"
    with caplog.at_level("WARNING", logger="distill.train"):
        s = train(TrainConfig(data=str(real_shards), out=str(out), steps=3, log_every=1, **TINY))
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == ["tensorboard is not installed: metrics go to metrics.jsonl only (pip install tensorboard)"]
    assert s.steps == 3 and [r["step"] for r in read_metrics(out)] == [1, 2, 3] and not (out / "tensorboard").exists()
    assert MedusaHeads.load(out).config.num_heads == 2


def test_load_backbone_puts_the_model_on_the_device_asked_for(model_dir):
    model = load_backbone(model_dir, torch.device("meta"), bf16=True)  # meta: a device other than the CPU it loads on
    assert {(p.device.type, p.dtype) for p in model.parameters()} == {("meta", torch.bfloat16)}


def test_lambda0_schedules_and_cosine_warmup():
    base = dict(data="x", mode="medusa2", lambda0=0.2, lambda0_warmup=4)
    sine = TrainConfig(lambda0_schedule="sine", **base)
    # 0.2 * sin(pi/2 * (s + 1) / 4), written out: 0.2 * sin(22.5 deg), sin(45 deg), sin(67.5 deg), then 0.2
    assert [round(lambda0_at(sine, s), 4) for s in range(5)] == [0.0765, 0.1414, 0.1848, 0.2, 0.2]
    assert lambda0_at(sine, 3) == pytest.approx(0.2)
    two = TrainConfig(lambda0_schedule="two-stage", **base)
    assert [lambda0_at(two, s) for s in range(6)] == [0, 0, 0, 0, 0.2, 0.2]
    assert lr_factor(0, 2, 10) == 0.5 and lr_factor(1, 2, 10) == 1.0 and lr_factor(10, 2, 10) == pytest.approx(0.0)


def test_bad_options_are_one_line_config_errors():
    with pytest.raises(ConfigError, match="--data"):
        TrainConfig()
    with pytest.raises(ConfigError, match="--medusa-mode"):
        TrainConfig(data="x", mode="medusa3")
    with pytest.raises(ConfigError, match="unknown train option"):
        TrainConfig.from_dict({"data": "x", "hedas": 3})
    with pytest.raises(ConfigError, match="--merge-adapter"):
        TrainConfig(data="x", merge_adapter=True)
