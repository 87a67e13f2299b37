"""Load a base model with Medusa heads in the real vLLM engine, generate, and print a JSON line per heads folder.

Usage: python vllm_medusa_generate.py MODEL_DIR HEADS_DIR NUM_SPECULATIVE_TOKENS [HEADS_DIR NUM_SPECULATIVE_TOKENS ...]
(run in its own process: the test session already holds a vLLM engine). Each folder gets an engine of its own, one
after the other in this process: the next is made once the last is shut down, so the process imports vLLM once.
"""

import gc
import json
import sys


def main(model_dir: str, runs: list[tuple[str, int]]) -> None:
    from vllm import LLM, SamplingParams
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    for heads_dir, k in runs:
        llm = LLM(model=model_dir, speculative_config={"method": "medusa", "model": heads_dir, "num_speculative_tokens": k},
                  enforce_eager=True, dtype="float32", max_model_len=512, seed=0, disable_log_stats=False)
        out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)
        metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode_num")}
        spec = llm.llm_engine.vllm_config.speculative_config
        print("RESULT " + json.dumps({"heads": heads_dir, "text": out[0].outputs[0].text, "n_tokens": len(out[0].outputs[0].token_ids),
                                      "method": spec.method if spec else None, "metrics": metrics}), flush=True)
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()


if __name__ == "__main__":
    args = sys.argv[2:]
    main(sys.argv[1], [(args[i], int(args[i + 1])) for i in range(0, len(args), 2)])
