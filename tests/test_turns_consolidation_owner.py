"""Consolidation and retention of turn facts (seed 002) keep what the owner made theirs:
facts of different sessions, agents or types never merge; a fact whose fields the owner
changed, restored from the trash or remembered is never trashed; an expiry the owner set
on a pinned fact is kept, whichever job runs first."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from core.errors import ErrorCode, ServiceError
from memories import services as memory_services
from memories.engine import engine_trashed
from memories.turns import services as turns
from tests.conftest import InThread
from tests.test_turns import facts_of, run, turn

pytestmark = pytest.mark.django_db

MORNING = "I prefer tea over coffee in the morning."
MORNING_AGAIN = "I prefer tea over coffee in the morning!"  # another text, the same words


def live_ids(scope) -> set[str]:
    return {str(row.id) for row in facts_of(scope)}


def attrs_of(scope, memory_id: str) -> dict:
    return next(row.payload["attrs"] for row in facts_of(scope) if str(row.id) == memory_id)


def maintenance(user, **arguments) -> int:
    return run(user, "memory_run_maintenance", **arguments)["consolidated_facts"]


# --- 1: different sessions, agents, types; fields the owner changed ---------------------------------
def test_near_duplicates_of_two_sessions_each_stay_recalled_in_their_own(alice, alice_scope, clean_vectors):
    first = turn(alice, "s1", "t1", MORNING)["fact_ids"][0]
    second = turn(alice, "s2", "t1", MORNING_AGAIN)["fact_ids"][0]
    prefetch = [m["id"] for m in run(alice, "memory_prefetch", query="tea or coffee", session_id="s1")["memories"]]
    assert prefetch == [first]
    assert maintenance(alice) == 0  # the nightly run's scope: all the user's sessions
    assert maintenance(alice, session_id="s1") == 0
    assert live_ids(alice_scope) == {first, second}
    prefetch = [m["id"] for m in run(alice, "memory_prefetch", query="tea or coffee", session_id="s1")["memories"]]
    assert prefetch == [first]


@pytest.mark.django_db(transaction=True)  # update_memory reads through the engine's own pool
def test_a_fact_whose_fields_the_owner_changed_is_never_trashed(alice, alice_scope, clean_vectors):
    first = turn(alice, "s", "t1", MORNING)["fact_ids"][0]
    tags = attrs_of(alice_scope, first)["tags"]
    run(alice, "update_memory", memory_id=first, tags=[*tags, "health"], importance=0.95)
    newer = turn(alice, "s", "t2", MORNING_AGAIN)["fact_ids"][0]
    assert maintenance(alice, session_id="s") == 1
    # The owner's fact is the group's: the newer plain copy goes (restorable).
    assert live_ids(alice_scope) == {first}
    assert [m.id for m in engine_trashed(alice_scope)] == [newer]
    kept = attrs_of(alice_scope, first)
    assert "health" in kept["tags"] and kept["importance"] == 0.95


@pytest.mark.django_db(transaction=True)  # update_memory reads through the engine's own pool
def test_facts_of_another_agent_or_type_never_merge(alice, alice_scope, clean_vectors):
    coder = turn(alice, "s", "t1", MORNING)["fact_ids"][0]
    run(alice, "update_memory", memory_id=coder, agent_id="coder", memory_type="feedback")
    plain = turn(alice, "s", "t2", MORNING_AGAIN)["fact_ids"][0]
    assert maintenance(alice, session_id="s") == 0
    assert live_ids(alice_scope) == {coder, plain}
    kept = attrs_of(alice_scope, coder)
    assert kept["agent_id"] == "coder" and kept["memory_type"] == "feedback"


# --- 2: restored from the trash, remembered ---------------------------------------------------------
def test_a_consolidated_fact_restored_from_the_trash_stays(alice, alice_scope, clean_vectors):
    older = turn(alice, "s", "t1", MORNING)["fact_ids"][0]
    newer = turn(alice, "s", "t2", MORNING_AGAIN)["fact_ids"][0]
    assert maintenance(alice, session_id="s") == 1
    assert live_ids(alice_scope) == {newer}
    assert run(alice, "restore_memory", memory_id=older)["restored"] == [older]
    # The undo sticks: neither copy is trashed again, by this run nor the nightly one's.
    assert maintenance(alice, session_id="s") == 0
    assert maintenance(alice) == 0
    assert live_ids(alice_scope) == {older, newer}


def test_a_turn_fact_the_user_remembered_is_never_trashed(alice, alice_scope, clean_vectors):
    remembered = turn(alice, "s", "t1", MORNING)["fact_ids"][0]  # long-term: nothing to make durable
    assert run(alice, "remember", memory=MORNING) == {"id": remembered, "duplicate": True}
    newer = turn(alice, "s", "t2", MORNING_AGAIN)["fact_ids"][0]
    assert maintenance(alice, session_id="s") == 1
    assert live_ids(alice_scope) == {remembered}
    assert [m.id for m in engine_trashed(alice_scope)] == [newer]


# --- 3: an expiry the owner set on a pinned fact ----------------------------------------------------
@pytest.mark.django_db(transaction=True)  # update_memory reads through the engine's own pool
def test_an_expiry_set_on_a_pinned_fact_is_kept_by_retention(alice, alice_scope, monkeypatch, clean_vectors):
    fact = turn(alice, "s", "t1", "Today I am working from the cafe.")["fact_ids"][0]
    run(alice, "update_memory", memory_id=fact, pinned=True)  # made durable at pin time
    assert "expires_at" not in attrs_of(alice_scope, fact)
    run(alice, "update_memory", memory_id=fact, ttl_days=1)  # then the owner's own expiry
    assert attrs_of(alice_scope, fact)["expires_at"]
    monkeypatch.setattr(turns, "_now", lambda: timezone.now() + timedelta(days=2))
    # Expired, it is deleted as the purge of expired memories would: never brought back.
    assert run(alice, "memory_run_maintenance", session_id="s")["expired_facts"] == 1
    assert facts_of(alice_scope) == []
    assert engine_trashed(alice_scope) == []


# --- 4: the kept copy changed between the read and the lock -----------------------------------------
def _meanwhile(monkeypatch, change) -> None:
    """Run `change` on another connection after consolidation read the facts and before it
    locks them, as an owner's call committing at that moment would."""
    real_lock = turns.engine_lock_owned_many

    def change_then_lock(scope, *, memory_ids, **options):
        InThread(change).result()
        return real_lock(scope, memory_ids=memory_ids, **options)

    monkeypatch.setattr(turns, "engine_lock_owned_many", change_then_lock)


