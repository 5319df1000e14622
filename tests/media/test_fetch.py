"""The media fetcher against real HTTP(S) servers on loopback.

Two listeners: the media server on 127.0.0.1 (allowed through ``allow_private``
where a test says so) and a "forbidden" server on 127.0.0.2 that records every
connection, so a test can prove that a refused address was never connected to.
"""

from __future__ import annotations

import ipaddress
import os
import ssl
import time
from collections.abc import Iterator

import anyio
import pytest
import trustme

from conftest import Recorder, image_bytes, send_body, start_server
from modalgate.errors import ErrorCode
from modalgate.media.fetch import FetchError, MediaFetcher
from modalgate.policy.models import MediaUrls

PNG = image_bytes("PNG", (32, 24))
LOOPBACK_ONLY = (ipaddress.ip_network("127.0.0.1/32"),)


def _redirect(target: str):
    def route(handler):
        handler.send_response(302)
        handler.send_header("location", target)
        handler.send_header("content-length", "0")
        handler.end_headers()

    return route


def _drip(handler) -> None:
    handler.send_response(200)
    handler.send_header("content-type", "image/png")
    handler.send_header("content-length", str(len(PNG)))
    handler.end_headers()
    for byte in PNG:
        handler.wfile.write(bytes([byte]))
        handler.wfile.flush()
        time.sleep(0.2)


def _endless(handler) -> None:
    handler.send_response(200)
    handler.send_header("content-type", "image/png")
    handler.end_headers()  # no Content-Length: the cap must stop the read
    try:
        for _ in range(10_000):
            handler.wfile.write(b"\x00" * 4096)
    except OSError:
        pass


def _bad_content_length(handler) -> None:
    handler.send_response(200)
    handler.send_header("content-type", "image/png")
    handler.send_header("content-length", "12, 13")
    handler.end_headers()
    handler.wfile.write(PNG[:12])


@pytest.fixture(scope="module")
def forbidden() -> Iterator[Recorder]:
    server = start_server(Recorder(("127.0.0.2", 0), {"/a.png": lambda h: send_body(h, PNG)}))
    yield server
    server.shutdown()


@pytest.fixture(scope="module")
def media(forbidden) -> Iterator[Recorder]:
    port = forbidden.server_address[1]
    routes = {
        "/a.png": lambda h: send_body(h, PNG),
        "/page.html": lambda h: send_body(h, b"<html>hi</html>", "text/html"),
        "/data.json": lambda h: send_body(h, b"{}", "application/json"),
        "/octet": lambda h: send_body(h, PNG, "application/octet-stream"),
        "/big": lambda h: send_body(h, b"\x00" * 50_000),
        "/endless": _endless,
        "/drip": _drip,
        "/to-metadata": _redirect("http://169.254.169.254/latest/meta-data/"),
        "/to-v6-loopback": _redirect(f"http://[::1]:{port}/a.png"),
        "/to-private": _redirect("http://10.0.0.7/a.png"),
        "/to-forbidden": _redirect(f"http://127.0.0.2:{port}/a.png"),
        "/to-decimal": _redirect(f"http://2130706434:{port}/a.png"),
        "/to-relative": _redirect("/a.png"),
        "/loop": _redirect("/loop"),
        "/to-file": _redirect("file:///etc/passwd"),
        # Locations httpx cannot join or send (InvalidURL, UnsupportedProtocol).
        "/to-foo-bar": _redirect("foo:bar"),
        "/to-data": _redirect("data:image/png;base64,iVBORw0KGgo="),
        "/to-bad-port": _redirect("http://127.0.0.1:99999/a.png"),
        "/to-bad-host": _redirect("http://exa mple.com/a.png"),
        "/to-nul": _redirect("http://127.0.0.1/a\x00.png"),
        "/to-long-label": _redirect("http://" + "a" * 70 + ".example/a.png"),
        "/to-bad-idna": _redirect("http://xn--a.example/a.png"),
        "/bad-content-length": _bad_content_length,
    }
    server = start_server(Recorder(("127.0.0.1", 0), routes))
    yield server
    server.shutdown()


def _rules(**overrides) -> MediaUrls:
    settings = {"schemes": ("http", "https", "data"), "allow_private": LOOPBACK_ONLY}
    settings.update(overrides)
    return MediaUrls(**settings)


def fetch(url: str, rules: MediaUrls | None = None, max_bytes: int = 1 << 20, **kw):
    async def run():
        fetcher = MediaFetcher(rules or _rules(), **kw)
        try:
            return await fetcher.fetch(url, max_bytes=max_bytes)
        finally:
            await fetcher.aclose()

    return anyio.run(run)


def refusal(url: str, rules: MediaUrls | None = None, **kw) -> FetchError:
    with pytest.raises(FetchError) as caught:
        fetch(url, rules, **kw)
    return caught.value


def test_fetches_an_allowed_image(media):
    fetched = fetch(media.base + "/a.png")
    assert fetched.data == PNG
    assert fetched.content_type == "image/png"


