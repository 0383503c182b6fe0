from django.contrib import admin
from django.urls import include, path

from memories.interfaces.mcp.registry import TOOLSETS
from memories.interfaces.web.oidc_login import oidc_urlpatterns
from memories.interfaces.wellknown import PROTECTED_RESOURCE_PATH, protected_resource_metadata
from memsite.observability import metrics_view
from memsite.views import healthz
from oauth import views as oauth_views

# A lost database answers 503 backend_unavailable + Retry-After, not 500 (memsite.unavailable).
handler500 = "memsite.unavailable.server_error"

urlpatterns = [
    path("healthz", healthz, name="healthz"),
    path("metrics", metrics_view, name="metrics"),
    path(PROTECTED_RESOURCE_PATH.lstrip("/"), protected_resource_metadata, name="oauth-protected-resource"),
    # RFC 9728 path-suffixed form: each MCP toolset is its own resource (its 401 points here).
    *(
        path(
            PROTECTED_RESOURCE_PATH.lstrip("/") + toolset.path,
            protected_resource_metadata,
            {"resource_path": toolset.path, "resource_name": f"memsite {toolset.id}"},
        )
        for toolset in TOOLSETS
    ),
    path("v1/", include("memories.interfaces.rest.urls")),
    path("admin/", admin.site.urls),
    path("oidc/", include(oidc_urlpatterns())),
    path("", include("memories.interfaces.web.urls")),
    path("v1/", include("proxy.urls")),  # chat proxy (issue 15): /v1/chat/completions, /v1/admin/tokens
    path("", include("proxy.web_urls")),  # its section of the API-key page
    # MCP authorization server (issue 16): RFC 8414 metadata, consent, connected apps.
    path(".well-known/oauth-authorization-server", oauth_views.authorization_server_metadata, name="oauth-as-metadata"),
    path("oauth/", include("oauth.urls")),
]
