"""An erasure that commits while an ingest is still in flight (mem0's LLM call, then mem0
writing its own rows outside our transaction) leaves nothing of that ingest behind; a
clear-all in that window puts the ingest's facts in the trash with everything else.

The LLM is a real HTTP fake whose answer is held until the test releases it, so the
ingest is genuinely in flight (its intent committed, mem0 waiting) while the erasure runs
and commits; the writes mem0 makes afterwards are real."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection, transaction
from django.db.models import Q

from audit.models import AuditEvent, MemoryHistory
from core.locks import advisory_xact_lock
from core.scope import CallContext, MemoryScope
from memories import engine
from memories.auth import Principal
from memories.models import ContentHash, EngineMessage, IngestIntent
from memories.operations import operation_execute
from memories.services import ingest_intents_reconcile, memory_ingest, memory_remember
from memories.toolkit.services import toolkit_user_data_wipe
from proxy.models import ProxyTurn
from proxy.services import proxy_turn_extract, proxy_turns_sweep
from tests.conftest import InThread, internal_call, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]

TURN = [{"role": "user", "content": "My sister Ingrid moved to Narvik, and I took up the nyckelharpa."}]
FACTS = ("Alice's sister Ingrid lives in Narvik", "Alice plays the nyckelharpa")


def run(user, name: str, arguments: dict | None = None) -> dict:
    principal = Principal(user=user, method="api_key", client_app="race-test")
    return operation_execute(principal, name, arguments or {}, call=internal_call())


@dataclass
class Gate:
    entered: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)


@contextmanager
def llm_held(llm) -> Iterator[Gate]:
    """The fake LLM (the network boundary) holds each extraction answer until released."""
    gate = Gate()
    answer = llm.handle

    def held(method, path, headers, payload):
        if path.endswith("/chat/completions"):
            gate.entered.set()
            gate.release.wait(60)
        return answer(method, path, headers, payload)

    llm.handle = held
    try:
        yield gate
    finally:
        gate.release.set()
        llm.handle = answer


def history_with(text: str):
    return MemoryHistory.objects.filter(Q(old_memory__icontains=text) | Q(new_memory__icontains=text))


@contextmanager
def ingest_in_flight(
    llm, scope: MemoryScope, *, facts: tuple[str, ...] = FACTS, messages: list[dict] = TURN
) -> Iterator[tuple[CallContext, InThread]]:
    """An ingest call of `scope` running in a thread, held in its LLM call until the block
    ends: (its call context, the thread)."""
    llm.queue_facts(*facts)
    call = internal_call()
    with llm_held(llm) as gate:
        ingest = InThread(lambda: memory_ingest(scope, messages=messages, call=call))
        assert gate.entered.wait(30)
        yield call, ingest


def nothing_left_of(scope: MemoryScope, *, request_id: str, words: tuple[str, ...]) -> None:
    """No memory, hash, raw message or history text of the call (its history events stay,
    blank); no intent holding a text."""
    assert engine.engine_rows_from_request(request_id=request_id) == []
    live = [engine.engine_memory_of(row).text for row in engine.engine_rows_owned(scope)]
    assert not [t for t in live if any(w in t for w in words)]
    assert not engine.engine_trashed(scope)
    assert not ContentHash.objects.filter(engine_user_id=scope.engine_user_id).exists()
    for word in words:
        assert not history_with(word).exists(), word
        assert not EngineMessage.objects.filter(content__icontains=word).exists(), word
        assert not [i for i in IngestIntent.objects.values("results", "detail") if word in str(i)], word
    assert not MemoryHistory.objects.filter(request_id=request_id).exclude(old_memory=None, new_memory=None).exists()


def the_audit_row(request_id: str) -> AuditEvent:
    return AuditEvent.objects.get(request_id=request_id, operation="ingest")


# --- (1) MCP/REST ingest held in its LLM call while the user erases their data ----------------
def test_an_ingest_in_flight_during_a_wipe_leaves_nothing_and_says_so(alice, alice_scope, llm):
    memory_remember(alice_scope, memory="Alice lives in Tromsø", call=internal_call())
    with ingest_in_flight(llm, alice_scope) as (call, ingest):
        assert IngestIntent.objects.get(request_id=call.request_id).state == IngestIntent.State.OPEN
        wiped = run(alice, "wipe_user_data", {"confirm": True})
        assert wiped["memories_deleted"] == 1
    # mem0 got its answer after the erasure committed and wrote its rows; the call answers
    # that nothing was stored.
    assert ingest.result() == []

    nothing_left_of(alice_scope, request_id=call.request_id, words=("Narvik", "nyckelharpa", "Tromsø"))
    # What happened is still on record: mem0's ADD and our DELETE, without their texts.
    events = sorted(MemoryHistory.objects.filter(request_id=call.request_id).values_list("event", flat=True))
    assert events == ["ADD", "ADD", "DELETE", "DELETE"]
    wipe_row = AuditEvent.objects.get(operation="wipe_user_data", outcome="ok")
    row = the_audit_row(call.request_id)
    assert row.outcome == "ok" and len(row.memory_ids) == 2
    assert row.before is None and row.after is None
    assert row.detail["superseded_by"]["request_id"] == wipe_row.request_id
    assert row.detail["superseded_by"]["erased"] is True
    assert row.detail["discarded"] == 2 and row.detail["trashed"] is False
    intent = IngestIntent.objects.get(request_id=call.request_id)
    assert (intent.state, intent.results) == (IngestIntent.State.DONE, [])


# --- (2) the chat proxy's extraction (the worker after an answered chat call) -----------------
def _turn(user, scope: MemoryScope) -> ProxyTurn:
    """The outbox row an answered chat call commits (proxy.services.chat_call_finish)."""
    return ProxyTurn.objects.create(
        request_id=internal_call().request_id, user=user, tenant=scope.tenant, session_id="s1", messages=TURN
    )


def test_a_chat_turn_extracted_during_a_wipe_leaves_nothing_and_is_not_retried(alice, alice_scope, llm, settings):
    settings.PROXY_MEMORY_STORE_TIMEOUT_S = 60
    turn = _turn(alice, alice_scope)
    llm.queue_facts(*FACTS)
    with llm_held(llm) as gate:
        extraction = InThread(lambda: proxy_turn_extract(turn_pk=turn.pk))
        assert gate.entered.wait(30)
        run(alice, "wipe_user_data", {"confirm": True})
    # The wipe deleted the turn; the extraction's results were discarded.
    assert extraction.result() == "erased"

    row = AuditEvent.objects.get(operation="ingest", turn_id=turn.request_id)
    assert (row.outcome, row.channel) == ("ok", "proxy")
    assert row.detail["superseded_by"]["erased"] is True and row.detail["discarded"] == 2
    nothing_left_of(alice_scope, request_id=row.request_id, words=("Narvik", "nyckelharpa"))
    # Nothing retries the turn: the sweep finds none, and a late task skips it.
    assert not ProxyTurn.objects.exists()
    assert proxy_turns_sweep(older_than_s=0) == 0
    assert proxy_turn_extract(turn_pk=turn.pk) == "skipped"
    assert len(llm.requests) == 1


def _advisory_waiters() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted")
        return cursor.fetchone()[0]


def test_a_chat_turn_claimed_just_before_a_wipe_is_not_extracted_after_it(alice, alice_scope, llm):
    turn = _turn(alice, alice_scope)
    llm.queue_facts(*FACTS)
    wipe = internal_call()
    with transaction.atomic():
        # The wipe holds the user's clear_all lock; the worker has claimed the turn and
        # waits for that lock to record its ingest.
        advisory_xact_lock(f"clear_all:{alice_scope.engine_user_id}")
        extraction = InThread(lambda: proxy_turn_extract(turn_pk=turn.pk))
        wait_for(lambda: _advisory_waiters() == 1, timeout=20, what="the extraction waiting for the wipe")
        toolkit_user_data_wipe(alice_scope, confirm=True, call=wipe)

    assert extraction.result() == "erased"
    assert llm.requests == []  # mem0 was never called with the erased turn
    assert not IngestIntent.objects.exists()
    assert not AuditEvent.objects.filter(operation="ingest").exists()
    assert not EngineMessage.objects.exists()


# --- (3) a crash: the reconciler completes a superseded intent -------------------------------
def test_the_reconciler_discards_what_a_superseded_ingest_stored_before_it_crashed(alice, alice_scope, llm):
    call = internal_call()
    # As memory_ingest records it before its engine call.
    IngestIntent.objects.create(
        request_id=call.request_id,
        engine_user_id=alice_scope.engine_user_id,
        scope={"tenant": alice_scope.tenant, "user_pk": alice_scope.user_pk, "client_app": None},
        call={"channel": "internal"},
        detail={"messages": 1},
        created_at=datetime.now(UTC) - timedelta(hours=1),
    )

    def mem0_writes(fact: str) -> None:
        """What the engine call stores on its own connection, tagged with the request id."""
        llm.queue_facts(fact)
        with engine.history_attribution(request_id=call.request_id, changed_by="alice"):
            engine.engine_ingest(alice_scope, messages=TURN, request_id=call.request_id)

    mem0_writes(FACTS[0])  # before the erasure: the wipe deletes it
    run(alice, "wipe_user_data", {"confirm": True})
    mem0_writes(FACTS[1])  # after the erasure committed; then the process dies
    assert len(engine.engine_rows_from_request(request_id=call.request_id)) == 1
    assert EngineMessage.objects.filter(content__icontains="Narvik").exists()

    assert ingest_intents_reconcile(older_than_s=0) == {"completed": 1, "undone": 0}
    assert ingest_intents_reconcile(older_than_s=0) == {"completed": 0, "undone": 0}

    nothing_left_of(alice_scope, request_id=call.request_id, words=("Narvik", "nyckelharpa"))
    row = the_audit_row(call.request_id)
    assert row.outcome == "ok" and row.detail["superseded_by"]["erased"] is True and row.detail["discarded"] == 1
    assert IngestIntent.objects.get(request_id=call.request_id).state == IngestIntent.State.DONE


# --- (4) tenancy: alice's wipe leaves bob's ingest in flight alone -----------------------------
def test_alices_wipe_does_not_touch_bobs_ingest_in_flight(alice, alice_scope, bob_scope, llm):
    memory_remember(alice_scope, memory="Alice lives in Tromsø", call=internal_call())
    messages = [{"role": "user", "content": "I repair clocks in Bodø."}]
    with ingest_in_flight(llm, bob_scope, facts=("Bob repairs clocks in Bodø",), messages=messages) as (call, ingest):
        run(alice, "wipe_user_data", {"confirm": True})
        assert "superseded_by" not in IngestIntent.objects.get(request_id=call.request_id).detail

    results = ingest.result()
    assert [(r["memory"], r["event"]) for r in results] == [("Bob repairs clocks in Bodø", "ADD")]
    assert [engine.engine_memory_of(r).text for r in engine.engine_rows_owned(bob_scope)] == [
        "Bob repairs clocks in Bodø"
    ]
    assert ContentHash.objects.filter(engine_user_id=bob_scope.engine_user_id, memory_id=results[0]["id"]).exists()
    assert history_with("clocks in Bodø").exists()
    assert EngineMessage.objects.filter(user_id=bob_scope.engine_user_id).exists()
    row = the_audit_row(call.request_id)
    assert row.outcome == "ok" and "superseded_by" not in row.detail and row.memory_ids == [results[0]["id"]]


# --- (5) clear-all (restorable) during an ingest: its facts join the clear-all's trash ---------
def test_a_clear_all_during_an_ingest_trashes_its_facts_and_undo_brings_them_back(alice, alice_scope, llm, settings):
    settings.TRASH_RETENTION_DAYS = 30
    memory_remember(alice_scope, memory="Alice lives in Tromsø", call=internal_call())
    with ingest_in_flight(llm, alice_scope) as (call, ingest):
        assert run(alice, "clear_all_memory", {"confirm": True}) == {"deleted": 1}
    assert ingest.result() == []

    clear_row = AuditEvent.objects.get(operation="clear_all_memory", outcome="ok")
    assert not engine.engine_rows_owned(alice_scope).exists()
    assert not ContentHash.objects.exists() and not EngineMessage.objects.exists()
    trashed = engine.engine_trashed(alice_scope)
    assert sorted(m.text for m in trashed) == sorted(["Alice lives in Tromsø", *FACTS])
    assert {m.trash.request_id for m in trashed} == {clear_row.request_id}
    row = the_audit_row(call.request_id)
    assert row.detail["superseded_by"]["request_id"] == clear_row.request_id
    assert row.detail["superseded_by"]["erased"] is False
    assert (row.detail["discarded"], row.detail["trashed"]) == (2, True)

    # Undoing the clear-all restores the in-flight call's facts with the rest.
    restored = run(alice, "restore_memory", {"request_id": clear_row.request_id})["restored"]
    assert len(restored) == 3
    live = sorted(engine.engine_memory_of(r).text for r in engine.engine_rows_owned(alice_scope))
    assert live == sorted(["Alice lives in Tromsø", *FACTS])
    assert ContentHash.objects.filter(engine_user_id=alice_scope.engine_user_id).count() == 3


def test_an_erasure_after_a_clear_all_in_the_same_window_deletes_the_facts_for_good(alice, alice_scope, llm, settings):
    settings.TRASH_RETENTION_DAYS = 30
    with ingest_in_flight(llm, alice_scope) as (call, ingest):
        run(alice, "clear_all_memory", {"confirm": True})
        run(alice, "wipe_user_data", {"confirm": True})
    assert ingest.result() == []

    nothing_left_of(alice_scope, request_id=call.request_id, words=("Narvik", "nyckelharpa"))
    wipe_row = AuditEvent.objects.get(operation="wipe_user_data", outcome="ok")
    assert the_audit_row(call.request_id).detail["superseded_by"]["request_id"] == wipe_row.request_id


def test_a_clear_all_undone_while_an_ingest_is_in_flight_lets_the_ingest_keep_its_facts(
    alice, alice_scope, llm, settings
):
    """The undo comes before the call completes: the call is no longer superseded, so its
    facts are stored live (not trashed after the undo, where nothing would bring them back)."""
    settings.TRASH_RETENTION_DAYS = 30
    memory_remember(alice_scope, memory="Alice lives in Tromsø", call=internal_call())
    with ingest_in_flight(llm, alice_scope) as (call, ingest):
        run(alice, "clear_all_memory", {"confirm": True})
        clear_row = AuditEvent.objects.get(operation="clear_all_memory", outcome="ok")
        assert run(alice, "restore_memory", {"request_id": clear_row.request_id})["restored"]
    results = ingest.result()
    assert sorted((r["memory"], r["event"]) for r in results) == sorted((fact, "ADD") for fact in FACTS)
    live = sorted(engine.engine_memory_of(r).text for r in engine.engine_rows_owned(alice_scope))
    assert live == sorted(["Alice lives in Tromsø", *FACTS])
    assert not engine.engine_trashed(alice_scope)
    assert "superseded_by" not in the_audit_row(call.request_id).detail


def test_two_tasks_for_one_chat_turn_extract_it_once_and_never_close_it_empty(alice, alice_scope, llm):
    """The sweep enqueues a pending turn again after a minute, so two tasks can claim one
    turn: attempt 1 claims it, and attempt 2 claims it before attempt 1 recorded its ingest.
    Attempt 1's ingest then stores nothing (the turn waits for attempt 2); it used to close
    the turn as done anyway, and attempt 2 then found it closed: nothing was extracted."""
    turn = _turn(alice, alice_scope)
    llm.queue_facts(*FACTS)
    with transaction.atomic():
        # Both attempts wait at the user's clear_all lock to record their ingest; the first
        # claim queues first, so it gets the lock first.
        advisory_xact_lock(f"clear_all:{alice_scope.engine_user_id}")
        first = InThread(lambda: proxy_turn_extract(turn_pk=turn.pk))
        wait_for(lambda: _advisory_waiters() == 1, timeout=20, what="attempt 1 waiting")
        second = InThread(lambda: proxy_turn_extract(turn_pk=turn.pk))
        wait_for(lambda: _advisory_waiters() == 2, timeout=20, what="attempt 2 waiting")
    assert first.result() == "superseded" and second.result() == "done"
    turn.refresh_from_db()
    assert (turn.state, turn.attempts) == (ProxyTurn.State.DONE, 2)
    assert len(llm.requests) == 1  # one extraction, by attempt 2
    ingests = AuditEvent.objects.filter(operation="ingest", turn_id=turn.request_id)
    assert [(r.outcome, len(r.memory_ids)) for r in ingests] == [("ok", 2)]  # its two facts stored
