"""The Host header as Django checks it, for the ASGI apps mounted beside Django (the MCP
toolsets, the SDK's OAuth endpoints), which never reach Django's own check, and the one
answer every JSON surface gives a Host it does not serve."""

from __future__ import annotations

from django.conf import settings
from django.http.request import split_domain_port, validate_host

# RFC 9110 §15.5.20 421 Misdirected Request: this server does not serve that authority. Not
# a 400: nothing in the request is malformed, it reached the wrong host (an HTTP/2 client
# that coalesced connections retries on a new one). Each surface answers it in its own
# JSON shape, and never echoes the host.
HOST_REFUSED_STATUS = 421
HOST_REFUSED_MESSAGE = "This host name is not served here (ALLOWED_HOSTS)."


def allowed_hosts() -> list[str]:
    """What Django's HttpRequest.get_host() accepts."""
    if settings.DEBUG and not settings.ALLOWED_HOSTS:
        return [".localhost", "127.0.0.1", "[::1]"]
    return list(settings.ALLOWED_HOSTS)


def host_allowed(host: str) -> bool:
    """The Host header as Django checks it (ALLOWED_HOSTS, wildcards included)."""
    domain, _ = split_domain_port(host)
    return bool(domain) and validate_host(domain, allowed_hosts())
