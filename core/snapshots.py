"""One consistent view of the database for a read that spans many statements (a streamed
download): every statement in the block sees the data as of the block's first one."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from django.db import connection, transaction


@contextmanager
def read_only_snapshot() -> Iterator[None]:
    """A read-only REPEATABLE READ transaction around the block. Inside a caller's
    transaction the block runs in that one (its isolation is the caller's choice). The
    connection is the calling thread's: writes by other requests, on their own
    connections, are not seen until the block ends."""
    snapshot = not connection.in_atomic_block
    with transaction.atomic():
        if snapshot:
            with connection.cursor() as cursor:
                cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        yield
