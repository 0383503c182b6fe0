"""Who is calling: a bearer token (API key or OIDC access token) to a Principal.

The Principal is the only source of a MemoryScope. An OAuth access token (issue 16,
oauth/) resolves to the same Principal as an API key, with the granted scopes as its
permissions. Nothing a client sends in a body
or a header other than `Authorization` selects whose memories are touched."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from django.conf import settings

from core.scope import MemoryScope
from memories.services import api_key_authenticate
from oauth.services import ACCESS_TOKEN_PREFIX as OAUTH_ACCESS_TOKEN_PREFIX
from oauth.services import oauth_access_token_authenticate

ALL_PERMISSIONS: frozenset[str] = frozenset({"read", "write", "delete"})


@dataclass(frozen=True)
class Principal:
    user: Any
    method: Literal["api_key", "oidc", "session", "oauth"]
    client_app: str | None = None
    # Drawn from {"read", "write", "delete"} (issue 12's contract); OAuth: the granted scopes.
    permissions: frozenset[str] = ALL_PERMISSIONS

    def scope(self) -> MemoryScope:
        return MemoryScope.for_user(self.user, client_app=self.client_app)


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or len(token) > 8192:
        return None
    return token


def authenticate_bearer(authorization: str | None, *, resource: str | None = None) -> Principal | None:
    """Check an `Authorization` header value. Touches the database (and, for OIDC, may
    fetch the provider's JWKS); call from a thread in async code. `resource` is the URL
    the request is for: an OAuth access token is accepted only there (RFC 8707), so
    without it (REST) OAuth tokens are refused."""
    token = bearer_token(authorization)
    if token is None:
        return None
    if token.startswith(OAUTH_ACCESS_TOKEN_PREFIX):
        info = oauth_access_token_authenticate(token=token, resource=resource)
        if info is None:
            return None
        return Principal(
            user=info.user,
            method="oauth",
            client_app=info.client_label,
            permissions=frozenset(info.scopes) & ALL_PERMISSIONS,
        )
    if token.startswith("msk_"):
        api_key = api_key_authenticate(token=token)
        if api_key is None:
            return None
        return Principal(
            user=api_key.user,
            method="api_key",
            client_app=api_key.name or f"key:{api_key.key_id}",
        )
    if settings.OIDC_ISSUER:
        from memories.oidc import oidc_principal

        return oidc_principal(token)
    return None
