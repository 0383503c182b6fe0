"""What a database error says about the request that met it, for every surface's catch-all.

psycopg classes SQLSTATE class 54 ("program limit exceeded": a tsvector over 1 MB, a
statement too complex) as an OperationalError, like a lost connection, but it is the
request's size, not an outage: retrying fails the same way. Surfaces answer it 413
`payload_too_large` (memsite.unavailable for Django and raw ASGI, the MCP tool dispatcher,
the chat proxy's admin API). A database that cannot be reached is answered 503
`backend_unavailable` (`is_backend_unavailable`).
"""

from __future__ import annotations

_PROGRAM_LIMIT_CLASS = "54"
_FOREIGN_KEY_VIOLATION = "23503"
PROGRAM_LIMIT_MESSAGE = "The request is too large for the database to process; send less."


def exception_chain(exc: BaseException | None) -> list[BaseException]:
    """`exc` and the exceptions it was raised from (Django wraps the driver's error)."""
    found: list[BaseException] = []
    while exc is not None and all(exc is not seen for seen in found):
        found.append(exc)
        exc = exc.__cause__ or exc.__context__
    return found


def is_program_limit_exceeded(exc: BaseException | None) -> bool:
    """True when the database refused a statement for exceeding one of its limits
    (SQLSTATE class 54): caused by what the request sent, not by the database's state."""
    return any(str(getattr(e, "sqlstate", "") or "").startswith(_PROGRAM_LIMIT_CLASS) for e in exception_chain(exc))


def is_foreign_key_violation(exc: BaseException | None) -> bool:
    """True when a row was refused for referring to a row that is not there (SQLSTATE
    23503): one deleted, or being deleted, while the statement ran."""
    return any(getattr(e, "sqlstate", None) == _FOREIGN_KEY_VIOLATION for e in exception_chain(exc))


def _unavailable_types() -> tuple[type[BaseException], ...]:
    import django.db
    import psycopg
    import psycopg_pool

    return (
        django.db.OperationalError,
        django.db.InterfaceError,
        psycopg.OperationalError,
        psycopg.InterfaceError,
        psycopg_pool.PoolTimeout,
    )


def is_backend_unavailable(exc: BaseException | None) -> bool:
    """True when `exc`, or an exception it was raised from, says the database is unreachable
    (connection refused or lost, server shutting down, pool exhausted while it reconnects)."""
    if is_program_limit_exceeded(exc):
        return False
    types = _unavailable_types()
    return any(isinstance(e, types) for e in exception_chain(exc))
