"""Review of seed 003's toolkit bounds: store_cache never evicts the entry it just stored,
store_memory keeps a message whose text an expiring turn fact holds, and a user's
decisions are capped (DECISION_MAX_PER_USER)."""

from __future__ import annotations

import contextlib
import json
import threading
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from audit.models import AuditEvent
from billing.models import UsageEvent
from core.errors import ErrorCode, ServiceError
from core.scope import MemoryScope
from memories.auth import Principal
from memories.operations import operation_execute
from memories.selectors import memory_get_owned
from memories.toolkit import services as toolkit_services
from memories.toolkit.models import CacheEntry, Decision
from memories.toolkit.services import toolkit_data_export
from memories.turns import services as turns
from tests.conftest import internal_call
from tests.test_turns import facts_of, turn

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


# --- 2: store_memory left a message's only long-term copy expiring ---------------------------------
CAFE = "Today I am working from the cafe."  # an L1 turn fact: it expires in a day


def test_store_memory_of_a_text_an_expiring_turn_fact_holds_makes_the_fact_durable(
    alice, alice_scope, bob, bob_scope, monkeypatch
):
    """store_memory skipped the human message's long-term candidate because the user 'has'
    the text, and left the turn fact that holds it expiring: two days later maintenance
    deleted it and nothing long-term of the message was left. The fact is made durable,
    as remember does, in the same call (named on its audit row); bob's fact of the same
    text is not touched."""
    fact = turn(alice, "s", "t1", CAFE)["fact_ids"][0]
    bobs = turn(bob, "s", "t1", CAFE)["fact_ids"][0]
    assert facts_of(alice_scope)[0].payload["attrs"].get("expires_at")

    said_twice = [{"role": "human", "content": CAFE}, {"role": "human", "content": CAFE}]
    stored = run(alice, "store_memory", {"conversation_id": "c-1", "messages": said_twice})

    assert stored["count"] == 2
    (row,) = facts_of(alice_scope)
    assert str(row.id) == fact and row.payload["attrs"].get("expires_at") is None
    audit = AuditEvent.objects.filter(operation="store_memory").latest("id")
    assert audit.detail["made_durable"] == [fact] and audit.detail["ltm_candidates"] == 0
    assert audit.memory_ids == [*stored["stm_ids"], fact]
    (bobs_row,) = facts_of(bob_scope)
    assert str(bobs_row.id) == bobs and bobs_row.payload["attrs"].get("expires_at")

    monkeypatch.setattr(turns, "_now", lambda: timezone.now() + timedelta(days=2))
    principal = Principal(user=alice, method="api_key")
    result = operation_execute(principal, "memory_run_maintenance", {"session_id": "s"}, call=internal_call())
    assert result["expired_facts"] == 0
    assert [str(item.id) for item in facts_of(alice_scope)] == [fact]
    assert memory_get_owned(alice_scope, memory_id=fact).text == CAFE


def test_store_memory_leaves_an_owners_own_expiring_memory_of_the_text_alone(alice, alice_scope):
    """An expiry the owner set on their memory is their choice: store_memory of the same
    text makes no candidate (the user has the text) and changes nothing of it."""
    kept = run(alice, "remember", {"memory": CAFE, "ttl_days": 3})["id"]
    before = memory_get_owned(alice_scope, memory_id=kept)
    assert before.attrs.expires_at
    run(alice, "store_memory", {"conversation_id": "c-1", "messages": [{"role": "human", "content": CAFE}]})
    after = memory_get_owned(alice_scope, memory_id=kept)
    assert after.attrs.expires_at == before.attrs.expires_at
    audit = AuditEvent.objects.filter(operation="store_memory").latest("id")
    assert "made_durable" not in audit.detail and kept not in audit.memory_ids


# --- 3: decisions had no per-user bound -------------------------------------------------------------
def fails(user, name: str, arguments: dict) -> ServiceError:
    with pytest.raises(ServiceError) as caught:
        run(user, name, arguments)
    return caught.value


def keys(user) -> list[str]:
    return sorted(Decision.objects.filter(user=user).values_list("key", flat=True))


