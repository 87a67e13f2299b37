"""`distill serve` with an API key (from DISTILL_API_KEY), a real server and real clients: every route but the two
probes needs the key."""

from __future__ import annotations

import httpx
import openai
import pytest

from helpers import API_KEY, Server, chat

pytestmark = pytest.mark.slow

KEYED = [("POST", "/v1/chat/completions", {"model": "smol", "messages": chat("Hi!"), "max_tokens": 2}),
         ("POST", "/v1/completions", {"model": "smol", "prompt": "Hi", "max_tokens": 2}),
         ("GET", "/v1/models", None),
         ("POST", "/tokenize", {"prompt": "Hi!"}),
         ("POST", "/detokenize", {"tokens": [1, 2, 3]}),
         ("GET", "/openapi.json", None)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DISTILL_API_KEY", API_KEY)  # the key as the docs say to give it: never on the command line
        srv = Server(["--max-batch", "2", "--max-tokens", "4", "--served-model-name", "smol"],
                     tmp_path_factory.mktemp("log") / "serve.log")
    yield srv
    srv.stop()


def _call(server, method: str, path: str, body, key: str | None, scheme: str = "Bearer") -> httpx.Response:
    headers = {"Authorization": f"{scheme} {key}"} if key is not None else {}
    return httpx.request(method, f"{server.url}{path}", json=body, headers=headers, timeout=120)


@pytest.mark.parametrize(("method", "path", "body"), KEYED, ids=[p for _, p, _ in KEYED])
def test_every_route_but_the_probes_answers_401_without_the_key_and_200_with_it(server, method, path, body):
    for key, scheme in ((None, ""), ("wrong-key", "Bearer"), (API_KEY, "Basic")):
        r = _call(server, method, path, body, key, scheme)
        assert r.status_code == 401, (key, scheme, r.status_code, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key" and API_KEY not in r.text
    assert _call(server, method, path, body, API_KEY).status_code == 200


def test_health_and_metrics_stay_open_and_an_unknown_route_tells_nothing_without_the_key(server):
    assert httpx.get(f"{server.url}/health", timeout=30).json()["status"] == "ok"
    assert _call(server, "POST", "/tokenize", {"prompt": "Hi!"}, None).status_code == 401
    metrics = httpx.get(f"{server.url}/metrics", timeout=30)
    assert metrics.status_code == 200 and 'distill_requests_total{endpoint="/tokenize",status="401"}' in metrics.text
    assert _call(server, "GET", "/docs", None, None).status_code == 401  # whether it exists is for key holders
    assert _call(server, "GET", "/docs", None, API_KEY).status_code == 404  # no docs page is served


def test_the_openai_client_needs_the_key(server):
    assert server.client().chat.completions.create(model="smol", messages=chat("Hi!"), max_tokens=2).choices
    with pytest.raises(openai.AuthenticationError):
        server.client(key="wrong-key", max_retries=0).models.list()
