"""Deleting many rows of a table every call writes to (the retention prunes) in short
statements: one DELETE of them all would hold every row lock, and run, as long as the
backlog is big (a first prune after an upgrade, or after the beat was down)."""

from __future__ import annotations

from django.db import transaction
from django.db.models import Model, QuerySet


def rows_delete_in_batches[M: Model](rows: QuerySet[M], *, order_by: str, batch_size: int) -> int:
    """Delete every row of `rows` no other transaction holds, `batch_size` at a time in
    `order_by` order (pick one an index of those rows gives, so no batch sorts the whole
    set), each batch its own transaction: a SELECT locking the rows it can at once (FOR
    UPDATE SKIP LOCKED) and a DELETE of them. A prune never waits for a row: the user's
    own multi-row deletes (an erasure, store_cache's eviction) lock theirs in their plan's
    order, and a prune's DELETE waiting for one while holding another deadlocked with them.
    A row skipped is being deleted by its holder or, if the holder lets it go, still
    matches `rows` for the next run. The DELETE applies `rows`' filter again (belt and
    braces: the locked rows cannot change). Returns the number Django's delete() reports
    (cascaded rows included)."""
    deleted = 0
    while True:
        with transaction.atomic():
            locked = rows.order_by(order_by).select_for_update(skip_locked=True, of=("self",))
            batch = list(locked.values_list("pk", flat=True)[:batch_size])
            if not batch:
                return deleted
            deleted += rows.filter(pk__in=batch).delete()[0]
