"""Input checks for the Django pages that do not go through the operation dispatcher."""

from __future__ import annotations

from collections.abc import Callable

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

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if request.path.startswith(ADMIN_PREFIX):
            problem = _problem(request)
            if problem:
                return HttpResponseBadRequest(problem, content_type="text/plain; charset=utf-8")
        return self.get_response(request)
