"""A memory's life after it is stored: fields, the trash, expiry and recall counters, as
SQL over the engine's table (in the caller's transaction; no mem0 call, no embedding).

Putting a memory in the trash is a state change of its row (a `trash` object in the
payload), not a deletion: the id, the vector and the history stay, so restore is exact.
Only the purge (`engine_delete_row`) removes a row."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import connection
from psycopg import sql

from core.scope import MemoryScope
from memories.engine.history_store import history_rows_add
from memories.engine.payload import (
    KEY_ATTRS,
    KEY_RECALL,
    KEY_TRASH,
    KEY_USER_ID,
    EngineMemory,
    MemoryAttrs,
    engine_memory_from_row,
    engine_timestamp,
)


def _table() -> sql.Identifier:
    return sql.Identifier(settings.MEMORY_COLLECTION)


def _run(statement: sql.Composable, params: list[Any]) -> list[tuple[Any, ...]]:
    with connection.cursor() as cursor:
        cursor.execute(statement.as_string(cursor.connection), params)
        return list(cursor.fetchall()) if cursor.description else []


def _payload(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else json.loads(value)


def engine_set_attrs(scope: MemoryScope, *, memory_id: str, attrs: MemoryAttrs) -> bool:
    """Replace a live memory's fields (no re-embedding: the text is unchanged)."""
    statement = sql.SQL(
        "UPDATE {} SET payload = jsonb_set(payload, %s, %s::jsonb)"
        " WHERE id = %s AND payload->>%s = %s AND NOT payload ? %s RETURNING id"
    ).format(_table())
    rows = _run(
        statement,
        [[KEY_ATTRS], json.dumps(attrs.as_payload()), memory_id, KEY_USER_ID, scope.engine_user_id, KEY_TRASH],
    )
    return bool(rows)


def engine_trash(
    scope: MemoryScope, *, memory_ids: list[str] | None, at: datetime, request_id: str, operation: str
) -> list[str]:
    """Move the scope's memories (all of them when `memory_ids` is None) to the trash.
    Returns the ids moved; ids already in the trash or not the scope's are skipped."""
    state = json.dumps({"at": engine_timestamp(at), "request_id": request_id, "operation": operation})
    clause = sql.SQL("")
    params: list[Any] = [[KEY_TRASH], state, KEY_USER_ID, scope.engine_user_id, KEY_TRASH]
    if memory_ids is not None:
        clause = sql.SQL(" AND id = ANY(%s::uuid[])")
        params.append(memory_ids)
    statement = sql.SQL(
        "UPDATE {} SET payload = jsonb_set(payload, %s, %s::jsonb) WHERE payload->>%s = %s AND NOT payload ? %s{}"
        " RETURNING id, payload->>'data', payload->>'created_at'"
    ).format(_table(), clause)
    rows = _run(statement, params)
    # The memory's history shows the move to the trash (and, on restore, the way back).
    history_rows_add(
        [
            {"memory_id": str(r[0]), "old_memory": r[1], "new_memory": None, "event": "DELETE",
             "created_at": r[2], "updated_at": engine_timestamp(at), "is_deleted": 1}
            for r in rows
        ]
    )  # fmt: skip
    return [str(row[0]) for row in rows]


