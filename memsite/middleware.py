"""Input checks for the Django pages that do not go through the operation dispatcher, and
the JSON answer to a Host that ALLOWED_HOSTS does not name."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum
from functools import cache
from typing import Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction, sync_to_async
from django.core.exceptions import DisallowedHost
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.template import engines

from core.errors import ErrorCode
from core.hosts import HOST_REFUSED_MESSAGE, HOST_REFUSED_STATUS
from core.inputs import text_problem

ADMIN_PREFIX = "/admin/"
# Checked by their own dispatcher, where a failure is also audited: the REST API and the
# chat proxy (/v1/...: /v1/chat/completions, /v1/admin/tokens) and the MCP toolsets. A
# 400 here would answer in the wrong shape and leave no audit row.
DISPATCHED_PREFIXES = ("/v1/", "/engines/")
# Web pages that check their own parameters: the memory pages hand them to the same
# dispatcher (audited, the error flashed or shown on the page), and the decisions page
# flashes "No such decision." like its siblings. Only their path is checked here. The
# import page (/data/import/) is one of them, so its multipart upload is never parsed
# here: it stays the view's to read, with its own size limit and message.
SELF_CHECKED_PAGE_PREFIXES = ("/memories/", "/trash/", "/data/", "/sessions/", "/decisions/", "/erase/")
# RFC 8414 / RFC 9728 metadata: JSON clients, so OAuth-style JSON errors.
JSON_PREFIXES = ("/.well-known/",)
# The SDK's /oauth/authorize, /token, /register and /revoke never reach Django (memsite/asgi.py
# mounts them beside it): oauth/provider.py checks their input in the same way.


class Surface(Enum):
    ADMIN = "admin"  # text/plain, as the admin's own 400s
    JSON = "json"  # {"error": "invalid_request", ...}
    PAGE = "page"  # an HTML page in the site's layout


@dataclass(frozen=True)
class Refusal:
    status: int
    code: ErrorCode
    message: str


def _surface(path: str) -> tuple[Surface, bool] | None:
    """How a path's refusals are answered and whether its parameters are checked here
    (None: not checked here at all)."""
    if path.startswith(DISPATCHED_PREFIXES):
        return None
    if path.startswith(ADMIN_PREFIX):
        return Surface.ADMIN, True
    if path.startswith(JSON_PREFIXES):
        return Surface.JSON, True
    return Surface.PAGE, not path.startswith(SELF_CHECKED_PAGE_PREFIXES)


def _parameter_problem(sources: Iterable[Any]) -> str | None:
    for source in sources:
        for name, values in source.lists():
            name_problem = text_problem(name)
            if name_problem:
                # The name itself is the bad part: say so without echoing it.
                return f"A parameter name {name_problem}."
            for value in values:
                problem = text_problem(value) if isinstance(value, str) else None
                if problem:
                    return f"The parameter {name[:40]!r} {problem}."
    return None


def _refusal(request: HttpRequest, *, check_parameters: bool) -> Refusal | None:
    problem = text_problem(request.path)
    if problem:
        # No page, key or consent request can have such a name: nothing is there.
        return Refusal(404, ErrorCode.NOT_FOUND, f"Nothing is here: the address {problem}.")
    if not check_parameters:
        return None
    # request.POST is the form of a form post (urlencoded or multipart) and empty for any
    # other body. CsrfViewMiddleware.process_view reads it right after this anyway, so
    # reading it first costs nothing; self-checked pages (the upload) are not read here.
    problem = _parameter_problem((request.GET, request.POST))
    if problem:
        return Refusal(400, ErrorCode.INVALID_ARGUMENT, problem)
    return None


@cache
def _page_template() -> Any:
    """The site's layout (no template file of its own: this module is its only user)."""
    return engines["django"].from_string(
        '{% extends "web/base.html" %}{% block title %}{{ title }}{% endblock %}'
        "{% block content %}<h1>{{ title }}</h1><p>{{ message }}</p>"
        '<p><a href="/">Back to memsite</a></p>{% endblock %}'
    )


