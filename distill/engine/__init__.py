"""Inference engine: plain, Medusa and EAGLE (tree) decoding with greedy, typical and rejection acceptance.

``Engine.from_pretrained(model, heads, EngineConfig(...)).generate(prompts, params)``, or
``engine.running_batch()`` for continuous batching; see
:mod:`distill.engine.engine` for the decoding step, :mod:`distill.engine.proposer` for the proposer
contract (:mod:`distill.engine.medusa`, :mod:`distill.engine.eagle`, :mod:`distill.engine.lookup`,
:mod:`distill.engine.union`), :mod:`distill.engine.tree` for tree buffers
and named trees, :mod:`distill.engine.acceptance` for the acceptance rules and
:mod:`distill.engine.policy` for when to speculate, :mod:`distill.engine.logits` for what a request's sampling
options (penalties, bias, min_tokens) do to the logits and for logprobs.
"""

from distill.engine.engine import Engine, EngineConfig, GenerationResult, RunningBatch, SamplingParams, StepStats
from distill.engine.logits import TokenLogprob

__all__ = ["Engine", "EngineConfig", "GenerationResult", "RunningBatch", "SamplingParams", "StepStats", "TokenLogprob"]