@pytest.mark.django_db(transaction=True)  # the owner's call runs on a connection of its own
def test_a_fact_whose_kept_twin_was_rewritten_meanwhile_stays(alice, alice_scope, monkeypatch, clean_vectors):
    older = turn(alice, "s", "t1", MORNING)["fact_ids"][0]
    newer = turn(alice, "s", "t2", MORNING_AGAIN)["fact_ids"][0]
    _meanwhile(monkeypatch, lambda: run(alice, "update_memory", memory_id=newer, memory="I switched to coffee only."))
    # The tea fact now lives only in `older`: nothing is a duplicate any more.
    assert maintenance(alice, session_id="s") == 0
    assert live_ids(alice_scope) == {older, newer}
    assert engine_trashed(alice_scope) == []


@pytest.mark.django_db(transaction=True)  # the owner's call runs on a connection of its own
@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda user, memory_id: run(user, "delete_memory", memory_id=memory_id), id="deleted"),
        pytest.param(
            lambda user, memory_id: run(user, "update_memory", memory_id=memory_id, session_id="s2"), id="moved"
        ),
    ],
)
def test_a_fact_whose_kept_twin_left_meanwhile_stays(alice, alice_scope, monkeypatch, clean_vectors, change):
    older = turn(alice, "s", "t1", MORNING)["fact_ids"][0]
    newer = turn(alice, "s", "t2", MORNING_AGAIN)["fact_ids"][0]
    _meanwhile(monkeypatch, lambda: change(alice, newer))
    assert maintenance(alice, session_id="s") == 0
    assert older in live_ids(alice_scope)
    assert older not in {m.id for m in engine_trashed(alice_scope)}


