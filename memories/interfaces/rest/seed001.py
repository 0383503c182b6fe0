"""Seed 001's REST shape at /v1/memory: store, search, list, update, delete and forget.

Thin views over the same `operation_execute` as /v1/memories and MCP (same services,
audit rows, usage events, rate limits). A client's `scope` never selects whose memories
are touched: `tenant_id`/`user_id` are checked against the caller (403 `forbidden`
otherwise), `agent_id`/`session_id` narrow inside the caller's own memories."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import OpenApiExample, OpenApiParameter, extend_schema, inline_serializer
from rest_framework import serializers, status
from rest_framework.response import Response
from rest_framework.views import APIView

from core.errors import ErrorCode, ServiceError
from memories.auth import Principal
from memories.interfaces.rest.views import _body, _call, field_filter_arguments
from memories.operations import operation_execute
from memories.selectors import memory_get_owned, memory_view

SCOPE_KEYS = ("tenant_id", "user_id", "agent_id", "session_id")
# Fields passed through to the operations as they are.
STORE_FIELDS = ("memory_type", "tags", "importance", "expires_at", "ttl_days", "source", "why_stored", "pinned")

_scope_serializer = inline_serializer(
    "MemoryScope",
    {
        "tenant_id": serializers.CharField(help_text="Your tenant (`default`)."),
        "user_id": serializers.CharField(help_text="Your username."),
        "agent_id": serializers.CharField(required=False, allow_null=True),
        "session_id": serializers.CharField(required=False, allow_null=True),
    },
)
_store_request = inline_serializer(
    "MemoryStore",
    {
        "content": serializers.CharField(required=False),
        "messages": serializers.ListField(child=serializers.DictField(), required=False),
        "memory_type": serializers.ChoiceField(["user", "feedback", "project", "reference"], required=False),
        "scope": _scope_serializer,
        "tags": serializers.ListField(child=serializers.CharField(), required=False),
        "importance": serializers.FloatField(required=False),
        "expires_at": serializers.DateTimeField(required=False),
        "ttl_days": serializers.IntegerField(required=False),
        "source": serializers.CharField(required=False),
        "why_stored": serializers.CharField(required=False),
    },
)
_search_request = inline_serializer(
    "MemorySearch",
    {
        "query": serializers.CharField(),
        "scope": _scope_serializer,
        "memory_type": serializers.ChoiceField(["user", "feedback", "project", "reference"], required=False),
        "tags": serializers.ListField(child=serializers.CharField(), required=False),
        "limit": serializers.IntegerField(required=False, default=10),
    },
)
_SCOPE_PARAMS = [
    OpenApiParameter("tenant_id", str, description="must be your tenant (`default`)"),
    OpenApiParameter("user_id", str, description="must be your username"),
    OpenApiParameter("agent_id", str, description="narrow to one agent's memories"),
    OpenApiParameter("session_id", str, description="narrow to one session's memories"),
]


def _scope_of(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ServiceError(ErrorCode.INVALID_ARGUMENT, "scope must be an object")
    unknown = set(value) - set(SCOPE_KEYS)
    if unknown:
        raise ServiceError(ErrorCode.INVALID_ARGUMENT, f"unexpected scope key {sorted(unknown)[0]!r}")
    for key, item in value.items():
        if item is not None and not isinstance(item, str):
            raise ServiceError(ErrorCode.INVALID_ARGUMENT, f"scope.{key} must be a string")
    return value


def _narrowing(scope: dict[str, Any]) -> dict[str, Any]:
    return {key: scope[key] for key in ("agent_id", "session_id") if scope.get(key)}


def seed_memory(principal: Principal, memory: dict[str, Any]) -> dict[str, Any]:
    """A memory in seed 001's shape (plus our tags, importance, access_count)."""
    shaped = {
        "id": memory["id"],
        "content": memory["memory"],
        "memory_type": memory["memory_type"],
        "scope": {
            "tenant_id": principal.scope().tenant,
            "user_id": principal.user.get_username(),
            "agent_id": memory["agent_id"],
            "session_id": memory["session_id"],
        },
        "pinned": memory["pinned"],
        "expires_at": memory["expires_at"],
        "source": memory["source"],
        "last_recalled_at": memory["last_recalled_at"],
        "why_stored": memory["why_stored"],
        "created_at": memory["created_at"],
        "updated_at": memory["updated_at"],
        "tags": memory["tags"],
        "importance": memory["importance"],
        "access_count": memory["access_count"],
    }
    if memory.get("score") is not None:
        shaped["score"] = memory["score"]
    return shaped


def _stored(principal: Principal, memory_id: str) -> dict[str, Any]:
    # A pure read of what the call just wrote (its audit row is the store's own).
    return memory_view(memory_get_owned(principal.scope(), memory_id=memory_id)).as_dict()


