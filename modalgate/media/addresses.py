"""Which IP addresses media URLs may never reach (unless a policy lists them).

The same predicate serves the validators (literal IPs in URLs) and, later, the
fetcher (every resolved address), so the two can never disagree.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

_CGNAT = ipaddress.IPv4Network("100.64.0.0/10")
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
# Cloud metadata endpoints that are not link-local (AWS's IPv6 one, Alibaba's).
_METADATA = {ipaddress.ip_address("fd00:ec2::254"), ipaddress.ip_address("100.100.100.200")}


def parse_host_address(host: str) -> IPAddress | None:
    """The address a host string denotes, including legacy numeric forms.

    ``2130706433``, ``0177.0.0.1``, ``0x7f.1`` and ``127.1`` all mean 127.0.0.1 to
    the C resolver, so they are read the way ``inet_aton`` reads them.
    """
    text = host.strip("[]").split("%", 1)[0]  # IPv6 zone ids name no other host
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        pass
    if text and all(c in "0123456789abcdefxABCDEFX." for c in text) and text[0].isdigit():
        try:
            return ipaddress.IPv4Address(socket.inet_aton(text))
        except OSError:
            return None
    return None


def is_forbidden_address(address: IPAddress, allow_private: Iterable[IPNetwork] = ()) -> bool:
    for network in allow_private:
        if address.version == network.version and address in network:
            return False
    if isinstance(address, ipaddress.IPv6Address):
        embedded = address.ipv4_mapped or address.sixtofour or _nat64_embedded(address)
        if embedded is not None:
            return is_forbidden_address(embedded, allow_private)
    if address in _METADATA:
        return True
    if isinstance(address, ipaddress.IPv4Address) and address in _CGNAT:
        return True
    return (
        address.is_private
        or address.is_loopback
        or address.is_link_local
        or address.is_multicast
        or address.is_reserved
        or address.is_unspecified
        or not address.is_global
    )


def _nat64_embedded(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if address in _NAT64:
        return ipaddress.IPv4Address(address.packed[-4:])
    return None
