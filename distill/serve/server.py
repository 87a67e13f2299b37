"""Start a server: the distill engine behind uvicorn, or vLLM's own OpenAI server with the heads.

Threads: the engine runs on the process's main thread and uvicorn on a second one
(the reason is in :mod:`distill.serve.scheduler`, "worker").

Shutdown (drain): SIGTERM or Ctrl-C makes the scheduler refuse new requests (503;
``/health`` answers 503 too, while the socket stays open) and lets the admitted ones
finish for up to ``shutdown_grace`` seconds; then those left end with a 503 JSON error
or, when streaming, an error event and ``data: [DONE]``. Once nothing is admitted,
uvicorn stops (its responses already complete, no task is cancelled) and ``serve``
returns: exit code 0. A second Ctrl-C forces the exit; a dead engine worker makes it 1.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from distill.errors import ConfigError
from distill.serve.config import ServeConfig

log = logging.getLogger("distill.serve")
RESPONSE_GRACE_S = 10.0  # after the drain: time uvicorn gives handlers to write their last bytes


def bind_warning(cfg: ServeConfig) -> str | None:
    """The warning printed when the server is reachable from other machines with no API key."""
    if not cfg.exposed_without_key:
        return None
    return (f"warning: distill serve binds {cfg.host} without an API key: anyone who can reach this port can use the model. "
            "Set DISTILL_API_KEY in the environment (a --api-key on the command line is visible in ps).")


def build_app(cfg: ServeConfig, worker_thread: bool = True):
    """Load the engine and make the app (no socket yet); ``worker_thread``: see :func:`~distill.serve.app.create_app`."""
    from distill.engine import Engine
    from distill.models import load_chat_template, resolve_model, stop_token_ids
    from distill.serve.app import AppSettings, create_app
    from distill.serve.protocol import request_defaults

    resolved = resolve_model(cfg.model)
    template = load_chat_template(cfg.chat_template)
    defaults, unhonoured = request_defaults(generation_config(cfg.generation_config, resolved.path))
    if defaults:
        log.warning("request defaults from %s: %s (--generation-config vllm for neutral ones)",
                    "the model's generation_config.json" if cfg.generation_config == "auto" else cfg.generation_config,
                    json.dumps(defaults))
    for name, value in unhonoured.items():
        log.warning("the generation config sets %s=%s, which this server does not honour yet: requests that omit %s "
                    "decode without it", name, value, name)
    engine = Engine.from_pretrained(cfg.model, cfg.heads, cfg.decoding)
    if getattr(engine.proposer, "datastore", None) is not None:
        log.info("lookup datastore: %s", engine.proposer.datastore.describe())
    if getattr(engine.proposer, "history", None) is not None:
        log.info("lookup history: %s", engine.proposer.history.describe())
    if engine.step_costs is not None:
        when = f"kept from an earlier start in {engine.step_costs.source}" if engine.step_costs.source else "measured at start"
        log.info("step costs %s (rows: cost of a forward over a one-row one): %s", when, engine.step_costs.to_dict())
    if engine.compile:
        t0 = time.perf_counter()
        engine.warmup()
        log.info("compiled the engine's decoding step in %.0f s", time.perf_counter() - t0)
    max_len = engine.max_len  # distill.models.context_limit: the model's context less the tree's margin
    if cfg.max_model_len is not None:
        if cfg.max_model_len > max_len:
            log.warning("--max-model-len %d exceeds what the engine can hold with its tree: %d is used", cfg.max_model_len, max_len)
        max_len = min(max_len, cfg.max_model_len)
    settings = AppSettings(
        model_name=cfg.served_model_name or engine.model_name,
        max_model_len=max_len,
        stop_token_ids=tuple(sorted(stop_token_ids(engine.tokenizer, resolved.path))),
        queue_size=cfg.queue_size,
        max_batch=cfg.decoding.max_batch,
        default_max_tokens=cfg.default_max_tokens,
        api_key=cfg.api_key,
        speculative=engine.proposer is not None,
        max_body_bytes=cfg.max_body_bytes,
        sampling_defaults=defaults,
        chat_template=template,
        chat_template_kwargs=cfg.chat_template_kwargs,
        model_root=str(resolved.path),
    )
    return create_app(engine, settings, worker_thread=worker_thread), settings


def generation_config(source: str, model_path: Path) -> dict:
    """The generation config values that differ from transformers' defaults (what vLLM reads), from
    ``source``: ``auto`` the model's ``generation_config.json`` (none there: {}), ``vllm`` / ``none``
    nothing, or a folder that must hold one."""
    from transformers import GenerationConfig

    if source in ("vllm", "none"):
        return {}
    folder = model_path if source == "auto" else Path(source).expanduser()
    try:
        return GenerationConfig.from_pretrained(folder).to_diff_dict()
    except OSError:
        if source == "auto":
            return {}
        raise ConfigError(f"--generation-config {source}: no generation_config.json there (auto: the model's; vllm: none)") from None


def _log_to_stderr(level: str) -> None:
    """The server's own start-up lines (the datastore, the history, the step costs) on stderr at ``level``, as
    uvicorn's are; once per process."""
    logger = logging.getLogger("distill")
    if not any(getattr(h, "distill_serve", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("distill serve: %(message)s"))
        handler.distill_serve = True
        logger.addHandler(handler)
    logger.setLevel(level.upper())


def check_heads(cfg: ServeConfig) -> None:
    """``--heads``: none, ``lookup``, or a folder holding heads or a drafter (names on disk only: nothing loads)."""
    from distill.engine.proposers.lookup import LOOKUP
    from distill.heads.model import check_heads_folder

    if cfg.heads is not None and cfg.heads != LOOKUP:
        check_heads_folder(Path(cfg.heads).expanduser())


def check_port(cfg: ServeConfig) -> None:
    """That ``--host``:``--port`` can be bound here now, as uvicorn and vLLM bind it (``SO_REUSEADDR``: a port another
    socket listens on is refused, one left in TIME_WAIT is not); ``--port 0`` (any free port) always can."""
    import errno
    import socket

    if cfg.port == 0:
        return
    family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((cfg.host, cfg.port))
        except OSError as exc:
            why = {errno.EADDRINUSE: "another process listens there: stop it, or choose another --port (0: any free port)",
                   errno.EACCES: "permission denied (ports below 1024 need privileges): choose another --port",
                   errno.EADDRNOTAVAIL: "the address is not one of this machine's: choose another --host"}
            raise ConfigError(f"cannot serve on {cfg.host}:{cfg.port}: "
                              + why.get(exc.errno, exc.strerror or str(exc))) from None


def serve(cfg: ServeConfig, log_level: str = "info") -> None:
    """Run until SIGTERM / Ctrl-C and the drain after it (``--engine vllm`` replaces this process with vLLM's server).

    The heads folder and the port are checked first: an error there is one line before any model loads."""
    check_heads(cfg)
    check_port(cfg)
    warning = bind_warning(cfg)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    if cfg.engine == "vllm":
        exec_vllm(cfg)
        return
    import uvicorn

    _log_to_stderr(log_level)
    app, settings = build_app(cfg, worker_thread=False)
    scheduler = app.state.scheduler
    proposer = getattr(scheduler.engine, "proposer", None) if settings.speculative else None
    mode = f"speculative decoding, proposer {proposer.name}" if proposer is not None else "plain decoding"
    print(f"distill serve: {settings.model_name} ({mode}) on http://{cfg.host}:{cfg.port}/v1", file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(
        app, host=cfg.host, port=cfg.port, log_level=log_level, timeout_graceful_shutdown=RESPONSE_GRACE_S,
        access_log=log_level == "debug",
    ))
    failed: list[BaseException] = []

    def http() -> None:  # uvicorn off the main thread installs no signal handlers: ours below stand in
        try:
            server.run()
        except BaseException as exc:  # noqa: BLE001 - e.g. SystemExit when the port is taken
            failed.append(exc)
        finally:
            scheduler.stop(timeout=0)  # ends the engine loop if the lifespan did not

    def on_signal(sig, frame) -> None:
        if scheduler.draining and sig == signal.SIGINT:  # a second Ctrl-C: now
            server.force_exit = server.should_exit = True
            scheduler.stop(timeout=0)
            return
        print(f"distill serve: {signal.Signals(sig).name}: finishing admitted requests for up to {cfg.shutdown_grace:g} s "
              "(new ones get 503)", file=sys.stderr, flush=True)
        scheduler.drain(cfg.shutdown_grace)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    thread = threading.Thread(target=http, name="distill-http", daemon=True)
    try:
        thread.start()
        scheduler.run()  # the engine, on this thread, until the drain ends (or the server stops)
        server.should_exit = True
        while thread.is_alive():
            thread.join(0.5)  # in slices: a signal handler runs between them
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if scheduler.error is not None:
        print(f"distill serve: the engine worker died: {scheduler.error}", file=sys.stderr, flush=True)
        raise SystemExit(1)
    if failed or not server.started:
        raise SystemExit(1)


# -- --engine vllm -------------------------------------------------------------------------
#: Drafts per step vLLM's EAGLE-3 proposer makes when --num-speculative-tokens is not given (vLLM's examples use 3).
VLLM_EAGLE_TOKENS = 3
#: Drafts per step of vLLM's ngram proposer for --heads lookup when --num-speculative-tokens is not given.
VLLM_LOOKUP_TOKENS = 4

def vllm_command(cfg: ServeConfig, python: str | None = None) -> list[str]:
    """The command that starts vLLM's OpenAI server with the heads as its Medusa or EAGLE-3 speculator
    (``--heads lookup``: vLLM's ``ngram`` prompt lookup, with the lookup proposer's n-gram range).

    vLLM proposes one chain (each head's top-1 token) and verifies it; it has no
    tree attention, so ``--tree`` does not apply. The dtype and its one rule are the distill
    engine's (:func:`distill.engine.config.resolve_placement`: the heads' teacher dtype by default); vLLM's
    own defaults stand for everything else, and ``cfg.vllm_args`` (what followed ``--``
    on the command line) are appended unchanged.
    """
    from distill.engine.proposers.lookup import DEFAULT_MAX_NGRAM, DEFAULT_MIN_NGRAM, LOOKUP
    from distill.heads.eagle import is_eagle3_folder
    from distill.heads.model import HeadsConfig, check_heads_folder
    from distill.engine.config import resolve_placement
    from distill.models import resolve_model

    if cfg.heads == LOOKUP:  # vLLM's prompt lookup: one chain from the context's n-gram match, nothing loaded
        resolved = resolve_model(cfg.model)
        where = resolve_placement(cfg.decoding, resolved.path, cfg.heads)
        spec = {"method": "ngram", "num_speculative_tokens": cfg.num_speculative_tokens or VLLM_LOOKUP_TOKENS,
                "prompt_lookup_max": DEFAULT_MAX_NGRAM, "prompt_lookup_min": DEFAULT_MIN_NGRAM}
        return _vllm_server_command(cfg, python, resolved, spec, where.dtype)
    heads = check_heads_folder(Path(cfg.heads).expanduser().resolve())
    if not (heads / "config.json").is_file():
        raise ConfigError(f"--heads {cfg.heads} is not a heads folder (needs config.json and model.safetensors)")
    if is_eagle3_folder(heads):  # vLLM's llama_eagle3 drafter: a chain of num_speculative_tokens drafts
        method, k = "eagle3", cfg.num_speculative_tokens or VLLM_EAGLE_TOKENS
    else:
        try:
            hcfg = HeadsConfig.from_vllm_config(json.loads((heads / "config.json").read_text()))
        except (ValueError, KeyError) as exc:
            raise ConfigError(f"{heads}/config.json is not a Medusa heads config: {exc}") from None
        method, k = "medusa", cfg.num_speculative_tokens or hcfg.num_heads
        if k > hcfg.num_heads:
            raise ConfigError(f"--num-speculative-tokens {k} exceeds the {hcfg.num_heads} heads in {heads}")
    resolved = resolve_model(cfg.model)
    where = resolve_placement(cfg.decoding, resolved.path, heads)
    spec = {"method": method, "model": str(heads), "num_speculative_tokens": k}
    return _vllm_server_command(cfg, python, resolved, spec, where.dtype)


def _vllm_server_command(cfg: ServeConfig, python: str | None, resolved, spec: dict, dtype: str) -> list[str]:
    cmd = [
        python or sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(resolved.path),
        "--served-model-name", cfg.served_model_name or resolved.name,
        "--host", cfg.host, "--port", str(cfg.port),
        "--speculative-config", json.dumps(spec),
        "--dtype", dtype,
    ]
    if cfg.vllm_max_num_seqs is not None:
        cmd += ["--max-num-seqs", str(cfg.vllm_max_num_seqs)]
    if cfg.max_model_len is not None:
        cmd += ["--max-model-len", str(cfg.max_model_len)]
    if cfg.chat_template is not None:  # vLLM's options of the same names and meanings
        cmd += ["--chat-template", cfg.chat_template]
    if cfg.chat_template_kwargs:
        cmd += ["--default-chat-template-kwargs", json.dumps(cfg.chat_template_kwargs)]
    if cfg.generation_config != "auto":
        cmd += ["--generation-config", "vllm" if cfg.generation_config == "none" else cfg.generation_config]
    return cmd + list(cfg.vllm_args)


def vllm_env(cfg: ServeConfig) -> dict[str, str]:
    """The environment for vLLM's server.

    The API key goes in VLLM_API_KEY, not on the (world-readable) command line; on a CPU
    machine the thread settings of :func:`distill.runtime.vllm_cpu_env` (variables the
    user set are kept), and with ``--enforce-eager`` no torch.compile at all
    (``TORCH_COMPILE_DISABLE=1``): vLLM would still compile a sampler helper on the first
    request that asks for logprobs, an inductor C++ build of several seconds on a CPU (see
    :class:`distill.generate.backends.VLLMBackend`).
    """
    from distill.runtime import resolve_device, vllm_cpu_env

    env = dict(os.environ)
    if resolve_device("auto") == "cpu":
        for key, value in vllm_cpu_env().items():
            env.setdefault(key, value)
        if "--enforce-eager" in cfg.vllm_args:
            env.setdefault("TORCH_COMPILE_DISABLE", "1")
    if cfg.api_key is not None:
        env["VLLM_API_KEY"] = cfg.api_key
    return env


def exec_vllm(cfg: ServeConfig) -> None:
    cmd = vllm_command(cfg)
    try:
        importlib.import_module("vllm")
    except ImportError:
        raise ConfigError("--engine vllm needs vLLM: pip install 'distill[vllm]' (GPU) or 'distill[cpu]'") from None
    print("distill serve --engine vllm: " + " ".join(_quote(c) for c in cmd), file=sys.stderr, flush=True)
    os.execve(cmd[0], cmd, vllm_env(cfg))


def _quote(arg: str) -> str:
    import shlex

    return shlex.quote(arg)