def test_a_fact_whose_kept_twin_is_unchanged_still_goes(alice, alice_scope, monkeypatch, clean_vectors):
    # The re-check is no blanket pass: a twin left as it was still has the older copy trashed.
    older = turn(alice, "s", "t1", MORNING)["fact_ids"][0]
    newer = turn(alice, "s", "t2", MORNING_AGAIN)["fact_ids"][0]
    locked: list[list[str]] = []
    real_lock = turns.engine_lock_owned_many

    def recording_lock(scope, *, memory_ids, **options):
        locked.append(sorted(memory_ids))
        return real_lock(scope, memory_ids=memory_ids, **options)

    monkeypatch.setattr(turns, "engine_lock_owned_many", recording_lock)
    assert maintenance(alice, session_id="s") == 1
    assert locked == [sorted([older, newer])]  # the kept copy is locked with the doomed one
    assert live_ids(alice_scope) == {newer}
    assert [m.id for m in engine_trashed(alice_scope)] == [older]


# --- 5: a writer holding the kept copy (or the doomed fact) while consolidation locks -------------
@pytest.mark.django_db(transaction=True)  # the owner's call runs on a connection of its own
def test_an_update_holding_the_kept_copy_does_not_deadlock_with_consolidation(
    alice, alice_scope, monkeypatch, clean_vectors
):
    """An update locks its memory, then the holder of its new text. Consolidation locked
    the doomed fact and its kept copy in id order, waiting for each: an update of one of
    the two to the other's text, holding the first while consolidation held the second,
    deadlocked, and Postgres ended the maintenance run (resource_busy). Now consolidation
    waits for no row: the pair stays until the next run, and both calls finish."""
    older = turn(alice, "s", "t1", MORNING)["fact_ids"][0]
    newer = turn(alice, "s", "t2", MORNING_AGAIN)["fact_ids"][0]
    # The update holds the row consolidation locks second, and then locks the first.
    target, text = (newer, MORNING) if older < newer else (older, MORNING_AGAIN)
    holding, go_on = threading.Event(), threading.Event()
    real_holder = memory_services._hash_owner_memory

    def holder_after_go_on(scope, *, digest):
        if threading.current_thread().name == "owner-update" and not holding.is_set():
            holding.set()  # the update's own row is locked by now
            assert go_on.wait(60)
        return real_holder(scope, digest=digest)

    monkeypatch.setattr(memory_services, "_hash_owner_memory", holder_after_go_on)
    real_lock = turns.engine_lock_owned_many

    def lock_then_let_the_update_go_on(scope, *, memory_ids, **options):
        # The update locks the other row while this statement runs, or has run.
        go_on.set()
        return real_lock(scope, memory_ids=memory_ids, **options)

    monkeypatch.setattr(turns, "engine_lock_owned_many", lock_then_let_the_update_go_on)
    update: dict[str, BaseException] = {}

    def owner_update() -> None:
        try:
            run(alice, "update_memory", memory_id=target, memory=text)
        except BaseException as exc:  # handed to the test's thread below
            update["error"] = exc
        finally:
            connection.close()

    thread = threading.Thread(target=owner_update, name="owner-update", daemon=True)
    thread.start()
    assert holding.wait(60)
    assert maintenance(alice, session_id="s") == 0  # the kept copy was busy: nothing trashed
    thread.join(60)
    assert not thread.is_alive()
    # The update's own answer: the text is the other fact's.
    assert isinstance(update["error"], ServiceError) and update["error"].code == ErrorCode.CONFLICT
    assert live_ids(alice_scope) == {older, newer}
    assert maintenance(alice, session_id="s") == 1  # the next run, nothing busy: the older goes
    assert live_ids(alice_scope) == {newer}
