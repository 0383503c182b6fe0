"""RFC 9728 protected-resource metadata, and the `WWW-Authenticate` challenge that points
agents to it (MCP and REST answer 401 with it). Each MCP toolset is its own protected
resource: its metadata is at the path-suffixed URL (RFC 9728 §3.1), the root document
describes /engines/memory/mcp."""

from __future__ import annotations

from django.conf import settings
from django.http import HttpRequest, JsonResponse
from django.views.decorators.http import require_GET

PROTECTED_RESOURCE_PATH = "/.well-known/oauth-protected-resource"
MCP_ENGINES_PREFIX = "/engines"


def mcp_path(toolset_id: str) -> str:
    """Where an MCP toolset is served: /engines/<id>/mcp."""
    return f"{MCP_ENGINES_PREFIX}/{toolset_id}/mcp"


MEMORY_MCP_PATH = mcp_path("memory")


def public_base_url(scheme: str, host: str) -> str:
    return settings.PUBLIC_BASE_URL or f"{scheme}://{host}"


def protected_resource_metadata_url(base_url: str, resource_path: str = "") -> str:
    return f"{base_url}{PROTECTED_RESOURCE_PATH}{resource_path}"


# The scopes an MCP client asks for (issue 16): our permissions. The 401 challenge names
# them so a client starting from a bare 401 requests them (MCP authorization, scope selection).
MCP_SCOPES = ("read", "write", "delete")


def www_authenticate(base_url: str, *, error: str | None = "invalid_token", resource_path: str = "") -> str:
    """The 401 challenge; `resource_path` (an MCP toolset's path) points at that resource's
    own metadata, so a client signing in gets a token for the endpoint it called."""
    value = f'Bearer resource_metadata="{protected_resource_metadata_url(base_url, resource_path)}"'
    value += f', scope="{" ".join(MCP_SCOPES)}"'
    if error:
        value += f', error="{error}"'
    return value


@require_GET
def protected_resource_metadata(
    request: HttpRequest, resource_path: str = MEMORY_MCP_PATH, resource_name: str = "memsite memory"
) -> JsonResponse:
    """RFC 9728: where agents learn how to get a token for an MCP endpoint (memsite/urls.py
    serves one per toolset)."""
    base = public_base_url(request.scheme or "http", request.get_host())
    body = {
        "resource": f"{base}{resource_path}",
        "resource_name": resource_name,
        "bearer_methods_supported": ["header"],
        # Our own authorization server (oauth/), or the external OIDC provider when set.
        "authorization_servers": [settings.OIDC_ISSUER] if settings.OIDC_ISSUER else [base],
        "scopes_supported": list(MCP_SCOPES),
        "resource_documentation": f"{base}/v1/schema/",
    }
    return JsonResponse(body)
