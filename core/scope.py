"""Whose memories a call may touch. Built only from an authenticated principal."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

DEFAULT_TENANT = "default"


@dataclass(frozen=True, kw_only=True)
class MemoryScope:
    tenant: str
    user_pk: int
    client_app: str | None = None

    @property
    def engine_user_id(self) -> str:
        """The partition key in the engine. Derived, never taken from a client."""
        return f"{self.tenant}:{self.user_pk}"

    @classmethod
    def from_engine_user_id(cls, engine_user_id: str) -> MemoryScope | None:
        """The scope a partition key belongs to (background jobs); None if malformed."""
        tenant, _, pk = engine_user_id.rpartition(":")
        return cls(tenant=tenant, user_pk=int(pk)) if tenant and pk.isdigit() else None

    @classmethod
    def for_user(cls, user: Any, *, client_app: str | None = None) -> MemoryScope:
        if user is None or not user.is_authenticated or user.pk is None:
            raise PermissionError("a MemoryScope needs an authenticated user")
        return cls(tenant=DEFAULT_TENANT, user_pk=user.pk, client_app=client_app)


@dataclass(frozen=True, kw_only=True)
class CallContext:
    """How a call reached us: one per request. `request_id` is the billing idempotency
    key and ties the call's usage event (and later its audit rows) together."""

    channel: str  # a core.choices.Channel value
    request_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    ip: str | None = None
    user_agent: str | None = None
    actor_username: str = ""
    actor_auth: str = ""  # "api_key", "oidc", "session"
    staff_user_id: int | None = None
    staff_username: str = ""
    turn_id: str = ""  # groups one agent turn's memory activity
    started_at: float = field(default_factory=time.monotonic)

    @property
    def changed_by(self) -> str:
        who = f"staff:{self.staff_username}" if self.staff_username else (self.actor_username or "?")
        return f"{who} ({self.channel})"
