"""Seed 001's /v1/memory: a forget's (and a delete's) query-string and body claims never
silently replace one another; a store with `messages` honours (or refuses) what it was sent and answers
in the seed's memory shape, like every other /v1/memory answer; a store and an update
refuse `expires_at` and `ttl_days` together alike."""

from __future__ import annotations

import pytest

from audit.models import AuditEvent
from memories.services import api_key_issue

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]
ALICE = {"tenant_id": "default", "user_id": "alice"}


def _stored(client, text: str = "Alice likes green tea") -> str:
    return client.post("/v1/memory", {"content": text}, format="json").json()["memory"]["id"]


# --- forget: the query's claim and the body's ---------------------------------------------------------
def test_a_forget_whose_query_claims_another_user_is_refused_whatever_the_body_claims(api_client, alice, bob):
    client = api_client(api_key_issue(user=alice, name="a")[1])
    memory_id = _stored(client)
    assert client.post(f"/v1/memory/{memory_id}/forget?user_id=bob").status_code == 403
    both = client.post(f"/v1/memory/{memory_id}/forget?user_id=bob", {"scope": ALICE}, format="json")
    # The query's claim for bob is refused, as it is alone: never dropped for the body's.
    assert both.status_code == 403, both.content
    assert client.get("/v1/memory").json()["memories"][0]["id"] == memory_id


def test_a_forget_whose_query_and_body_claim_different_users_is_invalid(api_client, alice, bob):
    client = api_client(api_key_issue(user=alice, name="a")[1])
    memory_id = _stored(client)
    for query, scope in [
        ("user_id=alice", {"tenant_id": "default", "user_id": "bob"}),
        ("tenant_id=default", {"tenant_id": "acme"}),
    ]:
        answer = client.post(f"/v1/memory/{memory_id}/forget?{query}", {"scope": scope}, format="json")
        assert answer.status_code == 400, answer.content
        error = answer.json()["error"]
        assert error["code"] == "invalid_argument"
        key = query.split("=")[0]
        assert f"scope.{key}" in error["message"] and f"{key} in the query string" in error["message"]
        assert "bob" not in error["message"] and "acme" not in error["message"]  # names fields, never values
    assert [m["id"] for m in client.get("/v1/memory").json()["memories"]] == [memory_id]  # nothing deleted
    refused = AuditEvent.objects.filter(operation="delete_memory").values_list("outcome", flat=True)
    assert list(refused) and set(refused) == {"error"}


def test_a_forget_whose_query_and_body_agree_forgets(api_client, alice):
    client = api_client(api_key_issue(user=alice, name="a")[1])
    memory_id = _stored(client)
    answer = client.post(f"/v1/memory/{memory_id}/forget?user_id=alice", {"scope": ALICE}, format="json")
    assert answer.status_code == 200 and answer.json() == {"id": memory_id, "deleted": True}


def test_a_delete_reads_its_bodys_scope_as_forget_does(api_client, alice, bob):
    """A DELETE's body was ignored: a scope naming bob, or a `dry_run`, went unnoticed and
    alice's memory was deleted. Now read as forget reads it: a claim of another user is
    refused (403), a contradiction of the query's is invalid (400), any other key is
    refused before anything is deleted; an agreeing scope deletes."""
    client = api_client(api_key_issue(user=alice, name="a")[1])
    memory_id = _stored(client)
    bob_scope = {"tenant_id": "default", "user_id": "bob"}
    assert client.delete(f"/v1/memory/{memory_id}", {"scope": bob_scope}, format="json").status_code == 403
    contradicted = client.delete(f"/v1/memory/{memory_id}?user_id=alice", {"scope": bob_scope}, format="json")
    assert contradicted.status_code == 400 and "bob" not in contradicted.json()["error"]["message"]
    dry = client.delete(f"/v1/memory/{memory_id}", {"dry_run": True}, format="json")
    assert dry.status_code == 400 and dry.json()["error"]["code"] == "invalid_argument"
    assert [m["id"] for m in client.get("/v1/memory").json()["memories"]] == [memory_id]  # nothing deleted
    agreed = client.delete(f"/v1/memory/{memory_id}?user_id=alice", {"scope": ALICE}, format="json")
    assert agreed.status_code == 200 and agreed.json() == {"id": memory_id, "deleted": True}
    bobs = api_client(api_key_issue(user=bob, name="b")[1])
    bob_memory = _stored(bobs, "Bob likes black coffee")
    # Bob's id is a missing one to alice, with a body or without.
    for body in (None, {"scope": ALICE}):
        missing = client.delete(f"/v1/memory/{bob_memory}", body, format="json")
        assert missing.status_code == 404, missing.content
    assert [m["id"] for m in bobs.get("/v1/memory").json()["memories"]] == [bob_memory]


