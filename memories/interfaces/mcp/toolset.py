"""One MCP toolset abstraction: a table of operations served as an MCP server at
/engines/<id>/mcp (official `mcp` SDK, low-level server, stateless, JSON responses).

We use the SDK's low-level server so that argument validation is ours: every bad
argument becomes a tool result with `isError: true` and a stable `code`, exactly like
the REST API's errors. Unknown tools and malformed requests are JSON-RPC errors.
Authentication happens before the SDK sees the request (`BearerAuthMiddleware`), and
every tool call goes through `memories.operations.operation_execute`.

A new toolset is a `Toolset(...)` naming its operations, added to `registry.TOOLSETS`;
memsite/asgi.py routes its path and runs its lifespan.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any, cast

import mcp_types as types
from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import close_old_connections
from mcp.server.lowlevel import Server
from mcp.server.transport_security import TransportSecuritySettings
from mcp.shared.exceptions import MCPError
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse

from audit.services import auth_failure_record
from core.calls import call_context_from_request
from core.choices import Channel
from core.errors import ErrorCode, ServiceError
from core.scope import CallContext
from memories.auth import Principal, authenticate_bearer
from memories.interfaces.wellknown import mcp_path, public_base_url, www_authenticate
from memories.operations import OPERATIONS, OperationDef, operation_execute, operations_permitted

logger = logging.getLogger(__name__)

PRINCIPAL_KEY = "memsite.principal"
MAX_REQUEST_BODY_BYTES = 256 * 1024


def _flat(node: Any, defs: dict[str, Any]) -> Any:
    """`node` with local `$ref`s inlined and `anyOf: [{type: X}, {type: null}]` as `type: [X, null]`."""
    if isinstance(node, list):
        return [_flat(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/$defs/"):
        return _flat(defs[ref.removeprefix("#/$defs/")], defs)
    flat = {key: _flat(value, defs) for key, value in node.items() if key != "$defs"}
    branches = flat.get("anyOf")
    if isinstance(branches, list) and all(isinstance(b, dict) and set(b) == {"type"} for b in branches):
        flat.pop("anyOf")
        flat["type"] = [b["type"] for b in branches]
    return flat


def output_schema_of(model: type[Any]) -> dict[str, Any]:
    """The operation's output model as a self-contained JSON schema. Clients (the official
    SDK among them) validate every result against it, so no `$ref`s to resolve per call."""
    schema = model.model_json_schema()
    return cast(dict[str, Any], _flat(schema, schema.get("$defs", {})))


def tool_of(operation: OperationDef) -> types.Tool:
    """The MCP tool for one operation: input and output schemas from its pydantic models."""
    return types.Tool(
        name=operation.tool_name or operation.name,
        title=operation.title,
        description=operation.description,
        input_schema=operation.input_model.model_json_schema(),
        output_schema=output_schema_of(operation.output_model),
        annotations=types.ToolAnnotations(
            title=operation.title,
            read_only_hint=operation.read_only,
            destructive_hint=operation.destructive,
            idempotent_hint=operation.idempotent,
            open_world_hint=operation.open_world,
        ),
    )


def _result(data: dict[str, Any], *, is_error: bool = False) -> types.CallToolResult:
    return types.CallToolResult(
        content=[types.TextContent(text=json.dumps(data, ensure_ascii=False))],
        structured_content=data,
        is_error=is_error,
    )


def _run_in_thread(principal: Principal, name: str, arguments: Any, call: CallContext) -> dict[str, Any]:
    close_old_connections()
    try:
        return operation_execute(principal, name, arguments, call=call)
    finally:
        close_old_connections()


@dataclass(frozen=True)
class Toolset:
    """An MCP server over some operations of `memories.operations.OPERATIONS`."""

    id: str
    name: str
    instructions: str
    operations: tuple[str, ...]
    version: str = "1"
    # Issue 14: seed 003's clients read `error` as a string: {"error": message, "code": ...}.
    flat_errors: bool = False
    tools: list[types.Tool] = field(init=False, repr=False, compare=False)
    by_tool: dict[str, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        unknown = [name for name in self.operations if name not in OPERATIONS]
        if unknown:
            raise ValueError(f"toolset {self.id!r} names unknown operations {unknown}")
        object.__setattr__(self, "tools", [tool_of(OPERATIONS[name]) for name in self.operations])
        by_tool = {OPERATIONS[name].tool_name or name: name for name in self.operations}
        if len(by_tool) != len(self.operations):
            raise ValueError(f"toolset {self.id!r} has two tools of the same name")
        object.__setattr__(self, "by_tool", by_tool)

    @property
    def path(self) -> str:
        return mcp_path(self.id)

    async def list_tools(self, ctx: Any, params: Any) -> types.ListToolsResult:  # noqa: ARG002 - SDK signature
        """Only the tools the credential may call (issue 12: a read-only key sees no write
        or delete tool); calling a hidden one anyway answers `forbidden`."""
        principal = (ctx.request.scope if ctx.request is not None else {}).get(PRINCIPAL_KEY)
        if principal is None:
            return types.ListToolsResult(tools=self.tools)
        permitted = operations_permitted(principal.permissions)
        return types.ListToolsResult(tools=[tool for tool in self.tools if tool.name in permitted])

    async def call_tool(self, ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        operation = self.by_tool.get(params.name)
        if operation is None:
            raise MCPError(types.INVALID_PARAMS, f"Unknown tool: {params.name}")
        principal = (ctx.request.scope if ctx.request is not None else {}).get(PRINCIPAL_KEY)
        if principal is None:  # the middleware lets nothing unauthenticated through
            raise MCPError(types.INVALID_REQUEST, "unauthenticated")
        call = call_context_from_request(ctx.request, channel=Channel.MCP)
        try:
            data = await sync_to_async(_run_in_thread, thread_sensitive=False)(
                principal, operation, params.arguments, call
            )
        except ServiceError as exc:
            return self._error(exc)
        except Exception:
            logger.exception("tool %s failed unexpectedly", params.name)
            return self._error(ServiceError(ErrorCode.BACKEND_UNAVAILABLE, "The memory service failed; retry later."))
        return _result(data)

    def input_schema(self, name: str) -> dict[str, Any] | None:
        """A tool's inputSchema, for the SDK's `Mcp-Param-*` header check before each call.
        Without it the SDK runs and serialises a whole tools/list per tools/call (about
        half the web process's CPU for an MCP call, measured: docs/benchmarks.md)."""
        for tool in self.tools:
            if tool.name == name:
                return tool.input_schema
        return None

    def _error(self, error: ServiceError) -> types.CallToolResult:
        if self.flat_errors:
            detail = error.as_dict()
            return _result({"error": detail.pop("message"), **detail}, is_error=True)
        return _result({"error": error.as_dict()}, is_error=True)

    def server(self) -> Server[Any]:
        return Server(
            self.name,
            version=self.version,
            instructions=self.instructions,
            get_tool_input_schema=self.input_schema,
            on_list_tools=self.list_tools,
            on_call_tool=self.call_tool,
        )

    def build_app(self) -> tuple[Any, Any]:
        """(the Starlette app, which owns its lifespan; the same behind bearer auth)."""
        app = self.server().streamable_http_app(
            streamable_http_path=self.path,
            stateless_http=True,
            json_response=True,
            transport_security=_transport_security(),
            max_request_body_size=MAX_REQUEST_BODY_BYTES,
        )
        return app, BearerAuthMiddleware(app)


def _transport_security() -> TransportSecuritySettings:
    hosts: list[str] = []
    origins: list[str] = list(settings.CSRF_TRUSTED_ORIGINS)
    for host in settings.ALLOWED_HOSTS:
        if host == "*":
            return TransportSecuritySettings(enable_dns_rebinding_protection=False)
        hosts += [host, f"{host}:*"]
        origins += [f"{scheme}://{host}{port}" for scheme in ("http", "https") for port in ("", ":*")]
    return TransportSecuritySettings(enable_dns_rebinding_protection=True, allowed_hosts=hosts, allowed_origins=origins)


class BearerAuthMiddleware:
    """405 for anything but POST (the endpoint is stateless: no SSE stream to GET, no
    session to DELETE, so nothing is held open); 401 (with RFC 9728 resource metadata)
    unless the bearer token is valid; otherwise put the Principal into the ASGI scope for
    the tool handlers."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope.get("method") != "POST":
            # The streamable HTTP transport lets a server without a stream answer GET with 405.
            error = ServiceError(
                ErrorCode.INVALID_ARGUMENT, "This MCP endpoint is stateless: use POST (no event stream, no session)."
            )
            await JSONResponse({"error": error.as_dict()}, status_code=405, headers={"Allow": "POST"})(
                scope, receive, send
            )
            return
        headers = Headers(scope=scope)
        resource = public_base_url(scope.get("scheme", "http"), headers.get("host", "localhost")) + scope["path"]
        principal = await sync_to_async(_authenticate, thread_sensitive=False)(headers.get("authorization"), resource)
        if principal is None:
            call = call_context_from_request(Request(scope), channel=Channel.MCP)
            await sync_to_async(_record_auth_failure, thread_sensitive=False)(call, bool(headers.get("authorization")))
            base = public_base_url(scope.get("scheme", "http"), headers.get("host", "localhost"))
            error = ServiceError(ErrorCode.UNAUTHENTICATED, "A valid bearer token is required.")
            response = JSONResponse(
                {"error": error.as_dict()},
                status_code=401,
                headers={
                    "WWW-Authenticate": www_authenticate(
                        base, error="invalid_token" if headers.get("authorization") else None
                    )
                },
            )
            await response(scope, receive, send)
            return
        await self.app({**scope, PRINCIPAL_KEY: principal}, receive, send)


def _record_auth_failure(call: CallContext, presented: bool) -> None:
    close_old_connections()
    try:
        auth_failure_record(call=call, credential_presented=presented)
    except Exception:  # counting must never turn a 401 into a 500
        logger.warning("could not count an unauthenticated request", exc_info=True)
    finally:
        close_old_connections()


def _authenticate(authorization: str | None, resource: str | None = None) -> Principal | None:
    close_old_connections()
    try:
        return authenticate_bearer(authorization, resource=resource)
    finally:
        close_old_connections()
