"""Tables written per call or per cached answer keep no one-column user index beside an
index that starts with the user (Django's foreign-key `db_index` made one): every new
rate window, cached answer and decision paid for a second index nothing reads (memories
0031, toolkit 0005). The user's rows are still found through the composite index, as a
user's deletion (ON DELETE CASCADE, by user) does."""

from __future__ import annotations

import pytest
from django.db import connection

from memories.models import RateWindow
from memories.toolkit.models import CacheEntry, Decision

pytestmark = pytest.mark.django_db


def _index_columns(table: str) -> dict[str, list[str]]:
    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT i.relname, a.attname
              FROM pg_index x
              JOIN pg_class i ON i.oid = x.indexrelid
              CROSS JOIN LATERAL unnest(x.indkey) WITH ORDINALITY AS k(attnum, n)
              LEFT JOIN pg_attribute a ON a.attrelid = x.indrelid AND a.attnum = k.attnum
             WHERE x.indrelid = %s::regclass
             ORDER BY i.relname, k.n
            """,
            [table],
        )
        found: dict[str, list[str]] = {}
        for name, column in cursor.fetchall():
            found.setdefault(name, []).append(column)
    return found


@pytest.mark.parametrize("model", [RateWindow, CacheEntry, Decision])
def test_no_user_index_is_a_prefix_of_another(model):
    indexes = _index_columns(model._meta.db_table)
    assert any(columns[0] == "user_id" and len(columns) > 1 for columns in indexes.values()), indexes
    for name, columns in indexes.items():
        for other, other_columns in indexes.items():
            if other != name and other_columns[: len(columns)] == columns and columns[0] == "user_id":
                pytest.fail(f"{name} {columns} is a prefix of {other} {other_columns}")
