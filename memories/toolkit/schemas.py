"""Seed 003's argument and result shapes (minus `user_id`: scope comes from the token).
Strict like the other operations: unknown fields (a `user_id` among them) are refused."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, field_validator

from memories.schemas import (
    INGEST_MAX_MESSAGES,
    INGEST_MAX_TOTAL_CHARS,
    MEMORY_MAX_CHARS,
    QUERY_MAX_CHARS,
    MemoryTypeName,
    StrictInput,
    Tags,
    TtlDays,
    _non_blank,
    _too_large,
)

CACHE_RESPONSE_MAX_CHARS = 32000
DECISION_KEY_MAX_CHARS = 128
DECISION_VALUE_MAX_CHARS = 8000
PATTERN_MAX_CHARS = 200
LIMIT_MAX = 1000  # then capped by MAX_RESULTS_PER_QUERY

Query = Annotated[StrictStr, Field(min_length=1, max_length=QUERY_MAX_CHARS)]
Limit = Annotated[int, Field(ge=1, le=LIMIT_MAX, strict=True, description="Capped at MAX_RESULTS_PER_QUERY.")]
Tier = Literal["stm", "ltm"]
Weight = Annotated[float, Field(ge=0, le=100)]
DecisionKey = Annotated[
    StrictStr, Field(min_length=1, max_length=DECISION_KEY_MAX_CHARS, pattern=r"^[A-Za-z0-9_.:@/-]+$")
]


class ToolkitMessage(StrictInput):
    role: Literal["human", "ai", "user", "assistant", "system"] = Field(description='"human" or "ai".')
    content: Annotated[StrictStr, Field(min_length=1, max_length=MEMORY_MAX_CHARS)]

    _blank = field_validator("content")(_non_blank)


class StoreMemoryInput(StrictInput):
    conversation_id: Annotated[StrictStr, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:@-]+$")] = Field(
        description="Groups the messages of one conversation."
    )
    messages: list[ToolkitMessage] = Field(min_length=1, max_length=INGEST_MAX_MESSAGES)

    @field_validator("messages")
    @classmethod
    def _total_size(cls, value: list[ToolkitMessage]) -> list[ToolkitMessage]:
        if sum(len(m.content) for m in value) > INGEST_MAX_TOTAL_CHARS:
            raise _too_large(f"messages exceed {INGEST_MAX_TOTAL_CHARS} characters in total")
        return value


class _Filters(StrictInput):
    query: Query
    memory_type: MemoryTypeName | None = Field(default=None, description="Only memories of this type.")
    tags: Tags | None = Field(default=None, description="Only memories with all of these tags.")
    limit: Limit = 10
    tier: list[Tier] | None = Field(default=None, max_length=2, description='["stm"], ["ltm"] or both (default).')

    _blank = field_validator("query")(_non_blank)


class RecallMemoryInput(_Filters):
    pass


class HybridSearchInput(_Filters):
    vector_weight: Weight | None = Field(default=None, description="Weight of the vector ranking (RRF_VECTOR_WEIGHT).")
    text_weight: Weight | None = Field(default=None, description="Weight of the full-text ranking (RRF_TEXT_WEIGHT).")


class CheckCacheInput(StrictInput):
    query: Query
    similarity_threshold: Annotated[float, Field(ge=0, le=1)] | None = Field(
        default=None, description="Minimum cosine similarity for a hit (CACHE_SIMILARITY_THRESHOLD, 0.95)."
    )

    _blank = field_validator("query")(_non_blank)


class StoreCacheInput(StrictInput):
    query: Query
    response: Annotated[StrictStr, Field(min_length=1, max_length=CACHE_RESPONSE_MAX_CHARS)]

    _blank = field_validator("query")(_non_blank)


class CacheInvalidateInput(StrictInput):
    pattern: Annotated[StrictStr, Field(min_length=1, max_length=PATTERN_MAX_CHARS)] | None = Field(
        default=None, description="Delete cached entries whose query contains this text (case-insensitive)."
    )
    invalidate_all: StrictBool = Field(default=False, description="Delete every cached entry.")


class SearchWebInput(StrictInput):
    query: Query

    _blank = field_validator("query")(_non_blank)


class MemoryHealthInput(StrictInput):
    pass


class WipeUserDataInput(StrictInput):
    confirm: StrictBool = Field(default=False, description="Must be true: this erases ALL of your data.")


class StoreDecisionInput(StrictInput):
    key: DecisionKey
    value: Annotated[StrictStr, Field(min_length=1, max_length=DECISION_VALUE_MAX_CHARS)]
    ttl_days: TtlDays | None = Field(default=None, description="Expire after this many days (omit: never).")


class RecallDecisionInput(StrictInput):
    key: DecisionKey


# --- outputs --------------------------------------------------------------------------------
class _Out(BaseModel):
    model_config = ConfigDict(populate_by_name=True, serialize_by_alias=True)


class StoreMemoryOutput(_Out):
    stm_ids: list[str]
    count: int


class RecalledMemory(_Out):
    id: str = Field(alias="_id")
    user_id: str
    tier: str
    content: str
    summary: str | None = None
    importance: float
    access_count: int
    created_at: str | None = None
    last_accessed: str | None = None
    memory_type: str
    tags: list[str]
    enrichment_status: str | None = None
    conversation_id: str | None = None
    final_score: float


class RecallMemoryOutput(_Out):
    results: list[RecalledMemory]
    count: int


class SearchedMemory(_Out):
    id: str = Field(alias="_id")
    user_id: str
    tier: str
    content: str
    summary: str | None = None
    importance: float
    created_at: str | None = None
    memory_type: str
    tags: list[str]
    rrf_score: float


class HybridSearchOutput(_Out):
    results: list[SearchedMemory]
    count: int


class ToolkitDeleteOutput(_Out):
    deleted_count: int
    dry_run: bool


class CheckCacheOutput(_Out):
    cache_hit: bool
    query: str | None = None
    response: str | None = None
    score: float | None = None


class StoreCacheOutput(_Out):
    cache_id: str


class CacheInvalidateOutput(_Out):
    user_id: str
    deleted_count: int


class WebResult(_Out):
    title: str
    url: str
    content: str


class SearchWebOutput(_Out):
    results: list[WebResult]
    query: str


class MemoryHealthOutput(_Out):
    user_id: str
    total_memories: int
    tier_stats: dict[str, int]
    enrichment_stats: dict[str, int]
    type_stats: dict[str, int]
    trash: int
    cache_entries: int
    decisions: int


class WipeUserDataOutput(_Out):
    user_id: str
    memories_deleted: int
    cache_deleted: int
    audit_deleted: int
    decisions_deleted: int


class StoreDecisionOutput(_Out):
    key: str
    action: Literal["created", "updated"]
    user_id: str


class DecisionOut(_Out):
    key: str
    value: str
    user_id: str
    created_at: str
    updated_at: str
    expires_at: str | None = None


class RecallDecisionOutput(_Out):
    key: str
    found: bool
    decision: DecisionOut | None = None


def drop_none(data: dict[str, Any], *keys: str) -> dict[str, Any]:
    """Seed 003 leaves absent fields out (a cache miss is just `{"cache_hit": false}`)."""
    return {k: v for k, v in data.items() if not (k in keys and v is None)}
