"""Review 19: seed 003's delete_memory by id deletes the stored message, not one of its
two rows. store_memory returns only the short-term id and recall shows either row of a
pair as one memory, so the long-term candidate made from a message goes to the trash
with its short-term row (and the other way round), in one call, restorable together."""

from __future__ import annotations

import pytest

from audit.models import AuditEvent
from billing.models import UsageEvent
from core.errors import ErrorCode, ServiceError
from core.scope import CallContext, MemoryScope
from memories.auth import Principal
from memories.models import ContentHash
from memories.operations import operation_execute
from memories.services import memory_remember, memory_restore
from tests.conftest import internal_call

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]

PRIVATE = "My home address is 12 Rue des Lilas, please keep it private."


def run(user, name: str, call: CallContext | None = None, **arguments) -> dict:
    principal = Principal(user=user, method="api_key", client_app="seed003-agent")
    return operation_execute(principal, name, arguments, call=call or CallContext(channel="mcp"))


def fails(user, name: str, **arguments) -> ServiceError:
    with pytest.raises(ServiceError) as caught:
        run(user, name, **arguments)
    return caught.value


def store(user, text: str = PRIVATE) -> str:
    return run(user, "store_memory", conversation_id="c1", messages=[{"role": "human", "content": text}])["stm_ids"][0]


def recalled(user, query: str = "home address") -> list[dict]:
    return run(user, "recall_memory", query=query)["results"]


def ltm_id_of(user) -> str:
    (row,) = [r for r in run(user, "recall_memory", query="home address", tier=["ltm"])["results"]]
    return row["_id"]


def test_deleting_the_stm_id_also_deletes_its_long_term_twin(alice):
    stm_id = store(alice)
    ltm_id = ltm_id_of(alice)
    call = CallContext(channel="mcp")
    usage_before = UsageEvent.objects.filter(operation="delete_memory").count()

    assert run(alice, "toolkit_delete_memory", call=call, memory_id=stm_id) == {"deleted_count": 2, "dry_run": False}

    assert [r for r in recalled(alice) if r["content"] == PRIVATE] == []
    assert run(alice, "hybrid_search", query="home address")["results"] == []
    health = run(alice, "memory_health")
    assert health["tier_stats"] == {"stm": 0, "ltm": 0} and health["trash"] == 2
    assert not ContentHash.objects.filter(memory_id=ltm_id).exists()
    # One call: one usage event, one audit row naming both ids.
    assert UsageEvent.objects.filter(operation="delete_memory").count() == usage_before + 1
    (row,) = AuditEvent.objects.filter(operation="delete_memory", request_id=call.request_id)
    assert row.memory_ids == [stm_id, ltm_id] and row.detail["linked"] == [ltm_id]

    # Undoing the call brings both back, the hash with the long-term one.
    restored = memory_restore(MemoryScope.for_user(alice), request_id=call.request_id, call=internal_call())
    assert sorted(restored) == sorted([stm_id, ltm_id])
    assert {r["_id"] for r in run(alice, "hybrid_search", query="home address")["results"]} == {stm_id, ltm_id}
    assert ContentHash.objects.filter(memory_id=ltm_id).exists()


def test_deleting_the_ltm_id_from_recall_also_deletes_its_short_term_copy(alice):
    stm_id = store(alice)
    ltm_id = ltm_id_of(alice)
    assert run(alice, "toolkit_delete_memory", memory_id=ltm_id) == {"deleted_count": 2, "dry_run": False}
    assert recalled(alice) == []
    assert fails(alice, "toolkit_delete_memory", memory_id=stm_id).code == ErrorCode.NOT_FOUND


def test_dry_run_counts_both_and_changes_nothing(alice):
    stm_id = store(alice)
    ltm_id = ltm_id_of(alice)
    assert run(alice, "toolkit_delete_memory", memory_id=stm_id, dry_run=True) == {"deleted_count": 2, "dry_run": True}
    assert run(alice, "toolkit_delete_memory", memory_id=ltm_id, dry_run=True) == {"deleted_count": 2, "dry_run": True}
    health = run(alice, "memory_health")
    assert health["tier_stats"] == {"stm": 1, "ltm": 1} and health["trash"] == 0
    assert ContentHash.objects.filter(memory_id=ltm_id).exists()


def test_a_message_without_a_twin_and_a_twin_gone_alone_delete_one(alice):
    short = run(alice, "store_memory", conversation_id="c1", messages=[{"role": "ai", "content": "Noted."}])
    assert run(alice, "toolkit_delete_memory", memory_id=short["stm_ids"][0])["deleted_count"] == 1
    stm_id = store(alice)
    ltm_id = ltm_id_of(alice)
    assert run(alice, "toolkit_delete_memory", memory_id=ltm_id)["deleted_count"] == 2
    memory_restore(MemoryScope.for_user(alice), memory_id=ltm_id, call=internal_call())  # by id: that one alone
    assert run(alice, "toolkit_delete_memory", memory_id=ltm_id) == {"deleted_count": 1, "dry_run": False}
    assert fails(alice, "toolkit_delete_memory", memory_id=stm_id).code == ErrorCode.NOT_FOUND


def test_a_memory_of_another_surface_is_never_a_twin(alice):
    """`tier` and `stm_id` are metadata any client may set; only store_memory's rows pair."""
    stm_id = store(alice)
    scope = MemoryScope.for_user(alice)
    forged = memory_remember(
        scope,
        memory="Bob's birthday is on the 3rd of May",
        metadata={"tier": "ltm", "stm_id": stm_id},
        call=internal_call(),
    ).id
    assert run(alice, "toolkit_delete_memory", memory_id=forged)["deleted_count"] == 1
    assert run(alice, "toolkit_delete_memory", memory_id=stm_id)["deleted_count"] == 2


def test_another_users_ids_behave_like_missing_ones(alice, bob):
    stm_id = store(alice)
    ltm_id = ltm_id_of(alice)
    missing = "00000000-0000-4000-8000-000000000000"
    for memory_id in (stm_id, ltm_id):
        for dry_run in (False, True):
            foreign = fails(bob, "toolkit_delete_memory", memory_id=memory_id, dry_run=dry_run)
            absent = fails(bob, "toolkit_delete_memory", memory_id=missing, dry_run=dry_run)
            assert (
                (foreign.code, foreign.message)
                == (absent.code, absent.message)
                == (
                    ErrorCode.NOT_FOUND,
                    "No memory with that id.",
                )
            )
    health = run(alice, "memory_health")
    assert health["tier_stats"] == {"stm": 1, "ltm": 1} and health["trash"] == 0


def test_a_bulk_forget_that_matches_one_row_of_a_message_takes_both(alice):
    """The enrichment types and tags the long-term candidate only; a bulk forget by its
    type trashed it and left the short-term row, which recall kept returning."""
    stm_id = store(alice)
    ltm_id = ltm_id_of(alice)
    run(alice, "update_memory", memory_id=ltm_id, memory_type="project")  # as the enrichment would
    counted = run(alice, "toolkit_delete_memory", memory_type="project", dry_run=True)
    assert counted == {"deleted_count": 2, "dry_run": True}  # the dry run counts what the forget takes
    forgotten = run(alice, "toolkit_delete_memory", memory_type="project", confirm=True)
    assert forgotten == {"deleted_count": 2, "dry_run": False}
    assert [r for r in recalled(alice) if r["content"] == PRIVATE] == []
    assert run(alice, "memory_health")["trash"] == 2
    row = AuditEvent.objects.filter(operation="delete_memory").latest("id")
    assert sorted(row.memory_ids) == sorted([stm_id, ltm_id]) and row.detail["count"] == 2
