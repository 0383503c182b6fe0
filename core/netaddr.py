"""Which network addresses a server-side fetch may reach on a user's say-so."""

from __future__ import annotations

import ipaddress


def address_is_public(address: str, *, allow_loopback: bool = False) -> bool:
    """Whether `address` (an IP literal, v4 or v6, maybe with a zone) is a public unicast
    address: not private, link-local (cloud metadata at 169.254.169.254), loopback
    (unless `allow_loopback`, for tests and local development), reserved or multicast.
    An IPv4-mapped IPv6 address is judged as the IPv4 one it maps."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    if ip.is_loopback:
        return allow_loopback
    return ip.is_global and not ip.is_multicast
