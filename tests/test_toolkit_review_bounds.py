"""Review of seed 003's toolkit bounds: store_cache never evicts the entry it just stored,
store_memory keeps a message whose text an expiring turn fact holds, and a user's
decisions are capped (DECISION_MAX_PER_USER)."""

from __future__ import annotations

import pytest

from audit.models import AuditEvent
from billing.models import UsageEvent
from memories.auth import Principal
from memories.operations import operation_execute
from memories.toolkit.models import CacheEntry
from tests.conftest import internal_call

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]


@pytest.fixture(autouse=True)
def unlimited(settings):
    settings.RATE_LIMITS = {op: (0, 60) for op in settings.RATE_LIMITS}


def run(user, name: str, arguments: dict | None = None) -> dict:
    principal = Principal(user=user, method="api_key", client_app="seed003-agent")
    return operation_execute(principal, name, arguments or {}, call=internal_call())


def queries(user) -> list[str]:
    return sorted(CacheEntry.objects.filter(user=user).values_list("query", flat=True))


# --- 1: store_cache evicted the entry it had just stored ------------------------------------------
def test_store_cache_never_evicts_the_entry_it_stores_when_older_ones_expire_later(alice, bob, settings):
    """Entries stored while CACHE_TTL_SECONDS was 3600; it is then lowered to 60 (or this
    process's clock is behind). At the cap the new entry was the one that expired first,
    so store_cache deleted it, answered its cache_id and billed the call; check_cache
    missed. The new entry stays, an older one goes, the cap holds, bob's are untouched."""
    settings.CACHE_MAX_ENTRIES_PER_USER = 3
    for n in range(3):
        run(bob, "store_cache", {"query": f"Bob's question {n}", "response": "bob"})
    for n in range(3):
        run(alice, "store_cache", {"query": f"old question {n}", "response": "old"})
    settings.CACHE_TTL_SECONDS = 60

    stored = run(alice, "store_cache", {"query": "What is the project deadline?", "response": "March 31"})

    assert CacheEntry.objects.filter(id=stored["cache_id"], user=alice).exists()
    hit = run(alice, "check_cache", {"query": "What is the project deadline?"})
    assert hit["cache_hit"] is True and hit["response"] == "March 31"
    assert CacheEntry.objects.filter(user=alice).count() == 3
    assert "What is the project deadline?" in queries(alice)
    row = AuditEvent.objects.filter(operation="store_cache", subject_user_id=alice.pk).latest("id")
    assert row.detail["cache_id"] == stored["cache_id"] and row.detail["evicted"] == 1
    # A second short-lived store keeps itself too, and evicts the other short-lived one
    # (it can be served for less time than the older ones): the cap still holds.
    again = run(alice, "store_cache", {"query": "Who owns the budget?", "response": "Dana"})
    assert CacheEntry.objects.filter(id=again["cache_id"]).exists()
    assert CacheEntry.objects.filter(user=alice).count() == 3
    assert run(alice, "check_cache", {"query": "Who owns the budget?"})["cache_hit"] is True
    assert queries(bob) == [f"Bob's question {n}" for n in range(3)]
    assert UsageEvent.objects.filter(operation="store_cache", user_id=str(alice.pk)).count() == 5


def test_store_cache_at_a_cap_of_one_keeps_only_the_new_entry(alice, bob, settings):
    settings.CACHE_MAX_ENTRIES_PER_USER = 1
    run(bob, "store_cache", {"query": "Bob's question", "response": "bob"})
    run(alice, "store_cache", {"query": "first question", "response": "r"})
    settings.CACHE_TTL_SECONDS = 60
    stored = run(alice, "store_cache", {"query": "second question", "response": "r"})
    assert [str(pk) for pk in CacheEntry.objects.filter(user=alice).values_list("id", flat=True)] == [
        stored["cache_id"]
    ]
    assert queries(bob) == ["Bob's question"]
