"""Capability routing: per-model upstreams, opt-in modality fallback, /v1/models.

Three real upstream processes on 127.0.0.1 (each records what it received), the
gateway in front as a real ``modalgate serve`` process, the official openai client.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest

from conftest import MP4_BYTES, TESTS_DIR, WAV_BYTES, b64, data_url, free_port, image_bytes
from gateway_proc import GatewayProcess, metric
from modalgate.errors import ErrorCode, Violation
from modalgate.policy import RuleMatcher, parse_policy
from modalgate.validators import Verdict, fallback_target, validate_request, with_fallback

HERE = TESTS_DIR
IMAGE = {"type": "image_url", "image_url": {"url": data_url(image_bytes())}}
VIDEO = {"type": "video_url", "video_url": {"url": data_url(MP4_BYTES, "video/mp4")}}
AUDIO = {"type": "input_audio", "input_audio": {"data": b64(WAV_BYTES), "format": "wav"}}


class UpstreamProcess:
    def __init__(self, name: str, port: int | None = None) -> None:
        self.name = name
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> UpstreamProcess:
        self.process = subprocess.Popen(
            [
                sys.executable,
                str(HERE / "toy_upstream.py"),
                "--port",
                str(self.port),
                "--name",
                self.name,
            ],
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                httpx.get(self.url + "/health", timeout=0.5)
                return self
            except httpx.HTTPError:
                time.sleep(0.05)
        raise RuntimeError(f"upstream {self.name} did not start")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)

    def chats(self) -> list[dict[str, Any]]:
        received = httpx.get(self.url + "/_received").json()
        return [orjson.loads(r["body"]) for r in received if r["path"] == "/v1/chat/completions"]

    def clear(self) -> None:
        httpx.delete(self.url + "/_received")


POLICY = """\
extends: builtin
models:
  - name: kimi-k3
    accepts: [image]
    upstream: {kimi}
    fallback: {{video: qwen3-vl, audio: qwen2-audio}}
  - name: kimi-k3-strict
    accepts: [image]
    upstream: {kimi}
  - name: qwen3-vl
    accepts: [image, video]
    limits: {{max_videos: 1}}
    upstream: {qwen}
  - name: qwen2-audio
    accepts: [audio]
    upstream: {audio}
  - name: unrouted
    accepts: [image]
