"""Inference engine: plain, Medusa and EAGLE (tree) decoding with greedy, typical and rejection acceptance.

``Engine.from_pretrained(model, heads, EngineConfig(...)).generate(prompts, params)``, or
``engine.running_batch()`` for continuous batching; see
:mod:`distill.engine.batch` for the decoding step, :mod:`distill.engine.target` for the model it runs,
:mod:`distill.engine.config` for its settings, :mod:`distill.engine.proposers` for what drafts
the trees (the contract in :mod:`distill.engine.proposers.base`; Medusa, EAGLE, lookup and their
union), :mod:`distill.engine.tree` for tree buffers
and named trees, :mod:`distill.engine.acceptance` for the acceptance rules and
:mod:`distill.engine.policy` for when to speculate, :mod:`distill.engine.logits` for what a request's sampling
options (penalties, bias, min_tokens) do to the logits and for logprobs.
"""

from distill import lazy_exports

# Exported lazily: a submodule (the lookup's constants, the step-cost cache) loads without the engine and
# transformers with it (``distill serve --engine vllm --print-command`` reads a few constants).
_EXPORTS = {name: "distill.engine.engine" for name in ("Engine", "GenerationResult", "RunningBatch", "SamplingParams",
                                                        "StepStats")} | {"EngineConfig": "distill.engine.config",
                                                                         "TokenLogprob": "distill.engine.logits"}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
