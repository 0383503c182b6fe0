"""Review 18 of the trash and the dedupe hashes: a restore gives hashes to the memories
that hold one in live data (never a toolkit short-term copy), a deleted hash holder hands
its hash to another live copy, a memory that expired in the trash is not restored; an
update never merges metadata past what an import takes, pinning keeps a turn fact, and a
project name fits its tag."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection
from django.utils import timezone

from audit.models import AuditEvent
from core.errors import ErrorCode, ServiceError
from memories.auth import Principal
from memories.models import ContentHash
from memories.operations import operation_execute
from memories.schemas import METADATA_MAX_KEYS, TAG_MAX_CHARS
from memories.services import memory_purge_due
from tests.conftest import internal_call
from tests.test_turns import facts_of, turn

# Deletes and updates read the memory through the engine's own pool: committed data.
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]

FLIGHT = "Your flight is KL1234 at 9am."
DARK_MODE = "I always prefer dark mode interfaces in every editor I use"
TEA = "Alice likes tea"


def run(user, name: str, **arguments):
    principal = Principal(user=user, method="api_key", client_app="review18")
    return operation_execute(principal, name, arguments, call=internal_call())


def fails(user, name: str, **arguments) -> ServiceError:
    with pytest.raises(ServiceError) as caught:
        run(user, name, **arguments)
    return caught.value


def listed(user) -> dict[str, str]:
    """Live memories: id -> text."""
    return {m["id"]: m["memory"] for m in run(user, "list_memory", page_size=200)["memories"]}


def hash_holders(scope) -> list[str]:
    return sorted(str(i) for i in ContentHash.objects.filter(engine_user_id=scope.engine_user_id).values_list(
        "memory_id", flat=True
    ))  # fmt: skip


def expire_now(memory_id: str) -> None:
    """The memory's expiry five minutes ago (as if time had passed in the trash)."""
    stamp = (datetime.now(UTC) - timedelta(minutes=5)).isoformat(timespec="microseconds")
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE memories SET payload = jsonb_set(payload, '{attrs,expires_at}', to_jsonb(%s::text)) WHERE id = %s",
            [stamp, memory_id],
        )


def clear_and_restore(user) -> list[str]:
    run(user, "clear_all_memory", confirm=True)
    clear = AuditEvent.objects.filter(operation="clear_all_memory", outcome="ok").latest("id")
    return run(user, "restore_memory", request_id=clear.request_id)["restored"]


# --- F1: a restore gives hashes as live data holds them ----------------------------------------------
def test_a_fact_remembered_after_undoing_a_clear_all_outlives_the_toolkits_short_term_copy(
    alice, alice_scope, settings
):
    stored = run(
        alice,
        "store_memory",
        conversation_id="c-1",
        messages=[{"role": "human", "content": DARK_MODE}, {"role": "ai", "content": FLIGHT}],
    )
    human_stm, ai_stm = stored["stm_ids"]
    (ltm_id,) = set(listed(alice)) - {human_stm, ai_stm}
    assert hash_holders(alice_scope) == [ltm_id]

    assert sorted(clear_and_restore(alice)) == sorted([human_stm, ai_stm, ltm_id])
    # As before the clear-all: the long-term copy holds the hash, no short-term copy does.
    assert hash_holders(alice_scope) == [ltm_id]

    remembered = run(alice, "remember", memory=FLIGHT)
    assert remembered["duplicate"] is False and remembered["id"] != ai_stm
    assert run(alice, "remember", memory=DARK_MODE) == {"id": ltm_id, "duplicate": True}

    later = datetime.now(UTC) + timedelta(hours=settings.STM_TTL_HOURS + 1)
    assert memory_purge_due(now=later) == 2  # the two short-term copies
    assert listed(alice) == {remembered["id"]: FLIGHT, ltm_id: DARK_MODE}


