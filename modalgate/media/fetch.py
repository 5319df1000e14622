"""Fetching remote media so that no URL can reach what the policy refuses (SSRF).

The rules, each a lesson from a published advisory:

- one parser decides: the URL is parsed once by httpx, checked, and the request
  is built from that parsed object (vLLM's allowlist bypasses came from two
  parsers reading one string differently);
- every address the host resolves to is checked, and the connection goes to
  an address that was checked: the network backend below refuses to connect
  anywhere else, so a second DNS answer (rebinding) has nowhere to go;
- redirects are followed by hand, each hop checked like the first;
- the byte cap is checked against Content-Length, then enforced while reading.
"""

from __future__ import annotations

import contextvars
import os
import socket
import ssl
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.to_thread
import httpcore
import httpx

from modalgate.errors import ErrorCode
from modalgate.media.addresses import IPAddress, is_forbidden_address, parse_host_address
from modalgate.media.urls import parse_media_url, parsed_url_refusal
from modalgate.policy.models import MediaUrls

# (host as httpcore sees it, the checked address to connect to) for the current task.
_PINNED: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar(
    "modalgate_pinned_address", default=None
)
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_GENERIC_TYPES = frozenset({"", "application/octet-stream", "binary/octet-stream"})


class FetchError(Exception):
    """A refusal or a failure, with a message fit for a client (no internal addresses)."""

    def __init__(self, code: ErrorCode, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Fetched:
    data: bytes
    content_type: str
    url: str  # after redirects


class _PinnedBackend(httpcore.AsyncNetworkBackend):
    """Connects only to the address this task's fetch checked for this host."""

    def __init__(self) -> None:
        self._inner = httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        pinned = _PINNED.get()
        if pinned is None or pinned[0] != host:
            raise httpcore.ConnectError("connection to an unchecked address refused")
        return await self._inner.connect_tcp(
            pinned[1], port, timeout, local_address, socket_options
        )

    async def connect_unix_socket(
        self, *args: object, **kwargs: object
    ) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError("unix sockets are not used for media")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


class _PinnedTransport(httpx.AsyncHTTPTransport):
    def __init__(self, verify: ssl.SSLContext | bool, max_connections: int) -> None:
        super().__init__(verify=verify)
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=httpx.create_ssl_context(verify=verify),
            max_connections=max_connections,
            max_keepalive_connections=max_connections,
            keepalive_expiry=5.0,
            network_backend=_PinnedBackend(),
        )


Resolver = Callable[[str, int], Awaitable[list[str]]]


async def system_resolver(host: str, port: int) -> list[str]:
    """Every address the system resolver gives for ``host``."""
    infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


