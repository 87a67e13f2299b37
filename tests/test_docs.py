"""The documentation's commands, run: every fenced ``bash`` and ``python`` block of README.md and of
the guides in docs/, in the order of :data:`DOCS`, each file top to bottom.

One scratch folder stands in for a user's working directory, shared by every file, so a guide may
use what the README's walkthrough or an earlier guide made. What differs from a GPU user's machine
is made to exist there rather than edited out of the commands:

- ``./my-chat-model`` is a link to the bundled SmolLM2-135M-Instruct folder;
- ``hf:HuggingFaceH4/ultrachat_200k:train_sft`` resolves to a local folder at that relative
  path, laid out as on the Hub (``data/train_sft-00000-of-00001.parquet``, UltraChat's
  columns), so the real ``hf:`` path through ``datasets.load_dataset`` runs;
- ``distill push`` talks to a local server speaking the Hub API (``HF_ENDPOINT``);
- ``distill serve`` is started in the background, answered by the README's OpenAI client
  block, and stopped with SIGTERM (exit 0 expected).

What the test changes in the commands themselves, and only this: sizes (:data:`SIZES`:
rows, tokens, steps, prompts; GPU counts to what a 2-core CPU runs: tensor parallelism 1,
``accelerate launch --multi_gpu`` runs as written: on a machine without GPUs it starts
2 CPU processes with the gloo backend; ``--precision bf16`` becomes ``auto`` on a CPU without
native bf16, where emulated bf16 is orders of magnitude slower), the server port, ``--enforce-eager`` for vLLM's
server (its inductor compile is most of its start-up on a CPU), and the set-up script,
which runs in plan mode (``DISTILL_SETUP_PLAN=1``: the CUDA wheels are not installable
here; the plan must name the ``vllm`` extra, which pyproject.toml must declare).
``bash scripts/test.sh`` is the command CI runs (``.ci/run``), which includes this test.

Each subcommand runs first as the console script, as a user runs it. Its later commands, where the
subcommand ends by itself and reaches no server (:data:`REPEATS_IN_PROCESS`) and the command is one
plain ``distill ...`` line, run the same ``main()`` with the same arguments, environment and folder in
this process (:func:`conftest.run_distill`), which saves a fresh process's torch and transformers imports.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path

import pytest

from conftest import COMMAND_SECONDS, REPO, run_distill
from distill.runtime import cpu_has_native_bf16
from fakehub import TOKEN, FakeHub

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

README = REPO / "README.md"
# The order the blocks run in: the README's walkthrough first, then each guide (later ones use what earlier ones made).
DOCS = [README] + [REPO / "docs" / f"{name}.md" for name in (
    "install", "generate", "data", "train", "serve", "bench", "run", "formats", "cli", "architecture", "development")]
VENV_BIN = Path(sys.executable).parent
API_KEY = "docs-test-key"

# Per subcommand: option -> small value; replaced where the command sets it, appended where not.
# (tensor parallelism 1: GPU counts are sizes too)
SIZES: dict[str, dict[str, str]] = {
    "generate": {"--limit": "3", "--max-tokens": "8", "--shard-size": "2"},
    "train-heads": {"--steps": "2", "--max-len": "128", "--context": "32", "--batch-size": "2", "--grad-accum": "1",
                    "--keep-checkpoints": "1"},
    "calibrate": {"--max-len": "128", "--eval-tokens": "512", "--nodes": "8"},
    "bench": {"--limit": "1", "--max-tokens": "8", "--sweep-nodes": "1,4", "--sweep-repeats": "1", "--sweep-context": "32"},
    "data split": {"--eval-fraction": "0.34"},
}
# Only replaced where present (they change what a command does, so never added).
REPLACE_ONLY: dict[str, dict[str, str]] = {
    "generate": {"--tensor-parallel-size": "1"},
    "train-heads": {"--stop-after": "1", "--save-every": "1"},  # a stopped run resumes from its checkpoint
}
if not cpu_has_native_bf16():  # bf16 is ~300x slower where emulated: the walkthrough runs the one dtype rule's choice
    REPLACE_ONLY["train-heads"]["--precision"] = "auto"
# Repeats of these run in this process (module docstring): no vLLM engine, no server, no Hub endpoint read at import.
REPEATS_IN_PROCESS = {"train-heads", "calibrate", "bench", "export", "env", "data validate", "data stats", "data inspect",
                      "data dedupe", "data split", "data merge", "data convert", "data repair"}
ONE_COMMAND = re.compile(r"distill\s[^|&;<>$`()\\*?~]*")  # no pipe, list, redirection, substitution, variable or glob
# split.by=id: 4 conversations have too few distinct openers for the quickstart's first-turn split
PIPELINE_SETS = ["generate.limit=4", "generate.max_new_tokens=8", "generate.turns=1", "split.by=id", "train.steps=2", "train.max_len=128",
                 "train.context=32", "calibrate.max_len=128", "bench.limit=1", "bench.max_tokens=8"]


def doc_blocks(text: str, name: str = "README.md") -> list[tuple[str, str, int]]:
    """(language, code, line number) of every fenced block of one file."""
    out, lang, buf, start = [], None, [], 0
    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            if lang is None:
                lang, buf, start = line[3:].strip() or "text", [], n
            else:
                out.append((lang, "\n".join(buf), start))
                lang = None
        elif lang is not None:
            buf.append(line)
    assert lang is None, f"{name}: the block opened at line {start} is never closed"
    return out


def all_blocks() -> list[tuple[str, str, str]]:
    """(language, code, "file:line") of every fenced block of :data:`DOCS`, in the order they run."""
    return [(lang, code, f"{path.relative_to(REPO)}:{line}") for path in DOCS
            for lang, code, line in doc_blocks(path.read_text(), path.name)]


def _strip_comment(line: str) -> str:
    """``line`` without a trailing ``# comment`` (a ``#`` inside quotes stays)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def shell_commands(code: str) -> list[str]:
    """One string per command: continuation lines joined, comments and blank lines dropped."""
    out, cur = [], ""
    for line in code.splitlines():
        line = _strip_comment(line)
        if line.endswith("\\"):
            cur += line[:-1].rstrip() + " "
            continue
        cur += line
        if cur.strip():
            out.append(" ".join(cur.split()))
        cur = ""
    return out


