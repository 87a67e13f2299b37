"""``distill serve``: an OpenAI-compatible HTTP server over the distill engine (or vLLM with the heads)."""

from distill.serve.config import ServeConfig
from distill.serve.server import build_app, serve, vllm_command, vllm_env

__all__ = ["ServeConfig", "build_app", "serve", "vllm_command", "vllm_env"]
