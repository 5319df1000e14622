"""Shared test parts: real images made with Pillow, request builders, a real uvicorn server."""

from __future__ import annotations

import contextlib
import gc
import io
import socket
import ssl
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pybase64
import pytest
import uvicorn
from PIL import Image

from media_stubs import MP4_BYTES, PDF_BYTES, WAV_BYTES, png_bomb  # noqa: F401 (re-exported)
from modalgate.policy import RuleMatcher, load_policy

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent

# ---------------------------------------------------------------- media bytes


def image_bytes(fmt: str = "PNG", size: tuple[int, int] = (64, 48), mode: str = "RGB") -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, size, "red" if mode == "RGB" else 1).save(buffer, fmt)
    return buffer.getvalue()


def noise_png(width: int, height: int, seed: int) -> bytes:
    """A photo-like (random) RGB PNG: each seed a different image, so caches cannot mix them."""
    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def animated_gif(frames: int = 3, size: tuple[int, int] = (16, 16)) -> bytes:
    images = [Image.new("RGB", size, color) for color in ("red", "green", "blue")[:frames]]
    buffer = io.BytesIO()
    images[0].save(buffer, "GIF", save_all=True, append_images=images[1:], duration=50, loop=0)
    return buffer.getvalue()


def b64(data: bytes) -> str:
    return pybase64.b64encode(data).decode()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{b64(data)}"


# ---------------------------------------------------------------- requests


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def chat(*parts: Any, model: str = "kimi-k3", role: str = "user", **extra: Any) -> dict[str, Any]:
    content: Any = list(parts) if parts else "hello"
    return {"model": model, "messages": [{"role": role, "content": content}], **extra}


def body(request: Any) -> bytes:
    return orjson.dumps(request)


@pytest.fixture(scope="session")
def builtin_policy():
    return load_policy()


@pytest.fixture(scope="session")
def encoder_matcher(builtin_policy) -> RuleMatcher:
    return RuleMatcher(builtin_policy, "encoder")


@pytest.fixture(scope="session")
def full_matcher(builtin_policy) -> RuleMatcher:
    return RuleMatcher(builtin_policy, None)


# ---------------------------------------------------------------- real server


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def serve(app: Any, **config: Any) -> Iterator[str]:
    """Run ``app`` under a real uvicorn server on 127.0.0.1; yields the base URL."""
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            app, host="127.0.0.1", port=port, log_level="warning", lifespan="on", **config
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def objects_left_behind(request: Callable[[], object], requests: int = 10) -> Counter[str]:
    """The modalgate objects that ``requests`` calls of ``request`` leave alive, by type.

    Garbage collection is off meanwhile: an object counted here was not freed by
    reference counting, so it sits in a reference cycle (or is kept on purpose) and
    holds what it refers to until a collection runs. Three calls first, for what a
    connection keeps (its last request, pooled upstreams).
    """

    def alive() -> Counter[str]:
        return Counter(
            type(thing).__qualname__
            for thing in gc.get_objects()
            if str(type(thing).__module__).startswith("modalgate.")
        )

    for _ in range(3):
        request()
    gc.collect()
    gc.disable()
    try:
        before = alive()
        for _ in range(requests):
            request()
        deadline = time.monotonic() + 5
        while (left := alive() - before) and time.monotonic() < deadline:
            time.sleep(0.05)  # the server's side may still be finishing the last one
    finally:
        gc.enable()
    return left


def parse_url(url: str) -> tuple[str, int]:
    parsed = httpx.URL(url)
    return parsed.host, parsed.port or 80


# ---------------------------------------------------------------- media server


class Recorder(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address, routes, tls: ssl.SSLContext | None = None):
        self.routes = routes
        self.connections: list[str] = []
        self.hosts: list[str] = []
        super().__init__(address, _Handler)
        if tls is not None:
            self.socket = tls.wrap_socket(self.socket, server_side=True)

    def verify_request(self, request, client_address) -> bool:
        self.connections.append(client_address[0])
        return True

    def handle_error(self, request, client_address) -> None:
        pass  # clients that hang up mid-body (caps, timeouts) are the point of some tests

    @property
    def base(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self.server.hosts.append(self.headers.get("host", ""))
        route = self.server.routes.get(self.path)
        if route is None:
            self.send_response(404)
            self.send_header("content-length", "0")
            self.end_headers()
            return
        route(self)


def send_body(handler, body: bytes, content_type: str = "image/png", length: bool = True) -> None:
    handler.send_response(200)
    handler.send_header("content-type", content_type)
    if length:
        handler.send_header("content-length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def start_server(server: Recorder) -> Recorder:
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server
