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
from core.errors import ErrorCode, ServiceError
from core.inputs import text_problem
from core.metrics import call_observed
from core.scope import CallContext, MemoryScope
from memories import schemas
from memories.auth import Principal
from memories.call_record import failures_audited
from memories.services import (
    memory_clear_all,
    memory_delete,
    memory_forget_bulk,
    memory_get,
    memory_ingest,
    memory_list,
    memory_purge,
    memory_remember,
    memory_restore,
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
    found = memory_search(
        scope, query=args.query, top_k=args.top_k, filters=args.filters, field_filters=args.field_filters(), call=call
    )
    return {"results": [view.as_dict() for view in found]}


def _remember(scope: MemoryScope, args: schemas.RememberInput, call: CallContext) -> dict[str, Any]:
    return memory_remember(
        scope, memory=args.memory, pinned=args.pinned, metadata=args.metadata, fields=args.field_changes(), call=call
    ).as_dict()


def _ingest(scope: MemoryScope, args: schemas.IngestInput, call: CallContext) -> dict[str, Any]:
    messages = [m.model_dump() for m in args.messages]
    return {
        "results": memory_ingest(
            scope, messages=messages, metadata=args.metadata, fields=args.field_changes(), call=call
        )
    }


def _update(scope: MemoryScope, args: schemas.UpdateInput, call: CallContext) -> dict[str, Any]:
    view = memory_update(
        scope,
        memory_id=args.memory_id,
        memory=args.memory,
        pinned=args.pinned,
        metadata=args.metadata,
        fields=args.field_changes(),
        call=call,
    )
    return {"memory": view.as_dict()}


def _delete(scope: MemoryScope, args: schemas.DeleteInput, call: CallContext) -> dict[str, Any]:
    if args.memory_id is None:
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
    memory_delete(scope, memory_id=args.memory_id, call=call)
    return {"id": args.memory_id, "deleted": True}


def _forget(scope: MemoryScope, args: schemas.GetInput, call: CallContext) -> dict[str, Any]:
    memory_delete(scope, memory_id=args.memory_id, forget=True, call=call)
    return {"id": args.memory_id, "deleted": True}


def _restore(scope: MemoryScope, args: schemas.RestoreInput, call: CallContext) -> dict[str, Any]:
    return {"restored": memory_restore(scope, memory_id=args.memory_id, request_id=args.request_id, call=call)}


def _purge(scope: MemoryScope, args: schemas.PurgeInput, call: CallContext) -> dict[str, Any]:
    return {"purged": memory_purge(scope, memory_id=args.memory_id, call=call)}


def _list(scope: MemoryScope, args: schemas.ListInput, call: CallContext) -> dict[str, Any]:
    page = memory_list(
        scope,
        cursor=args.cursor,
        page_size=args.page_size,
        filters=args.filters,
        created_from=getattr(args, "created_from", None),
        created_before=getattr(args, "created_before", None),
        field_filters=args.field_filters(),
        call=call,
    )
    return {"memories": [view.as_dict() for view in page.memories], "next_cursor": page.next_cursor}


def _clear_all(scope: MemoryScope, args: schemas.ClearAllInput, call: CallContext) -> dict[str, Any]:
    return {"deleted": memory_clear_all(scope, confirm=args.confirm, call=call)}


def _get(scope: MemoryScope, args: schemas.GetInput, call: CallContext) -> dict[str, Any]:
    return {"memory": memory_get(scope, memory_id=args.memory_id, call=call).as_dict()}


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
            "Delete one memory by id (it goes to the user's trash, restorable for a while). Or bulk forget: "
            "give tags (all must match), time_range {start, end} (ISO 8601, creation time) and/or memory_type "
            "instead of memory_id, with confirm: true; dry_run: true only counts. Returns {deleted_count, dry_run}.",
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
        OperationDef(
            "forget_memory",
            Operation.DELETE_MEMORY,
            "Forget a memory",
            "Delete one memory by id, recorded as a user-initiated forget (seed 001's /forget).",
            schemas.GetInput,
            schemas.DeleteOutput,
            _forget,
            destructive=True,
            idempotent=True,
        ),
        OperationDef(
            "restore_memory",
            Operation.RESTORE_MEMORY,
            "Restore from the trash",
            "Restore one memory, or everything one call deleted (request_id), with the same ids and history.",
            schemas.RestoreInput,
            schemas.RestoreOutput,
            _restore,
        ),
        OperationDef(
            "purge_memory",
            Operation.PURGE_MEMORY,
            "Delete forever",
            "Delete one memory in the trash forever, or empty the trash (all: true).",
            schemas.PurgeInput,
            schemas.PurgeOutput,
            _purge,
            destructive=True,
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


def operation_execute(
    principal: Principal,
    name: str,
    arguments: Any,
    *,
    call: CallContext,
    claimed_scope: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run one operation for the authenticated principal; raises ServiceError.

    `claimed_scope` is a client's own statement of whose memories it means (seed 001's
    `scope.tenant_id` / `scope.user_id`): it never selects anything, it is only checked
    against the principal, and a mismatch is refused (`forbidden`, audited as denied).

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
    if not isinstance(memory_id, str) or text_problem(memory_id):
        memory_id = None  # the audit row of a bad call must still be writable (no NUL)
    with call_observed(operation=definition.operation, channel=call.channel) as observed:  # metrics
        try:
            with failures_audited(scope, call=call, operation=definition.operation, memory_id=memory_id):
                principal_permission_check(principal, definition)
                if claimed_scope is not None:
                    principal_claim_check(principal, claimed_scope)
                validated = schemas.validate_input(definition.input_model, arguments)
                return definition.run(scope, validated, call)
        except ServiceError as error:
            observed.failed(code=error.code, denied=error.denied)
            raise


# Issue 12 owns permissions (it declares one per operation and filters tools/list); until
# it lands, this minimal check gives OAuth grants (issue 16) their granted scopes.
_DELETE_OPERATIONS = frozenset({"delete_memory", "clear_all_memory", "forget_memory", "purge_memory"})


def operation_permission(definition: OperationDef) -> str:
    if definition.read_only:
        return "read"
    return "delete" if definition.name in _DELETE_OPERATIONS else "write"


def principal_permission_check(principal: Principal, definition: OperationDef) -> None:
    needed = operation_permission(definition)
    if needed not in principal.permissions:
        raise ServiceError(
            ErrorCode.FORBIDDEN, f"This credential does not have the '{needed}' permission.", denied=True
        )


def principal_claim_check(principal: Principal, claimed: dict[str, Any]) -> None:
    """A named tenant and user must be the caller's own (delegation is a later issue)."""
    scope = principal.scope()
    tenant, user = claimed.get("tenant_id"), claimed.get("user_id")
    if tenant is not None and tenant != scope.tenant:
        raise ServiceError(ErrorCode.FORBIDDEN, "scope.tenant_id must be your own tenant.", denied=True)
    if user is not None and user != principal.user.get_username():
        raise ServiceError(ErrorCode.FORBIDDEN, "scope.user_id must be your own user id.", denied=True)


def _turn_id(arguments: Any) -> str:
    """Agents group a turn's calls by putting turn_id (or session_id) in metadata."""
    metadata = arguments.get("metadata") if isinstance(arguments, dict) else None
    if not isinstance(metadata, dict):
        return ""
    value = metadata.get("turn_id") or metadata.get("session_id")
    return value[:128] if isinstance(value, str) and not text_problem(value) else ""
