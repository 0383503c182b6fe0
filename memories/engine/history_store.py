"""mem0's history and raw-message store on Postgres, through Django models.

mem0 hard-wires an SQLite `SQLiteManager` (per-process file, no purge by user); the
engine swaps in this class, which implements the same methods.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any

from django.db import transaction

from audit.models import MemoryHistory
from memories.models import EngineMessage

KEEP_LAST_MESSAGES = 10

# mem0 writes history rows without knowing who asked; the service says it here.
_attribution: ContextVar[tuple[str, str]] = ContextVar("memsite_history_attribution", default=("", ""))


@contextmanager
def history_attribution(*, request_id: str, changed_by: str) -> Iterator[None]:
    token = _attribution.set((request_id, changed_by))
    try:
        yield
    finally:
        _attribution.reset(token)


def _user_id_of(session_scope: str) -> str:
    for part in session_scope.split("&"):
        key, _, value = part.partition("=")
        if key == "user_id":
            return value
    return ""


def _history_row(record: dict[str, Any]) -> MemoryHistory:
    request_id, changed_by = _attribution.get()
    return MemoryHistory(
        request_id=request_id,
        changed_by=changed_by[:300],
        memory_id=record["memory_id"],
        old_memory=record.get("old_memory"),
        new_memory=record.get("new_memory"),
        event=record["event"],
        created_at=record.get("created_at"),
        updated_at=record.get("updated_at"),
        is_deleted=bool(record.get("is_deleted", 0)),
        actor_id=record.get("actor_id"),
        role=record.get("role"),
    )


def history_rows_add(records: list[dict[str, Any]]) -> None:
    """History rows for changes made with SQL rather than through mem0 (the trash), in
    the caller's transaction, attributed like mem0's own."""
    if records:
        MemoryHistory.objects.bulk_create([_history_row(r) for r in records])


def history_versions_add(memory_id: str, versions: list[dict[str, Any]]) -> None:
    """An imported memory's versions as they were (event, texts, times, who changed it),
    in the caller's transaction; the import's request id ties them to the import call."""
    request_id, changed_by = _attribution.get()
    MemoryHistory.objects.bulk_create(
        [
            MemoryHistory(
                request_id=request_id,
                changed_by=(v.get("changed_by") or changed_by)[:300],
                memory_id=memory_id,
                old_memory=v.get("old_memory"),
                new_memory=v.get("new_memory"),
                event=v["event"],
                created_at=v.get("created_at"),
                updated_at=v.get("updated_at"),
                is_deleted=v["event"] == "DELETE",
            )
            for v in versions
        ]
    )


class PostgresHistoryStore:
    def add_history(
        self,
        memory_id: str,
        old_memory: str | None,
        new_memory: str | None,
        event: str,
        *,
        created_at: str | None = None,
        updated_at: str | None = None,
        is_deleted: int = 0,
        actor_id: str | None = None,
        role: str | None = None,
    ) -> None:
        _history_row(
            {
                "memory_id": memory_id,
                "old_memory": old_memory,
                "new_memory": new_memory,
                "event": event,
                "created_at": created_at,
                "updated_at": updated_at,
                "is_deleted": is_deleted,
                "actor_id": actor_id,
                "role": role,
            }
        ).save(force_insert=True)

    def batch_add_history(self, records: list[dict[str, Any]]) -> None:
        MemoryHistory.objects.bulk_create([_history_row(r) for r in records])

    def get_history(self, memory_id: str) -> list[dict[str, Any]]:
        rows = MemoryHistory.objects.filter(memory_id=memory_id).order_by("recorded_at", "id")
        return [
            {
                "id": str(r.id),
                "memory_id": r.memory_id,
                "old_memory": r.old_memory,
                "new_memory": r.new_memory,
                "event": r.event,
                "created_at": r.created_at,
                "updated_at": r.updated_at,
                "is_deleted": r.is_deleted,
                "actor_id": r.actor_id,
                "role": r.role,
            }
            for r in rows
        ]

    def save_messages(self, messages: list[dict[str, Any]], session_scope: str) -> None:
        if not messages:
            return
        now = datetime.now(UTC)
        user_id = _user_id_of(session_scope)
        with transaction.atomic():
            EngineMessage.objects.bulk_create(
                [
                    EngineMessage(
                        session_scope=session_scope,
                        user_id=user_id,
                        role=m.get("role") or "",
                        content=m.get("content") or "",
                        name=m.get("name"),
                        created_at=now,
                    )
                    for m in messages
                ]
            )
            keep = EngineMessage.objects.filter(session_scope=session_scope).order_by("-created_at", "-id")[
                :KEEP_LAST_MESSAGES
            ]
            EngineMessage.objects.filter(session_scope=session_scope).exclude(
                id__in=list(keep.values_list("id", flat=True))
            ).delete()

    def get_last_messages(self, session_scope: str, limit: int = 10) -> list[dict[str, Any]]:
        rows = list(EngineMessage.objects.filter(session_scope=session_scope).order_by("-created_at", "-id")[:limit])
        return [
            {"role": r.role, "content": r.content, "name": r.name, "created_at": r.created_at.isoformat()}
            for r in reversed(rows)
        ]

    def purge_messages(self, *, user_id: str) -> int:
        deleted, _ = EngineMessage.objects.filter(user_id=user_id).delete()
        return deleted

    def reset(self) -> None:
        raise NotImplementedError("the shared history store is never reset by the engine")

    def close(self) -> None:
        """Connections belong to Django; nothing to close."""