def _answer(request: HttpRequest, surface: Surface, refusal: Refusal) -> HttpResponse:
    if surface is Surface.ADMIN:
        body = f"{refusal.code.value}: {refusal.message}"
        return HttpResponse(body, status=refusal.status, content_type="text/plain; charset=utf-8")
    if surface is Surface.JSON:
        error = "invalid_request" if refusal.status == 400 else refusal.code.value
        body_json = {"error": error, "error_description": refusal.message}
        return JsonResponse(body_json, status=refusal.status, headers={"Cache-Control": "no-store"})
    title = "Not found" if refusal.status == 404 else "Bad request"
    context = {"title": title, "message": f"{refusal.code.value}: {refusal.message}"}
    return HttpResponse(_page_template().render(context, request), status=refusal.status)


class _RefusingMiddleware:
    """A middleware that may answer a request itself before the view (`_refused`), in a
    sync or an async chain. Async-capable, so an async view (the chat proxy's stream) runs
    without a thread hop."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Callable[[HttpRequest], Any]) -> None:
        self.get_response = get_response
        if iscoroutinefunction(get_response):
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest) -> Any:
        if iscoroutinefunction(self):
            return self._acall(request)
        refused = self._refused(request)
        return refused if refused is not None else self.get_response(request)

    async def _acall(self, request: HttpRequest) -> Any:
        refused = self._refused(request)  # a subclass whose check does I/O hops threads itself
        return refused if refused is not None else await self.get_response(request)

    def _refused(self, request: HttpRequest) -> HttpResponse | None:
        raise NotImplementedError


class RequestInputMiddleware(_RefusingMiddleware):
    """Invalid text (NUL, C0 controls, lone surrogates) in the path or the GET/POST
    parameters of the admin, the web UI's own pages, the consent and connected-apps pages
    and the OAuth metadata went straight to the ORM: a DataError (500) from Postgres,
    e.g. a key name or id, a consent request key, the admin's search box. Answer in each
    surface's error shape before any view runs: 404 for a path (nothing can be there),
    400 for a parameter. Never quotes the offending text."""

    async def _acall(self, request: HttpRequest) -> Any:
        if _surface(request.path) is None:  # /v1/ and /engines/: no hop on their hot path
            return await self.get_response(request)
        # Reading the body and rendering the page (request.user: the session) are sync.
        refused = await sync_to_async(self._refused)(request)
        return refused if refused is not None else await self.get_response(request)

    def _refused(self, request: HttpRequest) -> HttpResponse | None:
        surface = _surface(request.path)
        if surface is None:
            return None
        kind, check_parameters = surface
        refusal = _refusal(request, check_parameters=check_parameters)
        return None if refusal is None else _answer(request, kind, refusal)


# The JSON surfaces Django serves, by error shape. RFC 8414 / RFC 9728 metadata: OAuth's
# (RFC 6749 §5.2), as the SDK-mounted OAuth endpoints answer. The memory REST API, the chat
# proxy (/v1/...), an /engines/ path no toolset serves and the health check: our coded
# {"error": {"code", "message"}}, as memsite.unavailable answers them.
OAUTH_JSON_PREFIXES = ("/.well-known/",)
CODED_JSON_PREFIXES = ("/v1/", "/engines/", "/healthz")


def _foreign_host_refusal(request: HttpRequest) -> HttpResponse | None:
    """A JSON surface's answer to a Host Django refuses (DisallowedHost), or None."""
    oauth_shaped = request.path.startswith(OAUTH_JSON_PREFIXES)
    if not oauth_shaped and not request.path.startswith(CODED_JSON_PREFIXES):
        return None  # pages and the admin: Django's own 400 page, for a browser
    try:
        request.get_host()
    except DisallowedHost:
        pass
    else:
        return None
    body: dict[str, Any]
    if oauth_shaped:
        body = {"error": "invalid_request", "error_description": HOST_REFUSED_MESSAGE}
    else:
        body = {"error": {"code": ErrorCode.FORBIDDEN.value, "message": HOST_REFUSED_MESSAGE}}
    return JsonResponse(body, status=HOST_REFUSED_STATUS, headers={"Cache-Control": "no-store"})


class ForeignHostMiddleware(_RefusingMiddleware):
    """A Host outside ALLOWED_HOSTS raised DisallowedHost at the first `get_host()`
    (CommonMiddleware) and Django answered its HTML 400 page, also to the agents and OAuth
    clients on the JSON surfaces, which parse JSON. Those get the answer the MCP and OAuth
    apps beside Django give (core/hosts.py): 421, in their own JSON shape, never echoing
    the host. Before every middleware that asks for the host. Its check does no I/O: no
    thread hop on the async chain."""

    def _refused(self, request: HttpRequest) -> HttpResponse | None:
        return _foreign_host_refusal(request)
