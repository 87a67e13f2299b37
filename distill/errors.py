"""The one place for distill's exceptions.

Every error subclasses a built-in exception so library callers can catch it
naturally; ``distill.cli`` turns any :class:`DistillError` into a one-line
message (tracebacks only with ``--debug``).
"""

from __future__ import annotations


class DistillError(Exception):
    """Base class: an error with a message meant for the user."""


class ConfigError(DistillError, ValueError):
    """A bad option, a bad pipeline file, or a config that contradicts an existing output."""


class SeedError(DistillError, ValueError):
    """A seed source that cannot be read at all (single bad rows are rejected, not raised)."""


class ModelError(DistillError, OSError):
    """A model that cannot be found, fetched, converted or loaded."""


class HubUnreachableError(ModelError):
    """The Hugging Face Hub (or the configured HF_ENDPOINT) cannot be reached."""


class BackendError(DistillError, RuntimeError):
    """A generation backend that is missing or failed."""


class StoreError(DistillError, OSError):
    """A shard folder that is inconsistent, corrupted, or belongs to another run."""


class TemplateError(DistillError, ValueError):
    """A chat template whose renderings cannot be joined at the token level."""


class PushError(DistillError, RuntimeError):
    """A dataset that cannot be pushed to the Hub (invalid data, no token, a refused upload)."""
