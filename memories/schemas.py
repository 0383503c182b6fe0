"""Input and output models of the memory operations: one validation path for MCP, REST
and the web UI, and the `outputSchema` each MCP tool declares.

Strict types (no "5" for 5), unknown fields refused (so no client-supplied `user_id`
can ride along), sizes capped. `validate_input` turns any violation into a
ServiceError with code `invalid_argument` or `payload_too_large`.
"""

from __future__ import annotations

import copy
import json
import re
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictStr,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from core.errors import ErrorCode, ServiceError
from core.inputs import InputError, json_value_check
from memories.cursors import CURSOR_MAX_CHARS, CursorError, cursor_decode
from memories.engine import ENGINE_RESERVED_METADATA_KEYS, ENRICHMENT_KEY
from memories.turns.extraction import FACT_TAG, PROJECT_TAG_PREFIX, TIERS, tier_tag

MEMORY_MAX_CHARS = 8000
QUERY_MAX_CHARS = 2000
TOP_K_MAX = 50
PAGE_SIZE_DEFAULT = 50
PAGE_SIZE_MAX = 200
METADATA_MAX_KEYS = 20
METADATA_KEY_MAX_CHARS = 64
METADATA_VALUE_MAX_CHARS = 1000
METADATA_MAX_BYTES = 8192
FILTERS_MAX_KEYS = 10
INGEST_MAX_MESSAGES = 50
INGEST_MAX_TOTAL_CHARS = 40000
TAGS_MAX = 20
TAG_MAX_CHARS = 64
SCOPE_ID_MAX_CHARS = 128
SOURCE_MAX_CHARS = 64
RESERVED_SOURCE = "store_memory"  # the toolkit's store_memory rows (services.STORE_MEMORY_SOURCE)
WHY_STORED_MAX_CHARS = 500
TTL_DAYS_MAX = 3650

# Keys the engine or the service owns; clients may not set or filter on them.
RESERVED_KEYS = ENGINE_RESERVED_METADATA_KEYS | {"tenant", "client_app", "source", "pinned"}
# A letter, then letters, digits, '_', '.', '-', never two '_' in a row (Django's lookup
# separator). The same pattern is published in the tools' input schemas and OpenAPI.
KEY_PATTERN = r"^[A-Za-z](?:_?[A-Za-z0-9.-])*_?$"
_KEY_PATTERN = re.compile(KEY_PATTERN)
# Filters may also select on what the service records (read-only for clients).
FILTER_SYSTEM_KEYS = frozenset({"pinned", "client_app", "source"})

Scalar = StrictStr | StrictBool | int | float | None
TopK = Annotated[int, Field(ge=1, le=TOP_K_MAX, strict=True)]
PageSize = Annotated[int, Field(ge=1, le=PAGE_SIZE_MAX, strict=True)]


def _too_large(message: str) -> PydanticCustomError:
    return PydanticCustomError("payload_too_large", message)


# Objects whose keys are the caller's own text (which may hold anything, a secret too):
# errors name such a key by its position, never by itself, as the import promises for
# the records of a file (docs/portability.md), and failure audit rows keep the message.
FREE_KEYED_FIELDS = frozenset({"metadata", "filters"})


def _check_keys(values: dict[str, Any], *, what: str, max_keys: int, allow: frozenset[str] = frozenset()) -> None:
    if len(values) > max_keys:
        raise _too_large(f"{what} may have at most {max_keys} keys")
    for n, key in enumerate(values, start=1):
        if len(key) > METADATA_KEY_MAX_CHARS or not _KEY_PATTERN.fullmatch(key):
            raise ValueError(f"{what} key #{n} must be 1-64 letters, digits, '_', '.', '-' (no '__')")
        if key in RESERVED_KEYS and key not in allow:
            raise ValueError(f"{what} key #{n} ({key!r}) is reserved")  # one of our names: safe to show


def metadata_json_bytes(metadata: dict[str, Any]) -> int:
    """The size METADATA_MAX_BYTES limits: UTF-8 bytes of the JSON, as stored and exported
    (not ASCII-escaped, which counts an emoji as 12 bytes instead of 4)."""
    return len(json.dumps(metadata, ensure_ascii=False, default=str).encode("utf-8", "surrogatepass"))


