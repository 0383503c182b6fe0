"""Deleting many rows of a table every call writes to (the retention prunes) in short
statements: one DELETE of them all would hold every row lock, and run, as long as the
backlog is big (a first prune after an upgrade, or after the beat was down)."""

from __future__ import annotations

from django.db.models import Model, QuerySet


def rows_delete_in_batches[M: Model](rows: QuerySet[M], *, order_by: str, batch_size: int) -> int:
    """Delete every row of `rows`, `batch_size` at a time in `order_by` order (pick one an
    index of those rows gives, so no batch sorts the whole set), each batch its own
    SELECT and DELETE: outside a transaction each commits on its own. The DELETE applies
    `rows`' filter again, so a row that stopped matching after its batch was read (a
    state moved on) stays. Returns the number Django's delete() reports (cascaded rows
    included)."""
    deleted = 0
    while True:
        batch = list(rows.order_by(order_by).values_list("pk", flat=True)[:batch_size])
        if not batch:
            return deleted
        deleted += rows.filter(pk__in=batch).delete()[0]
