"""OIDC access tokens (JWT) for agents: signature against the provider's JWKS, then
`iss`, `aud` and expiry. `sub` maps to a local user (created on first sight), `azp`
names the client app."""

from __future__ import annotations

import hashlib
import logging
from functools import lru_cache

import jwt
from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import IntegrityError, transaction

from memories.models import ExternalIdentity

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


def _username_for(issuer: str, subject: str, claims: dict) -> str:
    User = get_user_model()
    preferred = str(claims.get("preferred_username") or "")[:100]
    if preferred and not User.objects.filter(username=preferred).exists():
        return preferred
    return "oidc-" + hashlib.sha256(f"{issuer}|{subject}".encode()).hexdigest()[:24]


def user_for_subject(*, issuer: str, subject: str, claims: dict):
    identity = ExternalIdentity.objects.select_related("user").filter(issuer=issuer, subject=subject).first()
    if identity:
        return identity.user
    User = get_user_model()
    try:
        with transaction.atomic():
            user = User.objects.create_user(
                username=_username_for(issuer, subject, claims), email=str(claims.get("email") or "")[:254]
            )
            ExternalIdentity.objects.create(user=user, issuer=issuer, subject=subject)
            return user
    except IntegrityError:  # a concurrent first request created it
        return ExternalIdentity.objects.select_related("user").get(issuer=issuer, subject=subject).user


def oidc_principal(token: str):
    from memories.auth import Principal

    claims = verify_access_token(token)
    if claims is None:
        return None
    user = user_for_subject(issuer=claims["iss"], subject=str(claims["sub"]), claims=claims)
    if not user.is_active:
        return None
    client_app = claims.get("azp") or claims.get("client_id")
    return Principal(user=user, method="oidc", client_app=str(client_app) if client_app else None)
