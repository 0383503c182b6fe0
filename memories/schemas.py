"""Input and output models of the memory operations: one validation path for MCP, REST
and the web UI, and the `outputSchema` each MCP tool declares.

Strict types (no "5" for 5), unknown fields refused (so no client-supplied `user_id`
can ride along), sizes capped. `validate_input` turns any violation into a
ServiceError with code `invalid_argument` or `payload_too_large`.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from core.errors import ErrorCode, ServiceError
from memories.engine import ENGINE_RESERVED_METADATA_KEYS

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
CURSOR_MAX_CHARS = 512

# Keys the engine or the service owns; clients may not set or filter on them.
RESERVED_KEYS = ENGINE_RESERVED_METADATA_KEYS | {"tenant", "client_app", "source", "pinned"}
_KEY_PATTERN = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]*$")

Scalar = StrictStr | StrictBool | int | float | None
TopK = Annotated[int, Field(ge=1, le=TOP_K_MAX, strict=True)]
PageSize = Annotated[int, Field(ge=1, le=PAGE_SIZE_MAX, strict=True)]


def _too_large(message: str) -> PydanticCustomError:
    return PydanticCustomError("payload_too_large", message)


def _check_keys(values: dict[str, Any], *, what: str, max_keys: int, allow: frozenset[str] = frozenset()) -> None:
    if len(values) > max_keys:
        raise _too_large(f"{what} may have at most {max_keys} keys")
    for key in values:
        if len(key) > METADATA_KEY_MAX_CHARS or not _KEY_PATTERN.match(key) or "__" in key:
            raise ValueError(f"{what} key {key[:80]!r} must be 1-64 letters, digits, '_', '.', '-' (no '__')")
        if key in RESERVED_KEYS and key not in allow:
            raise ValueError(f"{what} key {key!r} is reserved")


class StrictInput(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class MetadataMixin(StrictInput):
    metadata: dict[str, Scalar] | None = Field(
        default=None,
        description=f"Your own key/value labels (at most {METADATA_MAX_KEYS} keys; strings up to "
        f"{METADATA_VALUE_MAX_CHARS} characters).",
    )

    @field_validator("metadata")
    @classmethod
    def _metadata_ok(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None:
            return None
        _check_keys(value, what="metadata", max_keys=METADATA_MAX_KEYS)
        for key, item in value.items():
            if isinstance(item, str) and len(item) > METADATA_VALUE_MAX_CHARS:
                raise _too_large(f"metadata value for {key!r} exceeds {METADATA_VALUE_MAX_CHARS} characters")
        if len(json.dumps(value)) > METADATA_MAX_BYTES:
            raise _too_large(f"metadata exceeds {METADATA_MAX_BYTES} bytes")
        return value


class FiltersMixin(StrictInput):
    filters: dict[str, Scalar] | None = Field(
        default=None, description="Exact-match filters on your metadata keys, or on `pinned` (true/false)."
    )

    @field_validator("filters")
    @classmethod
    def _filters_ok(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None:
            return None
        _check_keys(value, what="filters", max_keys=FILTERS_MAX_KEYS, allow=frozenset({"pinned"}))
        if "pinned" in value and not isinstance(value["pinned"], bool):
            raise ValueError("filters.pinned must be true or false")
        return value


def _non_blank(value: str) -> str:
    if not value.strip():
        raise ValueError("must not be blank")
    return value


MemoryText = Annotated[StrictStr, Field(min_length=1, max_length=MEMORY_MAX_CHARS)]
MemoryId = Annotated[StrictStr, Field(min_length=1, max_length=64, description="The memory's id (a UUID).")]


class RememberInput(MetadataMixin):
    memory: MemoryText = Field(description="One curated fact about the user, stored verbatim.")
    pinned: StrictBool = Field(default=False, description="Pinned memories never lose rank with age.")

    _blank = field_validator("memory")(_non_blank)


class Message(StrictInput):
    role: Literal["user", "assistant", "system"]
    content: Annotated[StrictStr, Field(min_length=1, max_length=MEMORY_MAX_CHARS)]


class IngestInput(MetadataMixin):
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


class SearchInput(FiltersMixin):
    query: Annotated[StrictStr, Field(min_length=1, max_length=QUERY_MAX_CHARS)]
    top_k: TopK = 10

    _blank = field_validator("query")(_non_blank)


def _uuid_text(value: str) -> str:
    try:
        return str(uuid.UUID(value))
    except ValueError:
        raise ValueError("memory_id must be a UUID") from None


class UpdateInput(MetadataMixin):
    memory_id: MemoryId
    memory: MemoryText | None = Field(default=None, description="New text (re-embedded).")
    pinned: StrictBool | None = None

    _uuid = field_validator("memory_id")(_uuid_text)

    @field_validator("memory")
    @classmethod
    def _memory_non_blank(cls, value: str | None) -> str | None:
        return None if value is None else _non_blank(value)

    @model_validator(mode="after")
    def _something_to_change(self) -> UpdateInput:
        if self.memory is None and self.pinned is None and self.metadata is None:
            raise ValueError("give at least one of memory, pinned, metadata")
        return self


class DeleteInput(StrictInput):
    memory_id: MemoryId

    _uuid = field_validator("memory_id")(_uuid_text)


class ListInput(FiltersMixin):
    cursor: Annotated[StrictStr, Field(max_length=CURSOR_MAX_CHARS)] | None = Field(
        default=None, description="`next_cursor` from the previous page."
    )
    page_size: PageSize = PAGE_SIZE_DEFAULT


class ClearAllInput(StrictInput):
    confirm: StrictBool = Field(default=False, description="Must be true: this deletes every memory of yours.")


class GetInput(StrictInput):
    memory_id: MemoryId

    _uuid = field_validator("memory_id")(_uuid_text)


class DatedListInput(ListInput):
    """The web UI's list: a page of memories created in [created_from, created_before)."""

    created_from: Annotated[StrictStr, Field(max_length=40)] | None = None
    created_before: Annotated[StrictStr, Field(max_length=40)] | None = None


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
    id: str
    deleted: bool


class ListOutput(BaseModel):
    memories: list[MemoryOut]
    next_cursor: str | None = Field(description="Pass as `cursor` for the next page; null on the last page.")


class ClearAllOutput(BaseModel):
    deleted: int = Field(description="How many memories were deleted.")


class ExportOutput(BaseModel):
    content: str
    format: str
    count: int = Field(description="How many memories the file holds.")


class ImportOutput(BaseModel):
    imported: int = Field(description="Memories added.")
    duplicates: int = Field(description="Memories skipped because you already had the same text.")
    ids: list[str]


def _describe(error: Any) -> str:
    where = ".".join(str(p) for p in error.get("loc", ())) or "arguments"
    if error["type"] == "extra_forbidden":
        return f"unexpected argument {where!r}"
    message = error["msg"].removeprefix("Value error, ")
    return f"{where}: {message}"


def validate_input[T: BaseModel](model: type[T], arguments: Any) -> T:
    if not isinstance(arguments, dict):
        raise ServiceError(ErrorCode.INVALID_ARGUMENT, "arguments must be a JSON object")
    try:
        return model.model_validate(arguments)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False)
        too_large = any(e["type"] in ("payload_too_large", "string_too_long", "too_long") for e in errors)
        code = ErrorCode.PAYLOAD_TOO_LARGE if too_large else ErrorCode.INVALID_ARGUMENT
        raise ServiceError(code, "; ".join(_describe(e) for e in errors[:5])) from None
