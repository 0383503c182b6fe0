"""Input and output models of the lifecycle tools and prefetch (seed 002 §4, seed 001).

`user_id` is refused with a clear message: scope comes from the token only. Items are
Responses-style JSON objects, checked for shape and size (settings: request bytes, item
count, characters per content part), each limit a `payload_too_large`."""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar

from django.conf import settings
from pydantic import BaseModel, BeforeValidator, Field, StrictInt, StrictStr, field_validator, model_validator
from pydantic_core import PydanticCustomError

from memories.schemas import QUERY_MAX_CHARS, TAG_MAX_CHARS, MemoryOut, Message, ScopeId, StrictInput
from memories.turns.extraction import FACT_MAX_CHARS, FACTS_PER_TURN_MAX, PROJECT_TAG_PREFIX

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
ITEM_TYPES = frozenset({"message", "function_call", "function_call_output"})
ROLES = frozenset({"user", "assistant", "system", "developer", "tool"})

# A project's facts carry the tag `project:<name>`, and a tag is at most TAG_MAX_CHARS
# long: a longer name made facts that an export could not bring back (import refuses them).
PROJECT_MAX_CHARS = TAG_MAX_CHARS - len(PROJECT_TAG_PREFIX)
PROJECT_PATTERN = rf"^$|^[A-Za-z0-9][A-Za-z0-9._:-]{{0,{PROJECT_MAX_CHARS - 1}}}$"


def _project_length(value: Any) -> Any:
    # A long name is told the limit rather than the pattern.
    if isinstance(value, str) and len(value) > PROJECT_MAX_CHARS:
        raise ValueError(f"a project name is at most {PROJECT_MAX_CHARS} characters")
    return value


SessionId = Annotated[StrictStr, Field(pattern=NAME_PATTERN, description="The agent session (1-128 chars).")]
Project = Annotated[
    StrictStr,
    Field(
        default="",
        pattern=PROJECT_PATTERN,
        description=f"Narrows inside your memories (1-{PROJECT_MAX_CHARS} chars).",
    ),
    BeforeValidator(_project_length),  # last: runs first, before the pattern
]
TurnId = Annotated[StrictStr, Field(pattern=NAME_PATTERN, description="The turn's id, unique in the session.")]
Item = dict[str, Any]


def _too_large(message: str) -> PydanticCustomError:
    return PydanticCustomError("payload_too_large", message)


def _item_ok(item: Any) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise ValueError("each item must be an object")
    # Strings first: `in` on a set hashes its operand, and a list there raised TypeError,
    # which pydantic does not turn into a validation error (the call failed as a 500).
    kind = item.get("type", "message")
    if not isinstance(kind, str) or kind not in ITEM_TYPES:
        raise ValueError(f"item type must be one of {sorted(ITEM_TYPES)}")
    limit = settings.MCP_MEMORY_MAX_PART_CHARS
    if kind == "message":
        role = item.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise ValueError(f"a message item needs a role in {sorted(ROLES)}")
        content = item.get("content")
        if isinstance(content, str):
            parts = [content]
        elif isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or not isinstance(part.get("text", ""), str):
                    raise ValueError("content parts must be objects with a text string")
                parts.append(part.get("text", ""))
        else:
            raise ValueError("a message item needs content (a string or a list of parts)")
    elif kind == "function_call":
        name, arguments = item.get("name"), item.get("arguments", "")
        if not isinstance(name, str) or not isinstance(arguments, str):
            raise ValueError("a function_call item needs name and arguments strings")
        parts = [name, arguments]
    else:
        output = item.get("output", "")
        parts = [output if isinstance(output, str) else json.dumps(output)]
    if any(len(p) > limit for p in parts):
        raise _too_large(f"a content part exceeds {limit} characters")
    return item


def _items_ok(value: list[Any], *, required: bool) -> list[dict[str, Any]]:
    if len(value) > settings.MCP_MEMORY_MAX_ITEMS:
        raise _too_large(f"at most {settings.MCP_MEMORY_MAX_ITEMS} items per call")
    if required and not value:
        raise ValueError("at least one item is required")
    return [_item_ok(item) for item in value]


class TurnInput(StrictInput):
    """Common to the lifecycle tools: the size cap and the refused `user_id`.

    `TRANSCRIPT_FIELDS`: the arguments holding the turn's conversation items, kept as they
    came in the session log (JSONB). The edge check (`validate_input`) holds their strings
    to `core.inputs.transcript_text_problem` (NUL and lone surrogates refused, the only
    characters the database cannot keep): a tool output with terminal escapes or a form
    feed is a normal turn. Everything else keeps the full check."""

    TRANSCRIPT_FIELDS: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _envelope(cls, data: Any) -> Any:
        if isinstance(data, dict):
            if "user_id" in data:
                raise ValueError("user_id is not accepted: your memories are chosen by your credentials")
            size = len(json.dumps(data, ensure_ascii=False, default=str).encode())
            if size > settings.MCP_MEMORY_MAX_REQUEST_BYTES:
                raise _too_large(f"the request exceeds {settings.MCP_MEMORY_MAX_REQUEST_BYTES} bytes")
        return data


