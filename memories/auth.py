"""Who is calling: a bearer token (API key or OIDC access token) to a Principal.

The Principal is the only source of a MemoryScope. An OAuth access token (issue 16,
oauth/) resolves to the same Principal as an API key, with the granted scopes as its
permissions. Nothing a client sends in a body
or a header other than `Authorization` selects whose memories are touched."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from django.conf import settings

from core.choices import ALL_PERMISSIONS, Role
from core.inputs import text_problem
from core.scope import CallContext, MemoryScope, user_tenant
from memories.services import api_key_authenticate
from oauth.services import ACCESS_TOKEN_PREFIX as OAUTH_ACCESS_TOKEN_PREFIX
from oauth.services import oauth_access_token_authenticate


@dataclass(frozen=True)
class Principal:
    """Who is calling. `user` is whose memories a call touches. When a service credential
    acts for someone (`X-Memory-Subject`), `user`/`tenant` are the subject's and `actor`
    is the authenticated principal itself; role and permissions stay the credential's."""

    user: Any
    method: Literal["api_key", "oidc", "session", "oauth"]
    client_app: str | None = None
    # Issue 12. `tenant` None: looked up from the user (web sessions).
    tenant: str | None = None
    role: str = Role.USER
    permissions: frozenset[str] = ALL_PERMISSIONS
    credential: str = ""  # "key:<key_id>" or "oidc:<azp>": its own rate limit when delegating
    actor: Principal | None = None

    @property
    def tenant_name(self) -> str:
        return self.tenant or user_tenant(self.user)

    @property
    def acting_user(self) -> Any:
        """The authenticated user (the service account when delegating)."""
        return self.actor.user if self.actor is not None else self.user

    def scope(self) -> MemoryScope:
        return MemoryScope(
            tenant=self.tenant_name,
            user_pk=self._user_pk(),
            client_app=self.client_app,
            credential=self.credential if self.actor is not None else "",
            credential_user_pk=self.actor.user.pk if self.actor is not None else None,
        )

    def _user_pk(self) -> int:
        user = self.user
        if user is None or not user.is_authenticated or user.pk is None:
            raise PermissionError("a MemoryScope needs an authenticated user")
        return int(user.pk)

    def call_attributed(self, call: CallContext) -> CallContext:
        """`call` naming this principal as its actor, as audit rows record it: the
        authenticated user (the service account when delegating), how it authenticated,
        its role and credential."""
        return replace(
            call,
            actor_username=self.acting_user.get_username(),
            actor_auth=self.method,
            actor_user_id=self.acting_user.pk,
            actor_role=self.role,
            actor_credential=self.credential,
        )

    def acting_for(self, subject: Any, *, tenant: str) -> Principal:
        """The same credential acting for `subject` (resolved by `memories.tenancy`)."""
        if subject.pk == self.user.pk:
            return self
        return replace(self, user=subject, tenant=tenant, actor=self)


def bearer_token(authorization: str | None) -> str | None:
    """The token of a `Bearer` header value; None (the caller's invalid-token 401) for
    anything else, including a token holding NUL or other control characters: no key has
    one, and the key id part would reach Postgres, which refuses it (a DataError, 500)."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or len(token) > 8192 or text_problem(token):
        return None
    return token


def principal_of_api_key(api_key: Any) -> Principal:
    """The principal an authenticated API key stands for: its user, tenant, role and
    permissions (every surface that takes keys builds it here, so none forgets one)."""
    return Principal(
        user=api_key.user,
        method="api_key",
        client_app=api_key.name or f"key:{api_key.key_id}",
        tenant=user_tenant(api_key.user),
        role=api_key.role,
        permissions=api_key.permission_set,
        credential=f"key:{api_key.key_id}",
    )


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
        return principal_of_api_key(api_key) if api_key is not None else None
    if settings.OIDC_ISSUER:
        from memories.oidc import oidc_principal

        return oidc_principal(token)
    return None
