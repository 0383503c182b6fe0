"""mem0's row layout in one place: which payload keys are the engine's own, the memory
data class, and the queries over the engine's table that the rest of the code needs.

Outside this package nobody spells `payload__user_id`, `'data'` or `'created_at'`:
they ask for "a user's rows", "rows created in a range", "client apps"."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from django.db.models import BooleanField, Q, QuerySet
from django.db.models.expressions import RawSQL
from django.db.models.fields.json import KT, KeyTransform

from core.scope import MemoryScope
from memories.models import EngineMemoryRow

KEY_TEXT = "data"
KEY_USER_ID = "user_id"
KEY_CREATED_AT = "created_at"
KEY_UPDATED_AT = "updated_at"
KEY_CLIENT_APP = "client_app"
# Our own typed fields (issue 11), one nested object so they never meet a client's
# metadata key or a key mem0 interprets (it promotes `agent_id`, strips it on update).
KEY_ATTRS = "attrs"
# Trash state: present only while the memory is in the trash ({at, request_id, operation}).
KEY_TRASH = "trash"
# Recall counters, folded in from audit rows by a job ({count, at}); never on search's path.
KEY_RECALL = "recall"
# A toolkit enrichment worker's lease on a candidate ({until, token}; toolkit_rows'
# ENRICHMENT_CLAIM_KEY is this key). The engine's, not the memory's metadata: a lease of
# this database means nothing in an export, is no label of the user's, and must not take
# a place of the user's metadata budget while it lasts.
KEY_ENRICHMENT_CLAIM = "enrichment_claim"
OWN_PAYLOAD_KEYS = frozenset({KEY_ATTRS, KEY_TRASH, KEY_RECALL, KEY_ENRICHMENT_CLAIM})
# The request that made a row through mem0's own writes (ingest): how the reconciler
# finds the rows of a call that crashed before it recorded them.
KEY_REQUEST_ID = "memsite_request_id"
# mem0's lemmas of the text, for its own keyword search (`Memory.search`, which the engine
# never calls; retrieval.py searches the `fts` column). Rows stored before migration 0022
# and rows mem0's LLM ingest stores carry them; nothing reads them.
LEGACY_LEMMAS_KEY = "text_lemmatized"
# Keys the engine keeps in a row's payload for itself; the rest is the memory's metadata.
ENGINE_PAYLOAD_KEYS = frozenset(
    {
        KEY_TEXT,
        "hash",
        KEY_CREATED_AT,
        KEY_UPDATED_AT,
        KEY_USER_ID,
        LEGACY_LEMMAS_KEY,
        "role",
        "actor_id",
        KEY_REQUEST_ID,
    }
)

# Metadata keys a client may not set or filter on: mem0 owns or interprets them.
ENGINE_RESERVED_METADATA_KEYS = ENGINE_PAYLOAD_KEYS | OWN_PAYLOAD_KEYS | {
    "agent_id", "run_id", "id", "memory", "attributed_to", "expiration_date", "memory_type",
}  # fmt: skip


DEFAULT_MEMORY_TYPE = "user"
DEFAULT_IMPORTANCE = 0.5


def engine_timestamp(when: datetime) -> str:
    """The one text form of an instant in the engine's rows (UTC, microseconds), so that
    instants compare correctly as text in SQL, like mem0's own created_at."""
    return when.astimezone(UTC).isoformat(timespec="microseconds")


@dataclass(frozen=True)
class MemoryAttrs:
    """A memory's typed fields. Absent ones read as the defaults (migration 0006 also
    writes the defaults into rows made before these fields existed)."""

    memory_type: str = DEFAULT_MEMORY_TYPE
    tags: tuple[str, ...] = ()
    importance: float = DEFAULT_IMPORTANCE
    agent_id: str | None = None
    session_id: str | None = None
    expires_at: str | None = None  # engine_timestamp text
    why_stored: str | None = None

    def as_payload(self) -> dict[str, Any]:
        data: dict[str, Any] = {"memory_type": self.memory_type, "tags": list(self.tags), "importance": self.importance}
        for key in ("agent_id", "session_id", "expires_at", "why_stored"):
            if getattr(self, key) is not None:
                data[key] = getattr(self, key)
        return data