def test_restoring_equal_texts_together_gives_the_hash_to_the_one_without_expiry(alice, alice_scope):
    durable = run(alice, "remember", memory="Passport renewal is due in May")["id"]
    run(alice, "delete_memory", memory_id=durable)
    expiring = run(alice, "remember", memory="passport renewal is due in may", ttl_days=30)["id"]
    run(alice, "restore_memory", memory_id=durable)  # beside the newer copy, which hands it the hash
    assert hash_holders(alice_scope) == [durable]
    assert sorted(clear_and_restore(alice)) == sorted([expiring, durable])
    assert hash_holders(alice_scope) == [durable]


def test_a_durable_copy_restored_beside_an_expiring_holder_keeps_the_text_deduped(alice, alice_scope):
    """The expiring holder kept the hash; the purge then dropped it with the holder, and
    the durable copy left held none: remembering the text again stored a third copy."""
    durable = run(alice, "remember", memory=TEA)["id"]
    run(alice, "delete_memory", memory_id=durable)
    expiring = run(alice, "remember", memory=TEA, ttl_days=1)["id"]
    run(alice, "restore_memory", memory_id=durable)
    assert memory_purge_due(now=datetime.now(UTC) + timedelta(days=2)) == 1
    assert list(listed(alice)) == [durable] and expiring != durable
    assert run(alice, "remember", memory=TEA) == {"id": durable, "duplicate": True}


def test_a_copy_without_the_hash_may_resend_its_own_text(alice, alice_scope):
    """Restored beside a newer copy, the older one holds no hash: an update that resends
    its own text (with a pin) was refused as a duplicate of the newer copy."""
    older = run(alice, "remember", memory=TEA)["id"]
    run(alice, "delete_memory", memory_id=older)
    newer = run(alice, "remember", memory=TEA)["id"]
    run(alice, "restore_memory", memory_id=older)
    updated = run(alice, "update_memory", memory_id=older, memory=TEA, pinned=True)
    assert updated["memory"]["pinned"] is True and hash_holders(alice_scope) == [newer]
    with pytest.raises(ServiceError) as refused:  # a new text that another memory holds still is
        run(alice, "update_memory", memory_id=older, memory="Something else entirely")
        run(alice, "update_memory", memory_id=older, memory=TEA)
    assert refused.value.code == ErrorCode.CONFLICT


def test_a_bulk_forget_hands_the_hash_to_a_live_copy_as_a_delete_does(alice, alice_scope):
    older = run(alice, "remember", memory=TEA, tags=["a"])["id"]
    run(alice, "delete_memory", memory_id=older)
    newer = run(alice, "remember", memory=TEA, tags=["b"])["id"]
    assert newer != older
    run(alice, "restore_memory", memory_id=older)
    assert run(alice, "delete_memory", tags=["b"], confirm=True)["deleted_count"] == 1
    assert hash_holders(alice_scope) == [older]
    assert run(alice, "remember", memory=TEA) == {"id": older, "duplicate": True}  # not a third copy


def test_a_new_text_hands_the_old_texts_hash_to_a_live_copy(alice, alice_scope):
    older = run(alice, "remember", memory=TEA)["id"]
    run(alice, "delete_memory", memory_id=older)
    newer = run(alice, "remember", memory=TEA)["id"]
    run(alice, "restore_memory", memory_id=older)
    run(alice, "update_memory", memory_id=newer, memory="Alice likes coffee now")
    assert hash_holders(alice_scope) == sorted([older, newer])  # each text's own holder
    assert run(alice, "remember", memory=TEA) == {"id": older, "duplicate": True}