"""


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, UpstreamProcess]]:
    started = {name: UpstreamProcess(name) for name in ("kimi-k3", "qwen3-vl", "qwen2-audio")}
    try:
        for upstream in started.values():
            upstream.start()
        yield started
    finally:
        for upstream in started.values():
            upstream.stop()


@pytest.fixture(scope="module")
def gateway(servers, tmp_path_factory) -> Iterator[GatewayProcess]:
    policy = tmp_path_factory.mktemp("routing") / "policy.yaml"
    policy.write_text(
        POLICY.format(
            kimi=servers["kimi-k3"].url,
            qwen=servers["qwen3-vl"].url,
            audio=servers["qwen2-audio"].url,
        )
    )
    with GatewayProcess("--policy", str(policy), "--upstream-health-interval", "0.3") as process:
        yield process


@pytest.fixture
def clean(servers) -> dict[str, UpstreamProcess]:
    for upstream in servers.values():
        upstream.clear()
    return servers


def client(gateway: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="k", max_retries=0)


def ask(gateway: GatewayProcess, model: str, *parts: dict[str, Any]):
    content = [{"type": "text", "text": "what is this?"}, *parts]
    return client(gateway).chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": content}]
    )


def test_each_model_reaches_its_own_server(gateway, clean):
    for model, part in (("kimi-k3", IMAGE), ("qwen3-vl", VIDEO), ("qwen2-audio", AUDIO)):
        raw = ask(gateway, model, part)
        assert raw.parse().choices[0].message.content.startswith(f"{model} saw")
        assert "x-modalgate-routed-to" not in raw.headers
    for name, upstream in clean.items():
        assert [chat["model"] for chat in upstream.chats()] == [name]


def test_a_video_for_kimi_goes_to_the_video_server_with_the_model_rewritten(gateway, clean):
    raw = ask(gateway, "kimi-k3", VIDEO)
    assert raw.headers["x-modalgate-routed-to"] == "qwen3-vl"
    (forwarded,) = clean["qwen3-vl"].chats()
    assert forwarded["model"] == "qwen3-vl"
    assert forwarded["messages"][0]["content"][1] == VIDEO
    assert clean["kimi-k3"].chats() == []
    assert (
        metric(
            gateway, "modalgate_fallback_routes_total", from_model="kimi-k3", to_model="qwen3-vl"
        )
        >= 1
    )
    audio = ask(gateway, "kimi-k3", AUDIO)
    assert audio.headers["x-modalgate-routed-to"] == "qwen2-audio"
    assert [c["model"] for c in clean["qwen2-audio"].chats()] == ["qwen2-audio"]


def test_without_a_fallback_the_request_is_refused(gateway, clean):
    with pytest.raises(openai.BadRequestError) as caught:
        ask(gateway, "kimi-k3-strict", VIDEO)
    assert caught.value.code == "unsupported_modality"
    assert all(not upstream.chats() for upstream in clean.values())


def test_media_for_two_different_fallbacks_is_refused(gateway, clean):
    with pytest.raises(openai.BadRequestError) as caught:
        ask(gateway, "kimi-k3", VIDEO, AUDIO)
    assert caught.value.code == "unsupported_modality"
    assert all(not upstream.chats() for upstream in clean.values())


def test_the_fallback_models_own_limits_apply(gateway, clean):
    with pytest.raises(openai.BadRequestError) as caught:
        ask(gateway, "kimi-k3", VIDEO, VIDEO)
    assert caught.value.code == "too_many_media"
    assert caught.value.response.headers["x-modalgate-routed-to"] == "qwen3-vl"
    assert all(not upstream.chats() for upstream in clean.values())


def test_a_model_with_no_route_and_no_default_is_404(gateway, clean):
    with pytest.raises(openai.NotFoundError) as caught:
        ask(gateway, "unrouted", IMAGE)
    assert caught.value.code == "unknown_model"
    assert caught.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        ask(gateway, "some-model-nobody-serves")


def test_models_lists_every_model_with_its_modalities(gateway, clean):
    listed = {m.id: m for m in client(gateway).models.list().data}
    assert set(listed) >= {"kimi-k3", "kimi-k3-strict", "qwen3-vl", "qwen2-audio"}
    assert "unrouted" not in listed  # a rule with no route is not served here
    kimi = listed["kimi-k3"].model_dump()
    assert kimi["input_modalities"] == ["text", "image"]
    assert kimi["owned_by"] == "toy"  # the upstream's own object, kept
    assert kimi["capabilities"]["fallback"] == {"audio": "qwen2-audio", "video": "qwen3-vl"}
    assert kimi["capabilities"]["max_images"] == 16
    assert listed["qwen3-vl"].model_dump()["input_modalities"] == ["text", "image", "video"]
    assert listed["qwen2-audio"].model_dump()["input_modalities"] == ["text", "audio"]
    one = httpx.get(gateway.url + "/v1/models/qwen3-vl").json()
    assert one["id"] == "qwen3-vl" and one["input_modalities"] == ["text", "image", "video"]
    missing = httpx.get(gateway.url + "/v1/models/no-such-model")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "unknown_model"


def test_models_leaves_out_what_an_unknown_models_reject_policy_refuses(servers, tmp_path):
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        "unknown_models: reject\nmodels:\n  - name: qwen3-vl\n    accepts: [image, video]\n"
    )
    upstream = servers["kimi-k3"].url  # reports only the model "kimi-k3", which no rule names
    with GatewayProcess("--policy", str(policy), "--upstream", upstream) as gateway:
        listed = [m["id"] for m in httpx.get(gateway.url + "/v1/models").json()["data"]]
        assert listed == []
        assert httpx.get(gateway.url + "/v1/models/kimi-k3").status_code == 404


MODES = """\
models:
  - name: kimi-k3
    mode: encoder
    accepts: [image]
  - name: kimi-k3
    mode: full
    accepts: [image, video]
  - name: qwen2-audio
    accepts: [audio]