def engine_restore(
    scope: MemoryScope,
    *,
    memory_ids: list[str] | None = None,
    request_id: str | None = None,
    unexpired_at: datetime | None = None,
) -> list[EngineMemory]:
    """Take the scope's memories out of the trash: by id, or everything one call trashed
    (its request id). Returns them as restored. With `unexpired_at`, memories whose
    expiry has passed by then stay in the trash: restored, they would be invisible to
    every read and deleted by the next purge."""
    if memory_ids is None and request_id is None:
        raise ValueError("restore by memory ids or by request id")
    params: list[Any] = [KEY_TRASH, KEY_USER_ID, scope.engine_user_id, KEY_TRASH]
    which: sql.Composable
    if memory_ids is not None:
        which = sql.SQL("id = ANY(%s::uuid[])")
        params.append(memory_ids)
    else:
        which = sql.SQL("payload->{}->>'request_id' = %s").format(sql.Literal(KEY_TRASH))
        params.append(request_id)
    if unexpired_at is not None:
        # The stored `expires_at` column (vector_schema), as the reads test a live row.
        which = sql.SQL("{} AND (expires_at IS NULL OR expires_at > %s)").format(which)
        params.append(engine_timestamp(unexpired_at))
    statement = sql.SQL(
        "UPDATE {} SET payload = payload - %s WHERE payload->>%s = %s AND payload ? %s AND {} RETURNING id, payload"
    ).format(_table(), which)
    restored = [engine_memory_from_row(row[0], _payload(row[1])) for row in _run(statement, params)]
    history_rows_add(
        [
            {"memory_id": m.id, "old_memory": None, "new_memory": m.text, "event": "RESTORE",
             "created_at": m.created_at, "updated_at": m.updated_at}
            for m in restored
        ]
    )  # fmt: skip
    return restored


def engine_trashed(
    scope: MemoryScope,
    *,
    memory_ids: list[str] | None = None,
    request_id: str | None = None,
    after: tuple[str, str] | None = None,
    before: tuple[str, str] | None = None,
    limit: int = 500,
) -> list[EngineMemory]:
    """The scope's trash, most recently trashed first (id breaking ties); optionally only
    `memory_ids`, only what the call `request_id` trashed, or only what comes after the
    (trashed at, id) position `after` in that order; `before`: what comes before that
    position, the nearest first (so in the opposite order). `trashed` (the generated
    column) and the position's bound on the time alone let the partial index
    (owner, trashed at DESC, id) (vector_schema.create_trash_order_index) find the page."""
    params: list[Any] = [KEY_USER_ID, scope.engine_user_id]
    clause: sql.Composable = sql.SQL("")
    trashed_at = sql.SQL("payload->{}->>'at'").format(sql.Literal(KEY_TRASH))
    order = sql.SQL("{} DESC, id").format(trashed_at)
    if after is not None:
        clause = sql.SQL(" AND {at} <= %s AND ({at} < %s OR id > %s::uuid)").format(at=trashed_at)
        params += [after[0], after[0], after[1]]
    elif before is not None:
        clause = sql.SQL(" AND {at} >= %s AND ({at} > %s OR id < %s::uuid)").format(at=trashed_at)
        params += [before[0], before[0], before[1]]
        order = sql.SQL("{}, id DESC").format(trashed_at)
    if memory_ids is not None:
        clause = sql.SQL("{} AND id = ANY(%s::uuid[])").format(clause)
        params.append(memory_ids)
    if request_id is not None:
        clause = sql.SQL("{} AND payload->{}->>'request_id' = %s").format(clause, sql.Literal(KEY_TRASH))
        params.append(request_id)
    params.append(limit)
    statement = sql.SQL("SELECT id, payload FROM {} WHERE payload->>%s = %s AND trashed{} ORDER BY {} LIMIT %s").format(
        _table(), clause, order
    )
    return [engine_memory_from_row(row[0], _payload(row[1])) for row in _run(statement, params)]


def engine_trash_count(scope: MemoryScope, *, request_id: str | None = None) -> int:
    """How many of the scope's rows are in the trash; with `request_id`, how many that one
    call trashed. Counted over the partial trash order index: the Trash page asks on every
    view, and neither the user's live rows nor the trashed rows themselves are read."""
    params: list[Any] = [KEY_USER_ID, scope.engine_user_id]
    clause: sql.Composable = sql.SQL("")
    if request_id is not None:
        clause = sql.SQL(" AND payload->{}->>'request_id' = %s").format(sql.Literal(KEY_TRASH))
        params.append(request_id)
    statement = sql.SQL("SELECT count(*) FROM {} WHERE payload->>%s = %s AND trashed{}").format(_table(), clause)
    return int(_run(statement, params)[0][0])


