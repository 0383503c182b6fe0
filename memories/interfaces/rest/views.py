"""REST API under /v1/: the seven memory operations for clients that do not speak MCP.
Thin views over `operation_execute`, the same entry point the MCP tools use."""

from __future__ import annotations

import re
from typing import Any

from django.core.exceptions import RequestDataTooBig
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import exceptions, status
from rest_framework.parsers import MultiPartParser
from rest_framework.response import Response
from rest_framework.views import APIView

from core.calls import call_context_from_request
from core.choices import Channel
from core.errors import ErrorCode, ServiceError
from core.inputs import InputError, json_loads_safe
from core.scope import CallContext
from memories import schemas
from memories.interfaces.downloads import EXPORT_DOWNLOADS, streaming_download
from memories.operations import operation_execute, operation_stream


def _call(request) -> CallContext:
    return call_context_from_request(request, channel=Channel.REST)


def _rejected(code: ErrorCode, message: str) -> schemas.RejectedArguments:
    return schemas.RejectedArguments(ServiceError(code, message))


def _body(request) -> dict[str, Any] | schemas.RejectedArguments:
    """The JSON body as arguments; a body that cannot be decoded becomes RejectedArguments,
    answered (and audited) by the dispatcher like any other bad argument."""
    try:
        data = request.data
    except exceptions.APIException as exc:
        code = ErrorCode.PAYLOAD_TOO_LARGE if exc.status_code == 413 else ErrorCode.INVALID_ARGUMENT
        return _rejected(code, str(exc.detail))
    if not isinstance(data, dict):
        return _rejected(ErrorCode.INVALID_ARGUMENT, "the request body must be a JSON object")
    return dict(data)


def _with_memory_id(request, memory_id: str) -> dict[str, Any] | schemas.RejectedArguments:
    body = _body(request)
    if isinstance(body, schemas.RejectedArguments):
        return body
    if "memory_id" in body and body["memory_id"] != memory_id:
        return _rejected(ErrorCode.INVALID_ARGUMENT, "memory_id in the body differs from the URL")
    return {**body, "memory_id": memory_id}


FIELD_FILTER_PARAMS = ("memory_type", "agent_id", "session_id")


def field_filter_arguments(query) -> dict[str, Any]:
    """memory_type, agent_id, session_id and tags (repeated or comma-separated) from a
    query string, as operation arguments."""
    arguments: dict[str, Any] = {name: query[name] for name in FIELD_FILTER_PARAMS if query.get(name)}
    tags = [t for raw in query.getlist("tags") for t in raw.split(",") if t.strip()]
    if tags:
        arguments["tags"] = tags
    return arguments


def _paging_arguments(query) -> dict[str, Any]:
    arguments: dict[str, Any] = {}
    if "cursor" in query:
        arguments["cursor"] = query["cursor"]
    if "page_size" in query:
        raw = query["page_size"]
        # ASCII digits only: "²".isdigit() is true and int("²") fails.
        arguments["page_size"] = int(raw) if _DIGITS.fullmatch(raw) else raw
    return arguments


def query_problem(query, allowed: set[str], *, repeatable: frozenset[str] = frozenset({"tags"})) -> str | None:
    """Why a query string cannot be taken: a parameter the route does not know, or one
    given twice (which of the two would count is a guess: a filter, a scope claim)."""
    unknown = set(query) - allowed
    if unknown:
        return f"unexpected query parameter {sorted(unknown)[0][:40]!r}"
    for name in query:
        if name not in repeatable and len(query.getlist(name)) > 1:
            return f"query parameter {name[:40]!r} given more than once"
    return None


def _list_arguments(query) -> dict[str, Any] | schemas.RejectedArguments:
    problem = query_problem(query, {"cursor", "page_size", "filters", "tags", *FIELD_FILTER_PARAMS})
    if problem:
        return _rejected(ErrorCode.INVALID_ARGUMENT, problem)
    arguments: dict[str, Any] = {**field_filter_arguments(query), **_paging_arguments(query)}
    if "filters" in query:
        try:
            filters = json_loads_safe(query["filters"], max_depth=2)
        except InputError as exc:
            return _rejected(ErrorCode.INVALID_ARGUMENT, f"filters must be a JSON object: {exc.message}")
        if not isinstance(filters, dict):
            return _rejected(ErrorCode.INVALID_ARGUMENT, "filters must be a JSON object")
        arguments["filters"] = filters
    return arguments


