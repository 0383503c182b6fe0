"""Seed 001's /v1/memory: every route reads a scope claim wherever the client can put it,
the same way (the query string's tenant_id/user_id/agent_id/session_id, the body's
`scope`). Store, search, update and prefetch read only the body's, list only the query
string's: `POST /v1/memory?user_id=bob` stored into alice's memories, 201. Now a claim
of another user is 403 `forbidden` and nothing is stored or read, a contradiction
between the two places is 400 `invalid_argument`, both audited; agent_id/session_id in
the query string narrow as the body's do."""

from __future__ import annotations

import json
import uuid

import pytest

from audit.models import AuditEvent
from memories.services import api_key_issue

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]
ALICE = {"tenant_id": "default", "user_id": "alice"}
BOB = {"tenant_id": "default", "user_id": "bob"}


def _stored(client, text: str, query: str = "") -> str:
    answer = client.post(f"/v1/memory{query}", {"content": text}, format="json")
    assert answer.status_code == 201, answer.content
    return answer.json()["memory"]["id"]


def _listed(client) -> list[tuple[str, str]]:
    return [(m["id"], m["content"]) for m in client.get("/v1/memory").json()["memories"]]


def _calls(client, memory_id: str, query: str, scope: dict | None = None) -> dict:
    """One call of each route that takes a body, with `query` and the body's `scope`."""
    extra = {} if scope is None else {"scope": scope}
    return {
        "remember": client.post(f"/v1/memory?{query}", {"content": "Alice likes figs", **extra}, format="json"),
        "search_memory": client.post(f"/v1/memory/search?{query}", {"query": "coffee", **extra}, format="json"),
        "update_memory": client.put(
            f"/v1/memory/{memory_id}?{query}", {"content": "Alice likes figs", **extra}, format="json"
        ),
        "memory_prefetch": client.post(f"/v1/memory/prefetch?{query}", {"query": "coffee", **extra}, format="json"),
    }


@pytest.fixture
def clients(api_client, alice, bob):
    return api_client(api_key_issue(user=alice, name="a")[1]), api_client(api_key_issue(user=bob, name="b")[1])


def test_a_query_string_claim_of_another_user_is_refused_by_every_route_and_nothing_is_stored(clients):
    alices, bobs = clients
    mine = _stored(alices, "Alice likes green tea")
    bob_memory = _stored(bobs, "Bob likes black coffee")
    before = AuditEvent.objects.latest("id").id
    for scope in (None, ALICE):  # alone, and beside a body's scope naming alice
        for operation, answer in _calls(alices, mine, "user_id=bob", scope).items():
            assert answer.status_code == 403, (operation, scope, answer.content)
            assert answer.json()["error"]["code"] == "forbidden"
            assert "Bob likes" not in answer.content.decode()
    assert _listed(alices) == [(mine, "Alice likes green tea")]  # nothing stored, nothing changed
    assert _listed(bobs) == [(bob_memory, "Bob likes black coffee")]
    refused = AuditEvent.objects.filter(id__gt=before).exclude(operation="list_memory")
    assert refused.count() == 8 and {r.outcome for r in refused} == {"denied"}


def test_a_query_string_and_a_body_that_contradict_each_other_are_refused_by_every_route(clients):
    alices, _ = clients
    mine = _stored(alices, "Alice likes green tea")
    for query, scope, status in [
        ("user_id=alice", BOB, 400),  # the query's claim is allowed, the body contradicts it
        ("tenant_id=default", {"tenant_id": "acme"}, 400),
        ("agent_id=coder", {"agent_id": "writer"}, 400),
        ("user_id=bob", ALICE, 403),  # a claim the query may not make is refused first
    ]:
        for operation, answer in _calls(alices, mine, query, scope).items():
            assert answer.status_code == status, (operation, query, answer.content)
            error = answer.json()["error"]
            if status == 400:
                key = query.split("=")[0]
                assert error["code"] == "invalid_argument" and f"scope.{key} in the body" in error["message"]
                assert "bob" not in error["message"] and "acme" not in error["message"]  # names fields only
    assert _listed(alices) == [(mine, "Alice likes green tea")]


