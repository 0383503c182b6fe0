"""Erasure leaves no memory text behind and touches no one else's (wipe_user_data, which
the web erase page and the admin erasure run too): ingest intents, the history of rows
the ingest dedupe rule deleted, another user's history named by a failed call, and the
history of memories deleted for good (purge, the purge job) after audit retention."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.db import DatabaseError, connection, transaction
from django.db.models import Max, Q

from audit.export import audit_retention_purge
from audit.models import AuditEvent, AuditExportBatch, MemoryHistory
from core.errors import ErrorCode, ServiceError
from memories.auth import Principal
from memories.models import IngestIntent
from memories.operations import operation_execute
from memories.services import _ingest_complete, memory_ingest, memory_purge_due, memory_remember
from tests.conftest import internal_call

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]


def run(user, name: str, arguments: dict | None = None) -> dict:
    principal = Principal(user=user, method="api_key", client_app="erasure-test")
    return operation_execute(principal, name, arguments or {}, call=internal_call())


def fails(user, name: str, arguments: dict | None = None) -> ServiceError:
    with pytest.raises(ServiceError) as caught:
        run(user, name, arguments)
    return caught.value


def history_with(text: str):
    return MemoryHistory.objects.filter(Q(old_memory__icontains=text) | Q(new_memory__icontains=text))


def texts_anywhere(text: str) -> dict[str, int]:
    """Where `text` still lies in plaintext: history rows and ingest intents."""
    rows = IngestIntent.objects.values("results", "detail", "scope", "call")
    intents = [i for i in rows if text.lower() in str(i).lower()]
    return {"history": history_with(text).count(), "intents": len(intents)}


def _ingest(scope, llm, *facts: str) -> list[dict]:
    llm.queue_facts(*facts)
    return memory_ingest(scope, messages=[{"role": "user", "content": "about me"}], call=internal_call())


# --- defect 1: ingest intents -----------------------------------------------------------------
def test_a_closed_intent_keeps_no_texts_and_a_wipe_deletes_the_users_intents(alice, bob, alice_scope, bob_scope, llm):
    memory_remember(alice_scope, memory="Alice lives in Oslofjordby", call=internal_call())
    results = _ingest(alice_scope, llm, "alice lives in  Oslofjordby", "Alice keeps bees on Nesoddtangen")
    # The call's answer keeps its texts; the intent, which outlives the call, does not.
    assert sorted(r["memory"] for r in results) == ["Alice keeps bees on Nesoddtangen", "alice lives in  Oslofjordby"]
    intent = IngestIntent.objects.get(engine_user_id=alice_scope.engine_user_id)
    assert intent.state == IngestIntent.State.DONE
    assert sorted(intent.results, key=lambda r: r["event"]) == sorted(
        [{"id": r["id"], "event": r["event"]} for r in results], key=lambda r: r["event"]
    )
    assert texts_anywhere("Nesoddtangen")["intents"] == 0
    _ingest(bob_scope, llm, "Bob rows on Bunnefjorden")

    wiped = run(alice, "wipe_user_data", {"confirm": True})

    assert wiped["memories_deleted"] == 2
    assert texts_anywhere("Oslofjordby") == texts_anywhere("Nesoddtangen") == {"history": 0, "intents": 0}
    assert not IngestIntent.objects.filter(engine_user_id=alice_scope.engine_user_id).exists()
    assert IngestIntent.objects.filter(engine_user_id=bob_scope.engine_user_id).count() == 1  # bob's stays
    row = AuditEvent.objects.get(operation="wipe_user_data", outcome="ok")
    assert row.detail["ingest_intents"] == 1


def test_an_open_intent_survives_a_wipe_without_content_and_still_gets_its_audit_row(alice, alice_scope, llm):
    call = internal_call()
    open_intent = IngestIntent.objects.create(
        request_id=call.request_id,
        engine_user_id=alice_scope.engine_user_id,
        scope={"tenant": alice_scope.tenant, "user_pk": alice_scope.user_pk, "client_app": None},
        call={"channel": "internal"},
        detail={"messages": 1},
        created_at=datetime.now(UTC) - timedelta(hours=1),
    )
    run(alice, "wipe_user_data", {"confirm": True})
    # A call in flight (or cut short): it holds no text and completes the call's audit row.
    assert IngestIntent.objects.get(pk=open_intent.pk).state == IngestIntent.State.OPEN
    from memories.services import ingest_intents_reconcile

    assert ingest_intents_reconcile(older_than_s=0) == {"completed": 0, "undone": 1}
    assert AuditEvent.objects.filter(request_id=call.request_id, operation="ingest").count() == 1


def test_an_ingest_completed_by_the_reconciler_still_answers_with_texts(alice_scope, llm):
    memory_remember(alice_scope, memory="Alice sings in a choir", call=internal_call())
    call = internal_call()
    llm.queue_facts("alice sings in a  choir", "Alice bakes rye bread")
    results = memory_ingest(alice_scope, messages=[{"role": "user", "content": "x"}], call=call)
    intent = IngestIntent.objects.get(request_id=call.request_id)
    audits = AuditEvent.objects.count()

    # The call returning after the reconciler closed its intent: the same ids and events,
    # texts read from the memories (the dedupe rule answered NONE with the kept memory).
    again = _ingest_complete(alice_scope, intent=intent, call=call, added_ids=[])

    by_event = {r["event"]: r for r in again}
    assert {r["id"] for r in again} == {r["id"] for r in results}
    assert by_event["ADD"]["memory"] == "Alice bakes rye bread"
    assert by_event["NONE"]["memory"] == "Alice sings in a choir"
    assert AuditEvent.objects.count() == audits  # no second audit row


# --- defect 2: history of a row the ingest dedupe rule deleted ---------------------------------
def test_a_wipe_deletes_the_history_of_rows_the_dedupe_rule_deleted(alice, alice_scope, llm):
    known = memory_remember(alice_scope, memory="Alice lives in Oslofjordby", call=internal_call())
    results = _ingest(alice_scope, llm, "alice lives in  OSLOFJORDBY")
    assert results == [{"id": known.id, "memory": "alice lives in  OSLOFJORDBY", "event": "NONE"}]
    # mem0's own row for the duplicate was deleted again; its versions name an id no
    # audit row and no engine row holds, but they are alice's.
    duplicate_rows = history_with("alice lives in  OSLOFJORDBY").exclude(memory_id=known.id)
    assert duplicate_rows.count() == 2
    duplicate_id = duplicate_rows[0].memory_id
    assert not AuditEvent.objects.filter(memory_ids__contains=[duplicate_id]).exists()

    run(alice, "wipe_user_data", {"confirm": True})

    assert texts_anywhere("Oslofjordby") == {"history": 0, "intents": 0}
    assert not MemoryHistory.objects.filter(memory_id__in=[known.id, duplicate_id]).exists()


# --- defect 3: another user's history, named by alice's failed calls ---------------------------
def test_a_wipe_never_deletes_the_history_of_ids_a_failed_call_named(alice, bob, bob_scope):
    bobs = memory_remember(bob_scope, memory="Bob's locker code is 4711", call=internal_call())
    run(alice, "remember", {"memory": "Alice likes plums"})
    bob_history = list(MemoryHistory.objects.filter(memory_id=bobs.id).values_list("id", flat=True))
    assert bob_history
    for name in ("get_memory", "delete_memory", "restore_memory"):
        assert fails(alice, name, {"memory_id": bobs.id}).code == ErrorCode.NOT_FOUND
    # The failures are audited under alice with the id she gave: they must not count as hers.
    named = AuditEvent.objects.filter(subject_user_id=alice.pk, memory_ids__contains=[bobs.id])
    assert named.count() == 3 and not named.filter(outcome="ok").exists()

    run(alice, "wipe_user_data", {"confirm": True})

    assert list(MemoryHistory.objects.filter(memory_id=bobs.id).values_list("id", flat=True)) == bob_history
    assert history_with("locker code is 4711").count() == 1
    assert texts_anywhere("Alice likes plums")["history"] == 0


# --- defect 4: deleted for good, then audit retention, then a wipe -----------------------------
def _retention_removes_all_audit_rows() -> None:
    # As if the rows were older than the database's retention floor (a day).
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("ALTER TABLE audit_auditevent DISABLE TRIGGER audit_auditevent_append_only")
        cursor.execute("UPDATE audit_auditevent SET occurred_at = occurred_at - interval '2 days'")
        cursor.execute("ALTER TABLE audit_auditevent ENABLE TRIGGER audit_auditevent_append_only")
    last = AuditEvent.objects.aggregate(last=Max("id"))["last"]
    AuditExportBatch.objects.create(
        first_id=1, last_id=last, row_count=last, sha256="x", object_key="k", manifest_key="m"
    )
    assert audit_retention_purge(older_than_days=0) > 0
    assert not AuditEvent.objects.exists()


def test_purges_blank_the_history_texts_and_a_wipe_after_retention_deletes_the_rest(alice, alice_scope, settings):
    settings.TRASH_RETENTION_DAYS = 30
    purged = run(alice, "remember", {"memory": "Alice's PIN is 2468"})["id"]
    run(alice, "update_memory", {"memory_id": purged, "memory": "Alice's PIN is 1357"})
    run(alice, "delete_memory", {"memory_id": purged})
    due = run(alice, "remember", {"memory": "Alice owes Carol 40 euros"})["id"]
    run(alice, "delete_memory", {"memory_id": due})
    tomorrow = (datetime.now(UTC) + timedelta(days=1)).isoformat()
    expired = run(alice, "remember", {"memory": "Alice's hotel room is 512", "expires_at": tomorrow})["id"]
    audits = AuditEvent.objects.count()

    run(alice, "purge_memory", {"memory_id": purged})
    assert memory_purge_due(now=datetime.now(UTC) + timedelta(days=31)) == 2

    # One audit row per call (the purge, the purge job's row for alice), no text left,
    # and the history still tells what happened to each memory, when and by whom.
    assert AuditEvent.objects.count() == audits + 2
    for text in ("PIN is", "owes Carol", "room is 512"):
        assert texts_anywhere(text) == {"history": 0, "intents": 0}, text
    events = list(MemoryHistory.objects.filter(memory_id=purged).order_by("recorded_at", "id"))
    assert [e.event for e in events] == ["ADD", "UPDATE", "DELETE", "DELETE"]
    assert all(e.changed_by and e.engine_user_id == alice_scope.engine_user_id for e in events)
    assert [e.event for e in MemoryHistory.objects.filter(memory_id=due).order_by("recorded_at", "id")] == [
        "ADD",
        "DELETE",
        "DELETE",
    ]
    assert MemoryHistory.objects.filter(memory_id=expired).count() == 2

    _retention_removes_all_audit_rows()
    run(alice, "wipe_user_data", {"confirm": True})

    # Nothing names the purged ids any more but the owner column: the wipe finds them.
    assert not MemoryHistory.objects.filter(memory_id__in=[purged, due, expired]).exists()
    assert not MemoryHistory.objects.filter(engine_user_id=alice_scope.engine_user_id).exists()


def test_deletes_with_the_trash_off_blank_the_history_texts_like_a_purge(alice, alice_scope, bob, settings):
    settings.TRASH_RETENTION_DAYS = 0  # no trash: a delete is for good
    one = run(alice, "remember", {"memory": "Alice's locker is 77"})["id"]
    run(alice, "remember", {"memory": "Alice's bike lock is 4321"})
    run(bob, "remember", {"memory": "Bob's bike lock is 9876"})
    run(alice, "delete_memory", {"memory_id": one})
    assert texts_anywhere("locker is 77") == {"history": 0, "intents": 0}
    assert [e.event for e in MemoryHistory.objects.filter(memory_id=one).order_by("recorded_at", "id")] == [
        "ADD",
        "DELETE",
    ]
    run(alice, "clear_all_memory", {"confirm": True})
    assert texts_anywhere("Alice's bike lock") == {"history": 0, "intents": 0}
    assert texts_anywhere("Bob's bike lock")["history"] == 1  # another user's, untouched


def test_the_history_stays_append_only_beyond_blanking_texts(alice_scope):
    memory_id = memory_remember(alice_scope, memory="Alice's bike is blue", call=internal_call()).id
    row = MemoryHistory.objects.get(memory_id=memory_id)
    assert row.engine_user_id == alice_scope.engine_user_id  # the owner, filled on insert
    redact = "SET LOCAL memsite.history_redact = 'on'; "
    refused = [
        "UPDATE audit_memoryhistory SET new_memory = NULL",  # no purge under way
        redact + "UPDATE audit_memoryhistory SET new_memory = 'other'",  # only to NULL
        redact + "UPDATE audit_memoryhistory SET new_memory = NULL, event = 'NONE'",  # only the texts
        redact + "UPDATE audit_memoryhistory SET new_memory = NULL, engine_user_id = ''",
        redact + "DELETE FROM audit_memoryhistory",
    ]
    for statement in refused:
        with pytest.raises(DatabaseError, match="append-only"), transaction.atomic():
            connection.cursor().execute(statement)
    assert MemoryHistory.objects.get(pk=row.pk).new_memory == "Alice's bike is blue"
    # Unknown memory ids get no owner (nothing to guess from).
    MemoryHistory.objects.create(memory_id="not-a-memory", event="ADD", new_memory="x")
    assert MemoryHistory.objects.get(memory_id="not-a-memory").engine_user_id == ""


# --- rows written before owners were recorded ----------------------------------------------------
def test_backfill_attributes_old_rows_only_from_engine_rows_and_one_users_successful_calls(
    alice, bob, alice_scope, bob_scope
):
    import importlib

    migration = importlib.import_module("audit.migrations.0013_history_owner")
    live = memory_remember(alice_scope, memory="Alice's cat is Miso", call=internal_call()).id
    gone, foreign, shared = "a" * 8 + "-0000-0000-0000-" + "1" * 12, "bobs-gone-memory", "shared-gone-memory"
    for memory_id in (gone, foreign, shared):
        MemoryHistory.objects.create(memory_id=memory_id, event="ADD", new_memory=f"text of {memory_id}")

    def named(scope, memory_id: str, outcome: str = "ok") -> None:
        AuditEvent.objects.create(
            request_id="r",
            channel="internal",
            operation="remember",
            outcome=outcome,
            tenant=scope.tenant,
            subject_user_id=scope.user_pk,
            memory_ids=[memory_id],
        )

    named(alice_scope, gone)
    named(bob_scope, foreign)
    named(alice_scope, foreign, outcome="denied")  # alice tried bob's id: not hers
    named(alice_scope, shared)
    named(bob_scope, shared)  # two users' calls name it: never guessed

    with transaction.atomic(), connection.schema_editor() as editor:
        # As before the migration: no owners yet (the trigger filled the live one's).
        editor.execute("ALTER TABLE audit_memoryhistory DISABLE TRIGGER audit_memoryhistory_append_only")
        editor.execute("UPDATE audit_memoryhistory SET engine_user_id = ''")
        editor.execute("ALTER TABLE audit_memoryhistory ENABLE TRIGGER audit_memoryhistory_append_only")
        migration.backfill(None, editor)

    owners = dict(MemoryHistory.objects.values_list("memory_id", "engine_user_id"))
    assert owners == {
        live: alice_scope.engine_user_id,
        gone: alice_scope.engine_user_id,
        foreign: bob_scope.engine_user_id,
        shared: "",
    }
    run(alice, "wipe_user_data", {"confirm": True})
    # Alice's successful call still finds her unattributed row; bob's stays bob's, and one
    # that both users' calls name is nobody's to erase (never guessed).
    assert set(MemoryHistory.objects.values_list("memory_id", flat=True)) == {foreign, shared}


def test_intents_closed_before_lose_their_texts_in_the_migration(alice_scope):
    import importlib

    migration = importlib.import_module("memories.migrations.0023_ingest_intent_no_texts")
    record = {"scope": {}, "call": {}, "engine_user_id": alice_scope.engine_user_id}
    done = IngestIntent.objects.create(
        request_id="old-done",
        state=IngestIntent.State.DONE,
        results=[{"id": "m1", "memory": "Alice's passport expires in May", "event": "ADD"}],
        **record,
    )
    empty = IngestIntent.objects.create(request_id="old-undone", state=IngestIntent.State.UNDONE, **record)

    with connection.cursor() as cursor:
        cursor.execute(migration.STRIP)

    assert IngestIntent.objects.get(pk=done.pk).results == [{"id": "m1", "event": "ADD"}]
    assert IngestIntent.objects.get(pk=empty.pk).results == []


def test_the_wipe_finds_history_by_owner_through_its_index(alice_scope):
    memory_remember(alice_scope, memory="Alice's car is green", call=internal_call())
    with transaction.atomic(), connection.cursor() as cursor:
        # A tiny table: ask whether the index can serve. Plain index scans are priced out
        # too: on a few rows a walk of another index testing each row's owner costs the
        # same. A bitmap needs an index condition: the owner's index, or a Seq Scan.
        cursor.execute("SET LOCAL enable_seqscan = off")
        cursor.execute("SET LOCAL enable_indexscan = off")

        cursor.execute(
            "EXPLAIN DELETE FROM audit_memoryhistory WHERE engine_user_id = %s", [alice_scope.engine_user_id]
        )
        plan = "\n".join(row[0] for row in cursor.fetchall())
    assert "history_owner" in plan, plan
