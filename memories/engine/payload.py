"""mem0's row layout in one place: which payload keys are the engine's own, the memory
data class, and the queries over the engine's table that the rest of the code needs.

Outside this package nobody spells `payload__user_id`, `'data'` or `'created_at'`:
they ask for "a user's rows", "rows created in a range", "client apps"."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from django.db.models import Q, QuerySet
from django.db.models.fields.json import KT

from core.scope import MemoryScope
from memories.models import EngineMemoryRow

KEY_TEXT = "data"
KEY_USER_ID = "user_id"
KEY_CREATED_AT = "created_at"
KEY_UPDATED_AT = "updated_at"
KEY_CLIENT_APP = "client_app"
# The request that made a row through mem0's own writes (ingest): how the reconciler
# finds the rows of a call that crashed before it recorded them.
KEY_REQUEST_ID = "memsite_request_id"
# Keys the engine keeps in a row's payload for itself; the rest is the memory's metadata.
ENGINE_PAYLOAD_KEYS = frozenset(
    {
        KEY_TEXT,
        "hash",
        KEY_CREATED_AT,
        KEY_UPDATED_AT,
        KEY_USER_ID,
        "text_lemmatized",
        "role",
        "actor_id",
        KEY_REQUEST_ID,
    }
)

# Metadata keys a client may not set or filter on: mem0 owns or interprets them.
ENGINE_RESERVED_METADATA_KEYS = ENGINE_PAYLOAD_KEYS | {
    "agent_id", "run_id", "id", "memory", "attributed_to", "expiration_date", "memory_type",
}  # fmt: skip


@dataclass(frozen=True)
class EngineMemory:
    id: str
    text: str
    user_id: str
    metadata: dict[str, Any]
    created_at: str | None
    updated_at: str | None
    score: float | None = None


def engine_memory_from_row(memory_id: Any, payload: dict[str, Any], *, score: float | None = None) -> EngineMemory:
    """A row of the engine's table (read with SQL, not through mem0) as an EngineMemory."""
    return EngineMemory(
        id=str(memory_id),
        text=payload.get(KEY_TEXT, ""),
        user_id=payload.get(KEY_USER_ID, ""),
        metadata={k: v for k, v in payload.items() if k not in ENGINE_PAYLOAD_KEYS},
        created_at=payload.get(KEY_CREATED_AT),
        updated_at=payload.get(KEY_UPDATED_AT),
        score=score,
    )


def engine_memory_from_item(item: dict[str, Any]) -> EngineMemory:
    """A memory as mem0's API returns it (`memory.get`)."""
    return EngineMemory(
        id=str(item["id"]),
        text=item.get("memory", ""),
        user_id=item.get(KEY_USER_ID, ""),
        metadata=dict(item.get("metadata") or {}),
        created_at=item.get(KEY_CREATED_AT),
        updated_at=item.get(KEY_UPDATED_AT),
        score=item.get("score"),
    )


def engine_memory_of(row: EngineMemoryRow) -> EngineMemory:
    return engine_memory_from_row(row.id, row.payload)


# --- queries over the engine's table ------------------------------------------------------
def engine_rows_owned(
    scope: MemoryScope,
    *,
    filters: dict[str, Any] | None = None,
    created_from: str | None = None,
    created_before: str | None = None,
) -> QuerySet[EngineMemoryRow]:
    """The scope's rows (annotated with `created`), optionally filtered on metadata (exact
    match of each key, by containment) and on a creation-time range (ISO-8601 UTC text,
    which compares correctly as text)."""
    rows = EngineMemoryRow.objects.annotate(
        owner=KT(f"payload__{KEY_USER_ID}"), created=KT(f"payload__{KEY_CREATED_AT}")
    ).filter(owner=scope.engine_user_id)
    if filters:
        # JSON containment (payload @> filters), as hybrid search filters: a metadata key
        # named `lt`, `in` or `isnull` is data, never an ORM lookup.
        rows = rows.filter(payload__contains=filters)
    if created_from:
        rows = rows.filter(created__gte=created_from)
    if created_before:
        rows = rows.filter(created__lt=created_before)
    return rows


def engine_memories_page(
    scope: MemoryScope,
    *,
    after: tuple[str, str] | None,
    limit: int,
    filters: dict[str, Any] | None = None,
    created_from: str | None = None,
    created_before: str | None = None,
) -> list[EngineMemory]:
    """Up to `limit` of the scope's memories in creation order (id breaking ties),
    starting after the (created_at, id) position `after`."""
    rows = engine_rows_owned(scope, filters=filters, created_from=created_from, created_before=created_before)
    if after is not None:
        created_at, memory_id = after
        rows = rows.filter(Q(created__gt=created_at) | Q(created=created_at, id__gt=memory_id))
    return [engine_memory_of(row) for row in rows.order_by("created", "id")[:limit]]  # type: ignore[misc]


def engine_memory_count(scope: MemoryScope) -> int:
    return engine_rows_owned(scope).count()


def engine_memory_ids(scope: MemoryScope) -> list[str]:
    return [str(i) for i in engine_rows_owned(scope).values_list("id", flat=True)]


def engine_client_apps(scope: MemoryScope) -> list[str]:
    apps = (
        engine_rows_owned(scope).annotate(app=KT(f"payload__{KEY_CLIENT_APP}")).values_list("app", flat=True).distinct()
    )
    return sorted(a for a in apps if a)


# --- the forensic admin's view of the table ------------------------------------------------
def engine_rows_newest_first(rows: QuerySet[EngineMemoryRow]) -> QuerySet[EngineMemoryRow]:
    return rows.annotate(owner_id=KT(f"payload__{KEY_USER_ID}"), created_at=KT(f"payload__{KEY_CREATED_AT}")).order_by(
        "-created_at"
    )


def engine_rows_matching(rows: QuerySet[EngineMemoryRow], term: str) -> QuerySet[EngineMemoryRow]:
    """`user:<pk>`, a memory id, or words of the text (rows from engine_rows_newest_first)."""
    if term.startswith("user:") and term[5:].isdigit():
        return rows.filter(owner_id__endswith=f":{term[5:]}")  # type: ignore[misc]
    try:
        return rows.filter(id=uuid.UUID(term))
    except ValueError:
        return rows.filter(**{f"payload__{KEY_TEXT}__icontains": term})
