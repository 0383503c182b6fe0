"""The seven memory operations as one table, served alike by MCP tools and REST views.

`operation_execute` is the single entry point: validate the arguments at the edge,
build the scope from the authenticated principal, call the service, shape the result.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from pydantic import BaseModel

from memories import schemas
from memories.accounting import failures_audited
from memories.auth import Principal
from memories.scope import CallContext, MemoryScope
from memories.selectors import memory_list, memory_search
from memories.services import (
    memory_clear_all,
    memory_delete,
    memory_ingest,
    memory_remember,
    memory_update,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Operation:
    name: str
    title: str
    description: str
    input_model: type[BaseModel]
    run: Callable[[MemoryScope, Any, CallContext], dict[str, Any]]
    read_only: bool = False
    destructive: bool = False
    idempotent: bool = False


def _search(scope: MemoryScope, args: schemas.SearchInput, call: CallContext) -> dict[str, Any]:
    found = memory_search(scope, query=args.query, top_k=args.top_k, filters=args.filters, call=call)
    return {"results": [view.as_dict() for view in found]}


def _remember(scope: MemoryScope, args: schemas.RememberInput, call: CallContext) -> dict[str, Any]:
    return memory_remember(scope, memory=args.memory, pinned=args.pinned, metadata=args.metadata, call=call).as_dict()


def _ingest(scope: MemoryScope, args: schemas.IngestInput, call: CallContext) -> dict[str, Any]:
    messages = [m.model_dump() for m in args.messages]
    return {"results": memory_ingest(scope, messages=messages, metadata=args.metadata, call=call)}


def _update(scope: MemoryScope, args: schemas.UpdateInput, call: CallContext) -> dict[str, Any]:
    view = memory_update(
        scope, memory_id=args.memory_id, memory=args.memory, pinned=args.pinned, metadata=args.metadata, call=call
    )
    return {"memory": view.as_dict()}


def _delete(scope: MemoryScope, args: schemas.DeleteInput, call: CallContext) -> dict[str, Any]:
    memory_delete(scope, memory_id=args.memory_id, call=call)
    return {"id": args.memory_id, "deleted": True}


def _list(scope: MemoryScope, args: schemas.ListInput, call: CallContext) -> dict[str, Any]:
    page = memory_list(scope, cursor=args.cursor, page_size=args.page_size, filters=args.filters, call=call)
    return {"memories": [view.as_dict() for view in page.memories], "next_cursor": page.next_cursor}


def _clear_all(scope: MemoryScope, args: schemas.ClearAllInput, call: CallContext) -> dict[str, Any]:
    return {"deleted": memory_clear_all(scope, confirm=args.confirm, call=call)}


OPERATIONS: dict[str, Operation] = {
    op.name: op
    for op in [
        Operation(
            "search_memory",
            "Search memories",
            "Find what is remembered about the user that is relevant to a query. Newer memories rank higher; "
            "pinned ones never fade.",
            schemas.SearchInput,
            _search,
            read_only=True,
            idempotent=True,
        ),
        Operation(
            "remember",
            "Remember a fact",
            "Store one curated fact about the user, verbatim (no LLM). Remembering the same text again returns "
            "the existing memory with duplicate=true.",
            schemas.RememberInput,
            _remember,
            idempotent=True,
        ),
        Operation(
            "ingest",
            "Ingest a conversation turn",
            "Extract durable facts from conversation messages with the engine's LLM and store them.",
            schemas.IngestInput,
            _ingest,
        ),
        Operation(
            "update_memory",
            "Update a memory",
            "Change a memory's text, pinned state or metadata (metadata is merged).",
            schemas.UpdateInput,
            _update,
            destructive=True,
            idempotent=True,
        ),
        Operation(
            "delete_memory",
            "Delete a memory",
            "Delete one memory by id.",
            schemas.DeleteInput,
            _delete,
            destructive=True,
            idempotent=True,
        ),
        Operation(
            "list_memory",
            "List memories",
            "Page through all of the user's memories, oldest first. Pass next_cursor to get the next page.",
            schemas.ListInput,
            _list,
            read_only=True,
            idempotent=True,
        ),
        Operation(
            "clear_all_memory",
            "Delete all memories",
            "Delete every memory of the user. Requires confirm: true; at most 5 times per hour.",
            schemas.ClearAllInput,
            _clear_all,
            destructive=True,
            idempotent=True,
        ),
    ]
}


def operation_execute(principal: Principal, name: str, arguments: Any, *, call: CallContext) -> dict[str, Any]:
    """Run one operation for the authenticated principal; raises ServiceError.

    Whatever happens, the call leaves exactly one audit row. A call that returns has
    also recorded exactly one usage event; one that raises, none."""
    operation = OPERATIONS[name]
    scope = principal.scope()
    call = replace(
        call,
        actor_username=principal.user.get_username(),
        actor_auth=principal.method,
        turn_id=call.turn_id or _turn_id(arguments),
    )
    memory_id = arguments.get("memory_id") if isinstance(arguments, dict) else None
    with failures_audited(scope, call=call, operation=name, memory_id=memory_id):
        validated = schemas.validate_input(operation.input_model, arguments)
        return operation.run(scope, validated, call)


def _turn_id(arguments: Any) -> str:
    """Agents group a turn's calls by putting turn_id (or session_id) in metadata."""
    metadata = arguments.get("metadata") if isinstance(arguments, dict) else None
    if not isinstance(metadata, dict):
        return ""
    value = metadata.get("turn_id") or metadata.get("session_id")
    return value[:128] if isinstance(value, str) else ""
