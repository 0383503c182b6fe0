"""The session event log (issue 13; consumed by the proxy, issue 15).

Responses-style items of one agent session, appended in order and read back newest-last.
Scope comes from the caller's `MemoryScope` only; `project` and `session_id` narrow inside
that user's log, so another user's session id behaves exactly like an empty one."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from typing import Any

from django.db import transaction
from django.db.models import QuerySet
from django.utils import timezone

from core.scope import CallContext, MemoryScope
from core.snapshots import read_only_snapshot
from memories.models import SessionEvent

# What an item's identity is made of: two items equal here are the same event to dedupe.
_HASHED_KEYS = ("type", "role", "content", "metadata", "name", "arguments", "call_id", "output")


def session_item_hash(item: dict[str, Any]) -> str:
    """sha256 of the item's role + content + metadata (and a tool call's name/arguments/
    output), canonical JSON so key order and whitespace never matter."""
    identity = {key: item.get(key) for key in _HASHED_KEYS if key in item}
    canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def _session_events(scope: MemoryScope, *, session_id: str, project: str):  # noqa: ANN202 - a QuerySet
    return SessionEvent.objects.filter(engine_user_id=scope.engine_user_id, project=project, session_id=session_id)


def session_events_append(
    scope: MemoryScope,
    *,
    session_id: str,
    items: list[dict],
    project: str = "",
    turn_id: str = "",
    dedupe_window: int = 0,
    replayed: bool = False,
) -> int:
    """Append `items` to the session's log in order; returns how many were stored. With
    `dedupe_window > 0`, an item whose hash equals one of the session's last
    `dedupe_window` items (including ones appended earlier in this call) is skipped.
    The session's SessionState row is created or touched too, whoever writes (the turn
    tools, the chat proxy): the Sessions page lists, and nightly maintenance visits, only
    sessions that have one. `replayed`: the writer sends this log back to a model as
    conversation history (SessionState.replayed). Runs in the caller's transaction (no
    commit of its own)."""
    _session_state_touch(scope, session_id=session_id, project=project, replayed=replayed)
    recent: list[str] = []
    if dedupe_window > 0:
        recent = list(
            _session_events(scope, session_id=session_id, project=project)
            .order_by("-id")
            .values_list("item_hash", flat=True)[:dedupe_window]
        )
        recent.reverse()
    rows = []
    for item in items:
        digest = session_item_hash(item)
        if dedupe_window > 0:
            if digest in recent[-dedupe_window:]:
                continue
            recent.append(digest)
        rows.append(
            SessionEvent(
                engine_user_id=scope.engine_user_id,
                project=project,
                session_id=session_id,
                turn_id=turn_id,
                item=item,
                item_hash=digest,
            )
        )
    SessionEvent.objects.bulk_create(rows)
    return len(rows)


def _session_state_touch(scope: MemoryScope, *, session_id: str, project: str, replayed: bool) -> None:
    from memories.models import SessionState

    # One upsert: concurrent writers of the same session never collide on the unique row. A
    # writer that does not replay the log leaves `replayed` as another one set it.
    SessionState.objects.bulk_create(
        [SessionState(engine_user_id=scope.engine_user_id, project=project, session_id=session_id, replayed=replayed)],
        update_conflicts=True,
        unique_fields=["engine_user_id", "project", "session_id"],
        update_fields=["last_active_at", "replayed"] if replayed else ["last_active_at"],
    )


def sessions_replayed(scope: MemoryScope, *, project: str = "") -> list[str]:
    """The ids of the user's sessions whose log a writer replays to a model (clear-all)."""
    from memories.models import SessionState

    return list(
        SessionState.objects.filter(engine_user_id=scope.engine_user_id, project=project, replayed=True)
        .order_by("session_id")
        .values_list("session_id", flat=True)
    )


def session_events_recent(scope: MemoryScope, *, session_id: str, project: str = "", limit: int) -> list[dict]:
    """The session's last `limit` items, oldest first."""
    return _session_column_recent(scope, "item", session_id=session_id, project=project, limit=limit)


def session_item_hashes_recent(scope: MemoryScope, *, session_id: str, project: str = "", limit: int) -> list[str]:
    """The hashes (`session_item_hash`) of the session's last `limit` items, oldest first:
    what a writer compares a request with, without reading the items themselves."""
    return _session_column_recent(scope, "item_hash", session_id=session_id, project=project, limit=limit)


