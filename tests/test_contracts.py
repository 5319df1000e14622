"""What modalgate uses below its dependencies' public APIs still has the shape it relies on.

Each hook is listed, with what it gains and how it is measured, in docs/hooks.md. A
failure here names the dependency and its installed version: the internals moved, and
the hook must follow them (or go) before that version is allowed in pyproject.
"""

from __future__ import annotations

import ast
import asyncio
import ctypes
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import uvicorn
from PIL import Image

import modalgate
from modalgate.gateway.http import body_reader
from modalgate.gateway.http import protocol as http_protocol
from modalgate.media import pillow_planes

PACKAGE = Path(modalgate.__file__).parent


def imports_below_public_apis() -> list[str]:
    """Every import in modalgate of a dependency's private module or name: a segment or
    name starting with ``_``, or uvicorn's protocol implementations."""
    found = []
    for source in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.Import):
                modules, names = [alias.name for alias in node.names], []
            else:
                continue
            for module in modules:
                if module == "__future__" or module.split(".")[0] == "modalgate":
                    continue
                private = [part for part in module.split(".") if part.startswith("_")]
                private += [name for name in names if name.startswith("_")]
                if private or module.startswith("uvicorn.protocols"):
                    found.append(f"{source.relative_to(PACKAGE)}:{node.lineno} {module}")
    return found


def test_no_module_imports_a_private_part_of_a_dependency():
    """serve's protocol used to subclass uvicorn's private ``HttpToolsProtocol``; it is
    modalgate's own now (``gateway/http/connection.py``), on httptools' public parser."""
    assert imports_below_public_apis() == []


def test_the_private_import_check_finds_one(tmp_path, monkeypatch):
    (tmp_path / "hook.py").write_text(
        "from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol\n"
        "from starlette._utils import is_async_callable\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path)
    assert imports_below_public_apis() == [
        "hook.py:1 uvicorn.protocols.http.httptools_impl",
        "hook.py:2 starlette._utils",
    ]


async def _answer(_scope, receive, send) -> None:
    await receive()
    headers = [(b"content-length", b"2")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b"ok"})


def test_uvicorn_hosts_the_protocol_as_it_hosts_any_protocol_class():
    """What ``connection.Http11Protocol`` takes from ``uvicorn.Server``: it is built per
    connection from ``Config(http=cls)`` with the server's ``config``, ``server_state``
    and ``app_state``, is counted in ``server_state.connections``, counts its answers in
    ``server_state.total_requests``, and is told to ``shutdown()`` when the server
    stops (an idle kept-alive connection closes then)."""

    async def main() -> tuple[list[type], int, bytes, bytes]:
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        config = uvicorn.Config(
            _answer, http=http_protocol.ServeHttpProtocol, lifespan="off", log_level="warning"
        )
        server = uvicorn.Server(config)
        serving = asyncio.create_task(server.serve(sockets=[listener]))
        for _ in range(200):
            if server.started:
                break
            await asyncio.sleep(0.01)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = await asyncio.wait_for(reader.readuntil(b"ok"), 5)
        kinds = [type(connection) for connection in server.server_state.connections]
        requests = server.server_state.total_requests
        server.should_exit = True
        after = await asyncio.wait_for(reader.read(), 5)  # b"": closed by shutdown()
        writer.close()
        await asyncio.wait_for(serving, 10)
        return kinds, requests, answer, after

    version = f"uvicorn {uvicorn.__version__}"
    kinds, requests, answer, after = asyncio.run(main())
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n"), version
    assert kinds == [http_protocol.ServeHttpProtocol], f"{version}: server_state.connections"
    assert requests == 1, f"{version}: server_state.total_requests"
    assert after == b"", f"{version}: shutdown() left the idle connection open"


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
    code = "from modalgate.gateway.http.server import reuse_big_buffers; print(reuse_big_buffers())"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "True", "glibc's mallopt refused the thresholds"


def test_pillow_exports_its_pixel_block_where_the_planes_read_it():
    image = Image.new("RGB", (7, 3), (1, 2, 3))
    planes = pillow_planes.planes(image)
    assert [np.asarray(plane).tolist() for plane in planes] == [
        np.asarray(image)[..., band].tolist() for band in range(3)
    ]