class SeedMemoryCollectionView(APIView):
    @extend_schema(
        operation_id="v1_memory_store",
        request=_store_request,
        responses={201: dict, 200: dict},
        examples=[
            OpenApiExample(
                "store",
                value={
                    "content": "User prefers concise TypeScript examples",
                    "memory_type": "user",
                    "scope": {"tenant_id": "default", "user_id": "alice"},
                },
                request_only=True,
            )
        ],
    )
    def post(self, request):
        body = _body(request)
        claimed = _scope_of(body.pop("scope", None))
        content, messages = body.pop("content", None), body.pop("messages", None)
        unknown = set(body) - set(STORE_FIELDS) - {"metadata"}
        if unknown:
            raise ServiceError(ErrorCode.INVALID_ARGUMENT, f"unexpected argument {sorted(unknown)[0]!r}")
        if (content is None) == (messages is None):
            raise ServiceError(ErrorCode.INVALID_ARGUMENT, "give content or messages")
        arguments = {**body, **_narrowing(claimed)}
        if messages is not None:
            arguments.pop("pinned", None)
            result = operation_execute(
                request.auth, "ingest", {**arguments, "messages": messages}, call=_call(request), claimed_scope=claimed
            )
            return Response({"memories": result["results"]}, status=status.HTTP_201_CREATED)
        result = operation_execute(
            request.auth, "remember", {**arguments, "memory": content}, call=_call(request), claimed_scope=claimed
        )
        memory = seed_memory(request.auth, _stored(request.auth, result["id"]))
        code = status.HTTP_200_OK if result["duplicate"] else status.HTTP_201_CREATED
        return Response({"memory": memory, "duplicate": result["duplicate"]}, status=code)

    @extend_schema(
        operation_id="v1_memory_list",
        parameters=[
            *_SCOPE_PARAMS,
            OpenApiParameter("memory_type", str),
            OpenApiParameter("tags", str, many=True),
            OpenApiParameter("limit", int),
            OpenApiParameter("cursor", str),
        ],
        responses={200: dict},
    )
    def get(self, request):
        query = request.query_params
        unknown = set(query) - {*SCOPE_KEYS, "memory_type", "tags", "limit", "cursor"}
        if unknown:
            raise ServiceError(ErrorCode.INVALID_ARGUMENT, f"unexpected query parameter {sorted(unknown)[0]!r}")
        claimed = {key: query[key] for key in ("tenant_id", "user_id") if key in query}
        arguments = field_filter_arguments(query)
        if "limit" in query:
            raw = query["limit"]
            arguments["page_size"] = int(raw) if raw.isdigit() and len(raw) < 10 else raw
        if query.get("cursor"):
            arguments["cursor"] = query["cursor"]
        result = operation_execute(request.auth, "list_memory", arguments, call=_call(request), claimed_scope=claimed)
        return Response(
            {
                "memories": [seed_memory(request.auth, m) for m in result["memories"]],
                "next_cursor": result["next_cursor"],
            }
        )


class SeedMemorySearchView(APIView):
    @extend_schema(
        operation_id="v1_memory_search",
        request=_search_request,
        responses={200: dict},
        examples=[
            OpenApiExample(
                "search",
                value={
                    "query": "coding style preference",
                    "scope": {"tenant_id": "default", "user_id": "alice"},
                    "memory_type": "user",
                    "limit": 5,
                },
                request_only=True,
            )
        ],
    )
    def post(self, request):
        body = _body(request)
        claimed = _scope_of(body.pop("scope", None))
        unknown = set(body) - {"query", "memory_type", "tags", "limit"}
        if unknown:
            raise ServiceError(ErrorCode.INVALID_ARGUMENT, f"unexpected argument {sorted(unknown)[0]!r}")
        arguments = {key: body[key] for key in ("query", "memory_type", "tags") if key in body}
        arguments["top_k"] = body.get("limit", 10)
        arguments.update(_narrowing(claimed))
        result = operation_execute(request.auth, "search_memory", arguments, call=_call(request), claimed_scope=claimed)
        return Response({"memories": [seed_memory(request.auth, m) for m in result["results"]]})


class SeedMemoryItemView(APIView):
    @extend_schema(operation_id="v1_memory_update", request=_store_request, responses={200: dict})
    def put(self, request, memory_id: str):
        body = _body(request)
        claimed = _scope_of(body.pop("scope", None))
        unknown = set(body) - set(STORE_FIELDS) - {"content", "metadata"}
        if unknown:
            raise ServiceError(ErrorCode.INVALID_ARGUMENT, f"unexpected argument {sorted(unknown)[0]!r}")
        arguments = {**body, **_narrowing(claimed), "memory_id": memory_id}
        if "content" in arguments:
            arguments["memory"] = arguments.pop("content")
        result = operation_execute(request.auth, "update_memory", arguments, call=_call(request), claimed_scope=claimed)
        return Response({"memory": seed_memory(request.auth, result["memory"])})

    @extend_schema(operation_id="v1_memory_delete", parameters=_SCOPE_PARAMS[:2], responses={200: dict})
    def delete(self, request, memory_id: str):
        claimed = _query_claim(request)
        return Response(
            operation_execute(
                request.auth, "delete_memory", {"memory_id": memory_id}, call=_call(request), claimed_scope=claimed
            )
        )


def _query_claim(request) -> dict[str, Any]:
    query = request.query_params
    unknown = set(query) - {"tenant_id", "user_id"}
    if unknown:
        raise ServiceError(ErrorCode.INVALID_ARGUMENT, f"unexpected query parameter {sorted(unknown)[0]!r}")
    return {key: query[key] for key in ("tenant_id", "user_id") if key in query}


class SeedMemoryForgetView(APIView):
    @extend_schema(
        operation_id="v1_memory_forget",
        description="An alias for delete, recorded as a user-initiated forget.",
        parameters=_SCOPE_PARAMS[:2],
        request=None,
        responses={200: dict},
    )
    def post(self, request, memory_id: str):
        claimed = _query_claim(request)
        if isinstance(request.data, dict) and request.data.get("scope") is not None:
            claimed = {**claimed, **_scope_of(request.data["scope"])}
        return Response(
            operation_execute(
                request.auth, "forget_memory", {"memory_id": memory_id}, call=_call(request), claimed_scope=claimed
            )
        )
