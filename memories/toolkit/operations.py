"""Seed 003's twelve tools as operations of the one dispatcher (`memories.operations`
appends them to OPERATIONS). Names are prefixed `toolkit_` where a memory operation of
the same name exists; `tool_name` is what the MCP toolset calls them."""

from __future__ import annotations

from typing import Any

from core.choices import Operation
from core.scope import CallContext, MemoryScope
from memories.schemas import DeleteInput
from memories.toolkit import schemas
from memories.toolkit import services as toolkit


def _store(scope: MemoryScope, args: schemas.StoreMemoryInput, call: CallContext) -> dict[str, Any]:
    messages = [m.model_dump() for m in args.messages]
    return toolkit.toolkit_memory_store(scope, conversation_id=args.conversation_id, messages=messages, call=call)


def _recall(scope: MemoryScope, args: schemas.RecallMemoryInput, call: CallContext) -> dict[str, Any]:
    return toolkit.toolkit_memory_recall(
        scope,
        query=args.query,
        memory_type=args.memory_type,
        tags=args.tags,
        limit=args.limit,
        tier=args.tier,
        call=call,
    )


def _delete(scope: MemoryScope, args: DeleteInput, call: CallContext) -> dict[str, Any]:
    from memories.services import memory_forget_bulk

    if args.memory_id is not None:
        return toolkit.toolkit_memory_delete(scope, memory_id=args.memory_id, dry_run=args.dry_run, call=call)
    time_range = (args.time_range.start, args.time_range.end) if args.time_range else None
    return memory_forget_bulk(
        scope,
        tags=args.tags,
        time_range=time_range,
        memory_type=args.memory_type,
        confirm=args.confirm,
        dry_run=args.dry_run,
        call=call,
    ).as_dict()


def _hybrid(scope: MemoryScope, args: schemas.HybridSearchInput, call: CallContext) -> dict[str, Any]:
    return toolkit.toolkit_hybrid_search(
        scope,
        query=args.query,
        memory_type=args.memory_type,
        tags=args.tags,
        limit=args.limit,
        tier=args.tier,
        vector_weight=args.vector_weight,
        text_weight=args.text_weight,
        call=call,
    )


def _check_cache(scope: MemoryScope, args: schemas.CheckCacheInput, call: CallContext) -> dict[str, Any]:
    return toolkit.toolkit_cache_check(
        scope, query=args.query, similarity_threshold=args.similarity_threshold, call=call
    )


def _store_cache(scope: MemoryScope, args: schemas.StoreCacheInput, call: CallContext) -> dict[str, Any]:
    return toolkit.toolkit_cache_store(scope, query=args.query, response=args.response, call=call)


def _invalidate(scope: MemoryScope, args: schemas.CacheInvalidateInput, call: CallContext) -> dict[str, Any]:
    return toolkit.toolkit_cache_invalidate(scope, pattern=args.pattern, invalidate_all=args.invalidate_all, call=call)


def _web(scope: MemoryScope, args: schemas.SearchWebInput, call: CallContext) -> dict[str, Any]:
    return toolkit.toolkit_web_search(scope, query=args.query, call=call)


def _health(scope: MemoryScope, args: schemas.MemoryHealthInput, call: CallContext) -> dict[str, Any]:  # noqa: ARG001
    return toolkit.toolkit_memory_health(scope, call=call)


def _wipe(scope: MemoryScope, args: schemas.WipeUserDataInput, call: CallContext) -> dict[str, Any]:
    return toolkit.toolkit_user_data_wipe(scope, confirm=args.confirm, call=call)


def _store_decision(scope: MemoryScope, args: schemas.StoreDecisionInput, call: CallContext) -> dict[str, Any]:
    return toolkit.toolkit_decision_store(scope, key=args.key, value=args.value, ttl_days=args.ttl_days, call=call)


def _recall_decision(scope: MemoryScope, args: schemas.RecallDecisionInput, call: CallContext) -> dict[str, Any]:
    return toolkit.toolkit_decision_recall(scope, key=args.key, call=call)


