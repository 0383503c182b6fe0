"""Django for the memory REST API, with one thread hop per request.

Django's ASGI handler runs an async middleware chain. Django's own middleware
(`MiddlewareMixin`: security, sessions, common, CSRF, auth, messages, clickjacking) then
calls every `process_request`/`process_response`/`process_view` through `sync_to_async`,
the request_started/finished signals hop again, and each request gets a new thread
(`ThreadSensitiveContext`): about sixteen event-loop/thread round trips and a thread start
for one sync DRF view. Measured on the bench machine, that was a sizeable part of the web
process's CPU per REST call (docs/benchmarks.md, "One thread hop per REST call").

This handler keeps Django's request parsing and response sending (`ASGIHandler.read_body`,
`create_request`, `send_response`), but builds the *sync* middleware chain and runs the
whole request (signals, middleware, view, response close) in one call on a fixed pool of
threads: one round trip, no thread start, the same middleware in the same order.

Only sync views belong here: an async view would run through `async_to_sync` in a pool
thread. The chat proxy's streaming view stays on Django's ASGI handler (memsite/asgi.py).
"""

from __future__ import annotations

import asyncio
import contextvars
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from django.core import signals
from django.core.exceptions import RequestAborted
from django.core.handlers import base
from django.core.handlers.asgi import ASGIHandler, get_script_prefix
from django.http import HttpResponseBase
from django.urls import set_script_prefix


class ThreadPoolDjangoHandler(ASGIHandler):
    """An ASGI app serving Django's sync views from a pool of `threads` threads."""

    def __init__(self, *, threads: int) -> None:
        base.BaseHandler.__init__(self)  # not ASGIHandler.__init__: that loads the async chain
        self.load_middleware(is_async=False)
        self._threads = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="django-rest")

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            raise ValueError(f"Django can only handle ASGI/HTTP connections, not {scope['type']}.")
        try:
            body_file = await self.read_body(receive)
        except RequestAborted:
            return
        loop = asyncio.get_running_loop()
        # A context per request, as Django's ASGI handler has: the database connection
        # (an asgiref Local) and the request id live in it, not in the pool thread.
        context = contextvars.copy_context()
        try:
            response = await loop.run_in_executor(self._threads, context.run, self._respond, scope, body_file)
        finally:
            body_file.close()
        try:
            await self.send_response(response, send)
        except asyncio.CancelledError:
            pass  # the client went away while the response was being sent
        finally:
            if response.streaming:  # closed after its content was sent, in the request's context
                await loop.run_in_executor(self._threads, context.run, response.close)

    def _respond(self, scope: dict[str, Any], body_file: Any) -> HttpResponseBase:
        """The whole request on this pool thread: what `WSGIHandler.__call__` does."""
        set_script_prefix(get_script_prefix(scope))
        signals.request_started.send(sender=self.__class__, scope=scope)
        request, error_response = self.create_request(scope, body_file)
        if request is None:  # an undecodable request or a too large body: Django's 400/413
            assert error_response is not None
            response: HttpResponseBase = error_response
        else:
            response = self.get_response(request)
        # Django's handlers set this marker; request_finished's sender reads it.
        response._handler_class = self.__class__  # type: ignore[attr-defined]
        if not response.streaming:
            # Fires request_finished here, on the thread that used the database
            # connection, which returns it to the pool; the content stays in memory.
            response.close()
        return response
