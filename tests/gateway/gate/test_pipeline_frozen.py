"""The pipeline hands out frozen verdicts, and its fetch stage leaves the verdict it got alone."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import FrozenInstanceError

import anyio
import pytest

from conftest import Recorder, body, chat, image_bytes, image_part, send_body, start_server
from modalgate.gateway.gate.pipeline import Decider
from modalgate.gateway.gate.remote_media import MediaStage
from modalgate.policy import RuleMatcher, parse_policy
from modalgate.validators import validate_body

PNG = image_bytes("PNG", (40, 30))
POLICY = parse_policy(
    """
media_urls:
  schemes: [data, http]
  allow_private: ["127.0.0.1/32"]
models:
  - {name: vision, accepts: [image]}
""",
    fmt="yaml",
)


@pytest.fixture(scope="module")
def media() -> Iterator[Recorder]:
    server = start_server(Recorder(("127.0.0.1", 0), {"/a.png": lambda h: send_body(h, PNG)}))
    yield server
    server.shutdown()


def test_a_decided_verdict_after_fetch_and_inline_cannot_be_changed(media):
    request = body(chat(image_part(media.base + "/a.png"), model="vision"))

    async def decide():
        stage = MediaStage(POLICY.media_urls)
        try:
            return await Decider(RuleMatcher(POLICY, None), stage).decide(request)
        finally:
            await stage.aclose()

    decision = anyio.run(decide)
    verdict = decision.verdict
    assert verdict.accepted and verdict.parts[0].data == PNG
    assert b"data:image/png;base64," in decision.body  # fetched, then inlined
    for attempt in (
        lambda: setattr(verdict, "model", "other"),
        lambda: setattr(verdict.parts[0], "data", b""),
        lambda: verdict.violations.append(None),
        lambda: verdict.parts.append(None),
    ):
        with pytest.raises((FrozenInstanceError, AttributeError)):
            attempt()


def test_the_fetch_stage_returns_a_new_verdict(media):
    verdict = validate_body(
        body(chat(image_part(media.base + "/a.png"), model="vision")), RuleMatcher(POLICY, None)
    )
    remote = verdict.parts[0]

    async def fetch():
        stage = MediaStage(POLICY.media_urls)
        try:
            return await stage.fetch(verdict)
        finally:
            await stage.aclose()

    fetched = anyio.run(fetch)
    assert fetched is not verdict and fetched.parts[0].data == PNG
    assert verdict.parts[0] is remote and remote.data is None and remote.width is None
    assert (fetched.parts[0].width, fetched.parts[0].height) == (40, 30)