# --- store with messages -------------------------------------------------------------------------------
VIM = [{"role": "user", "content": "I always use vim for editing."}]


def test_a_store_of_messages_asking_for_a_pin_is_refused_not_unpinned(api_client, alice, llm):
    client = api_client(api_key_issue(user=alice, name="a")[1])
    llm.queue_facts("User uses vim for editing")
    answer = client.post("/v1/memory", {"messages": VIM, "pinned": True, "scope": ALICE}, format="json")
    assert answer.status_code == 400, answer.content
    error = answer.json()["error"]
    assert error["code"] == "invalid_argument" and error["message"].startswith("pinned:")
    assert client.get("/v1/memory").json()["memories"] == []  # nothing extracted, nothing billed
    assert llm.requests == []  # refused before the LLM is called
    # pinned: false asks for nothing a store of messages does not do.
    stored = client.post("/v1/memory", {"messages": VIM, "pinned": False, "scope": ALICE}, format="json")
    assert stored.status_code == 201, stored.content


def test_a_store_of_messages_answers_the_memories_in_the_seed_shape(api_client, alice, llm):
    client = api_client(api_key_issue(user=alice, name="a")[1])
    llm.queue_facts("User uses vim for editing")
    body = {"messages": VIM, "memory_type": "feedback", "tags": ["tools"], "scope": {**ALICE, "agent_id": "coder"}}
    answer = client.post("/v1/memory", body, format="json")
    assert answer.status_code == 201, answer.content
    (memory,) = answer.json()["memories"]
    listed = client.get("/v1/memory").json()["memories"]
    # Every other /v1/memory answer's shape (the list's, here), plus the extraction's event.
    assert memory == {**listed[0], "event": "ADD"}
    assert (memory["content"], memory["memory_type"], memory["tags"]) == (
        "User uses vim for editing",
        "feedback",
        ["tools"],
    )
    assert memory["scope"] == {**ALICE, "agent_id": "coder", "session_id": None}


# --- expires_at and ttl_days ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "expiry", [{"ttl_days": 1, "expires_at": None}, {"ttl_days": None, "expires_at": "2999-01-01T00:00:00Z"}]
)
def test_expires_at_and_ttl_days_together_are_refused_by_a_store_and_an_update_alike(api_client, alice, expiry):
    client = api_client(api_key_issue(user=alice, name="a")[1])
    memory_id = _stored(client)
    stored = client.post("/v1/memory", {"content": "Alice likes figs", **expiry}, format="json")
    updated = client.put(f"/v1/memory/{memory_id}", expiry, format="json")
    for answer in (stored, updated):
        assert answer.status_code == 400, answer.content
        assert answer.json()["error"]["code"] == "invalid_argument"
        assert "expires_at or ttl_days, not both" in answer.json()["error"]["message"]
    assert [m["id"] for m in client.get("/v1/memory").json()["memories"]] == [memory_id]
    assert client.get("/v1/memory").json()["memories"][0]["expires_at"] is None
    # Both null asks for no expiry, as either alone does.
    cleared = client.put(f"/v1/memory/{memory_id}", {"ttl_days": None, "expires_at": None}, format="json")
    assert cleared.status_code == 200, cleared.content
