"""Per-user, per-operation rate limits, counted atomically in Postgres across processes.

- Limits over a window shorter than `SLIDING_WINDOW_FROM_S` (per second, per minute) use
  a cheap fixed window: one counter row per window (INSERT ... ON CONFLICT DO UPDATE).
  Up to twice the limit can pass around a window edge, which is fine at that scale.
- Longer ones ("5 per hour") use an exact sliding window: a log of the calls per
  (user, operation), counted over the last `window` seconds under a transaction-level
  advisory lock on the key, so the limit holds in ANY span of that length.

A call counts in every window that applies to it (the user's; a service credential's own)
or in none: all are checked and recorded in one transaction, and a refusal by any of
them rolls back the others' records, so a call refused for one user never spends the
credential's capacity for its other users.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from datetime import UTC, datetime, timedelta

from django.conf import settings
from django.db import IntegrityError, connection, transaction

from core.batched import rows_delete_in_batches
from core.db_errors import is_foreign_key_violation
from core.errors import ErrorCode, ServiceError
from core.metrics import rate_limit_rejection_record
from core.scope import CallContext, MemoryScope
from memories.models import RateEvent, RateWindow

SLIDING_WINDOW_FROM_S = 3600

# Counts the call only while the window has room: no row back means refused, and a
# refused call leaves the count as it was.
_UPSERT = f"""
INSERT INTO {RateWindow._meta.db_table} (user_id, operation, window_seconds, window_start, count)
VALUES (%s, %s, %s, %s, 1)
ON CONFLICT (user_id, operation, window_seconds, window_start)
DO UPDATE SET count = {RateWindow._meta.db_table}.count + 1 WHERE {RateWindow._meta.db_table}.count < %s
RETURNING count
"""  # noqa: S608 - table name from our own model


def clock() -> float:
    """Seconds since the epoch (tests move it to cross window edges)."""
    return time.time()


def _limited(operation: str, limit: int, window: int, retry_after: float) -> ServiceError:
    seconds = max(1, math.ceil(retry_after))
    rate_limit_rejection_record(operation=operation)
    return ServiceError(
        ErrorCode.RATE_LIMITED,
        f"Too many {operation} calls: at most {limit} per {window} s. Retry in {seconds} s.",
        retry_after_s=seconds,
    )


def rate_limit_consume(scope: MemoryScope, *, operation: str) -> None:
    """Count one call; raise `rate_limited` (with retry_after_s) past the limit.

    Counted per subject (the scope's user). When a service credential acts for the user
    (issue 12), also per credential, under its own user and `operation@credential`, at
    `RATE_LIMIT_CREDENTIAL_FACTOR` times the per-user limit: one service key cannot spend
    its tenant's whole capacity. A credential acting for itself is covered by its user's
    own limit, which is lower."""
    limit, window = settings.RATE_LIMITS.get(operation, (0, 60))
    if limit == 0:
        return
    keys = [(scope.user_pk, operation, limit)]
    if scope.credential and scope.credential_user_pk is not None:
        factor = settings.RATE_LIMIT_CREDENTIAL_FACTOR
        keys.insert(0, (scope.credential_user_pk, f"{operation}@{scope.credential}"[:96], limit * factor))
    # One fixed window is one atomic statement. Anything more (a sliding window's
    # count-then-insert, two windows) runs in one transaction (a savepoint when the caller
    # holds one): a refusal raised inside rolls back the windows already counted. Its
    # locks (the fixed window's row, the sliding window's advisory lock) are held to its
    # end, always credential first, then user, so concurrent calls queue, never deadlock.
    single = len(keys) == 1 and window < SLIDING_WINDOW_FROM_S
    try:
        with nullcontext() if single else transaction.atomic():
            for user_pk, key, key_limit in keys:
                _consume(user_pk, operation=key, shown=operation, limit=key_limit, window=window)
    except IntegrityError as exc:
        # The account was deleted after the call authenticated (a staff deletion that
        # committed first, or that this statement's foreign key check waited for): the
        # window's row has no user to refer to. Raised at the statement, or at the commit
        # of the transaction above (Django's foreign keys are deferred); in a caller's
        # transaction, at its commit.
        if not is_foreign_key_violation(exc):
            raise
        raise ServiceError(ErrorCode.UNAUTHENTICATED, "This account no longer exists.") from None


def rate_limit_consume_audited(scope: MemoryScope, *, operation: str, call: CallContext) -> None:
    """rate_limit_consume for a web UI action outside the dispatcher (which audits its own
    refusals): a refusal is audited the same way, then raised."""
    from audit.services import audit_failure

    try:
        rate_limit_consume(scope, operation=operation)
    except ServiceError as error:
        with transaction.atomic():
            audit_failure(scope, call=call, operation=operation, error=error)
        raise


def _consume(user_pk: int, *, operation: str, shown: str, limit: int, window: int) -> None:
    if window >= SLIDING_WINDOW_FROM_S:
        _sliding_consume(user_pk, operation=operation, shown=shown, limit=limit, window=window)
        return
    now = clock()
    start = math.floor(now / window) * window
    with connection.cursor() as cursor:
        cursor.execute(_UPSERT, [user_pk, operation, window, datetime.fromtimestamp(start, UTC), limit])
        counted = cursor.fetchone()
    if counted is None:
        raise _limited(shown, limit, window, start + window - now)


def _sliding_consume(user_pk: int, *, operation: str, shown: str, limit: int, window: int) -> None:
    with connection.cursor() as cursor:
        # Serialises count-then-insert per key across processes; released at commit.
        cursor.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", [f"rate:{user_pk}:{operation}"])
    now = clock()
    at = datetime.fromtimestamp(now, UTC)
    since = at - timedelta(seconds=window)
    log = RateEvent.objects.filter(user_id=user_pk, operation=operation)
    log.filter(at__lte=since).delete()  # aged out: keeps each key's log at most `limit` rows
    recent = list(log.filter(at__gt=since).order_by("at").values_list("at", flat=True)[:limit])
    if len(recent) >= limit:
        # A slot frees up when the oldest call in the window ages out of it.
        raise _limited(shown, limit, window, (recent[0] - since).total_seconds())
    RateEvent.objects.create(user_id=user_pk, operation=operation, at=at)


# Rows deleted per statement by `rate_windows_prune`: short transactions.
RATE_PRUNE_BATCH = 5000


def rate_windows_prune(*, older_than: timedelta = timedelta(days=2)) -> int:
    """Fixed windows and sliding-window calls older than `older_than`; returns how many.
    Both tables take rows per call, so in batches, oldest first: windows from
    rate_window_recent (read backwards), calls from rate_event_at. Not calls in id order:
    ids only roughly follow `at`, which the planner does not know, and the last batch
    would read every call kept to find none."""
    cutoff = datetime.now(UTC) - older_than
    windows = RateWindow.objects.filter(window_start__lt=cutoff)
    deleted = rows_delete_in_batches(windows, order_by="window_start", batch_size=RATE_PRUNE_BATCH)
    events = RateEvent.objects.filter(at__lt=cutoff)
    return deleted + rows_delete_in_batches(events, order_by="at", batch_size=RATE_PRUNE_BATCH)