def test_relative_redirect_is_followed(media):
    assert fetch(media.base + "/to-relative").data == PNG


def test_octet_stream_is_left_to_the_magic_bytes(media):
    assert fetch(media.base + "/octet").data == PNG


@pytest.mark.parametrize(
    ("path", "code", "words"),
    [
        ("/to-metadata", ErrorCode.URL_NOT_ALLOWED, "private, loopback or reserved"),
        ("/to-v6-loopback", ErrorCode.URL_NOT_ALLOWED, "private, loopback or reserved"),
        ("/to-private", ErrorCode.URL_NOT_ALLOWED, "private, loopback or reserved"),
        ("/to-forbidden", ErrorCode.URL_NOT_ALLOWED, "private, loopback or reserved"),
        ("/to-decimal", ErrorCode.URL_NOT_ALLOWED, "private, loopback or reserved"),
        ("/to-file", ErrorCode.URL_NOT_ALLOWED, "scheme 'file'"),
        ("/loop", ErrorCode.MEDIA_FETCH_FAILED, "redirected more than 3 times"),
        ("/missing.png", ErrorCode.MEDIA_FETCH_FAILED, "HTTP 404"),
        ("/page.html", ErrorCode.MEDIA_FETCH_FAILED, "'text/html', not image"),
        ("/data.json", ErrorCode.MEDIA_FETCH_FAILED, "'application/json', not image"),
    ],
)
def test_refusals(media, forbidden, path, code, words):
    before = len(forbidden.connections)
    error = refusal(media.base + path)
    assert error.code is code
    assert words in error.reason
    assert "127.0.0.2" not in error.reason and "169.254" not in error.reason
    assert len(forbidden.connections) == before, "a refused address was connected to"


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.2",
        "2130706434",
        "0x7f000002",
        "0177.0.0.2",
        "0177.0.0.02",
        "127.2",
        "0x7f.2",
        "[::ffff:127.0.0.2]",
        "[::ffff:7f00:2]",
        "[64:ff9b::7f00:2]",
        "[2002:7f00:0002::]",
        "[::1]",
        "[fe80::1%25eth0]",
        "[::]",
        "0.0.0.0",
        "0",
        "169.254.169.254",
        "2852039166",
        "0xa9fea9fe",
        "[::ffff:169.254.169.254]",
        "[fd00:ec2::254]",
        "100.100.100.200",
        "100.64.0.1",
        "10.1.2.3",
        "172.16.0.1",
        "192.168.1.1",
        "224.0.0.1",
        "240.0.0.1",
        "localhost",
        "foo.localhost",
        "LOCALHOST.",
        "127。0。0。2",
        "１２７.０.０.２",
        "ⓛⓞⓒⓐⓛⓗⓞⓢⓣ",
    ],
)
def test_every_form_of_a_refused_address(forbidden, host):
    before = len(forbidden.connections)
    port = forbidden.server_address[1]
    error = refusal(f"http://{host}:{port}/a.png", _rules(allow_private=()))
    assert error.code is ErrorCode.URL_NOT_ALLOWED
    assert len(forbidden.connections) == before


@pytest.mark.parametrize(
    "url",
    [
        "http://user@127.0.0.1/a.png",
        "http://127.0.0.1\\@169.254.169.254/a.png",
        "http://127.0.0.1 /a.png",
        "gopher://127.0.0.1/a.png",
        "file:///etc/passwd",
        "ftp://example.com/a.png",
        "//example.com/a.png",
    ],
)
def test_url_tricks(url):
    assert refusal(url).code is ErrorCode.URL_NOT_ALLOWED


def test_byte_cap_from_content_length(media):
    error = refusal(media.base + "/big", max_bytes=10_000)
    assert error.code is ErrorCode.MEDIA_FETCH_FAILED
    assert "10000 bytes" in error.reason


def test_byte_cap_while_streaming_without_content_length(media):
    error = refusal(media.base + "/endless", max_bytes=100_000)
    assert error.code is ErrorCode.MEDIA_FETCH_FAILED
    assert "100000 bytes" in error.reason


def test_slow_drip_hits_the_total_timeout(media):
    started = time.monotonic()
    error = refusal(media.base + "/drip", _rules(fetch_timeout_s=1.0))
    assert error.code is ErrorCode.MEDIA_FETCH_FAILED
    assert "timed out" in error.reason
    assert time.monotonic() - started < 5


def test_connection_goes_to_the_checked_address_with_the_original_host(media):
    """A name resolves to the allowed address: the request keeps its Host header."""
    port = media.server_address[1]

    async def resolver(host: str, port: int) -> list[str]:
        return ["127.0.0.1"] if host == "media.test" else []

    fetched = fetch(f"http://media.test:{port}/a.png", resolver=resolver)
    assert fetched.data == PNG
    assert media.hosts[-1] == f"media.test:{port}"