def subcommand(cmd: str) -> str | None:
    m = re.search(r"\bdistill(?:\.cli)?\s+(data\s+\w+|[a-z][\w-]*)", cmd)
    return " ".join(m.group(1).split()) if m else None


def _set_option(cmd: str, opt: str, value: str, append: bool) -> str:
    pattern = re.compile(rf"(?<=\s){re.escape(opt)}(?:\s+|=)(\"[^\"]*\"|'[^']*'|\S+)")
    if pattern.search(cmd):
        return pattern.sub(f"{opt} {value}", cmd)
    if not append:
        return cmd
    return _append(cmd, f"{opt} {value}")


def _append(cmd: str, words: str) -> str:
    """Append to the distill command itself (a loop line ends in `& done; wait`)."""
    m = re.search(r"\s+&\s+done;", cmd)
    return f"{cmd[:m.start()]} {words}{cmd[m.start():]}" if m else f"{cmd} {words}"


def sized(cmd: str) -> str:
    """The command with the docs test's sizes (see the module docstring)."""
    sub = subcommand(cmd)
    for opt, value in SIZES.get(sub, {}).items():
        cmd = _set_option(cmd, opt, value, append=True)
    for opt, value in REPLACE_ONLY.get(sub, {}).items():
        cmd = _set_option(cmd, opt, value, append=False)
    if sub == "train-heads" and "-share-lm-head" not in cmd:
        # Disk is a size too: an untied head is a 49152 x 576 LM head (113 MB, 3x that in a checkpoint),
        # so the walkthrough's dozen heads folders would take GBs; shared, ~120 MB each.
        cmd = _append(cmd, "--share-lm-head")
    if sub == "serve" and "--engine vllm" in cmd and "--print-command" not in cmd:
        # vLLM compiles its CPU model with inductor at start-up (~50 s of a ~75 s start here); what the walkthrough
        # checks is that vLLM's server loads and serves our heads, which eager mode shows as well
        cmd += " --enforce-eager" if re.search(r"\s--(\s|$)", cmd) else " -- --enforce-eager"
    if sub == "run" or cmd.startswith("bash scripts/run.sh"):
        cmd += "".join(f" --set {s}" for s in PIPELINE_SETS)
    return cmd


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ultrachat_layout(work: Path, rows: int = 12) -> None:
    """A local folder shaped like the Hub's HuggingFaceH4/ultrachat_200k (split train_sft), from the bundled seed."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from distill.seeds import load_seed

    records = []
    for conv in load_seed("sharegpt"):
        if len(records) == rows:
            break
        if not hasattr(conv, "messages"):
            continue
        msgs = [{"role": m.role, "content": m.content} for m in conv.messages if m.role in ("user", "assistant")]
        # distinct prompts, as in UltraChat (the bundled ShareGPT file repeats many of its openers)
        if msgs and msgs[0]["role"] == "user" and all(r["prompt"] != msgs[0]["content"] for r in records):
            records.append({"prompt": msgs[0]["content"], "prompt_id": f"{len(records):064x}", "messages": msgs})
    folder = work / "HuggingFaceH4" / "ultrachat_200k" / "data"
    folder.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(records), folder / "train_sft-00000-of-00001.parquet")


class Docs:
    """Runs the README's blocks in one scratch folder and records what ran."""

    def __init__(self, work: Path, env: dict, client_code: str):
        self.work, self.env, self.client_code = work, env, client_code
        self.ran: list[str] = []
        self.seconds: list[tuple[float, str]] = []  # (wall seconds, command): printed slowest first at the end
        self.run_as_script: set[str] = set()  # the subcommands run as the console script so far

    def command(self, cmd: str) -> str:
        """One README command: the console script, or this process for a repeat (module docstring)."""
        sub = subcommand(cmd)
        if not ONE_COMMAND.fullmatch(cmd):
            return self.sh(cmd)
        if sub not in REPEATS_IN_PROCESS or sub not in self.run_as_script:
            self.run_as_script.add(sub)
            return self.sh(cmd)
        start = time.monotonic()
        proc = run_distill(shlex.split(cmd)[1:], env=self.env, cwd=self.work)
        self.seconds.append((time.monotonic() - start, f"{cmd} (in-process)"))
        assert proc.returncode == 0, f"README command failed ({proc.returncode}): {cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}"
        self.ran.append(cmd)
        return proc.stdout

    def sh(self, cmd: str, cwd: Path | None = None, env: dict | None = None, timeout: int = 900) -> str:
        start = time.monotonic()
        proc = subprocess.run(["bash", "-c", cmd], cwd=cwd or self.work, env=env or self.env, capture_output=True,
                              text=True, timeout=timeout)
        self.seconds.append((time.monotonic() - start, cmd))
        assert proc.returncode == 0, f"README command failed ({proc.returncode}): {cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}"
        self.ran.append(cmd)
        return proc.stdout

    def python(self, code: str, port: int | None = None) -> str:
        if port is not None:
            code = code.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        path = self.work / f"block-{len(self.ran)}.py"
        path.write_text(code)
        out = self.sh(f"{sys.executable} {path.name}")
        self.ran[-1] = code
        return out

    def serve(self, cmd: str) -> None:
        start = time.monotonic()
        port = _free_port()
        cmd = _set_option(cmd, "--port", str(port), append=True)
        log = open(self.work / f"serve-{port}.log", "w")
        proc = subprocess.Popen(["bash", "-c", f"exec {cmd}"], cwd=self.work, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 420
            while True:
                assert proc.poll() is None, f"{cmd} exited with {proc.returncode}:\n{(self.work / log.name).read_text()[-3000:]}"
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                assert time.monotonic() < deadline, f"{cmd} not healthy in time:\n{(self.work / log.name).read_text()[-3000:]}"
                time.sleep(1)
            out = self.python(self.client_code, port=port)
            assert out.strip(), "the client printed nothing"
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise
            log.close()
        assert code == 0, f"{cmd}: exit code {code} after SIGTERM"
        self.seconds.append((time.monotonic() - start, f"{cmd} (start, client, SIGTERM)"))
        self.ran.append(cmd)

    def bash_block(self, code: str) -> None:
        for cmd in shell_commands(code):
            if cmd == "bash scripts/test.sh":
                ci = (REPO / ".ci" / "run").read_text()
                assert "bash scripts/test.sh" in ci, ".ci/run must run the README's test command"
                continue  # CI's own command: this test runs inside it
            if cmd == "bash scripts/run.sh":
                self.sh(sized(f"{cmd} --out {self.work / 'out' / 'quickstart'}"), cwd=REPO)
                continue
            if cmd.endswith("bash scripts/setup.sh"):
                env = dict(self.env, DISTILL_SETUP_PLAN="1", DISTILL_VENV=str(self.work / "venv-plan"))
                plan = self.sh(cmd, cwd=REPO, env=env)
                extra = re.search(r"install: -e \.\[([\w,]+)\]", plan).group(1).split(",")
                declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
                assert all(e in declared for e in extra), (extra, sorted(declared))
                if "DISTILL_ENGINE=cuda" in cmd:
                    assert "vllm" in extra and any(d.startswith("vllm") for d in declared["vllm"])
                continue
            if subcommand(cmd) == "serve" and "--print-command" not in cmd:
                self.serve(sized(cmd))
                continue
            self.command(sized(cmd))


@pytest.fixture(scope="module")
def docs(tmp_path_factory, request):
    from distill.models import resolve_model

    work = tmp_path_factory.mktemp("readme")
    (work / "my-chat-model").symlink_to(resolve_model(None).path, target_is_directory=True)
    (work / "pipelines").symlink_to(REPO / "pipelines", target_is_directory=True)
    _ultrachat_layout(work)
    env = dict(os.environ, PATH=f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}", DISTILL_API_KEY=API_KEY, HF_TOKEN=TOKEN,
               HF_HOME=str(work / "hf-home"), HF_HUB_DISABLE_TELEMETRY="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"),
               VLLM_CPU_KVCACHE_SPACE="1", PYTHONUNBUFFERED="1")
    failed = request.session.testsfailed
    yield work, env
    if request.session.testsfailed == failed:  # the walkthrough writes GBs (heads, checkpoints, a merged model)
        shutil.rmtree(work, ignore_errors=True)


