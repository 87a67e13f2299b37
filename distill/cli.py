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
from rich.console import Console
from typer.core import TyperCommand, TyperGroup

from distill.configs import stage_options
from distill.errors import ConfigError, DistillError
from distill.progress import Progress, interval_from_env


def _heads_count(value: str | None) -> str:
    """train-heads' old ``--heads N``: a count there, a folder in every other command."""
    try:
        int(value) if value is not None else None
    except ValueError:
        raise ConfigError(f"train-heads writes its folder to --out and takes the number of heads as --num-heads "
                          f"(got --heads {value})") from None
    return f"--heads {value} is deprecated in train-heads: use --num-heads {value}"


#: Old option spellings that still work, per command: hidden from --help, read exactly as the new one, and each use
#: prints one warning line on stderr. old -> new, or old -> (new, check): check(value) gives the warning or refuses.
DEPRECATED: dict[str, dict[str, object]] = {
    "generate": {"--max-new-tokens": "--max-tokens", "--sampling-seed": "--random-seed", "--topk": "--teacher-topk"},
    "train-heads": {"--heads": ("--num-heads", _heads_count), "--mode": "--medusa-mode", "--seed": "--random-seed"},
    "calibrate": {"--max-tokens": "--eval-tokens"},
    "bench": {"--seed": "--random-seed"},
    "data dedupe": {"--mode": "--match"},
    "data convert": {"--to": "--format"},
}

#: Where a command keeps what follows a literal ``--`` (``serve``: arguments for vLLM's server).
AFTER_DASHES = "distill.after_dashes"


def _command_name(ctx) -> str:
    """``data dedupe`` for ``distill data dedupe``, whatever the program is called."""
    names = []
    while ctx.parent is not None:
        names.append(ctx.info_name)
        ctx = ctx.parent
    return " ".join(reversed(names))


def _renew_spellings(args: list[str], old: dict[str, object], takes_value: set[str]) -> tuple[list[str], list[str] | None]:
    """``args`` with the deprecated spellings in ``old`` replaced (one warning line each), and what follows ``--`` (None without one).

    An option's value is never read as an option: the token after an option in ``takes_value`` is passed on as is.
    """
    out, i = [], 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            return out, args[i + 1:]
        name, eq, value = arg.partition("=") if arg.startswith("--") else (arg, "", "")
        if name in old:
            new, check = old[name] if isinstance(old[name], tuple) else (old[name], None)
            given = value if eq else args[i + 1] if i + 1 < len(args) else None
            typer.echo(f"warning: {check(given) if check else f'{name} is deprecated: use {new}'}", err=True)
            out.append(new + eq + value)
            if not eq and i + 1 < len(args):
                out.append(args[i + 1])
                i += 1
        else:
            out.append(arg)
            if arg in takes_value and i + 1 < len(args):
                out.append(args[i + 1])
                i += 1
        i += 1
    return out, None


def _plain_flags(params: list) -> list:
    """A flag takes no value: typer's rich help would print a ``<bool>`` type beside it."""
    for param in params:
        if getattr(param, "is_flag", False):
            param.metavar = ""
    return params


class _Command(TyperCommand):
    """A distill command: old spellings (:data:`DEPRECATED`) read as the new ones; usage names arguments by metavar.

    With ``passthrough``, what follows a literal ``--`` is kept in ``ctx.meta[AFTER_DASHES]`` and parsed by nobody
    here, so an unknown option before it is click's usage error instead of an argument for another program.
    """

    passthrough = False

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        takes_value = {o for p in self.get_params(ctx) if p.param_type_name == "option" and not p.is_flag and not p.count
                       for o in p.opts}
        renewed, after = _renew_spellings(list(args), DEPRECATED.get(_command_name(ctx), {}), takes_value)
        if after is not None and self.passthrough:
            ctx.meta[AFTER_DASHES] = after
        elif after is not None:
            renewed = [*renewed, "--", *after]
        return super().parse_args(ctx, renewed)

    def get_params(self, ctx) -> list:
        return _plain_flags(super().get_params(ctx))

    def collect_usage_pieces(self, ctx) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if param.param_type_name == "argument":  # DATASET, not typer's {root}
                name = (param.metavar or param.name.upper()) + ("..." if param.nargs != 1 else "")
                pieces.append(name if param.required else f"[{name}]")
            else:
                pieces.extend(param.get_usage_pieces(ctx))
        if self.passthrough:
            pieces.append("[-- ARGS...]")
        return pieces


class _PassThroughCommand(_Command):
    passthrough = True


class _Group(TyperGroup):
    def get_params(self, ctx) -> list:
        return _plain_flags(super().get_params(ctx))


class _Typer(typer.Typer):
    """A typer app whose commands are :class:`_Command` and groups :class:`_Group`."""

    def __init__(self, **kwargs):
        super().__init__(cls=_Group, **kwargs)

    def command(self, *args, cls=None, **kwargs):
        return super().command(*args, cls=cls or _Command, **kwargs)


