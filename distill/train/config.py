"""The configs of ``distill train-heads`` (stored with the heads it produced) and ``distill calibrate``.

Torch-free to import, like every stage's config module: ``--help`` and unknown options never wait for torch
(building a ``TrainConfig`` does: its EAGLE-3 options are checked by the drafter's own parsers)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from distill.configs import config_from_options
from distill.errors import ConfigError, check_choice
from distill.runtime import canonical_dtype

ARCHS = ("medusa", "eagle3")
MODES = ("medusa1", "medusa2")
TARGETS = ("hard", "soft")
LAMBDA0_SCHEDULES = ("sine", "two-stage", "constant")
PRECISIONS = ("auto", "fp32", "bf16")
PRECISION_DTYPES = {"auto": "auto", "fp32": "float32", "bf16": "bfloat16"}  # --precision -> distill.runtime dtype
OPTIMIZERS = ("auto", "adamw", "adamw8bit")
REPORT_TO = ("tensorboard", "wandb", "none")
#: The tree a drafter is measured with when none is asked for: calibrate's --nodes and --ranks, and what train-heads'
#: held-out evaluation builds (--eval-nodes), so the two give one figure for one drafter.
TREE_NODES = 63
TREE_RANKS = 10
NO_EVAL = "none"  # --eval-data none: no held-out evaluation, even beside a split folder's train side

# Fields that may differ between a run and its --resume without changing the run (``out``: where the run's folder is
# now, moved or copied since, e.g. onto storage every machine of a larger launch shares).
RESUME_FREE = ("resume", "stop_after", "progress", "save_every", "keep_checkpoints", "log_every", "report_to", "out")


@dataclass
class TrainConfig:
    """Everything ``distill train-heads`` does is decided here.

    ``arch`` picks what trains: ``medusa`` (heads; ``mode``, ``heads``, ``layers``,
    ``share_lm_head`` and the LoRA options apply) or ``eagle3`` (one drafter layer;
    ``ttt_steps``, ``draft_vocab``, ``aux_layers`` and ``feature_loss`` apply). ``decay``
    weighs Medusa head k by decay^k and EAGLE-3 step j (0-based) by decay^j.

    ``steps`` is the number of optimizer steps of the whole run (0: one pass over the
    data, ``epochs`` times); ``stop_after`` ends this invocation early (a checkpoint is
    written) so a later ``resume`` continues the same run.

    ``eval_data`` (by default the eval side of a split ``data`` folder) is measured every
    ``eval_every`` steps and at the end, as ``distill calibrate`` measures a drafter (the same
    functions, the same figure), and the best weights by that figure are kept in ``OUT/best``.
    """

    data: str = ""
    out: str = "out/heads"
    model: str | None = None  # None: the bundled SmolLM2-135M-Instruct
    arch: str = "medusa"  # medusa | eagle3
    mode: str = "medusa1"
    targets: str = "hard"
    heads: int = 4
    layers: int = 1
    share_lm_head: bool = False
    max_len: int = 512
    context: int = 0  # tokens of history carried into each following window of a long conversation (no targets)
    batch_size: int = 4
    grad_accum: int = 1
    steps: int = 0
    epochs: int = 1
    lr: float = 1e-3  # heads' learning rate; the backbone (LoRA) gets lr / heads_lr_ratio
    heads_lr_ratio: float = 4.0
    weight_decay: float = 0.0
    warmup_steps: int = 0
    max_grad_norm: float = 1.0
    decay: float = 0.8  # Medusa-1 head weight decay^k; EAGLE-3 step weight decay^j
    ttt_steps: int = 3  # eagle3: training-time-test steps unrolled (draft depths trained)
    draft_vocab: str | int = "auto"  # eagle3: auto (>= 99% of generated tokens) | N most frequent | 0 (full vocabulary); kept as text
    aux_layers: str | list[int] = "auto"  # eagle3: target layers fused (auto: 2, N//2, N-3) or ids like "2,15,27" (or a list); kept as text
    feature_loss: float = 0.0  # eagle3: weight of EAGLE-1's smooth-L1 feature loss (0: off, as EAGLE-3)
    loss_chunk: int = 128  # time positions per loss chunk (memory grows with it, not with T)
    lambda0: float = 0.2
    lambda0_schedule: str = "sine"
    lambda0_warmup: int = 0  # steps of the λ0 ramp (sine) or of stage 1 (two-stage)
    lora_r: int = 32
    lora_alpha: int = 16
    lora_dropout: float = 0.05
    lora_targets: str = "all-linear"  # peft target_modules: "all-linear" or comma-separated names
    merge_adapter: bool = False
    gradient_checkpointing: bool = False  # medusa2: recompute backbone activations
    shuffle_buffer: int = 0  # examples; 0 keeps the shard order
    pack: bool = False  # lay windows end to end in rows of max_len (no padding compute)
    precision: str = "auto"  # auto: the data's teacher dtype; bf16 on CPUs only where native (distill.runtime)
    optimizer: str = "auto"  # auto = adamw; adamw8bit (bitsandbytes, GPU) only when asked
    seed: int = 0
    save_every: int = 0  # optimizer steps between checkpoints (0: only at the end)
    keep_checkpoints: int = 2  # newest checkpoints kept on disk (0: keep every one)
    log_every: int = 1
    resume: bool = False
    stop_after: int = 0  # stop this invocation after N optimizer steps (0: run to the end)
    progress: bool = True
    # held-out evaluation: "" the eval side of a split --data folder (none without one) | a dataset or split folder | none
    eval_data: str = ""
    eval_every: int = 200  # optimizer steps between evaluations (0: only at the end of the run)
    eval_tokens: int = 8192  # held-out input tokens per evaluation, whole batches (0: all)
    eval_nodes: int = TREE_NODES  # node budget of the sparse tree whose expected tokens/step picks the best checkpoint
    report_to: str = "tensorboard"  # tensorboard | wandb | none: accelerate's tracker, beside metrics.jsonl

    def __post_init__(self) -> None:
        if not self.data:
            raise ConfigError("--data is required: a dataset folder made by `distill generate`")
        check_choice("--arch", self.arch, ARCHS)
        check_choice("--medusa-mode", self.mode, MODES)
        check_choice("--targets", self.targets, TARGETS)
        check_choice("--lambda0-schedule", self.lambda0_schedule, LAMBDA0_SCHEDULES)
        check_choice("--precision", self.precision, PRECISIONS)
        check_choice("--optimizer", self.optimizer, OPTIMIZERS)
        check_choice("--report-to", self.report_to, REPORT_TO)
        self._check_arch_options()
        for name in ("heads", "layers", "batch_size", "grad_accum", "epochs", "loss_chunk", "log_every", "lora_r", "ttt_steps",
                     "eval_nodes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1; got {getattr(self, name)}")
        if not 0 <= self.context <= self.max_len // 2:
            raise ConfigError(f"--context must be between 0 and --max-len / 2 ({self.max_len // 2}); got {self.context}")
        ahead = self.heads if self.arch == "medusa" else self.ttt_steps
        if self.max_len < ahead + 2:
            what = "--heads" if self.arch == "medusa" else "--ttt-steps"
            raise ConfigError(f"--max-len ({self.max_len}) must exceed {what} + 1 so every {'head' if self.arch == 'medusa' else 'step'} has a target")
        for name in ("steps", "warmup_steps", "lambda0_warmup", "save_every", "keep_checkpoints", "stop_after", "shuffle_buffer",
                     "eval_every", "eval_tokens"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 0; got {getattr(self, name)}")
        if self.lr <= 0 or self.heads_lr_ratio <= 0:
            raise ConfigError(f"--lr and --heads-lr-ratio must be > 0; got {self.lr}, {self.heads_lr_ratio}")
        if not 0 < self.decay <= 1:
            raise ConfigError(f"--decay must be in (0, 1]; got {self.decay}")
        if self.lambda0 < 0 or not 0 <= self.lora_dropout < 1:
            raise ConfigError(f"--lambda0 must be >= 0 and --lora-dropout in [0, 1); got {self.lambda0}, {self.lora_dropout}")
        if self.feature_loss < 0:
            raise ConfigError(f"--feature-loss must be >= 0; got {self.feature_loss}")
        if self.merge_adapter and self.mode != "medusa2":
            raise ConfigError("--merge-adapter only applies to --medusa-mode medusa2 (Medusa-1 leaves the backbone untouched)")

    def _check_arch_options(self) -> None:
        """Canonical forms of the EAGLE-3 options; an option of the other architecture set away from its default is an error."""
        from distill.heads.eagle import parse_aux_layers_spec  # torch: imported when a config is built, not for --help
        from distill.train.draft_vocab import parse_draft_vocab

        self.draft_vocab = parse_draft_vocab(self.draft_vocab)
        self.aux_layers = parse_aux_layers_spec(self.aux_layers)
        if self.arch == "medusa":
            other = {"ttt_steps": 3, "draft_vocab": "auto", "aux_layers": "auto", "feature_loss": 0.0}
        else:
            other = {"mode": "medusa1", "heads": 4, "layers": 1, "share_lm_head": False}
        changed = [k for k, default in other.items() if getattr(self, k) != default]
        if changed:
            flags = {"mode": "medusa-mode", "heads": "num-heads"}  # the flags these fields have (docs/cli.md)
            names = ", ".join("--" + flags.get(k, k.replace("_", "-")) for k in changed)
            owner = "eagle3" if self.arch == "medusa" else "medusa"
            raise ConfigError(f"{names} only appl{'ies' if len(changed) == 1 else 'y'} to --arch {owner} (this run is --arch {self.arch})")

    def to_dict(self) -> dict:
        return asdict(self)

    def run_key(self) -> dict:
        """The fields that define the run (a --resume must match them)."""
        return {k: v for k, v in self.to_dict().items() if k not in RESUME_FREE}

    @classmethod
    def from_dict(cls, data: dict) -> "TrainConfig":
        return config_from_options(cls, data, "train")


@dataclass
class CalibrateConfig:
    heads: str
    data: str
    out: str | None = None  # default: the heads folder
    model: str | None = None  # default: the base model recorded with the heads (merged backbone for Medusa-2)
    nodes: int = TREE_NODES
    ranks: int = TREE_RANKS
    max_len: int = 512
    batch_size: int = 4
    max_tokens: int = 0
    plots: bool = True
    dtype: str = "auto"  # auto: the heads' teacher dtype (distill.runtime.stage_dtype)
    device: str = "auto"

    def __post_init__(self) -> None:
        self.dtype = canonical_dtype(self.dtype)
        if self.nodes < 1:
            raise ConfigError(f"--nodes must be >= 1; got {self.nodes}")
        if not 1 <= self.ranks <= 10:
            raise ConfigError(f"--ranks must be between 1 and 10; got {self.ranks}")
        if self.max_len < 3 or self.batch_size < 1 or self.max_tokens < 0:
            raise ConfigError("--max-len must be >= 3, --batch-size >= 1, --eval-tokens >= 0")
