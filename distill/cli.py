"""The ``distill`` command line: a thin typer layer over the library.

Options are shared ``Annotated`` types; every command validates, makes one library
call, and prints. Any :class:`distill.errors.DistillError` becomes one line on
stderr and exit code 2 (``--debug`` shows the traceback).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
import yaml
from rich.console import Console

from distill.errors import ConfigError, DistillError

app = typer.Typer(
    name="distill",
    help="Self-distilled data, Medusa heads and fast serving for chat models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
model_app = typer.Typer(help="The bundled default model and model folders.", no_args_is_help=True)
app.add_typer(model_app, name="model")
console = Console(stderr=True)
_state = {"debug": False}

ConfigOpt = Annotated[Optional[Path], typer.Option("--config", "-c", help="Pipeline YAML (pipelines/NAME.yaml); CLI options override it.")]
ModelOpt = Annotated[Optional[str], typer.Option("--model", "-m", help="Bundled default (omit), a local HF folder, or a Hub id.")]
OutOpt = Annotated[Optional[Path], typer.Option("--out", "-o", help="Output folder for shards, manifest.json and rejects.jsonl.")]


@app.callback()
def _main(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show the engines' own INFO logs.")] = False,
) -> None:
    _state["debug"] = debug or bool(os.environ.get("DISTILL_DEBUG"))
    # Engine logs go to stderr (stdout carries results) and stay at WARNING unless asked for.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO" if verbose else "WARNING")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "info" if verbose else "error")


def load_pipeline(path: Path | None, section: str) -> dict:
    """Read one stage's section of a pipeline YAML (a flat file is taken as that section)."""
    if path is None:
        return {}
    if not path.is_file():
        raise ConfigError(f"pipeline file {path} not found")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of options")
    section_data = data.get(section, data)
    if not isinstance(section_data, dict):
        raise ConfigError(f"{path}: '{section}' must be a mapping of options")
    return section_data