def _session_column_recent(scope: MemoryScope, column: str, *, session_id: str, project: str, limit: int) -> list[Any]:
    """One column of the session's last `limit` events, oldest first: the one query behind
    both reads above, which differ only in the column (the hashes' reader never loads
    the items)."""
    if limit <= 0:
        return []
    values = list(
        _session_events(scope, session_id=session_id, project=project)
        .order_by("-id")
        .values_list(column, flat=True)[:limit]
    )
    values.reverse()
    return values


def session_data_erase(scope: MemoryScope) -> int:
    """Erasure (wipe_user_data): every session-log row of the scope's user (raw events,
    summaries, archives, turn guards, run_turn's kept inputs), and what apps above this one keep for the user
    (registered with `erasure_register`, e.g. the chat proxy's turns awaiting
    extraction), in the caller's transaction. Returns how many rows went."""
    from memories.models import SessionArchive, SessionState, TurnGuard, TurnPending

    owned = {"engine_user_id": scope.engine_user_id}
    deleted = 0
    for model in (SessionEvent, SessionState, SessionArchive, TurnGuard, TurnPending):
        deleted += model.objects.filter(**owned).delete()[0]
    for eraser in _ERASERS:
        deleted += eraser(scope)
    return deleted


# Apps that depend on this one (the proxy) keep per-user content too; they register an
# eraser at start-up (AppConfig.ready) so erasure covers them without an upward import.
_ERASERS: list[Callable[[MemoryScope], int]] = []


def erasure_register(eraser: Callable[[MemoryScope], int]) -> None:
    if eraser not in _ERASERS:
        _ERASERS.append(eraser)


def erasure_account_deleted(scope: MemoryScope) -> None:
    """The erasure just done in the caller's transaction also deletes the user's account
    (the admin's user delete): what apps above this one registered with
    `erasure_account_deleted_register` hears it in that transaction (the erasure ledger
    marks its record, so that a restore deletes the account again rather than bring it
    back with its keys)."""
    for hook in _ACCOUNT_DELETED_HOOKS:
        hook(scope)


_ACCOUNT_DELETED_HOOKS: list[Callable[[MemoryScope], None]] = []


def erasure_account_deleted_register(hook: Callable[[MemoryScope], None]) -> None:
    if hook not in _ACCOUNT_DELETED_HOOKS:
        _ACCOUNT_DELETED_HOOKS.append(hook)


def session_logs_delete(scope: MemoryScope, *, project: str, session_ids: list[str]) -> int:
    """Delete the named sessions' logs (raw events, archives and the state row with its
    summary) in the caller's transaction; returns how many rows went."""
    from memories.models import SessionArchive, SessionState, TurnPending

    owned = {"engine_user_id": scope.engine_user_id, "project": project, "session_id__in": session_ids}
    models = (SessionEvent, SessionArchive, SessionState, TurnPending)
    return sum(model.objects.filter(**owned).delete()[0] for model in models)


def session_data_clear_all(scope: MemoryScope) -> int:
    """Clear all (memories.services.memory_clear_all): what apps above this one keep that
    could teach the cleared memories again (registered with `clear_all_register`, e.g. the
    chat proxy's turns awaiting extraction and its conversation logs), in the caller's
    transaction, under its erasure lock; and run_turn's kept inputs, so a turn committed
    afterwards with its token cannot store what was said before the clear (its after_turn
    is then refused as an unknown token). Returns how many rows were deleted or closed."""
    from memories.models import TurnPending

    kept = TurnPending.objects.filter(engine_user_id=scope.engine_user_id).delete()[0]
    return kept + sum(clearer(scope) for clearer in _CLEARERS)


_CLEARERS: list[Callable[[MemoryScope], int]] = []


def clear_all_register(clearer: Callable[[MemoryScope], int]) -> None:
    if clearer not in _CLEARERS:
        _CLEARERS.append(clearer)


def derived_answers_forget(scope: MemoryScope) -> int:
    """A memory of the user was deleted, or its text changed (memories.services): what apps
    above this one keep that was worked out from the user's memories and could hand the
    forgotten fact back (registered with `derived_answers_register`, e.g. the toolkit's
    cached answers), in the caller's transaction. Such rows do not say which memories they
    came from, so all of the user's go, as mem0's raw messages do on a delete. Returns how
    many rows went."""
    return sum(forgetter(scope) for forgetter in _FORGETTERS)


