"""The memory operations as one table, and the ONE dispatcher that MCP tools, REST views
and the web UI all call.

`operation_execute` validates the arguments at the edge, builds the scope from the
authenticated principal, calls the service and shapes the result. Whatever happens the
call leaves exactly one audit row (`memories.call_record`); a call that returns has also
recorded exactly one usage event (billed operations), one that raises, none.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from pydantic import BaseModel

from core.calls import subject_claim_of
from core.choices import ALL_PERMISSIONS, Operation, Permission
from core.errors import ErrorCode, ServiceError
from core.inputs import text_problem
from core.metrics import call_observed, lines_observed
from core.scope import CallContext, MemoryScope
from memories import schemas
from memories.auth import Principal
from memories.call_record import failures_audited
from memories.services import (
    memory_clear_all,
    memory_delete,
    memory_delete_dry_run,
    memory_export,
    memory_export_stream,
    memory_forget_bulk,
    memory_get,
    memory_import_file,
    memory_ingest,
    memory_list,
    memory_purge,
    memory_remember,
    memory_restore,
    memory_search,
    memory_trash_read,
    memory_update,
)
from memories.tenancy import subject_parse, subject_resolve

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
    # Issue 14: the MCP tool's name when it differs from `name` (seed 003's delete_memory).
    tool_name: str = ""
    open_world: bool = False
    # Issue 12: the permission (core.choices.Permission) a credential needs to call it.
    # Undeclared ("") fails closed: only a credential holding every permission may call it.
    permission: str = ""
    # Needed as well, for an operation whose effects span two permissions (maintenance
    # writes, and also trashes and deletes facts).
    also_requires: frozenset[str] = frozenset()
    # A file streamed line by line (`operation_stream`: REST's export) instead of `run`'s
    # one result built whole. It audits its own refusals, as `memory_export_stream` does.
    stream: Callable[[MemoryScope, Any, CallContext], Iterator[str]] | None = None
    # `run`, also answering `extras`: keys that are no part of the operation's answer (its
    # output model), which `operation_run(with_extras=True)` hands to its caller beside it
    # (seed 001's store answers the memory as stored, read in the store's transaction).
    # A separate run so that every other caller does not pay for reading them.
    run_with_extras: Callable[[MemoryScope, Any, CallContext], dict[str, Any]] | None = None
    extras: frozenset[str] = frozenset()

    @property
    def required_permissions(self) -> frozenset[str]:
        return frozenset({self.permission}) | self.also_requires if self.permission else ALL_PERMISSIONS

    def permitted(self, permissions: frozenset[str]) -> bool:
        return permissions >= self.required_permissions

    def refusal(self, permissions: frozenset[str]) -> str:
        """Why a credential holding `permissions` may not call it (names no secret), by the
        name the caller knows it by (the toolkit's `delete_memory`, not its operation name)."""
        called = self.tool_name or self.name
        if not self.permission:
            return f"This credential lacks the every permission {called} needs."
        missing = [p for p in (self.permission, *sorted(self.also_requires)) if p not in permissions]
        plural = "s" if len(missing) > 1 else ""
        return f"This credential lacks the {' and '.join(missing)} permission{plural} {called} needs."


def _search(scope: MemoryScope, args: schemas.SearchInput, call: CallContext) -> dict[str, Any]:
    found = memory_search(
        scope, query=args.query, top_k=args.top_k, filters=args.filters, field_filters=args.field_filters(), call=call
    )
    return {"results": [view.as_dict() for view in found]}


def _remember(
    scope: MemoryScope, args: schemas.RememberInput, call: CallContext, *, with_memory: bool = False
) -> dict[str, Any]:
    result = memory_remember(
        scope,
        memory=args.memory,
        pinned=args.pinned,
        metadata=args.metadata,
        fields=args.field_changes(),
        call=call,
        with_memory=with_memory,
    )
    if result.memory is None:
        return result.as_dict()
    return {**result.as_dict(), "memory": result.memory.as_dict()}  # `memory`: an extra


def _remember_with_memory(scope: MemoryScope, args: schemas.RememberInput, call: CallContext) -> dict[str, Any]:
    return _remember(scope, args, call, with_memory=True)


def _ingest(
    scope: MemoryScope, args: schemas.IngestInput, call: CallContext, *, with_stored: bool = False
) -> dict[str, Any]:
    messages = [m.model_dump() for m in args.messages]
    results = memory_ingest(
        scope,
        messages=messages,
        metadata=args.metadata,
        fields=args.field_changes(),
        call=call,
        with_stored=with_stored,
    )
    if not with_stored:
        return {"results": results}
    # `stored` (each memory whole, as the call left it: an extra) beside the answer's results.
    return {
        "results": [{key: value for key, value in r.items() if key != "stored"} for r in results],
        "stored": [{**(r["stored"] or {"id": r["id"]}), "event": r["event"]} for r in results],
    }


def _ingest_with_stored(scope: MemoryScope, args: schemas.IngestInput, call: CallContext) -> dict[str, Any]:
    return _ingest(scope, args, call, with_stored=True)


def _update(scope: MemoryScope, args: schemas.UpdateInput, call: CallContext) -> dict[str, Any]:
    view = memory_update(
        scope,
        memory_id=args.memory_id,
        memory=args.memory,
        pinned=args.pinned,
        metadata=args.metadata,
        fields=args.field_changes(),
        within=dict(call.narrowed_to),
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
    if args.dry_run:  # count, change nothing: as a bulk forget's dry run and the toolkit's delete
        ids = memory_delete_dry_run(scope, memory_id=args.memory_id, within=dict(call.narrowed_to), call=call)
        return {"id": args.memory_id, "deleted": False, "deleted_count": len(ids), "dry_run": True}
    memory_delete(scope, memory_id=args.memory_id, within=dict(call.narrowed_to), call=call)
    return {"id": args.memory_id, "deleted": True}


def _forget(scope: MemoryScope, args: schemas.GetInput, call: CallContext) -> dict[str, Any]:
    memory_delete(scope, memory_id=args.memory_id, forget=True, within=dict(call.narrowed_to), call=call)
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


def _export(scope: MemoryScope, args: schemas.ExportInput, call: CallContext) -> dict[str, Any]:
    return memory_export(scope, file_format=args.format, call=call).as_dict()


def _export_lines(scope: MemoryScope, args: schemas.ExportInput, call: CallContext) -> Iterator[str]:
    return memory_export_stream(scope, file_format=args.format, call=call)


def _import(scope: MemoryScope, args: schemas.ImportInput, call: CallContext) -> dict[str, Any]:
    return memory_import_file(scope, data=args.data, source=args.source, call=call).as_dict()


def _list_trash(scope: MemoryScope, args: schemas.TrashListInput, call: CallContext) -> dict[str, Any]:
    page = memory_trash_read(scope, cursor=args.cursor, page_size=args.page_size, call=call)
    return {"memories": [item.as_dict() for item in page.items], "next_cursor": page.next_cursor}


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
            permission=Permission.READ,
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
            permission=Permission.WRITE,
            run_with_extras=_remember_with_memory,
            extras=frozenset({"memory"}),
        ),
        OperationDef(
            "ingest",
            Operation.INGEST,
            "Ingest a conversation turn",
            "Extract durable facts from conversation messages with the engine's LLM and store them.",
            schemas.IngestInput,
            schemas.IngestOutput,
            _ingest,
            permission=Permission.WRITE,
            run_with_extras=_ingest_with_stored,
            extras=frozenset({"stored"}),
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
            permission=Permission.WRITE,
        ),
        OperationDef(
            "delete_memory",
            Operation.DELETE_MEMORY,
            "Delete a memory",
            "Delete one memory by id (it goes to the user's trash, restorable for a while; dry_run: true only "
            "counts it and its linked twin, returning {id, deleted: false, deleted_count, dry_run}). Or bulk forget: "
            "give tags (all must match), time_range {start, end} (ISO 8601, creation time) and/or memory_type "
            "instead of memory_id, with confirm: true; dry_run: true only counts. Returns {deleted_count, dry_run}.",
            schemas.DeleteInput,
            schemas.DeleteOutput,
            _delete,
            destructive=True,
            idempotent=True,
            permission=Permission.DELETE,
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
            permission=Permission.READ,
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
            permission=Permission.DELETE,
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
            permission=Permission.READ,
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
            stream=_export_lines,
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
            "forget_memory",
            Operation.DELETE_MEMORY,
            "Forget a memory",
            "Delete one memory by id, recorded as a user-initiated forget (seed 001's /forget).",
            schemas.GetInput,
            schemas.DeleteOutput,
            _forget,
            destructive=True,
            idempotent=True,
            permission=Permission.DELETE,
        ),
        OperationDef(
            "restore_memory",
            Operation.RESTORE_MEMORY,
            "Restore from the trash",
            "Restore one memory, or everything one call deleted (request_id), with the same ids and history.",
            schemas.RestoreInput,
            schemas.RestoreOutput,
            _restore,
            permission=Permission.WRITE,
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
            permission=Permission.DELETE,
        ),
        # GET /v1/trash (REST only; not an MCP tool).
        OperationDef(
            "list_trash",
            Operation.LIST_MEMORY,
            "List the trash",
            "Your deleted memories that can still be restored, most recently deleted first.",
            schemas.TrashListInput,
            schemas.TrashListOutput,
            _list_trash,
            read_only=True,
            idempotent=True,
            permission=Permission.READ,
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
            permission=Permission.READ,
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
    return operation_run(principal, name, arguments, call=call, claimed_scope=claimed_scope).answer


@dataclass(frozen=True)
class OperationRan:
    answer: dict[str, Any]  # what `operation_execute` answers
    extras: dict[str, Any]  # the definition's `extras` the run returned
    principal: Principal  # whom the call ran as: the caller, or the subject it acted for


def operation_run(
    principal: Principal,
    name: str,
    arguments: Any,
    *,
    call: CallContext,
    claimed_scope: dict[str, Any] | None = None,
    with_extras: bool = False,
) -> OperationRan:
    """`operation_execute`, also answering whom the call ran as (resolved once, when it was
    admitted: never again after the call, when a change committed meanwhile could refuse
    it) and, `with_extras`, the operation's `extras` (by its `run_with_extras`)."""
    definition = OPERATIONS[name]
    subject = call.subject
    call = _call_of(principal, call, arguments, claimed_scope=claimed_scope)
    memory_id = _memory_id_of(arguments)
    with call_observed(operation=definition.operation, channel=call.channel):  # metrics, refusals by code
        effective, scope, validated = _admitted(
            principal,
            definition,
            arguments,
            call=call,
            subject=subject,
            memory_id=memory_id,
            claimed_scope=claimed_scope,
        )
        with failures_audited(scope, call=call, operation=definition.operation, memory_id=memory_id):
            run = definition.run_with_extras if with_extras and definition.run_with_extras else definition.run
            result = run(scope, validated, call)
    answer = {key: value for key, value in result.items() if key not in definition.extras}
    extras = {key: value for key, value in result.items() if key in definition.extras}
    return OperationRan(answer=answer, extras=extras, principal=effective)


def operation_stream(principal: Principal, name: str, arguments: Any, *, call: CallContext) -> Iterator[str]:
    """An operation whose answer is a file, as lines to stream (REST's export): admitted
    and audited as `operation_execute` does, counted in the metrics until its last line.
    A refusal raises ServiceError before any line."""
    definition = OPERATIONS[name]
    stream = definition.stream
    if stream is None:
        raise ValueError(f"{name} is not streamed")
    subject = call.subject
    call = _call_of(principal, call, arguments)

    def start() -> Iterator[str]:
        _effective, scope, validated = _admitted(
            principal, definition, arguments, call=call, subject=subject, memory_id=_memory_id_of(arguments)
        )
        return stream(scope, validated, call)  # audits its own refusals and its success

    return lines_observed(operation=definition.operation, channel=call.channel, start=start)


def _call_of(
    principal: Principal, call: CallContext, arguments: Any, *, claimed_scope: dict[str, Any] | None = None
) -> CallContext:
    """The call as its audit row names it: who acts, how, and whom it claims to act for."""
    header_subject = call.subject
    claim = header_subject
    if not claim and claimed_scope:  # only then: the caller's tenant may cost a query
        claim = subject_claim_of(claimed_scope, tenant=principal.tenant_name, username=principal.user.get_username())
    return replace(
        principal.call_attributed(call),
        turn_id=call.turn_id or _turn_id(arguments),
        narrowed_to=_narrowed_to(claimed_scope),
        # Whom the call claims to act for, on its audit row even when refused: the header,
        # or else seed 001's scope claim.
        subject=claim,
    )


def _narrowed_to(claimed_scope: dict[str, Any] | None) -> tuple[tuple[str, str], ...]:
    claimed = claimed_scope or {}
    return tuple((key, claimed[key]) for key in ("agent_id", "session_id") if claimed.get(key))


def _memory_id_of(arguments: Any) -> str | None:
    memory_id = arguments.get("memory_id") if isinstance(arguments, dict) else None
    if not isinstance(memory_id, str) or text_problem(memory_id):
        return None  # the audit row of a bad call must still be writable (no NUL)
    return memory_id


def _admitted(
    principal: Principal,
    definition: OperationDef,
    arguments: Any,
    *,
    call: CallContext,
    subject: str,
    memory_id: str | None,
    claimed_scope: dict[str, Any] | None = None,
) -> tuple[Principal, MemoryScope, Any]:
    """Whom the call runs as (the principal, or the `X-Memory-Subject` it may act for),
    the scope it runs in and its validated arguments; a refusal (whom it acts for, its
    permission, its scope claim, its arguments) raises ServiceError, audited."""
    # Whose memories: the principal's own, or a subject it may act for (audited under the
    # caller's own scope when refused).
    with failures_audited(principal.scope(), call=call, operation=definition.operation, memory_id=memory_id):
        effective = principal_effective(principal, subject=subject, claimed=claimed_scope)
    scope = effective.scope()
    with failures_audited(scope, call=call, operation=definition.operation, memory_id=memory_id):
        if not definition.permitted(principal.permissions):
            raise ServiceError(ErrorCode.FORBIDDEN, definition.refusal(principal.permissions), denied=True)
        if claimed_scope is not None:
            principal_claim_check(effective, claimed_scope)
        validated = schemas.validate_input(definition.input_model, arguments)
        return effective, scope, validated


def principal_effective(principal: Principal, *, subject: str = "", claimed: dict[str, Any] | None = None) -> Principal:
    """The principal a call runs as: the caller itself, or (issue 12) the subject named by
    the `X-Memory-Subject` header or seed 001's `scope.tenant_id`/`scope.user_id`, when
    the caller's role allows it (`memories.tenancy.subject_resolve`). Raises ServiceError."""
    if principal.actor is not None:
        return principal  # already resolved
    if subject:
        tenant, username = subject_parse(subject)
    elif claimed and isinstance(claimed.get("user_id"), str):
        tenant, username = str(claimed.get("tenant_id") or principal.tenant_name), claimed["user_id"]
    else:
        return principal
    user = subject_resolve(
        actor_tenant=principal.tenant_name,
        actor_user=principal.user,
        role=principal.role,
        tenant=tenant,
        username=username,
    )
    return principal.acting_for(user, tenant=tenant)


def principal_claim_check(principal: Principal, claimed: dict[str, Any]) -> None:
    """A named tenant and user must be those the call runs as (its own, or the subject
    it acts for)."""
    tenant, user = claimed.get("tenant_id"), claimed.get("user_id")
    if tenant is not None and tenant != principal.tenant_name:
        raise ServiceError(ErrorCode.FORBIDDEN, "scope.tenant_id must be your own tenant.", denied=True)
    if user is not None and user != principal.user.get_username():
        raise ServiceError(ErrorCode.FORBIDDEN, "scope.user_id must be your own user id.", denied=True)


def operations_permitted(permissions: frozenset[str]) -> set[str]:
    """The operation names a credential with `permissions` may call (MCP tools/list)."""
    return {name for name, definition in OPERATIONS.items() if definition.permitted(permissions)}


def _turn_id(arguments: Any) -> str:
    """Agents group a turn's calls by putting turn_id (or session_id) in metadata."""
    metadata = arguments.get("metadata") if isinstance(arguments, dict) else None
    if not isinstance(metadata, dict):
        return ""
    value = metadata.get("turn_id") or metadata.get("session_id")
    return value[:128] if isinstance(value, str) and not text_problem(value) else ""


# --- The agent turn lifecycle (issue 13, seed 002) and prefetch (seed 001) --------------------
def _turn_operations() -> list[OperationDef]:
    from memories.turns import schemas as turn_schemas
    from memories.turns import services as turns

    def before(scope: MemoryScope, args: Any, call: CallContext) -> dict[str, Any]:
        return turns.turn_before(
            scope,
            project=args.project,
            session_id=args.session_id,
            turn_id=args.turn_id,
            current_input=args.current_input,
            base_instructions=args.base_instructions,
            max_input_tok=args.max_input_tok,
            call=call,
        )

    def after(scope: MemoryScope, args: Any, call: CallContext) -> dict[str, Any]:
        return turns.turn_after(
            scope,
            project=args.project,
            session_id=args.session_id,
            turn_id=args.turn_id,
            input_items=args.input_items,
            output_items=args.output_items,
            call=call,
        )

    def maintenance(scope: MemoryScope, args: Any, call: CallContext) -> dict[str, Any]:
        return turns.turn_maintenance_run(scope, project=args.project, session_id=args.session_id, call=call)

    def list_dir(scope: MemoryScope, args: Any, call: CallContext) -> dict[str, Any]:
        return turns.turn_dir_list(
            scope,
            project=args.project,
            session_id=args.session_id,
            path=args.path,
            depth=args.depth,
            limit=args.limit,
            call=call,
        )

    def run_turn(scope: MemoryScope, args: Any, call: CallContext) -> dict[str, Any]:
        return turns.turn_run(
            scope,
            project=args.project,
            session_id=args.session_id,
            turn_id=args.turn_id,
            current_input=args.current_input,
            base_instructions=args.base_instructions,
            max_input_tok=args.max_input_tok,
            call=call,
        )

    def prefetch(scope: MemoryScope, args: Any, call: CallContext) -> dict[str, Any]:
        return turns.memory_prefetch(
            scope,
            query=args.query,
            messages=[m.model_dump() for m in args.messages],
            limit=args.limit,
            project=args.project,
            agent_id=args.agent_id,
            session_id=args.session_id,
            call=call,
        )

    def delete_events(scope: MemoryScope, args: Any, call: CallContext) -> dict[str, Any]:
        deleted = turns.session_events_delete(scope, project=args.project, session_id=args.session_id, call=call)
        return {"deleted": deleted}

    s = turn_schemas
    return [
        OperationDef(
            "memory_before_turn",
            Operation.MEMORY_BEFORE_TURN,
            "Prepare a turn's model input",
            "Call before each model turn with the new input items (Responses-style). Returns input_items to send "
            "to the model: a block of relevant remembered facts, the session's summary and recent context, then "
            "the current input (older context is compacted past compact_threshold x max_input_tok), with "
            "recall_fact_ids and context_token_count.",
            s.BeforeTurnInput,
            s.BeforeTurnOutput,
            before,
            read_only=True,
        ),
        OperationDef(
            "memory_after_turn",
            Operation.MEMORY_AFTER_TURN,
            "Commit a finished turn",
            "Call after each model turn with its input_items (the turn's current input, not before_turn's "
            "prepared items: notes, summary and replayed context in them are not stored again) and output_items: "
            "stores them in the session's log "
            "and extracts durable facts (tiered: l1 a day, l2 a week, long-term). Exactly once per turn_id: a "
            "retry with the same items answers duplicate=true, the same turn_id with other items is refused "
            "(conflict, nothing stored); resource_busy means the turn or session is busy, retry shortly.",
            s.AfterTurnInput,
            s.AfterTurnOutput,
            after,
            idempotent=True,
        ),
        OperationDef(
            "memory_run_maintenance",
            Operation.MEMORY_RUN_MAINTENANCE,
            "Run memory maintenance",
            "Compact old raw events into archives, drop facts past their tier's retention, refresh session "
            "summaries and merge near-duplicate facts. For one session, or every session of the project. Safe to "
            "re-run.",
            s.MaintenanceInput,
            s.MaintenanceOutput,
            maintenance,
            idempotent=True,
        ),
        OperationDef(
            "memory_list_dir_with_abstract",
            Operation.MEMORY_LIST_DIR_WITH_ABSTRACT,
            "List what memory keeps",
            "The memory tree: / holds /memory (a directory per session: meta, events, archives/<first>-<last>) "
            'and /memory_tiers (l1, l2, long_term facts). Lists the entry at path ("" is /) and those up to '
            "depth levels under it, directories first, each with its abstract, updated_at and has_overview; the "
            "first limit of them.",
            s.ListDirInput,
            s.ListDirOutput,
            list_dir,
            read_only=True,
            idempotent=True,
        ),
        OperationDef(
            "memory_run_turn",
            Operation.MEMORY_RUN_TURN,
            "Start a server-orchestrated turn",
            "memory_before_turn plus an operation_token; the current input is kept under the token. Send the "
            "model's output later with memory_after_turn (turn_id = operation_token, output_items = the output; "
            "input_items not needed): the turn is stored with its input, exactly once. An unknown or expired "
            "server-issued token is refused (not_found) unless input_items are sent.",
            s.RunTurnInput,
            s.RunTurnOutput,
            run_turn,
        ),
        OperationDef(
            "memory_prefetch",
            Operation.MEMORY_PREFETCH,
            "Prefetch notes",
            "Relevant memories for a query or messages, as a ready-to-inject notes block and the memories.",
            s.PrefetchInput,
            s.PrefetchOutput,
            prefetch,
            read_only=True,
            idempotent=True,
        ),
        OperationDef(
            "delete_session_events",
            Operation.DELETE_SESSION_EVENTS,
            "Delete a session's raw events",
            "Delete one session's raw events and archives (the facts extracted from it stay).",
            s.DeleteSessionEventsInput,
            s.DeleteSessionEventsOutput,
            delete_events,
            destructive=True,
            idempotent=True,
        ),
    ]


OPERATIONS.update({op.name: op for op in _turn_operations()})


# Issue 14: seed 003's toolkit operations (memories/toolkit/), served at /engines/memory-toolkit/mcp.
from memories.toolkit.operations import toolkit_operation_defs  # noqa: E402

OPERATIONS.update({op.name: op for op in toolkit_operation_defs(OperationDef)})


# Issue 12: the permission of the operations built beside it (export/import, the turn
# lifecycle, seed 003's toolkit), declared in one place when the branches met.
_LATER_PERMISSIONS = {
    "export_memories": Permission.READ,
    "import_memories": Permission.WRITE,
    "memory_before_turn": Permission.READ,
    "memory_after_turn": Permission.WRITE,
    "memory_run_maintenance": Permission.WRITE,
    "memory_list_dir_with_abstract": Permission.READ,
    "memory_run_turn": Permission.READ,
    "memory_prefetch": Permission.READ,
    "delete_session_events": Permission.DELETE,
    "store_memory": Permission.WRITE,
    "recall_memory": Permission.READ,
    "toolkit_delete_memory": Permission.DELETE,
    "check_cache": Permission.READ,
    "store_cache": Permission.WRITE,
    "hybrid_search": Permission.READ,
    "search_web": Permission.READ,
    "memory_health": Permission.READ,
    "wipe_user_data": Permission.DELETE,
    "cache_invalidate": Permission.DELETE,
    "store_decision": Permission.WRITE,
    "recall_decision": Permission.READ,
}
for _name, _permission in _LATER_PERMISSIONS.items():
    if not OPERATIONS[_name].permission:
        OPERATIONS[_name] = replace(OPERATIONS[_name], permission=_permission)
# Maintenance also trashes facts (consolidation) and deletes expired ones (retention): a
# write-only credential must not reach deletions through it.
OPERATIONS["memory_run_maintenance"] = replace(
    OPERATIONS["memory_run_maintenance"], also_requires=frozenset({Permission.DELETE})
)
