"""Whose memories a call may touch. Built only from an authenticated principal."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from core.inputs import digits_int

DEFAULT_TENANT = "default"


@dataclass(frozen=True, kw_only=True)
class MemoryScope:
    tenant: str
    user_pk: int
    client_app: str | None = None
    # Set when a service credential acts for this user (issue 12): the credential's own
    # rate limit is counted too. Never part of the partition key.
    credential: str = ""
    credential_user_pk: int | None = None  # the credential's own user (its counters' owner)

    @property
    def engine_user_id(self) -> str:
        """The partition key in the engine. Derived, never taken from a client."""
        return f"{self.tenant}:{self.user_pk}"

    @classmethod
    def from_engine_user_id(cls, engine_user_id: str) -> MemoryScope | None:
        """The scope a partition key belongs to (background jobs); None if malformed."""
        tenant, _, pk = engine_user_id.rpartition(":")
        user_pk = digits_int(pk)
        return cls(tenant=tenant, user_pk=user_pk) if tenant and user_pk is not None else None

    @classmethod
    def for_user(cls, user: Any, *, client_app: str | None = None, tenant: str | None = None) -> MemoryScope:
        if user is None or not user.is_authenticated or user.pk is None:
            raise PermissionError("a MemoryScope needs an authenticated user")
        return cls(tenant=tenant or user_tenant(user), user_pk=user.pk, client_app=client_app)


def user_tenant(user: Any) -> str:
    """The tenant a user belongs to: its `memories.TenantMembership` (a one-to-one named
    `tenant_membership`, whose key is the tenant's name); a user without one is in the
    default tenant (every user before issue 12, and users created without a tenant)."""
    membership = getattr(user, "tenant_membership", None)  # a missing row raises AttributeError
    return membership.tenant_id if membership is not None else DEFAULT_TENANT


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
    # Issue 12: who really called (the service principal) when it acts for a subject,
    # its role, and the subject it named (`X-Memory-Subject: <tenant>/<username>`).
    actor_user_id: int | None = None
    actor_role: str = ""
    actor_credential: str = ""  # "key:<key id>" or "oidc:<client>": which credential called
    subject: str = ""
    staff_user_id: int | None = None
    staff_username: str = ""
    turn_id: str = ""  # groups one agent turn's memory activity
    # Seed 001's `scope.agent_id`/`session_id` as (key, value) pairs: a call about one
    # memory touches it only when it is that agent's or session's (else `not_found`).
    narrowed_to: tuple[tuple[str, str], ...] = ()
    started_at: float = field(default_factory=time.monotonic)

    @property
    def changed_by(self) -> str:
        who = f"staff:{self.staff_username}" if self.staff_username else (self.actor_username or "?")
        if self.actor_role in ("tenant_admin", "platform") and not self.staff_username:
            # A service acting for the user (issue 12): "support-bot, tenant admin (mcp)".
            who = f"{who}, {self.actor_role.replace('_', ' ')}"
        return f"{who} ({self.channel})"