_FORGETTERS: list[Callable[[MemoryScope], int]] = []


def derived_answers_register(forgetter: Callable[[MemoryScope], int]) -> None:
    if forgetter not in _FORGETTERS:
        _FORGETTERS.append(forgetter)


SESSION_LOGS_FORMAT = "memsite.session_logs"


def session_logs_export(scope: MemoryScope, *, call: CallContext) -> Iterator[str]:
    """Every session log the user has, as JSONL lines to stream (the web UI's "Your data"):
    a header with the counts, then one `session` line per session (its summaries: the
    abstract and overview, and `context_summary`, what before_turn shows), one `event`
    line per raw item in order, one `archive` line per compacted run of items, and one
    `pending_input` line per input `memory_run_turn` keeps for a turn not committed yet
    (an expired one too, until it is pruned: everything stored of the user is theirs to
    download), and one `turn` line per turn `memory_after_turn` recorded (its guard: the
    turn id, `processing` or `done`, the facts it stored, what it left out or shortened,
    the sha256 of its items; not the lease owner, a request's random id that says nothing
    of the user). Version 1 still: later keys and line kinds were only added, never changed.
    Audited with the counts before the first line (a refusal too); rate limited, not
    billed. The file is read in one snapshot from its header to its last line, so the
    header's counts are exactly its lines whatever agents write meanwhile, and a download
    cut short is told by them. (The audit row's counts are from the call's start.)"""
    from audit.services import audit_record
    from core.choices import Operation
    from memories.models import SessionArchive, SessionState, TurnGuard, TurnPending
    from memories.rate_limits import rate_limit_consume_audited

    rate_limit_consume_audited(scope, operation=Operation.EXPORT_SESSION_LOGS, call=call)

    owned = {"engine_user_id": scope.engine_user_id}
    states = SessionState.objects.filter(**owned).order_by("project", "session_id")
    events = SessionEvent.objects.filter(**owned).order_by("project", "session_id", "id")
    archives = SessionArchive.objects.filter(**owned).order_by("project", "session_id", "first_event_id")
    pending = TurnPending.objects.filter(**owned).order_by("project", "session_id", "created_at", "id")
    turns = TurnGuard.objects.filter(**owned).order_by("project", "session_id", "created_at", "id")

    # (line kind, header count, rows, rows read at a time, the line's keys: the row's
    # attribute of that name, or the one named after a colon).
    sections: list[tuple[str, str, QuerySet[Any], int, tuple[str, ...]]] = [
        ("session", "sessions", states, 500, ("project", "session_id", "abstract", "overview", "context_summary",
                                              "summary_updated_at", "created_at", "last_active_at")),
        ("event", "events", events, 500, ("project", "session_id", "turn_id", "created_at", "item")),
        ("archive", "archives", archives, 50, ("project", "session_id", "created_at", "items")),
        ("pending_input", "pending_inputs", pending, 50,
         ("project", "session_id", "operation_token:token", "created_at", "items")),
        ("turn", "turns", turns, 500, ("project", "session_id", "turn_id", "state", "fact_ids", "facts_left_out",
                                       "facts_shortened", "content_sha256", "created_at", "updated_at")),
    ]  # fmt: skip

    def counted() -> dict[str, int]:
        return {count_key: rows.count() for _kind, count_key, rows, _chunk, _keys in sections}

    counts = counted()
    with transaction.atomic():
        audit_record(scope, call=call, operation=Operation.EXPORT_SESSION_LOGS, detail=counts)
    header = {"format": SESSION_LOGS_FORMAT, "version": 1, "exported_at": timezone.now().isoformat(), **counts}

    def line(kind: str, row: Any, keys: tuple[str, ...]) -> str:
        data = {key.partition(":")[0]: getattr(row, key.partition(":")[2] or key) for key in keys}
        return json.dumps({kind: data}, ensure_ascii=False, default=str) + "\n"

    def lines() -> Iterator[str]:
        with read_only_snapshot():
            yield from snapshot_lines()

    def snapshot_lines() -> Iterator[str]:
        yield json.dumps({**header, **counted()}, ensure_ascii=False) + "\n"
        for kind, _count_key, rows, chunk, keys in sections:
            for row in rows.iterator(chunk_size=chunk):
                yield line(kind, row, keys)

    return lines()