def engine_purge_due(*, trashed_before: datetime | None, expired_at: datetime, limit: int) -> list[tuple[str, str]]:
    """(id, owner) of rows due for deletion: in the trash since before `trashed_before`
    (None: no trash is due), or expired at `expired_at`. Any user's: the purge job.
    Row-locked until the caller's transaction ends (rows locked by others are skipped)."""
    params: list[Any] = []
    conditions = []
    if trashed_before is not None:
        conditions.append(sql.SQL("payload->{}->>'at' < %s").format(sql.Literal(KEY_TRASH)))
        params.append(engine_timestamp(trashed_before))
    conditions.append(sql.SQL("payload->{}->>'expires_at' <= %s").format(sql.Literal(KEY_ATTRS)))
    params.append(engine_timestamp(expired_at))
    params.append(limit)
    statement = sql.SQL("SELECT id, payload->>{} FROM {} WHERE {} ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED").format(
        sql.Literal(KEY_USER_ID), _table(), sql.SQL(" OR ").join(conditions)
    )
    return [(str(row[0]), str(row[1])) for row in _run(statement, params)]


def engine_recalls_fold(recalls: dict[str, tuple[int, str]]) -> int:
    """Add recall counts to rows: {memory id: (times returned, last time as engine text)}.
    One statement; ids that no longer exist are skipped."""
    if not recalls:
        return 0
    ids = list(recalls)
    counts = [recalls[i][0] for i in ids]
    stamps = [recalls[i][1] for i in ids]
    recall = sql.Literal(KEY_RECALL)
    statement = sql.SQL(
        "UPDATE {table} t SET payload = jsonb_set(t.payload, ARRAY[{recall}], jsonb_build_object("
        "'count', coalesce((t.payload->{recall}->>'count')::int, 0) + v.n,"
        " 'at', greatest(t.payload->{recall}->>'at', v.at)))"
        " FROM unnest(%s::uuid[], %s::int[], %s::text[]) AS v(id, n, at) WHERE t.id = v.id RETURNING t.id"
    ).format(table=_table(), recall=recall)
    return len(_run(statement, [ids, counts, stamps]))


def engine_default_attrs(schema_editor: Any) -> None:
    """Migration: rows made before the fields existed get the defaults written in, so
    that a filter on the default type finds them."""
    defaults = json.dumps(MemoryAttrs().as_payload())
    statement = sql.SQL(
        "UPDATE {} SET payload = jsonb_set(payload, ARRAY[{}], %s::jsonb)"
        " WHERE jsonb_typeof(payload->{}) IS DISTINCT FROM 'object'"
    ).format(_table(), sql.Literal(KEY_ATTRS), sql.Literal(KEY_ATTRS))
    schema_editor.execute(statement.as_string(schema_editor.connection.connection), [defaults])


def engine_expired_owned(
    scope: MemoryScope, *, at: datetime, containment: dict[str, Any] | None = None, limit: int = 500
) -> list[str]:
    """Ids of the scope's rows (optionally matching `containment`, as `attrs_containment`
    builds it) whose `expires_at` is at or before `at`. Row-locked until the caller's
    transaction ends; rows locked by others are skipped (a concurrent sweep takes them)."""
    params: list[Any] = [KEY_USER_ID, scope.engine_user_id, engine_timestamp(at)]
    clause = sql.SQL("")
    if containment:
        clause = sql.SQL(" AND payload @> %s::jsonb")
        params.append(json.dumps(containment))
    params.append(limit)
    statement = sql.SQL(
        "SELECT id FROM {} WHERE payload->>%s = %s AND payload->{}->>'expires_at' <= %s{}"
        " ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED"
    ).format(_table(), sql.Literal(KEY_ATTRS), clause)
    return [str(row[0]) for row in _run(statement, params)]
