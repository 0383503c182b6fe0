"""Seed 001's prefetch: `POST /v1/memory/prefetch` (issue 13).

Given a query or the conversation's messages, a ready-to-inject notes block and the
memories behind it: the same memory block `memory_before_turn` puts first in its input
items (`memories.turns.services.memory_block_build`)."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import OpenApiExample, extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from memories.interfaces.rest.seed001 import (
    _SCOPE_PARAMS,
    _execute,
    _narrowing,
    _only,
    _scope_claimed,
    seed_memory,
)
from memories.interfaces.rest.views import COMMON_ERRORS, _body, _errors

_prefetch_request = inline_serializer(
    "MemoryPrefetch",
    {
        "query": serializers.CharField(required=False, help_text="What the next turn is about."),
        "messages": serializers.ListField(
            child=serializers.DictField(), required=False, help_text="Or the conversation: [{role, content}]."
        ),
        "limit": serializers.IntegerField(
            required=False, help_text="How many notes (default MCP_MEMORY_SEARCH_LIMIT)."
        ),
        "project": serializers.CharField(required=False, help_text="Narrow to facts of one project."),
        "scope": serializers.DictField(
            required=False,
            help_text="tenant_id/user_id are checked against the caller, never select; agent_id/session_id narrow.",
        ),
    },
)
_prefetch_response = inline_serializer(
    "MemoryPrefetchResult",
    {
        "notes": serializers.CharField(help_text="Ready to inject as a system/developer note; empty if none."),
        "memories": serializers.ListField(child=serializers.DictField()),
    },
)


class SeedMemoryPrefetchView(APIView):
    @extend_schema(
        operation_id="v1_memory_prefetch",
        parameters=_SCOPE_PARAMS,
        request=_prefetch_request,
        responses={200: _prefetch_response, **_errors(*COMMON_ERRORS, 403)},
        examples=[
            OpenApiExample(
                "prefetch",
                value={"messages": [{"role": "user", "content": "Which editor should I use?"}], "limit": 5},
                request_only=True,
            )
        ],
    )
    def post(self, request):
        def build(claimed: dict[str, Any]) -> dict[str, Any]:
            body = _scope_claimed(request, claimed, _body(request))
            _only(body, {"query", "messages", "limit", "project"})
            return {**body, **_narrowing(claimed)}

        ran = _execute(request, "memory_prefetch", build)
        return Response(
            {"notes": ran.answer["notes"], "memories": [seed_memory(ran.principal, m) for m in ran.answer["memories"]]}
        )