def attrs_from_payload(value: Any) -> MemoryAttrs:
    if not isinstance(value, dict):
        return MemoryAttrs()
    tags = value.get("tags")
    importance = value.get("importance")
    return MemoryAttrs(
        memory_type=str(value.get("memory_type") or DEFAULT_MEMORY_TYPE),
        tags=tuple(str(t) for t in tags) if isinstance(tags, list) else (),
        importance=float(importance) if isinstance(importance, int | float) else DEFAULT_IMPORTANCE,
        agent_id=value.get("agent_id"),
        session_id=value.get("session_id"),
        expires_at=value.get("expires_at"),
        why_stored=value.get("why_stored"),
    )


def attrs_containment(
    *,
    memory_type: str | None = None,
    tags: list[str] | tuple[str, ...] | None = None,
    agent_id: str | None = None,
    session_id: str | None = None,
) -> dict[str, Any]:
    """A `payload @> ...` object selecting rows with these field values (tags: all must
    be present). Empty when nothing is asked for."""
    wanted: dict[str, Any] = {}
    if memory_type is not None:
        wanted["memory_type"] = memory_type
    if tags:
        wanted["tags"] = list(tags)
    if agent_id is not None:
        wanted["agent_id"] = agent_id
    if session_id is not None:
        wanted["session_id"] = session_id
    return {KEY_ATTRS: wanted} if wanted else {}


def attrs_condition(containment: dict[str, Any]) -> Q:
    """`containment` (`attrs_containment`) as a condition on rows of `engine_rows_owned`,
    for a filtered aggregate: several counts over one scan instead of one query each."""
    return Q(payload__contains=containment)


@dataclass(frozen=True)
class TrashState:
    at: str
    request_id: str
    operation: str


@dataclass(frozen=True)
class EngineMemory:
    id: str
    text: str
    user_id: str
    metadata: dict[str, Any]
    created_at: str | None
    updated_at: str | None
    score: float | None = None
    attrs: MemoryAttrs = field(default_factory=MemoryAttrs)
    last_recalled_at: str | None = None
    access_count: int = 0
    trash: TrashState | None = None
    enrichment_claim: dict[str, Any] | None = None

    def expired(self, now: datetime) -> bool:
        return self.attrs.expires_at is not None and self.attrs.expires_at <= engine_timestamp(now)


def _own_fields(payload: dict[str, Any]) -> dict[str, Any]:
    raw_recall = payload.get(KEY_RECALL)
    recall: dict[str, Any] = raw_recall if isinstance(raw_recall, dict) else {}
    trash = payload.get(KEY_TRASH)
    claim = payload.get(KEY_ENRICHMENT_CLAIM)
    return {
        "attrs": attrs_from_payload(payload.get(KEY_ATTRS)),
        "last_recalled_at": recall.get("at"),
        "access_count": int(recall.get("count") or 0),
        "trash": TrashState(
            at=str(trash.get("at", "")),
            request_id=str(trash.get("request_id", "")),
            operation=str(trash.get("operation", "")),
        )
        if isinstance(trash, dict)
        else None,
        "enrichment_claim": claim if isinstance(claim, dict) else None,
    }


def engine_memory_from_row(memory_id: Any, payload: dict[str, Any], *, score: float | None = None) -> EngineMemory:
    """A row of the engine's table (read with SQL, not through mem0) as an EngineMemory."""
    return EngineMemory(
        id=str(memory_id),
        text=payload.get(KEY_TEXT, ""),
        user_id=payload.get(KEY_USER_ID, ""),
        metadata={k: v for k, v in payload.items() if k not in ENGINE_PAYLOAD_KEYS and k not in OWN_PAYLOAD_KEYS},
        created_at=payload.get(KEY_CREATED_AT),
        updated_at=payload.get(KEY_UPDATED_AT),
        score=score,
        **_own_fields(payload),
    )


