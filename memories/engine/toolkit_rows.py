"""What seed 003's toolkit (issue 14) needs from the engine's table: its memories are
ordinary rows whose tier (`stm`/`ltm`), enrichment status and summary are metadata keys
the toolkit service owns, so every other surface (search, list, trash, bulk forget)
sees them like any memory."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from django.conf import settings
from django.db import connection
from psycopg import sql

from core.scope import MemoryScope
from memories.engine.payload import (
    KEY_ATTRS,
    KEY_ENRICHMENT_CLAIM,
    KEY_TRASH,
    KEY_USER_ID,
    EngineMemory,
    MemoryAttrs,
    engine_memory_from_row,
    engine_timestamp,
)

# The toolkit's metadata keys (clients of the other surfaces may read them).
TIER_KEY = "tier"
ENRICHMENT_KEY = "enrichment_status"
# A worker's lease on a pending candidate while its LLM call runs outside any transaction:
# {"until": engine_timestamp, "token": str}. Another worker skips the row until `until`
# (so a crashed worker's claim lapses); only the holder of `token` applies its result.
ENRICHMENT_CLAIM_KEY = KEY_ENRICHMENT_CLAIM  # the engine payload key the claim lives under


def _table() -> sql.Identifier:
    return sql.Identifier(settings.MEMORY_COLLECTION)


def _rows(statement: sql.Composable, params: list[Any]) -> list[tuple[Any, ...]]:
    with connection.cursor() as cursor:
        cursor.execute(statement.as_string(cursor.connection), params)
        return list(cursor.fetchall()) if cursor.description else []


def engine_enrichment_apply(
    scope: MemoryScope, *, memory_id: str, metadata: dict[str, Any], attrs: MemoryAttrs
) -> bool:
    """Merge `metadata` into a live row's payload, replace its fields and drop the
    enrichment claim (the text, vector and history are unchanged). In the caller's
    transaction; False when the row is gone."""
    statement = sql.SQL(
        "UPDATE {} SET payload = jsonb_set((payload - %s::text) || %s::jsonb, %s, %s::jsonb)"
        " WHERE id = %s AND payload->>%s = %s AND NOT payload ? %s RETURNING id"
    ).format(_table())
    rows = _rows(
        statement,
        [
            ENRICHMENT_CLAIM_KEY,
            json.dumps(metadata),
            [KEY_ATTRS],
            json.dumps(attrs.as_payload()),
            memory_id,
            KEY_USER_ID,
            scope.engine_user_id,
            KEY_TRASH,
        ],
    )
    return bool(rows)


def engine_metadata_merge(*, memory_id: str, metadata: dict[str, Any], drop: Sequence[str] = ()) -> bool:
    """Merge `metadata` into a live row's payload (after removing the `drop` keys), whoever
    owns it (the enrichment job claiming a candidate, or marking one it could not enrich).
    In the caller's transaction; False when gone."""
    statement = sql.SQL(
        "UPDATE {} SET payload = (payload - %s::text[]) || %s::jsonb WHERE id = %s AND NOT payload ? %s RETURNING id"
    )
    return bool(_rows(statement.format(_table()), [list(drop), json.dumps(metadata), memory_id, KEY_TRASH]))


def engine_rows_with_metadata(
    *,
    containment: dict[str, Any],
    memory_ids: list[str] | None = None,
    exclude_ids: list[str] | None = None,
    unclaimed: bool = False,
    limit: int = 100,
) -> list[EngineMemory]:
    """Live rows of any user whose payload contains `containment` (the enrichment job's
    pending candidates), oldest first, row-locked (SKIP LOCKED) for the caller's transaction.
    `exclude_ids`: rows this run already tried (a failed one must not be picked again).
    `unclaimed`: only rows without a live ENRICHMENT_CLAIM_KEY lease (the row lock ends
    with the claiming transaction; the lease is what keeps a second worker off meanwhile)."""
    now = engine_timestamp(datetime.now(UTC))
    clause: sql.Composable = sql.SQL("")
    params: list[Any] = [json.dumps(containment), KEY_TRASH, now]
    if unclaimed:
        clause = sql.SQL(" AND NOT COALESCE(payload->%s->>'until' > %s, false)")
        params.extend([ENRICHMENT_CLAIM_KEY, now])
    if memory_ids is not None:
        clause = clause + sql.SQL(" AND id = ANY(%s::uuid[])")
        params.append(memory_ids)
    if exclude_ids:
        clause = clause + sql.SQL(" AND NOT (id = ANY(%s::uuid[]))")
        params.append(exclude_ids)
    statement = sql.SQL(
        "SELECT id, payload FROM {} WHERE payload @> %s::jsonb AND NOT payload ? %s"
        " AND (expires_at IS NULL OR expires_at > %s){} ORDER BY payload->>'created_at' LIMIT %s"
        " FOR UPDATE SKIP LOCKED"
    ).format(_table(), clause)
    params.append(limit)
    return [
        engine_memory_from_row(r[0], r[1] if isinstance(r[1], dict) else json.loads(r[1]))
        for r in _rows(statement, params)
    ]


def engine_health_counts(scope: MemoryScope, *, enriched_source: str = "") -> dict[str, Any]:
    """Counts over the scope's rows: live total, per tier, per enrichment status (of the
    rows whose `source` is `enriched_source`: the only rows enrichment takes up), per memory
    type, and how many are in the trash."""
    now = engine_timestamp(datetime.now(UTC))
    statement = sql.SQL(
        "SELECT payload ? %s AS trashed, payload->>%s,"
        " CASE WHEN payload->>'source' = %s THEN payload->>%s END,"
        " payload->%s->>'memory_type', count(*)"
        " FROM {} WHERE payload->>%s = %s AND (expires_at IS NULL OR expires_at > %s OR payload ? %s)"
        " GROUP BY 1, 2, 3, 4"
    ).format(_table())
    rows = _rows(
        statement,
        [
            KEY_TRASH,
            TIER_KEY,
            enriched_source,
            ENRICHMENT_KEY,
            KEY_ATTRS,
            KEY_USER_ID,
            scope.engine_user_id,
            now,
            KEY_TRASH,
        ],
    )
    total = trash = 0
    tiers: dict[str, int] = {}
    enrichment: dict[str, int] = {}
    types: dict[str, int] = {}
    for trashed, tier, status, memory_type, count in rows:
        if trashed:
            trash += count
            continue
        total += count
        # A memory without the toolkit's tier (made by another surface, or a tier key of
        # the owner's own) is long-term, as results label it.
        tier = tier if tier in ("stm", "ltm") else "ltm"
        tiers[tier] = tiers.get(tier, 0) + count
        if status:
            enrichment[status] = enrichment.get(status, 0) + count
        types[memory_type or "user"] = types.get(memory_type or "user", 0) + count
    return {"total": total, "tiers": tiers, "enrichment": enrichment, "types": types, "trash": trash}