"""


@pytest.mark.parametrize(
    ("mode", "kimi"), [("encoder", ["text", "image"]), ("full", ["text", "image", "video"])]
)
def test_models_answers_in_the_mode_served(tmp_path, mode, kimi):
    policy = tmp_path / "modes.yaml"
    policy.write_text(MODES)
    with GatewayProcess("--policy", str(policy), "--mode", mode) as gateway:
        listed = {m["id"]: m for m in httpx.get(gateway.url + "/v1/models").json()["data"]}
        assert set(listed) == {"kimi-k3", "qwen2-audio"}
        assert listed["kimi-k3"]["input_modalities"] == kimi
        assert listed["kimi-k3"]["capabilities"]["mode"] == mode
        assert listed["qwen2-audio"]["input_modalities"] == ["text", "audio"]


def test_a_down_upstream_is_skipped_and_comes_back(tmp_path):
    alive, later = UpstreamProcess("a").start(), UpstreamProcess("b")
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        "models:\n  - name: m\n    accepts: [image]\n    upstream:\n"
        f"      - {{url: '{alive.url}', weight: 1}}\n      - {{url: '{later.url}', weight: 3}}\n"
    )
    try:
        with GatewayProcess("--policy", str(policy), "--upstream-health-interval", "0.3") as gw:
            for _ in range(8):
                assert ask(gw, "m", IMAGE).parse().choices[0].message.content.startswith("a saw")
            later.start()
            deadline = time.monotonic() + 10
            while not later_received(later) and time.monotonic() < deadline:
                ask(gw, "m", IMAGE)
            assert later_received(later)
            ready = httpx.get(gw.url + "/readyz").json()
            assert ready["checks"]["upstream"] is True
    finally:
        alive.stop()
        later.stop()


def later_received(upstream: UpstreamProcess) -> bool:
    try:
        return bool(upstream.chats())
    except httpx.HTTPError:
        return False


def test_a_fallback_to_a_model_of_another_mode_does_not_start(tmp_path):
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        "models:\n"
        "  - {name: kimi-k3, mode: encoder, accepts: [image], fallback: {video: qwen3-vl}}\n"
        "  - {name: qwen3-vl, mode: full, accepts: [image, video]}\n"
    )
    gateway = GatewayProcess("--policy", str(policy), "--mode", "encoder")
    assert gateway.process.wait(30) == 2
    assert (
        "rule 'kimi-k3': fallback for video names 'qwen3-vl', which no rule of mode "
        "'encoder' matches"
    ) in gateway.text()


# ---------------------------------------------------------------- the pure part


PURE = parse_policy(
    """
models:
  - {name: a, accepts: [image], fallback: {video: b, audio: c}}
  - {name: b, accepts: [image, video], limits: {max_videos: 1}}
  - {name: c, accepts: [audio]}
""",
    fmt="yaml",
)


def verdict(model: str, *parts: dict[str, Any]) -> Verdict:
    request = {"model": model, "messages": [{"role": "user", "content": list(parts)}]}
    return validate_request(request, RuleMatcher(PURE))


def test_fallback_target_is_the_one_model_for_every_refused_modality():
    assert fallback_target(verdict("a", VIDEO)) == "b"
    assert fallback_target(verdict("a", AUDIO, IMAGE)) == "c"
    assert fallback_target(verdict("a", VIDEO, AUDIO)) is None
    assert fallback_target(verdict("a", IMAGE)) is None  # accepted
    assert fallback_target(verdict("b", AUDIO)) is None  # b has no fallback


def test_with_fallback_revalidates_against_the_target_and_stops_there():
    routed = with_fallback(verdict("a", VIDEO), RuleMatcher(PURE))
    assert routed.accepted and routed.model == "b" and routed.routed_from == "a"
    assert routed.request["model"] == "b"
    refused = with_fallback(verdict("a", VIDEO, VIDEO), RuleMatcher(PURE))
    assert [v.code for v in refused.violations] == [ErrorCode.TOO_MANY_MEDIA]
    # Only modality refusals reroute: anything else about the request stands.
    mixed = verdict("a", VIDEO).with_violations(Violation(ErrorCode.INVALID_IMAGE, "x", "p"))
    assert fallback_target(mixed) is None


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        ("{name: a, accepts: [video], fallback: {video: b}}", "which this rule accepts"),
        ("{name: a, accepts: [image], fallback: {video: a}}", "cannot fall back to itself"),
        ("{name: a, accepts: [image], upstream: []}", "needs at least one URL"),
        ("{name: a, accepts: [image], upstream: 'ftp://x'}", "must be an http(s) URL"),
    ],
)
def test_bad_routes_name_the_field(rule, message):
    from modalgate.policy import PolicyError

    with pytest.raises(PolicyError) as caught:
        parse_policy(f"models:\n  - {rule}\n", fmt="yaml")
    assert message in str(caught.value)
    assert "models.[0]" in str(caught.value)