def engine_memory_from_item(item: dict[str, Any]) -> EngineMemory:
    """A memory as mem0's API returns it (`memory.get`)."""
    extra = dict(item.get("metadata") or {})
    return EngineMemory(
        id=str(item["id"]),
        text=item.get("memory", ""),
        user_id=item.get(KEY_USER_ID, ""),
        metadata={k: v for k, v in extra.items() if k not in OWN_PAYLOAD_KEYS},
        created_at=item.get(KEY_CREATED_AT),
        updated_at=item.get(KEY_UPDATED_AT),
        score=item.get("score"),
        **_own_fields(extra),
    )


def engine_memory_of(row: EngineMemoryRow) -> EngineMemory:
    return engine_memory_from_row(row.id, row.payload)


# --- queries over the engine's table ------------------------------------------------------
def _rows_of(scope: MemoryScope) -> QuerySet[EngineMemoryRow]:
    return EngineMemoryRow.objects.annotate(
        owner=KT(f"payload__{KEY_USER_ID}"),
        created=KT(f"payload__{KEY_CREATED_AT}"),
        expires=KT(f"payload__{KEY_ATTRS}__expires_at"),
    ).filter(owner=scope.engine_user_id)


def engine_memory_owned(scope: MemoryScope, *, memory_id: str) -> EngineMemory | None:
    """The scope's memory by id, in the trash or expired too, as the caller's transaction
    sees it (no lock): for a transaction answering the row it just wrote."""
    row = _rows_of(scope).filter(id=memory_id).first()
    return engine_memory_of(row) if row is not None else None


def engine_rows_owned(
    scope: MemoryScope,
    *,
    filters: dict[str, Any] | None = None,
    created_from: str | None = None,
    created_before: str | None = None,
    containment: dict[str, Any] | None = None,
    as_of: str | None = None,
) -> QuerySet[EngineMemoryRow]:
    """The scope's live rows (not in the trash, not expired; annotated with `created`),
    optionally filtered on metadata and on fields (`attrs_containment`), both by JSON
    containment, and on a creation-time range (ISO-8601 UTC text, which compares
    correctly as text). `as_of` (an `engine_timestamp`) is the instant expiry is judged
    at, now by default: a reader of several pages passes one, so a memory expiring
    between two pages is not live in one and gone from the other."""
    now = as_of or engine_timestamp(datetime.now(UTC))
    live = Q(expires__isnull=True) | Q(expires__gt=now)
    rows = _rows_of(scope).exclude(payload__has_key=KEY_TRASH).filter(live)
    if filters:
        # JSON containment (payload @> filters), as hybrid search filters: a metadata key
        # named `lt`, `in` or `isnull` is data, never an ORM lookup.
        rows = rows.filter(payload__contains=filters)
    if containment:
        rows = rows.filter(payload__contains=containment)
    if created_from:
        rows = rows.filter(created__gte=created_from)  # type: ignore[misc]
    if created_before:
        rows = rows.filter(created__lt=created_before)  # type: ignore[misc]
    return rows


def engine_memories_page(
    scope: MemoryScope,
    *,
    after: tuple[str, str] | None,
    limit: int,
    filters: dict[str, Any] | None = None,
    created_from: str | None = None,
    created_before: str | None = None,
    containment: dict[str, Any] | None = None,
    as_of: str | None = None,
) -> list[EngineMemory]:
    """Up to `limit` of the scope's memories in creation order (id breaking ties),
    starting after the (created_at, id) position `after`; live `as_of` (see
    engine_rows_owned)."""
    rows = engine_rows_owned(
        scope,
        filters=filters,
        created_from=created_from,
        created_before=created_before,
        containment=containment,
        as_of=as_of,
    )
    if after is not None:
        created_at, memory_id = after
        rows = rows.filter(Q(created__gt=created_at) | Q(created=created_at, id__gt=memory_id))
    return [engine_memory_of(row) for row in rows.order_by("created", "id")[:limit]]  # type: ignore[misc]


