"""Per-user, per-operation fixed windows, counted atomically in Postgres."""

from __future__ import annotations

import math
import time
from datetime import UTC, datetime, timedelta

from django.conf import settings
from django.db import connection

from core.errors import ErrorCode, ServiceError
from core.metrics import rate_limit_rejection_record
from core.scope import MemoryScope
from memories.models import RateWindow

_UPSERT = f"""
INSERT INTO {RateWindow._meta.db_table} (user_id, operation, window_seconds, window_start, count)
VALUES (%s, %s, %s, %s, 1)
ON CONFLICT (user_id, operation, window_seconds, window_start)
DO UPDATE SET count = {RateWindow._meta.db_table}.count + 1
RETURNING count
"""  # noqa: S608 - table name from our own model


def rate_limit_consume(scope: MemoryScope, *, operation: str) -> None:
    """Count one call; raise `rate_limited` (with retry_after_s) past the limit."""
    limit, window = settings.RATE_LIMITS.get(operation, (0, 60))
    if limit == 0:
        return
    now = time.time()
    start = math.floor(now / window) * window
    with connection.cursor() as cursor:
        cursor.execute(_UPSERT, [scope.user_pk, operation, window, datetime.fromtimestamp(start, UTC)])
        count = cursor.fetchone()[0]
    if count > limit:
        retry_after = max(1, math.ceil(start + window - now))
        rate_limit_rejection_record(operation=operation)
        raise ServiceError(
            ErrorCode.RATE_LIMITED,
            f"Too many {operation} calls: at most {limit} per {window} s. Retry in {retry_after} s.",
            retry_after_s=retry_after,
        )


def rate_windows_prune(*, older_than: timedelta = timedelta(days=2)) -> int:
    deleted, _ = RateWindow.objects.filter(window_start__lt=datetime.now(UTC) - older_than).delete()
    return deleted
