"""The session event log as fixed by the session-2 contract (issue 13 owns
`memories.sessions`). Until that module is merged, this stand-in with the same
signatures keeps the proxy working; `proxy.services` prefers the real one."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from core.scope import MemoryScope
from proxy.models import SessionMessage


def _item_hash(item: dict[str, Any]) -> str:
    # role + content + metadata (everything but the type), canonical JSON
    return hashlib.sha256(json.dumps(item, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def session_events_append(
    scope: MemoryScope,
    *,
    session_id: str,
    items: list[dict],
    project: str = "",
    turn_id: str = "",
    dedupe_window: int = 0,
) -> int:
    recent: set[str] = set()
    if dedupe_window > 0:
        recent = set(
            SessionMessage.objects.filter(engine_user_id=scope.engine_user_id, session_id=session_id, project=project)
            .order_by("-id")
            .values_list("item_hash", flat=True)[:dedupe_window]
        )
    stored = 0
    for item in items:
        digest = _item_hash(item)
        if digest in recent:
            continue
        recent.add(digest)
        SessionMessage.objects.create(
            engine_user_id=scope.engine_user_id,
            session_id=session_id,
            project=project,
            turn_id=turn_id,
            item=item,
            item_hash=digest,
        )
        stored += 1
    return stored


def session_events_recent(scope: MemoryScope, *, session_id: str, project: str = "", limit: int) -> list[dict]:
    rows = SessionMessage.objects.filter(
        engine_user_id=scope.engine_user_id, session_id=session_id, project=project
    ).order_by("-id")[:limit]
    return [row.item for row in reversed(list(rows))]
