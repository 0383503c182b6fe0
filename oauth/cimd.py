"""Fetching a Client ID Metadata Document safely.

The client_id is an https URL chosen by whoever starts an authorization, so fetching it is
a server-side request on an attacker's behalf. The fetch therefore: takes https only,
resolves the name once and refuses any non-public address (loopback only under the test
setting `OAUTH_CIMD_ALLOW_LOOPBACK`), connects to exactly the address it checked (no DNS
rebinding between check and connect), follows no redirect, and stops at a size and time
limit. Callers cache the result (`services.oauth_client_from_metadata_url`)."""

from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings

from core.http_deadline import DeadlineSSLSocket, addresses_resolved, deadline_remaining, outbound_deadline
from core.inputs import InputError, json_loads_safe, text_problem
from core.netaddr import address_is_public


class MetadataDocumentError(Exception):
    """Why a document URL or document was refused (safe to show: no secrets in it)."""


def metadata_url_check(url: str) -> tuple[str, int, str]:
    """(host, port, path) of an acceptable document URL, or MetadataDocumentError."""
    if len(url) > 512:
        raise MetadataDocumentError("client_id URL is too long")
    problem = text_problem(url)
    if problem:  # Postgres refuses it: the cache lookup by URL would be a DataError
        raise MetadataDocumentError(f"client_id URL {problem}")
    parts = urlsplit(url)
    if parts.scheme != "https":
        raise MetadataDocumentError("client_id metadata document URL must use https")
    if not parts.hostname or parts.username or parts.password or parts.fragment:
        raise MetadataDocumentError("client_id metadata document URL is malformed")
    if parts.path in ("", "/") or "/./" in parts.path or "/../" in parts.path:
        raise MetadataDocumentError("client_id metadata document URL needs a path")
    try:
        port = parts.port or 443
    except ValueError as error:
        raise MetadataDocumentError("client_id metadata document URL has a bad port") from error
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    return parts.hostname, port, path


def _address_allowed(address: str) -> bool:
    return address_is_public(address, allow_loopback=bool(settings.OAUTH_CIMD_ALLOW_LOOPBACK))


def _resolve_public(host: str, port: int) -> str:
    try:  # an address literal needs no lookup
        literal = str(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        literal = ""
    if literal:
        if not _address_allowed(literal):
            raise MetadataDocumentError("client_id metadata document host is not a public address")
        return literal
    try:  # within the fetch's deadline: getaddrinfo itself takes no timeout
        addresses = addresses_resolved(host, port)
    except (OSError, UnicodeError) as error:  # TimeoutError included
        raise MetadataDocumentError("client_id metadata document host does not resolve") from error
    # Every address the name has must be public: otherwise a second lookup could pick another.
    if not addresses or not all(_address_allowed(address) for address in addresses):
        raise MetadataDocumentError("client_id metadata document host is not a public address")
    return addresses[0]


class _PinnedHTTPSConnection(http.client.HTTPSConnection):
    """HTTPS to one checked address, with the certificate checked against the host name."""

    def __init__(self, host: str, port: int, *, address: str, timeout: float, context: ssl.SSLContext):
        super().__init__(host, port, timeout=timeout, context=context)
        self._address = address

    def connect(self) -> None:
        sock = socket.create_connection((self._address, self.port), deadline_remaining(self.timeout))
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)  # type: ignore[attr-defined]


def _tls_context() -> ssl.SSLContext:
    context = ssl.create_default_context()
    # http.client gives every read its own timeout, and a header line or a body takes many
    # reads: a server sending a byte at a time held the fetch for about limit x timeout.
    # These sockets wait only until the fetch's deadline (outbound_deadline below).
    context.sslsocket_class = DeadlineSSLSocket
    if settings.OAUTH_CIMD_CA_FILE:  # tests: a throwaway CA for the loopback document server
        context.load_verify_locations(cafile=settings.OAUTH_CIMD_CA_FILE)
    return context


def _fetched(host: str, port: int, path: str, *, address: str, limit: int) -> bytes:
    """At most `limit + 1` bytes of the document's body, from the checked address."""
    connection = _PinnedHTTPSConnection(
        host, port, address=address, timeout=settings.OAUTH_CIMD_TIMEOUT_S, context=_tls_context()
    )
    try:
        connection.request("GET", path, headers={"Accept": "application/json", "User-Agent": "memsite-oauth"})
        response = connection.getresponse()
        if response.status != 200:  # a redirect (3xx) is refused like any other status
            raise MetadataDocumentError(f"client_id metadata document answered HTTP {response.status}")
        return bytes(response.read(limit + 1))
    except (OSError, http.client.HTTPException, ssl.SSLError) as error:
        raise MetadataDocumentError("client_id metadata document could not be fetched") from error
    finally:
        connection.close()


def metadata_document_fetch(url: str) -> dict[str, Any]:
    """The parsed JSON object at `url`, or MetadataDocumentError."""
    host, port, path = metadata_url_check(url)
    limit = settings.OAUTH_CIMD_MAX_BYTES
    with outbound_deadline(settings.OAUTH_CIMD_TIMEOUT_S):  # the whole fetch (its name lookup too), not each read
        address = _resolve_public(host, port)
        body = _fetched(host, port, path, address=address, limit=limit)
    if len(body) > limit:
        raise MetadataDocumentError("client_id metadata document is too large")
    try:
        # Bounded depth (a deep document was a RecursionError) and every string storable
        # (a NUL in client_name or a redirect URI was a DataError when cached).
        document = json_loads_safe(body)
    except InputError as error:
        raise MetadataDocumentError(f"client_id metadata document: {error.message}") from error
    if not isinstance(document, dict):
        raise MetadataDocumentError("client_id metadata document is not a JSON object")
    return document
