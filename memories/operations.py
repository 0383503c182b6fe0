"""The memory operations as one table, and the ONE dispatcher that MCP tools, REST views
and the web UI all call.

`operation_execute` validates the arguments at the edge, builds the scope from the
authenticated principal, calls the service and shapes the result. Whatever happens the
call leaves exactly one audit row (`memories.call_record`); a call that returns has also
recorded exactly one usage event (billed operations), one that raises, none.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from pydantic import BaseModel

from core.choices import Operation
from core.scope import CallContext, MemoryScope
from memories import schemas
from memories.auth import Principal
from memories.call_record import failures_audited
from memories.services import (
    memory_clear_all,
    memory_delete,
    memory_export,
    memory_get,
    memory_import_file,
    memory_ingest,
    memory_list,
    memory_remember,
    memory_search,
    memory_update,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OperationDef:
    """One entry of the table. `name` is how callers (and MCP tools) ask for it;
    `operation` is what its audit row, usage event and rate limit are recorded under."""

    name: str
    operation: Operation
    title: str
    description: str
    input_model: type[BaseModel]
    output_model: type[BaseModel]
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
    page = memory_list(
        scope,
        cursor=args.cursor,
        page_size=args.page_size,
        filters=args.filters,
        created_from=getattr(args, "created_from", None),
        created_before=getattr(args, "created_before", None),
        call=call,
    )
    return {"memories": [view.as_dict() for view in page.memories], "next_cursor": page.next_cursor}


def _clear_all(scope: MemoryScope, args: schemas.ClearAllInput, call: CallContext) -> dict[str, Any]:
    return {"deleted": memory_clear_all(scope, confirm=args.confirm, call=call)}


def _get(scope: MemoryScope, args: schemas.GetInput, call: CallContext) -> dict[str, Any]:
    return {"memory": memory_get(scope, memory_id=args.memory_id, call=call).as_dict()}


def _export(scope: MemoryScope, args: schemas.ExportInput, call: CallContext) -> dict[str, Any]:
    return memory_export(scope, file_format=args.format, call=call).as_dict()


def _import(scope: MemoryScope, args: schemas.ImportInput, call: CallContext) -> dict[str, Any]:
    return memory_import_file(scope, data=args.data, source=args.source, call=call).as_dict()


OPERATIONS: dict[str, OperationDef] = {
    op.name: op
    for op in [
        OperationDef(
            "search_memory",
            Operation.SEARCH_MEMORY,
            "Search memories",
            "Find what is remembered about the user that is relevant to a query. Newer memories rank higher; "
            "pinned ones never fade.",
            schemas.SearchInput,
            schemas.SearchOutput,
            _search,
            read_only=True,
            idempotent=True,
        ),
        OperationDef(
            "remember",
            Operation.REMEMBER,
            "Remember a fact",
            "Store one curated fact about the user, verbatim (no LLM). Remembering the same text again returns "
            "the existing memory with duplicate=true.",
            schemas.RememberInput,
            schemas.RememberOutput,
            _remember,
            idempotent=True,
        ),
        OperationDef(
            "ingest",
            Operation.INGEST,
            "Ingest a conversation turn",
            "Extract durable facts from conversation messages with the engine's LLM and store them.",
            schemas.IngestInput,
            schemas.IngestOutput,
            _ingest,
        ),
        OperationDef(
            "update_memory",
            Operation.UPDATE_MEMORY,
            "Update a memory",
            "Change a memory's text, pinned state or metadata (metadata is merged).",
            schemas.UpdateInput,
            schemas.MemoryOutput,
            _update,
            destructive=True,
            idempotent=True,
        ),
        OperationDef(
            "delete_memory",
            Operation.DELETE_MEMORY,
            "Delete a memory",
            "Delete one memory by id.",
            schemas.DeleteInput,
            schemas.DeleteOutput,
            _delete,
            destructive=True,
            idempotent=True,
        ),
        OperationDef(
            "list_memory",
            Operation.LIST_MEMORY,
            "List memories",
            "Page through all of the user's memories, oldest first. Pass next_cursor to get the next page.",
            schemas.ListInput,
            schemas.ListOutput,
            _list,
            read_only=True,
            idempotent=True,
        ),
        OperationDef(
            "clear_all_memory",
            Operation.CLEAR_ALL_MEMORY,
            "Delete all memories",
            "Delete every memory of the user. Requires confirm: true; at most 5 times per hour.",
            schemas.ClearAllInput,
            schemas.ClearAllOutput,
            _clear_all,
            destructive=True,
            idempotent=True,
        ),
        # For people, in the web UI (not MCP tools).
        OperationDef(
            "get_memory",
            Operation.GET_MEMORY,
            "Open a memory",
            "One memory with its content.",
            schemas.GetInput,
            schemas.MemoryOutput,
            _get,
            read_only=True,
            idempotent=True,
        ),
        # Taking memories out and bringing them in (REST and the web UI; not MCP tools).
        OperationDef(
            "export_memories",
            Operation.EXPORT_MEMORIES,
            "Export memories",
            "All of your memories with their history, as lossless JSONL or readable Markdown.",
            schemas.ExportInput,
            schemas.ExportOutput,
            _export,
            read_only=True,
            idempotent=True,
        ),
        OperationDef(
            "import_memories",
            Operation.IMPORT_MEMORIES,
            "Import memories",
            "Bring in a memsite export, a mem0 export JSON or an OpenMemory export zip. Texts you already "
            "have are skipped.",
            schemas.ImportInput,
            schemas.ImportOutput,
            _import,
            idempotent=True,
        ),
        OperationDef(
            "list_memory_dated",
            Operation.LIST_MEMORY,
            "List memories created in a date range",
            "A page of the user's memories created in [created_from, created_before).",
            schemas.DatedListInput,
            schemas.ListOutput,
            _list,
            read_only=True,
            idempotent=True,
        ),
    ]
}


def operation_execute(principal: Principal, name: str, arguments: Any, *, call: CallContext) -> dict[str, Any]:
    """Run one operation for the authenticated principal; raises ServiceError.

    Whatever happens, the call leaves exactly one audit row. A call that returns has
    also recorded exactly one usage event (billed operations); one that raises, none."""
    definition = OPERATIONS[name]
    scope = principal.scope()
    call = replace(
        call,
        actor_username=principal.user.get_username(),
        actor_auth=principal.method,
        turn_id=call.turn_id or _turn_id(arguments),
    )
    memory_id = arguments.get("memory_id") if isinstance(arguments, dict) else None
    with failures_audited(scope, call=call, operation=definition.operation, memory_id=memory_id):
        validated = schemas.validate_input(definition.input_model, arguments)
        return definition.run(scope, validated, call)


def _turn_id(arguments: Any) -> str:
    """Agents group a turn's calls by putting turn_id (or session_id) in metadata."""
    metadata = arguments.get("metadata") if isinstance(arguments, dict) else None
    if not isinstance(metadata, dict):
        return ""
    value = metadata.get("turn_id") or metadata.get("session_id")
    return value[:128] if isinstance(value, str) else ""
