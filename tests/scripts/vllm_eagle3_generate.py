"""Load a base model with an EAGLE-3 drafter in the real vLLM engine, generate, and print a JSON line.

Usage: python vllm_eagle3_generate.py MODEL_DIR DRAFTER_DIR NUM_SPECULATIVE_TOKENS [PROMPT]
(run in its own process: the test session already holds a vLLM engine).
"""

import json
import sys


def main(model_dir: str, drafter_dir: str, k: int, prompt: str) -> None:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, speculative_config={"method": "eagle3", "model": drafter_dir, "num_speculative_tokens": k},
              enforce_eager=True, dtype="float32", max_model_len=512, seed=0, disable_log_stats=False)
    out = llm.generate([prompt], SamplingParams(max_tokens=32, temperature=0.0), use_tqdm=False)
    metrics = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode_num"):
            metrics[m.name] = getattr(m, "value", None)
    spec = llm.llm_engine.vllm_config.speculative_config
    plain = None
    print("RESULT " + json.dumps({"text": out[0].outputs[0].text, "token_ids": list(out[0].outputs[0].token_ids),
                                  "method": spec.method if spec else None, "metrics": metrics, "plain": plain}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else "The capital of France is")
