"""Seed 001's store answers the memory it stored, read back after the call. A memory whose
`expires_at` passed during the call (a slow embedding) was hidden from that read: the
client got 404 for a store that succeeded and was billed."""

from __future__ import annotations

import time
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from billing.models import UsageEvent
from memories import operations, services
from memories.operations import OPERATIONS
from memories.services import api_key_issue

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]


def test_a_memory_that_expired_during_its_store_is_answered_as_stored(api_client, alice, monkeypatch):
    client = api_client(api_key_issue(user=alice, name="store")[1])
    embed = services.engine_embed_text
    assert client.post("/v1/memory", {"content": "A warm-up store"}, format="json").status_code == 201

    def slow(text):
        time.sleep(4)  # past the expiry below
        return embed(text)

    monkeypatch.setattr(services, "engine_embed_text", slow)
    soon = (datetime.now(UTC) + timedelta(seconds=3)).isoformat()
    answer = client.post("/v1/memory", {"content": "Alice's parking spot is B4", "expires_at": soon}, format="json")
    assert answer.status_code == 201, answer.content
    assert answer.json()["memory"]["content"] == "Alice's parking spot is B4"
    assert list(UsageEvent.objects.values_list("operation", flat=True)) == ["remember"] * 2
    assert client.get(f"/v1/memory/{answer.json()['memory']['id']}").status_code in (404, 405)  # gone for reads


def _deleted_right_after_the_store(monkeypatch, other) -> None:
    """The store's transaction commits, then another of Alice's agents forgets the new
    memory before the store is answered."""
    definition = OPERATIONS["remember"]

    def run(scope, args, call):
        result = definition.run_with_extras(scope, args, call)
        assert other.delete(f"/v1/memory/{result['id']}").status_code == 200
        return result

    # Seed 001's store is the surface that asks for the memory (`run_with_extras`).
    monkeypatch.setitem(OPERATIONS, "remember", replace(definition, run_with_extras=run))


@pytest.mark.parametrize("trash_days", [0, 30])
def test_a_store_deleted_before_its_answer_is_answered_as_stored(api_client, alice, settings, monkeypatch, trash_days):
    settings.TRASH_RETENTION_DAYS = trash_days  # 0: the delete is final
    client = api_client(api_key_issue(user=alice, name="a")[1])
    other = api_client(api_key_issue(user=alice, name="b")[1])
    _deleted_right_after_the_store(monkeypatch, other)
    answer = client.post("/v1/memory", {"content": "Alice likes green tea", "tags": ["drinks"]}, format="json")
    # Stored and billed: answered so (a retry would store and bill it again), never a 404.
    assert answer.status_code == 201, answer.content
    memory = answer.json()["memory"]
    assert (memory["content"], memory["tags"], memory["scope"]["user_id"]) == (
        "Alice likes green tea",
        ["drinks"],
        "alice",
    )
    assert list(UsageEvent.objects.values_list("operation", flat=True)) == ["remember", "delete_memory"]


def test_a_store_is_answered_for_whom_it_ran_as_without_resolving_it_again(api_client, alice, monkeypatch):
    client = api_client(api_key_issue(user=alice, name="a")[1])
    resolved = []
    real = operations.subject_resolve

    def counted(**kwargs):
        resolved.append(kwargs["username"])
        return real(**kwargs)

    monkeypatch.setattr(operations, "subject_resolve", counted)
    answer = client.post(
        "/v1/memory",
        {"content": "Alice likes figs", "scope": {"tenant_id": "default", "user_id": "alice"}},
        format="json",
    )
    assert answer.status_code == 201 and answer.json()["memory"]["scope"]["user_id"] == "alice"
    assert resolved == ["alice"]  # when the call was admitted; not again after it committed
    # What the store's transaction read is what a read after it answers.
    assert answer.json()["memory"] == client.get("/v1/memory").json()["memories"][0]
    again = client.post("/v1/memory", {"content": "Alice likes figs"}, format="json")
    assert again.status_code == 200 and again.json() == {"memory": answer.json()["memory"], "duplicate": True}
