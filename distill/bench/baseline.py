"""Bare vLLM on the benchmark's prompts: the decoding a user runs instead of ours (``distill bench --vllm``).

The same model, dtype and prompt token ids, greedy, the same ``max_tokens`` and stop tokens as
the engine's plain runs, one prompt at a time (batch 1), through the vLLM engine ``distill
generate`` runs (:class:`~distill.generate.backends.VLLMBackend`: on a CPU the engine core
in-process and eager, the settings measured fastest there; on a GPU vLLM's defaults). Its
tokens/s is what ``vllm serve`` of the model would give one user, without the HTTP layer.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

from distill.errors import ConfigError


class VllmBaseline:
    """A :class:`~distill.generate.backends.VLLMBackend` decoding the benchmark's greedy baseline runs."""

    def __init__(self, backend):
        self.backend = backend

    @classmethod
    @functools.lru_cache(maxsize=1)  # one vLLM engine per process: a second benchmark on the same model reuses it
    def start(cls, model_path: str | Path, dtype: str, device: str, max_model_len: int, seed: int = 0) -> "VllmBaseline":
        """``max_model_len``: the model's context (:func:`distill.models.context_limit`), as every stage uses.
        A vLLM that cannot import or start raises :class:`~distill.errors.BackendError` saying why."""
        from distill.generate.backends import BackendOptions, VLLMBackend

        return cls(VLLMBackend(Path(model_path), BackendOptions(seed=seed, dtype=dtype, device=device, max_model_len=max_model_len)))

    def check_stops(self, stop_ids: set[int] | frozenset[int]) -> None:
        """The engine's stop tokens must be vLLM's, or the two decode different lengths of the same text."""
        if set(stop_ids) != set(self.backend.stop_ids):
            raise ConfigError(f"--vllm: the engine stops at tokens {sorted(stop_ids)}, vLLM at {sorted(self.backend.stop_ids)}: "
                              "the two would not decode the same replies")

    def generate(self, ids: list[int], max_tokens: int) -> tuple[list[int], float, str]:
        """Greedy decoding of one prompt -> (token ids, wall seconds of the call, finish reason)."""
        from distill.generate.backends import Request

        t0 = time.perf_counter()
        (out,) = self.backend.generate([Request(prompt_ids=list(ids), max_new_tokens=max_tokens, seed=0, topk=0, temperature=0.0)])
        return out.token_ids, time.perf_counter() - t0, out.finish_reason


__all__ = ["VllmBaseline"]
