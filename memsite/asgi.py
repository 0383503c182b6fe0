"""ASGI entry point: Django, with every registered MCP toolset mounted at its own
/engines/<id>/mcp path.

The MCP apps need their lifespan run (each SDK session manager starts there, once per
app); this app runs all of them inside the one ASGI lifespan."""

import os
from contextlib import AsyncExitStack

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "memsite.settings")
django_app = get_asgi_application()

from memories.interfaces.mcp.registry import TOOLSETS  # noqa: E402 - needs Django set up
from memsite.observability import RequestIdASGIMiddleware  # noqa: E402
from memsite.unavailable import BackendUnavailableMiddleware  # noqa: E402
from oauth.provider import oauth_asgi_routes  # noqa: E402


def build_application():
    """A fresh ASGI app (tests build one per event loop: an MCP app's lifespan runs once)."""
    mcp_apps = {toolset.path: toolset.build_app() for toolset in TOOLSETS}
    # The request id is bound around bearer auth, so its log lines and 401s carry one too.
    routes = {path: RequestIdASGIMiddleware(authed) for path, (_, authed) in mcp_apps.items()}
    # The OAuth endpoints are the MCP SDK's authorization-server handlers (oauth/provider.py).
    routes.update({path: RequestIdASGIMiddleware(app) for path, app in oauth_asgi_routes().items()})

    async def lifespan(receive, send) -> None:
        message = await receive()  # lifespan.startup
        async with AsyncExitStack() as stack:
            try:
                for app, _ in mcp_apps.values():
                    await stack.enter_async_context(app.router.lifespan_context(app))
            except Exception as exc:
                await send({"type": "lifespan.startup.failed", "message": repr(exc)})
                return
            await send({"type": "lifespan.startup.complete"})
            message = await receive()  # lifespan.shutdown
        if message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})

    async def application(scope, receive, send):
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] == "http":
            mounted = routes.get(scope["path"].rstrip("/"))
            if mounted is not None:
                await mounted(scope, receive, send)
                return
        await django_app(scope, receive, send)

    # While the database is away every surface answers 503 backend_unavailable with Retry-After.
    return BackendUnavailableMiddleware(application)


application = build_application()
