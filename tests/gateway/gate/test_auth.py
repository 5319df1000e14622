"""API keys at the front door: a real ``modalgate serve`` in front of the toy upstream,
asked by the official openai client. A refused request never reaches the upstream."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from conftest import chat, serve
from gateway_proc import GatewayProcess
from modalgate.gateway.gate.auth import ApiKeyAuth, bearer_token
from toy_upstream import ToyUpstream

USER = [{"role": "user", "content": "hi"}]
VIDEO = {"type": "video_url", "video_url": {"url": "https://example.com/clip.mp4"}}


@pytest.fixture(scope="module")
def upstream() -> Iterator[tuple[ToyUpstream, str]]:
    toy = ToyUpstream()
    with serve(toy.app()) as base:
        yield toy, base


@pytest.fixture(scope="module")
def gateway(upstream, tmp_path_factory) -> Iterator[GatewayProcess]:
    # Two keys from the variable, a third from a key file: all three open the door.
    key_file = tmp_path_factory.mktemp("keys") / "keys"
    key_file.write_text("key-three\n", encoding="utf-8")
    env = {"MODALGATE_API_KEYS": "key-one, key-two"}
    with GatewayProcess(
        "--upstream", upstream[1], "--api-key-file", str(key_file), env=env
    ) as process:
        yield process


@pytest.fixture
def toy(upstream) -> ToyUpstream:
    toy, _ = upstream
    toy.received.clear()
    return toy


def client(gateway: GatewayProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0)


def chats(toy: ToyUpstream) -> list[str]:
    return [r.path for r in toy.received if r.path != "/v1/models"]


@pytest.mark.parametrize("key", ["key-one", "key-two", "key-three"])
def test_each_key_opens_the_door_and_goes_upstream_untouched(gateway, toy, key):
    completion = client(gateway, key).chat.completions.create(model="kimi-k3", messages=USER)
    assert completion.choices[0].message.content.startswith("toy saw ")
    [received] = [r for r in toy.received if r.path == "/v1/chat/completions"]
    assert received.headers["authorization"] == f"Bearer {key}"  # stripped of nothing


def test_a_wrong_key_is_401_invalid_api_key_and_never_reaches_the_upstream(gateway, toy):
    with pytest.raises(openai.AuthenticationError) as caught:
        client(gateway, "key-four").chat.completions.create(model="kimi-k3", messages=USER)
    assert caught.value.status_code == 401
    assert caught.value.code == "invalid_api_key"
    assert caught.value.param is None
    assert caught.value.body["message"] == "the API key is not valid"
    assert caught.value.body["type"] == "invalid_request_error"
    assert chats(toy) == []


def test_a_request_without_a_key_is_refused_before_its_body_is_judged(gateway, toy):
    # A body the gate would refuse (400) gets the 401: nothing is read before the lock.
    response = httpx.post(gateway.url + "/v1/chat/completions", json=chat(VIDEO))
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == 'Bearer realm="modalgate"'
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_api_key", None)
    assert error["message"] == "no API key: send one in the Authorization header as 'Bearer KEY'"
    assert response.headers["x-request-id"]  # refused requests are still traceable
    assert chats(toy) == []


@pytest.mark.parametrize(
    "authorization", ["key-one", "Basic a2V5LW9uZTo=", "Bearer", "Bearer key-one-and-more"]
)
def test_anything_but_a_bearer_key_of_the_list_is_refused(gateway, toy, authorization):
    response = httpx.post(
        gateway.url + "/v1/chat/completions", json=chat(), headers={"authorization": authorization}
    )
    assert (response.status_code, response.json()["error"]["code"]) == (401, "invalid_api_key")
    assert chats(toy) == []


def test_every_other_path_is_locked_too(gateway, toy):
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/validate"), ("GET", "/echo/x")]:
        response = httpx.request(method, gateway.url + path, json=chat())
        assert response.status_code == 401, path
    assert chats(toy) == []
    with pytest.raises(openai.AuthenticationError):
        client(gateway, "nope").models.list()
    assert [m.id for m in client(gateway, "key-two").models.list()] == ["toy"]


def test_a_refusal_of_the_gate_still_has_its_own_code_with_a_good_key(gateway, toy):
    with pytest.raises(openai.BadRequestError) as caught:
        client(gateway, "key-one").chat.completions.create(
            model="kimi-k3", messages=[{"role": "user", "content": [VIDEO]}]
        )
    assert caught.value.code == "unsupported_modality"
    assert caught.value.param == "messages.[0].content.[0].type"
    assert chats(toy) == []


def test_health_and_metrics_stay_open(gateway):
    for path in ("/healthz", "/readyz", "/metrics"):
        assert httpx.get(gateway.url + path).status_code == 200, path


def test_health_and_metrics_can_be_locked(upstream, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# the team's keys\nfile-key-a\n\n  file-key-b  \n", encoding="utf-8")
    # The flag's key joins the file's; it replaces the variable's (flags win).
    gateway = GatewayProcess(
        "--upstream",
        upstream[1],
        "--api-key-file",
        str(keys),
        "--api-key",
        "flag-key",
        "--auth-health-and-metrics",
        env={"MODALGATE_API_KEYS": "env-key"},
    )
    try:
        # /healthz is locked too, so wait for uvicorn's own "running" line instead.
        gateway.wait_for_log(lambda r: r.get("event", "").startswith("Uvicorn running"), 30)
        for path in ("/healthz", "/readyz", "/metrics"):
            assert httpx.get(gateway.url + path).status_code == 401, path
            locked = {"authorization": "Bearer file-key-b"}
            assert httpx.get(gateway.url + path, headers=locked).status_code == 200, path
        for key in ("file-key-a", "flag-key"):
            completion = client(gateway, key).chat.completions.create(
                model="kimi-k3", messages=USER
            )
            assert completion.choices[0].message.content.startswith("toy saw ")
        for key in ("# the team's keys", "env-key"):
            with pytest.raises(openai.AuthenticationError):
                client(gateway, key).chat.completions.create(model="kimi-k3", messages=USER)
    finally:
        gateway.__exit__()


def test_a_key_file_without_a_key_stops_the_start(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# nothing yet\n\n", encoding="utf-8")
    gateway = GatewayProcess("--api-key-file", str(keys))
    try:
        assert gateway.process.wait(30) == 2
        assert f"cannot start: the API key file {keys} holds no key" in gateway.text()
        assert "Traceback" not in gateway.text()
    finally:
        gateway.__exit__()


def test_the_start_up_line_counts_keys_and_never_shows_one(gateway):
    line = gateway.wait_for_log(lambda r: r.get("event") == "gateway started")
    assert line["api_keys"] == 3
    assert line["open_paths"] == "/healthz, /readyz, /metrics"
    assert "key-one" not in gateway.text() and "key-three" not in gateway.text()


def test_bearer_token_reads_the_first_authorization_header():
    assert bearer_token([(b"authorization", b"Bearer abc")]) == b"abc"
    assert bearer_token([(b"authorization", b"bearer  abc ")]) == b"abc"
    assert bearer_token([(b"authorization", b"Token abc")]) is None
    assert bearer_token([(b"x-api-key", b"abc")]) is None


def test_without_keys_the_lock_is_open():
    assert ApiKeyAuth(app=None, keys=[]).keys == ()  # type: ignore[arg-type]
    locked = ApiKeyAuth(app=None, keys=["a", "b"])  # type: ignore[arg-type]
    assert locked.accepts(b"b") and not locked.accepts(b"c") and not locked.accepts(b"")