# --- F7: a deleted hash holder hands its hash to another live copy --------------------------------
@pytest.mark.parametrize(
    ("first", "again"),
    [
        (TEA, TEA),
        (TEA, "alice  LIKES tea"),  # equal up to case and spacing: found by its words
        ("To be or not to be", "To be or not to be"),  # stop words only: found by the exact text
    ],
)
def test_a_restored_copy_takes_the_hash_when_the_newer_copy_is_deleted(alice, alice_scope, first, again):
    older = run(alice, "remember", memory=first)["id"]
    run(alice, "delete_memory", memory_id=older)
    newer = run(alice, "remember", memory=again)["id"]
    assert newer != older
    assert run(alice, "restore_memory", memory_id=older) == {"restored": [older]}
    assert hash_holders(alice_scope) == [newer]

    run(alice, "delete_memory", memory_id=newer)
    assert hash_holders(alice_scope) == [older]
    assert run(alice, "remember", memory=first) == {"id": older, "duplicate": True}
    assert list(listed(alice)) == [older]


def test_a_deleted_holder_hands_no_hash_to_a_short_term_copy_or_another_users_memory(alice, bob, alice_scope):
    run(alice, "store_memory", conversation_id="c-1", messages=[{"role": "ai", "content": FLIGHT}])
    bobs = run(bob, "remember", memory=FLIGHT)["id"]
    remembered = run(alice, "remember", memory=FLIGHT)["id"]
    run(alice, "delete_memory", memory_id=remembered)
    assert hash_holders(alice_scope) == []
    assert ContentHash.objects.get(memory_id=bobs)  # bob's own hash is untouched
    assert run(alice, "remember", memory=FLIGHT)["duplicate"] is False


# --- F8: a memory that expired in the trash is not restored ---------------------------------------------
def test_a_memory_that_expired_in_the_trash_is_not_restored_by_id(alice, bob, alice_scope):
    memory_id = run(alice, "remember", memory="Gate code is 4711", ttl_days=1)["id"]
    run(alice, "delete_memory", memory_id=memory_id)
    expire_now(memory_id)

    error = fails(alice, "restore_memory", memory_id=memory_id)
    assert error.code == ErrorCode.NOT_FOUND and "expired while in the trash" in error.message
    assert listed(alice) == {}
    assert [m["id"] for m in run(alice, "list_trash")["memories"]] == [memory_id]
    assert not hash_holders(alice_scope)
    # For someone else the id is a missing one, as ever.
    assert fails(bob, "restore_memory", memory_id=memory_id).message == "No memory with that id."


def test_undoing_a_clear_all_restores_the_unexpired_and_counts_the_expired(alice):
    kept = run(alice, "remember", memory="Dentist is Dr. Lima")["id"]
    lapsed = run(alice, "remember", memory="Parking spot 12 today", ttl_days=1)["id"]
    run(alice, "clear_all_memory", confirm=True)
    clear = AuditEvent.objects.get(operation="clear_all_memory", outcome="ok")
    expire_now(lapsed)

    assert run(alice, "restore_memory", request_id=clear.request_id) == {"restored": [kept]}
    assert list(listed(alice)) == [kept]
    row = AuditEvent.objects.get(operation="restore_memory", outcome="ok")
    assert row.memory_ids == [kept] and row.detail["expired"] == 1
    # Nothing restorable left: said so, not a silent empty success.
    error = fails(alice, "restore_memory", request_id=clear.request_id)
    assert error.code == ErrorCode.NOT_FOUND and "expired while in the trash" in error.message


# --- F2: merged metadata stays importable ---------------------------------------------------------------
def test_an_update_that_would_merge_metadata_past_the_limit_is_refused_and_changes_nothing(alice):
    memory_id = run(alice, "remember", memory="Project kickoff notes")["id"]
    run(alice, "update_memory", memory_id=memory_id, metadata={f"a{i}": i for i in range(15)})
    before = run(alice, "list_memory")["memories"][0]

    error = fails(alice, "update_memory", memory_id=memory_id, metadata={f"b{i}": i for i in range(15)}, pinned=True)
    assert error.code == ErrorCode.PAYLOAD_TOO_LARGE and error.http_status == 413
    assert f"at most {METADATA_MAX_KEYS}" in error.message and "30 keys" in error.message
    assert "b0" not in error.message and "a0" not in error.message
    assert run(alice, "list_memory")["memories"][0] == before

    # Changing keys it has already, or adding up to the limit, goes through.
    run(alice, "update_memory", memory_id=memory_id, metadata={"a0": "zero", **{f"b{i}": i for i in range(5)}})
    assert len(run(alice, "list_memory")["memories"][0]["metadata"]) == METADATA_MAX_KEYS