def test_docs_blocks_parse_into_commands():
    blocks = all_blocks()
    runnable = [b for b in blocks if b[0] in ("bash", "python")]
    assert len(runnable) >= 15
    strange = [(lang, where) for lang, _, where in blocks if lang not in ("bash", "python", "text")]
    assert not strange, f"blocks in a language the docs test does not run: {strange}"
    guides = sorted((REPO / "docs").glob("*.md"))
    assert set(guides) <= set(DOCS), f"guides the docs test does not run: {sorted(set(guides) - set(DOCS))}"
    assert len(README.read_text().splitlines()) <= 250, "README.md is the front door: at most 250 lines"
    benchmarks = doc_blocks((REPO / "BENCHMARKS.md").read_text(), "BENCHMARKS.md")
    assert {b[0] for b in benchmarks} <= {"text"}, "BENCHMARKS.md shows commands as text blocks: they are not run"
    assert shell_commands("a \\\n  --b 1  # note\n# whole line\n\nc '#x'") == ["a --b 1", "c '#x'"]
    assert sized("distill generate --limit 20000 --out o") == "distill generate --limit 3 --out o --max-tokens 8 --shard-size 2"
    loop = "for i in 0 1; do distill generate --part $i/2 --out o$i & done; wait"
    assert sized(loop).endswith("--shard-size 2 & done; wait") and "--limit 3" in sized(loop)
    assert "--stop-after 1" in sized("distill train-heads --steps 1000 --stop-after 100") and "--steps 2" in sized("distill train-heads --steps 1000")
    assert sized("distill train-heads --out o").endswith(" --share-lm-head") and "--no-share-lm-head" not in sized("distill train-heads")
    assert sized("distill train-heads --no-share-lm-head").count("share-lm-head") == 1
    assert sized("distill serve --heads h --engine vllm").endswith(" -- --enforce-eager")
    assert sized("distill serve --heads h --engine vllm -- --max-num-seqs 4").endswith(" -- --max-num-seqs 4 --enforce-eager")
    assert "enforce" not in sized("distill serve --heads h") + sized("distill serve --heads h --engine vllm --print-command")
    # what may run in this process: one plain distill command, quoted arguments included; not a loop, pipe or variable
    assert ONE_COMMAND.fullmatch("distill data stats o --json") and ONE_COMMAND.fullmatch("""distill x --k '{"a": 1}'""")
    assert not any(ONE_COMMAND.fullmatch(c) for c in (loop, "distill data stats o | head", "X=1 distill env", "distill env > f",
                                                      "distill generate --part $i/2", "distill env; distill env"))


