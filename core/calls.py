"""One builder from an incoming request to the CallContext its audit row and usage event
carry: Django requests (REST, web UI, admin) and Starlette/ASGI requests (MCP) alike."""

from __future__ import annotations

from typing import Any

from core.choices import Channel
from core.inputs import text_storable
from core.request_ids import request_id_claim
from core.scope import CallContext

USER_AGENT_MAX_CHARS = 300
# An agent's turn: the header groups the call's audit rows as turn events.
TURN_ID_HEADER = "X-Turn-Id"
TURN_ID_MAX_CHARS = 128
# A tenant_admin or platform credential names whose memories it acts on (issue 12).
SUBJECT_HEADER = "X-Memory-Subject"
SUBJECT_MAX_CHARS = 300
# Reserved for the turn lifecycle (not read yet).
REQUEST_ID_HEADER = "X-Request-Id"


def _turn_id_of(request: Any) -> str:
    """The X-Turn-Id header of a Django or Starlette request ('' when absent)."""
    headers = getattr(request, "headers", None) or {}
    value = headers.get(TURN_ID_HEADER) or ""
    return text_storable(value.strip()[:TURN_ID_MAX_CHARS]) if isinstance(value, str) else ""


def _subject_of(request: Any) -> str:
    """The X-Memory-Subject header ('' when absent). Only a claim: the dispatcher checks it
    against the principal's role; it never selects anything by itself."""
    headers = getattr(request, "headers", None) or {}
    value = headers.get(SUBJECT_HEADER) or ""
    return text_storable(value.strip()[:SUBJECT_MAX_CHARS]) if isinstance(value, str) else ""


def subject_claim_of(claimed: dict[str, Any] | None, *, tenant: str, username: str) -> str:
    """Seed 001's `scope.tenant_id`/`scope.user_id` claim as `<tenant>/<username>`, the
    caller's own `tenant`/`username` filling a part it leaves out; '' when it names
    neither. Recorded like the X-Memory-Subject header, so a refused claim names whom it
    claimed; never checked or resolved from here."""
    if not claimed:
        return ""
    claimed_tenant, claimed_user = claimed.get("tenant_id"), claimed.get("user_id")
    if not isinstance(claimed_tenant, str) and not isinstance(claimed_user, str):
        return ""
    tenant = claimed_tenant if isinstance(claimed_tenant, str) else tenant
    username = claimed_user if isinstance(claimed_user, str) else username
    return text_storable(f"{tenant}/{username}"[:SUBJECT_MAX_CHARS])


def _client_of(request: Any) -> tuple[str | None, str]:
    """(ip, user agent) of a Django HttpRequest / DRF Request or a Starlette Request."""
    meta = getattr(request, "META", None)
    if meta is not None:  # Django (DRF proxies META too)
        return meta.get("REMOTE_ADDR"), meta.get("HTTP_USER_AGENT", "") or ""
    client = getattr(request, "client", None)
    headers = getattr(request, "headers", None) or {}
    return (client.host if client else None), headers.get("user-agent") or ""


def call_context_from_request(request: Any, *, channel: Channel, staff: bool = False) -> CallContext:
    """The call context of one request. `staff=True` records the signed-in staff user
    as the actor (admin actions)."""
    ip, user_agent = (None, "") if request is None else _client_of(request)
    # Headers reach the audit row as they came: uvicorn refuses control characters in
    # them, other servers and in-process clients may not, and Postgres refuses NUL.
    user_agent = text_storable(user_agent)
    extra: dict[str, Any] = {}
    turn_id = "" if request is None else _turn_id_of(request)
    if turn_id:
        extra["turn_id"] = turn_id
    subject = "" if request is None else _subject_of(request)
    if subject:
        extra["subject"] = subject
    if staff:
        extra = {"staff_user_id": request.user.pk, "staff_username": request.user.get_username()}
    return CallContext(
        channel=channel,
        request_id=request_id_claim(),  # the id the request's log lines and X-Request-Id carry
        ip=ip,
        user_agent=user_agent[:USER_AGENT_MAX_CHARS],
        **extra,
    )
