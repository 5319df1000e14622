"""ModalGate with remote media: fetched once, checked like inline media, forwarded inline."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import orjson
import pybase64
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from conftest import (
    MP4_BYTES,
    PDF_BYTES,
    Recorder,
    chat,
    image_bytes,
    image_part,
    send_body,
    serve,
    start_server,
)
from modalgate import ModalGate, get_verdict
from modalgate.policy import parse_policy

PNG = image_bytes("PNG", (40, 30))
TINY = image_bytes("PNG", (1, 1))

POLICY = """
media_urls:
  schemes: [data, https, http]
  allow_private: ["127.0.0.1/32"]
  inline_fetched: {inline}
  fetch: {fetch}
models:
  - name: vision
    accepts: [image]
  - name: watcher
    accepts: [image, video]
"""


async def echo(request: Request):
    raw = await request.body()
    verdict = get_verdict(request.scope)
    return JSONResponse(
        {
            "body": raw.decode(),
            "content_length": request.headers.get("content-length"),
            "media": verdict.to_dict()["media"],
        }
    )


def gate_app(inline: bool = True, fetch: bool = True) -> ModalGate:
    policy = parse_policy(
        POLICY.format(inline=str(inline).lower(), fetch=str(fetch).lower()), fmt="yaml"
    )
    app = Starlette(routes=[Route("/v1/chat/completions", echo, methods=["POST"])])
    return ModalGate(app, policy=policy)


def _redirect(location: str):
    def route(handler) -> None:
        handler.send_response(302)
        handler.send_header("location", location)
        handler.send_header("content-length", "0")
        handler.end_headers()

    return route


@pytest.fixture(scope="module")
def media() -> Iterator[Recorder]:
    routes = {
        "/a.png": lambda h: send_body(h, PNG),
        "/tiny.png": lambda h: send_body(h, TINY),
        "/video-as-png": lambda h: send_body(h, MP4_BYTES, "image/png"),
        "/garbage.png": lambda h: send_body(h, b"not an image at all"),
        "/a.pdf": lambda h: send_body(h, PDF_BYTES, "application/pdf"),
        "/a.mp4": lambda h: send_body(h, MP4_BYTES, "video/mp4"),
        "/cut.mp4": lambda h: send_body(h, MP4_BYTES[:-64], "video/mp4"),
        "/mp4-as-webm": lambda h: send_body(h, MP4_BYTES, "video/webm"),
        "/to-foo-bar": _redirect("foo:bar"),
        "/to-data": _redirect("data:image/png;base64,iVBORw0KGgo="),
    }
    server = start_server(Recorder(("127.0.0.1", 0), routes))
    yield server
    server.shutdown()


@pytest.fixture(scope="module")
def inline_url() -> Iterator[str]:
    with serve(gate_app(inline=True)) as url:
        yield url


def post(base: str, request: dict) -> httpx.Response:
    return httpx.post(base + "/v1/chat/completions", json=request, timeout=10)


def test_fetched_image_is_checked_and_inlined(inline_url, media):
    before = len(media.connections)
    response = post(inline_url, chat(image_part(media.base + "/a.png"), model="vision"))
    assert response.status_code == 200
    echoed = response.json()
    forwarded = orjson.loads(echoed["body"])
    url = forwarded["messages"][0]["content"][0]["image_url"]["url"]
    assert url.startswith("data:image/png;base64,")
    assert pybase64.b64decode(url.split(",", 1)[1]) == PNG
    assert echoed["content_length"] == str(len(echoed["body"].encode()))
    [part] = echoed["media"]
    assert (part["format"], part["width"], part["height"], part["bytes"]) == (
        "png",
        40,
        30,
        len(PNG),
    )
    assert len(media.connections) == before + 1, "fetched exactly once"


@pytest.mark.parametrize(
    ("path", "status", "code"),
    [
        ("/video-as-png", 400, "modality_mismatch"),
        ("/garbage.png", 400, "invalid_image"),
        ("/tiny.png", 400, "image_too_small"),
        ("/missing.png", 400, "media_fetch_failed"),
        # httpx raises InvalidURL (not an HTTPError) for these Locations: was a 500
        ("/to-foo-bar", 400, "media_fetch_failed"),
        ("/to-data", 400, "media_fetch_failed"),
    ],
)
def test_fetched_bytes_get_the_inline_checks(inline_url, media, path, status, code):
    response = post(inline_url, chat(image_part(media.base + path), model="vision"))
    assert response.status_code == status
    error = response.json()["error"]
    assert (error["code"], error["param"]) == (code, "messages.[0].content.[0].image_url.url")


def video_part(url: str) -> dict:
    return {"type": "video_url", "video_url": {"url": url}}


def test_a_fetched_video_is_probed_and_inlined(inline_url, media):
    response = post(inline_url, chat(video_part(media.base + "/a.mp4"), model="watcher"))
    assert response.status_code == 200, response.text
    echoed = response.json()
    forwarded = orjson.loads(echoed["body"])
    url = forwarded["messages"][0]["content"][0]["video_url"]["url"]
    assert pybase64.b64decode(url.split(",", 1)[1]) == MP4_BYTES  # checked bytes, inline
    [part] = echoed["media"]
    assert (part["format"], part["width"], part["height"], part["frames"]) == ("mp4", 16, 16, 2)


@pytest.mark.parametrize(
    ("path", "code", "message"),
    [
        ("/cut.mp4", "invalid_media",
         "the MP4 video is not whole: it is cut short (its last box, moov, ends past the data)"),
        ("/mp4-as-webm", "modality_mismatch",
         "the format is given as 'video/webm' but the data is MP4"),
    ],
)  # fmt: skip
def test_a_fetched_video_gets_the_inline_checks(inline_url, media, path, code, message):
    response = post(inline_url, chat(video_part(media.base + path), model="watcher"))
    at = "messages.[0].content.[0].video_url.url"
    error = response.json()["error"]
    assert (response.status_code, error["code"], error["param"]) == (400, code, at)
    assert error["message"] == f"{at}: {message}"


def test_refused_host_is_never_fetched(inline_url, media):
    response = post(inline_url, chat(image_part("http://169.254.169.254/latest/"), model="vision"))
    error = response.json()["error"]
    assert (response.status_code, error["code"]) == (400, "url_not_allowed")


def test_without_inlining_the_body_is_forwarded_unchanged(media):
    request = chat(image_part(media.base + "/a.png"), model="vision")
    raw = orjson.dumps(request)
    with serve(gate_app(inline=False)) as url:
        response = httpx.post(url + "/v1/chat/completions", content=raw)
    assert response.status_code == 200
    assert response.json()["body"].encode() == raw
    assert response.json()["media"][0]["width"] == 40


def test_fetch_can_be_turned_off(media):
    before = len(media.connections)
    with serve(gate_app(fetch=False)) as url:
        response = post(url, chat(image_part(media.base + "/tiny.png"), model="vision"))
    assert response.status_code == 200
    assert response.json()["media"][0]["width"] is None
    assert len(media.connections) == before


FILE_POLICY = """
media_urls:
  schemes: [data, https, http]
  allow_private: ["127.0.0.1/32"]