class MediaFetcher:
    """Fetches media URLs under one ``media_urls`` policy; share one per process."""

    def __init__(
        self,
        rules: MediaUrls,
        *,
        verify: ssl.SSLContext | bool = True,
        resolver: Resolver = system_resolver,
    ) -> None:
        self.rules = rules
        max_connections = rules.max_connections
        self._resolver = resolver
        self._client = httpx.AsyncClient(
            transport=_PinnedTransport(verify, max_connections),
            follow_redirects=False,
            trust_env=False,
            timeout=httpx.Timeout(rules.fetch_timeout_s),
            headers={
                "user-agent": "modalgate",
                "accept": "image/*, video/*, audio/*, */*;q=0.1",
                "accept-encoding": "identity",
            },
        )
        # fast_acquire: a free slot costs no trip through the event loop (each trip
        # made httpcore's pool race for idle connections more often under load).
        self._all = anyio.Semaphore(max_connections, fast_acquire=True)
        self._max_per_host = rules.max_connections_per_host
        self._per_host: dict[str, anyio.Semaphore] = {}

    async def fetch(self, url: str, *, max_bytes: int, modality: str = "image") -> Fetched:
        """The media at ``url``; every way it cannot be had is a ``FetchError`` (the gate
        turns that into a 400, anything else it would answer 500)."""
        try:
            with anyio.fail_after(self.rules.fetch_timeout_s):
                return await self._fetch(url, max_bytes, modality)
        except TimeoutError:
            raise FetchError(ErrorCode.MEDIA_FETCH_FAILED, "fetching the URL timed out") from None
        except OSError:  # a file:// read: gone, or not readable, after its check
            raise FetchError(ErrorCode.MEDIA_FETCH_FAILED, "the file could not be read") from None

    async def aclose(self) -> None:
        await self._client.aclose()

    @property
    def is_closed(self) -> bool:
        return self._client.is_closed

    async def _fetch(self, url: str, max_bytes: int, modality: str) -> Fetched:
        current = url
        for _hop in range(self.rules.max_redirects + 1):
            parsed = self._checked(current)
            if parsed.scheme == "file":
                return await self._read_file(parsed, max_bytes)
            address = await self._resolve(parsed)
            host = parsed.raw_host.decode("ascii")
            async with self._all, self._host_slot(host):
                token = _PINNED.set((host, address))
                try:
                    result = await self._get(parsed, max_bytes, modality)
                finally:
                    _PINNED.reset(token)
            if isinstance(result, Fetched):
                return result
            try:
                current = str(parsed.join(result))
            except (httpx.InvalidURL, UnicodeError, ValueError):
                raise FetchError(ErrorCode.MEDIA_FETCH_FAILED, _BAD_LOCATION) from None
        raise FetchError(
            ErrorCode.MEDIA_FETCH_FAILED,
            f"the URL redirected more than {self.rules.max_redirects} times",
        )

    def _checked(self, url: str) -> httpx.URL:
        parsed = parse_media_url(url)
        if isinstance(parsed, str):
            raise FetchError(ErrorCode.URL_NOT_ALLOWED, parsed)
        reason = parsed_url_refusal(parsed, self.rules)
        if reason is not None:
            raise FetchError(ErrorCode.URL_NOT_ALLOWED, reason)
        if parsed.scheme not in ("http", "https", "file"):
            raise FetchError(ErrorCode.URL_NOT_ALLOWED, f"cannot fetch {parsed.scheme!r} URLs")
        return parsed

    async def _resolve(self, url: httpx.URL) -> str:
        """The address to connect to; every address the name has must pass."""
        host = url.raw_host.decode("ascii")
        literal = parse_host_address(host)
        addresses: list[IPAddress]
        if literal is not None:
            addresses = [literal]
        else:
            try:
                port = url.port or (443 if url.scheme == "https" else 80)
                resolved = await self._resolver(host, port)
            except (OSError, UnicodeError):
                raise FetchError(
                    ErrorCode.MEDIA_FETCH_FAILED, "the URL's host name does not resolve"
                ) from None
            addresses = [a for a in map(parse_host_address, resolved) if a is not None]
        if not addresses:
            raise FetchError(ErrorCode.MEDIA_FETCH_FAILED, "the URL's host name does not resolve")
        if any(is_forbidden_address(a, self.rules.allow_private) for a in addresses):
            raise FetchError(
                ErrorCode.URL_NOT_ALLOWED,
                "the URL's host resolves to a private, loopback or reserved address",
            )
        return str(addresses[0])

    def _host_slot(self, host: str) -> anyio.Semaphore:
        slot = self._per_host.get(host)
        if slot is None:
            if len(self._per_host) > 4096:
                self._per_host = {
                    h: s for h, s in self._per_host.items() if s.value < self._max_per_host
                }
            slot = self._per_host[host] = anyio.Semaphore(self._max_per_host, fast_acquire=True)
        return slot

    async def _get(self, url: httpx.URL, max_bytes: int, modality: str) -> Fetched | str:
        """The media, or the Location of a redirect."""
        try:
            async with self._client.stream("GET", url) as response:
                if response.status_code in _REDIRECTS:
                    location = response.headers.get("location")
                    if not location:
                        raise FetchError(
                            ErrorCode.MEDIA_FETCH_FAILED, "the URL redirected without a Location"
                        )
                    return location
                if not 200 <= response.status_code < 300:
                    raise FetchError(
                        ErrorCode.MEDIA_FETCH_FAILED,
                        f"the URL answered HTTP {response.status_code}",
                    )
                encoding = response.headers.get("content-encoding", "identity").strip().lower()
                if encoding not in ("identity", ""):
                    # Compressed media could expand past the cap inside one chunk.
                    raise FetchError(
                        ErrorCode.MEDIA_FETCH_FAILED, "the URL sent compressed (encoded) content"
                    )
                content_type = _main_type(response.headers.get("content-type", ""))
                if content_type not in _GENERIC_TYPES and not _fits(content_type, modality):
                    raise FetchError(
                        ErrorCode.MEDIA_FETCH_FAILED,
                        f"the URL returned {content_type[:60]!r}, not {modality}",
                    )
                declared = response.headers.get("content-length")
                if declared is not None and declared.isdigit() and int(declared) > max_bytes:
                    raise _too_big(max_bytes)
                data = bytearray()
                async for chunk in response.aiter_raw():
                    data += chunk
                    if len(data) > max_bytes:
                        raise _too_big(max_bytes)
                return Fetched(bytes(data), content_type, str(url))
        except httpx.TimeoutException:
            raise FetchError(ErrorCode.MEDIA_FETCH_FAILED, "fetching the URL timed out") from None
        except httpx.HTTPError:
            raise FetchError(
                ErrorCode.MEDIA_FETCH_FAILED, "could not download from the URL's host"
            ) from None
        except (httpx.InvalidURL, UnicodeError, ValueError):
            # Not HTTPErrors: httpx builds a redirect's next request as it sends (a Location
            # it cannot parse, or whose host IDNA refuses, raises there).
            raise FetchError(ErrorCode.MEDIA_FETCH_FAILED, _BAD_LOCATION) from None
        except httpx.StreamError:
            raise FetchError(
                ErrorCode.MEDIA_FETCH_FAILED, "could not download from the URL's host"
            ) from None

    async def _read_file(self, url: httpx.URL, max_bytes: int) -> Fetched:
        path = await anyio.to_thread.run_sync(_file_inside_roots, url.path, self.rules.file_roots)
        size = await anyio.to_thread.run_sync(os.path.getsize, path)
        if size > max_bytes:
            raise _too_big(max_bytes)
        data = await anyio.to_thread.run_sync(path.read_bytes)
        return Fetched(data, "", str(url))


def _file_inside_roots(raw_path: str, roots: Iterable[str]) -> Path:
    """The real path, if it is a regular file inside a root after resolving every symlink."""
    real = Path(os.path.realpath(raw_path))
    for root in roots:
        real_root = Path(os.path.realpath(root))
        if real.is_relative_to(real_root) and real.is_file():
            return real
    raise FetchError(ErrorCode.URL_NOT_ALLOWED, "the file is not inside an allowed directory")


def _main_type(content_type: str) -> str:
    return content_type.split(";", 1)[0].strip().lower()


def _fits(content_type: str, modality: str) -> bool:
    if modality == "file":
        return content_type == "application/pdf" or content_type.startswith("text/")
    return content_type.startswith(modality + "/")


_BAD_LOCATION = "the URL redirected to a location that cannot be fetched"


def _too_big(max_bytes: int) -> FetchError:
    return FetchError(
        ErrorCode.MEDIA_FETCH_FAILED, f"the media is larger than the limit of {max_bytes} bytes"
    )
