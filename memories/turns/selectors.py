"""Pure reads of the turn lifecycle: the user's sessions and the memory tree."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC
from itertools import islice
from typing import Any
from urllib.parse import unquote

from django.db.models import Count, F, Func, IntegerField, Max, Q, Sum, Value
from django.db.models.functions import Substr
from django.utils.dateparse import parse_datetime

from core.scope import MemoryScope
from memories.engine import attrs_condition, attrs_containment, engine_memory_of, engine_rows_owned
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
    fact_counts_by_tier says how many there are). One statement for all tiers: each
    tier's newest `limit`, the three joined by UNION ALL (a fact is listed under every
    tier it is tagged with, as one query per tier did)."""
    found: dict[str, list[dict[str, Any]]] = {tier: [] for tier in TIERS}
    if limit <= 0:
        return found
    newest = [
        _facts_of_tier(scope, tier).annotate(fact_tier=Value(tier)).order_by("-created")[:limit] for tier in TIERS
    ]
    rows = newest[0].union(*newest[1:], all=True).order_by("-created")
    for row in rows:
        fact = engine_memory_of(row)
        found[row.fact_tier].append(
            {"id": fact.id, "text": fact.text, "session_id": fact.attrs.session_id, "expires_at": fact.attrs.expires_at}
        )
    return found


def fact_counts_by_tier(scope: MemoryScope, *, session_id: str | None = None) -> dict[str, int]:
    """How many live turn facts the user has per tier (of one session, given one): one
    statement, a filtered count per tier over the user's live facts."""
    facts = engine_rows_owned(scope, containment=attrs_containment(tags=[FACT_TAG], session_id=session_id))
    found = facts.aggregate(
        **{tier: Count("id", filter=attrs_condition(attrs_containment(tags=[tier_tag(tier)]))) for tier in TIERS}
    )
    return {tier: found[tier] for tier in TIERS}


# --- seed 002's memory tree (memory_list_dir_with_abstract) ------------------------------------
#
#   /                                  the project's memory
#   /memory                            its sessions
#   /memory/<session>                  one session (its summary, counts)
#   /memory/<session>/meta             the session's summary (abstract, overview)
#   /memory/<session>/events           its raw events
#   /memory/<session>/archives         the runs maintenance compacted
#   /memory/<session>/archives/<a>-<b> one run (first and last event id)
#   /memory_tiers                      the live turn facts
#   /memory_tiers/<tier>               one tier's facts (l1, l2, long_term)
#
# The tiers sit beside /memory, not in it: a session may have any name (the chat proxy takes
# any printable X-Session-Id, and seed 002's tools have always taken `tiers`), so no name
# under /memory is free for them. A session's name is one path segment: its `%` and `/` are
# written %25 and %2F.
#
# Order: depth first, a directory before what it holds, siblings in the order above, sessions
# by session_id, archives by first event id. The walk is lazy and stops at `limit` entries,
# so a small listing of a big memory reads little: one statement for the page of sessions
# (at most `limit`: each shows at least its own entry), one grouped count per kind for that
# page, one for its first `limit` archives (in walk order they are a prefix of the page's),
# never an archive's items (counted by jsonb_array_length in the database).

TREE_SESSIONS = "memory"
TREE_TIERS = "memory_tiers"
_ARCHIVE_DIGEST_CHARS = 300


def _tree_segment(session_id: str) -> str:
    return session_id.replace("%", "%25").replace("/", "%2F")


def _tree_time(value: Any) -> str | None:
    # seed 002 §4.4's form: RFC 3339 in UTC, to the second ("2026-02-21T12:00:00Z").
    if value is None:
        return None
    if value.tzinfo is None:  # the engine's text without an offset is UTC
        value = value.replace(tzinfo=UTC)
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _latest(*values: Any) -> Any:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _entry(path: str, abstract: str, updated: Any, has_overview: bool) -> dict[str, Any]:
    return {"path": path, "abstract": abstract, "updated_at": _tree_time(updated), "has_overview": has_overview}


class _TreeNode:
    """A directory or file of the tree: its entry, and its children (lazily, in order)."""

    path = "/"

    def entry(self) -> dict[str, Any]:
        raise NotImplementedError

    def children(self) -> Iterator[_TreeNode]:
        return iter(())

    def child(self, name: str) -> _TreeNode | None:
        return next((c for c in self.children() if c.path.rsplit("/", 1)[-1] == name), None)