_DIGITS = re.compile(r"[0-9]{1,9}")
CURSOR_PARAMETER = OpenApiParameter(
    "cursor",
    {"type": "string", "maxLength": schemas.CURSOR_MAX_CHARS, "pattern": "^[A-Za-z0-9_-]+$"},
    description="`next_cursor` of the previous page (opaque).",
)


def _page_size_parameter(*, default: int) -> OpenApiParameter:
    return OpenApiParameter(
        "page_size",
        {"type": "integer", "minimum": 1, "maximum": schemas.PAGE_SIZE_MAX},
        description=f"1-{schemas.PAGE_SIZE_MAX}, default {default}.",
    )


def _errors(*codes: int) -> dict[int, OpenApiResponse]:
    """The error responses an operation can give, all with the one error body."""
    described = {
        400: "Invalid argument (or confirmation required): `invalid_argument`, `confirmation_required`.",
        401: "Missing or invalid bearer token: `unauthenticated`.",
        403: "The key may not do this (a read-only key writing), or `X-Memory-Subject` / a `scope` names "
        "someone a user key may not act for: `forbidden`.",
        404: "No memory with that id (a foreign id answers the same), or a service key's `X-Memory-Subject` "
        "names no user of its tenant: `not_found`.",
        409: "A real conflict (e.g. another memory's text), not to be retried as is: `conflict`; or a lock "
        "wait that timed out (e.g. during a clear-all or erasure): `resource_busy`, with `retry_after_s` and a "
        "Retry-After header.",
        413: "An argument or the body is too large: `payload_too_large`.",
        421: "The Host header names a host this server does not serve (`ALLOWED_HOSTS`): `forbidden`.",
        429: "Rate limited: `rate_limited`, with `retry_after_s` and a Retry-After header.",
        503: "The engine (or the LLM, for ingest) is unavailable: `backend_unavailable`, `llm_unavailable`; "
        "retry later.",
    }
    return {code: OpenApiResponse(response=schemas.ErrorResponse, description=described[code]) for code in codes}


# Every route can refuse the key's role (403), a service key's subject (404) and a foreign Host (421).
COMMON_ERRORS = (400, 401, 403, 404, 409, 413, 421, 429, 503)
MEMORY_ID_PARAMETER = OpenApiParameter(
    "memory_id", OpenApiTypes.UUID, OpenApiParameter.PATH, description="The memory's id (a UUID)."
)
FILTERS_SCHEMA = {
    "type": "string",
    "contentMediaType": "application/json",
    "contentSchema": schemas.FILTERS_OBJECT_SCHEMA,
    "maxLength": 4096,
}


class MemoryCollectionView(APIView):
    @extend_schema(
        operation_id="list_memory",
        parameters=[
            CURSOR_PARAMETER,
            _page_size_parameter(default=schemas.PAGE_SIZE_DEFAULT),
            OpenApiParameter(
                "filters",
                FILTERS_SCHEMA,
                description='A JSON object as a string: exact-match filters, e.g. {"pinned": true} or '
                '{"project": "apollo"} (keys follow the metadata key rules).',
            ),
            OpenApiParameter("memory_type", str, enum=["user", "feedback", "project", "reference"]),
            OpenApiParameter("tags", str, many=True, description="all must match (repeat or comma-separate)"),
            OpenApiParameter("agent_id", str),
            OpenApiParameter("session_id", str),
        ],
        responses={200: schemas.ListOutput, **_errors(*COMMON_ERRORS)},
    )
    def get(self, request):
        return Response(
            operation_execute(
                request.auth, "list_memory", call=_call(request), arguments=_list_arguments(request.query_params)
            )
        )

    @extend_schema(
        operation_id="remember",
        request=schemas.RememberInput,
        responses={
            201: OpenApiResponse(schemas.RememberOutput, description="Stored."),
            200: OpenApiResponse(schemas.RememberOutput, description="Already remembered (duplicate: true)."),
            **_errors(*COMMON_ERRORS),
        },
    )
    def post(self, request):
        data = operation_execute(request.auth, "remember", call=_call(request), arguments=_body(request))
        return Response(data, status=status.HTTP_200_OK if data["duplicate"] else status.HTTP_201_CREATED)


