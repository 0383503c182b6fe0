"""OIDC access tokens (JWT) for agents: signature against the provider's JWKS, then
`iss`, `aud` and expiry. `sub` maps to a local user (created on first sight), `azp`
names the client app."""

from __future__ import annotations

import hashlib
import logging
from functools import lru_cache
from typing import Any

import jwt
from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import IntegrityError, transaction

from core.choices import Role
from core.inputs import text_problem
from core.scope import DEFAULT_TENANT, user_tenant
from memories.models import ExternalIdentity, Tenant, TenantMembership
from memories.portability import LABEL_MAX_CHARS
from memories.tenancy import tenant_ensure

logger = logging.getLogger(__name__)
JWKS_TIMEOUT_S = 5


@lru_cache(maxsize=4)
def _jwks_client(jwks_url: str) -> jwt.PyJWKClient:
    return jwt.PyJWKClient(jwks_url, cache_keys=True, lifespan=300, timeout=JWKS_TIMEOUT_S)


@lru_cache(maxsize=4)
def _discovered_jwks_url(issuer: str) -> str:
    import json
    import urllib.request

    url = issuer.rstrip("/") + "/.well-known/openid-configuration"
    with urllib.request.urlopen(url, timeout=JWKS_TIMEOUT_S) as response:  # noqa: S310 - configured issuer
        return json.load(response)["jwks_uri"]


def jwks_url() -> str:
    return settings.OIDC_JWKS_URL or _discovered_jwks_url(settings.OIDC_ISSUER)


def verify_access_token(token: str) -> dict | None:
    """The token's claims if it is valid for us, else None (reason logged, token not)."""
    try:
        signing_key = _jwks_client(jwks_url()).get_signing_key_from_jwt(token)
        return jwt.decode(
            token,
            signing_key.key,
            algorithms=settings.OIDC_ALGORITHMS,
            audience=settings.OIDC_AUDIENCE,
            issuer=settings.OIDC_ISSUER,
            options={"require": ["exp", "iss", "sub"]},
            leeway=30,
        )
    except (jwt.PyJWTError, OSError, KeyError, ValueError) as exc:
        logger.info("rejected an OIDC access token: %s", type(exc).__name__)
        return None


IDENTITY_MAX_CHARS = 255  # ExternalIdentity.issuer and .subject


def _username_for(issuer: str, subject: str, claims: dict) -> str:
    User = get_user_model()
    # As create_user will store it (NFKC): a fullwidth "ａlice" is "alice", maybe taken,
    # and one character may become many ("ﷺ" is 18), past the column.
    preferred = User.normalize_username(str(claims.get("preferred_username") or "")[:100])
    limit = getattr(User._meta.get_field(User.USERNAME_FIELD), "max_length", None) or 150
    if (
        preferred
        and len(preferred) <= limit
        and not text_problem(preferred)
        and not User.objects.filter(username=preferred).exists()
    ):
        return preferred
    return _username_of_identity(issuer, subject)


def _username_of_identity(issuer: str, subject: str) -> str:
    return "oidc-" + hashlib.sha256(f"{issuer}|{subject}".encode()).hexdigest()[:24]


def identity_storable(issuer: str, subject: str) -> bool:
    """An issuer and subject we can keep (within their columns, no NUL)."""
    return not any(len(value) > IDENTITY_MAX_CHARS or text_problem(value) for value in (issuer, subject))


def _email_of(claims: dict) -> str:
    email = str(claims.get("email") or "")[:254]
    return "" if text_problem(email) else email  # a NUL cannot be stored; the email is optional


def user_for_subject(*, issuer: str, subject: str, claims: dict, tenant: str | None = None):
    """The local user of an OIDC subject, created (in `tenant`, default: the default
    tenant) on first sight. None for an issuer or subject we cannot keep (longer than
    its column, or a NUL): the token or login is refused, as any unusable one is."""
    if not identity_storable(issuer, subject):
        logger.info("rejected an OIDC identity: its issuer or subject cannot be stored")
        return None
    identity = ExternalIdentity.objects.select_related("user").filter(issuer=issuer, subject=subject).first()
    if identity:
        return identity.user
    User = get_user_model()
    # The preferred name first; the identity's own if another subject took that name at
    # the same moment (its first sign-in too).
    for username in dict.fromkeys((_username_for(issuer, subject, claims), _username_of_identity(issuer, subject))):
        try:
            with transaction.atomic():
                user = User.objects.create_user(username=username, email=_email_of(claims))
                if tenant is not None:
                    TenantMembership.objects.create(user=user, tenant=tenant_ensure(name=tenant))
                ExternalIdentity.objects.create(user=user, issuer=issuer, subject=subject)
                return user
        except IntegrityError:  # a concurrent first request of this subject created it, or took the name
            identity = ExternalIdentity.objects.select_related("user").filter(issuer=issuer, subject=subject).first()
            if identity:
                return identity.user
    return None


def claim_at(claims: dict, path: str | None) -> Any:
    """A claim by dotted path (`realm_access.roles`), or None."""
    node: Any = claims
    for part in (path or "").split("."):
        if not part or not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


def tenant_from_claims(claims: dict) -> str | None:
    """The tenant an access token names: the configured claim (mapped), or the fixed
    OIDC_TENANT. None when the token names no tenant we know: the token is refused."""
    if not settings.OIDC_TENANT_CLAIM:
        return settings.OIDC_TENANT
    value = claim_at(claims, settings.OIDC_TENANT_CLAIM)
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if not isinstance(value, str) or not value:
        return None
    tenant = settings.OIDC_TENANT_MAP.get(value, value)
    return tenant if Tenant.objects.filter(name=tenant).exists() or tenant == DEFAULT_TENANT else None


def role_from_claims(claims: dict) -> str:
    """The highest role the roles claim grants (a list, or a space-separated string)."""
    value = claim_at(claims, settings.OIDC_ROLES_CLAIM)
    names = set(value.split()) if isinstance(value, str) else {str(v) for v in value or () if isinstance(v, str)}
    if settings.OIDC_ROLE_PLATFORM in names:
        return Role.PLATFORM
    if settings.OIDC_ROLE_TENANT_ADMIN in names:
        return Role.TENANT_ADMIN
    return Role.USER


def oidc_principal(token: str):
    from memories.auth import Principal

    claims = verify_access_token(token)
    if claims is None:
        return None
    tenant = tenant_from_claims(claims)
    if tenant is None:
        logger.info("rejected an OIDC access token: unknown tenant")
        return None
    user = user_for_subject(issuer=claims["iss"], subject=str(claims["sub"]), claims=claims, tenant=tenant)
    if user is None or not user.is_active:
        return None
    if user_tenant(user) != tenant:
        # A user belongs to one tenant (its partition key); a token naming another is refused.
        logger.info("rejected an OIDC access token: tenant differs from the user's")
        return None
    client_app = claims.get("azp") or claims.get("client_id")
    return Principal(
        user=user,
        method="oidc",
        # Cut like OAuth client labels: an export carries it and the import refuses longer ones.
        client_app=str(client_app)[:LABEL_MAX_CHARS] if client_app else None,
        tenant=tenant,
        role=role_from_claims(claims),
        credential=f"oidc:{str(client_app or 'token')[:80]}",
    )
