"""mem0's own search and history, for tests that check the engine underneath our
retrieval (the product searches with memories.engine.hybrid_search instead)."""

from __future__ import annotations

from typing import Any

from core.scope import MemoryScope
from memories.engine import EngineMemory, get_memory
from memories.engine.payload import engine_memory_from_item


def engine_search(scope: MemoryScope, *, query: str, top_k: int) -> list[EngineMemory]:
    result = get_memory().search(query, top_k=top_k, filters={"user_id": scope.engine_user_id})
    return [engine_memory_from_item(item) for item in result.get("results") or []]


def engine_history(memory_id: str) -> list[dict[str, Any]]:
    return get_memory().db.get_history(memory_id)


def memory_gone(memory_id: str) -> bool:
    """Deleted as far as the user can tell: no row, or the row is in the trash (issue 11:
    delete and clear_all move memories to the trash until the purge job)."""
    from memories.engine import engine_get

    item = engine_get(memory_id)
    return item is None or item.trash is not None
