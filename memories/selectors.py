"""Pure reads. Keyword-only functions taking a MemoryScope first; they never see another
user's memory (it behaves exactly like a missing one), and they write nothing (a test
runs each inside a read-only transaction). Billed or audited reads (search, list, get)
are services: they consume rate limits and write usage events and audit rows."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.db.models import Count, F, QuerySet, Window
from django.db.models.functions import RowNumber, TruncDate

from audit.models import AuditEvent, MemoryHistory
from billing.models import UsageEvent
from core.choices import Operation
from core.errors import ErrorCode, ServiceError, backend_unavailable, not_found
from core.scope import MemoryScope
from memories.engine import (
    EngineError,
    EngineMemory,
    engine_client_apps,
    engine_get,
    engine_memory_count,
    engine_memory_ids,
    engine_trash_count,
    engine_trashed,
)
from memories.keyset import KeysetPage, Seek, keyset_page, queryset_page

# Metadata keys the service writes; everything else in metadata is the client's own.
SYSTEM_KEYS = ("pinned", "source", "client_app")


@dataclass(frozen=True)
class MemoryView:
    id: str
    memory: str
    pinned: bool
    metadata: dict[str, Any]
    source: str | None
    client_app: str | None
    created_at: str | None
    updated_at: str | None
    memory_type: str
    tags: list[str]
    importance: float
    agent_id: str | None
    session_id: str | None
    expires_at: str | None
    why_stored: str | None
    last_recalled_at: str | None
    access_count: int
    score: float | None = None

    def as_dict(self) -> dict[str, Any]:
        # Field by field, not dataclasses.asdict: the same dict (mutable members copied, so
        # a caller cannot change the view through it) in 40 % of the time, per search result.
        # tests/test_memory_view.py holds it equal to asdict's for every field.
        data = {
            "id": self.id,
            "memory": self.memory,
            "pinned": self.pinned,
            "metadata": _json_copy(self.metadata),
            "source": self.source,
            "client_app": self.client_app,
            "created_at": self.created_at,
            "updated_at": self.updated_at,
            "memory_type": self.memory_type,
            "tags": _json_copy(self.tags),
            "importance": self.importance,
            "agent_id": self.agent_id,
            "session_id": self.session_id,
            "expires_at": self.expires_at,
            "why_stored": self.why_stored,
            "last_recalled_at": self.last_recalled_at,
            "access_count": self.access_count,
        }
        if self.score is not None:
            data["score"] = self.score
        return data


_IMMUTABLE = (str, int, float, bool, type(None))


def _json_copy(value: Any) -> Any:
    """A deep copy, as dataclasses.asdict makes, faster for what a payload holds (JSON's
    dicts, lists and scalars); anything else is deep-copied the general way."""
    kind = type(value)
    if kind is dict:
        return {key: _json_copy(item) for key, item in value.items()}
    if kind is list:
        return [_json_copy(item) for item in value]
    if kind in _IMMUTABLE:
        return value
    return copy.deepcopy(value)


def memory_view(item: EngineMemory, *, score: float | None = None) -> MemoryView:
    metadata = dict(item.metadata)
    system = {key: metadata.pop(key, None) for key in SYSTEM_KEYS}
    attrs = item.attrs
    return MemoryView(
        memory_type=attrs.memory_type,
        tags=list(attrs.tags),
        importance=attrs.importance,
        agent_id=attrs.agent_id,
        session_id=attrs.session_id,
        expires_at=attrs.expires_at,
        why_stored=attrs.why_stored,
        last_recalled_at=item.last_recalled_at,
        access_count=item.access_count,
        id=item.id,
        memory=item.text,
        pinned=bool(system["pinned"]),
        metadata=metadata,
        source=system["source"],
        client_app=system["client_app"],
        created_at=item.created_at,
        updated_at=item.updated_at,
        score=score,
    )


def memory_get_owned(scope: MemoryScope, *, memory_id: str, live: bool = True) -> EngineMemory:
    """The memory if it is the scope's and live; `not_found` for missing and foreign ids
    alike, and for the scope's own memories in the trash or expired (invisible at once).
    `live=False` also returns the scope's own memory in the trash or expired: for a call
    that just stored it answering what it stored, though it expired or was cleared since."""
    try:
        item = engine_get(memory_id)
    except EngineError as exc:
        raise backend_unavailable() from exc
    if item is None or item.user_id != scope.engine_user_id:
        raise not_found(denied=item is not None)
    if live and (item.trash is not None or item.expired(datetime.now(UTC))):
        raise not_found()
    return item


@dataclass(frozen=True)
class TrashedView:
    memory: MemoryView
    trashed_at: str
    request_id: str
    operation: str

    def as_dict(self) -> dict[str, Any]:
        return {
            **self.memory.as_dict(),
            "trashed_at": self.trashed_at,
            "request_id": self.request_id,
            "operation": self.operation,
        }


def memory_trash_list(
    scope: MemoryScope, *, limit: int = 500, after: tuple[str, str] | None = None
) -> list[TrashedView]:
    """The scope's trash, most recently deleted first: `limit` items, the first ones or
    those after the (trashed at, id) position `after` (the API's cursor)."""
    return _trashed_views(engine_trashed(scope, after=after, limit=limit))


def memory_trash_page(scope: MemoryScope, *, limit: int = 200, seek: Seek | None = None) -> KeysetPage[TrashedView]:
    """A page of the scope's trash, most recently deleted first (the web UI's pages, which
    memories deleted, restored or purged meanwhile do not shift): the first or the one
    `seek` names by (trashed at, id). `memory_trash_count` says how many there are in all."""

    def fetch(seek: Seek | None, limit: int) -> list[EngineMemory]:
        if seek is None:
            return engine_trashed(scope, limit=limit)
        position = (str(seek.position[0]), str(seek.position[1]))
        if seek.backward:
            return engine_trashed(scope, before=position, limit=limit)
        return engine_trashed(scope, after=position, limit=limit)

    page = keyset_page(fetch, key=_trash_position, seek=seek, limit=limit)
    return KeysetPage(rows=_trashed_views(page), previous=page.previous, next=page.next)


def _trash_position(item: EngineMemory) -> tuple[str, str]:
    return (item.trash.at if item.trash is not None else "", item.id)


def _trashed_views(items: Iterable[EngineMemory]) -> list[TrashedView]:
    return [
        TrashedView(memory=memory_view(item), trashed_at=item.trash.at, request_id=item.trash.request_id,
                    operation=item.trash.operation)
        for item in items
        if item.trash is not None
    ]  # fmt: skip


def memory_trash_count(scope: MemoryScope, *, request_id: str | None = None) -> int:
    """How many memories are in the scope's trash; with `request_id`, how many of them that
    one call deleted (what restoring its group brings back)."""
    return engine_trash_count(scope, request_id=request_id)


def memory_versions(scope: MemoryScope, *, memory_id: str) -> list[dict[str, Any]]:
    """Every version of one of the scope's memories, oldest first, with who made it."""
    try:
        memory_get_owned(scope, memory_id=memory_id)
    except ServiceError:
        # The history of a memory in the trash stays readable (it is restorable).
        if not engine_trashed(scope, memory_ids=[memory_id]):
            raise
    return list(
        MemoryHistory.objects.filter(memory_id=memory_id)  # type: ignore[arg-type]
        .order_by("recorded_at", "id")
        .values("event", "old_memory", "new_memory", "changed_by", "recorded_at")
    )


@dataclass(frozen=True)
class MemoryHistoryView:
    versions: list[dict[str, Any]]  # oldest first
    omitted: int = 0  # older versions left out (memory_histories' `newest`)


def memory_histories(
    scope: MemoryScope, *, memory_ids: list[str], newest: int | None = None, owned_ids: set[str] | None = None
) -> dict[str, MemoryHistoryView]:
    """The versions of the scope's memories (ids from the scope's own rows), oldest first;
    with `newest`, only that many of each memory's latest, and how many older ones there are.
    `owned_ids`: the scope's ids, when the caller read them already (a streamed export asks
    page by page, and would otherwise read every id of the user for each page)."""
    owned = set(memory_ids) & (owned_ids if owned_ids is not None else set(engine_memory_ids(scope)))
    versions: dict[str, list[dict[str, Any]]] = {memory_id: [] for memory_id in owned}
    totals: dict[str, int] = {}
    rows = MemoryHistory.objects.filter(memory_id__in=list(owned))
    fields = ["memory_id", "event", "old_memory", "new_memory", "created_at", "updated_at", "changed_by"]
    if newest is not None:
        memory = [F("memory_id")]
        latest_first = Window(RowNumber(), partition_by=memory, order_by=[F("recorded_at").desc(), F("id").desc()])
        rows = rows.annotate(place=latest_first, total=Window(Count("id"), partition_by=memory))
        rows = rows.filter(place__lte=newest)
        fields.append("total")
    for row in rows.order_by("recorded_at", "id").values(*fields):
        version: dict[str, Any] = dict(row)
        memory_id = version.pop("memory_id")
        totals[memory_id] = version.pop("total", 0)
        versions[memory_id].append(version)
    return {
        memory_id: MemoryHistoryView(versions=kept, omitted=max(0, totals.get(memory_id, 0) - len(kept)))
        for memory_id, kept in versions.items()
    }


def memory_client_apps(scope: MemoryScope) -> list[str]:
    return engine_client_apps(scope)


def memory_count(scope: MemoryScope) -> int:
    return engine_memory_count(scope)


def memory_ids_owned(scope: MemoryScope, *, as_of: str | None = None) -> list[str]:
    """Ids of the scope's live memories, live now or at `as_of` (an engine timestamp)."""
    return engine_memory_ids(scope, as_of=as_of)


def usage_by_day(scope: MemoryScope, *, days: int = 30) -> list[dict[str, Any]]:
    """The user's billed calls per operation per day."""
    since = datetime.now(UTC) - timedelta(days=days)
    return list(
        UsageEvent.objects.filter(user_id=str(scope.user_pk), created_at__gte=since)  # type: ignore[arg-type]
        .annotate(day=TruncDate("created_at"))
        .values("day", "operation")
        .annotate(calls=Count("id"))
        .order_by("-day", "operation")
    )


# --- ranking ---------------------------------------------------------------------------
def _age_days(item: EngineMemory, now: datetime) -> float:
    stamp = item.updated_at or item.created_at
    if not stamp:
        return 0.0
    try:
        when = datetime.fromisoformat(stamp)
    except ValueError:
        return 0.0
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (now - when).total_seconds() / 86400)


