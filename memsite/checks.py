"""Start-up checks of settings that load but would fail later, inside a request.
`manage.py migrate`, which the launcher runs before serving, stops on these errors."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.checks import Error, register


@register()
def proxy_encryption_key_check(app_configs: Any = None, **kwargs: Any) -> list[Error]:  # noqa: ARG001 - Django API
    """A malformed key would otherwise surface as a 500 on the first chat-proxy call that
    stores or reads an upstream key (proxy/crypto.py). The value is a secret: never quoted."""
    key = settings.PROXY_ENCRYPTION_KEY
    if not key:
        return []  # derived from SECRET_KEY (development)
    from cryptography.fernet import Fernet

    try:
        Fernet(key)
    except (ValueError, TypeError):
        return [
            Error(
                "PROXY_ENCRYPTION_KEY is not a Fernet key (32 bytes, url-safe base64-encoded).",
                hint="Generate one with: python -c 'from cryptography.fernet import Fernet; "
                "print(Fernet.generate_key().decode())'. Upstream keys stored under another key "
                "stay unreadable.",
                id="memsite.E001",
            )
        ]
    return []


# mem0's ingest makes up to two LLM requests (the fact extraction, then the update decision
# against the user's similar memories), each up to (1 + LLM_MAX_RETRIES) x LLM_TIMEOUT_S.
INGEST_LLM_REQUESTS = 2
# Embedding the facts, the database and lock waits on top of the LLM requests.
INGEST_LEASE_MARGIN_S = 60.0


@register()
def ingest_intent_lease_check(app_configs: Any = None, **kwargs: Any) -> list[Error]:  # noqa: ARG001 - Django API
    """The reconciler treats an ingest open longer than INGEST_INTENT_LEASE_S as crashed.
    A lease shorter than the slowest ingest lets it close a call still running as undone:
    the facts mem0 stores after that stay live with no hash, usage event or audit row."""
    lease = settings.INGEST_INTENT_LEASE_S
    slowest = INGEST_LLM_REQUESTS * (1 + settings.LLM_MAX_RETRIES) * settings.LLM_TIMEOUT_S + INGEST_LEASE_MARGIN_S
    if lease > slowest:
        return []
    return [
        Error(
            f"INGEST_INTENT_LEASE_S ({lease:g}) must be more than the slowest ingest, {slowest:g} s "
            f"({INGEST_LLM_REQUESTS} LLM requests x (1 + LLM_MAX_RETRIES) x LLM_TIMEOUT_S "
            f"+ {INGEST_LEASE_MARGIN_S:g} s).",
            hint="Raise INGEST_INTENT_LEASE_S, or lower LLM_TIMEOUT_S or LLM_MAX_RETRIES.",
            id="memsite.E002",
        )
    ]


# The chat proxy's retry delay is drawn within +-20 % (proxy.services._retry_delay); its
# sweep republishes a due turn within a minute.
PROXY_RETRY_JITTER = 1.2
PROXY_SWEEP_S = 60.0


@register()
def ingest_intent_retention_check(app_configs: Any = None, **kwargs: Any) -> list[Error]:  # noqa: ARG001 - Django API
    """The chat proxy reads a closed intent once more: an attempt that finished after its
    turn's deadline (or whose worker died before closing the turn) closes the turn as done
    when the sweep comes back to it, at most the longest retry delay later. Pruned before
    that, the turn would be extracted again."""
    retention = settings.INGEST_INTENT_RETENTION_DAYS * 86400.0
    needed = PROXY_RETRY_JITTER * settings.PROXY_EXTRACTION_RETRY_MAX_S + PROXY_SWEEP_S
    if retention > needed:
        return []
    return [
        Error(
            f"INGEST_INTENT_RETENTION_DAYS ({settings.INGEST_INTENT_RETENTION_DAYS}) must be more than the chat "
            f"proxy's longest retry delay, {needed:g} s ({PROXY_RETRY_JITTER:g} x PROXY_EXTRACTION_RETRY_MAX_S "
            f"+ {PROXY_SWEEP_S:g} s).",
            hint="Raise INGEST_INTENT_RETENTION_DAYS, or lower PROXY_EXTRACTION_RETRY_MAX_S.",
            id="memsite.E003",
        )
    ]


@register()
def chat_upstream_url_check(app_configs: Any = None, **kwargs: Any) -> list[Error]:  # noqa: ARG001 - Django API
    """The deployment's chat upstream serves every key without its own. A URL the upstream
    client cannot call (a port outside 1-65535, no host, whitespace) fails every such chat
    call: some as a 500 (an ExceptionGroup from the connection), none as an answer. The
    same rule as a key's upstream on save; empty means no default upstream. The URL may
    carry credentials: never quoted."""
    from proxy.services import upstream_url_usable

    url = settings.CHAT_UPSTREAM_BASE_URL
    if not url or upstream_url_usable(url):
        return []
    return [
        Error(
            "CHAT_UPSTREAM_BASE_URL is not a usable http(s) URL: it needs a host and, if given, "
            "a port from 1 to 65535, and no spaces or control characters.",
            hint="Set it to the upstream's base URL, e.g. https://api.openai.com, or leave it empty "
            "for no default upstream (keys then need their own).",
            id="memsite.E004",
        )
    ]
