"""Session 27: the toolkit's own metadata keys (`tier`, `enrichment_status`, `summary`) are
also keys any surface may set on a memory. Only store_memory's rows are the toolkit's: a
user's own memory keeps its `summary` through an edit, and memory_health reports the
toolkit's tiers and enrichment states, not whatever values the owner put in those keys."""

from __future__ import annotations

import pytest

from memories.auth import Principal
from memories.operations import operation_execute
from tests.conftest import internal_call

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]


@pytest.fixture(autouse=True)
def unlimited(settings):
    settings.RATE_LIMITS = {op: (0, 60) for op in settings.RATE_LIMITS}


def run(user, name: str, arguments: dict | None = None) -> dict:
    principal = Principal(user=user, method="api_key", client_app="seed003-agent")
    return operation_execute(principal, name, arguments or {}, call=internal_call())


def test_an_edit_keeps_the_owners_own_summary_key(alice):
    """memory_update dropped `summary` (and marked the memory pending for an enrichment
    that never takes up a memory store_memory did not make) on any memory with one."""
    mine = run(alice, "remember", {"memory": "Alice runs on Tuesdays", "metadata": {"summary": "running"}})
    updated = run(alice, "update_memory", {"memory_id": mine["id"], "memory": "Alice runs on Thursdays"})
    assert updated["memory"]["metadata"].get("summary") == "running"
    assert "enrichment_status" not in updated["memory"]["metadata"]


def test_memory_health_counts_the_toolkits_tiers_and_enrichment_states_only(alice):
    run(alice, "remember", {"memory": "Alice keeps a paper diary", "metadata": {"tier": "archive"}})
    run(alice, "remember", {"memory": "Alice owns a red kayak", "metadata": {"enrichment_status": "pending"}})
    run(alice, "remember", {"memory": "Alice plays the cello", "metadata": {"enrichment_status": "someday"}})
    preference = "I always prefer dark mode interfaces in every editor I use"  # a long-term candidate
    run(alice, "store_memory", {"conversation_id": "c", "messages": [{"role": "human", "content": preference}]})
    health = run(alice, "memory_health")
    assert health["total_memories"] == 5
    assert health["tier_stats"] == {"stm": 1, "ltm": 4}
    assert health["enrichment_stats"] == {"pending": 1, "completed": 0}


def test_recall_labels_a_memory_with_an_owners_tier_value_long_term(alice):
    run(alice, "remember", {"memory": "Alice keeps bees", "metadata": {"tier": 3}})
    results = run(alice, "recall_memory", {"query": "bees"})["results"]
    assert [r["tier"] for r in results] == ["ltm"]
