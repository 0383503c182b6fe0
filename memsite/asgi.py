"""ASGI entry point: Django, with every registered MCP toolset mounted at its own
/engines/<id>/mcp path.

The MCP apps need their lifespan run (each SDK session manager starts there, once per
app); this app runs all of them inside the one ASGI lifespan."""

import asyncio
import os
from contextlib import AsyncExitStack

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "memsite.settings")
django_app = get_asgi_application()

from django.conf import settings  # noqa: E402

from memories.interfaces.mcp.registry import TOOLSETS  # noqa: E402 - needs Django set up
from memsite.body_limit import BodyLimitMiddleware, ForeignHostBodyWithheld  # noqa: E402
from memsite.observability import RequestIdASGIMiddleware, RequestIdBoundASGI  # noqa: E402
from memsite.process_start import web_process_start  # noqa: E402
from memsite.threaded_django import ThreadPoolDjangoHandler  # noqa: E402
from memsite.unavailable import BackendUnavailableMiddleware  # noqa: E402
from oauth.provider import oauth_asgi_routes  # noqa: E402

# The memory REST API: sync DRF views, the hot path next to MCP. They run on Django's sync
# middleware chain on a thread pool, one thread hop per request (memsite/threaded_django.py).
# Everything else (web UI, admin, the chat proxy's async streaming view) stays on Django's
# ASGI handler.
REST_PREFIXES = ("/v1/memories", "/v1/memory", "/v1/trash")
# The export streams its file as it is read; Django's ASGI handler reads it in batches on the
# request's own thread, and so its database connection (memories/interfaces/downloads.py).
# The pool would read it on another thread, outside the request's snapshot.
STREAMED_REST_PATHS = ("/v1/memories/export",)


def build_application():
    """A fresh ASGI app (tests build one per event loop: an MCP app's lifespan runs once)."""
    mcp_apps = {toolset.path: toolset.build_app() for toolset in TOOLSETS}
    # The request id is bound in front of Django's handlers too: Django logs a 4xx, and the
    # server its access line, after the middleware chain has returned.
    rest_app = RequestIdBoundASGI(ThreadPoolDjangoHandler(threads=settings.REST_THREADS))
    web_app = RequestIdBoundASGI(django_app)
    # The request id is bound around bearer auth, so its log lines and 401s carry one too.
    routes = {path: RequestIdASGIMiddleware(authed) for path, (_, authed) in mcp_apps.items()}
    # The OAuth endpoints are the MCP SDK's authorization-server handlers (oauth/provider.py).
    routes.update({path: RequestIdASGIMiddleware(app, channel="oauth") for path, app in oauth_asgi_routes().items()})

    async def lifespan(receive, send) -> None:
        message = await receive()  # lifespan.startup
        async with AsyncExitStack() as stack:
            try:
                for app, _ in mcp_apps.values():
                    await stack.enter_async_context(app.router.lifespan_context(app))
            except Exception as exc:
                await send({"type": "lifespan.startup.failed", "message": repr(exc)})
                return
            await asyncio.to_thread(web_process_start)  # engine loaded, start-up heap frozen
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
            if scope["path"].startswith(REST_PREFIXES) and scope["path"].rstrip("/") not in STREAMED_REST_PATHS:
                await rest_app(scope, receive, send)
                return
        await web_app(scope, receive, send)

    # While the database is away every surface answers 503 backend_unavailable with Retry-After;
    # no body over REQUEST_BODY_MAX_BYTES is read (413 payload_too_large).
    # A chunked body is spooled for Django only: the MCP and OAuth apps read it themselves,
    # after their host and credential checks.
    limited = BodyLimitMiddleware(
        application,
        max_bytes=settings.REQUEST_BODY_MAX_BYTES,
        reads_chunked=lambda path: path.rstrip("/") in routes,
    )
    # A foreign Host's body is never read, nor weighed: its 421 (or Django's 400 page) first.
    return BackendUnavailableMiddleware(ForeignHostBodyWithheld(limited))


application = build_application()
