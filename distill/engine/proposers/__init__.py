"""Proposers: what drafts the tree the engine verifies each step.

:mod:`~distill.engine.proposers.base` holds the contract the engine's step relies on
(``feature_layers``, ``start``, ``propose``, ``commit``); each proposer is a plain class built
from what it drafts with: :mod:`~distill.engine.proposers.medusa` (Medusa heads and their static
tree), :mod:`~distill.engine.proposers.eagle` (an EAGLE-3 drafter's dynamic trees),
:mod:`~distill.engine.proposers.lookup` (suffix matches in the context, a datastore from
:mod:`~distill.engine.proposers.datastore` and the engine's earlier replies, scored by
:mod:`~distill.engine.proposers.suffix`) and
:mod:`~distill.engine.proposers.union` (the lookup's trees merged with a drafter's per row).
"""

from distill import lazy_exports

# Exported lazily: the lookup's constants and the datastore load without the EAGLE drafter and the heads'
# modules (``distill serve --engine vllm --print-command`` reads a few lookup constants).
_EXPORTS = (
    {name: "distill.engine.proposers.base" for name in ("DraftSampling", "DraftState", "Proposal", "Proposer",
                                                        "host_proposal")}
    | {"Medusa": "distill.engine.proposers.medusa", "Eagle": "distill.engine.proposers.eagle",
       "Lookup": "distill.engine.proposers.lookup", "LOOKUP": "distill.engine.proposers.lookup",
       "Union": "distill.engine.proposers.union"}
    | {name: "distill.engine.proposers.datastore" for name in ("Datastore", "History")}
)
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
