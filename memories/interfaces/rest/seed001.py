"""Seed 001's REST shape at /v1/memory: store, search, list, update, delete and forget.

Thin views over the same dispatcher (`operation_run`) as /v1/memories and MCP (same services,
audit rows, usage events, rate limits). A client's `scope` never selects whose memories
are touched: `tenant_id`/`user_id` are checked against the caller (403 `forbidden`
otherwise), `agent_id`/`session_id` narrow inside the caller's own memories: a store puts
the memory there, a search, list or prefetch keeps to them, and an update or forget of a
memory outside them answers `not_found`, as for a missing id. Every route reads that
scope wherever the client can put it, the same way (`_scope_claimed`): the query string's
keys and the body's `scope` object."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from drf_spectacular.utils import OpenApiExample, OpenApiParameter, extend_schema, inline_serializer
from rest_framework import serializers, status
from rest_framework.response import Response
from rest_framework.views import APIView

from core.errors import ErrorCode, ServiceError
from core.inputs import text_problem
from memories import schemas
from memories.auth import Principal
from memories.interfaces.rest.views import (
    _DIGITS,
    COMMON_ERRORS,
    _body,
    _call,
    _errors,
    field_filter_arguments,
    query_problem,
)
from memories.operations import OperationRan, operation_run

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
        "pinned": serializers.BooleanField(
            required=False, help_text="A store of `messages` refuses `true`: pin an extracted memory with PUT."
        ),
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
# The scope as query parameters: on every route, beside (or instead of) a body's `scope`;
# a key given in both must have the same value (else 400 invalid_argument).
_SCOPE_PARAMS = [
    OpenApiParameter("tenant_id", str, description="must be your tenant (`default`)"),
    OpenApiParameter("user_id", str, description="must be your username"),
    OpenApiParameter("agent_id", str, description="narrow to one agent's memories"),
    OpenApiParameter("session_id", str, description="narrow to one session's memories"),
]


class _Rejected(Exception):
    """A bad seed-001 argument, answered and audited by the dispatcher like any other."""

    def __init__(self, message: str):
        self.arguments = schemas.RejectedArguments(ServiceError(ErrorCode.INVALID_ARGUMENT, message))


def _scope_of(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _Rejected("scope must be an object")
    unknown = set(value) - set(SCOPE_KEYS)
    if unknown:
        raise _Rejected(f"unexpected scope key {sorted(unknown)[0][:40]!r}")
    for key, item in value.items():
        if item is not None and not isinstance(item, str):
            raise _Rejected(f"scope.{key} must be a string")
    return value


def _limit(value: Any, maximum: int) -> int:
    """Seed 001's `limit`, checked here: it becomes `top_k` or `page_size`, and their error
    would name an argument the client never sent."""
    if isinstance(value, str) and _DIGITS.fullmatch(value):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= maximum:
        raise _Rejected(f"limit: must be a whole number from 1 to {maximum}")
    return value


def _query_claim_of(query: Any, keys: tuple[str, ...] = SCOPE_KEYS) -> dict[str, Any]:
    """The scope a query string claims. Its values never pass the JSON check that a body's
    do: one Postgres cannot take (a NUL) is refused here, as the body's would be."""
    for key in keys:
        for value in query.getlist(key):
            problem = text_problem(value)
            if problem:
                raise _Rejected(f"{key}: {problem}")
    return {key: query[key] for key in keys if key in query}


def _only(keys: Any, allowed: set[str], what: str = "argument") -> None:
    unknown = set(keys) - allowed
    if unknown:
        raise _Rejected(f"unexpected {what} {sorted(unknown)[0][:40]!r}")


def _query_only(query: Any, allowed: set[str]) -> None:
    problem = query_problem(query, allowed)
    if problem:
        raise _Rejected(problem)


class _RejectedBody(_Rejected):
    def __init__(self, arguments: schemas.RejectedArguments):
        self.arguments = arguments


def _execute(request, operation: str, build: Callable[[dict[str, Any]], dict[str, Any]]) -> OperationRan:
    """Build the arguments and run the operation. `build` adds the scope the request claims
    to the dict it is given as soon as it reads it: a bad argument found later goes to the
    dispatcher as RejectedArguments with the claim read so far, so a claim the caller may
    not make is refused first, and the call's audit row names whom it claimed. Whom the
    call ran as (seed_memory's scope) is the dispatcher's, resolved once as it admitted
    the call: never again after it."""
    claimed: dict[str, Any] = {}
    arguments: dict[str, Any] | schemas.RejectedArguments
    try:
        arguments = build(claimed)
    except _Rejected as rejected:
        arguments = rejected.arguments
    return operation_run(
        request.auth, operation, arguments, call=_call(request), claimed_scope=claimed, with_extras=True
    )


def _narrowing(scope: dict[str, Any]) -> dict[str, Any]:
    return {key: scope[key] for key in ("agent_id", "session_id") if scope.get(key)}