def test_every_docs_command_runs(docs, request):
    work, env = docs
    blocks = all_blocks()
    client = [code for lang, code, _ in blocks if lang == "python" and "openai.OpenAI(" in code]
    assert len(client) == 1, "one OpenAI client block: it is run against every server the README starts"
    runner = Docs(work, env, client[0])
    request.node.user_properties.append((COMMAND_SECONDS, runner.seconds))  # the terminal summary prints them, slowest first
    with FakeHub() as hub:
        runner.env["HF_ENDPOINT"] = hub.url
        for lang, code, line in blocks:
            if lang == "bash":
                runner.bash_block(code)
            elif lang == "python" and code is not client[0]:
                runner.python(code)
        assert hub.created and hub.commits, "distill push reached the Hub endpoint"
        pushed = {c["path"] for c in hub.commits}
    # The pieces the walkthrough promises exist where it says.
    assert (work / "out" / "my-heads" / "tree.json").is_file() and (work / "out" / "my-heads-m2" / "merged" / "config.json").is_file()
    merged = json.loads((work / "out" / "ultrachat-dp" / "manifest.json").read_text())
    assert merged["totals"]["rows"] == 3
    assert (work / "out" / "my-heads-ddp" / "model.safetensors").is_file()
    assert (work / "out" / "heads" / "tree.json").is_file() and (work / "out" / "heads-medusa-repo" / "medusa_lm_head.safetensors").is_file()
    stale = work / "out" / "quickstart" / "stale"  # the changed option moved the old train outputs aside
    assert stale.is_dir() and any(stale.iterdir())
    assert any("my-chat-model-ultrachat-selfdistilled" in p for p in pushed)
    commands = sum(len(shell_commands(c)) for lang, c, _ in blocks if lang == "bash")
    assert len(runner.ran) >= commands - 1  # every command but CI's own ran (serve commands with their client)
