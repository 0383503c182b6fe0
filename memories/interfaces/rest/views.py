"""REST API under /v1/: the seven memory operations for clients that do not speak MCP.
Thin views over `operation_execute`, the same entry point the MCP tools use."""

from __future__ import annotations

import json
from typing import Any

from django.core.exceptions import RequestDataTooBig
from django.http import HttpResponse
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import status
from rest_framework.parsers import MultiPartParser
from rest_framework.response import Response
from rest_framework.views import APIView

from core.calls import call_context_from_request
from core.choices import Channel
from core.errors import ErrorCode, ServiceError
from core.scope import CallContext
from memories import schemas
from memories.operations import operation_execute

EXPORT_CONTENT_TYPES = {"jsonl": "application/x-ndjson", "markdown": "text/markdown"}
EXPORT_FILE_NAMES = {"jsonl": "memories.jsonl", "markdown": "memories.md"}


def _call(request) -> CallContext:
    return call_context_from_request(request, channel=Channel.REST)


def _body(request) -> dict[str, Any]:
    if not isinstance(request.data, dict):
        raise ServiceError(ErrorCode.INVALID_ARGUMENT, "the request body must be a JSON object")
    return dict(request.data)


def _with_memory_id(request, memory_id: str) -> dict[str, Any]:
    body = _body(request)
    if "memory_id" in body and body["memory_id"] != memory_id:
        raise ServiceError(ErrorCode.INVALID_ARGUMENT, "memory_id in the body differs from the URL")
    return {**body, "memory_id": memory_id}


def _list_arguments(query) -> dict[str, Any]:
    unknown = set(query) - {"cursor", "page_size", "filters"}
    if unknown:
        raise ServiceError(ErrorCode.INVALID_ARGUMENT, f"unexpected query parameter {sorted(unknown)[0]!r}")
    arguments: dict[str, Any] = {}
    if "cursor" in query:
        arguments["cursor"] = query["cursor"]
    if "page_size" in query:
        raw = query["page_size"]
        arguments["page_size"] = int(raw) if raw.isdigit() and len(raw) < 10 else raw
    if "filters" in query:
        try:
            arguments["filters"] = json.loads(query["filters"])
        except ValueError:
            raise ServiceError(ErrorCode.INVALID_ARGUMENT, "filters must be a JSON object") from None
    return arguments


class MemoryCollectionView(APIView):
    @extend_schema(
        operation_id="list_memory",
        parameters=[
            OpenApiParameter("cursor", str, description="next_cursor of the previous page"),
            OpenApiParameter("page_size", int, description=f"1-{schemas.PAGE_SIZE_MAX}"),
            OpenApiParameter("filters", str, description='JSON object, e.g. {"pinned": true}'),
        ],
        responses={200: dict},
    )
    def get(self, request):
        return Response(
            operation_execute(
                request.auth, "list_memory", call=_call(request), arguments=_list_arguments(request.query_params)
            )
        )

    @extend_schema(operation_id="remember", request=schemas.RememberInput, responses={201: dict, 200: dict})
    def post(self, request):
        data = operation_execute(request.auth, "remember", call=_call(request), arguments=_body(request))
        return Response(data, status=status.HTTP_200_OK if data["duplicate"] else status.HTTP_201_CREATED)


class MemorySearchView(APIView):
    @extend_schema(operation_id="search_memory", request=schemas.SearchInput, responses={200: dict})
    def post(self, request):
        return Response(operation_execute(request.auth, "search_memory", call=_call(request), arguments=_body(request)))


class MemoryIngestView(APIView):
    @extend_schema(operation_id="ingest", request=schemas.IngestInput, responses={200: dict})
    def post(self, request):
        return Response(operation_execute(request.auth, "ingest", call=_call(request), arguments=_body(request)))


class MemoryClearView(APIView):
    @extend_schema(operation_id="clear_all_memory", request=schemas.ClearAllInput, responses={200: dict})
    def post(self, request):
        return Response(
            operation_execute(request.auth, "clear_all_memory", call=_call(request), arguments=_body(request))
        )


class MemoryItemView(APIView):
    @extend_schema(operation_id="update_memory", request=schemas.UpdateInput, responses={200: dict})
    def patch(self, request, memory_id: str):
        return Response(
            operation_execute(
                request.auth, "update_memory", call=_call(request), arguments=_with_memory_id(request, memory_id)
            )
        )

    @extend_schema(operation_id="delete_memory", responses={200: dict})
    def delete(self, request, memory_id: str):
        return Response(
            operation_execute(request.auth, "delete_memory", call=_call(request), arguments={"memory_id": memory_id})
        )


def export_response(result: dict[str, Any]) -> HttpResponse:
    """An export as a file download (REST and the web UI)."""
    response = HttpResponse(result["content"], content_type=f"{EXPORT_CONTENT_TYPES[result['format']]}; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="{EXPORT_FILE_NAMES[result["format"]]}"'
    response["X-Memory-Count"] = str(result["count"])
    return response


class MemoryExportView(APIView):
    def perform_content_negotiation(self, request, force=False):
        # `?format=` names the export's format here, not one of DRF's renderers.
        return super().perform_content_negotiation(request, force=True)

    @extend_schema(
        operation_id="export_memories",
        parameters=[OpenApiParameter("format", str, enum=["jsonl", "markdown"], description="default jsonl")],
        responses={200: bytes},
    )
    def get(self, request):
        unknown = set(request.query_params) - {"format"}
        if unknown:
            raise ServiceError(ErrorCode.INVALID_ARGUMENT, f"unexpected query parameter {sorted(unknown)[0]!r}")
        arguments = {"format": request.query_params.get("format", "jsonl")}
        return export_response(
            operation_execute(request.auth, "export_memories", call=_call(request), arguments=arguments)
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
        responses={200: schemas.ImportOutput},
    )
    def post(self, request):
        arguments = {"data": upload_bytes(request), "source": request.query_params.get("from", "memsite")}
        return Response(operation_execute(request.auth, "import_memories", call=_call(request), arguments=arguments))


def upload_bytes(request) -> bytes:
    """The uploaded file (multipart field `file`) or, failing that, the raw request body."""
    from django.conf import settings

    too_large = ServiceError(ErrorCode.PAYLOAD_TOO_LARGE, f"the file exceeds {settings.IMPORT_MAX_BYTES} bytes")
    try:
        if request.content_type.startswith("multipart/"):
            upload = request.FILES.get("file")
            if upload is None:
                raise ServiceError(ErrorCode.INVALID_ARGUMENT, "send the file in the multipart field 'file'")
            if upload.size > settings.IMPORT_MAX_BYTES:
                raise too_large
            return upload.read()
        return request.body
    except RequestDataTooBig:
        raise too_large from None
