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


def _needs_redaction(exc: BaseException, db_types) -> bool:
    """A server-reported error (it has a SQLSTATE) can quote data; a client-side one, such as
    "connection refused", cannot, and its text is what an operator needs in an outage."""
    if not isinstance(exc, db_types):
        return False
    import psycopg

    driver = exc if isinstance(exc, psycopg.Error) else exc.__cause__
    if isinstance(driver, psycopg.Error):
        return driver.sqlstate is not None
    return True


def _redact_chain(te: traceback.TracebackException, exc: BaseException | None, db_types, seen: set[int]) -> bool:
    """Blank the message of each data-quoting database exception in the chain (walking the
    exceptions alongside their TracebackExceptions); True if any was found."""
    found = False
    while te is not None and exc is not None and id(te) not in seen:
        seen.add(id(te))
        if _needs_redaction(exc, db_types):
            sqlstate = getattr(exc, "sqlstate", None) or getattr(exc.__cause__, "sqlstate", None)
            te._str = f"SQLSTATE {sqlstate} {WITHHELD}" if sqlstate else WITHHELD  # type: ignore[attr-defined]  # noqa: SLF001
            found = True
        for member_te, member in zip(te.exceptions or (), getattr(exc, "exceptions", ()) or (), strict=False):
            found |= _redact_chain(member_te, member, db_types, seen)
        if te.__cause__ is not None:
            te, exc = te.__cause__, exc.__cause__
        elif te.__context__ is not None and not te.__suppress_context__:
            te, exc = te.__context__, exc.__context__
        else:
            break
    return found


def _redact_value(value, db_types):
    if isinstance(value, BaseException) and _needs_redaction(value, db_types):
        return f"{type(value).__name__}{WITHHELD}"
    return value


class RedactDatabaseErrors(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        db_types = _db_error_types()
        if record.exc_info and record.exc_info[1] is not None:
            te = traceback.TracebackException(*record.exc_info, compact=True)
            if _redact_chain(te, record.exc_info[1], db_types, set()):
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
