"""Bad input gets a clear error with a stable code and changes nothing."""

import pytest
from django.db import connection

from core.scope import MemoryScope
from memories.services import memory_remember
from tests.conftest import internal_call

pytestmark = pytest.mark.slow

UUID = "5b3a3c1e-1111-4444-8888-123456789abc"
BIG = "x" * 8001

CASES = [
    # tool, arguments, expected code
    ("remember", {"memory": BIG}, "payload_too_large"),
    ("remember", {"memory": ""}, "invalid_argument"),
    ("remember", {"memory": "   "}, "invalid_argument"),
    ("remember", {"memory": 42}, "invalid_argument"),
    ("remember", {}, "invalid_argument"),
    ("remember", {"memory": "ok", "pinned": "yes"}, "invalid_argument"),
    ("remember", {"memory": "ok", "metadata": {f"k{i}": i for i in range(21)}}, "payload_too_large"),
    ("remember", {"memory": "ok", "metadata": {"k": "v" * 1001}}, "payload_too_large"),
    ("remember", {"memory": "ok", "metadata": {"k": {"nested": 1}}}, "invalid_argument"),
    ("remember", {"memory": "ok", "metadata": "flat"}, "invalid_argument"),
    ("remember", {"memory": "ok", "metadata": {"bad key!": 1}}, "invalid_argument"),
    ("remember", {"memory": "ok", "user_id": "bob"}, "invalid_argument"),
    ("ingest", {"messages": []}, "invalid_argument"),
    ("ingest", {"messages": [{"role": "robot", "content": "hi"}]}, "invalid_argument"),
    ("ingest", {"messages": [{"role": "user", "content": BIG}]}, "payload_too_large"),
    ("ingest", {"messages": [{"role": "user", "content": "hi"}] * 51}, "payload_too_large"),
    ("ingest", {"messages": [{"role": "user", "content": "y" * 7000}] * 6}, "payload_too_large"),
    ("ingest", {"messages": [{"role": "system", "content": "only system"}]}, "invalid_argument"),
    ("ingest", {"messages": "hello"}, "invalid_argument"),
    ("ingest", {"messages": [{"role": "user", "content": "hi", "extra": 1}]}, "invalid_argument"),
    ("search_memory", {"query": "q" * 2001}, "payload_too_large"),
    ("search_memory", {"query": ""}, "invalid_argument"),
    ("search_memory", {"query": "q", "top_k": 0}, "invalid_argument"),
    ("search_memory", {"query": "q", "top_k": 51}, "invalid_argument"),
    ("search_memory", {"query": "q", "top_k": "5"}, "invalid_argument"),
    ("search_memory", {"query": "q", "top_k": 2.5}, "invalid_argument"),
    ("search_memory", {"query": "q", "filters": {"pinned": "yes"}}, "invalid_argument"),
    ("search_memory", {"query": ["q"]}, "invalid_argument"),
    ("update_memory", {"memory_id": UUID}, "invalid_argument"),
    ("update_memory", {"memory_id": "not-a-uuid", "memory": "x"}, "invalid_argument"),
    ("update_memory", {"memory_id": UUID, "memory": BIG}, "payload_too_large"),
    ("update_memory", {"memory_id": 7, "memory": "x"}, "invalid_argument"),
    ("update_memory", {"memory_id": UUID, "pinned": 1}, "invalid_argument"),
    ("delete_memory", {}, "invalid_argument"),
    ("delete_memory", {"memory_id": "../../etc"}, "invalid_argument"),
    ("delete_memory", {"memory_id": UUID, "force": True}, "invalid_argument"),
    ("list_memory", {"page_size": 201}, "invalid_argument"),
    ("list_memory", {"page_size": "10"}, "invalid_argument"),
    ("list_memory", {"cursor": "!!not-ours!!"}, "invalid_argument"),
    ("list_memory", {"cursor": "c" * 513}, "payload_too_large"),
    ("clear_all_memory", {}, "confirmation_required"),
    ("clear_all_memory", {"confirm": False}, "confirmation_required"),
    ("clear_all_memory", {"confirm": "true"}, "invalid_argument"),
    ("clear_all_memory", {"confirm": True, "user_id": "bob"}, "invalid_argument"),
]


def _database_state() -> tuple:
    with connection.cursor() as cursor:
        counts = []
        for table in (
            "memories",
            "memories_contenthash",
            "audit_memoryhistory",
            "memories_enginemessage",
        ):
            cursor.execute(f"SELECT count(*), md5(string_agg(t::text, ',' ORDER BY t::text)) FROM {table} t")  # noqa: S608
            counts.append(cursor.fetchone())
    return tuple(counts)


@pytest.fixture
def existing(alice, memsite_server):  # noqa: ARG001
    return memory_remember(
        MemoryScope.for_user(alice), memory="An existing memory", pinned=True, call=internal_call()
    ).id


def test_every_tool_rejects_bad_arguments_and_changes_nothing(mcp_as, alice_key, existing):
    mcp = mcp_as(alice_key)
    before = _database_state()
    failures = []
    for tool, arguments, expected in CASES:
        error = mcp.error(tool, arguments)
        if error["code"] != expected or not error["message"]:
            failures.append((tool, arguments if len(str(arguments)) < 80 else "<big>", error))
        assert "Traceback" not in error["message"]
    assert failures == []
    assert _database_state() == before
    assert mcp.ok("list_memory", {})["memories"][0]["id"] == existing


def test_rest_rejects_bad_bodies(api_client, alice_key, existing):
    client = api_client(alice_key)
    before = _database_state()
    response = client.post("/v1/memories", data="{not json", content_type="application/json")
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_argument"
    response = client.post("/v1/memories", data="[1, 2]", content_type="application/json")
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_argument"
    response = client.post("/v1/memories", {"memory": "x" * 8001}, format="json")
    assert response.status_code == 413 and response.json()["error"]["code"] == "payload_too_large"
    response = client.get("/v1/memories?page_size=abc")
    assert response.status_code == 400
    response = client.get("/v1/memories?filters={bad")
    assert response.status_code == 400
    response = client.get("/v1/memories?owner=bob")
    assert response.status_code == 400
    response = client.patch(f"/v1/memories/{existing}", {"memory_id": UUID, "memory": "x"}, format="json")
    assert response.status_code == 400
    response = client.post("/v1/memories/clear", {}, format="json")
    assert response.status_code == 400 and response.json()["error"]["code"] == "confirmation_required"
    assert _database_state() == before