class MemorySearchView(APIView):
    @extend_schema(
        operation_id="search_memory",
        request=schemas.SearchInput,
        responses={200: schemas.SearchOutput, **_errors(*COMMON_ERRORS)},
    )
    def post(self, request):
        return Response(operation_execute(request.auth, "search_memory", call=_call(request), arguments=_body(request)))


class MemoryIngestView(APIView):
    @extend_schema(
        operation_id="ingest",
        request=schemas.IngestInput,
        responses={200: schemas.IngestOutput, **_errors(*COMMON_ERRORS)},
    )
    def post(self, request):
        return Response(operation_execute(request.auth, "ingest", call=_call(request), arguments=_body(request)))


class MemoryClearView(APIView):
    @extend_schema(
        operation_id="clear_all_memory",
        request=schemas.ClearAllInput,
        responses={200: schemas.ClearAllOutput, **_errors(*COMMON_ERRORS)},
    )
    def post(self, request):
        return Response(
            operation_execute(request.auth, "clear_all_memory", call=_call(request), arguments=_body(request))
        )


class MemoryItemView(APIView):
    @extend_schema(
        operation_id="update_memory",
        parameters=[MEMORY_ID_PARAMETER],
        request=schemas.UpdateBody,
        responses={200: schemas.MemoryOutput, **_errors(*COMMON_ERRORS, 404)},
    )
    def patch(self, request, memory_id: str):
        return Response(
            operation_execute(
                request.auth, "update_memory", call=_call(request), arguments=_with_memory_id(request, memory_id)
            )
        )

    @extend_schema(
        operation_id="delete_memory",
        parameters=[MEMORY_ID_PARAMETER],
        responses={200: schemas.DeleteOutput, **_errors(*COMMON_ERRORS, 404)},
    )
    def delete(self, request, memory_id: str):
        return Response(
            operation_execute(request.auth, "delete_memory", call=_call(request), arguments={"memory_id": memory_id})
        )


class MemoryForgetView(APIView):
    """Bulk forget (seed 003): by tags, time_range and/or memory_type; confirm or dry_run."""

    @extend_schema(
        operation_id="forget_memories",
        request=schemas.DeleteInput,
        responses={200: schemas.ForgetOutput, **_errors(*COMMON_ERRORS)},
    )
    def post(self, request):
        body = _body(request)
        if isinstance(body, dict) and "memory_id" in body:
            body = _rejected(ErrorCode.INVALID_ARGUMENT, "use DELETE /v1/memories/{id} for one memory")
        return Response(operation_execute(request.auth, "delete_memory", call=_call(request), arguments=body))


class TrashView(APIView):
    @extend_schema(
        operation_id="list_trash",
        parameters=[CURSOR_PARAMETER, _page_size_parameter(default=schemas.PAGE_SIZE_MAX)],
        responses={200: schemas.TrashListOutput, **_errors(*COMMON_ERRORS)},
    )
    def get(self, request):
        problem = query_problem(request.query_params, {"cursor", "page_size"})
        arguments: dict[str, Any] | schemas.RejectedArguments = _paging_arguments(request.query_params)
        if problem:
            # Refused by the dispatcher, so the failed call is audited like any other.
            arguments = _rejected(ErrorCode.INVALID_ARGUMENT, problem)
        return Response(operation_execute(request.auth, "list_trash", call=_call(request), arguments=arguments))


class TrashRestoreView(APIView):
    @extend_schema(
        operation_id="restore_memory",
        request=schemas.RestoreInput,
        responses={200: schemas.RestoreOutput, **_errors(*COMMON_ERRORS, 404)},
    )
    def post(self, request):
        return Response(
            operation_execute(request.auth, "restore_memory", call=_call(request), arguments=_body(request))
        )


class TrashPurgeView(APIView):
    @extend_schema(
        operation_id="purge_memory",
        request=schemas.PurgeInput,
        responses={200: schemas.PurgeOutput, **_errors(*COMMON_ERRORS, 404)},
    )
    def post(self, request):
        return Response(operation_execute(request.auth, "purge_memory", call=_call(request), arguments=_body(request)))


