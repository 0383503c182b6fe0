"""Scope comes only from authentication: bob can never read, change or delete alice's
memory, and another user's id behaves exactly like a missing one."""

import uuid

import pytest

from audit.models import MemoryHistory
from core.scope import MemoryScope
from memories import engine
from memories.services import memory_remember
from tests.conftest import internal_call

pytestmark = pytest.mark.slow

ALICE_FACT = "Alice's locker code is 4417"


@pytest.fixture
def alice_memory(alice, memsite_server) -> str:  # noqa: ARG001 - flushes data after the test
    return memory_remember(
        MemoryScope.for_user(alice), memory=ALICE_FACT, metadata={"kind": "secret"}, call=internal_call()
    ).id


def _alice_memory_untouched(memory_id: str) -> None:
    stored = engine.engine_get(memory_id)
    assert stored is not None and stored.text == ALICE_FACT
    assert stored.metadata["kind"] == "secret"
    assert list(MemoryHistory.objects.filter(memory_id=memory_id).values_list("event", flat=True)) == ["ADD"]


def test_mcp_every_tool(mcp_as, bob_key, alice_memory):
    bob = mcp_as(bob_key)
    missing = str(uuid.uuid4())
    for memory_id in (alice_memory, missing):
        update = bob.error("update_memory", {"memory_id": memory_id, "memory": "pwned", "pinned": True})
        delete = bob.error("delete_memory", {"memory_id": memory_id})
        assert update["code"] == delete["code"] == "not_found"
        assert update["message"] == delete["message"] == "No memory with that id."

    assert bob.ok("search_memory", {"query": ALICE_FACT, "top_k": 50})["results"] == []
    assert bob.ok("list_memory", {"page_size": 200})["memories"] == []
    assert bob.ok("clear_all_memory", {"confirm": True}) == {"deleted": 0}
    # bob remembering the same text gets a memory of his own, not alice's.
    bobs = bob.ok("remember", {"memory": ALICE_FACT})
    assert bobs["duplicate"] is False and bobs["id"] != alice_memory
    assert bob.error("search_memory", {"query": "x", "user_id": "alice"})["code"] == "invalid_argument"
    assert bob.error("remember", {"memory": "x", "metadata": {"user_id": "alice"}})["code"] == "invalid_argument"
    assert bob.error("list_memory", {"filters": {"user_id": "1"}})["code"] == "invalid_argument"

    _alice_memory_untouched(alice_memory)


def test_rest_every_endpoint(api_client, bob_key, alice_memory):
    bob = api_client(bob_key)
    missing = str(uuid.uuid4())
    for memory_id in (alice_memory, missing):
        update = bob.patch(f"/v1/memories/{memory_id}", {"memory": "pwned"}, format="json")
        delete = bob.delete(f"/v1/memories/{memory_id}")
        assert update.status_code == delete.status_code == 404
        assert update.json() == delete.json() == {"error": {"code": "not_found", "message": "No memory with that id."}}

    assert bob.post("/v1/memories/search", {"query": ALICE_FACT}, format="json").json()["results"] == []
    assert bob.get("/v1/memories").json()["memories"] == []
    assert bob.post("/v1/memories/clear", {"confirm": True}, format="json").json() == {"deleted": 0}
    assert bob.post("/v1/memories", {"memory": ALICE_FACT}, format="json").json()["id"] != alice_memory
    response = bob.post("/v1/memories/search", {"query": "x", "user_id": "alice"}, format="json")
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_argument"
    # issue 11: bulk forget, the trash and /v1/memory never reach alice's memory.
    forget = {"tags": [], "memory_type": "user", "dry_run": True}
    assert bob.post("/v1/memories/forget", forget, format="json").json() == {"deleted_count": 1, "dry_run": True}
    for memory_id in (alice_memory, missing):
        assert bob.post("/v1/trash/restore", {"memory_id": memory_id}, format="json").status_code == 404
        assert bob.post("/v1/trash/purge", {"memory_id": memory_id}, format="json").status_code == 404
        assert bob.put(f"/v1/memory/{memory_id}", {"content": "pwned"}, format="json").status_code == 404
        assert bob.delete(f"/v1/memory/{memory_id}").status_code == 404
        assert bob.post(f"/v1/memory/{memory_id}/forget").status_code == 404
    search = bob.post("/v1/memory/search", {"query": ALICE_FACT}, format="json").json()["memories"]
    assert [m["content"] for m in search] == [ALICE_FACT] and search[0]["id"] != alice_memory  # bob's own copy
    claim = bob.post("/v1/memory/search", {"query": "x", "scope": {"user_id": "alice"}}, format="json")
    assert claim.status_code == 403 and claim.json()["error"]["code"] == "forbidden"

    _alice_memory_untouched(alice_memory)


REST_CALLS = [
    ("get", "/v1/memories", None),
    ("post", "/v1/memories", {"memory": "x"}),
    ("post", "/v1/memories/search", {"query": "x"}),
    ("post", "/v1/memories/ingest", {"messages": [{"role": "user", "content": "x"}]}),
    ("post", "/v1/memories/clear", {"confirm": True}),
    ("patch", "/v1/memories/{id}", {"memory": "x"}),
    ("delete", "/v1/memories/{id}", None),
    # issue 11
    ("post", "/v1/memories/forget", {"tags": ["x"], "confirm": True}),
    ("get", "/v1/trash", None),
    ("post", "/v1/trash/restore", {"memory_id": "{id}"}),
    ("post", "/v1/trash/purge", {"all": True}),
    ("post", "/v1/memory", {"content": "x"}),
    ("get", "/v1/memory", None),
    ("post", "/v1/memory/search", {"query": "x"}),
    ("put", "/v1/memory/{id}", {"content": "x"}),
    ("delete", "/v1/memory/{id}", None),
    ("post", "/v1/memory/{id}/forget", None),
]


@pytest.mark.parametrize(("method", "path", "body"), REST_CALLS)
@pytest.mark.parametrize("token", [None, "msk_0123456789ab_wrong", "not-a-key", ""])
def test_rest_needs_a_valid_token(api_client, alice_memory, method, path, body, token):
    client = api_client(token)
    if body and body.get("memory_id") == "{id}":
        body = {**body, "memory_id": alice_memory}
    response = getattr(client, method)(path.format(id=alice_memory), body, format="json")
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "unauthenticated"
    assert response["WWW-Authenticate"].startswith('Bearer resource_metadata="http://testserver/.well-known/')
    _alice_memory_untouched(alice_memory)


@pytest.mark.parametrize(
    ("tool", "arguments"),
    [
        ("search_memory", {"query": "x"}),
        ("remember", {"memory": "x"}),
        ("ingest", {"messages": [{"role": "user", "content": "x"}]}),
        ("update_memory", {"memory_id": "{id}", "memory": "x"}),
        ("delete_memory", {"memory_id": "{id}"}),
        ("list_memory", {}),
        ("clear_all_memory", {"confirm": True}),
    ],
)
def test_mcp_needs_a_valid_token(mcp_as, alice_memory, tool, arguments):
    from mcp.shared.exceptions import MCPError

    arguments = {k: (v.format(id=alice_memory) if isinstance(v, str) else v) for k, v in arguments.items()}
    caller = mcp_as("msk_0123456789ab_wrong")
    with pytest.raises(MCPError):
        caller.call(tool, arguments)
    assert caller.statuses and set(caller.statuses) == {401}
    _alice_memory_untouched(alice_memory)
