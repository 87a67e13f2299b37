"""Seed readers: every seed format, normalized to the Conversation contract at the edge.

``load_seed(spec, format=None)`` resolves ``NAME | PATH | hf:DATASET_ID[:split]`` to a
:class:`SeedSource`; iterating it yields exactly one :class:`~distill.conversation.Conversation`
or :class:`~distill.conversation.Rejection` per seed row, in order. Reason codes of
rejections are listed in :data:`REASONS`.
"""

from __future__ import annotations

from distill.seeds.formats import FORMATS, SEED_FORMATS, detect_format
from distill.seeds.normalize import REASONS, ROLE_MAP, normalize
from distill.seeds.registry import ID_FIELDS, REGISTERED, SeedSource, available_seeds, load_seed

__all__ = [
    "FORMATS",
    "ID_FIELDS",
    "REASONS",
    "REGISTERED",
    "ROLE_MAP",
    "SEED_FORMATS",
    "SeedSource",
    "available_seeds",
    "detect_format",
    "load_seed",
    "normalize",
]
