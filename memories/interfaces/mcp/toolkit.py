"""Seed 003's twelve tools at /engines/memory-toolkit/mcp (issue 14). Same auth, audit
row, usage event and rate limits as the memory toolset; `user_id` is never an argument."""

from __future__ import annotations

from memories.interfaces.mcp.toolset import Toolset

TOOLKIT_TOOLSET = Toolset(
    id="memory-toolkit",
    name="memsite-memory-toolkit",
    instructions=(
        "A memory server for the authenticated user (Memory-MCP compatible). store_memory every conversation "
        "turn; recall_memory (or hybrid_search) before answering when earlier context could help; check_cache "
        "before an expensive answer and store_cache after; store_decision/recall_decision for sticky choices "
        "and preferences; delete_memory when the user retracts something. search_web only when web search is "
        "configured. wipe_user_data only on the user's explicit request to erase everything."
    ),
    operations=(
        "store_memory",
        "recall_memory",
        "toolkit_delete_memory",
        "check_cache",
        "store_cache",
        "hybrid_search",
        "search_web",
        "memory_health",
        "wipe_user_data",
        "cache_invalidate",
        "store_decision",
        "recall_decision",
    ),
    flat_errors=True,
)