def test_a_null_in_the_bodys_scope_never_clears_the_query_strings_claim(clients):
    """A null in the body names nothing: `?user_id=bob` beside it is still bob's claim."""
    alices, _ = clients
    mine = _stored(alices, "Alice likes green tea")
    nulls = {"tenant_id": None, "user_id": None}
    forgot = alices.post(f"/v1/memory/{mine}/forget?user_id=bob", {"scope": nulls}, format="json")
    assert forgot.status_code == 403, forgot.content
    for operation, answer in _calls(alices, mine, "user_id=bob", nulls).items():
        assert answer.status_code == 403, (operation, answer.content)
    assert _listed(alices) == [(mine, "Alice likes green tea")]


def test_agreeing_claims_work_and_the_query_strings_agent_narrows_as_the_bodys_does(clients):
    alices, bobs = clients
    bob_memory = _stored(bobs, "Bob likes black coffee")
    coder = _stored(alices, "Alice codes in Rust", "?tenant_id=default&user_id=alice&agent_id=coder")
    assert alices.get("/v1/memory?agent_id=coder").json()["memories"][0]["scope"] == {
        **ALICE,
        "agent_id": "coder",
        "session_id": None,
    }
    found = alices.post("/v1/memory/search?user_id=alice", {"query": "Rust", "scope": ALICE}, format="json")
    assert [m["id"] for m in found.json()["memories"]] == [coder]
    assert alices.post("/v1/memory/search?agent_id=writer", {"query": "Rust"}, format="json").json() == {"memories": []}
    prefetched = alices.post("/v1/memory/prefetch?agent_id=writer", {"query": "Rust"}, format="json").json()
    assert prefetched["memories"] == []
    # An update narrowed by the query string to another agent: as a missing id.
    outside = alices.put(f"/v1/memory/{coder}?agent_id=writer", {"content": "Alice codes in Go"}, format="json")
    missing = alices.put(f"/v1/memory/{uuid.uuid4()}", {"content": "Alice codes in Go"}, format="json")
    bobs_id = alices.put(f"/v1/memory/{bob_memory}?user_id=alice", {"content": "Alice codes in Go"}, format="json")
    for answer in (outside, missing, bobs_id):
        assert answer.status_code == 404 and answer.json()["error"]["code"] == "not_found", answer.content
    assert alices.delete(f"/v1/memory/{coder}?agent_id=writer").status_code == 404
    updated = alices.put(f"/v1/memory/{coder}?agent_id=coder", {"content": "Alice codes in Go"}, format="json")
    assert updated.status_code == 200 and updated.json()["memory"]["content"] == "Alice codes in Go"
    assert _listed(bobs) == [(bob_memory, "Bob likes black coffee")]


def test_a_get_reads_its_bodys_scope_and_unknown_query_keys_are_refused(clients):
    """The list read only its query string (a body's scope naming bob was ignored), the
    routes with a body only their body (`?limit=1` on a search was silently dropped)."""
    alices, _ = clients
    mine = _stored(alices, "Alice likes green tea")
    body = json.dumps({"scope": BOB})
    refused = alices.generic("GET", "/v1/memory", body, content_type="application/json")
    assert refused.status_code == 403, refused.content
    narrowed = alices.generic("GET", "/v1/memory", json.dumps({"scope": {"agent_id": "x"}}), "application/json")
    assert narrowed.status_code == 200 and narrowed.json()["memories"] == []
    stray = alices.post("/v1/memory/search?limit=1", {"query": "tea"}, format="json")
    assert stray.status_code == 400 and "unexpected query parameter 'limit'" in stray.json()["error"]["message"]
    stored = alices.post("/v1/memory?pinned=true", {"content": "Alice likes figs"}, format="json")
    assert stored.status_code == 400
    assert _listed(alices) == [(mine, "Alice likes green tea")]