def test_a_name_with_any_forbidden_address_is_refused(media, forbidden):
    port = forbidden.server_address[1]

    async def resolver(host: str, port: int) -> list[str]:
        return ["127.0.0.1", "127.0.0.2"]  # one good answer does not launder a bad one

    before = len(forbidden.connections) + len(media.connections)
    error = refusal(f"http://split.test:{port}/a.png", resolver=resolver)
    assert error.code is ErrorCode.URL_NOT_ALLOWED
    assert "resolves to a private" in error.reason
    assert len(forbidden.connections) + len(media.connections) == before


def test_dns_rebinding_has_nowhere_to_go(media, forbidden):
    """The second lookup would say 127.0.0.2; no second lookup is ever made."""
    answers = iter([["127.0.0.1"], ["127.0.0.2"], ["127.0.0.2"]])
    port = media.server_address[1]
    calls = []

    async def resolver(host: str, port: int) -> list[str]:
        calls.append(host)
        return next(answers)

    before = len(forbidden.connections)
    assert fetch(f"http://rebind.test:{port}/a.png", resolver=resolver).data == PNG
    assert calls == ["rebind.test"]
    assert len(forbidden.connections) == before


def test_unresolvable_host(media):
    async def resolver(host: str, port: int) -> list[str]:
        raise OSError("no such host")

    error = refusal("http://nowhere.test/a.png", resolver=resolver)
    assert error.code is ErrorCode.MEDIA_FETCH_FAILED
    assert "does not resolve" in error.reason


def test_allow_hosts_is_checked_on_every_hop(media):
    port = media.server_address[1]
    rules = _rules(allow_hosts=("media.test",))

    async def resolver(host: str, port: int) -> list[str]:
        return ["127.0.0.1"]

    assert fetch(f"http://media.test:{port}/a.png", rules, resolver=resolver).data == PNG
    error = refusal(f"http://other.test:{port}/a.png", rules, resolver=resolver)
    assert error.code is ErrorCode.URL_NOT_ALLOWED


def test_tls_to_a_pinned_address_keeps_server_name_and_verification(tmp_path):
    authority = trustme.CA()
    certificate = authority.issue_cert("media.test")
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    certificate.configure_cert(server_context)
    server = start_server(
        Recorder(("127.0.0.1", 0), {"/a.png": lambda h: send_body(h, PNG)}, server_context)
    )
    client_context = ssl.create_default_context()
    authority.configure_trust(client_context)
    port = server.server_address[1]

    async def resolver(host: str, port: int) -> list[str]:
        return ["127.0.0.1"]

    try:
        rules = _rules(schemes=("https",))
        fetched = fetch(
            f"https://media.test:{port}/a.png", rules, verify=client_context, resolver=resolver
        )
        assert fetched.data == PNG
        # The same address under a name the certificate does not carry fails verification.
        error = refusal(
            f"https://other.test:{port}/a.png", rules, verify=client_context, resolver=resolver
        )
        assert error.code is ErrorCode.MEDIA_FETCH_FAILED
    finally:
        server.shutdown()


def test_file_urls_only_inside_roots(tmp_path):
    root = tmp_path / "media"
    root.mkdir()
    (root / "a.png").write_bytes(PNG)
    secret = tmp_path / "secret.png"
    secret.write_bytes(PNG)
    os.symlink(secret, root / "escape.png")
    rules = _rules(schemes=("file",), file_roots=(str(root),))
    assert fetch(f"file://{root}/a.png", rules).data == PNG
    assert refusal(f"file://{root}/escape.png", rules).code is ErrorCode.URL_NOT_ALLOWED
    assert refusal(f"file://{root}/../secret.png", rules).code is ErrorCode.URL_NOT_ALLOWED
    assert refusal("file:///etc/passwd", rules).code is ErrorCode.URL_NOT_ALLOWED
    no_roots = _rules(schemes=("file",))
    assert refusal(f"file://{root}/a.png", no_roots).code is ErrorCode.URL_NOT_ALLOWED


def test_idna_hosts_are_resolved_and_connected_in_their_ascii_form(media):
    port = media.server_address[1]
    asked = []

    async def resolver(host: str, port: int) -> list[str]:
        asked.append(host)
        return ["127.0.0.1"]

    assert fetch(f"http://bücher.test:{port}/a.png", resolver=resolver).data == PNG
    assert asked == ["xn--bcher-kva.test"]
    assert media.hosts[-1] == f"xn--bcher-kva.test:{port}"


@pytest.mark.parametrize(
    "path",
    [
        "/to-foo-bar",
        "/to-data",
        "/to-bad-port",
        "/to-bad-host",
        "/to-nul",
        "/to-long-label",
        "/to-bad-idna",
        "/bad-content-length",
    ],
)
def test_what_httpx_raises_outside_http_error_is_a_fetch_refusal(media, path):
    """InvalidURL, UnsupportedProtocol, a header it cannot read: each a FetchError with
    a stable code, never an exception the gate would answer 500."""
    error = refusal(media.base + path)
    assert error.code in (ErrorCode.MEDIA_FETCH_FAILED, ErrorCode.URL_NOT_ALLOWED), error
    assert "Traceback" not in error.reason and "httpx" not in error.reason