class BeforeTurnInput(TurnInput):
    TRANSCRIPT_FIELDS: ClassVar[frozenset[str]] = frozenset({"current_input"})

    project: Project = ""
    session_id: SessionId
    turn_id: Annotated[StrictStr, Field(default="", pattern=r"^$|" + NAME_PATTERN)] = ""
    current_input: list[Item] = Field(description="The turn's new input items (Responses-style).")
    base_instructions: Annotated[StrictStr, Field(default="", max_length=32_000)] = ""
    max_input_tok: Annotated[StrictInt, Field(default=120_000, ge=256, le=10_000_000)] = 120_000

    @field_validator("current_input")
    @classmethod
    def _current(cls, value: list[Any]) -> list[dict[str, Any]]:
        return _items_ok(value, required=True)


class BeforeTurnOutput(BaseModel):
    input_items: list[dict[str, Any]]
    recall_fact_ids: list[str]
    context_token_count: int


class AfterTurnInput(TurnInput):
    TRANSCRIPT_FIELDS: ClassVar[frozenset[str]] = frozenset({"input_items", "output_items"})

    project: Project = ""
    session_id: SessionId
    turn_id: TurnId
    input_items: list[Item] = Field(
        default_factory=list,
        description="The turn's new input: the current_input given to memory_before_turn (not its prepared "
        "input_items; if those are sent, the memory notes, summary, instructions and replayed context in them are "
        "recognised and not stored again). Optional after memory_run_turn: its input is kept under the token.",
    )
    output_items: list[Item] = Field(default_factory=list, description="The model's output items.")

    @field_validator("input_items", "output_items")
    @classmethod
    def _items(cls, value: list[Any]) -> list[dict[str, Any]]:
        return _items_ok(value, required=False)

    @model_validator(mode="after")
    def _something(self) -> AfterTurnInput:
        if not self.input_items and not self.output_items:
            raise ValueError("input_items or output_items must hold at least one item")
        if len(self.input_items) + len(self.output_items) > settings.MCP_MEMORY_MAX_ITEMS:
            raise _too_large(f"at most {settings.MCP_MEMORY_MAX_ITEMS} items per call")
        return self


class AfterTurnOutput(BaseModel):
    ok: bool
    duplicate: bool = False
    fact_ids: list[str] = []
    events_stored: int = 0
    input_items_skipped: int = Field(
        0,
        description="Input items not stored because before_turn made them (memory notes, summary, its "
        "instructions) or they replay the session's recent context already in its log.",
    )
    facts_left_out: int = Field(
        0,
        description=f"Extracted facts not stored: past the per-turn limit ({FACTS_PER_TURN_MAX}), or holding "
        "a character a memory's text may not hold. The session log keeps the turn's items whole. A "
        "duplicate (a retried turn id) answers the first call's count.",
    )
    facts_shortened: int = Field(0, description=f"Stored facts cut to {FACT_MAX_CHARS} characters.")


class MaintenanceInput(TurnInput):
    project: Project = ""
    session_id: Annotated[StrictStr, Field(default="", pattern=r"^$|" + NAME_PATTERN)] = ""


class MaintenanceOutput(BaseModel):
    ok: bool
    sessions: int = 0
    compacted_events: int = 0
    expired_facts: int = 0
    summaries_refreshed: int = 0
    # Sessions busy with a turn during the run: their summary waits for the next run.
    summaries_skipped: int = 0
    consolidated_facts: int = 0
    pruned_turn_guards: int = 0


class ListDirInput(TurnInput):
    project: Project = ""
    session_id: Annotated[StrictStr, Field(default="", pattern=r"^$|" + NAME_PATTERN)] = ""
    path: Annotated[
        StrictStr,
        Field(
            default="",
            max_length=512,
            description='Where to list from: "" or "/" (the root), /memory, /memory/<session>, ... '
            "(a session's / and % are written %2F and %25).",
        ),
    ] = ""
    depth: Annotated[
        StrictInt, Field(default=8, ge=0, le=16, description="Levels under path to list (0: path's own entry).")
    ] = 8
    limit: Annotated[StrictInt, Field(default=200, ge=1, le=1000, description="At most this many entries.")] = 200


class DirEntry(BaseModel):
    path: str
    abstract: str
    updated_at: str | None
    has_overview: bool


class ListDirOutput(BaseModel):
    summaries: list[DirEntry]


class RunTurnInput(BeforeTurnInput):
    pass


class RunTurnOutput(BeforeTurnOutput):
    operation_token: str = Field(
        description="Commit the turn with memory_after_turn(turn_id=operation_token, output_items=the model's "
        "output): the current input is kept under the token (for MCP_MEMORY_RUN_TURN_TOKEN_TTL_HOURS, default "
        "24) and stored with the output. The turn_id given, else server-issued."
    )


class PrefetchInput(TurnInput):
    query: Annotated[StrictStr, Field(default="", max_length=QUERY_MAX_CHARS)] = ""
    messages: list[Message] = Field(default_factory=list, max_length=50)
    limit: Annotated[StrictInt | None, Field(default=None, ge=1, le=50)] = None
    project: Project = ""
    # Seed 001's narrower scope (the REST view passes its `scope.agent_id`/`session_id`).
    agent_id: ScopeId | None = None
    session_id: ScopeId | None = None

    @model_validator(mode="after")
    def _one(self) -> PrefetchInput:
        # Blank messages leave nothing to recall for, as a blank query does.
        if not self.query.strip() and not any(m.content.strip() for m in self.messages):
            raise ValueError("give a query or messages")
        return self


class PrefetchOutput(BaseModel):
    notes: str
    memories: list[MemoryOut]


class DeleteSessionEventsInput(TurnInput):
    project: Project = ""
    session_id: SessionId


class DeleteSessionEventsOutput(BaseModel):
    deleted: int