def test_store_decision_refuses_a_new_key_past_the_cap_and_still_updates_one(alice, bob, settings):
    """Every new key was kept (only the rate limit bounded them), and the "Your data"
    export holds them all at once. Past DECISION_MAX_PER_USER a new key is refused with
    a stable code and nothing changes; an update of a key the user has is taken; bob's
    cap is his own."""
    settings.DECISION_MAX_PER_USER = 3
    for n in range(3):
        run(alice, "store_decision", {"key": f"k{n}", "value": "v"})
    usage = UsageEvent.objects.filter(operation="store_decision", user_id=str(alice.pk)).count()

    refused = fails(alice, "store_decision", {"key": "k3", "value": "v"})

    assert refused.code == ErrorCode.PAYLOAD_TOO_LARGE and refused.http_status == 413
    assert "3 decisions" in refused.message and "Nothing was changed" in refused.message
    assert keys(alice) == ["k0", "k1", "k2"]
    assert UsageEvent.objects.filter(operation="store_decision", user_id=str(alice.pk)).count() == usage
    row = AuditEvent.objects.filter(operation="store_decision", subject_user_id=alice.pk).latest("id")
    assert row.outcome == AuditEvent.Outcome.ERROR and row.error_code == "payload_too_large"
    assert run(alice, "store_decision", {"key": "k1", "value": "changed"})["action"] == "updated"
    assert run(alice, "recall_decision", {"key": "k1"})["decision"]["value"] == "changed"
    for n in range(3):
        assert run(bob, "store_decision", {"key": f"k{n}", "value": "bob"})["action"] == "created"
    assert fails(bob, "store_decision", {"key": "b3", "value": "v"}).code == ErrorCode.PAYLOAD_TOO_LARGE
    # Room made by the owner (a delete, or a decision that expired) takes a new key again.
    Decision.objects.filter(user=alice, key="k0").delete()
    assert run(alice, "store_decision", {"key": "k3", "value": "v"})["action"] == "created"
    Decision.objects.filter(user=alice, key="k1").update(expires_at=timezone.now() - timedelta(seconds=1))
    assert run(alice, "store_decision", {"key": "k4", "value": "v"})["action"] == "created"
    assert keys(alice) == ["k2", "k3", "k4"] and keys(bob) == ["k0", "k1", "k2"]
    document = json.loads("".join(toolkit_data_export(MemoryScope.for_user(alice), call=internal_call())))
    assert [d["key"] for d in document["decisions"]] == ["k2", "k3", "k4"]


def test_two_new_keys_stored_at_once_at_one_below_the_cap_keep_the_cap(alice, settings, monkeypatch):
    """Each store held only its key's lock: two new keys at cap - 1 could both see room
    and both be stored. Here the first to find room waits (bounded) for the other to find
    room too: with the user's lock the other cannot, and is refused once the first commits."""
    settings.DECISION_MAX_PER_USER = 3
    for n in range(2):
        run(alice, "store_decision", {"key": f"k{n}", "value": "v"})
    barrier = threading.Barrier(2)
    room = toolkit_services._decision_room

    def room_then_wait_for_the_other(scope, **kwargs):
        room(scope, **kwargs)
        # Broken after the timeout when the other store waits for our lock: we go on alone.
        with contextlib.suppress(threading.BrokenBarrierError):
            barrier.wait(timeout=3)

    monkeypatch.setattr(toolkit_services, "_decision_room", room_then_wait_for_the_other)
    outcomes: dict[str, object] = {}

    def store(key: str) -> None:
        try:
            outcomes[key] = run(alice, "store_decision", {"key": key, "value": "v"})["action"]
        except ServiceError as error:
            outcomes[key] = error.code
        finally:
            connection.close()

    threads = [threading.Thread(target=store, args=(key,)) for key in ("new-a", "new-b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(map(str, outcomes.values())) == ["created", "payload_too_large"]
    assert Decision.objects.filter(user=alice).count() == 3


def _transaction_lock_waiters() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'transactionid' AND NOT granted")
        return cursor.fetchone()[0]


def test_a_store_making_room_at_the_cap_does_not_deadlock_with_the_purge(alice, monkeypatch, settings):
    """At the cap a store deleted the user's expired decisions, waiting for each: the
    purge's one DELETE of every user's expired decisions, holding `b`, waited for `a`,
    which the store had deleted to make its key new, and the store waited for `b`.
    Postgres ended one of them (here the purge). The store now skips an expired decision
    another transaction holds (the purge is deleting it), and both finish."""
    settings.DECISION_MAX_PER_USER = 2
    past = timezone.now() - timedelta(days=1)
    for key, expires_at in (("b", past), ("a", past), ("c", None)):  # the purge reads `b` first
        Decision.objects.create(user=alice, key=key, value="v", created_at=past, updated_at=past, expires_at=expires_at)
    made_new, go_on = threading.Event(), threading.Event()
    room = toolkit_services._decision_room

    def room_once_the_purge_waits(scope, **kwargs):
        made_new.set()  # the expired `a` is deleted by now, row-locked until the store commits
        assert go_on.wait(60)
        return room(scope, **kwargs)

    monkeypatch.setattr(toolkit_services, "_decision_room", room_once_the_purge_waits)
    outcomes: dict[str, object] = {}

    def elsewhere(name: str, work) -> threading.Thread:
        def target() -> None:
            try:
                outcomes[name] = work()
            except Exception as error:  # handed to the assertions below
                outcomes[name] = error
            finally:
                connection.close()

        thread = threading.Thread(target=target)
        thread.start()
        return thread

    store = elsewhere("store", lambda: run(alice, "store_decision", {"key": "a", "value": "new"})["action"])
    assert made_new.wait(60)
    purge = elsewhere("purge", lambda: toolkit_services.toolkit_expired_purge()["decisions"])
    while not _transaction_lock_waiters() and purge.is_alive():  # the purge, holding `b`, waits for `a`
        threading.Event().wait(0.05)
    go_on.set()
    store.join(60)
    purge.join(60)
    assert outcomes == {"store": "created", "purge": 1}, outcomes
    assert keys(alice) == ["a", "c"]
    assert Decision.objects.get(user=alice, key="a").value == "new"
