"""Connections to a key's own upstream reach public addresses only.

A key's upstream URL is set by its owner in the web UI (or by staff): without this, any
user could point it at the server's own network (a database port, a cloud metadata
service at 169.254.169.254) and read the answers relayed back. The deployment's default
upstream (`CHAT_UPSTREAM_BASE_URL`, set by the operator) is not restricted.

The check runs where the connection is made, on the address connected to: the host is
resolved once, every address it resolves to must be public, and the connection goes to
the address checked, so a DNS answer that changes between a check and the connect
(rebinding) cannot slip through. TLS still verifies the URL's host name (httpcore takes
SNI and the certificate name from the URL, not from the address connected to).
`PROXY_KEY_UPSTREAM_ALLOW_LOOPBACK` (tests, local development) also admits loopback.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable
from typing import Any

import anyio
import httpcore
import httpx
from django.conf import settings

from core.netaddr import address_is_public


class UpstreamAddressRefused(httpcore.ConnectError):
    """The upstream's host is, or resolves to, an address a key's upstream may not use."""


def _literal(host: str) -> str | None:
    try:
        return str(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return None


async def public_address(host: str, port: int, *, timeout: float | None) -> str:
    """The address to connect to for `host`, or UpstreamAddressRefused."""
    allow_loopback = bool(settings.PROXY_KEY_UPSTREAM_ALLOW_LOOPBACK)
    literal = _literal(host)
    if literal is not None:
        addresses = [literal]
    else:
        with anyio.fail_after(timeout):
            infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
    # All of them: a name that resolves to one public and one private address could be
    # connected to either.
    if not addresses or not all(address_is_public(a, allow_loopback=allow_loopback) for a in addresses):
        raise UpstreamAddressRefused("the upstream host is not a public address")
    return addresses[0]


class PublicAddressBackend(httpcore.AsyncNetworkBackend):
    def __init__(self) -> None:
        self._backend = httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        # httpcore maps the errors of its own connect only: a name that does not resolve
        # (socket.gaierror from our lookup), a resolver that does not answer in time, or
        # a port anyio refuses (an ExceptionGroup around OverflowError) would leave httpx
        # as raw exceptions, and the view as a 500 with no audit row. Each is a connection
        # that could not be made (502 `upstream_unreachable`); a refused address stays
        # UpstreamAddressRefused.
        try:
            address = await public_address(host, port, timeout=timeout)
            return await self._backend.connect_tcp(
                address, port, timeout=timeout, local_address=local_address, socket_options=socket_options
            )
        except (httpcore.ConnectError, httpcore.ConnectTimeout):
            raise
        except TimeoutError as exc:
            raise httpcore.ConnectTimeout("the upstream host was not resolved or connected in time") from exc
        except (OSError, OverflowError, ValueError, ExceptionGroup) as exc:
            raise httpcore.ConnectError("the upstream host could not be connected to") from exc

    async def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore.AsyncNetworkStream:
        raise UpstreamAddressRefused("a key's upstream is never a local socket")

    async def sleep(self, seconds: float) -> None:
        await self._backend.sleep(seconds)


def public_only_transport(*, limits: httpx.Limits) -> httpx.AsyncHTTPTransport:
    """httpx's transport with its connection pool on PublicAddressBackend. httpx (pinned)
    takes no network backend, so the pool it built is replaced by an equal one that has."""
    transport = httpx.AsyncHTTPTransport(limits=limits, trust_env=False)
    transport._pool = httpcore.AsyncConnectionPool(
        ssl_context=httpx.create_ssl_context(trust_env=False),
        max_connections=limits.max_connections,
        max_keepalive_connections=limits.max_keepalive_connections,
        keepalive_expiry=limits.keepalive_expiry,
        network_backend=PublicAddressBackend(),
    )
    return transport


def upstream_address_is_refused(error: BaseException) -> bool:
    """Whether an httpx error came from UpstreamAddressRefused."""
    return isinstance(error.__cause__, UpstreamAddressRefused)
