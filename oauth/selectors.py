"""Pure reads of the authorization server."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.utils import timezone

from core.inputs import text_problem
from oauth.models import OAuthAuthorizationRequest, OAuthGrant
from oauth.services import client_host


@dataclass(frozen=True)
class ConnectedApp:
    grant_id: int
    client_name: str
    client_host: str
    verified_by_document: bool
    scopes: list[str]
    resource: str
    created_at: datetime
    last_used_at: datetime | None


def oauth_grants_connected(*, user: Any) -> list[ConnectedApp]:
    """The user's live grants, newest first (another user's never appear)."""
    grants = (
        OAuthGrant.objects.select_related("client")
        .filter(user=user, revoked_at__isnull=True)
        .order_by("-created_at", "-pk")
    )
    return [
        ConnectedApp(
            grant_id=grant.pk,
            client_name=grant.client.client_name or client_host(grant.client),
            client_host=client_host(grant.client),
            verified_by_document=grant.client.kind == "cimd",
            scopes=[scope for scope in grant.scopes if scope != "offline_access"],
            resource=grant.resource,
            created_at=grant.created_at,
            last_used_at=grant.last_used_at,
        )
        for grant in grants
    ]


def oauth_authorization_request_pending(*, request_key: str) -> OAuthAuthorizationRequest | None:
    if text_problem(request_key):  # no key holds one, and Postgres would refuse the lookup
        return None
    return (
        OAuthAuthorizationRequest.objects.select_related("client")
        .filter(request_key=request_key[:64], decided_at__isnull=True, expires_at__gt=timezone.now())
        .first()
    )
