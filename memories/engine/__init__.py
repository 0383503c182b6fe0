"""The memory engine: everything that knows mem0 or the layout of its table.

The rest of the code imports from here (`from memories.engine import ...`), never from
mem0 and never a payload key; import-linter holds that line (pyproject.toml)."""

from memories.engine.history_store import history_attribution
from memories.engine.mem0_adapter import (
    EngineError,
    LlmUnavailable,
    engine_add_text,
    engine_close,
    engine_delete,
    engine_embed_query,
    engine_get,
    engine_import_text,
    engine_ingest,
    engine_ping,
    engine_purge_user,
    engine_update,
    get_memory,
    llm_configured,
)
from memories.engine.payload import (
    ENGINE_RESERVED_METADATA_KEYS,
    EngineMemory,
    engine_client_apps,
    engine_memories_page,
    engine_memory_count,
    engine_memory_from_row,
    engine_memory_ids,
    engine_memory_of,
    engine_rows_matching,
    engine_rows_newest_first,
    engine_rows_owned,
)
from memories.engine.retrieval import hybrid_search

__all__ = [
    "ENGINE_RESERVED_METADATA_KEYS",
    "EngineError",
    "EngineMemory",
    "LlmUnavailable",
    "engine_add_text",
    "engine_client_apps",
    "engine_close",
    "engine_delete",
    "engine_embed_query",
    "engine_get",
    "engine_import_text",
    "engine_ingest",
    "engine_memories_page",
    "engine_memory_count",
    "engine_memory_from_row",
    "engine_memory_ids",
    "engine_memory_of",
    "engine_ping",
    "engine_purge_user",
    "engine_rows_matching",
    "engine_rows_newest_first",
    "engine_rows_owned",
    "engine_update",
    "get_memory",
    "history_attribution",
    "hybrid_search",
    "llm_configured",
]
