"""Scheme and host rules for media URLs, decided from the URL text alone (no I/O).

The validators call this for the cheap tier; the fetcher calls it again for
every redirect hop, then resolves the name and checks every address.
"""

from __future__ import annotations

import fnmatch

import httpx

from modalgate.media.addresses import is_forbidden_address, parse_host_address
from modalgate.policy.models import MediaUrls


def url_refusal(url: str, rules: MediaUrls) -> str | None:
    """Why this URL may not be used, in words fit for a client; ``None`` if it may."""
    parsed = parse_media_url(url)
    return parsed if isinstance(parsed, str) else parsed_url_refusal(parsed, rules)


def parse_media_url(url: str) -> httpx.URL | str:
    """The one parse every later decision and the request itself use, or why it failed."""
    if "\\" in url or any(ord(c) < 0x21 for c in url):
        return "the URL contains backslashes, spaces or control characters"
    try:
        parsed = httpx.URL(url)
        _ = parsed.host  # decodes IDNA labels, which can fail (xn--ls8h is not a valid label)
    except (httpx.InvalidURL, ValueError, UnicodeError):
        return "the URL cannot be parsed"
    if parsed.port is not None and not 0 < parsed.port < 65536:  # httpx takes any digits
        return "the URL's port is not between 1 and 65535"
    return parsed


def parsed_url_refusal(parsed: httpx.URL, rules: MediaUrls) -> str | None:
    scheme = parsed.scheme.lower()
    if not scheme:
        return "the URL has no scheme; use https:// or a data: URL"
    if scheme not in rules.schemes:
        allowed = ", ".join(rules.schemes)
        return f"the URL scheme {scheme!r} is not allowed (allowed: {allowed})"
    if scheme == "file":
        return None if rules.file_roots else "file URLs need configured media_urls.file_roots"
    if parsed.userinfo:
        return "URLs with user credentials are not allowed"
    host = parsed.host.lower().rstrip(".")
    if not host:
        return "the URL has no host"
    address = parse_host_address(host)
    if address is not None:
        if is_forbidden_address(address, rules.allow_private):
            return "the URL points to a private, loopback or reserved address"
    elif host == "localhost" or host.endswith(".localhost"):
        loopback = parse_host_address("127.0.0.1")
        if loopback is not None and is_forbidden_address(loopback, rules.allow_private):
            return "the URL points to a private, loopback or reserved address"
    if rules.allow_hosts and not any(fnmatch.fnmatchcase(host, p) for p in rules.allow_hosts):
        return "the URL's host is not in the allowed hosts"
    return None
