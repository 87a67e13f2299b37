"""Training Medusa heads or an EAGLE-3 drafter on self-distilled shards (``distill train-heads``)."""

from distill import lazy_exports

# Exported lazily: ``distill.train.config`` (what ``--help`` reads) must not import the trainer and torch with it.
_EXPORTS = {"TrainConfig": "distill.train.config", "TrainSummary": "distill.train.trainer", "Trainer": "distill.train.trainer",
            "read_metrics": "distill.train.trainer", "train": "distill.train.trainer"}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
