"""Keep database error messages out of the logs.

A driver's error text can quote the data of the failing statement (psycopg's `CONTEXT: JSON
data, line 1: ...`, a unique-violation `DETAIL: Key (...)=(...)`), i.e. memory content. This
filter keeps tracebacks but replaces the message of every database exception in them by its
type and SQLSTATE. Attached to the console handler in settings.LOGGING and to Celery's handlers
(memsite.celery), so it covers everything our processes print."""

from __future__ import annotations

import logging
import traceback

WITHHELD = "(message withheld: database errors can quote stored data)"


def _db_error_types() -> tuple[type[BaseException], ...]:
    types: list[type[BaseException]] = []
    try:
        import psycopg

        types.append(psycopg.Error)
    except ImportError:  # pragma: no cover - psycopg is a requirement
        pass
    try:
        import django.db

        types.append(django.db.Error)
    except ImportError:  # pragma: no cover
        pass
    try:
        import sqlalchemy.exc

        types.append(sqlalchemy.exc.DBAPIError)
    except ImportError:  # pragma: no cover
        pass
    return tuple(types)


def _redact_chain(te: traceback.TracebackException, db_types, seen: set[int]) -> bool:
    """Blank the message of each database exception in the chain; True if any was found."""
    found = False
    while te is not None and id(te) not in seen:
        seen.add(id(te))
        exc_type = te.exc_type
        if exc_type is not None and issubclass(exc_type, db_types):
            te._str = WITHHELD  # noqa: SLF001 - the text traceback.format() prints for the message
            found = True
        for group_member in te.exceptions or ():
            found |= _redact_chain(group_member, db_types, seen)
        te = te.__cause__ or te.__context__
    return found


def _redact_value(value, db_types):
    if isinstance(value, BaseException) and isinstance(value, db_types):
        return f"{type(value).__name__}{WITHHELD}"
    return value


class RedactDatabaseErrors(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        db_types = _db_error_types()
        if record.exc_info and record.exc_info[1] is not None:
            te = traceback.TracebackException(*record.exc_info, compact=True)
            if _redact_chain(te, db_types, set()):
                record.exc_text = "".join(te.format()).rstrip("\n")
                record.exc_info = None
        if isinstance(record.args, tuple):
            record.args = tuple(_redact_value(a, db_types) for a in record.args)
        elif isinstance(record.args, dict):
            record.args = {k: _redact_value(v, db_types) for k, v in record.args.items()}
        return True


def add_redaction(logger: logging.Logger) -> None:
    for handler in logger.handlers:
        if not any(isinstance(f, RedactDatabaseErrors) for f in handler.filters):
            handler.addFilter(RedactDatabaseErrors())
