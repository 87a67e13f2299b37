"""Shared fixtures: one converted model, one in-process vLLM engine, one HF backend per session."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from distill.store import ShardStore, TeacherEncoding, encode_topk

os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
# The session's engine runs in this process (no engine-core subprocess to spawn from pytest).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Inductor (the compiled-forward tests) first builds and loads a test program for each vector ISA the CPU's flags name,
# once per machine: its on-disk cache keeps the result, but the suite starts from an empty one. Trusting the flags
# skips those builds, which cost the compiled-forward test a large share of its time; the kernels are built alike.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")

REPO = Path(__file__).resolve().parents[1]
DISTILL = str(Path(sys.executable).with_name("distill"))
COMMAND_SECONDS = "readme_command_seconds"  # a user property: (seconds, command) of the docs walkthrough's commands
_COMMAND_ROWS: list = []


# A two-token, two-turn row and a store for it: the shard store's own tests (local, journal, object store) share them.
TINY_KEY = {"model_id": "m", "topk": 2}
TINY_ENC = TeacherEncoding.for_vocab(2, 100)


def tiny_row(i: int) -> dict:
    ids, lp = encode_topk(np.array([[3, 4], [5, 6]]), np.array([[-0.1, -2.0], [-0.3, -1.5]]), TINY_ENC)
    return {
        "id": f"s:{i}", "source": "s", "messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": "yo"}],
        "input_ids": [1, 2, 3, 5], "loss_mask": [False, False, True, True], "teacher_ids": ids, "teacher_lp": lp,
        "turns": [{"role": "user", "start": 0, "end": 2, "n_tokens": 0, "finish_reason": None},
                  {"role": "assistant", "start": 2, "end": 4, "n_tokens": 2, "finish_reason": "stop"}],
        "stop_reason": "completed", "n_prompt_tokens": 2, "n_generated_tokens": 2,
    }


def tiny_store(root, key=TINY_KEY) -> ShardStore:
    return ShardStore(root, {"config_key": key, "teacher": TINY_ENC.to_dict()}, key, TINY_ENC.id_dtype).open()


def pytest_runtest_logreport(report):
    """Collect the docs walkthrough's timings (a report's user properties reach the controller under xdist too)."""
    if report.when == "call":
        _COMMAND_ROWS.extend(tuple(row) for name, rows in report.user_properties if name == COMMAND_SECONDS for row in rows)


def pytest_terminal_summary(terminalreporter, config):
    """Where the docs walkthrough's time goes (CI logs show it beside pytest's --durations)."""
    rows = sorted(_COMMAND_ROWS, reverse=True)
    if rows:
        terminalreporter.section(f"docs commands: {len(rows)} in {sum(s for s, _ in rows):.0f}s, slowest first")
        for seconds, cmd in rows[:25]:
            terminalreporter.write_line(f"{seconds:7.1f}s  {cmd[:160]}")


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from distill.models import resolve_model

    return resolve_model(None).path


@pytest.fixture(scope="session")
def vllm_backend(model_dir):
    from distill.generate.backends import BackendOptions, VLLMBackend, vllm_available

    if not vllm_available():
        pytest.fail("vLLM is not installed: run scripts/setup.sh (the test command does)")
    backend = VLLMBackend(model_dir, BackendOptions(dtype="float32", max_model_len=2048, seed=0))
    yield backend
    backend.close()


@pytest.fixture(scope="session")
def hf_backend(model_dir):
    from distill.generate.backends import BackendOptions, HFBackend

    return HFBackend(model_dir, BackendOptions(dtype="float32", max_model_len=2048, batch_size=8))


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def mt_bench_prompts(tokenizer, n: int) -> list[list[int]]:
    """The chat-templated first turns of the first ``n`` MT-Bench questions (token ids)."""
    from distill.seeds import load_seed

    out = []
    for conv in load_seed("mt-bench"):
        if hasattr(conv, "messages"):
            first = next(m for m in conv.messages if m.role == "user")
            out.append(list(tokenizer.apply_chat_template([{"role": "user", "content": first.content}],
                                                          add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]))
        if len(out) == n:
            return out
    raise ValueError(f"MT-Bench has fewer than {n} questions")


MT_QUESTIONS, MT_TOKENS = 3, 24


@pytest.fixture(scope="session")
def mt_prompts(tokenizer) -> list[list[int]]:
    """The first MT-Bench first turns that the engine tests decode (MT_QUESTIONS of them)."""
    return mt_bench_prompts(tokenizer, MT_QUESTIONS)


@pytest.fixture(scope="session")
def mt_plain(hf_model, tokenizer, mt_prompts) -> list[list[int]]:
    """Plain greedy decoding of ``mt_prompts`` (MT_TOKENS each, one prompt at a time): what every proposer must reproduce."""
    from distill.engine import Engine, EngineConfig, SamplingParams

    engine = Engine(hf_model, tokenizer, None, EngineConfig())
    return [engine.generate([p], SamplingParams(max_tokens=MT_TOKENS))[0][0].token_ids for p in mt_prompts]


@pytest.fixture(scope="session")
def hf_model(model_dir):
    """The model in float32 for re-scoring stored token streams."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def built_once(tmp_path_factory, name: str, build) -> Path:
    """``build(folder)`` once per test run, the folder shared read-only by every pytest-xdist worker.

    The first worker to ask builds it under a file lock in the run's common temp folder; the
    other finds it there (or waits for it) instead of building its own copy. A build that
    fails leaves no mark: the next to ask builds it again.
    """
    from filelock import FileLock

    if not os.environ.get("PYTEST_XDIST_WORKER"):  # one process: a folder of its own
        out = tmp_path_factory.mktemp(name) / name
        build(out)
        return out
    root = tmp_path_factory.getbasetemp().parent / f"built-once-{name}"
    with FileLock(f"{root}.lock"):
        if not (root / ".built").exists():
            shutil.rmtree(root, ignore_errors=True)
            build(root / name)
            (root / ".built").touch()
    return root / name


