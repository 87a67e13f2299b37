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


def check_choice(option: str, value, choices, *, repr_value: bool = False, listed=None, note: str = "",
                 error: type[Exception] = ConfigError) -> None:
    """Raise ``error`` unless ``value`` is one of ``choices``, naming ``option`` and the choices in the message.

    The message is ``{option} must be one of a, b, c{note}; got 'value'``: the value in quotes as typed, or
    its ``repr`` with ``repr_value`` (for values that need not be strings). ``listed`` names the choices
    the message shows when the caller accepts more than this check does (another path handles the rest).
    """
    if value in choices:
        return
    shown = ", ".join(map(str, choices if listed is None else listed))
    got = repr(value) if repr_value else f"'{value}'"
    raise error(f"{option} must be one of {shown}{note}; got {got}")
