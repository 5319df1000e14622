"""A small body whose PNG inflates to far more than the body is judged in a thread.

The gate judges bodies under 256 KiB on the event loop: most checks cost a small
constant per byte. Inflating a PNG's pixel data costs its declared size, which can
be ~1,000 times the compressed size; past ``INLINE_WORK_BYTES`` the check stops on
the loop and the body is judged again in one of the gate's threads.
"""

from __future__ import annotations

import threading
import zlib

import orjson
import pytest
from test_fast_path import App, post

from conftest import chat, data_url, image_part
from media_stubs import png_of, png_rows
from modalgate import ModalGate
from modalgate.media import png_pixels


@pytest.fixture
def threads_seen(monkeypatch) -> list[str]:
    """The thread each PNG stream check ran in."""
    seen: list[str] = []
    original = png_pixels.check_stream

    def recording(*args, **kwargs):
        seen.append(threading.current_thread().name)
        return original(*args, **kwargs)

    monkeypatch.setattr("modalgate.media.image_integrity.check_stream", recording)
    return seen


def body_with(png: bytes) -> bytes:
    return orjson.dumps(chat(image_part(data_url(png)), model="kimi-k3"))


def test_a_small_png_declaring_a_big_image_is_inflated_in_a_thread(threads_seen):
    side = 2000  # 12 MB of rows from ~12 KB of zlib
    png = png_of(side, side, zlib.compress(b"\x00" * (3 * side + 1) * side, 9))
    body = body_with(png)
    assert len(body) < 64 * 1024
    app = App()
    status, _ = post(ModalGate(app), body)
    assert status == 204 and app.bodies == [body]
    # Charged before inflating: refused the loop at once, then inflated in a thread.
    assert threads_seen[0] == threading.main_thread().name
    assert threads_seen[1:] == ["modalgate-cpu"]


def test_a_small_png_is_inflated_on_the_loop(threads_seen):
    png = png_of(64, 64, zlib.compress(png_rows(64, 64)))
    app = App()
    status, _ = post(ModalGate(app), body_with(png))
    assert status == 204
    assert threads_seen == [threading.main_thread().name]


def test_a_big_png_that_is_corrupt_is_refused_from_the_thread(threads_seen):
    side = 2000
    rows = bytearray(b"\x00" * (3 * side + 1) * side)
    rows[-(3 * side + 1)] = 9  # the last row's filter
    png = png_of(side, side, zlib.compress(bytes(rows), 9))
    status, error = post(ModalGate(App()), body_with(png))
    assert status == 400
    assert error["error"]["code"] == "invalid_image"
    assert error["error"]["param"] == "messages.[0].content.[0].image_url.url"
    assert threads_seen[1:] == ["modalgate-cpu"]
