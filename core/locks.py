"""Postgres advisory locks: serialise work on one memory across threads, processes
and hosts, without holding a transaction open across slow engine calls."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from django.conf import settings
from django.db import OperationalError, connection, transaction

from core.errors import ErrorCode, ServiceError


@contextmanager
def advisory_lock(key: str, *, timeout_s: float | None = None) -> Iterator[None]:
    """Hold a session-level advisory lock on `key`; `conflict` if it stays busy."""
    timeout_ms = int((timeout_s if timeout_s is not None else settings.MEMORY_LOCK_TIMEOUT_S) * 1000)
    try:
        # A short transaction scopes the lock_timeout; the session-level lock outlives it.
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SELECT set_config('lock_timeout', %s, true)", [f"{timeout_ms}ms"])
            cursor.execute("SELECT pg_advisory_lock(hashtextextended(%s, 0))", [key])
    except OperationalError as exc:
        # Only lock_timeout (55P03) means busy; a lost connection is backend_unavailable (503).
        if getattr(exc.__cause__, "sqlstate", None) != "55P03":
            raise
        raise ServiceError(ErrorCode.CONFLICT, "Another change to this memory is in progress; retry.") from None
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_unlock(hashtextextended(%s, 0))", [key])