def toolkit_operation_defs(definition: Any) -> list[Any]:
    """The twelve OperationDefs (`definition` is memories.operations.OperationDef,
    passed in so this module does not import the dispatcher that imports it)."""
    d = definition
    return [
        d(
            "store_memory",
            Operation.STORE_MEMORY,
            "Store conversation messages",
            "Store conversation messages as short-term memories (expire after STM_TTL_HOURS). Human messages over "
            "30 characters also become long-term candidates, enriched in the background (summary, importance, "
            "tags, type). Returns {stm_ids, count}; delete_memory with an stm id deletes the long-term "
            "memory made from that message too.",
            schemas.StoreMemoryInput,
            schemas.StoreMemoryOutput,
            _store,
        ),
        d(
            "recall_memory",
            Operation.RECALL_MEMORY,
            "Recall memories",
            "Search the user's memories, ranked by recency, importance and relevance. Filters: memory_type, tags "
            '(all must match), tier (["stm"], ["ltm"]), limit.',
            schemas.RecallMemoryInput,
            schemas.RecallMemoryOutput,
            _recall,
            read_only=True,
        ),
        d(
            "toolkit_delete_memory",
            Operation.DELETE_MEMORY,
            "Delete memories",
            "Soft-delete one memory by memory_id, or in bulk by tags and/or time_range {start, end} with "
            "confirm: true; dry_run: true only counts. By memory_id the whole stored message goes: a short-term "
            "id (from store_memory) also deletes the long-term memory made from it, and a long-term id (from "
            "recall) its short-term copy, so deleted_count is 2 for such a pair. Deleted memories are purged "
            "after SOFT_DELETE_PURGE_DAYS (our trash retention). Returns {deleted_count, dry_run}.",
            DeleteInput,
            schemas.ToolkitDeleteOutput,
            _delete,
            destructive=True,
            idempotent=True,
            tool_name="delete_memory",
        ),
        d(
            "check_cache",
            Operation.CHECK_CACHE,
            "Check the semantic cache",
            "Look up a cached response to a similar earlier query (cosine similarity >= similarity_threshold, "
            "default 0.95). A miss is {cache_hit: false}.",
            schemas.CheckCacheInput,
            schemas.CheckCacheOutput,
            _check_cache,
            read_only=True,
        ),
        d(
            "store_cache",
            Operation.STORE_CACHE,
            "Cache a response",
            "Cache a query/response pair for CACHE_TTL_SECONDS (default 3600).",
            schemas.StoreCacheInput,
            schemas.StoreCacheOutput,
            _store_cache,
        ),
        d(
            "hybrid_search",
            Operation.HYBRID_SEARCH,
            "Hybrid search",
            "Vector + full-text search over the user's memories fused by weighted reciprocal rank fusion "
            "(vector_weight, text_weight). Returns results with rrf_score.",
            schemas.HybridSearchInput,
            schemas.HybridSearchOutput,
            _hybrid,
            read_only=True,
            idempotent=True,
        ),
        d(
            "search_web",
            Operation.SEARCH_WEB,
            "Search the web",
            "Search the web (Tavily) when it is configured. Results are not stored as memories.",
            schemas.SearchWebInput,
            schemas.SearchWebOutput,
            _web,
            read_only=True,
            open_world=True,
        ),
        d(
            "memory_health",
            Operation.MEMORY_HEALTH,
            "Memory health",
            "Counts of the user's memories: total, per tier, per enrichment status and type, trash, cache, decisions.",
            schemas.MemoryHealthInput,
            schemas.MemoryHealthOutput,
            _health,
            read_only=True,
            idempotent=True,
        ),
        d(
            "wipe_user_data",
            Operation.WIPE_USER_DATA,
            "Erase all user data",
            "Permanently erase ALL of the user's data: memories (trash included), cache, decisions. Requires "
            "confirm: true. Irreversible; only on the user's explicit request.",
            schemas.WipeUserDataInput,
            schemas.WipeUserDataOutput,
            _wipe,
            destructive=True,
            idempotent=True,
        ),
        d(
            "cache_invalidate",
            Operation.CACHE_INVALIDATE,
            "Invalidate the cache",
            "Delete cached entries whose query contains pattern (case-insensitive), or all with invalidate_all: true.",
            schemas.CacheInvalidateInput,
            schemas.CacheInvalidateOutput,
            _invalidate,
            destructive=True,
            idempotent=True,
        ),
        d(
            "store_decision",
            Operation.STORE_DECISION,
            "Store a decision",
            "Store a keyed decision (preference, choice, sticky setting); the same key again overwrites it. "
            "ttl_days makes it expire. An account keeps at most DECISION_MAX_PER_USER keys (10,000 by "
            "default): a new key past it is refused payload_too_large; an existing key can always be updated. "
            "Returns {key, action: created|updated}.",
            schemas.StoreDecisionInput,
            schemas.StoreDecisionOutput,
            _store_decision,
            idempotent=True,
        ),
        d(
            "recall_decision",
            Operation.RECALL_DECISION,
            "Recall a decision",
            "The stored decision for a key, or {found: false} when it is missing or expired.",
            schemas.RecallDecisionInput,
            schemas.RecallDecisionOutput,
            _recall_decision,
            read_only=True,
            idempotent=True,
        ),
    ]
