from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework.authentication import BaseAuthentication

from memories.auth import authenticate_bearer
from memories.interfaces.wellknown import public_base_url, www_authenticate


class BearerTokenAuthentication(BaseAuthentication):
    """DRF side of the same bearer check the MCP endpoint uses."""

    def authenticate(self, request):
        principal = authenticate_bearer(request.META.get("HTTP_AUTHORIZATION"))
        if principal is None:
            return None  # -> 401 with authenticate_header below
        return principal.user, principal

    def authenticate_header(self, request):
        presented = bool(request.META.get("HTTP_AUTHORIZATION"))
        return www_authenticate(
            public_base_url(request.scheme, request.get_host()), error="invalid_token" if presented else None
        )


class BearerTokenScheme(OpenApiAuthenticationExtension):
    target_class = "memories.interfaces.rest.auth.BearerTokenAuthentication"
    name = "bearerAuth"

    def get_security_definition(self, auto_schema):
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "A memsite API key (msk_...) or an OIDC access token.",
        }