def _metadata_checked(
    value: dict[str, Any], *, exempt: frozenset[str] = frozenset(), besides: str = ""
) -> dict[str, Any]:
    """Key names, reserved keys and value sizes of every key; the key count and the size
    budget of the owner's own keys (those not in `exempt`, which `besides` names for the
    messages: what the system or another product recorded, not the owner's labels)."""
    own = {key: item for key, item in value.items() if key not in exempt}
    if len(own) > METADATA_MAX_KEYS:
        raise _too_large(f"metadata may have at most {METADATA_MAX_KEYS} keys{besides}")
    _check_keys(value, what="metadata", max_keys=len(value))  # names and reserved keys, each by position
    for n, item in enumerate(value.values(), start=1):
        if isinstance(item, str) and len(item) > METADATA_VALUE_MAX_CHARS:
            raise _too_large(f"the value of metadata key #{n} exceeds {METADATA_VALUE_MAX_CHARS} characters")
    if metadata_json_bytes(own) > METADATA_MAX_BYTES:
        raise _too_large(f"metadata exceeds {METADATA_MAX_BYTES} bytes{besides}")
    return value


class StrictInput(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def _key_names(*, reserved: frozenset[str]) -> dict[str, Any]:
    return {"pattern": KEY_PATTERN, "maxLength": METADATA_KEY_MAX_CHARS, "not": {"enum": sorted(reserved)}}


_METADATA_VALUE_SCHEMA: dict[str, Any] = {
    "anyOf": [
        {"type": "string", "maxLength": METADATA_VALUE_MAX_CHARS},
        {"type": "boolean"},
        {"type": "integer"},
        {"type": "number"},
        {"type": "null"},
    ]
}


# The JSON schemas of metadata and filters objects, as the validators below enforce them
# (published in each tool's inputSchema and in /v1/schema/).
METADATA_OBJECT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "maxProperties": METADATA_MAX_KEYS,
    "propertyNames": _key_names(reserved=frozenset(RESERVED_KEYS)),
    "additionalProperties": _METADATA_VALUE_SCHEMA,
}
FILTERS_OBJECT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "maxProperties": FILTERS_MAX_KEYS,
    "propertyNames": _key_names(reserved=frozenset(RESERVED_KEYS - FILTER_SYSTEM_KEYS)),
    "additionalProperties": _METADATA_VALUE_SCHEMA,
}


def _object_branch(schema: dict[str, Any], replacement: dict[str, Any]) -> None:
    """Replace the object branch of an optional dict field's generated schema."""
    for branch in schema.get("anyOf", []):
        if branch.get("type") == "object":
            branch.clear()
            branch.update(copy.deepcopy(replacement))


