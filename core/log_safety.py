"""Logs never carry memory content (house rule 6), whoever formats them.

Exception messages are where content leaks: a psycopg error's DETAIL and CONTEXT lines
quote the JSON or text it choked on, a vendor error echoes its request body, a KeyError
repeats its key. `ContentSafeFilter` sits on every handler (Django's, uvicorn's, Celery's)
and renders a record's traceback with its frames but without exception messages, except
for exceptions that declare their message safe (`log_safe_message = True`, e.g.
ServiceError, whose messages are written for humans and never hold content). It also
drops query strings from access-log lines (a web UI search is `?q=<words>`), and keeps
only the type name of the exceptions Celery's lines quote as text (a task's "retry: ...",
"raised unexpected: ...").
"""

from __future__ import annotations

import logging
import re
import traceback
from collections.abc import Mapping
from types import TracebackType
from typing import Any

WITHHELD = "[message withheld: it may quote memory content]"
ACCESS_LOGGERS = ("uvicorn.access",)
# Celery's worker and trace loggers (celery.app.trace, celery.worker.request, ...).
CELERY_LOGGERS = ("celery.",)
# `Retry in 1s: DataError('...')` / `Retry at 2026-01-01 ...: DataError('...')` (str(Retry)).
_RETRY = re.compile(r"(Retry (?:in|at) .*?): ([A-Za-z_][\w.]*\(.*)\Z", re.DOTALL)
_RETRY_PLAIN = re.compile(r"Retry (?:in [\d.]+s|at [\dT:.+ -]+)\Z")
_REPR_TYPE = re.compile(r"([A-Za-z_][\w.]*)\(")
_HANDLER_LOGGERS = (
    "", "django", "django.request", "django.server", "uvicorn", "uvicorn.error", "uvicorn.access", "celery",
    "celery.task",
)  # fmt: skip


def _chain(exc: BaseException) -> list[BaseException]:
    """The exception and its causes/contexts, oldest first (as Python prints them)."""
    chain: list[BaseException] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        chain.append(current)
        current = current.__cause__ or (None if current.__suppress_context__ else current.__context__)
    return list(reversed(chain))


def _message_is_safe(exc: BaseException) -> bool:
    """Our own messages written for humans, and a database driver's client-side errors
    (no SQLSTATE: "connection refused", what an operator needs in an outage)."""
    if getattr(exc, "log_safe_message", False):
        return True
    driver = exc if hasattr(exc, "sqlstate") else exc.__cause__
    return (
        driver is not None
        and type(driver).__module__.startswith("psycopg")
        and getattr(driver, "sqlstate", "?") is None
    )


def safe_traceback(exc: BaseException, tb: TracebackType | None = None) -> str:
    """A traceback with every frame and no exception message (unless declared safe)."""
    lines: list[str] = []
    for index, item in enumerate(_chain(exc)):
        if index:
            lines.append("\nThe above exception led to the following exception:\n\n")
        frames = item.__traceback__ if item is not exc or tb is None else tb
        if frames is not None:
            lines.append("Traceback (most recent call last):\n")
            lines.extend(traceback.format_tb(frames))
        kind = type(item)
        name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
        message = str(item) if _message_is_safe(item) else WITHHELD
        lines.append(f"{name}: {message}\n")
    return "".join(lines).rstrip("\n")


def make_content_safe(record: logging.LogRecord) -> logging.LogRecord:
    """Pre-render a record's traceback without messages and strip access-log query
    strings. Idempotent."""
    if getattr(record, "_content_safe", False):
        return record
    exc = record.exc_info[1] if record.exc_info else None
    if record.exc_info and record.exc_info[1] is not None:
        # Formatters use a pre-set exc_text instead of formatting exc_info themselves.
        record.exc_text = safe_traceback(record.exc_info[1], record.exc_info[2])
        # Handlers and filters that would format exc_info themselves see only exc_text.
        record.exc_info = None
    if record.name in ACCESS_LOGGERS and isinstance(record.args, tuple):
        record.args = tuple(_without_query(a) if i == 2 else a for i, a in enumerate(record.args))
    if record.name.startswith(CELERY_LOGGERS):
        _celery_args_safe(record, exc)
    record._content_safe = True
    return record


class ContentSafeFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        make_content_safe(record)
        return True


class _SafeText(str):
    """Stands in for an exception in a record's arguments: `%r` prints it as `%s` does."""

    __slots__ = ()

    def __repr__(self) -> str:
        return str(self)


def _exception_line(exc: BaseException) -> str:
    name = type(exc).__name__
    return _SafeText(f"{name}({str(exc)!r})" if _message_is_safe(exc) else f"{name}({WITHHELD})")


def _repr_withheld(text: Any) -> str:
    """`DataError('... CONTEXT: JSON data ...')` (Celery's safe_repr of the exception): its
    type name only, as tracebacks show it."""
    match = _REPR_TYPE.match(text) if isinstance(text, str) else None
    return f"{match.group(1)}({WITHHELD})" if match else WITHHELD


def _celery_args_safe(record: logging.LogRecord, exc: BaseException | None) -> None:
    """Celery hands the exception to its log lines as text, not as the exception: the
    trace logger's `%(exc)s` is `safe_repr(exc)` ("raised unexpected", "failed") or
    `str(Retry)` ("retry: Retry in 1s: DataError('...')"), and its `data` extra repeats
    that and the whole traceback with messages. Such text can quote stored data (a driver's
    CONTEXT line), so only the exception's type name is kept; the worker's other lines
    (`'Task handler raised error: %r', exc`) pass the exception object itself."""
    args = record.args
    if isinstance(args, Mapping) and "exc" in args:
        text = args["exc"]
        if exc is not None:
            safe = _exception_line(exc)
        elif isinstance(text, str) and (retry := _RETRY.match(text)):
            safe = f"{retry.group(1)}: {_repr_withheld(retry.group(2))}"
        elif isinstance(text, str) and _RETRY_PLAIN.match(text):
            safe = text  # a retry without an exception: only its delay
        else:
            safe = _repr_withheld(text)
        record.args = {**args, "exc": safe}
        data = getattr(record, "data", None)
        if isinstance(data, Mapping):
            record.data = {
                **data,
                "exc": safe,
                **({"traceback": record.exc_text or WITHHELD} if "traceback" in data else {}),
            }
    elif isinstance(args, tuple):
        record.args = tuple(_exception_line(a) if isinstance(a, BaseException) else a for a in args)


def _without_query(value: Any) -> Any:
    # uvicorn: '%s - "%s %s HTTP/%s" %d' with (client, method, path_with_query, version, status).
    return value.split("?", 1)[0] + ("?…" if "?" in value else "") if isinstance(value, str) else value


def install_content_filter() -> None:
    """Put the filter on every handler of the loggers that print (idempotent). Call after
    logging is configured (Django's LOGGING, uvicorn's and Celery's own set-up)."""
    for name in _HANDLER_LOGGERS:
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, ContentSafeFilter) for f in handler.filters):
                handler.addFilter(ContentSafeFilter())