@dataclass
class _Tree:
    scope: MemoryScope
    project: str
    session_id: str  # narrows to one session when set
    limit: int
    _tier_stats: dict[str, tuple[int, Any]] | None = None

    def states(self) -> Any:
        states = SessionState.objects.filter(engine_user_id=self.scope.engine_user_id, project=self.project)
        return states.filter(session_id=self.session_id) if self.session_id else states

    def owned(self, model: Any, session_ids: list[str]) -> Any:
        return model.objects.filter(
            engine_user_id=self.scope.engine_user_id, project=self.project, session_id__in=session_ids
        )

    def tier_stats(self) -> dict[str, tuple[int, Any]]:
        """Per tier: how many live facts, and when the newest was made. One statement for
        all tiers: the live facts (of the project, of the session) counted per tier, with
        their newest `created` (the engine's creation time, text that orders as the
        instants it names)."""
        if self._tier_stats is None:
            tags = [FACT_TAG] + ([project_tag(self.project)] if self.project else [])
            facts = engine_rows_owned(
                self.scope, containment=attrs_containment(tags=tags, session_id=self.session_id or None)
            )
            of_tier = {tier: attrs_condition(attrs_containment(tags=[tier_tag(tier)])) for tier in TIERS}
            found = facts.aggregate(
                **{f"n_{tier}": Count("id", filter=of_tier[tier]) for tier in TIERS},
                **{f"newest_{tier}": Max("created", filter=of_tier[tier]) for tier in TIERS},
            )
            self._tier_stats = {
                tier: (found[f"n_{tier}"], parse_datetime(found[f"newest_{tier}"]) if found[f"newest_{tier}"] else None)
                for tier in TIERS
            }
        return self._tier_stats


class _RootNode(_TreeNode):
    def __init__(self, tree: _Tree) -> None:
        self.tree = tree

    def entry(self) -> dict[str, Any]:
        sessions = self.tree.states().aggregate(n=Count("id"), newest=Max("last_active_at"))
        stats = self.tree.tier_stats()
        facts = sum(n for n, _ in stats.values())
        owner = f"Project {self.tree.project}" if self.tree.project else "Memory"
        abstract = (
            f"{owner}: {_plural(sessions['n'], 'session')} under /{TREE_SESSIONS}, "
            f"{_plural(facts, 'live fact')} under /{TREE_TIERS}."
        )
        return _entry("/", abstract, _latest(sessions["newest"], *(t for _, t in stats.values())), False)

    def children(self) -> Iterator[_TreeNode]:
        yield _SessionsNode(self.tree)
        yield _TiersNode(self.tree)


class _SessionsNode(_TreeNode):
    path = f"/{TREE_SESSIONS}"

    def __init__(self, tree: _Tree) -> None:
        self.tree = tree

    def entry(self) -> dict[str, Any]:
        sessions = self.tree.states().aggregate(n=Count("id"), newest=Max("last_active_at"))
        abstract = f"{_plural(sessions['n'], 'session')}, each with its summary, raw events and archives."
        return _entry(self.path, abstract, sessions["newest"], False)

    def children(self) -> Iterator[_TreeNode]:
        states = list(self.tree.states().order_by("session_id")[: self.tree.limit])
        yield from _SessionPage(self.tree, states).nodes()

    def child(self, name: str) -> _TreeNode | None:
        session_id = unquote(name)
        states = list(self.tree.states().filter(session_id=session_id)[:1])
        return next(_SessionPage(self.tree, states).nodes(), None)


@dataclass(frozen=True)
class _ArchiveRow:
    first_event_id: int
    last_event_id: int
    events: int
    digest: str
    created_at: Any


class _SessionPage:
    """Sessions listed together: their counts in one grouped statement per kind, and their
    first `limit` archives (in walk order) in one more, when first asked for."""

    def __init__(self, tree: _Tree, states: list[SessionState]) -> None:
        self.tree = tree
        self.states = states
        self._archives: dict[str, list[_ArchiveRow]] | None = None
        ids = [s.session_id for s in states]
        self.events: dict[str, tuple[int, Any]] = {}
        self.archive_totals: dict[str, tuple[int, int, Any]] = {}
        if not ids:
            return
        events = (
            tree.owned(SessionEvent, ids)
            .values("session_id")
            .annotate(n=Count("id"), newest=Max("created_at"))
            .order_by()
        )
        self.events = {row["session_id"]: (row["n"], row["newest"]) for row in events}
        archives = (
            tree.owned(SessionArchive, ids)
            .values("session_id")
            .annotate(n=Count("id"), items=Sum(_archive_length()), newest=Max("created_at"))
            .order_by()
        )
        self.archive_totals = {row["session_id"]: (row["n"], row["items"] or 0, row["newest"]) for row in archives}

    def nodes(self) -> Iterator[_TreeNode]:
        for state in self.states:
            yield _SessionNode(self, state)

    def archives_of(self, session_id: str) -> list[_ArchiveRow]:
        if self._archives is None:
            self._archives = {}
            rows = self.tree.owned(SessionArchive, [s.session_id for s in self.states])
            for session, row in _archive_rows(rows, limit=self.tree.limit):
                self._archives.setdefault(session, []).append(row)
        return self._archives.get(session_id, [])


def _archive_rows(archives: Any, *, limit: int) -> list[tuple[str, _ArchiveRow]]:
    """The first `limit` of `archives` in walk order, each with its session: never their
    items, only how many there are, and the start of the digest."""
    rows = (
        archives.order_by("session_id", "first_event_id", "id")
        .annotate(events=_archive_length(), digest_start=Substr("digest", 1, _ARCHIVE_DIGEST_CHARS))
        .values_list("session_id", "first_event_id", "last_event_id", "events", "digest_start", "created_at")
    )[:limit]
    return [
        (session, _ArchiveRow(first, last, n, digest, created)) for session, first, last, n, digest, created in rows
    ]


