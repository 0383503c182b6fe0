"""Postgres advisory locks: serialise work on one memory across threads, processes
and hosts, without holding a transaction open across slow engine calls."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from django.conf import settings
from django.db import OperationalError, connection, transaction

from core.errors import ErrorCode, ServiceError

# A lock wait that timed out is a wait, not a conflict: `resource_busy`, retried after
# this many seconds. Never `conflict`, which tells a client not to retry (a reused id).
LOCK_RETRY_AFTER_S = 1


def lock_busy(message: str) -> ServiceError:
    """The answer to a lock wait that timed out: `resource_busy`, with `retry_after_s`."""
    return ServiceError(ErrorCode.RESOURCE_BUSY, message, retry_after_s=LOCK_RETRY_AFTER_S)


@contextmanager
def advisory_lock(key: str, *, timeout_s: float | None = None) -> Iterator[None]:
    """Hold a session-level advisory lock on `key`; `resource_busy` if it stays busy."""
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
        raise lock_busy("Another change to this memory is in progress; retry.") from None
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_unlock(hashtextextended(%s, 0))", [key])


@contextmanager
def advisory_lock_try(key: str) -> Iterator[bool]:
    """Hold a session-level advisory lock on `key` if it is free, without waiting: yields
    True while held, or False (nothing held) when another session holds it. For work that
    needs no second copy running (a periodic sweep): the caller skips instead of queueing.
    A crashed process's lock goes with its connection."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_lock(hashtextextended(%s, 0))", [key])
        acquired = bool(cursor.fetchone()[0])
    try:
        yield acquired
    finally:
        if acquired:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_advisory_unlock(hashtextextended(%s, 0))", [key])


def advisory_xact_lock(
    *keys: str,
    shared: Iterable[str] = (),
    timeout_s: float | None = None,
    then: tuple[str, Sequence[Any]] | None = None,
) -> tuple[Any, ...] | None:
    """Take transaction-level advisory locks on `keys` (released at commit or rollback);
    `resource_busy` (`lock_busy`) if one stays busy. Call inside `transaction.atomic()`: the locks then
    cover exactly the writes they protect, and a crashed process cannot leak them.

    `shared` keys are taken in shared mode, before the exclusive ones: holders of a shared
    key do not wait for each other, only for a holder of it in exclusive mode (and it for
    them). The user's writers hold its erasure key shared, the erasure exclusive.

    `then` is one more statement (SQL, params) to run once the locks are held, in the same
    round trip; its first row is returned (None without one, or when it has no row)."""
    if not connection.in_atomic_block:
        raise RuntimeError("advisory_xact_lock needs a transaction")
    timeout_ms = int((timeout_s if timeout_s is not None else settings.MEMORY_LOCK_TIMEOUT_S) * 1000)
    try:
        # No savepoint: a timeout fails the whole call, and the caller's atomic rolls back.
        # One round trip: the statements of one simple query run in order inside the
        # transaction, the caller's timeout kept in a transaction-local setting meanwhile.
        # Only the advisory wait is bounded; the rest of the transaction waits as usual.
        # One order everywhere (shared keys first, each group sorted): no deadlocks between
        # callers, as long as every caller takes a shared key before any exclusive one.
        ordered_shared = sorted(set(shared))
        ordered = sorted(set(keys))
        statements = [
            "SELECT set_config('memsite.lock_timeout_outside', current_setting('lock_timeout'), true),"
            " set_config('lock_timeout', %s, true)",
            *["SELECT pg_advisory_xact_lock_shared(hashtextextended(%s, 0))"] * len(ordered_shared),
            *["SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))"] * len(ordered),
            "SELECT set_config('lock_timeout', current_setting('memsite.lock_timeout_outside'), true)",
        ]
        then_sql, then_params = then or ("", ())
        with transaction.atomic(savepoint=False), connection.cursor() as cursor:
            cursor.execute(
                "; ".join([*statements, *([then_sql] if then_sql else [])]),
                [f"{timeout_ms}ms", *ordered_shared, *ordered, *then_params],
            )
            if not then_sql:
                return None
            while cursor.nextset():  # to the last statement's result
                pass
            row = cursor.fetchone()
            return tuple(row) if row is not None else None
    except OperationalError as exc:
        # Only lock_timeout (55P03) means busy; a lost connection is backend_unavailable (503).
        if getattr(exc.__cause__, "sqlstate", None) != "55P03":
            raise
        raise lock_busy(
            "Another change to this memory, or to all your memories (a clear-all or erasure), is in progress; retry."
        ) from None