class MemoryExportView(APIView):
    def perform_content_negotiation(self, request, force=False):
        # `?format=` names the export's format here, not one of DRF's renderers.
        return super().perform_content_negotiation(request, force=True)

    @extend_schema(
        operation_id="export_memories",
        parameters=[OpenApiParameter("format", str, enum=["jsonl", "markdown"], description="default jsonl")],
        responses={
            (200, "application/x-ndjson"): OpenApiResponse(OpenApiTypes.STR, description="The JSONL file."),
            (200, "text/markdown"): OpenApiResponse(OpenApiTypes.STR, description="The Markdown file."),
            **_errors(*COMMON_ERRORS),
        },
    )
    def get(self, request):
        problem = query_problem(request.query_params, {"format"})
        arguments: dict[str, Any] | schemas.RejectedArguments = {"format": request.query_params.get("format", "jsonl")}
        if problem:
            # Refused by the dispatcher, so the failed call is audited like any other.
            arguments = _rejected(ErrorCode.INVALID_ARGUMENT, problem)
        # Streamed as it is read, never built whole (memory_export_stream). Its count is in
        # the file's first line.
        lines = operation_stream(request.auth, "export_memories", call=_call(request), arguments=arguments)
        content_type, filename = EXPORT_DOWNLOADS[request.query_params.get("format", "jsonl")]
        return streaming_download(
            request._request, lines, content_type=f"{content_type}; charset=utf-8", filename=filename
        )


class MemoryImportView(APIView):
    # A multipart upload (field `file`); any other body is taken raw as the file itself.
    parser_classes = [MultiPartParser]

    @extend_schema(
        operation_id="import_memories",
        parameters=[
            OpenApiParameter("from", str, enum=["memsite", "mem0", "openmemory"], description="default memsite")
        ],
        request={
            "multipart/form-data": {"type": "object", "properties": {"file": {"type": "string", "format": "binary"}}}
        },
        responses={200: schemas.ImportOutput, **_errors(*COMMON_ERRORS)},
    )
    def post(self, request):
        problem = query_problem(request.query_params, {"from"})
        data = upload_bytes(request) if not problem else _rejected(ErrorCode.INVALID_ARGUMENT, problem)
        arguments: dict[str, Any] | schemas.RejectedArguments = (
            data
            if isinstance(data, schemas.RejectedArguments)
            else {"data": data, "source": request.query_params.get("from", "memsite")}
        )
        return Response(operation_execute(request.auth, "import_memories", call=_call(request), arguments=arguments))


def upload_bytes(request) -> bytes | schemas.RejectedArguments:
    """The uploaded file (multipart field `file`) or, failing that, the raw request body.
    An upload that cannot be read becomes RejectedArguments, answered (and audited) by
    the dispatcher like any other bad argument."""
    from django.conf import settings

    too_large = ServiceError(ErrorCode.PAYLOAD_TOO_LARGE, f"the file exceeds {settings.IMPORT_MAX_BYTES} bytes")
    try:
        if request.content_type.startswith("multipart/"):
            upload = request.FILES.get("file")
            if upload is None:
                return _rejected(ErrorCode.INVALID_ARGUMENT, "send the file in the multipart field 'file'")
            if upload.size > settings.IMPORT_MAX_BYTES:
                return schemas.RejectedArguments(too_large)
            return upload.read()
        # Read the stream ourselves: `request.body` stops at DATA_UPLOAD_MAX_MEMORY_SIZE
        # (2.5 MB), far below the import limit.
        stream = request.stream
        data = stream.read(settings.IMPORT_MAX_BYTES + 1) if stream is not None else b""
        if len(data) > settings.IMPORT_MAX_BYTES:
            return schemas.RejectedArguments(too_large)
        return data
    except RequestDataTooBig:
        return schemas.RejectedArguments(too_large)
    except exceptions.APIException as exc:  # a multipart body DRF cannot parse (no or a bad boundary)
        code = ErrorCode.PAYLOAD_TOO_LARGE if exc.status_code == 413 else ErrorCode.INVALID_ARGUMENT
        return _rejected(code, str(exc.detail))