def _archive_length() -> Func:
    # Counted where the rows are: an archive holds up to 200 items, and loading them to count
    # them read megabytes for a listing of a few lines.
    return Func(F("items"), function="jsonb_array_length", output_field=IntegerField())


class _SessionNode(_TreeNode):
    def __init__(self, page: _SessionPage, state: SessionState) -> None:
        self.page = page
        self.state = state
        self.path = f"/{TREE_SESSIONS}/{_tree_segment(state.session_id)}"

    def entry(self) -> dict[str, Any]:
        state = self.state
        events, _ = self.page.events.get(state.session_id, (0, None))
        archives, archived, _ = self.page.archive_totals.get(state.session_id, (0, 0, None))
        abstract = (
            f"Session {state.session_id}: {_plural(events, 'raw event')}, "
            f"{_plural(archives, 'archive')} of {_plural(archived, 'compacted event')}."
        )
        if state.abstract:
            abstract += " " + state.abstract
        return _entry(self.path, abstract, state.last_active_at, bool(state.overview))

    def children(self) -> Iterator[_TreeNode]:
        state, page = self.state, self.page
        yield _LeafNode(
            f"{self.path}/meta",
            _entry(
                f"{self.path}/meta",
                state.abstract or "No summary yet.",
                state.summary_updated_at,
                bool(state.overview),
            ),
        )
        events, newest = page.events.get(state.session_id, (0, None))
        yield _LeafNode(f"{self.path}/events", _entry(f"{self.path}/events", f"{events} raw events", newest, False))
        yield _ArchivesNode(self)


class _ArchivesNode(_TreeNode):
    def __init__(self, session: _SessionNode) -> None:
        self.session = session
        self.path = f"{session.path}/archives"

    def entry(self) -> dict[str, Any]:
        session_id = self.session.state.session_id
        archives, archived, newest = self.session.page.archive_totals.get(session_id, (0, 0, None))
        abstract = f"{_plural(archives, 'archive')} of {_plural(archived, 'compacted event')}, oldest first."
        return _entry(self.path, abstract, newest, False)

    def children(self) -> Iterator[_TreeNode]:
        for row in self.session.page.archives_of(self.session.state.session_id):
            yield self._leaf(row)

    def child(self, name: str) -> _TreeNode | None:
        # Looked up by itself: it may be past the first `limit` archives children() reads.
        first, _, last = name.partition("-")
        if not (first.isdigit() and last.isdigit()):
            return None
        tree = self.session.page.tree
        archives = tree.owned(SessionArchive, [self.session.state.session_id]).filter(
            first_event_id=int(first), last_event_id=int(last)
        )
        found = _archive_rows(archives, limit=1)
        return self._leaf(found[0][1]) if found else None

    def _leaf(self, row: _ArchiveRow) -> _TreeNode:
        path = f"{self.path}/{row.first_event_id}-{row.last_event_id}"
        abstract = f"{row.events} archived events. " + row.digest
        return _LeafNode(path, _entry(path, abstract, row.created_at, bool(row.digest)))


class _TiersNode(_TreeNode):
    path = f"/{TREE_TIERS}"

    def __init__(self, tree: _Tree) -> None:
        self.tree = tree

    def entry(self) -> dict[str, Any]:
        stats = self.tree.tier_stats()
        counts = ", ".join(f"{tier} {n}" for tier, (n, _) in stats.items())
        abstract = f"{_plural(sum(n for n, _ in stats.values()), 'live fact')} by tier: {counts}."
        return _entry(self.path, abstract, _latest(*(t for _, t in stats.values())), False)

    def children(self) -> Iterator[_TreeNode]:
        for tier, (n, newest) in self.tree.tier_stats().items():
            path = f"{self.path}/{tier}"
            yield _LeafNode(path, _entry(path, f"{n} facts", newest, False))


class _LeafNode(_TreeNode):
    def __init__(self, path: str, entry: dict[str, Any]) -> None:
        self.path = path
        self._entry = entry

    def entry(self) -> dict[str, Any]:
        return self._entry


def _tree_walk(node: _TreeNode, target: list[str], depth: int) -> Iterator[dict[str, Any]]:
    """The entries at `target` (segments below `node`) and `depth` levels under it."""
    if target:
        child = node.child(target[0])
        if child is not None:
            yield from _tree_walk(child, target[1:], depth)
        return
    yield node.entry()
    if depth > 0:
        for child in node.children():
            yield from _tree_walk(child, [], depth - 1)


def memory_tree(
    scope: MemoryScope, *, project: str, session_id: str, path: str, depth: int, limit: int
) -> list[dict[str, Any]]:
    """seed 002's directory view (the layout and order above): the entry at `path` ("" or
    "/" is the root) and those at most `depth` levels under it, each with its abstract,
    updated_at and has_overview; the first `limit` of them. A path that names nothing
    lists nothing."""
    target = [segment for segment in path.split("/") if segment]
    tree = _Tree(scope=scope, project=project, session_id=session_id, limit=limit)
    return list(islice(_tree_walk(_RootNode(tree), target, depth), limit))