def test_an_update_that_would_merge_metadata_past_the_byte_limit_is_refused(alice):
    memory_id = run(alice, "remember", memory="Long labels", metadata={f"k{i}": "x" * 900 for i in range(5)})["id"]
    error = fails(alice, "update_memory", memory_id=memory_id, metadata={f"m{i}": "y" * 900 for i in range(5)})
    assert error.code == ErrorCode.PAYLOAD_TOO_LARGE and "bytes" in error.message
    assert len(json.dumps(run(alice, "list_memory")["memories"][0]["metadata"])) < 8192


def test_the_export_of_a_memory_updated_up_to_the_limit_imports_again(alice, bob):
    memory_id = run(alice, "remember", memory="Round trip")["id"]
    run(alice, "update_memory", memory_id=memory_id, metadata={f"a{i}": i for i in range(10)})
    run(alice, "update_memory", memory_id=memory_id, metadata={f"b{i}": i for i in range(10)})
    exported = run(alice, "export_memories", format="jsonl")["content"]
    assert run(bob, "import_memories", data=exported.encode(), source="memsite")["imported"] == 1


# --- pinned turn facts -----------------------------------------------------------------------------
def test_a_pinned_turn_fact_survives_the_purge_of_expired_memories(alice, alice_scope):
    fact = turn(alice, "s", "t1", "Today I am working from the cafe.")["fact_ids"][0]
    (row,) = facts_of(alice_scope)
    assert row.payload["attrs"].get("expires_at")  # an expiring (L1) turn fact
    run(alice, "update_memory", memory_id=fact, pinned=True)

    assert memory_purge_due(now=datetime.now(UTC) + timedelta(days=30)) == 0
    assert list(listed(alice)) == [fact]
    (row,) = facts_of(alice_scope)
    assert "expires_at" not in row.payload["attrs"] and "tier:long_term" in row.payload["attrs"]["tags"]
    # A pin that sets its own expiry keeps that expiry.
    other = turn(alice, "s", "t2", "Today I am working late.")["fact_ids"][0]
    until = (timezone.now() + timedelta(hours=3)).isoformat()
    view = run(alice, "update_memory", memory_id=other, pinned=True, expires_at=until)["memory"]
    assert view["expires_at"] is not None and view["pinned"] is True and "tier:l1" in view["tags"]


# --- F3: a project name fits its tag -----------------------------------------------------------------
def test_a_project_name_longer_than_its_tag_allows_is_refused_and_the_longest_fits(alice, alice_scope):
    longest = "p" * (TAG_MAX_CHARS - len("project:"))
    error = fails(alice, "memory_prefetch", query="tea", project=longest + "p")
    assert error.code == ErrorCode.INVALID_ARGUMENT and f"at most {len(longest)} characters" in error.message
    assert fails(alice, "memory_after_turn", session_id="s", turn_id="t1", project="q" * 128,
                 input_items=[{"type": "message", "role": "user", "content": "I like tea."}]).code == (
        ErrorCode.INVALID_ARGUMENT
    )  # fmt: skip

    turn(alice, "s", "t1", "I prefer green tea over coffee.", project=longest)
    (row,) = facts_of(alice_scope)
    assert f"project:{longest}" in row.payload["attrs"]["tags"]
    exported = run(alice, "export_memories", format="jsonl")["content"]
    run(alice, "clear_all_memory", confirm=True)
    assert run(alice, "import_memories", data=exported.encode(), source="memsite")["imported"] == 1