@app.command()
def generate(
    config: ConfigOpt = None,
    seed: Annotated[Optional[str], typer.Option(help="Seed data: sharegpt | chitchat | mt-bench | ultrachat | PATH | hf:DATASET[:split].")] = None,
    seed_format: Annotated[Optional[str], typer.Option(help="Force the seed format instead of detecting it.")] = None,
    out: OutOpt = None,
    model: ModelOpt = None,
    backend: Annotated[Optional[str], typer.Option(help="auto (vLLM when installed) | vllm | hf.")] = None,
    mode: Annotated[Optional[str], typer.Option(help="multi-turn | self-talk | single-turn.")] = None,
    turns: Annotated[Optional[int], typer.Option(help="self-talk: max assistant turns; multi-turn: replay at most N user turns (0 = all).")] = None,
    temperature: Annotated[Optional[float], typer.Option(help="Sampling temperature (0 = greedy).")] = None,
    top_p: Annotated[Optional[float], typer.Option(help="Nucleus sampling threshold.")] = None,
    max_new_tokens: Annotated[Optional[int], typer.Option(help="Max new tokens per turn.")] = None,
    max_model_len: Annotated[Optional[int], typer.Option(help="Context-length guard (default: the model's).")] = None,
    topk: Annotated[Optional[int], typer.Option(help="Teacher candidates stored per generated token.")] = None,
    sampling_seed: Annotated[Optional[int], typer.Option(help="Random seed of sampling (per-request seeds derive from it).")] = None,
    system_prompt: Annotated[Optional[str], typer.Option(help="System prompt for seed rows that have none.")] = None,
    user_prompt: Annotated[Optional[str], typer.Option(help="self-talk user-simulator prompt: a file in prompts/ or a path.")] = None,
    shard_size: Annotated[Optional[int], typer.Option(help="Conversations per shard (and per engine batch).")] = None,
    limit: Annotated[Optional[int], typer.Option(help="Only the first N seed rows.")] = None,
    dtype: Annotated[Optional[str], typer.Option(help="auto | float32 | bfloat16 | float16.")] = None,
    batch_size: Annotated[Optional[int], typer.Option(help="hf backend: sequences per generate call.")] = None,
    tensor_parallel_size: Annotated[Optional[int], typer.Option(help="vLLM tensor parallelism (GPUs).")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")] = False,
) -> None:
    """Regenerate seed conversations with the model; write shards with its top-k logprobs."""
    from distill.generate import GenerateConfig, Generator

    given = {k: v for k, v in locals().items() if k not in ("config", "quiet", "GenerateConfig", "Generator") and v is not None}
    options = {**load_pipeline(config, "generate"), **{k: str(v) if isinstance(v, Path) else v for k, v in given.items()}}
    cfg = GenerateConfig.from_dict(options)
    with _progress(quiet) as progress:
        summary = Generator(cfg, progress=progress).run()
    _print_summary(summary)


class _progress:
    """A rich progress bar fed by the generator's (conversations, tokens) callback."""

    def __init__(self, quiet: bool):
        self.quiet = quiet or not sys.stderr.isatty() and not os.environ.get("DISTILL_PROGRESS")

    def __enter__(self):
        if self.quiet:
            return None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        self.bar = Progress(
            TextColumn("[bold]generate"), BarColumn(), MofNCompleteColumn(), TextColumn("conversations"),
            TextColumn("{task.fields[tps]:>8.1f} tok/s"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
            console=console, transient=False,
        )
        self.bar.start()
        self.task = self.bar.add_task("generate", total=None, tps=0.0)
        self.tokens = 0
        import time

        self.t0 = time.monotonic()
        return self.update

    def update(self, conversations: int, tokens: int, total: int | None = None) -> None:
        import time

        self.tokens += tokens
        rate = self.tokens / max(time.monotonic() - self.t0, 1e-6)
        if total is not None:
            self.bar.update(self.task, total=total)
        self.bar.update(self.task, advance=conversations, tps=rate)

    def __exit__(self, *exc) -> None:
        if not self.quiet:
            self.bar.stop()


def _print_summary(s) -> None:
    typer.echo(
        f"{s.out}: {s.generated} generated + {s.rejected} rejected + {s.skipped} skipped = {s.seed_rows} seed rows"
        + ("" if s.balanced else f" (+{s.pending} pending)")
    )
    typer.echo(
        f"  {s.generated_tokens:,} generated tokens, {s.prompt_tokens:,} prompt tokens; this run: "
        f"{s.new_conversations} conversations, {s.new_tokens:,} tokens in {s.seconds:.1f}s"
        + (f" ({s.new_tokens / s.seconds:.1f} tok/s)" if s.new_tokens and s.seconds else "")
    )
    if s.rejects_by_reason:
        typer.echo("  rejects: " + ", ".join(f"{k} {v}" for k, v in sorted(s.rejects_by_reason.items())))
    typer.echo(f"  rejects: {s.out}/rejects.jsonl, manifest: {s.out}/manifest.json")


@model_app.command("prepare")
def model_prepare(
    model: ModelOpt = None,
    force: Annotated[bool, typer.Option(help="Rebuild the bundled conversion even if it checks out.")] = False,
) -> None:
    """Resolve a model to a local folder (converting the bundled GGUF once) and print it."""
    from distill.models import convert_bundled, resolve_model

    if force and not model:
        convert_bundled(force=True)
    resolved = resolve_model(model)
    typer.echo(json.dumps({"name": resolved.name, "path": str(resolved.path), "id": resolved.model_id, "revision": resolved.revision}))


@app.command("seeds")
def seeds_list() -> None:
    """List the registered seed names."""
    from distill.seeds import available_seeds

    for name, desc in available_seeds().items():
        typer.echo(f"{name:12s} {desc}")


# == data commands: distill data ..., distill push (issue 3) ==


# == training commands: distill train-heads, calibrate, export (issue 4) ==


# == serving commands: distill serve, bench (issue 5) ==


# == pipeline command: distill run (issue 6) ==


def main() -> None:
    try:
        app()
    except DistillError as exc:
        if _state["debug"]:
            raise
        typer.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        typer.echo("interrupted; run the same command again to resume", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