def seed_memory(principal: Principal, memory: dict[str, Any]) -> dict[str, Any]:
    """A memory in seed 001's shape (plus our tags, importance, access_count)."""
    shaped = {
        "id": memory["id"],
        "content": memory["memory"],
        "memory_type": memory["memory_type"],
        "scope": {
            "tenant_id": principal.tenant_name,
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


def _seed_ingested(principal: Principal, stored: dict[str, Any]) -> dict[str, Any]:
    """An extracted memory in seed 001's shape, as the ingest's transaction left it, with
    its extraction `event` (ADD: stored now; NONE: a memory that already held the text).
    One deleted since (a completion the reconciler made first) keeps its id and event."""
    if "memory" not in stored:
        return {"id": stored["id"], "content": None, "event": stored["event"]}
    return {**seed_memory(principal, stored), "event": stored["event"]}


class SeedMemoryCollectionView(APIView):
    @extend_schema(
        operation_id="v1_memory_store",
        parameters=_SCOPE_PARAMS,
        request=_store_request,
        responses={201: schemas.SeedStoreOutput, 200: schemas.SeedStoreOutput, **_errors(*COMMON_ERRORS, 403)},
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
        # Read once: after a failed parse DRF's request.data is an empty QueryDict, so a
        # second read would hide why the body was refused (too large, not JSON, NUL).
        raw = _body(request)
        if isinstance(raw, dict) and raw.get("messages") is not None and raw.get("content") is None:
            ingested = _execute(
                request, "ingest", lambda claimed: self._arguments(request, raw, claimed, messages=True)
            )
            memories = [_seed_ingested(ingested.principal, stored) for stored in ingested.extras["stored"]]
            return Response({"memories": memories}, status=status.HTTP_201_CREATED)
        ran = _execute(request, "remember", lambda claimed: self._arguments(request, raw, claimed, messages=False))
        # The memory as the store left it, read in its transaction: a delete or expiry
        # committed since never turns the stored, billed call into a 404.
        memory = seed_memory(ran.principal, ran.extras["memory"])
        code = status.HTTP_200_OK if ran.answer["duplicate"] else status.HTTP_201_CREATED
        return Response({"memory": memory, "duplicate": ran.answer["duplicate"]}, status=code)

    @staticmethod
    def _arguments(
        request, raw: dict[str, Any] | schemas.RejectedArguments, claimed: dict[str, Any], *, messages: bool
    ) -> dict[str, Any]:
        body = _scope_claimed(request, claimed, raw)
        content, items = body.pop("content", None), body.pop("messages", None)
        _only(body, set(STORE_FIELDS) | {"metadata"})
        if (content is None) == (items is None):
            raise _Rejected("give content or messages")
        arguments = {**body, **_narrowing(claimed)}
        if messages:
            # Extraction stores candidate memories the client has not seen, or answers one
            # the user already has (NONE), and the ingest operation takes no pin on any
            # surface: refused rather than dropped. Pin an extracted memory with PUT.
            if arguments.pop("pinned", False) is not False:
                raise _Rejected("pinned: not with messages; pin an extracted memory with PUT /v1/memory/{id}")
            return {**arguments, "messages": items}
        return {**arguments, "memory": content}

    @extend_schema(
        operation_id="v1_memory_list",
        parameters=[
            *_SCOPE_PARAMS,
            OpenApiParameter("memory_type", str),
            OpenApiParameter("tags", str, many=True),
            OpenApiParameter("limit", int),
            OpenApiParameter("cursor", str),
        ],
        responses={200: schemas.SeedListOutput, **_errors(*COMMON_ERRORS, 403)},
    )
    def get(self, request):
        def build(claimed: dict[str, Any]) -> dict[str, Any]:
            query = request.query_params
            # A GET's body is read too (only its `scope`): a claim there is no less a claim.
            body = _scope_claimed(
                request, claimed, _body(request), query_also={"memory_type", "tags", "limit", "cursor"}
            )
            _only(body, set())
            arguments = {**field_filter_arguments(query), **_narrowing(claimed)}
            if "limit" in query:
                arguments["page_size"] = _limit(query["limit"], schemas.PAGE_SIZE_MAX)
            if query.get("cursor"):
                arguments["cursor"] = query["cursor"]
            return arguments

        ran = _execute(request, "list_memory", build)
        return Response(
            {
                "memories": [seed_memory(ran.principal, m) for m in ran.answer["memories"]],
                "next_cursor": ran.answer["next_cursor"],
            }
        )


class SeedMemorySearchView(APIView):
    @extend_schema(
        operation_id="v1_memory_search",
        parameters=_SCOPE_PARAMS,
        request=_search_request,
        responses={200: schemas.SeedSearchOutput, **_errors(*COMMON_ERRORS, 403)},
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
        def build(claimed: dict[str, Any]) -> dict[str, Any]:
            body = _scope_claimed(request, claimed, _body(request))
            _only(body, {"query", "memory_type", "tags", "limit"})
            arguments: dict[str, Any] = {key: body[key] for key in ("query", "memory_type", "tags") if key in body}
            arguments["top_k"] = _limit(body.get("limit", 10), schemas.TOP_K_MAX)
            arguments.update(_narrowing(claimed))
            return arguments

        ran = _execute(request, "search_memory", build)
        return Response({"memories": [seed_memory(ran.principal, m) for m in ran.answer["results"]]})


class SeedMemoryItemView(APIView):
    @extend_schema(
        operation_id="v1_memory_update",
        parameters=_SCOPE_PARAMS,
        request=_store_request,
        responses={200: schemas.SeedMemoryOutput, **_errors(*COMMON_ERRORS, 403, 404)},
    )
    def put(self, request, memory_id: str):
        def build(claimed: dict[str, Any]) -> dict[str, Any]:
            body = _scope_claimed(request, claimed, _body(request))
            _only(body, set(STORE_FIELDS) | {"content", "metadata"})
            # The scope's agent_id/session_id narrow (the update answers not_found for a
            # memory outside them); they never move the memory to another agent.
            arguments = {**body, "memory_id": memory_id}
            if "content" in arguments:
                arguments["memory"] = arguments.pop("content")
            return arguments

        ran = _execute(request, "update_memory", build)
        return Response({"memory": seed_memory(ran.principal, ran.answer["memory"])})

    @extend_schema(
        operation_id="v1_memory_delete",
        parameters=_SCOPE_PARAMS,
        responses={200: schemas.DeleteOutput, **_errors(*COMMON_ERRORS, 403, 404)},
    )
    def delete(self, request, memory_id: str):
        return Response(_execute(request, "delete_memory", _deletion(request, memory_id)).answer)


def _deletion(request, memory_id: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """The arguments of a delete or forget: only the scope claim (a body was ignored by
    delete: a scope naming another user, or a `dry_run`, went unnoticed and the memory
    was deleted)."""

    def build(claimed: dict[str, Any]) -> dict[str, Any]:
        # The body is optional, but one that does not parse is answered and audited
        # like any bad argument (reading request.data raised past the dispatcher).
        body = _scope_claimed(request, claimed, _body(request))
        # Refused before anything is deleted: {"dry_run": true} must not delete.
        _only(body, set())
        return {"memory_id": memory_id}

    return build


def _scope_claimed(
    request,
    claimed: dict[str, Any],
    body: dict[str, Any] | schemas.RejectedArguments | None,
    *,
    query_also: Collection[str] = (),
) -> dict[str, Any]:
    """Read the scope a request claims into `claimed`, the same way on every /v1/memory
    route, wherever the client put it: the query string's `tenant_id`, `user_id`,
    `agent_id`, `session_id` (as the seed's list and delete put them), then the body's
    `scope` object (as its store, search and update do). Each route read one of them and
    ignored the other: `POST /v1/memory?user_id=bob` stored into the caller's memories,
    unnoticed. The query string is read first, so a claim it may not make is refused
    (403) even when the body is bad or contradicts it; any other query key is refused
    (`query_also`: a route's own, the list's filters). Returns the body without its
    `scope`; a body that does not parse is raised here, after the query's claim."""
    query = request.query_params
    _query_only(query, {*SCOPE_KEYS, *query_also})  # first: a repeated user_id is no claim
    claimed.update(_query_claim_of(query))
    if isinstance(body, schemas.RejectedArguments):
        raise _RejectedBody(body)
    rest = dict(body or {})
    scope = rest.pop("scope", None)
    if scope is not None:
        claimed.update(_claims_merged(claimed, _scope_of(scope)))
    return rest


def _claims_merged(query: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    """The body's scope beside the query string's claim: a key both name must name the
    same value, else neither silently wins (a refused claim replaced by an allowed one
    would go unnoticed). A null in the body names nothing (as a key left out): the query's
    claim stands, and is checked, beside it. Read after the
    query's claim, so a claim the query may not make is still refused first (403), as for
    any bad argument found after it."""
    said = {key: value for key, value in body.items() if value is not None}
    for key, value in said.items():
        if key in query and query[key] != value:
            raise _Rejected(f"scope.{key} in the body and {key} in the query string differ: give one, or the same")
    return said


class SeedMemoryForgetView(APIView):
    @extend_schema(
        operation_id="v1_memory_forget",
        description="An alias for delete, recorded as a user-initiated forget.",
        parameters=_SCOPE_PARAMS,
        request=None,
        responses={200: schemas.DeleteOutput, **_errors(*COMMON_ERRORS, 403, 404)},
    )
    def post(self, request, memory_id: str):
        return Response(_execute(request, "forget_memory", _deletion(request, memory_id)).answer)
