"""One corpus through every entry point: the same body gets the same verdict everywhere.

The entry points are ``Decider.decide`` (the pipeline itself), ``modalgate validate``
and a real ``modalgate serve`` answering ``POST /v1/validate`` and
``/v1/validate/responses`` (a validation service: the middleware decides there).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import orjson
import pytest

from conftest import MP4_BYTES, chat, data_url, image_bytes, image_part
from gateway_proc import GatewayProcess
from modalgate.errors import error_body
from modalgate.gateway.cli import main
from modalgate.gateway.gate.pipeline import Decider
from modalgate.policy import RuleMatcher, load_policy

PNG = image_bytes("PNG", (40, 30))
VIDEO = {"type": "video_url", "video_url": {"url": data_url(MP4_BYTES, "video/mp4")}}
POLICY = """\
extends: builtin
models:
  - {name: pictures, accepts: [image], fallback: {video: movies}}
  - {name: movies, accepts: [image, video], limits: {max_videos: 1}}
"""
CORPUS: list[tuple[str, Any]] = [
    ("chat", chat(image_part(data_url(PNG)), model="kimi-k3")),
    ("chat", chat(VIDEO, model="kimi-k3")),
    ("chat", chat(VIDEO, model="pictures")),  # the fallback takes it
    ("chat", chat(VIDEO, VIDEO, model="pictures")),  # the fallback's own limit refuses it
    ("chat", chat(image_part("https://xn--ls8h.la/a.png"), model="kimi-k3")),
    ("chat", {"messages": [{"role": "user", "content": "no model"}]}),
    ("chat", b'{"model":"kimi-k3","model":"x","messages":[]}'),
    ("chat", b"\xef\xbb\xbf" + orjson.dumps(chat(model="kimi-k3"))),
    ("chat", chat({"type": "text", "text": "x", "uuid": "u", "video_embeds": "A"})),
    ("responses", {"model": "pictures", "input": [VIDEO]}),
    ("responses", {"model": "kimi-k3", "input": "text only"}),
    ("responses", {"model": "kimi-k3", "input": [{"type": {"a": 1}}]}),
]


def raw(body: Any) -> bytes:
    return body if isinstance(body, bytes) else orjson.dumps(body)


def answer(verdict: Any) -> dict[str, Any]:
    """What every entry point shows: the verdict when accepted, the envelope when not."""
    return verdict.to_dict() if verdict.accepted else error_body(verdict.violations)


@pytest.fixture(scope="module")
def policy_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("entry") / "policy.yaml"
    path.write_text(POLICY, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def service(policy_file) -> Iterator[GatewayProcess]:
    with GatewayProcess("--policy", str(policy_file)) as gateway:
        yield gateway


def test_every_entry_point_gives_the_same_verdict(service, policy_file, tmp_path, capsys):
    decider = Decider(RuleMatcher(load_policy(policy_file), None), media=None)
    for index, (api, body) in enumerate(CORPUS):
        expected = answer(anyio.run(decider.decide, raw(body), api).verdict)

        where = "/v1/validate" + ("/responses" if api == "responses" else "")
        served = httpx.post(service.url + where, content=raw(body), timeout=10).json()

        request = tmp_path / f"{index}.json"
        request.write_bytes(raw(body))
        code = main(["validate", str(request), "--policy", str(policy_file), "--api", api])
        printed = orjson.loads(capsys.readouterr().out)

        assert served == expected, (index, served, expected)
        assert printed == expected, (index, printed, expected)
        assert code == (0 if "error" not in expected else 1)


def test_the_fallback_is_part_of_every_decision(policy_file, tmp_path, capsys):
    request = tmp_path / "video.json"
    request.write_bytes(orjson.dumps(chat(VIDEO, model="pictures")))
    assert main(["validate", str(request), "--policy", str(policy_file)]) == 0
    printed = orjson.loads(capsys.readouterr().out)
    assert (printed["model"], printed["routed_from"]) == ("movies", "pictures")
