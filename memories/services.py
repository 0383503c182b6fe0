"""Writes. Every function is keyword-only; memory operations take a MemoryScope first."""

from __future__ import annotations

import hashlib
import secrets

from django.db import transaction
from django.utils import timezone

from memories.models import ApiKey

KEY_ID_BYTES = 6  # 12 hex chars: the public, unique lookup part
SECRET_BYTES = 32


def _secret_hash(secret: str) -> str:
    # Keys are 256-bit random, so a fast hash is enough (no password stretching needed).
    return hashlib.sha256(secret.encode()).hexdigest()


def api_key_issue(*, user, name: str = "") -> tuple[ApiKey, str]:
    """Create a key for `user`. Returns the row and the plain key, which is not stored."""
    key_id = secrets.token_hex(KEY_ID_BYTES)
    secret = secrets.token_urlsafe(SECRET_BYTES)
    api_key = ApiKey.objects.create(user=user, name=name[:100], key_id=key_id, secret_hash=_secret_hash(secret))
    return api_key, f"{ApiKey.PREFIX}{key_id}_{secret}"


def api_key_authenticate(*, token: str) -> ApiKey | None:
    """The active key matching `token`, or None. Constant-time on the secret."""
    if not token.startswith(ApiKey.PREFIX):
        return None
    key_id, sep, secret = token[len(ApiKey.PREFIX) :].partition("_")
    if not sep or not key_id or not secret:
        return None
    api_key = ApiKey.objects.select_related("user").filter(key_id=key_id, revoked_at__isnull=True).first()
    expected = api_key.secret_hash if api_key else _secret_hash("")
    if not secrets.compare_digest(expected, _secret_hash(secret)) or api_key is None:
        return None
    if not api_key.user.is_active:
        return None
    ApiKey.objects.filter(pk=api_key.pk).update(last_used_at=timezone.now())
    return api_key


@transaction.atomic
def api_key_revoke(*, user, key_id: str) -> bool:
    updated = ApiKey.objects.filter(user=user, key_id=key_id, revoked_at__isnull=True).update(revoked_at=timezone.now())
    return updated == 1