@pytest.fixture(scope="session")
def real_shards(tmp_path_factory, request) -> Path:
    """A small self-distilled dataset made by the real generator and engine, shared read-only.

    16 ShareGPT conversations (multi-turn replay, temperature 0.7, up to 64 new
    tokens a turn, teacher k=20) in shards of 6 rows: 3 shards. Tests that modify
    a dataset copy it first (``shutil.copytree``). Made once per run (:func:`built_once`:
    ~40 s of one core here), by the session's vLLM engine of the worker that made it.
    """
    from distill.generate import GenerateConfig, Generator

    def build(out: Path) -> None:
        cfg = GenerateConfig(seed="sharegpt", out=str(out), limit=16, shard_size=6, max_new_tokens=64, temperature=0.7,
                             dtype="float32", sampling_seed=0)
        summary = Generator(cfg, backend=request.getfixturevalue("vllm_backend")).run()
        assert summary.generated == 16 and summary.balanced

    return built_once(tmp_path_factory, "sharegpt", build)


@pytest.fixture(scope="session")
def plain_shards(tmp_path_factory, model_dir) -> Path:
    """Four seed conversations tokenized with the bundled model's chat template (no teacher, no vLLM): heads train on
    them in seconds. Read-only; copy it to put it in a tree of your own."""
    import json

    from distill.data.convert import seed_to_shards

    def build(out: Path) -> None:
        seed = tmp_path_factory.mktemp("plain-seed") / "plain-seed.jsonl"  # out's parent need not exist yet
        topics = ("the sea", "a cat", "rain", "bread")
        seed.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Say something about {t}."},
                                                         {"role": "assistant", "content": f"Here is a sentence about {t}, "
                                                          f"and another one about {t} that goes on a little longer."}]}) + "\n"
                                for t in topics))
        seed_to_shards(str(seed), out)

    return built_once(tmp_path_factory, "plain-shards", build)


