from django.conf import settings
from django.http import JsonResponse
from django.views.decorators.http import require_GET

from memories.auth import public_base_url
from memories.mcp_paths import MCP_PATH


@require_GET
def protected_resource_metadata(request):
    """RFC 9728: where agents learn how to get a token for the MCP endpoint."""
    base = public_base_url(request.scheme, request.get_host())
    body = {
        "resource": f"{base}{MCP_PATH}",
        "resource_name": "memsite memory",
        "bearer_methods_supported": ["header"],
        "authorization_servers": [settings.OIDC_ISSUER] if settings.OIDC_ISSUER else [],
        "resource_documentation": f"{base}/v1/schema/",
    }
    return JsonResponse(body)
