"""REST API under /v1/: the seven memory operations for clients that do not speak MCP.
Thin views over `operation_execute`, the same entry point the MCP tools use."""

from __future__ import annotations

import json
from typing import Any

from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import status
from rest_framework.response import Response
from rest_framework.views import APIView

from core.calls import call_context_from_request
from core.choices import Channel
from core.errors import ErrorCode, ServiceError
from core.scope import CallContext
from memories import schemas
from memories.operations import operation_execute
from memories.selectors import memory_trash_list


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


FIELD_FILTER_PARAMS = ("memory_type", "agent_id", "session_id")


def field_filter_arguments(query) -> dict[str, Any]:
    """memory_type, agent_id, session_id and tags (repeated or comma-separated) from a
    query string, as operation arguments."""
    arguments: dict[str, Any] = {name: query[name] for name in FIELD_FILTER_PARAMS if query.get(name)}
    tags = [t for raw in query.getlist("tags") for t in raw.split(",") if t.strip()]
    if tags:
        arguments["tags"] = tags
    return arguments


def _list_arguments(query) -> dict[str, Any]:
    unknown = set(query) - {"cursor", "page_size", "filters", "tags", *FIELD_FILTER_PARAMS}
    if unknown:
        raise ServiceError(ErrorCode.INVALID_ARGUMENT, f"unexpected query parameter {sorted(unknown)[0]!r}")
    arguments: dict[str, Any] = field_filter_arguments(query)
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
            OpenApiParameter("memory_type", str, enum=["user", "feedback", "project", "reference"]),
            OpenApiParameter("tags", str, many=True, description="all must match (repeat or comma-separate)"),
            OpenApiParameter("agent_id", str),
            OpenApiParameter("session_id", str),
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


class MemoryForgetView(APIView):
    """Bulk forget (seed 003): by tags, time_range and/or memory_type; confirm or dry_run."""

    @extend_schema(operation_id="forget_memories", request=schemas.DeleteInput, responses={200: dict})
    def post(self, request):
        body = _body(request)
        if "memory_id" in body:
            raise ServiceError(ErrorCode.INVALID_ARGUMENT, "use DELETE /v1/memories/{id} for one memory")
        return Response(operation_execute(request.auth, "delete_memory", call=_call(request), arguments=body))


class TrashView(APIView):
    @extend_schema(operation_id="list_trash", responses={200: dict})
    def get(self, request):
        trashed = memory_trash_list(request.auth.scope())
        return Response({"memories": [item.as_dict() for item in trashed]})


class TrashRestoreView(APIView):
    @extend_schema(operation_id="restore_memory", request=schemas.RestoreInput, responses={200: dict})
    def post(self, request):
        return Response(
            operation_execute(request.auth, "restore_memory", call=_call(request), arguments=_body(request))
        )


class TrashPurgeView(APIView):
    @extend_schema(operation_id="purge_memory", request=schemas.PurgeInput, responses={200: dict})
    def post(self, request):
        return Response(operation_execute(request.auth, "purge_memory", call=_call(request), arguments=_body(request)))
