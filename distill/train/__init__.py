"""Training Medusa heads or an EAGLE-3 drafter on self-distilled shards (``distill train-heads``)."""

from importlib import import_module

# Exported lazily: ``distill.train.config`` (what ``--help`` reads) must not import the trainer and torch with it.
_EXPORTS = {"TrainConfig": "distill.train.config", "TrainSummary": "distill.train.trainer", "Trainer": "distill.train.trainer",
            "read_metrics": "distill.train.trainer", "train": "distill.train.trainer"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
