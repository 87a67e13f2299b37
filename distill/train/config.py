"""The one config of ``distill train-heads`` (stored with the heads it produced)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from distill.configs import config_from_options
from distill.errors import ConfigError

MODES = ("medusa1", "medusa2")
TARGETS = ("hard", "soft")
LAMBDA0_SCHEDULES = ("sine", "two-stage", "constant")
PRECISIONS = ("auto", "fp32", "bf16")
PRECISION_DTYPES = {"auto": "auto", "fp32": "float32", "bf16": "bfloat16"}  # --precision -> distill.runtime dtype
OPTIMIZERS = ("auto", "adamw", "adamw8bit")

# Fields that may differ between a run and its --resume without changing the run.
RESUME_FREE = ("resume", "stop_after", "progress", "save_every", "keep_checkpoints", "log_every")


@dataclass
class TrainConfig:
    """Everything ``distill train-heads`` does is decided here.

    ``steps`` is the number of optimizer steps of the whole run (0: one pass over the
    data, ``epochs`` times); ``stop_after`` ends this invocation early (a checkpoint is
    written) so a later ``resume`` continues the same run.
    """

    data: str = ""
    out: str = "out/heads"
    model: str | None = None  # None: the bundled SmolLM2-135M-Instruct
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
    decay: float = 0.8  # Medusa-1 head weight decay^k
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
    optimizer: str = "auto"  # auto: 8-bit AdamW when bitsandbytes and a GPU are there
    seed: int = 0
    save_every: int = 0  # optimizer steps between checkpoints (0: only at the end)
    keep_checkpoints: int = 2  # newest checkpoints kept on disk (0: keep every one)
    log_every: int = 1
    resume: bool = False
    stop_after: int = 0  # stop this invocation after N optimizer steps (0: run to the end)
    progress: bool = True

    def __post_init__(self) -> None:
        if not self.data:
            raise ConfigError("--data is required: a dataset folder made by `distill generate`")
        if self.mode not in MODES:
            raise ConfigError(f"--mode must be one of {', '.join(MODES)}; got '{self.mode}'")
        if self.targets not in TARGETS:
            raise ConfigError(f"--targets must be one of {', '.join(TARGETS)}; got '{self.targets}'")
        if self.lambda0_schedule not in LAMBDA0_SCHEDULES:
            raise ConfigError(f"--lambda0-schedule must be one of {', '.join(LAMBDA0_SCHEDULES)}; got '{self.lambda0_schedule}'")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"--precision must be one of {', '.join(PRECISIONS)}; got '{self.precision}'")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}; got '{self.optimizer}'")
        for name in ("heads", "layers", "batch_size", "grad_accum", "epochs", "loss_chunk", "log_every", "lora_r"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1; got {getattr(self, name)}")
        if not 0 <= self.context <= self.max_len // 2:
            raise ConfigError(f"--context must be between 0 and --max-len / 2 ({self.max_len // 2}); got {self.context}")
        if self.max_len < self.heads + 2:
            raise ConfigError(f"--max-len ({self.max_len}) must exceed --heads + 1 so every head has a target")
        for name in ("steps", "warmup_steps", "lambda0_warmup", "save_every", "keep_checkpoints", "stop_after", "shuffle_buffer"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 0; got {getattr(self, name)}")
        if self.lr <= 0 or self.heads_lr_ratio <= 0:
            raise ConfigError(f"--lr and --heads-lr-ratio must be > 0; got {self.lr}, {self.heads_lr_ratio}")
        if not 0 < self.decay <= 1:
            raise ConfigError(f"--decay must be in (0, 1]; got {self.decay}")
        if self.lambda0 < 0 or not 0 <= self.lora_dropout < 1:
            raise ConfigError(f"--lambda0 must be >= 0 and --lora-dropout in [0, 1); got {self.lambda0}, {self.lora_dropout}")
        if self.merge_adapter and self.mode != "medusa2":
            raise ConfigError("--merge-adapter only applies to --mode medusa2 (Medusa-1 leaves the backbone untouched)")

    def to_dict(self) -> dict:
        return asdict(self)

    def run_key(self) -> dict:
        """The fields that define the run (a --resume must match them)."""
        return {k: v for k, v in self.to_dict().items() if k not in RESUME_FREE}

    @classmethod
    def from_dict(cls, data: dict) -> "TrainConfig":
        return config_from_options(cls, data, "train")
