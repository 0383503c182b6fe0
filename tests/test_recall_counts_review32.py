"""A memory's `access_count`/`last_recalled_at` counted the searches that returned it
(search_memory, seed 003's recall_memory) but not the recalls that inject it into a
prompt: seed 001's prefetch and seed 002's memory_before_turn (and memory_run_turn,
which is before_turn). Their audit rows list the memories they injected, and
`memory_recalls_fold` now counts them as it counts a search's."""

from __future__ import annotations

import pytest

from memories.services import api_key_issue, memory_recalls_fold, memory_remember
from tests.conftest import internal_call
from tests.test_turns import run, user_msg

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]


def test_prefetch_before_turn_and_run_turn_count_as_accesses(api_client, alice, alice_scope, bob_scope):
    cat = memory_remember(alice_scope, memory="Alice's cat is called Miso", call=internal_call()).id
    memory_remember(bob_scope, memory="Bob's cat is called Tom", call=internal_call())
    client = api_client(api_key_issue(user=alice, name="a")[1])
    prefetched = client.post("/v1/memory/prefetch", {"query": "cat name", "limit": 1}, format="json")
    assert [m["id"] for m in prefetched.json()["memories"]] == [cat]
    said = [user_msg("What is my cat called?")]
    assert run(alice, "memory_before_turn", session_id="s", current_input=said)["recall_fact_ids"] == [cat]
    assert run(alice, "memory_run_turn", session_id="s", current_input=said)["recall_fact_ids"] == [cat]
    assert client.get("/v1/memory").json()["memories"][0]["access_count"] == 0  # folded, not on the path
    assert memory_recalls_fold(settle_seconds=0) == 3
    (listed,) = client.get("/v1/memory").json()["memories"]
    assert (listed["id"], listed["access_count"]) == (cat, 3) and listed["last_recalled_at"] is not None


def test_seed_003s_hybrid_search_counts_as_an_access(alice_scope, bob_scope):
    from memories.toolkit.services import toolkit_hybrid_search

    cat = memory_remember(alice_scope, memory="Alice's cat is called Miso", call=internal_call()).id
    bobs = memory_remember(bob_scope, memory="Bob's cat is called Tom", call=internal_call()).id
    found = toolkit_hybrid_search(alice_scope, query="cat name", limit=1, call=internal_call())
    assert [r["_id"] for r in found["results"]] == [cat]
    assert memory_recalls_fold(settle_seconds=0) >= 1
    assert _accesses(alice_scope, cat) == 1 and _accesses(bob_scope, bobs) == 0


def _accesses(scope, memory_id: str) -> int:
    from memories.selectors import memory_get_owned, memory_view

    return memory_view(memory_get_owned(scope, memory_id=memory_id)).access_count