@pytest.fixture()
def one_torch_thread():
    """Tiny tensors: one torch thread is fastest and avoids thread contention (restored after)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture()
def cli_env(tmp_path):
    """Environment for running the `distill` command: the console script in a subprocess, or :func:`run_distill`."""
    env = dict(os.environ)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env["HF_DATASETS_CACHE"] = str(tmp_path / "hf-datasets-cache")
    return env


def run_distill(args, env: dict | None = None, cwd: Path | None = None, timeout: int = 900) -> subprocess.CompletedProcess:
    """``distill ARGS`` run inside this test process, as the console script runs it.

    The console script's own ``main()`` (its one-line errors and exit codes) runs with ``sys.argv``, the
    environment ``env`` (else this process's) and the working folder ``cwd``; its stdout and stderr are
    captured (click's test isolation) and returned as ``subprocess.run(..., capture_output=True, text=True)``
    returns them. The environment, folder and argv are restored after. What it saves is a fresh process's
    imports (torch and transformers: seconds of CPU each), which this worker has done
    already. For commands that end by themselves in one process: not ``serve`` (signal handlers, a port), not
    vLLM's ``generate`` (one in-process vLLM engine a process; the session's is :func:`vllm_backend`), not a
    run a test kills: those keep their processes, and the docs walkthrough runs each subcommand first as
    the console script. A command still running after ``timeout`` seconds ends this worker with every thread's
    traceback on stderr (:func:`faulthandler.dump_traceback_later`): a hang fails, as the subprocess's timeout
    made it fail, instead of stalling the suite.
    """
    import faulthandler

    from click.testing import CliRunner

    from distill import cli

    args = [str(a) for a in args]
    saved_env, saved_cwd, saved_argv = dict(os.environ), os.getcwd(), sys.argv
    code = 0
    _reset_accelerate()
    faulthandler.dump_traceback_later(timeout, exit=True)
    try:
        with CliRunner().isolation() as (out, err, _):
            if env is not None:
                os.environ.clear()
                os.environ.update(env)
            if cwd is not None:
                os.chdir(cwd)
            sys.argv = ["distill", *args]
            try:
                cli.main()
            except SystemExit as exc:
                if isinstance(exc.code, str):  # sys.exit("message"): printed, exit status 1
                    print(exc.code, file=sys.stderr)
                code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
            sys.stdout.flush()
            sys.stderr.flush()
            stdout, stderr = out.getvalue().decode(), err.getvalue().decode()
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        os.chdir(saved_cwd)
        sys.argv = saved_argv
        faulthandler.cancel_dump_traceback_later()
        _reset_accelerate()
    return subprocess.CompletedProcess(["distill", *args], code, stdout, stderr)


def _reset_accelerate() -> None:
    """Forget accelerate's process-wide state (as accelerate's own tests do between cases).

    ``train-heads`` makes an ``Accelerator``, whose state is one per process and refuses another mixed
    precision once set ("restart your runtime"): a fresh process starts without it, and so must each
    in-process command.
    """
    if "accelerate" in sys.modules:
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)


# -- checks shared by the generation tests ---------------------------------------------------
LOGPROB_TOL = 0.02  # nats: engine-vs-transformers float32 noise (~1e-4) + storage quantization (4.9e-4), with margin
ARGMAX_TOL = 1e-3  # nats: a greedy token may tie the argmax within float noise


def assert_teacher_matches_model(root: Path, model, greedy: bool) -> int:
    """Re-score every stored token stream with transformers (float32) and compare the teacher columns.

    At every generated position t the stored candidates must carry the model's
    log-softmax at t-1 within LOGPROB_TOL, no token clearly above the k-th stored
    logprob may be missing, and (greedy) the generated token must be the argmax.
    Returns the number of positions checked.
    """
    import numpy as np
    import torch

    from distill.store import TeacherEncoding, decode_row_dense, iter_rows, load_manifest

    enc = TeacherEncoding.from_dict(load_manifest(root)["meta"]["teacher"])
    checked = 0
    for row in iter_rows(root):
        ids = torch.tensor(row["input_ids"])[None]  # (1, T)
        with torch.inference_mode():
            ref = torch.log_softmax(model(ids).logits[0].float(), -1).numpy()  # (T, V)
        t_ids, t_lp = decode_row_dense(row["input_ids"], row["loss_mask"], row["teacher_ids"], row["teacher_lp"], enc)
        pos = np.flatnonzero(row["loss_mask"])
        assert pos.size and pos.min() > 0
        dist = ref[pos - 1]  # (N, V): the distribution each generated token was drawn from
        cand = t_ids[pos]  # (N, K)
        assert all(len(set(c)) == len(c) for c in cand.tolist()), f"{row['id']}: a position repeats a candidate id"
        stored = t_lp[pos]  # (N, K)
        rescored = np.take_along_axis(dist, cand, axis=1)
        worst = np.abs(rescored - stored).max()
        assert worst <= LOGPROB_TOL, f"{row['id']}: stored logprob off by {worst:.4f} nats"
        kth = stored[:, -1:]  # (N, 1)
        above = dist > kth + LOGPROB_TOL  # (N, V) tokens that clearly belong in the top-k
        in_top = np.zeros_like(above)
        np.put_along_axis(in_top, cand, True, axis=1)
        assert not (above & ~in_top).any(), f"{row['id']}: a top-k candidate is missing"
        if greedy:
            tokens = np.asarray(row["input_ids"])[pos]
            gap = dist.max(1) - dist[np.arange(pos.size), tokens]
            assert gap.max() <= ARGMAX_TOL, f"{row['id']}: a greedy token is {gap.max():.4f} nats below the argmax"
        checked += pos.size
    return checked


ENC_TOL = 1.0 / 1024 + 1e-6  # one quantization step of the teacher encoding


def _rows_by_id(out) -> dict[str, dict]:
    from distill.store import iter_rows

    return {r["id"]: r for r in iter_rows(out)}


def assert_same_rows(out, ref) -> None:
    """Same ids, token streams, masks, messages and turns; teacher top-k equal within the encoding error.

    Two engines (or one engine batching differently) differ by float noise, which may round a
    logprob to the neighbouring 1/1024 code or swap two candidates tied at the k-th place.
    """
    from distill.store import TeacherEncoding, decode_topk, load_manifest

    enc = TeacherEncoding.from_dict(load_manifest(out)["meta"]["teacher"])
    got, want = _rows_by_id(out), _rows_by_id(ref)
    assert sorted(got) == sorted(want)
    for key, a in got.items():
        b = want[key]
        for col in ("input_ids", "loss_mask", "messages", "turns", "stop_reason", "n_generated_tokens"):
            assert a[col] == b[col], f"{key}: {col} differs"
        ids_a, lp_a = decode_topk(a["teacher_ids"], a["teacher_lp"], enc)  # (N, K)
        ids_b, lp_b = decode_topk(b["teacher_ids"], b["teacher_lp"], enc)
        for t in range(ids_a.shape[0]):
            da, db = dict(zip(ids_a[t].tolist(), lp_a[t].tolist())), dict(zip(ids_b[t].tolist(), lp_b[t].tolist()))
            for tok in set(da) & set(db):
                assert abs(da[tok] - db[tok]) <= ENC_TOL, f"{key} position {t}: logprob of {tok} differs"
            for tok in set(da) ^ set(db):  # only a tie at the k-th place may swap a candidate
                kth = min(lp_a[t][-1], lp_b[t][-1])
                assert abs(da.get(tok, db.get(tok)) - kth) <= ENC_TOL, f"{key} position {t}: candidate {tok} differs"


# -- trained heads shared by the training, heads and calibration tests ---------------
TRAINED_HEADS_OPTIONS = dict(heads=2, share_lm_head=True, max_len=64, batch_size=4, steps=12, lr=3e-3, warmup_steps=2,
                             seed=0, progress=False)


@pytest.fixture(scope="session")
def trained_heads(tmp_path_factory, real_shards) -> Path:
    """Medusa-1 heads (K=2, shared LM head) trained for 12 steps on ``real_shards``; read-only, made once per run."""
    from distill.train import TrainConfig, train

    def build(out: Path) -> None:
        summary = train(TrainConfig(data=str(real_shards), out=str(out), **TRAINED_HEADS_OPTIONS))
        assert summary.steps == TRAINED_HEADS_OPTIONS["steps"] and not summary.stopped_early

    return built_once(tmp_path_factory, "heads", build)


# -- a real vLLM OpenAI server (the openai backend's tests) ------------------------------------
def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMServer:
    """`python -m vllm.entrypoints.openai.api_server` on 127.0.0.1 with the bundled model, in its own process group.

    vLLM's defaults stand (raw logprobs, its engine-core process) but for what ``distill serve --engine vllm``
    sets on a CPU (:func:`distill.runtime.vllm_cpu_env`: the worker inside the engine-core process, not a third
    process spinning beside it); float32 and eager mode as the in-process test engine runs, so both give the same
    tokens. ``extra`` is appended.
    """

    def __init__(self, model_dir: Path, log_path: Path, extra: tuple[str, ...] = (), dev_mode: bool = False):
        import subprocess

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        from distill.runtime import vllm_cpu_env

        env = {**os.environ, **vllm_cpu_env()}
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"
        env["TORCH_COMPILE_DISABLE"] = "1"  # eager, as `distill serve --engine vllm -- --enforce-eager` runs it
        if dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"  # /server_info reports the dtype and the logprobs mode
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--host", "127.0.0.1",
               "--port", str(self.port), "--dtype", "float32", "--max-model-len", "2048", "--max-logprobs", "64",
               "--enforce-eager", *extra]
        self.log_path = log_path
        self.proc = subprocess.Popen(cmd, env=env, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 900) -> "VLLMServer":
        import time
        import urllib.request

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited ({self.proc.returncode}):\n{self.log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=5) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(1)
        self.kill()
        raise RuntimeError(f"vLLM server not ready in {timeout}s:\n{self.log_path.read_text()[-3000:]}")

    def kill(self) -> None:
        """SIGKILL the whole process group (API server and engine core)."""
        import signal

        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


_LAST_SERVER_USER = pytest.StashKey[str]()
_SERVER = pytest.StashKey[VLLMServer]()


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(session, config, items):
    """For `-n 2` (scripts/test.sh): the docs walkthrough, a quarter of the suite on its own, starts first so the
    other worker runs everything else beside it; the session vLLM server's users share one worker (one server), and
    so do a module's tests that use a module-scoped fixture (a server, an engine: built once, not once per worker).
    scripts/test.sh keeps this order (``--no-loadscope-reorder``)."""
    items.sort(key=lambda item: item.nodeid.split("::")[0] != "tests/test_docs.py")  # stable: the rest keep their order
    for item in items:
        if "vllm_server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("vllm_server"))
        elif _uses_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


def _uses_module_fixture(item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    defs = getattr(info, "name2fixturedefs", {}) if info is not None else {}
    return any(d[-1].scope in ("module", "class") for d in defs.values() if d)


def pytest_runtest_teardown(item, nextitem):
    """A vLLM server is not left running for tests that do not use it (its memory, its processes).

    The last user is found among the session's items once the run has begun (after -k / -m deselection)."""
    config = item.config
    if _LAST_SERVER_USER not in config.stash:
        users = [i.nodeid for i in item.session.items if "vllm_server" in getattr(i, "fixturenames", ())]
        config.stash[_LAST_SERVER_USER] = users[-1] if users else ""
    if item.nodeid == config.stash[_LAST_SERVER_USER] and _SERVER in config.stash:
        config.stash[_SERVER].kill()


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory, model_dir, request):
    """One vLLM OpenAI server for the session (dev mode on: it reports its config), stopped after its last user."""
    server = VLLMServer(model_dir, tmp_path_factory.mktemp("vllm-server") / "server.log", dev_mode=True).wait_ready()
    request.config.stash[_SERVER] = server
    yield server
    server.kill()