models:
  - name: docs
    accepts: [image, file]
"""


@pytest.fixture(scope="module")
def responses_url() -> Iterator[str]:
    app = Starlette(routes=[Route("/v1/responses", echo, methods=["POST"])])
    with serve(ModalGate(app, policy=parse_policy(FILE_POLICY, fmt="yaml"))) as url:
        yield url


def input_file(**fields) -> dict:
    return {
        "model": "docs",
        "input": [{"role": "user", "content": [{"type": "input_file", **fields}]}],
    }


@pytest.mark.parametrize(
    ("fields", "filename"),
    [({}, "a.pdf"), ({"filename": "report.pdf"}, "report.pdf")],
    ids=["named-from-url", "own-name"],
)
def test_a_fetched_input_file_is_forwarded_as_file_data(responses_url, media, fields, filename):
    """What the gate checked is what goes on: the server does not download it again."""
    before = len(media.connections)
    request = input_file(file_url=media.base + "/a.pdf", **fields)
    response = httpx.post(responses_url + "/v1/responses", json=request, timeout=10)
    assert response.status_code == 200, response.text
    echoed = response.json()
    [part] = orjson.loads(echoed["body"])["input"][0]["content"]
    assert set(part) == {"type", "file_data", "filename"}
    assert part["filename"] == filename
    assert part["file_data"].startswith("data:application/pdf;base64,")
    assert pybase64.b64decode(part["file_data"].split(",", 1)[1]) == PDF_BYTES
    assert echoed["content_length"] == str(len(echoed["body"].encode()))
    assert len(media.connections) == before + 1, "fetched exactly once"
