"""Django views of the authorization server: RFC 8414 metadata, the consent page and the
"Connected apps" page. Thin callers of oauth.services / oauth.selectors."""

from __future__ import annotations

from urllib.parse import urlsplit

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect, JsonResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from core.calls import call_context_from_request
from core.choices import Channel
from core.errors import ServiceError
from oauth import provider as routes
from oauth.selectors import oauth_authorization_request_pending, oauth_grants_connected
from oauth.services import (
    OFFLINE_ACCESS,
    PERMISSION_SCOPES,
    SCOPES_SUPPORTED,
    client_host,
    oauth_consent_decide,
    oauth_grant_revoke,
)

PERMISSION_TEXT = {
    "read": "Read and search your memories",
    "write": "Add and change memories",
    "delete": "Delete memories (and clear them all)",
}


def _issuer(request: HttpRequest) -> str:
    return routes.issuer_for(request.scheme or "http", request.get_host())


@require_GET
def authorization_server_metadata(request: HttpRequest) -> JsonResponse:
    """RFC 8414, with the MCP additions: client ID metadata documents (public clients,
    auth method none) and `iss` in authorization responses (RFC 9207)."""
    issuer = _issuer(request)
    body = {
        "issuer": issuer,
        "authorization_endpoint": f"{issuer}{routes.AUTHORIZE_PATH}",
        "token_endpoint": f"{issuer}{routes.TOKEN_PATH}",
        "registration_endpoint": f"{issuer}{routes.REGISTER_PATH}",
        "revocation_endpoint": f"{issuer}{routes.REVOKE_PATH}",
        "scopes_supported": list(SCOPES_SUPPORTED),
        "response_types_supported": ["code"],
        "response_modes_supported": ["query"],
        "grant_types_supported": ["authorization_code", "refresh_token"],
        "token_endpoint_auth_methods_supported": ["none", "client_secret_post", "client_secret_basic"],
        "revocation_endpoint_auth_methods_supported": ["none", "client_secret_post", "client_secret_basic"],
        "code_challenge_methods_supported": ["S256"],
        "client_id_metadata_document_supported": True,
        "authorization_response_iss_parameter_supported": True,
        "service_documentation": f"{issuer}/v1/schema/",
    }
    return JsonResponse(body)


@login_required
@require_http_methods(["GET", "POST"])
def consent(request: HttpRequest, request_key: str) -> HttpResponse:
    """The signed-in user sees who asks for what, and grants it, less, or nothing."""
    pending = oauth_authorization_request_pending(request_key=request_key)
    if pending is None:
        return render(request, "oauth/consent_gone.html", status=404)
    if request.method == "POST":
        call = call_context_from_request(request, channel=Channel.UI)
        granted = None if "deny" in request.POST else request.POST.getlist("scope") + [OFFLINE_ACCESS]
        try:
            target = oauth_consent_decide(
                request_key=request_key, user=request.user, granted=granted, issuer=_issuer(request), call=call
            )
        except ServiceError as error:
            messages.error(request, error.message)
            return redirect(request.path)
        # The redirect may use a private-use scheme (cursor://), which Django's redirect refuses.
        response = HttpResponseRedirect(target)
        response.allowed_schemes = [target.split(":", 1)[0]]
        return response
    client = pending.client
    requested = [scope for scope in PERMISSION_SCOPES if scope in pending.scopes]
    # A self-registered client vouches for nothing: show where this answer will go.
    redirect_parts = urlsplit(pending.redirect_uri)
    host = client_host(client) if client.kind == "cimd" else (redirect_parts.hostname or redirect_parts.scheme)
    context = {
        "client_name": client.client_name or host,
        "client_host": host,
        "verified_by_document": client.kind == "cimd",
        "client_id": client.client_id,
        "redirect_uri": pending.redirect_uri,
        "permissions": [(scope, PERMISSION_TEXT[scope]) for scope in requested],
        "offline": OFFLINE_ACCESS in pending.scopes,
    }
    return render(request, "oauth/consent.html", context)


@login_required
@require_GET
def connected_apps(request: HttpRequest) -> HttpResponse:
    apps = oauth_grants_connected(user=request.user)
    return render(request, "oauth/connected_apps.html", {"apps": apps, "permission_text": PERMISSION_TEXT})


@login_required
@require_POST
def connected_app_revoke(request: HttpRequest, grant_id: int) -> HttpResponse:
    call = call_context_from_request(request, channel=Channel.UI)
    try:
        oauth_grant_revoke(user=request.user, grant_id=grant_id, call=call)
    except ServiceError as error:
        return render(request, "oauth/consent_gone.html", {"message": error.message}, status=error.http_status)
    messages.success(request, "App disconnected: its tokens no longer work.")
    return redirect(reverse("oauth-connected-apps"))
