"""Reads. Keyword-only functions taking a MemoryScope first; they never see another
user's memory (it behaves exactly like a missing one)."""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Count, Q
from django.db.models.fields.json import KT
from django.db.models.functions import TruncDate

from audit.models import MemoryHistory
from audit.services import audit_record, audit_text
from billing.models import UsageEvent
from memories.accounting import call_succeeded
from memories.engine import EngineError, EngineMemory, engine_get, engine_memory_from_row
from memories.errors import ErrorCode, ServiceError, not_found
from memories.models import EngineMemoryRow
from memories.ratelimit import rate_limit_consume
from memories.retrieval import hybrid_search
from memories.scope import CallContext, MemoryScope

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
    score: float | None = None

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        if self.score is None:
            data.pop("score")
        return data


def memory_view(item: EngineMemory, *, score: float | None = None) -> MemoryView:
    metadata = dict(item.metadata)
    system = {key: metadata.pop(key, None) for key in SYSTEM_KEYS}
    return MemoryView(
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


def backend_unavailable() -> ServiceError:
    return ServiceError(ErrorCode.BACKEND_UNAVAILABLE, "The memory engine is unavailable; retry later.")


def memory_get_owned(scope: MemoryScope, *, memory_id: str) -> EngineMemory:
    """The memory if it is the scope's; `not_found` for missing and foreign ids alike."""
    try:
        item = engine_get(memory_id)
    except EngineError as exc:
        raise backend_unavailable() from exc
    if item is None or item.user_id != scope.engine_user_id:
        raise not_found(denied=item is not None)
    return item


def memory_get(scope: MemoryScope, *, memory_id: str, call: CallContext) -> MemoryView:
    """One memory with its content, for people (the web UI): audited, not billed (it is
    not one of the agent tools)."""
    view = memory_view(memory_get_owned(scope, memory_id=memory_id))
    audit_record(scope, call=call, operation="get_memory", memory_ids=[view.id])
    return view


def memory_versions(scope: MemoryScope, *, memory_id: str) -> list[dict[str, Any]]:
    """Every version of one of the scope's memories, oldest first, with who made it."""
    memory_get_owned(scope, memory_id=memory_id)
    return list(
        MemoryHistory.objects.filter(memory_id=memory_id)
        .order_by("recorded_at", "id")
        .values("event", "old_memory", "new_memory", "changed_by", "recorded_at")
    )


def memory_client_apps(scope: MemoryScope) -> list[str]:
    apps = owned_rows(scope).annotate(app=KT("payload__client_app")).values_list("app", flat=True).distinct()
    return sorted(a for a in apps if a)


def usage_by_day(scope: MemoryScope, *, days: int = 30) -> list[dict[str, Any]]:
    """The user's billed calls per operation per day."""
    since = datetime.now(UTC) - timedelta(days=days)
    return list(
        UsageEvent.objects.filter(user_id=str(scope.user_pk), created_at__gte=since)
        .annotate(day=TruncDate("created_at"))
        .values("day", "operation")
        .annotate(calls=Count("id"))
        .order_by("-day", "operation")
    )


# --- search ---------------------------------------------------------------------------
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


def memory_search(
    scope: MemoryScope, *, query: str, top_k: int, filters: dict[str, Any] | None = None, call: CallContext
) -> list[MemoryView]:
    rate_limit_consume(scope, operation="search_memory")
    try:
        candidates = hybrid_search(
            scope, query=query, limit=min(100, top_k * settings.SEARCH_CANDIDATE_FACTOR), filters=filters
        )
    except EngineError as exc:
        raise backend_unavailable() from exc
    now = datetime.now(UTC)
    ranked = sorted(((decayed_score(c, now=now), c) for c in candidates), key=lambda pair: pair[0], reverse=True)
    results = [memory_view(item, score=round(score, 6)) for score, item in ranked[:top_k]]
    with transaction.atomic():
        call_succeeded(
            scope,
            call=call,
            operation="search_memory",
            memory_ids=[r.id for r in results],
            detail={"query": audit_text(query), "top_k": top_k, "filters": filters or {}, "results": len(results)},
        )
    return results


# --- list -----------------------------------------------------------------------------
def _encode_cursor(created_at: str, memory_id: str) -> str:
    raw = json.dumps([created_at, memory_id], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_cursor(cursor: str) -> tuple[str, str]:
    try:
        padded = cursor + "=" * (-len(cursor) % 4)
        created_at, memory_id = json.loads(base64.urlsafe_b64decode(padded.encode()))
        if not isinstance(created_at, str) or not isinstance(memory_id, str):
            raise ValueError
        return created_at, memory_id
    except (ValueError, TypeError, binascii.Error, json.JSONDecodeError):
        raise ServiceError(ErrorCode.INVALID_ARGUMENT, "cursor is not one this server issued") from None


def owned_rows(
    scope: MemoryScope,
    *,
    filters: dict[str, Any] | None = None,
    created_from: str | None = None,
    created_before: str | None = None,
):
    rows = EngineMemoryRow.objects.annotate(owner=KT("payload__user_id"), created=KT("payload__created_at")).filter(
        owner=scope.engine_user_id
    )
    for key, value in (filters or {}).items():
        rows = rows.filter(**{f"payload__{key}": value})
    # ISO-8601 UTC timestamps compare correctly as text.
    if created_from:
        rows = rows.filter(created__gte=created_from)
    if created_before:
        rows = rows.filter(created__lt=created_before)
    return rows


@dataclass(frozen=True)
class MemoryPage:
    memories: list[MemoryView]
    next_cursor: str | None


def memory_list(
    scope: MemoryScope,
    *,
    cursor: str | None = None,
    page_size: int = 50,
    filters: dict[str, Any] | None = None,
    created_from: str | None = None,
    created_before: str | None = None,
    call: CallContext,
) -> MemoryPage:
    """One page in creation order (oldest first, id breaking ties): each memory
    appears exactly once across pages, even while new ones are added."""
    rate_limit_consume(scope, operation="list_memory")
    rows = owned_rows(scope, filters=filters, created_from=created_from, created_before=created_before)
    if cursor:
        created_at, memory_id = _decode_cursor(cursor)
        rows = rows.filter(Q(created__gt=created_at) | Q(created=created_at, id__gt=memory_id))
    page = list(rows.order_by("created", "id")[: page_size + 1])
    views = [memory_view(engine_memory_from_row(row.id, row.payload)) for row in page[:page_size]]
    next_cursor = None
    if len(page) > page_size:
        last = page[page_size - 1]
        next_cursor = _encode_cursor(last.created or "", str(last.id))
    with transaction.atomic():
        call_succeeded(
            scope,
            call=call,
            operation="list_memory",
            memory_ids=[v.id for v in views],
            detail={"page_size": page_size, "paged": bool(cursor), "filters": filters or {}, "results": len(views)},
        )
    return MemoryPage(memories=views, next_cursor=next_cursor)


def memory_count(scope: MemoryScope) -> int:
    return owned_rows(scope).count()


def memory_ids_owned(scope: MemoryScope) -> list[str]:
    return [str(i) for i in owned_rows(scope).values_list("id", flat=True)]