def decayed_score(item: EngineMemory, *, now: datetime) -> float:
    """Pinned memories keep their score. Others lose relevance with age, halving the
    decaying part every half-life, but never below SEARCH_DECAY_FLOOR of it: an old
    exact match should still beat a fresh unrelated memory."""
    score = item.score or 0.0
    if item.metadata.get("pinned"):
        return score
    floor = settings.SEARCH_DECAY_FLOOR
    return score * (floor + (1 - floor) * 0.5 ** (_age_days(item, now) / settings.SEARCH_DECAY_HALF_LIFE_DAYS))


ACTIVITY_LIMIT = 200


def _activity_rows(scope: MemoryScope, *, by_services: bool) -> QuerySet[AuditEvent]:
    rows = AuditEvent.objects.filter(subject_user_id=scope.user_pk, tenant=scope.tenant).exclude(
        operation=Operation.AUTHENTICATE
    )
    if by_services:
        rows = rows.exclude(actor_user_id=scope.user_pk).exclude(actor_user_id__isnull=True)
    return rows


# The Activity page says how many calls there were up to this many, and "more than" past
# it: the count runs on every page view and a busy agent's user has millions of rows.
ACTIVITY_COUNT_CAP = 10_000


def memory_activity_count(scope: MemoryScope, *, by_services: bool = False, cap: int = ACTIVITY_COUNT_CAP) -> int:
    """How many calls memory_activity lists, counted up to `cap` + 1 at most (more than
    `cap` is all the page needs to say), so the count stops after that many index rows."""
    return _activity_rows(scope, by_services=by_services)[: cap + 1].count()


