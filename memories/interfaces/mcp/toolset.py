"""One MCP toolset abstraction: a table of operations served as an MCP server at
/engines/<id>/mcp (official `mcp` SDK, low-level server, stateless, JSON responses).

We use the SDK's low-level server so that argument validation is ours: every bad
argument becomes a tool result with `isError: true` and a stable `code`, exactly like
the REST API's errors. Unknown tools and malformed requests are JSON-RPC errors.
Authentication and the HTTP checks happen before the SDK sees the request (`McpHttpGate`),
and every tool call goes through `memories.operations.operation_execute`, on the MCP
toolsets' own thread pool.

A new toolset is a `Toolset(...)` naming its operations, added to `registry.TOOLSETS`;
memsite/asgi.py routes its path and runs its lifespan.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import urlsplit

import mcp_types as types
from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import close_old_connections
from django.http.request import split_domain_port, validate_host
from django.utils.http import is_same_domain
from mcp.server.lowlevel import Server
from mcp.server.streamable_http import check_accept_headers
from mcp.server.transport_security import TransportSecuritySettings
from mcp.shared.exceptions import MCPError
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse

from audit.services import auth_failure_record
from core.asgi_body import Receive, asgi_body_buffered
from core.calls import call_context_from_request
from core.choices import Channel
from core.db_errors import PROGRAM_LIMIT_MESSAGE, is_program_limit_exceeded
from core.errors import ErrorCode, ServiceError
from core.hosts import HOST_REFUSED_MESSAGE, HOST_REFUSED_STATUS, allowed_hosts, host_allowed
from core.inputs import LONE_SURROGATE_PROBLEM
from core.scope import CallContext
from memories.auth import Principal, authenticate_bearer
from memories.interfaces.wellknown import mcp_path, public_base_url, www_authenticate
from memories.operations import OPERATIONS, OperationDef, operation_execute, operations_permitted

logger = logging.getLogger(__name__)

PRINCIPAL_KEY = "memsite.principal"
WITHHELD_ARGUMENTS_KEY = "memsite.withheld_arguments"
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


def _result(data: dict[str, Any]) -> types.CallToolResult:
    return types.CallToolResult(
        content=[types.TextContent(text=json.dumps(data, ensure_ascii=False))],
        structured_content=data,
        is_error=False,
    )


def _error_result(error: dict[str, Any]) -> types.CallToolResult:
    """A tool error: the error JSON in the text only. The TypeScript SDK (Claude Code,
    Cursor, Inspector) validates `structuredContent` against the tool's outputSchema even
    when `isError` is true, so an error there would reach the agent as -32602 instead of
    our code and message."""
    return types.CallToolResult(
        content=[types.TextContent(text=json.dumps(error, ensure_ascii=False))],
        is_error=True,
    )


@functools.cache
def _threads() -> ThreadPoolExecutor:
    """The MCP toolsets' own threads (tool calls and bearer checks): a few hung calls can
    stall MCP, but never the event loop's default executor that OAuth and the chat proxy
    share, and hung calls elsewhere cannot stall MCP."""
    return ThreadPoolExecutor(max_workers=settings.MCP_THREADS, thread_name_prefix="mcp")


def _in_mcp_thread[**P, R](function: Callable[P, R]) -> Callable[P, Awaitable[R]]:
    # sync_to_async (not run_in_executor) for what it carries over: the caller's context
    # (request id, database connection Local) in, its changes back out.
    return sync_to_async(function, thread_sensitive=False, executor=_threads())


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
        scope = ctx.request.scope if ctx.request is not None else {}
        principal = scope.get(PRINCIPAL_KEY)
        if principal is None:  # the middleware lets nothing unauthenticated through
            raise MCPError(types.INVALID_REQUEST, "unauthenticated")
        call = call_context_from_request(ctx.request, channel=Channel.MCP)
        # `arguments` is optional in tools/call: a tool whose arguments are all optional
        # (list_memory, memory_health) may be called without any. Arguments the gate held
        # back from the SDK (a lone surrogate in them) are the call's own, to be refused.
        withheld = scope.get(WITHHELD_ARGUMENTS_KEY)
        arguments = withheld if withheld is not None else params.arguments if params.arguments is not None else {}
        try:
            data = await _in_mcp_thread(_run_in_thread)(principal, operation, arguments, call)
        except ServiceError as exc:
            return self._error(exc)
        except Exception as exc:
            if is_program_limit_exceeded(exc):  # the request's size: a retry fails the same way
                return self._error(ServiceError(ErrorCode.PAYLOAD_TOO_LARGE, PROGRAM_LIMIT_MESSAGE))
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
            return _error_result({"error": detail.pop("message"), **detail})
        return _error_result({"error": error.as_dict()})

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
            # McpHttpGate checks Host and Origin first, before authentication.
            transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False),
            max_request_body_size=MAX_REQUEST_BODY_BYTES,
        )
        return app, McpHttpGate(app, resource_path=self.path)


def origin_allowed(origin: str) -> bool:
    """A browser's Origin (DNS rebinding): a CSRF_TRUSTED_ORIGINS entry (Django's
    `https://*.example.com` form too), or http(s) on a host ALLOWED_HOSTS names. A bare
    `*` there allows any Host, not any Origin: list browser origins in CSRF_TRUSTED_ORIGINS."""
    trusted = settings.CSRF_TRUSTED_ORIGINS
    if origin in trusted:
        return True
    try:
        parts = urlsplit(origin)
    except ValueError:
        return False
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return False  # "null" (sandboxed frames, file://) among them
    for pattern in trusted:
        if "*" in pattern:
            allowed = urlsplit(pattern)
            if allowed.scheme == parts.scheme and is_same_domain(parts.netloc, allowed.netloc.lstrip("*")):
                return True
    domain, _ = split_domain_port(parts.netloc)
    return bool(domain) and validate_host(domain, [host for host in allowed_hosts() if host != "*"])


def _refusal(
    status: int,
    code: ErrorCode,
    message: str,
    headers: dict[str, str] | None = None,
    *,
    request_id: str | int | None = None,
) -> JSONResponse:
    """Every refusal before a JSON-RPC request is dispatched (but the 401), in one shape: a
    JSON-RPC error, its `data` our usual {code, message}. Its id is the request's own when
    the gate could read a valid one (`_readable_id`), else null."""
    error = {"code": types.INVALID_REQUEST, "message": message, "data": ServiceError(code, message).as_dict()}
    return JSONResponse({"jsonrpc": "2.0", "id": request_id, "error": error}, status_code=status, headers=headers)


def _is_id(value: Any) -> bool:
    return isinstance(value, str | int) and not isinstance(value, bool)


def _readable_id(message: Any) -> str | int | None:
    """The id a refusal of `message` answers with, so that the client can tell which of its
    calls failed: the message's own when it is a valid JSON-RPC id (and free of lone
    surrogates, which no UTF-8 answer can carry), else null."""
    request_id = message.get("id") if isinstance(message, dict) else None
    return request_id if _is_id(request_id) and _lone_surrogate_problem(request_id) is None else None


def _message_refusal(message: Any) -> str | None:
    """Why a decoded body is not one JSON-RPC message the SDK reads as we do, or None. The
    2025-era SDK path answers a batch or a malformed envelope (a response's too) with
    -32602 and a pydantic dump of the client's data, and takes a request without an id,
    or whose id is null, a float or an object, for a notification: 202 Accepted, and the
    call (a `remember`, say) silently never runs."""
    if not isinstance(message, dict):
        return "The body must be one JSON-RPC message object (batches are not supported)."
    if message.get("jsonrpc") != "2.0":
        return 'The JSON-RPC version must be "2.0".'
    if "id" in message and not _is_id(message["id"]):
        return "A JSON-RPC id must be a string or an integer."
    if "method" in message:
        method = message["method"]
        if not isinstance(method, str):
            return "The JSON-RPC method must be a string."
        if "id" not in message and not method.startswith("notifications/"):
            return (
                "A JSON-RPC request needs an id (a string or an integer): without one it is a "
                "notification, which is never answered, and the call would not run."
            )
        if "params" in message and not isinstance(message["params"], dict):
            return "JSON-RPC params must be an object."
        return None
    if "result" not in message and "error" not in message:
        return "A JSON-RPC message needs a method."
    return _response_refusal(message)


def _response_refusal(message: dict[str, Any]) -> str | None:
    """Why a JSON-RPC response or error (a client's answer to a server request) is malformed."""
    if "id" not in message:
        return "A JSON-RPC response needs the id (a string or an integer) of the request it answers."
    if ("result" in message) == ("error" in message):
        return "A JSON-RPC response has either a result or an error, not both."
    if "result" in message:
        return None if isinstance(message["result"], dict) else "A JSON-RPC result must be an object."
    error = message["error"]
    code = error.get("code") if isinstance(error, dict) else None
    if not isinstance(code, int) or isinstance(code, bool) or not isinstance(error.get("message"), str):
        return "A JSON-RPC error must be an object with an integer code and a string message."
    return None


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
# The JSON-RPC envelope's and MCP params' own key names, named in a refusal; deeper keys
# are the client's text (a tool's metadata), named by position.
_NAMED_DEPTH = 2


def _lone_surrogate_problem(value: Any) -> str | None:
    """Where a decoded message holds a lone surrogate, in a string or a key ("params.name:
    contains ..."), or None; never the text itself. Python's json.loads decodes a
    "\\ud83d" escape (a JavaScript client's truncated emoji) to one; the SDK's parser
    refuses it as a parse error with id null, which no client can match to its request."""
    stack: list[tuple[Any, tuple[str, ...]]] = [(value, ())]
    while stack:
        item, path = stack.pop()
        where = ".".join(path) or "the message"
        if isinstance(item, str):
            if _LONE_SURROGATE.search(item):
                return f"{where}: {LONE_SURROGATE_PROBLEM}"
        elif isinstance(item, dict):
            for n, (key, child) in enumerate(item.items(), start=1):
                if _LONE_SURROGATE.search(key):
                    return f"{where}: a key {LONE_SURROGATE_PROBLEM}"
                stack.append((child, (*path, key if len(path) < _NAMED_DEPTH else f"#{n}")))
        elif isinstance(item, list):
            stack.extend((child, (*path, str(index))) for index, child in enumerate(item))
    return None


@dataclass(frozen=True)
class _Screened:
    """The gate's reading of a body: a refusal (its message, and the id to answer with), or
    the body to hand the SDK and the tool arguments held back from it."""

    refusal: str | None = None
    request_id: str | int | None = None
    body: bytes = b""
    withheld_arguments: dict[str, Any] | None = None


def _message_screened(body: bytes) -> _Screened:
    """The body checked as one JSON-RPC message (`_message_refusal`) free of lone
    surrogates. A tools/call whose surrogates are all in its arguments reaches the SDK
    with `{}` for them, and the tool runs with the real ones (held back in the ASGI
    scope), so the operation refuses them as it refuses any bad argument: a tool error
    naming the argument, audited, not billed."""
    try:
        message = json.loads(body)
    except (ValueError, RecursionError):
        return _Screened(body=body)  # the SDK's own -32700 parse error
    reason = _message_refusal(message)
    if reason is not None:
        return _Screened(refusal=reason, request_id=_readable_id(message))
    params = message.get("params")
    arguments = params.get("arguments") if isinstance(params, dict) else None
    tool_call = message.get("method") == "tools/call" and isinstance(arguments, dict)
    envelope = {**message, "params": {**params, "arguments": {}}} if tool_call else message
    problem = _lone_surrogate_problem(envelope)
    if problem is not None:
        return _Screened(refusal=problem, request_id=_readable_id(message))
    if not tool_call or _lone_surrogate_problem(arguments) is None:
        return _Screened(body=body)
    return _Screened(body=json.dumps(envelope).encode(), withheld_arguments=arguments)


class McpHttpGate:
    """The HTTP front door of one toolset, in the order a refusal must win: Host (421) and
    Origin (403) first, so a foreign page learns nothing even without a token (MCP
    transport: an invalid Origin MUST be 403); POST only (405: the endpoint is stateless,
    no SSE stream to GET, no session to DELETE); a valid bearer token (401, with RFC 9728
    resource metadata); Content-Type (415), Accept (406), body size (413) and a body that
    is one JSON-RPC message (400). Then the SDK, with the Principal in the ASGI scope."""

    def __init__(self, app: Any, *, resource_path: str):
        self.app = app
        self.resource_path = resource_path

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        host = headers.get("host", "")
        if not host_allowed(host):
            await _refusal(HOST_REFUSED_STATUS, ErrorCode.FORBIDDEN, HOST_REFUSED_MESSAGE)(scope, receive, send)
            return
        origin = headers.get("origin")
        if origin is not None and not origin_allowed(origin):
            await _refusal(403, ErrorCode.FORBIDDEN, "Requests from this Origin are not allowed.")(scope, receive, send)
            return
        if scope.get("method") != "POST":
            await _refusal(
                405,
                ErrorCode.INVALID_ARGUMENT,
                "This MCP endpoint is stateless: use POST (no event stream, no session).",
                headers={"Allow": "POST"},
            )(scope, receive, send)
            return
        base = public_base_url(scope.get("scheme", "http"), host or "localhost")
        authorization = headers.get("authorization")
        principal = await _in_mcp_thread(_authenticate)(authorization, base + self.resource_path)
        if principal is None:
            await self._unauthenticated(scope, receive, send, base=base, presented=bool(authorization))
            return
        refused = _headers_refusal(scope, headers)
        if refused is not None:
            await refused(scope, receive, send)
            return
        declared = headers.get("content-length", "")
        too_large = declared.isdigit() and int(declared) > MAX_REQUEST_BODY_BYTES
        received = None if too_large else await asgi_body_buffered(receive, max_bytes=MAX_REQUEST_BODY_BYTES)
        if received is None:
            limit = MAX_REQUEST_BODY_BYTES // 1024
            await _refusal(413, ErrorCode.PAYLOAD_TOO_LARGE, f"The request body is over {limit} KiB.")(
                scope, receive, send
            )
            return
        body, replay = received
        screened = _message_screened(body)
        if screened.refusal is not None:
            await _refusal(400, ErrorCode.INVALID_ARGUMENT, screened.refusal, request_id=screened.request_id)(
                scope, receive, send
            )
            return
        scope = {**scope, PRINCIPAL_KEY: principal}
        if screened.withheld_arguments is not None:
            scope = _with_body(scope, screened.body)
            scope[WITHHELD_ARGUMENTS_KEY] = screened.withheld_arguments
            replay = _body_replay(screened.body, receive)
        await self.app(scope, replay, send)

    async def _unauthenticated(
        self, scope: dict[str, Any], receive: Any, send: Any, *, base: str, presented: bool
    ) -> None:
        call = call_context_from_request(Request(scope), channel=Channel.MCP)
        await _in_mcp_thread(_record_auth_failure)(call, presented)
        error = ServiceError(ErrorCode.UNAUTHENTICATED, "A valid bearer token is required.")
        challenge = www_authenticate(
            base, error="invalid_token" if presented else None, resource_path=self.resource_path
        )
        response = JSONResponse({"error": error.as_dict()}, status_code=401, headers={"WWW-Authenticate": challenge})
        await response(scope, receive, send)


def _with_body(scope: dict[str, Any], body: bytes) -> dict[str, Any]:
    """`scope` with its Content-Length the length of `body` (a rewritten request)."""
    headers = [(name, value) for name, value in scope["headers"] if name.lower() != b"content-length"]
    return {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}


def _body_replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that gives `body` as the whole request, then defers to `receive`."""
    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


def _headers_refusal(scope: dict[str, Any], headers: Headers) -> JSONResponse | None:
    media_type = headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        return _refusal(415, ErrorCode.INVALID_ARGUMENT, "Send the JSON-RPC message as Content-Type: application/json.")
    has_json, _ = check_accept_headers(Request(scope))
    if not has_json:
        return _refusal(406, ErrorCode.INVALID_ARGUMENT, "Accept application/json: this endpoint answers in JSON.")
    return None


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
