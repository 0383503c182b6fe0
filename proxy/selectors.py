"""Pure reads: the effective upstream configuration of a key, memories for a prompt,
the admin's view of a configuration (never the upstream key)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from django.conf import settings
from django.db.models import Q
from django.utils import timezone

from core.scope import MemoryScope
from memories.engine import EngineError, hybrid_search
from memories.models import ApiKey
from memories.schemas import QUERY_MAX_CHARS
from memories.selectors import MemoryView, decayed_score, memory_view
from proxy.crypto import SecretUnreadable, secret_decrypt
from proxy.errors import memory_unavailable, unauthenticated
from proxy.models import TokenConfig

DEFAULT_MEMORY_LIMIT = 5
DEFAULT_SESSION_WINDOW = 20


@dataclass(frozen=True)
class UpstreamConfig:
    """One call's configuration, immutable (seed 004's frozen TokenConfig)."""

    base_url: str
    api_key: str = field(repr=False)
    extra_body: dict[str, Any] = field(default_factory=dict)
    memory_llm: dict[str, Any] = field(default_factory=dict)
    memory_prompt: str = ""
    memory_limit: int = DEFAULT_MEMORY_LIMIT
    session_window_size: int = DEFAULT_SESSION_WINDOW
    source: str = "default"  # "key" (its own row) or "default" (the deployment's)

    @property
    def completions_url(self) -> str:
        return self.base_url.rstrip("/") + "/v1/chat/completions"


def token_config_effective(*, api_key: ApiKey | None) -> UpstreamConfig:
    """The key's own configuration, else the deployment default. An invalid stored
    configuration (empty/zero fields, JSON that is not an object, a secret that does not
    decrypt) or no upstream at all is 401: the token is unusable, nothing falls back."""
    row = TokenConfig.objects.filter(api_key=api_key).first() if api_key is not None else None
    if row is None:
        if not settings.CHAT_UPSTREAM_BASE_URL:
            raise unauthenticated("This key has no chat upstream configured.")
        return UpstreamConfig(base_url=settings.CHAT_UPSTREAM_BASE_URL, api_key=settings.CHAT_UPSTREAM_API_KEY or "")
    try:
        upstream_key = secret_decrypt(row.upstream_api_key_encrypted)
    except SecretUnreadable:
        raise unauthenticated("This key's chat configuration is invalid.") from None
    if (
        not row.upstream_base_url
        or not upstream_key
        # sent as a header: a key saved before save-time checks could fail every call
        or not (upstream_key.isascii() and upstream_key.isprintable())
        or not row.memory_limit
        or not row.session_window_size
        or not isinstance(row.extra_body, dict)
        or not isinstance(row.memory_llm, dict)
    ):
        raise unauthenticated("This key's chat configuration is invalid.")
    return UpstreamConfig(
        base_url=row.upstream_base_url,
        api_key=upstream_key,
        extra_body=dict(row.extra_body),
        memory_llm=dict(row.memory_llm),
        memory_prompt=row.memory_prompt,
        memory_limit=row.memory_limit,
        session_window_size=row.session_window_size,
        source="key",
    )


def chat_memories_find(scope: MemoryScope, *, query: str, limit: int) -> list[MemoryView]:
    """The scope's best memories for the prompt: the same hybrid retrieval and age decay
    as search_memory, but not a billed call of its own (the chat call is). The query is
    the prompt's last QUERY_MAX_CHARS characters, the bound of every other search surface
    (a pasted document would pass PostgreSQL's 1 MB tsvector limit)."""
    query = query[-QUERY_MAX_CHARS:]
    if not query.strip():
        return []
    try:
        candidates = hybrid_search(scope, query=query, limit=min(100, limit * settings.SEARCH_CANDIDATE_FACTOR))
    except EngineError:
        raise memory_unavailable() from None
    now = datetime.now(UTC)
    ranked = sorted(((decayed_score(c, now=now), c) for c in candidates), key=lambda pair: pair[0], reverse=True)
    return [memory_view(item, score=round(score, 6)) for score, item in ranked[:limit]]


def token_config_view(row: TokenConfig) -> dict[str, Any]:
    """What the admin API and the UI show: everything but the upstream key."""
    return {
        "key_id": row.api_key.key_id,
        "user": row.api_key.user.get_username(),
        "upstream_base_url": row.upstream_base_url,
        "upstream_api_key_set": bool(row.upstream_api_key_encrypted),
        "extra_body": row.extra_body,
        "memory_llm": row.memory_llm,
        "memory_prompt": row.memory_prompt,
        "memory_limit": row.memory_limit,
        "session_window_size": row.session_window_size,
        "updated_at": row.updated_at.isoformat(),
    }


def _live_keys(prefix: str = "") -> Q:
    """Keys that still authenticate as far as the key itself says (api_key_authenticate):
    not revoked, not expired. `prefix`: the path to the key from the model filtered."""
    return Q(**{f"{prefix}revoked_at__isnull": True}) & (
        Q(**{f"{prefix}expires_at__isnull": True}) | Q(**{f"{prefix}expires_at__gt": timezone.now()})
    )


def token_admin_key(*, key_id: str, retired_too: bool = False) -> ApiKey | None:
    """The key the admin token API names: a live one (a revoked or expired key never
    authenticates again, so its settings are neither shown nor changed: 404 as an unknown
    key); with `retired_too` (DELETE) any, so its settings can be removed."""
    keys = ApiKey.objects.select_related("user").filter(key_id=key_id)
    return (keys if retired_too else keys.filter(_live_keys())).first()


def token_owner_key(user: Any, *, key_id: str) -> ApiKey | None:
    """One of `user`'s own keys, live or retired, for their settings page (another user's
    key id is None, as a missing one): a retired key's settings can still be removed."""
    return ApiKey.objects.select_related("user").filter(user=user, key_id=key_id).first()


def token_configs_of_live_keys(*, after_id: int | None = None, limit: int | None = None) -> list[TokenConfig]:
    """The configurations the admin API lists: those of live keys, in id order, from
    after `after_id` (a page's cursor), at most `limit`. A revoked or expired key's
    configuration is 404 at /v1/admin/tokens/<key_id> for every method but DELETE (it can
    never be used again), so the list does not offer it either."""
    rows = TokenConfig.objects.filter(_live_keys("api_key__")).select_related("api_key__user")
    if after_id is not None:
        rows = rows.filter(id__gt=after_id)
    rows = rows.order_by("id")
    return list(rows[:limit] if limit is not None else rows)


def token_config_of_key(*, api_key: ApiKey) -> TokenConfig | None:
    return TokenConfig.objects.filter(api_key=api_key).select_related("api_key__user").first()
