"""Input checks for the Django pages that do not go through the operation dispatcher."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest

from core.errors import ErrorCode
from core.inputs import text_problem

ADMIN_PREFIX = "/admin/"


def _problem(request: HttpRequest) -> str | None:
    for source in (request.GET, request.POST):
        for name, values in source.lists():
            for value in [name, *values]:
                problem = text_problem(value)
                if problem:
                    return f"{ErrorCode.INVALID_ARGUMENT.value}: the parameter {name[:40]!r} {problem}."
    return None


class AdminInputMiddleware:
    """The admin's search box and list filters go straight to the ORM: a NUL there was a
    DataError (500). Answer 400 instead, before any view runs. (Memory operations are
    checked by the dispatcher, where the failure is also audited.)"""

    # Async-capable, so an async view (the chat proxy's stream) runs without a thread hop.
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
        refused = self._refused(request)
        return refused if refused is not None else await self.get_response(request)

    @staticmethod
    def _refused(request: HttpRequest) -> HttpResponse | None:
        if request.path.startswith(ADMIN_PREFIX):
            problem = _problem(request)
            if problem:
                return HttpResponseBadRequest(problem, content_type="text/plain; charset=utf-8")
        return None
