"""The Host header as Django checks it, for the ASGI apps mounted beside Django (the MCP
toolsets, the SDK's OAuth endpoints), which never reach Django's own check."""

from __future__ import annotations

from django.conf import settings
from django.http.request import split_domain_port, validate_host


def allowed_hosts() -> list[str]:
    """What Django's HttpRequest.get_host() accepts."""
    if settings.DEBUG and not settings.ALLOWED_HOSTS:
        return [".localhost", "127.0.0.1", "[::1]"]
    return list(settings.ALLOWED_HOSTS)


def host_allowed(host: str) -> bool:
    """The Host header as Django checks it (ALLOWED_HOSTS, wildcards included)."""
    domain, _ = split_domain_port(host)
    return bool(domain) and validate_host(domain, allowed_hosts())
