"""Training Medusa heads or an EAGLE-3 drafter on self-distilled shards (``distill train-heads``)."""

from distill.train.config import TrainConfig
from distill.train.trainer import TrainSummary, Trainer, read_metrics, train

__all__ = ["TrainConfig", "TrainSummary", "Trainer", "read_metrics", "train"]
