"""Import what distill's processes import, once, so that Python writes its bytecode (scripts/setup.sh).

Every module of distill, and the modules its commands import lazily (vLLM's engine, server, model and
speculative decoding code; transformers' Llama; the test tools). One that fails to import (an extra
that is not installed, a GPU-only module) is skipped: this only saves later processes compile time.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import warnings

LAZY = [
    "vllm", "vllm.entrypoints.llm", "vllm.v1.engine.llm_engine", "vllm.v1.engine.core", "vllm.v1.engine.core_client",
    "vllm.entrypoints.openai.api_server", "vllm.benchmarks.serve", "vllm.model_executor.models.llama",
    "vllm.model_executor.models.llama_eagle3", "vllm.model_executor.models.medusa", "vllm.v1.spec_decode.eagle",
    "vllm.v1.spec_decode.medusa", "vllm.v1.worker.cpu_worker", "vllm.v1.worker.cpu_model_runner",
    "transformers.models.llama.modeling_llama", "transformers.models.auto.modeling_auto",
    "transformers.models.auto.tokenization_auto", "transformers.generation.utils",
    "peft", "accelerate", "datasets", "pyarrow.parquet", "fastapi", "uvicorn", "openai", "httpx", "s3fs", "huggingface_hub",
    "matplotlib.pyplot", "pytest", "xdist", "moto.server",
]


def main() -> int:
    warnings.simplefilter("ignore")
    import distill

    names = [m.name for m in pkgutil.walk_packages(distill.__path__, "distill.")] + LAZY
    failed = []
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - skipped, named below
            failed.append(f"{name} ({type(exc).__name__})")
    print(f"setup: bytecode written for {len(sys.modules)} modules" + (f"; not importable here: {', '.join(failed)}" if failed else ""),
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
