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
