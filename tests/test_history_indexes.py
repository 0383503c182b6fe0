"""The memory history keeps one index for lookups by memory id, (memory_id, recorded_at):
the one-column memory_id indexes Django's `db_index` made (a btree and its
varchar_pattern_ops twin) were prefix duplicates every history write paid for, and
nothing reads through them (audit 0022). Each lookup by memory id is read through the
composite index; the plans are read with sequential and plain index scans priced out,
as in tests/test_admin_list_plans.py, so that no statistics decide them (see _plan)."""

from __future__ import annotations

import uuid

import pytest
from django.db import connection, transaction
from django.db.models import Count, F, Window
from django.db.models.functions import RowNumber

from audit.models import AuditEvent, MemoryHistory

pytestmark = pytest.mark.django_db

HISTORY = MemoryHistory._meta.db_table
COMPOSITE = "audit_memor_memory__49f0b1_idx"  # (memory_id, recorded_at), audit 0001
MEMORY_ID = "2390a61d-7837-4837-bd01-b4bdfbacbfa5"


def _indexes() -> dict[str, list[tuple[str, str]]]:
    """Every index of the history table: its key columns, each with its operator class."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT i.relname, a.attname, opc.opcname
              FROM pg_index x
              JOIN pg_class i ON i.oid = x.indexrelid
              CROSS JOIN LATERAL unnest(x.indkey, x.indclass) WITH ORDINALITY AS k(attnum, opclass, n)
              LEFT JOIN pg_attribute a ON a.attrelid = x.indrelid AND a.attnum = k.attnum
              JOIN pg_opclass opc ON opc.oid = k.opclass
             WHERE x.indrelid = %s::regclass
             ORDER BY i.relname, k.n
            """,
            [HISTORY],
        )
        found: dict[str, list[tuple[str, str]]] = {}
        for name, column, opclass in cursor.fetchall():
            found.setdefault(name, []).append((column, opclass))
    return found


def test_no_history_index_is_a_prefix_of_another():
    indexes = _indexes()
    by_memory = {name for name, keys in indexes.items() if keys[0][0] == "memory_id"}
    assert by_memory == {COMPOSITE}, indexes
    # More generally: no index's leading columns another index starts with too, whatever
    # their operator class (a pattern_ops twin serves equality as well; nothing here
    # matches memory ids by pattern).
    for name, keys in indexes.items():
        columns = [column for column, _ in keys]
        for other, other_keys in indexes.items():
            other_columns = [column for column, _ in other_keys]
            if other != name and other_columns[: len(columns)] == columns and "memory_id" in columns:
                pytest.fail(f"{name} {columns} is a prefix of {other} {other_columns}")


def _plan(sql: str, params: list, *, without: tuple[str, ...] = ()) -> str:
    """EXPLAIN with sequential and plain index scans priced out, and these indexes dropped,
    in a transaction rolled back. A bitmap scan needs an index condition (or a partial
    index's predicate), so every table is read through one: a walk of another index testing
    each row, or a join reading the audit table whole, is no longer a plan that statistics
    could prefer (autovacuum may analyse or vacuum either table while the test runs, and
    `erase` joined the audit rows, whose statistics earlier tests leave)."""
    with transaction.atomic(), connection.cursor() as cursor:
        for index in without:
            cursor.execute(f'DROP INDEX "{index}"')
        cursor.execute("SET LOCAL enable_seqscan = off")
        cursor.execute("SET LOCAL enable_indexscan = off")
        cursor.execute(f"EXPLAIN {sql}", params)
        plan = "\n".join(row[0] for row in cursor.fetchall())
        transaction.set_rollback(True)
    return plan


def _queryset_plan(queryset, *, without: tuple[str, ...] = ()) -> str:
    sql, params = queryset.query.sql_with_params()
    return _plan(sql, list(params), without=without)


@pytest.fixture
def history():
    """Versions of 400 memories of 40 users (some of unknown owner), every event, analysed:
    planned as a table with rows."""
    events = list(MemoryHistory.Event.values)
    MemoryHistory.objects.bulk_create(
        MemoryHistory(
            memory_id=str(uuid.UUID(int=n % 400)),
            event=events[n % len(events)],
            request_id=str(n),
            engine_user_id="" if n % 10 == 0 else f"default:{n % 40}",
        )
        for n in range(4000)
    )
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {HISTORY}")


def test_history_lookups_by_memory_id_read_the_composite_index(history):
    ids = [MEMORY_ID, str(uuid.UUID(int=7))]
    one = MemoryHistory.objects.filter(memory_id=MEMORY_ID)
    many = MemoryHistory.objects.filter(memory_id__in=ids)
    memory = [F("memory_id")]
    plans = {
        # A memory's versions, oldest first: the REST/MCP history, the admin's table, mem0.
        "versions": _queryset_plan(one.order_by("recorded_at", "id")),
        # memory_histories' newest versions per memory (exports).
        "histories": _queryset_plan(
            many.annotate(
                place=Window(RowNumber(), partition_by=memory, order_by=[F("recorded_at").desc(), F("id").desc()]),
                total=Window(Count("id"), partition_by=memory),
            ).order_by("recorded_at", "id")
        ),
        # Maintenance: facts changed or restored by their owner. (The event's index would
        # find those rows too, a question of statistics: dropped for the check.)
        "events": _queryset_plan(
            many.filter(event=MemoryHistory.Event.UPDATE).values("memory_id"), without=("history_event_recent",)
        ),
        # The owner trigger's fallback: the memory's latest attributed version. (The owner
        # index, scanned whole for its predicate `engine_user_id <> ''`, would find them too:
        # dropped for the check.)
        "trigger": _plan(
            f"SELECT engine_user_id FROM {HISTORY} WHERE memory_id = %s AND engine_user_id <> ''"  # noqa: S608
            " ORDER BY recorded_at DESC LIMIT 1",
            [MEMORY_ID],
            without=("history_owner",),
        ),
        # A purge blanks the texts of the memories' versions (history_content_erase).
        "redact": _plan(
            f"UPDATE {HISTORY} SET old_memory = NULL, new_memory = NULL"  # noqa: S608
            " WHERE memory_id = ANY(%s) AND engine_user_id IN (%s, '')",
            [ids, "default:1"],
        ),
        # An erasure's unowned rows among the ids its user's calls name.
        "erase": _plan(
            f"DELETE FROM {HISTORY} WHERE engine_user_id = '' AND memory_id IN ("  # noqa: S608
            f" SELECT unnest(%s::text[]) UNION ALL SELECT ids.id FROM {AuditEvent._meta.db_table} e,"
            " jsonb_array_elements_text(e.memory_ids) AS ids(id) WHERE e.subject_user_id = %s)",
            [ids, 1],
        ),
    }
    for name, plan in plans.items():
        assert COMPOSITE in plan and "Seq Scan" not in plan, (name, plan)
        assert "Index Cond: ((memory_id)::text" in plan, (name, plan)
