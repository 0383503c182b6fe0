"""A deleted or rewritten memory takes the person's cached answers with it.

Agents cache answers worked out from a person's memories (seed 003's store_cache), and an
entry does not say which memories it came from. So when one of the person's memories is
deleted (any surface: delete, forget, bulk forget, the web UI) or its text changes, all of
their cached answers go in the same transaction, and the audit row says how many. Nothing
else changes them: a pin, a failed call, a dry run, another user's id. Bob's answers never
go with alice's."""

from __future__ import annotations

import uuid

import pytest

from audit.models import AuditEvent
from memories.auth import Principal
from memories.operations import operation_execute
from memories.toolkit.models import CacheEntry
from tests.conftest import internal_call

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]


def run(user, operation: str, arguments: dict) -> dict:
    principal = Principal(user=user, method="api_key", client_app="cache-agent")
    return operation_execute(principal, operation, arguments, call=internal_call())


def remember(user, text: str) -> str:
    return run(user, "remember", {"memory": text})["id"]


def cache(user, query: str, response: str) -> uuid.UUID:
    return uuid.UUID(run(user, "store_cache", {"query": query, "response": response})["cache_id"])


def cached(user) -> set[uuid.UUID]:
    return set(CacheEntry.objects.filter(user=user).values_list("id", flat=True))


@pytest.fixture
def two_caches(alice, bob):
    """alice: a memory with an answer cached from it; bob: his own answer."""
    memory_id = remember(alice, "My gym locker code is 4417.")
    cache(alice, "What is my gym locker code?", "It is 4417.")
    bobs = cache(bob, "What is my gym locker code?", "bob-2929")
    return memory_id, bobs


def last_audit(operation: str) -> AuditEvent:
    return AuditEvent.objects.filter(operation=operation, outcome="ok").latest("id")


@pytest.mark.parametrize("operation", ["delete_memory", "forget_memory"])
def test_deleting_a_memory_drops_the_cached_answers(alice, bob, two_caches, operation):
    memory_id, bobs = two_caches
    run(alice, operation, {"memory_id": memory_id})
    assert cached(alice) == set() and cached(bob) == {bobs}
    assert run(alice, "check_cache", {"query": "What is my gym locker code?"}) == {"cache_hit": False}
    assert last_audit("delete_memory").detail["derived_answers_deleted"] == 1


def test_bulk_forget_drops_them_and_a_dry_run_does_not(alice, bob):
    run(alice, "remember", {"memory": "I keep my spare key under the blue pot.", "tags": ["home"]})
    cache(alice, "Where is my spare key?", "Under the blue pot.")
    bobs = cache(bob, "Where is my spare key?", "bob-mat")
    dry = run(alice, "delete_memory", {"tags": ["home"], "dry_run": True})
    assert dry["deleted_count"] == 1 and len(cached(alice)) == 1
    run(alice, "delete_memory", {"tags": ["home"], "confirm": True})
    assert cached(alice) == set() and cached(bob) == {bobs}
    assert last_audit("delete_memory").detail["derived_answers_deleted"] == 1


def test_a_bulk_forget_matching_nothing_keeps_them(alice):
    remember(alice, "I like green tea.")
    kept = cache(alice, "What tea do I like?", "Green tea.")
    assert run(alice, "delete_memory", {"tags": ["nothing-has-this"], "confirm": True})["deleted_count"] == 0
    assert cached(alice) == {kept}


def test_new_text_drops_them_and_a_pin_does_not(alice, bob, two_caches):
    memory_id, bobs = two_caches
    run(alice, "update_memory", {"memory_id": memory_id, "pinned": True})
    assert len(cached(alice)) == 1
    assert "derived_answers_deleted" not in (last_audit("update_memory").detail or {})
    run(alice, "update_memory", {"memory_id": memory_id, "memory": "My gym locker code is 9031."})
    assert cached(alice) == set() and cached(bob) == {bobs}
    assert last_audit("update_memory").detail == {"derived_answers_deleted": 1}


def test_another_users_memory_id_changes_nothing(alice, bob, two_caches):
    memory_id, bobs = two_caches
    alices = cached(alice)
    for operation, arguments in (
        ("delete_memory", {"memory_id": memory_id}),
        ("forget_memory", {"memory_id": memory_id}),
        ("update_memory", {"memory_id": memory_id, "memory": "bob was here"}),
    ):
        with pytest.raises(Exception) as refused:
            run(bob, operation, arguments)
        assert getattr(refused.value, "code", None) == "not_found"
    assert cached(alice) == alices and cached(bob) == {bobs}


def test_the_web_ui_delete_and_edit_drop_them(alice, bob, client, two_caches):
    memory_id, bobs = two_caches
    client.force_login(alice)
    client.post(f"/memories/{memory_id}/edit/", {"memory": "My gym locker code is 1212."})
    assert cached(alice) == set()
    cache(alice, "What is my gym locker code?", "It is 1212.")
    client.post(f"/memories/{memory_id}/delete/")
    assert cached(alice) == set() and cached(bob) == {bobs}
