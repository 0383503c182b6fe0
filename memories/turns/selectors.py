"""Pure reads of the turn lifecycle: the user's sessions and the memory tree."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from django.db.models import Count, Q

from core.scope import MemoryScope
from memories.engine import attrs_containment, engine_memory_of, engine_rows_owned
from memories.keyset import KeysetPage, Seek, queryset_page
from memories.models import SessionArchive, SessionEvent, SessionState
from memories.turns.extraction import FACT_TAG, TIERS, project_tag, tier_tag


@dataclass(frozen=True)
class SessionSummary:
    project: str
    session_id: str
    abstract: str
    overview: str
    summary_updated_at: Any
    last_active_at: Any
    events: int
    archives: int


# Orders of the web UI's pages (memories.keyset), each ending with a unique key and served
# by an index that starts with the owner.
SESSIONS_ORDER = ("-last_active_at", "id")  # index session_state_recent
SESSION_ITEMS_ORDER = ("id",)  # index session_event_order
SESSION_ARCHIVES_ORDER = ("first_event_id", "id")  # the (owner, session, first_event_id) index


def sessions_of_user(scope: MemoryScope, *, limit: int = 200, seek: Seek | None = None) -> KeysetPage[SessionSummary]:
    """The user's sessions, most recently active first: a page of `limit`, the first or
    the one `seek` names by (last active at, id). A session active again meanwhile moves
    up to the first page and leaves the pages after it as it goes: seen once at most."""
    states = SessionState.objects.filter(engine_user_id=scope.engine_user_id)
    page = queryset_page(states, order=SESSIONS_ORDER, seek=seek, limit=limit)
    events = _counts_per_session(scope, SessionEvent, page.rows)
    archives = _counts_per_session(scope, SessionArchive, page.rows)
    return page.map(
        lambda state: SessionSummary(
            project=state.project,
            session_id=state.session_id,
            abstract=state.abstract,
            overview=state.overview,
            summary_updated_at=state.summary_updated_at,
            last_active_at=state.last_active_at,
            events=events.get((state.project, state.session_id), 0),
            archives=archives.get((state.project, state.session_id), 0),
        )
    )


def _counts_per_session(scope: MemoryScope, model: Any, states: list[SessionState]) -> dict[tuple[str, str], int]:
    """How many rows of `model` each of `states`' sessions holds, in one grouped statement
    for the whole page (one count per session was two statements per row of the page)."""
    if not states:
        return {}
    sessions = Q()
    for state in states:
        sessions |= Q(project=state.project, session_id=state.session_id)
    rows = (
        model.objects.filter(sessions, engine_user_id=scope.engine_user_id)
        .values_list("project", "session_id")
        .annotate(n=Count("id"))
        .order_by()
    )
    return {(project, session_id): n for project, session_id, n in rows}


def session_count(scope: MemoryScope) -> int:
    """How many sessions the user has (all of sessions_of_user's pages)."""
    return SessionState.objects.filter(engine_user_id=scope.engine_user_id).count()


def session_exists(scope: MemoryScope, *, project: str, session_id: str) -> bool:
    """Whether the user has this session (another user's is as missing as an unknown one)."""
    return SessionState.objects.filter(
        engine_user_id=scope.engine_user_id, project=project, session_id=session_id
    ).exists()


@dataclass(frozen=True)
class SessionItem:
    """One raw item of a session's log as a person reads it."""

    kind: str  # message, function_call, function_call_output, or the item's own type
    role: str
    text: str
    turn_id: str
    created_at: Any


def _item_text(item: dict[str, Any]) -> str:
    """The readable part of a Responses-style item: a message's text (its content parts'
    texts, joined), a tool call's name and arguments, a tool output; else the item as JSON."""
    content = item.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [str(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
        if parts:
            return "\n".join(parts)
    if item.get("type") == "function_call":
        return f"{item.get('name', '')}({item.get('arguments', '')})"
    if "output" in item:
        output = item["output"]
        return output if isinstance(output, str) else json.dumps(output, ensure_ascii=False, default=str)
    return json.dumps(item, ensure_ascii=False, default=str)


def _session_item(item: Any, *, turn_id: str, created_at: Any) -> SessionItem:
    if not isinstance(item, dict):
        return SessionItem(
            kind="item", role="", text=json.dumps(item, default=str), turn_id=turn_id, created_at=created_at
        )
    return SessionItem(
        kind=str(item.get("type") or "message"),
        role=str(item.get("role") or ""),
        text=_item_text(item),
        turn_id=turn_id,
        created_at=created_at,
    )


def session_items(
    scope: MemoryScope, *, project: str, session_id: str, limit: int = 200, seek: Seek | None = None
) -> KeysetPage[SessionItem]:
    """The session's raw log in order: a page of `limit` items, the first or the one `seek`
    names by event id (events maintenance compacts meanwhile shift nothing)."""
    rows = SessionEvent.objects.filter(engine_user_id=scope.engine_user_id, project=project, session_id=session_id)
    page = queryset_page(rows, order=SESSION_ITEMS_ORDER, seek=seek, limit=limit)
    return page.map(lambda row: _session_item(row.item, turn_id=row.turn_id, created_at=row.created_at))


@dataclass(frozen=True)
class SessionArchiveView:
    """One run of a session's older events that maintenance compacted (at most 200)."""

    compacted_at: Any
    items: list[SessionItem]


def session_archives(
    scope: MemoryScope, *, project: str, session_id: str, limit: int = 5, seek: Seek | None = None
) -> KeysetPage[SessionArchiveView]:
    """The session's archived runs, oldest first: a page of `limit`, the first or the one
    `seek` names by (first event id, id). Archived items keep no time or turn of their own:
    the run's compaction time stands for them."""
    archives = SessionArchive.objects.filter(
        engine_user_id=scope.engine_user_id, project=project, session_id=session_id
    )
    page = queryset_page(archives, order=SESSION_ARCHIVES_ORDER, seek=seek, limit=limit)
    return page.map(
        lambda archive: SessionArchiveView(
            compacted_at=archive.created_at,
            items=[_session_item(item, turn_id="", created_at=None) for item in archive.items or []],
        )
    )


def session_item_count(scope: MemoryScope, *, project: str, session_id: str) -> int:
    """How many raw items the session's log holds (all of session_items' pages)."""
    return SessionEvent.objects.filter(
        engine_user_id=scope.engine_user_id, project=project, session_id=session_id
    ).count()


def session_archive_count(scope: MemoryScope, *, project: str, session_id: str) -> int:
    """How many runs of the session's older events maintenance compacted into archives."""
    return SessionArchive.objects.filter(
        engine_user_id=scope.engine_user_id, project=project, session_id=session_id
    ).count()


def _facts_of_tier(scope: MemoryScope, tier: str) -> Any:
    return engine_rows_owned(scope, containment=attrs_containment(tags=[FACT_TAG, tier_tag(tier)]))


def facts_by_tier(scope: MemoryScope, *, limit: int = 100) -> dict[str, list[dict[str, Any]]]:
    """The user's live turn facts per tier, newest first (at most `limit` of each tier:
    fact_counts_by_tier says how many there are)."""
    found: dict[str, list[dict[str, Any]]] = {}
    for tier in TIERS:
        newest = _facts_of_tier(scope, tier).order_by("-created")
        facts = [engine_memory_of(row) for row in newest[:limit]]
        found[tier] = [
            {"id": f.id, "text": f.text, "session_id": f.attrs.session_id, "expires_at": f.attrs.expires_at}
            for f in facts
        ]
    return found


def fact_counts_by_tier(scope: MemoryScope) -> dict[str, int]:
    """How many live turn facts the user has per tier."""
    return {tier: _facts_of_tier(scope, tier).count() for tier in TIERS}


def memory_tree(
    scope: MemoryScope, *, project: str, session_id: str, path: str, depth: int, limit: int
) -> list[dict[str, Any]]:
    """seed 002's directory view: `/memory/<session>/{meta,events,archives/<n>}` and
    `/memory/tiers/<tier>`, each with its abstract, updated_at and has_overview, below
    `path` and at most `depth` levels under it."""
    entries: list[dict[str, Any]] = []
    states = SessionState.objects.filter(engine_user_id=scope.engine_user_id, project=project)
    if session_id:
        states = states.filter(session_id=session_id)
    for state in states.order_by("session_id"):
        owned = {"engine_user_id": scope.engine_user_id, "project": project, "session_id": state.session_id}
        base = f"/memory/{state.session_id}"
        entries.append(
            _entry(f"{base}/meta", state.abstract or "No summary yet.", state.summary_updated_at, bool(state.overview))
        )
        events = SessionEvent.objects.filter(**owned)
        newest = events.order_by("-id").values_list("created_at", flat=True).first()
        entries.append(_entry(f"{base}/events", f"{events.count()} raw events", newest, False))
        for archive in SessionArchive.objects.filter(**owned).order_by("first_event_id"):
            entries.append(
                _entry(
                    f"{base}/archives/{archive.first_event_id}-{archive.last_event_id}",
                    f"{len(archive.items)} archived events. " + archive.digest[:300],
                    archive.created_at,
                    bool(archive.digest),
                )
            )
    for tier in TIERS:
        tags = [FACT_TAG, tier_tag(tier)] + ([project_tag(project)] if project else [])
        rows = engine_rows_owned(scope, containment=attrs_containment(tags=tags, session_id=session_id or None))
        top = rows.order_by("-created").first()  # type: ignore[misc]
        updated = engine_memory_of(top).created_at if top is not None else None
        entries.append(_entry(f"/memory/tiers/{tier}", f"{rows.count()} facts", updated, False))
    prefix = "/" + path.strip("/") if path.strip("/") else ""
    base_depth = prefix.count("/")
    selected = [
        e
        for e in entries
        if (not prefix or e["path"] == prefix or e["path"].startswith(prefix + "/"))
        and e["path"].count("/") - base_depth <= depth
    ]
    return selected[:limit]


def _entry(path: str, abstract: str, updated: Any, has_overview: bool) -> dict[str, Any]:
    if updated is not None and not isinstance(updated, str):
        updated = updated.isoformat()
    return {"path": path, "abstract": abstract, "updated_at": updated, "has_overview": has_overview}
