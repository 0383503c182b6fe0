"""Web UI login through an OIDC provider (mozilla-django-oidc: authorization code flow
with PKCE). Endpoints come from settings or, if unset, from the provider's discovery
document, fetched on first use (never at start-up). Users are created on first login
and share the identity mapping of API access tokens (`sub` -> ExternalIdentity)."""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from functools import lru_cache, wraps

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.http import Http404
from django.urls import URLPattern
from mozilla_django_oidc.auth import OIDCAuthenticationBackend
from mozilla_django_oidc.views import OIDCAuthenticationCallbackView, OIDCAuthenticationRequestView

from core.scope import DEFAULT_TENANT
from memories.models import ExternalIdentity
from memories.oidc import identity_storable, tenant_from_claims, user_for_subject

DISCOVERED = {
    "OIDC_OP_AUTHORIZATION_ENDPOINT": "authorization_endpoint",
    "OIDC_OP_TOKEN_ENDPOINT": "token_endpoint",
    "OIDC_OP_USER_ENDPOINT": "userinfo_endpoint",
    "OIDC_OP_JWKS_ENDPOINT": "jwks_uri",
    "OIDC_OP_LOGOUT_ENDPOINT": "end_session_endpoint",
}


@lru_cache(maxsize=4)
def discovery(issuer: str) -> dict:
    url = issuer.rstrip("/") + "/.well-known/openid-configuration"
    with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310 - the configured issuer
        return json.load(response)


def oidc_setting(attr: str, *default):
    value = getattr(settings, attr, None)
    if value:
        return value
    if attr in DISCOVERED and settings.OIDC_ISSUER:
        found = discovery(settings.OIDC_ISSUER).get(DISCOVERED[attr])
        if found:
            return found
    if default:
        return default[0]
    raise ImproperlyConfigured(f"Setting {attr} not found")


# Not needed: the verified ID token supplies the claims (see get_userinfo).
OPTIONAL = {"OIDC_OP_USER_ENDPOINT": ""}


class DiscoveredSettings:
    @staticmethod
    def get_settings(attr, *args):
        if not args and attr in OPTIONAL:
            args = (OPTIONAL[attr],)
        return oidc_setting(attr, *args)


class MemsiteOIDCBackend(DiscoveredSettings, OIDCAuthenticationBackend):
    def verify_claims(self, claims):
        return bool(claims.get("sub"))

    def get_userinfo(self, access_token, id_token, payload):
        # The ID token's claims are already verified (signature, iss, aud, nonce).
        return payload

    def filter_users_by_claims(self, claims):
        if not identity_storable(settings.OIDC_ISSUER, str(claims["sub"])):
            return self.UserModel.objects.none()  # then create_user refuses it too
        identity = ExternalIdentity.objects.filter(issuer=settings.OIDC_ISSUER, subject=str(claims["sub"]))
        return self.UserModel.objects.filter(external_identities__in=identity)

    def create_user(self, claims):
        # The same tenant rule as access tokens (issue 12); an unknown one: the default.
        tenant = tenant_from_claims(claims) or DEFAULT_TENANT
        return user_for_subject(issuer=settings.OIDC_ISSUER, subject=str(claims["sub"]), claims=claims, tenant=tenant)

    def update_user(self, user, claims):
        return user


class LoginStart(DiscoveredSettings, OIDCAuthenticationRequestView):
    pass


class LoginCallback(DiscoveredSettings, OIDCAuthenticationCallbackView):
    pass


def provider_logout_url(request) -> str:
    """Where /oidc/logout/ sends the browser: the provider's end-session endpoint."""
    endpoint = oidc_setting("OIDC_OP_LOGOUT_ENDPOINT", "")
    if not endpoint:
        return settings.LOGOUT_REDIRECT_URL
    params = {
        "client_id": settings.OIDC_RP_CLIENT_ID,
        "post_logout_redirect_uri": request.build_absolute_uri("/accounts/login/"),
    }
    return f"{endpoint}?{urllib.parse.urlencode(params)}"


def _only_when_enabled(view):
    @wraps(view)
    def wrapped(request, *args, **kwargs):
        if not settings.OIDC_WEB_LOGIN:
            # Without a provider these views can only fail (ImproperlyConfigured, a 500).
            raise Http404("OIDC login is not configured.")
        return view(request, *args, **kwargs)

    return wrapped


def oidc_urlpatterns() -> list[URLPattern]:
    """mozilla-django-oidc's routes (/oidc/...), answering 404 while OIDC login is off
    (checked per request, so settings changed at run time and in tests apply)."""
    from mozilla_django_oidc import urls

    return [
        URLPattern(p.pattern, _only_when_enabled(p.callback), p.default_args, p.name)
        for p in urls.urlpatterns
        if isinstance(p, URLPattern)
    ]