def memory_activity(
    scope: MemoryScope, *, by_services: bool = False, limit: int = ACTIVITY_LIMIT, seek: Seek | None = None
) -> KeysetPage[dict[str, Any]]:
    """The calls made on the scope's memories, newest first (issue 12): who (the actor,
    its role and client app: a service acting for the user shows as itself), what, when,
    how it ended. `by_services`: only calls by another principal than the user. A page of
    `limit` rows, the first or the one `seek` names (by audit row id: the web UI's pages,
    which calls recorded meanwhile do not shift; `memory_activity_count` says how many
    there are in all)."""
    rows = _activity_rows(scope, by_services=by_services)
    fields = (
        "id", "occurred_at", "operation", "outcome", "error_code", "channel", "actor_user_id", "actor_username",
        "actor_role", "actor_client_app", "staff_username", "memory_ids",
    )  # fmt: skip
    # Newest first by id, through the index (subject, -id).
    page = queryset_page(rows.values(*fields), order=("-id",), seek=seek, limit=limit)
    return page.map(lambda row: _activity_row(scope, row))


def _activity_row(scope: MemoryScope, row: dict[str, Any]) -> dict[str, Any]:
    row["by_service"] = row["actor_user_id"] is not None and row["actor_user_id"] != scope.user_pk
    row["memory_count"] = len(row.pop("memory_ids") or [])
    row["role_label"] = row["actor_role"].replace("_", " ") if row["actor_role"] not in ("", "user") else ""
    if row["outcome"] == AuditEvent.Outcome.DENIED and row["error_code"] == ErrorCode.NOT_FOUND:
        # Another user's id was answered as missing; the trail keeps `denied` for staff,
        # but shown here it would tell the caller that the id exists.
        row["outcome"] = AuditEvent.Outcome.ERROR
    return row
