"""Bare vLLM on the benchmark's prompts: the decoding a user runs instead of ours (``distill bench --vllm``).

The same model, dtype and prompt token ids, greedy, the same ``max_tokens`` and stop tokens as
the engine's plain runs, one prompt at a time (batch 1), through ``vllm.LLM`` in this process:
on a CPU with the engine core in-process and eager (:func:`distill.runtime.configure_vllm`, the
settings ``distill generate`` measured fastest there), on a GPU with vLLM's defaults. Its
tokens/s is what ``vllm serve`` of the model would give one user, without the HTTP layer.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

from distill.errors import BackendError


class VllmBaseline:
    """One ``vllm.LLM`` for the benchmark's greedy baseline runs."""

    def __init__(self, llm):
        self.llm = llm

    @classmethod
    @functools.lru_cache(maxsize=1)  # one vLLM engine per process: a second benchmark on the same model reuses it
    def start(cls, model_path: str | Path, dtype: str, device: str, max_model_len: int, seed: int = 0) -> "VllmBaseline":
        """``max_model_len``: the model's context (:func:`distill.models.context_limit`), as every stage uses."""
        from distill.runtime import configure_vllm

        configure_vllm(device, offline=True)
        try:
            from vllm import LLM
        except Exception as exc:  # noqa: BLE001 - a broken install is reported, not hidden
            raise BackendError(f"--vllm needs vLLM, which failed to import ({type(exc).__name__}: {exc}); "
                               "on a CPU run scripts/setup.sh") from exc
        try:
            llm = LLM(model=str(model_path), dtype=dtype, seed=seed, enforce_eager=device == "cpu",
                      max_model_len=max_model_len)
        except Exception as exc:  # noqa: BLE001
            raise BackendError(f"vLLM could not start on {model_path}: {type(exc).__name__}: {exc}") from exc
        return cls(llm)

    def generate(self, ids: list[int], max_tokens: int, stop_ids: set[int]) -> tuple[list[int], float, str]:
        """Greedy decoding of one prompt -> (token ids, wall seconds of the call, finish reason)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, detokenize=False, stop_token_ids=sorted(stop_ids))
        t0 = time.perf_counter()
        (out,) = self.llm.generate([TokensPrompt(prompt_token_ids=list(ids))], params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        completion = out.outputs[0]
        return list(completion.token_ids), seconds, completion.finish_reason or "length"


__all__ = ["VllmBaseline"]
