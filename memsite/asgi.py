"""ASGI entry point: Django, with the MCP app mounted at /engines/memory/mcp.

The MCP app also owns the lifespan (its session manager needs it)."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "memsite.settings")
django_app = get_asgi_application()

from memories.mcp import build_mcp_app  # noqa: E402 - needs Django set up
from memories.mcp_paths import MCP_PATH  # noqa: E402
from memsite.unavailable import BackendUnavailableMiddleware  # noqa: E402

mcp_app, authenticated_mcp_app = build_mcp_app()


async def _route(scope, receive, send):
    if scope["type"] == "lifespan":
        await mcp_app(scope, receive, send)
    elif scope["type"] == "http" and scope["path"].rstrip("/") == MCP_PATH:
        await authenticated_mcp_app(scope, receive, send)
    else:
        await django_app(scope, receive, send)


# While the database is away every surface answers 503 backend_unavailable with Retry-After.
application = BackendUnavailableMiddleware(_route)