def engine_memory_count(scope: MemoryScope) -> int:
    return engine_rows_owned(scope).count()


def engine_memory_ids(
    scope: MemoryScope,
    *,
    containment: dict[str, Any] | None = None,
    created_from: str | None = None,
    created_before: str | None = None,
    as_of: str | None = None,
) -> list[str]:
    """Ids of the scope's live memories (`as_of`: see engine_rows_owned), optionally
    narrowed (bulk forget)."""
    rows = engine_rows_owned(
        scope, containment=containment, created_from=created_from, created_before=created_before, as_of=as_of
    )
    return [str(i) for i in rows.values_list("id", flat=True)]


def engine_client_apps(scope: MemoryScope) -> list[str]:
    apps = (
        engine_rows_owned(scope).annotate(app=KT(f"payload__{KEY_CLIENT_APP}")).values_list("app", flat=True).distinct()
    )
    return sorted(a for a in apps if a)


# --- the forensic admin's view of the table ------------------------------------------------
# Each is read through an index (migration 0027, vector_schema.create_admin_indexes): the
# table holds every user's memories, and a page must not read all of it.
def engine_rows_newest_first(rows: QuerySet[EngineMemoryRow]) -> QuerySet[EngineMemoryRow]:
    """Rows newest first with their owner, without loading the vectors (the admin lists).
    Ordered by the creation time's jsonb value, as the admin's index holds it (see
    vector_schema._admin_index_statements); the admin adds `id`, which the index holds too."""
    return (
        rows.only("id", "payload")
        .annotate(owner_id=KT(f"payload__{KEY_USER_ID}"), created_at=KeyTransform(KEY_CREATED_AT, "payload"))
        .order_by("-created_at")
    )


def engine_rows_of(rows: QuerySet[EngineMemoryRow], scopes: Sequence[MemoryScope]) -> QuerySet[EngineMemoryRow]:
    """The rows of these partitions (rows from engine_rows_newest_first), newest first:
    exact owners and the creation time's text, so that the paging index (owner,
    created_at, id) finds one owner's rows in order."""
    owned = rows.filter(owner_id__in=[scope.engine_user_id for scope in scopes])  # type: ignore[misc]
    return owned.order_by(KT(f"payload__{KEY_CREATED_AT}").desc(), "-id")


# The memory text's words, as the `fts` column holds them (vector_schema.create_fulltext_column:
# the same configuration, or the query's stems are not the column's). Each side of the OR
# states the predicate of one partial index: the live rows' (search's) and the trashed rows'.
_WORDS_IN_ANY_ROW = (
    "(NOT trashed AND fts @@ websearch_to_tsquery('english', %s))"
    " OR (trashed AND fts @@ websearch_to_tsquery('english', %s))"
)


def engine_rows_matching(rows: QuerySet[EngineMemoryRow], term: str) -> QuerySet[EngineMemoryRow]:
    """A memory id, or else words of the text, live or trashed (rows from
    engine_rows_newest_first). Words match as the full-text search reads them: whole
    words, any inflection ("bake" finds "baking"), quotes for a phrase; not parts of a
    word, and not stop words alone ("the" finds nothing)."""
    try:
        return rows.filter(id=uuid.UUID(term))
    except ValueError:
        # The SQL is constants of ours (the columns are the engine's, no model field); the
        # term is a parameter.
        words = RawSQL(_WORDS_IN_ANY_ROW, [term, term], output_field=BooleanField())  # noqa: S611
        # Newest first by the creation time's text, an order no index holds across owners
        # (the paging index holds it per owner, the admin's the jsonb value). Ordered by the
        # admin's index, the planner walks it testing each row's words whenever it expects
        # many matches, which reads the whole table when they are few or none (measured at
        # 200k rows: 190 ms for a word it misjudged, 300 ms for two words no row holds
        # together). Sorting the matches the full-text indexes find costs what they number
        # (a word in a large share of all memories may still be read by a scan: its
        # matches are then a large share of the table).
        return rows.filter(words).order_by(KT(f"payload__{KEY_CREATED_AT}").desc(), "-id")