app = _Typer(
    name="distill",
    help="Self-distilled data, speculative drafters (Medusa, EAGLE-3, lookup) and fast serving for chat models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
model_app = _Typer(help="The bundled default model and model folders.", no_args_is_help=True)
app.add_typer(model_app, name="model")
console = Console(stderr=True)
_state = {"debug": False}

ChatTemplateOpt = Annotated[Optional[str], typer.Option("--chat-template", help="Chat template that renders the prompts: a Jinja file, or the template itself (default: the model's).")]
ChatTemplateKwargsOpt = Annotated[Optional[str], typer.Option("--chat-template-kwargs", help='The chat template\'s extra variables, a JSON object, e.g. \'{"enable_thinking": false}\'.')]

QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress on stderr: no bar, no progress lines, no stage lines.")]
ConfigOpt = Annotated[Optional[Path], typer.Option("--config", "-c", help="Pipeline YAML (pipelines/NAME.yaml): this stage's section (or a flat file); --set and CLI options override it.")]
SetOpt = Annotated[Optional[list[str]], typer.Option("--set", help="Override one option: KEY=VALUE, the value read as YAML (e.g. --set max_len=256); repeatable; CLI options override it.")]
ModelOpt = Annotated[Optional[str], typer.Option("--model", "-m", help="Bundled default (omit), a local HF folder, or a Hub id.")]
DeviceOpt = Annotated[str, typer.Option("--device", help="auto (CUDA when available, else CPU) | cpu | cuda | cuda:1 ...")]
CudaGraphsOpt = Annotated[Optional[bool], typer.Option(
    "--cuda-graphs/--no-cuda-graphs", help="distill engine on a GPU: replay its decoding steps (and an EAGLE drafter's passes) "
    "as CUDA graphs, one per batch size and tree size (default: on with CUDA).")]
OutOpt = Annotated[Optional[str], typer.Option("--out", "-o", help="Output folder for shards, manifest.json and rejects.jsonl: a path, or an object-store URL (s3://BUCKET/PREFIX, gs://...).")]


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


def _one_progress_style() -> None:
    """No bar of transformers' own while a model loads (its "Loading weights"): the command's stage line says what
    loads, and off a terminal that bar's redraws would fill the log, with --quiet too. The Hub's download bars stay."""
    from transformers.utils import logging as transformers_logging

    if hasattr(transformers_logging, "set_tqdm_hook"):
        transformers_logging.set_tqdm_hook(lambda factory, args, kwargs: factory(*args, **dict(kwargs, disable=True)))


def _given(ctx: typer.Context, cls: type, rename: dict[str, str] | None = None) -> dict:
    """The options of this command given on the command line (or by environment) that are fields of ``cls``.

    Defaults are never passed on: the config dataclass holds them (and ``--help`` shows them).
    ``rename`` maps an option's name to its field's where they differ.
    """
    from distill.configs import option_hints

    names = set(option_hints(cls))
    given = {}
    for key, value in ctx.params.items():
        field = (rename or {}).get(key, key)
        source = ctx.get_parameter_source(key)  # click's ParameterSource (typer may carry its own copy of the enum)
        if field in names and getattr(source, "name", "DEFAULT") not in ("DEFAULT", "DEFAULT_MAP"):
            given[field] = value
    return given


@app.command()
def generate(
    ctx: typer.Context,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    seed: Annotated[Optional[str], typer.Option(help="Seed data: sharegpt | chitchat | mt-bench | ultrachat | PATH | hf:DATASET[:split].")] = None,
    seed_format: Annotated[Optional[str], typer.Option(help="Force the seed format instead of detecting it.")] = None,
    out: OutOpt = None,
    model: ModelOpt = None,
    backend: Annotated[Optional[str], typer.Option(help="auto (vLLM when installed) | vllm | hf | openai (running vLLM OpenAI servers: --server).")] = None,
    mode: Annotated[Optional[str], typer.Option(help="multi-turn (replay the seed's user turns) | self-talk (the model plays the user too) | single-turn.")] = None,
    turns: Annotated[Optional[int], typer.Option(help="Turns per conversation at most. self-talk: assistant turns (default 4); multi-turn: seed user turns replayed (default 64; 0 = all), a longer seed row ending as truncated_turns.")] = None,
    temperature: Annotated[Optional[float], typer.Option(help="Sampling temperature (0 = greedy).")] = None,
    top_p: Annotated[Optional[float], typer.Option(help="Nucleus sampling threshold.")] = None,
    top_k: Annotated[Optional[int], typer.Option(help="Sample from the K most likely tokens only (0 = all); not --teacher-topk. The stored teacher top-k stays the raw model's.")] = None,
    min_p: Annotated[Optional[float], typer.Option(help="Drop tokens less likely than MIN_P x the most likely one (0 = none).")] = None,
    repetition_penalty: Annotated[Optional[float], typer.Option(help="vLLM's repetition penalty on tokens already in the conversation (1 = none; > 1 discourages repeats).")] = None,
    samples: Annotated[Optional[int], typer.Option(help="Independent completions per seed conversation (ids ID#s0..#sN-1 when N > 1; needs --temperature > 0).")] = None,
    max_tokens: Annotated[Optional[int], typer.Option("--max-tokens", help="Max new tokens per turn (config key max_new_tokens).")] = None,
    max_model_len: Annotated[Optional[int], typer.Option(help="Context-length guard (default: the model's).")] = None,
    teacher_topk: Annotated[Optional[int], typer.Option("--teacher-topk", help="Teacher candidates stored per generated token (config key topk).")] = None,
    random_seed: Annotated[Optional[int], typer.Option("--random-seed", help="Random seed of sampling; per-request seeds derive from it (config key sampling_seed).")] = None,
    system_prompt: Annotated[Optional[str], typer.Option(help="System prompt for seed rows that have none.")] = None,
    user_prompt: Annotated[Optional[str], typer.Option(help="self-talk user-simulator prompt: a file in prompts/ or a path.")] = None,
    shard_size: Annotated[Optional[int], typer.Option(help="Conversations per shard (and per engine batch).")] = None,
    limit: Annotated[Optional[int], typer.Option(help="Only the first N seed rows.")] = None,
    dtype: Annotated[Optional[str], typer.Option(help="auto | float32 | bfloat16 | float16.")] = None,
    batch_size: Annotated[Optional[int], typer.Option(help="hf backend: sequences per generate call.")] = None,
    tensor_parallel_size: Annotated[Optional[int], typer.Option(help="vLLM tensor parallelism (GPUs).")] = None,
    part: Annotated[Optional[str], typer.Option(help="I/N: only seed rows with index % N == I (one process per GPU; merge the parts with `distill data merge`).")] = None,
    server: Annotated[Optional[str], typer.Option(help="--backend openai: URL[,URL...] of running vLLM OpenAI servers serving --model (requests go to the least busy; a failing one is retried elsewhere).")] = None,
    concurrency: Annotated[Optional[int], typer.Option(help="--backend openai: conversations in flight, each advancing turn by turn on its own.")] = None,
    api_key_env: Annotated[Optional[str], typer.Option(help="--backend openai: the environment variable that holds the servers' API key (never the key itself).")] = None,
    retries: Annotated[Optional[int], typer.Option(help="--backend openai: attempts after the first per request on connection errors, 429 and 5xx, with backoff.")] = None,
    chat_template: ChatTemplateOpt = None,
    chat_template_kwargs: ChatTemplateKwargsOpt = None,
    reasoning: Annotated[Optional[str], typer.Option(help="keep | strip | both: think blocks (<think>...</think>) in the stored messages: kept, removed, or kept only in the replies a row trains (input_ids always hold what the model saw and wrote).")] = None,
    quiet: QuietOpt = False,
) -> None:
    """Regenerate seed conversations with the model; write shards with its top-k logprobs."""
    from distill.generate import GenerateConfig, Generator

    cfg = GenerateConfig.from_dict(stage_options("generate", config, set_, _given(ctx, GenerateConfig, FIELDS["generate"])))
    _one_progress_style()
    with Progress("generate", "conversations", quiet=quiet) as progress:
        summary = Generator(cfg, progress=progress).run()
    _print_summary(summary)


def _print_summary(s) -> None:
    typer.echo(
        f"{s.out}: {s.generated} generated + {s.rejected} rejected + {s.skipped} skipped = "
        + (f"{s.seed_rows} seed rows" if s.samples == 1 else f"{s.rows} rows ({s.seed_rows} seed rows x {s.samples} samples)")
        + ("" if s.balanced else f" (+{s.pending} pending)")
    )
    typer.echo(
        f"  {s.generated_tokens:,} generated tokens, {s.prompt_tokens:,} prompt tokens; this run: "
        f"{s.new_conversations} conversations, {s.new_tokens:,} tokens in {s.seconds:.1f}s"
        + (f" ({s.new_tokens / s.seconds:.1f} tok/s)" if s.new_tokens and s.seconds else "")
    )
    if s.rejects_by_reason:
        typer.echo("  rejects: " + ", ".join(f"{k} {v}" for k, v in sorted(s.rejects_by_reason.items())))
    if s.continued_rows:
        typer.echo(f"  + {s.continued_rows} rows that continue a conversation (ID#tN): the chat template re-renders "
                   "the history, so each such turn is a row of its own")
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


@app.command("env")
def env_cmd(
    model: ModelOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of the pasteable block.")] = False,
) -> None:
    """Versions, hardware and what each stage would pick here (device, dtype, vLLM mode): paste it into a bug report."""
    from distill.envinfo import collect

    report = collect(model)
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
    else:
        typer.echo("\n".join(report.lines()))


@app.command("seeds")
def seeds_list() -> None:
    """List the registered seed names."""
    from distill.seeds import available_seeds

    for name, desc in available_seeds().items():
        typer.echo(f"{name:12s} {desc}")


# == data commands: distill data ..., distill push ==
data_app = _Typer(help="Look at, check, reshape and convert shard folders.", no_args_is_help=True)
app.add_typer(data_app, name="data")

DataDirArg = Annotated[str, typer.Argument(metavar="DATASET", help="A dataset folder (manifest.json + shard-*.parquet): a path, or an object-store URL (s3://..., gs://...).")]
NewOutOpt = Annotated[str, typer.Option("--out", "-o", help="A new local folder to write (never an existing one).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON (for machines) instead of a table.")]
ShardRowsOpt = Annotated[int, typer.Option("--shard-size", help="Conversations per written shard.")]


def _echo_json(obj) -> None:
    typer.echo(json.dumps(obj, indent=2, ensure_ascii=False, default=str))


@data_app.command("inspect")
def data_inspect(
    root: DataDirArg,
    id: Annotated[Optional[str], typer.Option("--id", help="The row id to show.")] = None,
    index: Annotated[Optional[int], typer.Option("--index", "-n", help="The row index to show (manifest order; default 0).")] = None,
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="Tokenizer to decode tokens (default: the model in the manifest).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Show one conversation: roles, and every generated token coloured by the teacher's top-1 probability."""
    from distill.data.inspect import conversation_view, render_conversation

    view = conversation_view(root, row_id=id, index=0 if id is None and index is None else index, model=model)
    if as_json:
        _echo_json(view.to_dict())
    else:
        Console().print(render_conversation(view))


@data_app.command("stats")
def data_stats(
    root: DataDirArg,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Folder for PNG charts (lengths, entropy, coverage) and stats.json.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Counts, token statistics, finish/reject reasons and the teacher's top-1 mass, entropy and top-k coverage."""
    from distill.data.report import plot_stats, stats_table
    from distill.data.stats import compute_stats

    st = compute_stats(root)
    if plot is not None:
        written = plot_stats(st, plot)
        from distill.store.atomic import atomic_write_json

        atomic_write_json(plot / "stats.json", st.to_dict())
        console.print("wrote " + ", ".join(str(p) for p in [*written, plot / "stats.json"]))
    if as_json:
        _echo_json(st.to_dict())
    else:
        Console().print(stats_table(st))


@data_app.command("validate")
def data_validate(
    root: DataDirArg,
    checksums: Annotated[bool, typer.Option("--checksums/--no-checksums", help="Verify each shard's SHA-256 against the manifest.")] = True,
    rescore: Annotated[int, typer.Option("--rescore", help="Also re-score N random rows with the model: top-1 / top-k set agreement "
                                         "and logprob error of the stored teacher (0: off).")] = 0,
    rescore_dtype: Annotated[str, typer.Option(help="--rescore: the dtype to score in (auto: the one the engine serves these data in).")] = "auto",
    device: DeviceOpt = "auto",
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="--rescore: the model (default: the one in the manifest).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Check schema, checksums, counts, ids and every row's invariants; exit 1 and name each problem if any."""
    from distill.data.validate import validate_dataset

    report = validate_dataset(root, checksums=checksums)
    fidelity = None
    if rescore and report.ok:
        from distill.data.rescore import rescore as run_rescore

        fidelity = run_rescore(root, rescore, model=model, dtype=rescore_dtype, device=device)
    if as_json:
        _echo_json(dict(report.to_dict(), rescore=fidelity.to_dict() if fidelity else None))
    else:
        for p in report.problems:
            typer.echo(str(p))
        for key, n in report.unlisted.items():
            typer.echo(f"{key}: {n} more problem(s) of this kind")
        verdict = "OK" if report.ok else f"INVALID: {report.count} problem(s)"
        typer.echo(f"{root}: {report.shards} shards, {report.rows:,} rows, {report.tokens:,} tokens: {verdict}")
        if fidelity is not None:
            typer.echo("\n".join(fidelity.lines()))
    if not report.ok:
        raise typer.Exit(1)


@data_app.command("repair")
def data_repair(root: DataDirArg) -> None:
    """Set damaged shards aside (renamed *.corrupt, dropped from the manifest) so a rerun of `distill generate` redoes them."""
    from distill.data.repair import repair

    _echo_json(repair(root).to_dict())


@data_app.command("convert")
def data_convert(
    source: Annotated[str, typer.Argument(metavar="DATASET", help="A dataset folder; with --format shards, any seed (NAME | PATH | hf:DATASET[:split]).")],
    format: Annotated[str, typer.Option("--format", "-f", help="sharegpt (JSON) | openai (JSONL) | specforge (JSONL) | hf (save_to_disk folder) | trl (Parquet folder, teacher top-k as lists) | shards (seed -> teacher-less shards).")],
    out: Annotated[str, typer.Option("--out", "-o", help="The new local file (sharegpt, openai) or folder (hf, shards).")],
    model: ModelOpt = None,
    seed_format: Annotated[Optional[str], typer.Option(help="--format shards: force the seed format instead of detecting it.")] = None,
    limit: Annotated[Optional[int], typer.Option(help="--format shards: only the first N seed rows.")] = None,
    shard_size: ShardRowsOpt = 1000,
    chat_template: ChatTemplateOpt = None,
    chat_template_kwargs: ChatTemplateKwargsOpt = None,
) -> None:
    """Export shards to ShareGPT / OpenAI messages / a datasets folder, or turn seed data into shards (no teacher)."""
    from distill.data.convert import export, seed_to_shards

    if format != "shards" and (chat_template is not None or chat_template_kwargs is not None):
        raise ConfigError("--chat-template and --chat-template-kwargs apply to --format shards only (the rows hold their tokens)")
    if format == "shards":
        if limit is not None and limit < 0:
            raise ConfigError(f"--limit must be >= 0; got {limit}")
        summary = seed_to_shards(source, out, model=model, seed_format=seed_format, limit=limit, shard_rows=shard_size,
                                 chat_template=chat_template, chat_template_kwargs=chat_template_kwargs)
    else:
        if model or seed_format or limit is not None:
            raise ConfigError("--model, --seed-format and --limit apply to --format shards only")
        summary = export(source, format, out)
    _echo_json(summary.to_dict())


@data_app.command("merge")
def data_merge(
    inputs: Annotated[list[str], typer.Argument(metavar="DATASET", help="Two or more dataset folders (paths or object-store URLs) of the same model and teacher encoding.")],
    out: NewOutOpt,
    skip_duplicate_ids: Annotated[bool, typer.Option(help="Keep the first row of a repeated id instead of failing.")] = False,
    shard_size: ShardRowsOpt = 1000,
) -> None:
    """Concatenate datasets into a new folder."""
    from distill.data.transform import merge

    _echo_json(merge(inputs, out, skip_duplicate_ids=skip_duplicate_ids, shard_rows=shard_size).to_dict())


@data_app.command("dedupe")
def data_dedupe(
    root: DataDirArg,
    out: NewOutOpt,
    match: Annotated[str, typer.Option("--match", help="normalized (case and whitespace folded) | exact: how user turns are compared.")] = "normalized",
    shard_size: ShardRowsOpt = 1000,
) -> None:
    """Drop conversations whose user turns repeat an earlier one (keeps the first; counts by kind)."""
    from distill.data.transform import dedupe

    _echo_json(dedupe(root, out, mode=match, shard_rows=shard_size).to_dict())


@data_app.command("split")
def data_split(
    root: DataDirArg,
    out: NewOutOpt,
    eval_fraction: Annotated[float, typer.Option(help="Fraction of rows (by key hash) that go to eval.")] = 0.05,
    by: Annotated[str, typer.Option("--by", help="Split key: id (row by row) | first-turn (conversations opening with "
                                    "the same user turn, normalized, stay on one side: no prompt leaks into eval).")] = "id",
    shard_size: ShardRowsOpt = 1000,
) -> None:
    """Deterministic train/eval split by key hash into OUT/train and OUT/eval."""
    from distill.data.transform import split

    _echo_json(split(root, out, eval_fraction=eval_fraction, shard_rows=shard_size, by=by).to_dict())


@app.command("push")
def push_cmd(
    root: Annotated[str, typer.Argument(metavar="DATASET", help="A dataset folder, or a split folder (train/, eval/) from `distill data split`: a path or an object-store URL.")],
    repo: Annotated[str, typer.Option("--repo", help="Hub dataset repo OWNER/NAME (created if missing).")],
    private: Annotated[bool, typer.Option("--private", help="Create the repo private.")] = False,
    dry_run: Annotated[Optional[Path], typer.Option("--dry-run", help="Write exactly what would be uploaded into this new folder; upload nothing.")] = None,
    license: Annotated[str, typer.Option("--license", help="License id for the card (follow the model's and the seed's terms).")] = "other",
    language: Annotated[Optional[list[str]], typer.Option("--language", help="Language code(s) of the data (repeatable).")] = None,
    pretty_name: Annotated[Optional[str], typer.Option(help="Title of the dataset card.")] = None,
) -> None:
    """Validate and upload a dataset to the Hugging Face Hub with a generated dataset card."""
    from distill.hub import CardOptions, push

    opts = CardOptions(repo_id=repo, license=license, language=language or ["en"], pretty_name=pretty_name)
    summary = push(root, opts, private=private, dry_run=dry_run)
    _echo_json(summary.to_dict())


# == training commands: distill train-heads, calibrate, export ==
DataOpt = Annotated[Optional[str], typer.Option("--data", "-d", help="Dataset folder made by `distill generate` (manifest.json + shards): a path or an object-store URL.")]
HeadsDirOpt = Annotated[Path, typer.Option("--heads", help="Heads folder made by `distill train-heads`.")]


@app.command("train-heads")
def train_heads(
    ctx: typer.Context,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    data: DataOpt = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Heads folder (vLLM Medusa or EAGLE-3 format) + checkpoints/ + metrics.jsonl.")] = None,
    model: ModelOpt = None,
    arch: Annotated[Optional[str], typer.Option(help="medusa (heads on the last hidden state) | eagle3 (one drafter layer on fused target features).")] = None,
    medusa_mode: Annotated[Optional[str], typer.Option("--medusa-mode", help="medusa1 (frozen backbone) | medusa2 (LoRA backbone + heads); config key mode.")] = None,
    targets: Annotated[Optional[str], typer.Option(help="hard (sampled token) | soft (stored teacher top-k + tail bucket).")] = None,
    ttt_steps: Annotated[Optional[int], typer.Option(help="eagle3: training-time-test steps unrolled (draft depths trained).")] = None,
    draft_vocab: Annotated[Optional[str], typer.Option(help="eagle3: auto (covers >= 99% of generated tokens) | N most frequent generated tokens | 0 (full vocabulary); special tokens always.")] = None,
    aux_layers: Annotated[Optional[str], typer.Option(help="eagle3: target layers fused into the feature: auto (2, N/2, N-3) or ids like 2,15,27.")] = None,
    feature_loss: Annotated[Optional[float], typer.Option(help="eagle3: weight of EAGLE-1's smooth-L1 feature loss (0: off).")] = None,
    num_heads: Annotated[Optional[int], typer.Option("--num-heads", help="Number of Medusa heads K (config key heads).")] = None,
    layers: Annotated[Optional[int], typer.Option(help="Residual blocks per head.")] = None,
    share_lm_head: Annotated[Optional[bool], typer.Option("--share-lm-head/--no-share-lm-head", help="Read every head through the base LM head (vLLM original_lm_head); only the blocks train.")] = None,
    max_len: Annotated[Optional[int], typer.Option(help="Tokens per training window.")] = None,
    context: Annotated[Optional[int], typer.Option(help="Tokens of history re-read (without targets) at the start of each following window.")] = None,
    batch_size: Annotated[Optional[int], typer.Option(help="Windows per micro-batch (per process).")] = None,
    grad_accum: Annotated[Optional[int], typer.Option(help="Micro-batches per optimizer step.")] = None,
    steps: Annotated[Optional[int], typer.Option(help="Optimizer steps of the run (0: --epochs passes over the data).")] = None,
    epochs: Annotated[Optional[int], typer.Option(help="Passes over the data when --steps is 0.")] = None,
    lr: Annotated[Optional[float], typer.Option(help="Heads' learning rate (the LoRA backbone gets lr / --heads-lr-ratio).")] = None,
    heads_lr_ratio: Annotated[Optional[float], typer.Option(help="Medusa-2: heads' lr / backbone's lr.")] = None,
    warmup_steps: Annotated[Optional[int], typer.Option(help="Linear lr warm-up steps before the cosine decay.")] = None,
    weight_decay: Annotated[Optional[float], typer.Option(help="AdamW weight decay.")] = None,
    decay: Annotated[Optional[float], typer.Option(help="Loss weight decay^k of Medusa head k (k = 1..K) / decay^j of EAGLE-3 step j (j = 0..).")] = None,
    max_grad_norm: Annotated[Optional[float], typer.Option(help="Clip the gradient norm to this (0: no clipping).")] = None,
    gradient_checkpointing: Annotated[Optional[bool], typer.Option("--gradient-checkpointing/--no-gradient-checkpointing", help="Medusa-2: recompute the LoRA backbone's activations in the backward pass (less memory, slower).")] = None,
    loss_chunk: Annotated[Optional[int], typer.Option(help="Positions per loss chunk (peak memory grows with it, not with T).")] = None,
    lambda0: Annotated[Optional[float], typer.Option(help="Medusa-2 weight of the heads' loss (0.01 recommended for self-distilled data).")] = None,
    lambda0_schedule: Annotated[Optional[str], typer.Option(help="sine | two-stage | constant.")] = None,
    lambda0_warmup: Annotated[Optional[int], typer.Option(help="Steps of the λ0 ramp (sine) or of stage 1 (two-stage).")] = None,
    lora_r: Annotated[Optional[int], typer.Option(help="LoRA rank.")] = None,
    lora_alpha: Annotated[Optional[int], typer.Option(help="LoRA alpha.")] = None,
    lora_dropout: Annotated[Optional[float], typer.Option(help="LoRA dropout.")] = None,
    lora_targets: Annotated[Optional[str], typer.Option(help="peft target modules: all-linear or comma-separated names.")] = None,
    merge_adapter: Annotated[Optional[bool], typer.Option("--merge-adapter/--no-merge-adapter", help="Medusa-2: also write the merged backbone to OUT/merged.")] = None,
    precision: Annotated[Optional[str], typer.Option(help="auto (the data's teacher dtype; bf16 on CPUs only where native) | fp32 | bf16 (autocast, fp32 master weights).")] = None,
    optimizer: Annotated[Optional[str], typer.Option(help="auto (= adamw) | adamw | adamw8bit (bitsandbytes, GPU only).")] = None,
    shuffle_buffer: Annotated[Optional[int], typer.Option(help="Seeded shuffle buffer in windows (0: shard order).")] = None,
    pack: Annotated[Optional[bool], typer.Option("--pack/--no-pack", help="Lay windows end to end in rows of --max-len (no compute on padding; attention kept inside each window).")] = None,
    random_seed: Annotated[Optional[int], typer.Option("--random-seed", help="Random seed of initialization, shuffling and dropout (config key seed).")] = None,
    save_every: Annotated[Optional[int], typer.Option(help="Checkpoint every N steps (always at the end).")] = None,
    keep_checkpoints: Annotated[Optional[int], typer.Option(help="Keep only the newest N checkpoints (0: keep all).")] = None,
    log_every: Annotated[Optional[int], typer.Option(help="Write metrics every N steps.")] = None,
    stop_after: Annotated[Optional[int], typer.Option(help="Stop this invocation after N steps (checkpointed; continue with --resume).")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue the run in OUT from its latest checkpoint.")] = False,
    eval_data: Annotated[Optional[str], typer.Option("--eval-data", help="Held-out rows measured while training, as calibrate measures them: a dataset or split folder (its eval side), or none (default: the eval side of a split --data folder, which then trains on its train side).")] = None,
    eval_every: Annotated[Optional[int], typer.Option(help="Measure the held-out rows every N steps and at the end (0: only at the end); the best weights by expected tokens/step go to OUT/best.")] = None,
    eval_tokens: Annotated[Optional[int], typer.Option("--eval-tokens", help="Held-out tokens measured per evaluation, whole batches (0: all).")] = None,
    eval_nodes: Annotated[Optional[int], typer.Option(help="Node budget of the sparse tree whose expected tokens/step the evaluation reports and picks the best weights by.")] = None,
    report_to: Annotated[Optional[str], typer.Option(help="tensorboard (OUT/tensorboard) | wandb | none: where metrics go beside OUT/metrics.jsonl.")] = None,
    quiet: QuietOpt = False,
) -> None:
    """Train Medusa heads (Medusa-1 or Medusa-2) or an EAGLE-3 drafter on self-distilled shards; write a vLLM-loadable folder."""
    from distill.train.config import TrainConfig

    cfg = TrainConfig.from_dict(stage_options("train", config, set_, _given(ctx, TrainConfig, FIELDS["train-heads"])))
    from distill.train import train  # the trainer and torch: once the options are whole

    if not quiet:
        interval_from_env()  # a bad DISTILL_PROGRESS_SECONDS: one line now, not once the model is loaded
    _one_progress_style()
    s = train(cfg, progress=not quiet)  # a bar on a terminal, periodic lines off one (distill.progress)
    if int(os.environ.get("RANK", "0")) != 0:  # under `accelerate launch`: the main process reports
        return
    final = s.final
    what, n = ("head", cfg.heads) if cfg.arch == "medusa" else ("step", cfg.ttt_steps)
    top1 = " ".join(f"{final.get(f'{what}{k}_top1', 0):.3f}" for k in range(1, n + 1))
    where = f" on {s.processes} processes{' (target sharded)' if s.sharded_target else ''}" if s.processes > 1 else ""
    typer.echo(f"{s.out}: {s.steps} steps{where}, {s.tokens:,} tokens in {s.seconds:.1f}s ({s.tokens_per_s:.1f} tok/s), "
               f"peak memory {s.peak_memory_mb:.0f} MiB")
    typer.echo(f"  last step: loss {final.get('loss', float('nan')):.4f}, {what} top-1 {top1}")
    if s.draft_vocab:
        v = s.draft_vocab
        typer.echo(f"  draft vocabulary: {v['size']:,} of {v['target_vocab']:,} tokens ({v['frequent']:,} most frequent + "
                   f"{v['special_added']} special), covering {v['coverage']:.2%} of {v['generated_tokens']:,} generated tokens")
    if s.last_eval:
        last, best = s.last_eval, s.best_eval
        typer.echo(f"  held-out expected tokens/step ({cfg.eval_nodes}-node tree / chain): last step {last['step']} {last['tree']:.3f} / "
                   f"{last['chain']:.3f}, best step {best['step']} {best['tree']:.3f} / {best['chain']:.3f} in {s.best}")
    typer.echo(f"  stopped after {s.steps} steps: continue with --resume" if s.stopped_early
               else f"  {'heads' if cfg.arch == 'medusa' else 'drafter'}: {s.out} (config.json + model.safetensors), metrics: {s.out}/metrics.jsonl")


@app.command()
def calibrate(
    ctx: typer.Context,
    heads: Annotated[Optional[Path], typer.Option("--heads", help="Heads folder made by `distill train-heads` (default with --config: its train: out).")] = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    data: DataOpt = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Where tree.json, calibration.json and plots go (default: the heads folder).")] = None,
    model: ModelOpt = None,
    nodes: Annotated[Optional[int], typer.Option(help="Node budget of the sparse tree.")] = None,
    ranks: Annotated[Optional[int], typer.Option(help="Top-i accuracies measured per head (i <= 10).")] = None,
    max_len: Annotated[Optional[int], typer.Option(help="Tokens per evaluation window.")] = None,
    batch_size: Annotated[Optional[int], typer.Option(help="Windows per forward pass.")] = None,
    eval_tokens: Annotated[Optional[int], typer.Option("--eval-tokens", help="Stop after this many held-out tokens, 0: all (config key max_tokens).")] = None,
    plots: Annotated[Optional[bool], typer.Option("--plots/--no-plots", help="Write tree.png and acceptance.png.")] = None,
    dtype: Annotated[Optional[str], typer.Option(help="auto (the heads' teacher dtype) | float32 | bfloat16 | float16.")] = None,
    device: Annotated[Optional[str], typer.Option(help="auto (CUDA when available, else CPU) | cpu | cuda | cuda:N.")] = None,
    quiet: QuietOpt = False,
) -> None:
    """Measure per-head top-i accuracy on held-out data and write the best sparse tree (tree.json)."""
    from distill.configs import config_from_options, stage_section
    from distill.train.config import CalibrateConfig

    options = stage_options("calibrate", config, set_, _given(ctx, CalibrateConfig, FIELDS["calibrate"]))
    if not options.get("heads") and config is not None:
        options["heads"] = stage_section(config, "train").get("out")  # the heads the same file trains
    if not options.get("heads"):
        raise ConfigError("--heads is required: the folder written by `distill train-heads`")
    if not options.get("data"):
        raise ConfigError("--data is required: a held-out dataset folder (see `distill data split`)")
    cfg = config_from_options(CalibrateConfig, options, "calibrate")
    from distill.train.calibrate import calibrate as run_calibrate  # torch: once the options are whole

    _one_progress_style()
    with Progress("calibrate", "tokens", quiet=quiet) as progress:
        budget = f"up to {cfg.max_tokens:,} held-out tokens" if cfg.max_tokens else "every held-out token"
        progress.stage(f"{cfg.heads} on {cfg.data} ({budget}): top-{cfg.ranks} accuracy per head, then the best {cfg.nodes}-node tree")
        r = run_calibrate(cfg, progress=progress)
    typer.echo(f"{r.out}/tree.json: {r.nodes} nodes, expected acceptance length {r.expected_acceptance_length:.3f}"
               + (f" (best Cartesian {r.cartesian['spec']}: {r.cartesian['expected_acceptance_length']:.3f})" if r.cartesian else ""))
    typer.echo("  top-1 per head: " + " ".join(f"{a:.3f}" for a in r.top1) + f" over {min(r.positions):,}+ positions")


@app.command()
def export(
    heads: HeadsDirOpt,
    out: Annotated[Path, typer.Option("--out", "-o", help="New folder to write.")],
    format: Annotated[str, typer.Option("--format", "-f", help="medusa-repo (FasterDecoding/Medusa layout) | vllm (Medusa heads) | vllm-eagle3 (an EAGLE-3 drafter).")] = "medusa-repo",
    base_model: Annotated[Optional[str], typer.Option(help="Base model id for medusa-repo's config (default: the one recorded).")] = None,
) -> None:
    """Write a heads or drafter folder in another layout."""
    from distill.heads.export import export_heads

    typer.echo(str(export_heads(heads, out, format, base_model)))


# == serving commands: distill serve, bench ==
HeadsOpt = Annotated[Optional[Path], typer.Option("--heads", help="Medusa heads or EAGLE-3 drafter folder (from `distill train-heads`), or `lookup`: draft from n-gram matches in each request's own context, nothing trained.")]
DraftNodesOpt = Annotated[Optional[int], typer.Option("--draft-nodes", help="EAGLE drafter or lookup: node budget of the dynamic tree (default: EAGLE 24, lookup 8).")]
LookupDataOpt = Annotated[Optional[Path], typer.Option("--lookup-data", help="With --heads lookup: a dataset this model generated (`distill generate`); the n-grams of its replies draft beside the context's.")]
LookupHistoryOpt = Annotated[Optional[int], typer.Option("--lookup-history", help="With --heads lookup: tokens of the replies already produced that later requests draft from, oldest dropped first (default 262144; 0: none). Greedy requests draft from it (their output never depends on drafts; a seeded sample stays reproducible); `distill bench` clears it before each pass.")]
LookupOpt = Annotated[Optional[bool], typer.Option("--lookup/--no-lookup", help="With --heads FOLDER (Medusa heads or an EAGLE-3 drafter): merge the lookup proposer's tree (n-gram matches in the context, --lookup-data, the earlier replies) into theirs every step; one verification forward holds both. --lookup-data and --lookup-history then apply to it.")]
LookupNodesOpt = Annotated[Optional[int], typer.Option("--lookup-nodes", help="The lookup proposer's node budget, with --heads lookup or --lookup (default: --draft-nodes with --heads lookup, else 8).")]
TreeOpt = Annotated[Optional[str], typer.Option("--tree", help="Verification tree: tree.json path, chain[-K], sparse-N, or Cartesian 3,2,2,1 (default: the heads' tree.json, else sparse-24). With an EAGLE-3 drafter only a tree.json of distill calibrate: its per-depth accuracy.")]


@app.command(cls=_PassThroughCommand)
def serve(
    ctx: typer.Context,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    model: ModelOpt = None,
    heads: HeadsOpt = None,
    engine: Annotated[Optional[str], typer.Option(
        "--engine", help="distill: our engine (tree attention; plain decoding without --heads). "
        "vllm: start vLLM's OpenAI server with the heads as its Medusa speculative config; vLLM verifies a single "
        "chain of each head's top-1 guess, no tree, so --tree does not apply.")] = None,
    host: Annotated[Optional[str], typer.Option(help="Address to bind: 127.0.0.1 is this machine only, 0.0.0.0 every interface (without an API key, a warning).")] = None,
    port: Annotated[Optional[int], typer.Option(help="Port (0 = any free port).")] = None,
    api_key: Annotated[Optional[str], typer.Option("--api-key", envvar="DISTILL_API_KEY", help="Require 'Authorization: Bearer KEY' on every route but /health and /metrics (with --engine vllm: vLLM's rule, /v1/* only). Give it in the environment variable DISTILL_API_KEY: a --api-key on the command line is visible to every user of the machine (ps).")] = None,
    served_model_name: Annotated[Optional[str], typer.Option(help="Model id clients send (default: the model's name).")] = None,
    queue_size: Annotated[Optional[int], typer.Option(help="Requests that may wait for the engine; more get HTTP 503.")] = None,
    max_batch: Annotated[Optional[int], typer.Option(help="Sequences decoded together (default 8); waiting ones join the running batch as rows free up. --engine vllm: its --max-num-seqs (default: vLLM's).")] = None,
    max_tokens: Annotated[Optional[int], typer.Option("--max-tokens", help="max_tokens of requests that give none (default: the rest of the context, as vLLM; or the generation config's max_new_tokens); config key default_max_tokens.")] = None,
    max_model_len: Annotated[Optional[int], typer.Option(help="Context limit for prompt + max_tokens (default: the model's).")] = None,
    generation_config: Annotated[Optional[str], typer.Option("--generation-config", help="Where requests' sampling defaults come from, as vLLM's option: auto (the model's generation_config.json), vllm or none (neutral: temperature 1, top_p 1), or a folder holding a generation_config.json.")] = None,
    chat_template: Annotated[Optional[str], typer.Option("--chat-template", help="Chat template for /v1/chat/completions: a Jinja file, or the template itself (default: the model's).")] = None,
    chat_template_kwargs: Annotated[Optional[str], typer.Option("--chat-template-kwargs", help='The chat template\'s extra variables for every chat request, a JSON object (e.g. \'{"enable_thinking": false}\'); a request\'s own chat_template_kwargs override them (vLLM: --default-chat-template-kwargs).')] = None,
    tree: TreeOpt = None,
    draft_nodes: DraftNodesOpt = None,
    lookup_data: LookupDataOpt = None,
    lookup_history: LookupHistoryOpt = None,
    lookup: LookupOpt = None,
    lookup_nodes: LookupNodesOpt = None,
    acceptance: Annotated[Optional[str], typer.Option(help="Acceptance for sampled requests: typical | rejection | greedy (temperature 0 is always greedy, lossless).")] = None,
    typical_epsilon: Annotated[Optional[float], typer.Option(help="Typical acceptance epsilon.")] = None,
    typical_delta: Annotated[Optional[float], typer.Option(help="Typical acceptance delta.")] = None,
    step_cost_ratio: Annotated[Optional[float], typer.Option(help="The policy's step cost as a line, r per extra tree token (`distill bench --sweep-tree` fits it); default: on a CPU the curve timed at start, on CUDA r = 0.002.")] = None,
    adaptive: Annotated[Optional[bool], typer.Option(
        "--adaptive/--static", help="adaptive: the tree size per batch size follows the acceptance and step "
        "times measured while serving, plain decoding when that is faster; static: the calibrated prediction alone.")] = None,
    compile: Annotated[Optional[bool], typer.Option("--compile/--no-compile", help="torch.compile the engine's decoding steps, compiled before the server listens (with CUDA graphs, every step, then recorded; on a CPU, single-token steps only).")] = None,
    cuda_graphs: CudaGraphsOpt = None,
    num_speculative_tokens: Annotated[Optional[int], typer.Option(help="--engine vllm: heads used (default: all).")] = None,
    dtype: Annotated[Optional[str], typer.Option(help="auto (the heads' teacher dtype, else the model's; bf16 on CPUs only where native) | float32 | bfloat16 | float16.")] = None,
    device: Annotated[Optional[str], typer.Option(help="auto (CUDA when available, else CPU) | cpu | cuda | cuda:N (distill engine).")] = None,
    shutdown_grace: Annotated[Optional[float], typer.Option(help="After SIGTERM / Ctrl-C: seconds admitted requests get to finish while new ones get 503; then those left end with a 503 error.")] = None,
    max_body_bytes: Annotated[Optional[int], typer.Option(help="Request bodies over this many bytes get 413 before they are read (default: 4 MiB, or 64 bytes per context token when that is more).")] = None,
    log_level: Annotated[str, typer.Option(help="uvicorn log level: warning | info | debug.")] = "info",
    print_command: Annotated[bool, typer.Option("--print-command", help="--engine vllm: print the vLLM server command and the "
                                                "environment distill adds (JSON), and exit.")] = False,
) -> None:
    """Serve the model (with Medusa heads, an EAGLE-3 drafter or the lookup proposer) over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions).

    With --engine vllm, everything after a literal `--` goes to vLLM's server unchanged
    (e.g. `-- --tensor-parallel-size 2 --gpu-memory-utilization 0.85`); an option before it
    that serve does not know is an error.
    """
    from distill.serve import ServeConfig, serve as run_server

    from distill.configs import config_from_options

    options = stage_options("serve", config, set_, _given(ctx, ServeConfig, FIELDS["serve"]))
    if "max_tokens" in options:  # a file's or --set's name for it
        options["default_max_tokens"] = options.pop("max_tokens")
    if ctx.meta.get(AFTER_DASHES):
        options["vllm_args"] = list(ctx.meta[AFTER_DASHES])
    cfg = config_from_options(ServeConfig, options, "serve")
    if print_command:
        from distill.serve.server import vllm_command, vllm_env

        if cfg.engine != "vllm":
            raise ConfigError("--print-command shows the vLLM server command: it needs --engine vllm")
        env = vllm_env(cfg)
        added = {k: env[k] for k in sorted(set(env) - set(os.environ)) if k != "VLLM_API_KEY"}
        typer.echo(json.dumps({"env": added, "command": vllm_command(cfg)}))
        return
    run_server(cfg, log_level=log_level)


@app.command()
def bench(
    ctx: typer.Context,
    heads: Annotated[Optional[Path], typer.Option("--heads", help="Medusa heads or EAGLE-3 drafter folder (from `distill train-heads`; default with --config: its train: out), or `lookup`: draft from n-gram matches in each prompt's own context, nothing trained.")] = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    model: ModelOpt = None,
    prompts: Annotated[Optional[str], typer.Option(help="Seed of prompts (first user turn of each): mt-bench, a file, ...")] = None,
    limit: Annotated[Optional[int], typer.Option(help="At most N prompts, round-robin over categories.")] = None,
    max_tokens: Annotated[Optional[int], typer.Option(help="Tokens generated per prompt.")] = None,
    modes: Annotated[Optional[str], typer.Option(help="Acceptance modes to measure, comma-separated: greedy,typical.")] = None,
    temperature: Annotated[Optional[float], typer.Option(help="Sampling temperature of the typical mode.")] = None,
    tree: TreeOpt = None,
    typical_epsilon: Annotated[Optional[float], typer.Option(help="Typical acceptance epsilon.")] = None,
    typical_delta: Annotated[Optional[float], typer.Option(help="Typical acceptance delta.")] = None,
    draft_nodes: DraftNodesOpt = None,
    lookup_data: LookupDataOpt = None,
    lookup_history: LookupHistoryOpt = None,
    lookup: LookupOpt = None,
    lookup_nodes: LookupNodesOpt = None,
    vllm: Annotated[Optional[bool], typer.Option("--vllm/--no-vllm", help="Also decode the greedy prompts with bare vLLM (in this process; the same model, dtype and max tokens) and report plain and speculative tok/s against it.")] = None,
    full_tree: Annotated[Optional[bool], typer.Option("--full-tree/--policy-tree", help="Verify the whole tree every step (speculation policy off): measures the tree itself.")] = None,
    tree_acceptance: Annotated[Optional[bool], typer.Option("--tree-acceptance/--no-tree-acceptance", help="With the policy deciding the tree: also decode the greedy prompts once with the whole tree, untimed, and report the tokens/step it accepts beside this machine's break-even.")] = None,
    compile: Annotated[Optional[bool], typer.Option("--compile/--no-compile", help="torch.compile the engine's decoding steps, compiled before timing (with CUDA graphs, every step, then recorded; on a CPU, single-token steps only).")] = None,
    cuda_graphs: CudaGraphsOpt = None,
    sweep_tree: Annotated[Optional[bool], typer.Option("--sweep-tree/--no-sweep-tree", help="Also time step latency against tree size here and pick the node budget with the best predicted speedup (writes tree.json).")] = None,
    sweep_nodes: Annotated[Optional[str], typer.Option(help="Tree sizes of the sweep, comma-separated.")] = None,
    sweep_context: Annotated[Optional[int], typer.Option(help="Context length the sweep's steps are timed at.")] = None,
    sweep_repeats: Annotated[Optional[int], typer.Option(help="Timed repeats per tree size (median kept).")] = None,
    dtype: Annotated[Optional[str], typer.Option(help="auto (the heads' teacher dtype, else the model's; bf16 on CPUs only where native) | float32 | bfloat16 | float16.")] = None,
    device: Annotated[Optional[str], typer.Option(help="auto (CUDA when available, else CPU) | cpu | cuda | cuda:N.")] = None,
    random_seed: Annotated[Optional[int], typer.Option("--random-seed", help="Sampling seed of the first prompt; prompt i uses seed + i (config key seed).")] = None,
    chat_template: ChatTemplateOpt = None,
    chat_template_kwargs: ChatTemplateKwargsOpt = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Folder for bench.json, bench.md, bench.png (and sweep.png, tree.json).")] = None,
    quiet: QuietOpt = False,
) -> None:
    """Plain vs speculative (Medusa, EAGLE or lookup) decoding on the same prompts: tokens/step, step overhead, tokens/s and speedup per category; with --vllm against bare vLLM too."""
    from distill.bench.config import BenchConfig
    from distill.configs import config_from_options, stage_section

    options = stage_options("bench", config, set_, _given(ctx, BenchConfig, FIELDS["bench"]))
    if not options.get("heads") and config is not None:
        options["heads"] = stage_section(config, "train").get("out")  # the heads the same file trains
    if not options.get("heads"):
        raise ConfigError("--heads is required: the folder written by `distill train-heads`")
    cfg = config_from_options(BenchConfig, options, "bench")
    from distill.bench import run_bench  # the engine and torch: once the options are whole
    from distill.bench.report import markdown

    _one_progress_style()
    with Progress("bench", "prompts", quiet=quiet) as progress:
        result, paths = run_bench(cfg, progress=progress)
    typer.echo(markdown(result))
    typer.echo("wrote " + ", ".join(str(p) for p in paths.values()))


def drafter_lines(d: dict) -> list[str]:
    """The trained drafter as the policy saw it (the pipeline's bench summary, ``drafter``): what its full tree accepts
    on the held-out prompts, this machine's break-even, the nodes the policy used, and the GPU prediction."""
    tau, even, used = d.get("full_tree_tokens_per_step"), d.get("break_even_tokens_per_step"), d.get("nodes_used_at_batch_1")
    if tau is None:
        return []
    line = f"its full tree ({d.get('nodes')} nodes): {tau:.2f} tokens/step on these held-out prompts (greedy, untimed)"
    if even is not None:
        line += f"; this machine breaks even at {even:.2f} tokens/step"
    if used is not None:
        from distill.bench.report import policy_used

        line += f"; {policy_used(used)}"
    lines = [line]
    if d.get("gpu_prediction"):
        lines.append(d["gpu_prediction"]["text"])
    return lines


# == pipeline command: distill run ==
@app.command("run")
def run_pipeline(
    pipeline: Annotated[Path, typer.Argument(metavar="PIPELINE", help="Pipeline YAML with run: and one section per stage (pipelines/quickstart.yaml).")],
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Folder of every stage's output (overrides run: out).")] = None,
    model: ModelOpt = None,
    stages: Annotated[Optional[str], typer.Option(help="Only these stages, comma-separated (default: all, in order).")] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="Override one option: STAGE.KEY=VALUE (e.g. train.steps=20); repeatable.")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress lines (which stage runs, which is up to date).")] = False,
) -> None:
    """The whole loop: generate -> validate -> split -> train heads -> calibrate -> bench; resumable, skips what is up to date."""
    from distill.pipeline import STAGES, Pipeline, PipelineConfig

    cfg = PipelineConfig.from_yaml(pipeline, {"out": str(out) if out else None, "model": model}, sets=set_ or ())
    chosen = tuple(s.strip() for s in stages.split(",") if s.strip()) if stages else STAGES
    report = Pipeline(cfg, progress=None if quiet else lambda msg: console.print(f"[bold]run[/bold] {msg}")).run(chosen)
    typer.echo("| stage | status | seconds | output |\n| --- | --- | ---: | --- |")
    for r in report.stages:
        typer.echo(f"| {r.stage} | {r.status} | {r.seconds:.0f} | {r.output} |")
    store = " + the data's n-grams" if report.result.get("lookup_source") == "context and data" else ""
    for who, key in (("trained drafter", "overall"), (f"lookup{store} (nothing trained)", "lookup")):
        for mode, g in report.result.get(key, {}).items():
            against = (f"; against bare vLLM ({g['vllm_tokens_per_s']:.1f} tok/s): plain {g['plain_vs_vllm']:.2f}x, "
                       f"{who} {g['medusa_vs_vllm']:.2f}x" if "vllm_tokens_per_s" in g else "")
            typer.echo(f"{who}, {mode}: {g['tokens_per_step']:.2f} tokens/step, step overhead {g['step_overhead']:.2f}x, "
                       f"speedup {g['speedup']:.2f}x ({g['plain_tokens_per_s']:.1f} -> {g['medusa_tokens_per_s']:.1f} tok/s){against}")
        if key == "overall":
            for line in drafter_lines(report.result.get("drafter") or {}):
                typer.echo(f"  {line}")
    typer.echo(f"drafter: {cfg.out}/heads  calibration: {cfg.out}/calibrate/tree.json  bench: {cfg.out}/bench/bench.md")



#: The config dataclass behind each stage command: its defaults are the ones ``--help`` shows.
STAGE_CONFIGS = {
    "generate": ("distill.generate.config", "GenerateConfig"),
    "train-heads": ("distill.train.config", "TrainConfig"),
    "calibrate": ("distill.train.config", "CalibrateConfig"),
    "bench": ("distill.bench.config", "BenchConfig"),
    "serve": ("distill.serve.config", "ServeConfig"),
}

#: A stage command's options whose config field is named otherwise (option's parameter -> field); the rest match.
FIELDS = {
    "generate": {"max_tokens": "max_new_tokens", "teacher_topk": "topk", "random_seed": "sampling_seed"},
    "train-heads": {"num_heads": "heads", "medusa_mode": "mode", "random_seed": "seed"},
    "calibrate": {"eval_tokens": "max_tokens"},
    "bench": {"random_seed": "seed"},
    "serve": {"max_tokens": "default_max_tokens"},
}

_CONFIG = "config set_"
_LOOKUP = "lookup_data lookup_history lookup lookup_nodes"
#: The --help panels of the long commands: panel -> its options' parameter names.
PANELS = {
    "generate": {
        "Data": "seed seed_format mode turns samples system_prompt user_prompt limit part reasoning",
        "Model": "model dtype max_model_len chat_template chat_template_kwargs",
        "Sampling": "temperature top_p top_k min_p repetition_penalty max_tokens random_seed teacher_topk",
        "Engine": "backend batch_size tensor_parallel_size server concurrency api_key_env retries",
        "Output": "out shard_size quiet", "Config": _CONFIG},
    "train-heads": {
        "Data": "data max_len context batch_size shuffle_buffer pack eval_data eval_tokens",
        "Model": "model arch precision",
        "Training": "targets steps epochs grad_accum lr warmup_steps weight_decay max_grad_norm decay loss_chunk optimizer random_seed",
        "Medusa": "medusa_mode num_heads layers share_lm_head",
        "Medusa-2": "heads_lr_ratio lambda0 lambda0_schedule lambda0_warmup lora_r lora_alpha lora_dropout lora_targets "
                    "gradient_checkpointing merge_adapter",
        "EAGLE-3": "ttt_steps draft_vocab aux_layers feature_loss",
        "Output": "out save_every keep_checkpoints log_every eval_every eval_nodes report_to stop_after resume quiet", "Config": _CONFIG},
    "calibrate": {
        "Data": "data max_len batch_size eval_tokens",
        "Model": "heads model dtype device",
        "Tree": "nodes ranks",
        "Output": "out plots quiet", "Config": _CONFIG},
    "bench": {
        "Data": "prompts limit max_tokens modes temperature random_seed",
        "Model": "heads model dtype device chat_template chat_template_kwargs",
        "Engine": "tree draft_nodes typical_epsilon typical_delta full_tree compile cuda_graphs vllm",
        "Lookup": _LOOKUP,
        "Tree sweep": "sweep_tree sweep_nodes sweep_context sweep_repeats",
        "Output": "out quiet", "Config": _CONFIG},
    "serve": {
        "Model": "model heads dtype device max_model_len generation_config chat_template chat_template_kwargs",
        "Engine": "engine max_batch tree draft_nodes acceptance typical_epsilon typical_delta step_cost_ratio adaptive compile "
                  "cuda_graphs num_speculative_tokens",
        "Lookup": _LOOKUP,
        "Server": "host port api_key served_model_name queue_size max_tokens shutdown_grace max_body_bytes log_level",
        "Output": "print_command", "Config": _CONFIG},
}


def _help_default(value):
    """A config default as --help shows it: what one would type (a tuple as a comma-separated list)."""
    return ",".join(map(str, value)) if isinstance(value, tuple) else value


def _command(argv: list[str]):
    """The click command of ``app``: the long commands' options in panels, and the invoked stage command's
    effective defaults (its config dataclass's) in its ``--help``, printed as every other default is."""
    import importlib

    from distill.configs import defaults

    group = typer.main.get_command(app)
    for command, panels in PANELS.items():  # panels in PANELS' order, --help in the last one
        cmd = group.commands[command]
        order = {name: (i, panel) for i, (panel, names) in enumerate(panels.items()) for name in names.split()}
        cmd.params.sort(key=lambda p: order.get(p.name, (len(panels), None))[0])
        for param in [*cmd.params, cmd.get_help_option(typer.Context(cmd))]:
            param.rich_help_panel = order.get(param.name, (None, list(panels)[-1]))[1]
    name = next((a for a in argv if not a.startswith("-")), None)
    if name in STAGE_CONFIGS and "--help" in argv:
        module, cls = STAGE_CONFIGS[name]
        shown = defaults(getattr(importlib.import_module(module), cls))
        for param in group.commands[name].params:
            value = shown.get(FIELDS.get(name, {}).get(param.name, param.name))
            if param.default is None and value not in (None, ()):
                param.default = _help_default(value)  # help only: _given() passes on what the command line gave
    return group


def main() -> None:
    try:
        _command(sys.argv[1:])(prog_name="distill")
    except DistillError as exc:
        if _state["debug"]:
            raise
        typer.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except OSError as exc:  # a full disk or a folder that cannot be written, wherever a command met it: one line too
        from distill.store.atomic import cannot_write

        if _state["debug"] or (found := cannot_write(exc)) is None:
            raise
        typer.echo(f"error: {str(exc.filename) + ': ' if exc.filename else ''}{found[0]}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        typer.echo("interrupted; run the same command again to resume", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
