"""Upstream API keys encrypted at rest (Fernet: AES-128-CBC + HMAC-SHA256).

The key comes from settings.PROXY_ENCRYPTION_KEY (a Fernet key; in development it is
derived from SECRET_KEY). A value that no longer decrypts (key rotated without
re-encryption, tampered row) makes the token config invalid: 401, never a 500."""

from __future__ import annotations

import base64
import hashlib

from cryptography.fernet import Fernet, InvalidToken
from django.conf import settings


class SecretUnreadable(Exception):
    """The stored secret cannot be decrypted with the configured key."""


def _fernet() -> Fernet:
    key = settings.PROXY_ENCRYPTION_KEY
    if not key:
        key = base64.urlsafe_b64encode(hashlib.sha256(f"proxy:{settings.SECRET_KEY}".encode()).digest()).decode()
    return Fernet(key)


def secret_encrypt(plain: str) -> str:
    return _fernet().encrypt(plain.encode()).decode()


def secret_decrypt(token: str) -> str:
    try:
        return _fernet().decrypt(token.encode()).decode()
    except (InvalidToken, ValueError):
        raise SecretUnreadable from None
