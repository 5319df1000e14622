"""What modalgate uses below its dependencies' public APIs still has the shape it relies on.

Each hook is listed, with what it gains and how it is measured, in docs/hooks.md. A
failure here names the dependency and its installed version: the internals moved, and
the hook must follow them (or go) before that version is allowed in pyproject.
"""

from __future__ import annotations

import ast
import asyncio
import ctypes
import inspect
import subprocess
import sys

import numpy as np
import pytest
import uvicorn
from PIL import Image
from uvicorn.config import Config
from uvicorn.protocols.http import httptools_impl
from uvicorn.server import ServerState

from modalgate.gateway import body_reader, http_protocol
from modalgate.media import pillow_planes


def attributes_used_on_self(cls: type) -> set[str]:
    """Every ``self.name`` the class's own methods read or call."""
    tree = ast.parse(inspect.getsource(cls))
    used = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
        ):
            used.add(node.attr)
    return used


def own_names(cls: type) -> set[str]:
    """Names the class (and its own modalgate bases) define or assign on ``self``."""
    names = set()
    for klass in cls.__mro__:
        if not klass.__module__.startswith("modalgate"):
            continue
        names |= set(vars(klass))
        tree = ast.parse(inspect.getsource(klass))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
    return names


def test_uvicorns_httptools_protocol_has_what_the_serve_protocol_uses():
    """``http_protocol.ServeHttpProtocol`` subclasses uvicorn's private
    ``HttpToolsProtocol``: every attribute it uses and does not define is the base's."""
    config = Config(app=lambda scope, receive, send: None, http="httptools")
    config.load()
    loop = asyncio.new_event_loop()
    try:
        base = httptools_impl.HttpToolsProtocol(
            config=config, server_state=ServerState(), app_state={}, _loop=loop
        )
    finally:
        loop.close()
    ours = http_protocol.ServeHttpProtocol
    used = attributes_used_on_self(ours) | attributes_used_on_self(ours.__mro__[1])
    inherited = sorted(name for name in used if name not in own_names(ours))
    assert len(inherited) >= 10  # cycle, flow, scope, _should_upgrade, ...: the check has work
    missing = [name for name in inherited if not hasattr(base, name)]
    assert missing == [], f"uvicorn {uvicorn.__version__}: HttpToolsProtocol lacks {missing}"
    for method in ("on_message_begin", "on_message_complete", "on_headers_complete",
                   "on_response_complete", "connection_made", "connection_lost",
                   "handle_websocket_upgrade", "send_400_response"):  # fmt: skip
        assert callable(getattr(httptools_impl.HttpToolsProtocol, method, None)), (
            f"uvicorn {uvicorn.__version__}: HttpToolsProtocol.{method} is gone"
        )


def test_uvicorns_request_response_cycle_has_what_the_body_handover_reads():
    cycle = inspect.signature(httptools_impl.RequestResponseCycle.__init__).parameters
    for name in ("scope", "transport", "flow", "logger", "access_logger", "access_log",
                 "default_headers", "message_event", "expect_100_continue", "keep_alive",
                 "on_response"):  # fmt: skip
        assert name in cycle, f"uvicorn {uvicorn.__version__}: RequestResponseCycle({name}=)"
    source = inspect.getsource(httptools_impl.RequestResponseCycle)
    for attribute in ("self.body", "self.more_body", "self.message_event"):
        assert attribute in source, f"uvicorn {uvicorn.__version__}: {attribute} is gone"
    assert isinstance(http_protocol.HIGH_WATER_LIMIT, int)


@pytest.mark.skipif(sys.implementation.name != "cpython", reason="the hook is CPython's")
def test_a_body_filled_in_place_is_a_normal_bytes_object():
    """``body_reader.writable_bytes``: a ``bytes`` from ``PyBytes_FromStringAndSize``
    written through ctypes at CPython's ``bytes`` data offset."""
    body, view = body_reader.writable_bytes(5)
    view[:] = b"hello"
    assert type(body) is bytes and body == b"hello" and hash(body) == hash(b"hello")
    assert ctypes.sizeof(ctypes.c_char) == 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_glibc_takes_the_allocator_settings():
    """In a process of its own: the settings are the whole process's."""
    code = "from modalgate.gateway.server import reuse_big_buffers; print(reuse_big_buffers())"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "True", "glibc's mallopt refused the thresholds"


def test_pillow_exports_its_pixel_block_where_the_planes_read_it():
    image = Image.new("RGB", (7, 3), (1, 2, 3))
    planes = pillow_planes.planes(image)
    assert [np.asarray(plane).tolist() for plane in planes] == [
        np.asarray(image)[..., band].tolist() for band in range(3)
    ]