class MetadataMixin(StrictInput):
    metadata: dict[str, Scalar] | None = Field(
        default=None,
        description=f"Your own key/value labels (at most {METADATA_MAX_KEYS} keys; strings up to "
        f"{METADATA_VALUE_MAX_CHARS} characters; at most {METADATA_MAX_BYTES} bytes as JSON). Keys: a letter, "
        "then letters, digits, '_', '.', '-' (never '__'), up to 64 characters, not a reserved name.",
        json_schema_extra=lambda schema: _object_branch(schema, METADATA_OBJECT_SCHEMA),
    )

    @field_validator("metadata")
    @classmethod
    def _metadata_ok(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if value is None else _metadata_checked(value)


class FiltersMixin(StrictInput):
    filters: dict[str, Scalar] | None = Field(
        default=None,
        description=f"Exact-match filters (at most {FILTERS_MAX_KEYS}) on your metadata keys (same key rules as "
        "metadata), or on `pinned` (true/false), `client_app` or `source`.",
        json_schema_extra=lambda schema: _object_branch(schema, FILTERS_OBJECT_SCHEMA),
    )

    @field_validator("filters")
    @classmethod
    def _filters_ok(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None:
            return None
        _check_keys(value, what="filters", max_keys=FILTERS_MAX_KEYS, allow=FILTER_SYSTEM_KEYS)
        if "pinned" in value and not isinstance(value["pinned"], bool):
            raise ValueError("filters.pinned must be true or false")
        for key in ("client_app", "source"):
            if key in value and not isinstance(value[key], str):
                raise ValueError(f"filters.{key} must be a string")
        for n, item in enumerate(value.values(), start=1):
            if isinstance(item, str) and len(item) > METADATA_VALUE_MAX_CHARS:
                raise _too_large(f"the value of filters key #{n} exceeds {METADATA_VALUE_MAX_CHARS} characters")
        return value


MemoryTypeName = Literal["user", "feedback", "project", "reference"]
Tag = Annotated[StrictStr, Field(min_length=1, max_length=TAG_MAX_CHARS, pattern=r"^[^\x00-\x1f]+$")]
Tags = Annotated[list[Tag], Field(max_length=TAGS_MAX, description=f"Short labels (at most {TAGS_MAX}).")]
_TAG_ADAPTER: TypeAdapter[str] = TypeAdapter(Tag)


def tag_storable(value: str) -> bool:
    """Whether `value` is a tag as clients and the import take it (the `Tag` type itself):
    a writer of tags that no client chose (an LLM's answer) keeps only these, or the
    user's export would be refused whole."""
    try:
        _TAG_ADAPTER.validate_python(value)
    except ValidationError:
        return False
    return True


ScopeId = Annotated[StrictStr, Field(min_length=1, max_length=SCOPE_ID_MAX_CHARS, pattern=r"^[A-Za-z0-9_.:@-]+$")]
Importance = Annotated[float, Field(ge=0, le=1, description="0 to 1 (default 0.5).")]
TtlDays = Annotated[int, Field(ge=1, le=TTL_DAYS_MAX, strict=True)]
Instant = Annotated[StrictStr, Field(max_length=40, description="ISO 8601, e.g. 2026-12-31T00:00:00Z.")]

# The typed fields (issue 11): what `remember` may set and `update_memory` may change.
FIELD_NAMES = ("memory_type", "tags", "importance", "agent_id", "session_id", "expires_at", "source", "why_stored")


def parse_instant(value: str, *, what: str) -> datetime:
    """An ISO 8601 date or date-time, as a UTC instant; naive ones are taken as UTC.

    Converted here, where a bad value is still the caller's mistake: an instant whose UTC
    form leaves datetime's range (9999-12-31T23:59:59-05:00, 0001-01-01T00:00:00+05:00)
    raised OverflowError deep in the engine, a 500."""
    try:
        when = datetime.fromisoformat(value.replace("Z", "+00:00") if value.endswith("Z") else value)
    except ValueError:
        raise ValueError(f"{what} must be an ISO 8601 date-time, e.g. 2026-12-31T00:00:00Z") from None
    try:
        return when.astimezone(UTC) if when.tzinfo else when.replace(tzinfo=UTC)
    except OverflowError:
        raise ValueError(f"{what} is out of range: use an instant between years 0001 and 9999 in UTC") from None


class FieldsMixin(StrictInput):
    memory_type: MemoryTypeName | None = Field(
        default=None, description="user (default), feedback, project, reference."
    )
    tags: Tags | None = None
    importance: Importance | None = None
    agent_id: ScopeId | None = Field(default=None, description="Narrower scope: the agent this memory belongs to.")
    session_id: ScopeId | None = Field(default=None, description="Narrower scope: the session it belongs to.")
    expires_at: Instant | None = Field(default=None, description="When the memory expires (in the future).")
    ttl_days: TtlDays | None = Field(default=None, description="Or: expire this many days from now.")
    source: Annotated[StrictStr, Field(min_length=1, max_length=SOURCE_MAX_CHARS)] | None = Field(
        default=None, description="Where the memory came from (default: the operation, e.g. remember)."
    )
    why_stored: Annotated[StrictStr, Field(max_length=WHY_STORED_MAX_CHARS)] | None = Field(
        default=None, description="Why the agent kept it."
    )

    @field_validator("tags")
    @classmethod
    def _tags_unique(cls, value: list[str] | None) -> list[str] | None:
        return None if value is None else list(dict.fromkeys(t.strip() for t in value if t.strip()))

    @field_validator("source")
    @classmethod
    def _source_not_the_toolkits(cls, value: str | None) -> str | None:
        # The toolkit's store_memory marks its own rows with it, and enrichment and the
        # pair rule (`services._pairs`) trust it: a client must not pass one off as such.
        if value == RESERVED_SOURCE:
            raise ValueError(f"source {RESERVED_SOURCE!r} is reserved for the toolkit's store_memory")
        return value

    @field_validator("expires_at")
    @classmethod
    def _expires_in_future(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if parse_instant(value, what="expires_at") <= datetime.now(UTC):
            raise ValueError("expires_at must be in the future")
        return value

    @model_validator(mode="after")
    def _one_expiry(self) -> FieldsMixin:
        # Both given, one null: an explicit `expires_at: null` (no expiry; on an update, clear
        # it) beside a `ttl_days` contradicts it as a date would, on a store and an update alike.
        both = {"expires_at", "ttl_days"} <= self.model_fields_set
        if both and (self.expires_at is not None or self.ttl_days is not None):
            raise ValueError("give expires_at or ttl_days, not both")
        return self

    def field_changes(self) -> dict[str, Any]:
        """The fields the caller gave (an explicit null clears a nullable field)."""
        given = {name: getattr(self, name) for name in FIELD_NAMES if name in self.model_fields_set}
        if self.ttl_days is not None:
            given["ttl_days"] = self.ttl_days
        return given


class FieldFiltersMixin(StrictInput):
    memory_type: MemoryTypeName | None = Field(default=None, description="Only memories of this type.")
    tags: Tags | None = Field(default=None, description="Only memories with all of these tags.")
    agent_id: ScopeId | None = Field(default=None, description="Only this agent's memories.")
    session_id: ScopeId | None = Field(default=None, description="Only this session's memories.")

    def field_filters(self) -> dict[str, Any]:
        return {
            "memory_type": self.memory_type,
            "tags": self.tags,
            "agent_id": self.agent_id,
            "session_id": self.session_id,
        }


def _non_blank(value: str) -> str:
    if not value.strip():
        raise ValueError("must not be blank")
    return value


MemoryText = Annotated[StrictStr, Field(min_length=1, max_length=MEMORY_MAX_CHARS)]
# No max_length: an over-long id is simply not a UUID (400), not a payload too large (413).
MemoryId = Annotated[
    StrictStr, Field(description="The memory's id (a UUID).", json_schema_extra={"format": "uuid", "maxLength": 36})
]


class RememberInput(FieldsMixin, MetadataMixin):
    memory: MemoryText = Field(description="One curated fact about the user, stored verbatim.")
    pinned: StrictBool = Field(
        default=False,
        description="Pinned memories never lose rank with age. True pins a memory you already have of this text; "
        "false never unpins it.",
    )

    _blank = field_validator("memory")(_non_blank)


# --- what the product stores beyond what a client may set ------------------------------------
# Metadata keys the toolkit's enrichment writes onto a long-term memory after the fact (its
# result, or its failed attempts): the owner may have used the whole key and byte budget
# before it ran, so they are outside it.
SUMMARY_KEY = "summary"
ENRICHED_BY_KEY = "enriched_by"
ENRICHMENT_ATTEMPTS_KEY = "enrichment_attempts"
ENRICHMENT_ERROR_KEY = "enrichment_error"
ENRICHMENT_METADATA_KEYS = frozenset(
    {ENRICHMENT_KEY, SUMMARY_KEY, ENRICHED_BY_KEY, ENRICHMENT_ATTEMPTS_KEY, ENRICHMENT_ERROR_KEY}
)
_TIER_TAGS = frozenset(tier_tag(tier) for tier in TIERS)
# Who said a mem0 memory (mem0's top-level `actor_id`, `role`, `attributed_to`), which its
# import brings in as these metadata keys (docs/portability.md). mem0 recorded them, not the
# owner: counted in the owner's 20 keys, a valid mem0 memory with 19 or 20 keys of its own
# and a speaker refused the whole file. They sit outside that budget, like the enrichment's.
MEM0_SPEAKER_FIELDS = ("actor_id", "role", "attributed_to")
MEM0_SPEAKER_KEYS = frozenset(f"mem0_{field}" for field in MEM0_SPEAKER_FIELDS)
# A stored memory's metadata keys outside its owner's METADATA_MAX_KEYS and METADATA_MAX_BYTES:
# what the import of a memsite file accepts on top, and what `update_memory` does not count.
METADATA_KEYS_BESIDES_OWN = ENRICHMENT_METADATA_KEYS | MEM0_SPEAKER_KEYS


def metadata_own(metadata: dict[str, Any]) -> dict[str, Any]:
    """The keys of a stored memory's metadata that count in its owner's budget."""
    return {key: value for key, value in metadata.items() if key not in METADATA_KEYS_BESIDES_OWN}


def system_tag(tag: str) -> bool:
    """A tag the turn lifecycle sets (`turn-fact`, `tier:<tier>`, `project:<name>`), outside
    the owner's TAGS_MAX: a fact said in several projects carries one tag per project."""
    return tag == FACT_TAG or tag in _TIER_TAGS or tag.startswith(PROJECT_TAG_PREFIX)


class StoredMemoryInput(RememberInput):
    """A memory as the product may hold it, which a memsite export carries: `remember`'s
    limits for what its owner set, not for what the system added after (turn lifecycle
    tags, the enrichment's metadata keys). The import checks its own exports with this
    (a user's backup must come back in whole); everything else stays refused: bad types,
    keys or tags, reserved keys, over-long values, too many of the owner's own."""

    tags: list[Tag] | None = None

    @field_validator("tags")
    @classmethod
    def _tags_unique(cls, value: list[str] | None) -> list[str] | None:  # replaces FieldsMixin's
        if value is None:
            return None
        tags = list(dict.fromkeys(t.strip() for t in value if t.strip()))
        if sum(1 for tag in tags if not system_tag(tag)) > TAGS_MAX:
            raise _too_large(f"at most {TAGS_MAX} tags besides turn-fact, tier: and project: ones")
        return tags

    @field_validator("metadata")
    @classmethod
    def _metadata_ok(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:  # replaces MetadataMixin's
        return (
            None
            if value is None
            else _metadata_checked(
                value, exempt=METADATA_KEYS_BESIDES_OWN, besides=" besides the enrichment's and mem0's speaker keys"
            )
        )


class Mem0MemoryInput(RememberInput):
    """A memory of a mem0 file: `remember`'s limits for the record's own metadata (its
    renamed reserved keys too), its speaker keys on top."""

    @field_validator("metadata")
    @classmethod
    def _metadata_ok(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:  # replaces MetadataMixin's
        return (
            None
            if value is None
            else _metadata_checked(value, exempt=MEM0_SPEAKER_KEYS, besides=" besides mem0's speaker keys")
        )


class Message(StrictInput):
    role: Literal["user", "assistant", "system"]
    content: Annotated[StrictStr, Field(min_length=1, max_length=MEMORY_MAX_CHARS)]


class IngestInput(FieldsMixin, MetadataMixin):
    messages: list[Message] = Field(
        min_length=1, max_length=INGEST_MAX_MESSAGES, description="The conversation turn(s) to extract facts from."
    )

    @field_validator("messages")
    @classmethod
    def _total_size(cls, value: list[Message]) -> list[Message]:
        if sum(len(m.content) for m in value) > INGEST_MAX_TOTAL_CHARS:
            raise _too_large(f"messages exceed {INGEST_MAX_TOTAL_CHARS} characters in total")
        if not any(m.role != "system" for m in value):
            raise ValueError("messages need at least one user or assistant message")
        return value


class SearchInput(FieldFiltersMixin, FiltersMixin):
    query: Annotated[StrictStr, Field(min_length=1, max_length=QUERY_MAX_CHARS)]
    top_k: TopK = 10

    _blank = field_validator("query")(_non_blank)


def _uuid_text(value: str) -> str:
    try:
        if len(value) > 45:  # the longest form uuid.UUID reads: urn:uuid:<36>
            raise ValueError
        return str(uuid.UUID(value))
    except ValueError:
        raise ValueError("memory_id must be a UUID") from None


class TimeRange(StrictInput):
    start: Instant | None = None
    end: Instant | None = None

    @model_validator(mode="after")
    def _ordered(self) -> TimeRange:
        start = parse_instant(self.start, what="time_range.start") if self.start else None
        end = parse_instant(self.end, what="time_range.end") if self.end else None
        if start is None and end is None:
            raise ValueError("time_range needs start and/or end")
        if start and end and start >= end:
            raise ValueError("time_range.start must be before time_range.end")
        return self


class UpdateBody(FieldsMixin, MetadataMixin):
    """update_memory's arguments but its id, and their rules: the REST body of PATCH
    /v1/memories/{memory_id} (the id is in the URL), as OpenAPI publishes it. The call is
    validated with UpdateInput, this plus the id, so the published body cannot drift from
    what the call takes."""

    model_config = ConfigDict(json_schema_extra={"minProperties": 1})

    memory: MemoryText | None = Field(default=None, description="New text (re-embedded).")
    pinned: StrictBool | None = None

    @field_validator("source")
    @classmethod
    def _source_not_the_toolkits(cls, value: str | None) -> str | None:  # replaces FieldsMixin's
        # A store_memory row's fields sent back as they were read keep its own source:
        # `memory_update` refuses the value only on a memory store_memory did not make.
        return value

    @field_validator("memory")
    @classmethod
    def _memory_non_blank(cls, value: str | None) -> str | None:
        return None if value is None else _non_blank(value)

    @model_validator(mode="after")
    def _something_to_change(self) -> UpdateBody:
        if self.memory is None and self.pinned is None and self.metadata is None and not self.field_changes():
            raise ValueError("give at least one of memory, pinned, metadata or a field")
        return self


class _MemoryIdInput(StrictInput):
    memory_id: MemoryId

    _uuid = field_validator("memory_id")(_uuid_text)


# update_memory's arguments: the memory's id and the body (no docstring: it would become the
# tool's inputSchema description). The id's base comes last so the id comes first there.
class UpdateInput(UpdateBody, _MemoryIdInput):
    # The body's "minProperties: 1" is for the body alone, not the tool's inputSchema.
    model_config = ConfigDict(json_schema_extra=None)


class DeleteInput(StrictInput):
    """One memory by id, or (bulk forget) every memory matching tags, a creation time
    range and/or a type: then `confirm: true` is required and `dry_run` only counts."""

    memory_id: MemoryId | None = None
    tags: Tags | None = Field(default=None, description="Bulk: memories with all of these tags.")
    time_range: TimeRange | None = Field(default=None, description="Bulk: created in [start, end), ISO 8601.")
    memory_type: MemoryTypeName | None = Field(default=None, description="Bulk: memories of this type.")
    confirm: StrictBool = Field(default=False, description="Bulk: must be true.")
    dry_run: StrictBool = Field(
        default=False, description="Only count what would be deleted (by id: the memory and its linked twin)."
    )

    @field_validator("memory_id")
    @classmethod
    def _uuid(cls, value: str | None) -> str | None:
        return None if value is None else _uuid_text(value)

    @property
    def bulk(self) -> bool:
        return self.memory_id is None

    @model_validator(mode="after")
    def _one_form(self) -> DeleteInput:
        selectors = self.tags or self.time_range is not None or self.memory_type is not None
        if self.memory_id is not None and selectors:
            raise ValueError("give memory_id, or tags/time_range/memory_type, not both")
        if self.memory_id is None and not selectors:
            raise ValueError("give memory_id, or at least one of tags, time_range, memory_type")
        return self


class CursorMixin(StrictInput):
    cursor: Annotated[StrictStr, Field(max_length=CURSOR_MAX_CHARS)] | None = Field(
        default=None, description="`next_cursor` from the previous page (opaque)."
    )

    @field_validator("cursor")
    @classmethod
    def _cursor_ours(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                cursor_decode(value)
            except CursorError as exc:
                raise ValueError(str(exc)) from None
        return value


class ListInput(FieldFiltersMixin, FiltersMixin, CursorMixin):
    page_size: PageSize = PAGE_SIZE_DEFAULT


class TrashListInput(CursorMixin):
    """GET /v1/trash: a page of the trash (the largest page by default)."""

    page_size: PageSize = PAGE_SIZE_MAX


class ClearAllInput(StrictInput):
    confirm: StrictBool = Field(default=False, description="Must be true: this deletes every memory of yours.")


class GetInput(StrictInput):
    memory_id: MemoryId

    _uuid = field_validator("memory_id")(_uuid_text)


class DatedListInput(ListInput):
    """The web UI's list: a page of memories created in [created_from, created_before)."""

    created_from: Annotated[StrictStr, Field(max_length=40)] | None = None
    created_before: Annotated[StrictStr, Field(max_length=40)] | None = None

    @field_validator("created_from", "created_before")
    @classmethod
    def _iso_time(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                datetime.fromisoformat(value)
            except ValueError:
                raise ValueError("must be an ISO-8601 date or time, e.g. 2026-01-31") from None
        return value


class ExportInput(StrictInput):
    format: Literal["jsonl", "markdown"] = Field(default="jsonl", description="jsonl (lossless) or markdown (to read).")


class ImportInput(StrictInput):
    """Not an MCP tool: REST and the web UI pass the uploaded file's bytes."""

    data: bytes = Field(description="The file's content.")
    source: Literal["memsite", "mem0", "openmemory"] = "memsite"


# --- outputs (each MCP tool's outputSchema) ---------------------------------------------------
class MemoryOut(BaseModel):
    id: str
    memory: str
    pinned: bool
    metadata: dict[str, Any]
    source: str | None
    client_app: str | None
    created_at: str | None
    updated_at: str | None
    memory_type: str = "user"
    tags: list[str] = Field(default_factory=list)
    importance: float = 0.5
    agent_id: str | None = None
    session_id: str | None = None
    expires_at: str | None = None
    why_stored: str | None = None
    last_recalled_at: str | None = Field(
        default=None, description="Last time a recall (search, prefetch, before_turn) returned it (batched)."
    )
    access_count: int = Field(
        default=0, description="How often recalls (searches, prefetch, before_turn) returned it (batched)."
    )
    score: float | None = Field(default=None, description="Relevance (search results only).")


class SearchOutput(BaseModel):
    results: list[MemoryOut]


class RememberOutput(BaseModel):
    id: str
    duplicate: bool = Field(description="True when the same text was already remembered.")


class IngestedMemory(BaseModel):
    id: str
    memory: str | None
    event: str | None = Field(description="ADD, UPDATE, DELETE or NONE.")


class IngestOutput(BaseModel):
    results: list[IngestedMemory]


class MemoryOutput(BaseModel):
    memory: MemoryOut


class DeleteOutput(BaseModel):
    id: str | None = Field(default=None, description="Single delete: the memory's id.")
    deleted: bool | None = Field(
        default=None, description="Single delete: true (moved to the trash); false for a dry run."
    )
    deleted_count: int | None = Field(
        default=None, description="Bulk forget, or a dry run by id: how many (would be) deleted."
    )
    dry_run: bool | None = Field(default=None, description="True when nothing was changed.")


class ListOutput(BaseModel):
    memories: list[MemoryOut]
    next_cursor: str | None = Field(description="Pass as `cursor` for the next page; null on the last page.")


class ClearAllOutput(BaseModel):
    deleted: int = Field(description="How many memories were deleted.")


class ErrorInfo(BaseModel):
    code: ErrorCode = Field(description="Stable machine-readable code.")
    message: str = Field(description="For humans; never holds memory content or secrets.")
    retry_after_s: int | None = Field(
        default=None, description="Seconds to wait before retrying (rate_limited, resource_busy, backend_unavailable)."
    )
    details: Any = None


class ErrorResponse(BaseModel):
    """Every error of the REST API (and the structured content of an MCP error result)."""

    error: ErrorInfo


class ExportOutput(BaseModel):
    content: str
    format: str
    count: int = Field(description="How many memories the file holds.")


class ImportOutput(BaseModel):
    imported: int = Field(description="Memories added.")
    duplicates: int = Field(description="Memories skipped because you already had the same text.")
    expired: int = Field(default=0, description="Memories skipped because their expiry has passed.")
    ids: list[str]


def _describe(error: Any, arguments: dict[str, Any]) -> str:
    loc = error.get("loc", ())
    if len(loc) >= 2 and loc[0] in FREE_KEYED_FIELDS:
        # pydantic's location names the key (then the union member tried): say its place.
        given = arguments.get(loc[0])
        keys = list(given) if isinstance(given, dict) else []
        n = keys.index(loc[1]) + 1 if loc[1] in keys else "?"
        return f"{loc[0]} key #{n}: the value must be text, a number, true, false or null"
    # A location holds the caller's own keys (an unknown argument's name may be any size,
    # or content): each part is cut, as json_value_check cuts the keys it names.
    where = ".".join(str(p)[:64] for p in loc) or "arguments"
    if error["type"] == "extra_forbidden":
        return f"unexpected argument {where!r}"
    message = error["msg"].removeprefix("Value error, ")
    return f"{where}: {message}"


@dataclass(frozen=True)
class RejectedArguments:
    """Arguments an interface could not even decode (a malformed body or query string).
    Passed to the dispatcher like arguments, so the failure is answered and audited there
    like any other bad argument."""

    error: ServiceError


def validate_input[T: BaseModel](model: type[T], arguments: Any) -> T:
    """The edge check of every surface: a coded error for anything the engine or the
    database could not take (NUL, lone surrogates, non-finite numbers, deep nesting)."""
    if isinstance(arguments, RejectedArguments):
        raise arguments.error
    if not isinstance(arguments, dict):
        raise ServiceError(ErrorCode.INVALID_ARGUMENT, "arguments must be a JSON object")
    try:
        # The lifecycle tools' conversation items: only what the database cannot store.
        json_value_check(arguments, transcript_keys=getattr(model, "TRANSCRIPT_FIELDS", frozenset()))
    except InputError as exc:
        code = ErrorCode.PAYLOAD_TOO_LARGE if exc.too_large else ErrorCode.INVALID_ARGUMENT
        raise ServiceError(code, exc.message) from None
    try:
        return model.model_validate(arguments)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False)
        too_large = any(e["type"] in ("payload_too_large", "string_too_long", "too_long") for e in errors)
        code = ErrorCode.PAYLOAD_TOO_LARGE if too_large else ErrorCode.INVALID_ARGUMENT
        # One line per problem: a bad metadata value fails every member of the union.
        described = dict.fromkeys(_describe(e, arguments) for e in errors[:5])
        raise ServiceError(code, "; ".join(described)) from None


class RestoreInput(StrictInput):
    """The trash: one memory by id, or everything one call deleted (its request id)."""

    memory_id: MemoryId | None = None
    request_id: Annotated[StrictStr, Field(min_length=1, max_length=64)] | None = None

    @field_validator("memory_id")
    @classmethod
    def _uuid(cls, value: str | None) -> str | None:
        return None if value is None else _uuid_text(value)

    @model_validator(mode="after")
    def _one(self) -> RestoreInput:
        if (self.memory_id is None) == (self.request_id is None):
            raise ValueError("give memory_id or request_id")
        return self


class PurgeInput(StrictInput):
    """Delete forever: one memory in the trash, or (`all: true`) the whole trash."""

    memory_id: MemoryId | None = None
    all: StrictBool = False

    @field_validator("memory_id")
    @classmethod
    def _uuid(cls, value: str | None) -> str | None:
        return None if value is None else _uuid_text(value)

    @model_validator(mode="after")
    def _one(self) -> PurgeInput:
        if (self.memory_id is None) == (not self.all):
            raise ValueError("give memory_id or all: true")
        return self


class RestoreOutput(BaseModel):
    restored: list[str]


class TrashListOutput(BaseModel):
    memories: list[MemoryOut] = Field(description="A page of the trash, most recently deleted first.")
    next_cursor: str | None = Field(description="Pass as `cursor` for the next page; null on the last one.")


class ForgetOutput(BaseModel):
    deleted_count: int = Field(description="How many memories went to the trash (or would, with dry_run).")
    dry_run: bool


class SeedScope(BaseModel):
    tenant_id: str
    user_id: str
    agent_id: str | None
    session_id: str | None


class SeedMemory(BaseModel):
    """A memory in seed 001's shape (plus tags, importance and access_count)."""

    id: str
    content: str
    memory_type: str
    scope: SeedScope
    pinned: bool
    expires_at: str | None
    source: str | None
    last_recalled_at: str | None
    why_stored: str | None
    created_at: str | None
    updated_at: str | None
    tags: list[str]
    importance: float
    access_count: int
    score: float | None = None


class SeedIngestedMemory(SeedMemory):
    """An extracted memory in seed 001's shape. One deleted since the call stored it (its
    answer made by the ingest reconciler first) has only `id`, `content: null` and `event`."""

    event: str = Field(description="ADD: stored now; NONE: a memory that already held the text.")


class SeedStoreOutput(BaseModel):
    memory: SeedMemory | None = Field(default=None, description="The stored memory (content).")
    duplicate: bool | None = Field(default=None, description="True when the text was already stored.")
    memories: list[SeedIngestedMemory] | None = Field(
        default=None, description="The extracted memories (messages), each with its extraction `event`."
    )


class SeedMemoryOutput(BaseModel):
    memory: SeedMemory


class SeedListOutput(BaseModel):
    memories: list[SeedMemory]
    next_cursor: str | None


class SeedSearchOutput(BaseModel):
    memories: list[SeedMemory]


class PurgeOutput(BaseModel):
    purged: int
