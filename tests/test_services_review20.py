"""Review 20 (f1): races on the dedupe hash, the trash's ledger, ingest's ledger, what an
edit or a delete leaves for agents, the web UI's key revocation."""

from __future__ import annotations

import json
import threading
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.conf import settings as django_settings
from django.db import connection, transaction

from audit.models import AuditEvent
from billing.models import UsageEvent
from core.choices import Channel, Operation
from core.errors import ErrorCode, ServiceError
from core.locks import advisory_xact_lock
from core.scope import CallContext, MemoryScope
from memories import engine, schemas
from memories import services as memory_services
from memories.auth import Principal
from memories.models import ApiKey, ContentHash, EngineMessage, IngestIntent
from memories.operations import operation_execute
from memories.services import (
    api_key_issue,
    api_key_revoke,
    erasure_lock_key,
    ingest_intents_reconcile,
    memory_delete,
    memory_export,
    memory_forget_bulk,
    memory_import_file,
    memory_ingest,
    memory_purge,
    memory_purge_due,
    memory_remember,
    memory_update,
)
from memories.toolkit.services import toolkit_candidates_enrich
from tests.conftest import InThread, internal_call, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]

OLD = "Alice lives in Oslo"
NEW = "Alice lives in Bergen"
TURN = [{"role": "user", "content": "I like tea and coffee."}, {"role": "assistant", "content": "Noted."}]


def run(user, name: str, arguments: dict[str, Any], *, call: CallContext | None = None) -> Any:
    principal = Principal(user=user, method="api_key", client_app="r20")
    return operation_execute(principal, name, arguments, call=call or internal_call())


def outcome(work) -> Any:
    """The call's answer, or its error as a dict (an unexpected exception propagates)."""
    try:
        return work()
    except ServiceError as exc:
        return exc.as_dict()


def lock_waiters() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'transactionid' AND NOT granted")
        return cursor.fetchone()[0]


def live_texts(scope) -> list[str]:
    return sorted(engine.engine_memory_of(row).text for row in engine.engine_rows_owned(scope))


def live_rows(scope) -> list[engine.EngineMemory]:
    return [engine.engine_memory_of(row) for row in engine.engine_rows_owned(scope)]


class HeldBefore:
    """Holds the transaction of the first `operation` call open right before its usage
    event and audit row (its own writes done, not committed) until `release()`."""

    def __init__(self, monkeypatch, operation: str, *, hook: str = "call_succeeded") -> None:
        self.inside, self.finish = threading.Event(), threading.Event()
        original = getattr(memory_services, hook)

        def held(scope_, *, call, operation: str, **kwargs):
            if operation == self.operation and not self.inside.is_set():
                self.inside.set()
                assert self.finish.wait(60)
            return original(scope_, call=call, operation=operation, **kwargs)

        self.operation = operation
        monkeypatch.setattr(memory_services, hook, held)

    def wait(self) -> None:
        assert self.inside.wait(60), f"{self.operation} did not reach its audit row"

    def release(self) -> None:
        self.finish.set()


def racing(held: HeldBefore, first, second) -> tuple[Any, Any]:
    """`first` held open by `held`; `second` started meanwhile, until it waits on a row
    `first` holds (or is done); then `first` commits. Returns both outcomes."""
    one = InThread(first)
    try:
        held.wait()
        two = InThread(second)
        wait_for(lambda: lock_waiters() >= 1 or two.done(), timeout=30, what="the second call waiting")
    finally:
        held.release()
    return one.result(), two.result()


# --- 1: a writer of T racing an update that moves the memory holding T to T' -------------------
def test_remember_of_the_text_an_update_moves_away_is_stored_not_a_duplicate(alice, alice_scope, monkeypatch):
    memory_id = memory_remember(alice_scope, memory=OLD, call=internal_call()).id
    held = HeldBefore(monkeypatch, Operation.UPDATE_MEMORY)
    _, answer = racing(
        held,
        lambda: run(alice, "update_memory", {"memory_id": memory_id, "memory": NEW}),
        lambda: run(alice, "remember", {"memory": OLD}),
    )
    assert answer["duplicate"] is False and answer["id"] != memory_id
    assert live_texts(alice_scope) == sorted([OLD, NEW])
    owners = dict(
        ContentHash.objects.filter(engine_user_id=alice_scope.engine_user_id).values_list("sha256", "memory_id")
    )
    assert {str(v) for v in owners.values()} == {memory_id, answer["id"]}


def test_store_memory_of_the_text_an_update_moves_away_keeps_its_long_term_candidate(alice, alice_scope, monkeypatch):
    old = "Alice works as a pediatric nurse at the Oslo university hospital"
    new = "Alice works as a surgeon at the Bergen university hospital now"
    memory_id = memory_remember(alice_scope, memory=old, call=internal_call()).id
    held = HeldBefore(monkeypatch, Operation.UPDATE_MEMORY)
    arguments = {"conversation_id": "c1", "messages": [{"role": "user", "content": old}]}
    racing(
        held,
        lambda: run(alice, "update_memory", {"memory_id": memory_id, "memory": new}),
        lambda: run(alice, "store_memory", arguments),
    )
    long_term = [m for m in live_rows(alice_scope) if m.text == old and m.metadata.get("tier") == "ltm"]
    assert len(long_term) == 1


def test_import_of_the_text_an_update_moves_away_is_imported(alice, alice_scope, monkeypatch):
    memory_id = memory_remember(alice_scope, memory=OLD, call=internal_call()).id
    held = HeldBefore(monkeypatch, Operation.UPDATE_MEMORY)
    data = json.dumps({"results": [{"memory": OLD}]}).encode()
    _, result = racing(
        held,
        lambda: run(alice, "update_memory", {"memory_id": memory_id, "memory": NEW}),
        lambda: memory_import_file(alice_scope, data=data, source="mem0", call=internal_call()),
    )
    assert (result.imported, result.duplicates) == (1, 0)
    assert live_texts(alice_scope) == sorted([OLD, NEW])


def test_update_to_the_text_another_update_gives_up_is_no_conflict(alice, alice_scope, monkeypatch):
    m = memory_remember(alice_scope, memory=OLD, call=internal_call()).id
    n = memory_remember(alice_scope, memory="Alice lives in Trondheim", call=internal_call()).id
    held = HeldBefore(monkeypatch, Operation.UPDATE_MEMORY)
    _, answer = racing(
        held,
        lambda: run(alice, "update_memory", {"memory_id": m, "memory": NEW}),
        lambda: outcome(lambda: run(alice, "update_memory", {"memory_id": n, "memory": OLD})),
    )
    assert answer["memory"]["id"] == n and answer["memory"]["memory"] == OLD, answer
    assert live_texts(alice_scope) == sorted([OLD, NEW])


def test_stress_remember_racing_an_update_never_answers_a_memory_holding_another_text(alice, alice_scope, settings):
    """No hooks: rounds of (update M: T -> T') || (remember T). A remember that commits
    after the update (audit ids follow the row lock on M) must not answer M."""
    settings.RATE_LIMITS = {**settings.RATE_LIMITS, "remember": (0, 60), "update_memory": (0, 60)}
    for i in range(10):
        old, new = f"{OLD} round {i}", f"{NEW} round {i}"
        memory_id = memory_remember(alice_scope, memory=old, call=internal_call()).id
        barrier = threading.Barrier(2)
        update_call, remember_call = internal_call(), internal_call()
        answers: dict[str, Any] = {}

        def update(memory_id=memory_id, new=new, update_call=update_call, barrier=barrier) -> None:
            barrier.wait()
            memory_update(alice_scope, memory_id=memory_id, memory=new, call=update_call)

        def remember(old=old, remember_call=remember_call, barrier=barrier, answers=answers) -> None:
            barrier.wait()
            answers["r"] = memory_remember(alice_scope, memory=old, call=remember_call)

        one, two = InThread(update), InThread(remember)
        one.result(), two.result()
        ids = dict(
            AuditEvent.objects.filter(request_id__in=[update_call.request_id, remember_call.request_id]).values_list(
                "request_id", "id"
            )
        )
        if ids[remember_call.request_id] > ids[update_call.request_id]:  # else a duplicate before the update
            assert answers["r"].duplicate is False, f"round {i}: answered {memory_id}, which holds {new!r}"
            assert old in live_texts(alice_scope)


def test_remember_of_a_text_a_large_import_is_writing_without_hooks(alice, alice_scope, monkeypatch):
    texts = [f"Imported fact number {i} about the garden shed" for i in range(300)]
    data = json.dumps({"results": [{"memory": t} for t in texts]}).encode()
    # Nothing held: the import only says when it has written the first text's row and hash
    # (its second row begins after them). Waiting for its lock alone raced: under load the
    # remember could claim the text before the import wrote its hash, and the import then
    # answered `conflict` (retry), a correct answer this test does not look for.
    first_written = threading.Event()
    insert = memory_services.engine_insert_imported
    rows: list[int] = []

    def counted(*args: Any, **kwargs: Any) -> str:
        rows.append(1)
        if len(rows) == 2:
            first_written.set()
        return insert(*args, **kwargs)

    monkeypatch.setattr(memory_services, "engine_insert_imported", counted)
    importing_all = InThread(lambda: memory_import_file(alice_scope, data=data, source="mem0", call=internal_call()))
    wait_for(lambda: first_written.is_set() or importing_all.done(), timeout=120, interval=0.01, what="import")
    answer = run(alice, "remember", {"memory": texts[0]})
    imported = importing_all.result()
    assert imported.imported == 300 and answer["duplicate"] is True and answer["id"] in imported.ids
    assert len(rows) == 300  # the import wrote through the counting wrapper


# --- 2: writers of a text an import is writing (the import takes no text lock) ------------------
TEXT = "Prefers vegetarian food"


def importing(scope, *texts: str):
    data = json.dumps({"results": [{"memory": t} for t in texts]}).encode()
    return lambda: memory_import_file(scope, data=data, source="mem0", call=internal_call())


def test_remember_during_an_import_of_the_same_text_is_a_duplicate(alice, alice_scope, monkeypatch):
    held = HeldBefore(monkeypatch, Operation.IMPORT_MEMORIES)
    imported, answer = racing(held, importing(alice_scope, TEXT), lambda: run(alice, "remember", {"memory": TEXT}))
    assert imported.imported == 1
    assert answer == {"id": imported.ids[0], "duplicate": True}
    assert live_texts(alice_scope) == [TEXT]
    assert len(live_rows(alice_scope)) == 1  # its own row was undone whole


def test_rest_remember_during_an_import_of_the_same_text_is_no_500(alice, alice_key, alice_scope, monkeypatch):
    from rest_framework.test import APIClient

    def post():
        client = APIClient()
        client.raise_request_exception = False
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {alice_key}")
        response = client.post("/v1/memories", {"memory": TEXT}, format="json")
        return response.status_code, response.json()

    held = HeldBefore(monkeypatch, Operation.IMPORT_MEMORIES)
    imported, (status, body) = racing(held, importing(alice_scope, TEXT), post)
    assert status == 200 and body == {"id": imported.ids[0], "duplicate": True}, (status, body)


def test_store_memory_during_an_import_of_the_same_text_makes_no_second_candidate(alice, alice_scope, monkeypatch):
    long_text = "I am allergic to peanuts and to most tree nuts as well"
    arguments = {"conversation_id": "c1", "messages": [{"role": "user", "content": long_text}]}
    held = HeldBefore(monkeypatch, Operation.IMPORT_MEMORIES)
    imported, answer = racing(held, importing(alice_scope, long_text), lambda: run(alice, "store_memory", arguments))
    assert answer["count"] == 1
    rows = live_rows(alice_scope)
    assert sorted(m.metadata.get("tier") or "" for m in rows) == ["", "stm"]  # the import's memory, the short-term row
    assert [str(h) for h in ContentHash.objects.values_list("memory_id", flat=True)] == imported.ids


def test_update_to_the_text_an_import_is_storing_is_a_conflict(alice, alice_scope, monkeypatch):
    mine = memory_remember(alice_scope, memory="Prefers meat dishes", call=internal_call()).id
    held = HeldBefore(monkeypatch, Operation.IMPORT_MEMORIES)
    imported, answer = racing(
        held,
        importing(alice_scope, TEXT),
        lambda: outcome(lambda: run(alice, "update_memory", {"memory_id": mine, "memory": TEXT})),
    )
    assert answer["code"] == ErrorCode.CONFLICT.value and answer["details"]["existing_id"] == imported.ids[0], answer
    assert live_texts(alice_scope) == sorted(["Prefers meat dishes", TEXT])
    assert not UsageEvent.objects.filter(operation=Operation.UPDATE_MEMORY).exists()


# --- 3: "delete forever" racing the purge job -----------------------------------------------------
def test_delete_forever_racing_the_purge_job_counts_and_audits_only_its_own(alice_scope, monkeypatch):
    memory_id = memory_remember(alice_scope, memory="Alice once lived in Tromso", call=internal_call()).id
    memory_delete(alice_scope, memory_id=memory_id, call=internal_call())
    held = HeldBefore(monkeypatch, Operation.PURGE_DUE, hook="audit_record")
    later = datetime.now(UTC) + timedelta(days=django_settings.TRASH_RETENTION_DAYS + 1)
    purged_by_job, purged = racing(
        held, lambda: memory_purge_due(now=later), lambda: memory_purge(alice_scope, call=internal_call())
    )
    assert (purged_by_job, purged) == (1, 0)
    named = AuditEvent.objects.filter(
        operation__in=[Operation.PURGE_DUE, Operation.PURGE_MEMORY], memory_ids__contains=[memory_id]
    )
    assert [row.operation for row in named] == [Operation.PURGE_DUE]


# --- 4: an extracted fact no text may hold ------------------------------------------------------
def test_an_extracted_fact_with_a_control_character_is_dropped_and_the_export_imports(llm, alice_scope, bob_scope):
    llm.queue_facts("Shell prompt shows \x1b[31mred\x1b[0m errors", "Likes green tea")
    call = internal_call()
    added = memory_ingest(alice_scope, messages=TURN, call=call)
    assert [(a["memory"], a["event"]) for a in added] == [("Likes green tea", "ADD")]
    assert live_texts(alice_scope) == ["Likes green tea"]
    row = AuditEvent.objects.get(request_id=call.request_id, operation=Operation.INGEST)
    assert row.detail["unstorable"] == 1
    exported = memory_export(alice_scope, file_format="jsonl", call=internal_call())
    result = memory_import_file(bob_scope, data=exported.content.encode(), source="memsite", call=internal_call())
    assert result.imported == 1


# --- 5: an ingest that answered an error is never billed --------------------------------------
def test_an_ingest_that_answered_an_error_is_completed_but_never_billed(llm, settings, alice, alice_scope):
    settings.MEMORY_LOCK_TIMEOUT_S = 0.5
    llm.queue_facts("Alice keeps bees on her roof")
    llm.hold()
    call = internal_call()
    arguments = {"messages": [{"role": "user", "content": "I keep bees on my roof."}]}
    ingest = InThread(lambda: outcome(lambda: run(alice, "ingest", arguments, call=call)))
    llm.wait_held(1)  # the intent is committed, the LLM call under way
    held, done = threading.Event(), threading.Event()

    def long_writer():  # holds the user's erasure lock shared past MEMORY_LOCK_TIMEOUT_S
        try:
            with transaction.atomic():
                advisory_xact_lock(shared=[erasure_lock_key(alice_scope)])
                held.set()
                done.wait(30)
        finally:
            connection.close()

    blocker = threading.Thread(target=long_writer)
    blocker.start()
    try:
        assert held.wait(10)
        llm.release()
        answer = ingest.result()
    finally:
        done.set()
        blocker.join(10)
    assert "code" in answer, answer  # the client was told it failed
    intent = IngestIntent.objects.get(request_id=call.request_id)
    assert intent.state == IngestIntent.State.OPEN and intent.detail["answered_error"] is True

    assert ingest_intents_reconcile(older_than_s=0) == {"completed": 1, "undone": 0}
    assert not UsageEvent.objects.filter(request_id=call.request_id).exists()
    outcomes = list(
        AuditEvent.objects.filter(request_id=call.request_id).order_by("id").values_list("outcome", flat=True)
    )
    assert outcomes == [AuditEvent.Outcome.ERROR, AuditEvent.Outcome.OK]
    assert live_texts(alice_scope) == ["Alice keeps bees on her roof"]  # kept: a retry finds it (NONE)


# --- 6, 7: restore and purge are billed and rate limited; a foreign id is denied -----------------
def test_rest_restore_and_purge_are_billed_and_rate_limited(alice, api_client, settings):
    c = api_client(api_key_issue(user=alice, name="agent")[1])
    mid = c.post("/v1/memories", {"memory": "Alice drinks green tea"}, format="json").json()["id"]
    assert c.delete(f"/v1/memories/{mid}").status_code == 200

    def billed(response_of) -> tuple[int, int]:
        before = UsageEvent.objects.count()
        status = response_of().status_code
        return status, UsageEvent.objects.count() - before

    assert billed(lambda: c.post("/v1/trash/restore", {"memory_id": mid}, format="json")) == (200, 1)
    assert c.delete(f"/v1/memories/{mid}").status_code == 200
    assert billed(lambda: c.post("/v1/trash/purge", {"memory_id": mid}, format="json")) == (200, 1)
    assert UsageEvent.objects.filter(operation__in=["restore_memory", "purge_memory"]).count() == 2

    # Two a minute: the calls above took one of each.
    settings.RATE_LIMITS = {**settings.RATE_LIMITS, "restore_memory": (2, 60), "purge_memory": (2, 60)}
    for path in ("/v1/trash/restore", "/v1/trash/purge"):
        assert c.post(path, {"memory_id": mid}, format="json").status_code == 404  # counted: gone
        assert c.post(path, {"memory_id": mid}, format="json").status_code == 429


def test_web_restore_and_purge_are_billed_like_the_web_delete(alice, client):
    memory_id = memory_remember(MemoryScope.for_user(alice), memory="Alice drinks green tea", call=internal_call()).id
    client.force_login(alice)
    for url, data in (
        (f"/memories/{memory_id}/delete/", {}),
        ("/trash/restore/", {"memory_id": memory_id}),
        (f"/memories/{memory_id}/delete/", {}),
        ("/trash/purge/", {"memory_id": memory_id}),
    ):
        before = UsageEvent.objects.count()
        assert client.post(url, data).status_code == 302
        assert UsageEvent.objects.count() == before + 1, url


def test_a_foreign_id_on_restore_and_purge_is_audited_as_denied(alice, bob, api_client):
    bob_c = api_client(api_key_issue(user=bob, name="bob-agent")[1])
    alice_c = api_client(api_key_issue(user=alice, name="alice-agent")[1])
    trashed = bob_c.post("/v1/memories", {"memory": "Bob's trashed note"}, format="json").json()["id"]
    live = bob_c.post("/v1/memories", {"memory": "Bob's live note"}, format="json").json()["id"]
    assert bob_c.delete(f"/v1/memories/{trashed}").status_code == 200
    for path, memory_id in (
        ("/v1/trash/restore", trashed),
        ("/v1/trash/purge", trashed),
        ("/v1/trash/restore", live),
        ("/v1/trash/purge", live),
    ):
        mark = AuditEvent.objects.order_by("-id").values_list("id", flat=True).first()
        response = alice_c.post(path, {"memory_id": memory_id}, format="json")
        assert response.status_code == 404
        (row,) = AuditEvent.objects.filter(id__gt=mark)
        assert row.outcome == AuditEvent.Outcome.DENIED, (path, row.outcome)
    # Her own missing id stays a plain not_found.
    mark = AuditEvent.objects.order_by("-id").values_list("id", flat=True).first()
    missing = "0f6d3c2e-6a35-4b5e-9d2a-1c1f5e0a0001"
    assert alice_c.post("/v1/trash/purge", {"memory_id": missing}, format="json").status_code == 404
    assert AuditEvent.objects.get(id__gt=mark).outcome == AuditEvent.Outcome.ERROR


# --- 8: a memory deleted (forever) is not fed to the next extraction --------------------------
@pytest.mark.parametrize("how", ["delete", "delete_forever", "forget_bulk"])
def test_deleting_a_memory_purges_the_raw_messages_the_next_extraction_reads(how, alice, alice_scope, llm):
    llm.queue_facts("User's sister is called Ingrid")
    (added,) = memory_ingest(
        alice_scope, messages=[{"role": "user", "content": "My sister is called Ingrid."}], call=internal_call()
    )
    assert EngineMessage.objects.filter(content__icontains="Ingrid").exists()
    if how == "forget_bulk":
        everything = ("2000-01-01T00:00:00Z", None)
        memory_forget_bulk(alice_scope, time_range=everything, confirm=True, call=internal_call())
    else:
        memory_delete(alice_scope, memory_id=added["id"], call=internal_call())
    if how == "delete_forever":
        assert memory_purge(alice_scope, memory_id=added["id"], call=internal_call()) == 1
    assert not EngineMessage.objects.filter(content__icontains="Ingrid").exists()
    llm.queue_facts("User likes hiking")
    hiking = [{"role": "user", "content": "I like hiking on weekends."}]
    memory_ingest(alice_scope, messages=hiking, call=internal_call())
    assert "Ingrid" not in llm.prompts()[-1]


def test_delete_forever_alone_purges_the_raw_messages(alice, alice_scope, llm):
    llm.queue_facts("User's sister is called Ingrid")
    (added,) = memory_ingest(
        alice_scope, messages=[{"role": "user", "content": "My sister is called Ingrid."}], call=internal_call()
    )
    memory_delete(alice_scope, memory_id=added["id"], call=internal_call())
    # A message mem0 saved after the delete (a later ingest of the same conversation).
    llm.queue_facts()
    memory_ingest(alice_scope, messages=[{"role": "user", "content": "Ingrid visits in May."}], call=internal_call())
    assert EngineMessage.objects.filter(content__icontains="Ingrid").exists()
    assert memory_purge(alice_scope, call=internal_call()) == 1
    assert not EngineMessage.objects.filter(content__icontains="Ingrid").exists()


# --- 9: an edit drops the enrichment's summary of the old text --------------------------------
ADDRESS = "My home address is 12 Rue des Lilas in Lyon, please keep it private."


def test_editing_an_enriched_memory_drops_its_summary_and_enriches_the_new_text(alice, alice_scope):
    run(alice, "store_memory", {"conversation_id": "c1", "messages": [{"role": "human", "content": ADDRESS}]})
    toolkit_candidates_enrich()
    (ltm,) = [m for m in live_rows(alice_scope) if m.metadata.get("tier") == "ltm"]
    assert "Lilas" in ltm.metadata[schemas.SUMMARY_KEY]
    new = "My home address is something I no longer want stored here."
    memory_update(alice_scope, memory_id=ltm.id, memory=new, call=internal_call())
    edited = engine.engine_get(ltm.id)
    assert schemas.SUMMARY_KEY not in edited.metadata and schemas.ENRICHED_BY_KEY not in edited.metadata
    assert edited.metadata[engine.ENRICHMENT_KEY] == "pending"
    recalled = run(alice, "recall_memory", {"query": "home address", "tier": ["ltm"]})["results"]
    assert "Lilas" not in json.dumps(recalled)
    assert toolkit_candidates_enrich() == 1  # the sweep enriches the new text
    assert "Lilas" not in engine.engine_get(ltm.id).metadata[schemas.SUMMARY_KEY]
    # Other edits (pin, fields) and an unchanged text keep the summary.
    memory_update(alice_scope, memory_id=ltm.id, memory=new.upper(), pinned=True, call=internal_call())
    assert schemas.SUMMARY_KEY in engine.engine_get(ltm.id).metadata


# --- 10: the web UI's key revocation is audited ------------------------------------------------
def test_revoking_a_key_with_a_call_is_audited_without_the_secret(alice, bob):
    key, secret = api_key_issue(user=alice, name="laptop")
    call = CallContext(channel=Channel.UI, actor_username="alice")
    assert api_key_revoke(user=bob, key_id=key.key_id, call=call) is False  # not bob's: nothing written
    assert not AuditEvent.objects.filter(operation=Operation.API_KEY_REVOKE).exists()
    assert api_key_revoke(user=alice, key_id=key.key_id, call=call) is True
    row = AuditEvent.objects.get(operation=Operation.API_KEY_REVOKE)
    assert row.detail == {"key_id": key.key_id, "name": "laptop"} and row.request_id == call.request_id
    assert secret.split("_")[-1] not in json.dumps([row.detail, row.before, row.after])
    assert api_key_revoke(user=alice, key_id=key.key_id, call=call) is False  # revoked already


def test_revoking_a_key_without_a_call_writes_no_audit_row(alice):
    key, _ = api_key_issue(user=alice, name="laptop")
    assert api_key_revoke(user=alice, key_id=key.key_id, call=None) is True
    assert ApiKey.objects.get(pk=key.pk).revoked_at is not None
    assert not AuditEvent.objects.filter(operation=Operation.API_KEY_REVOKE).exists()


def test_revoking_a_key_in_the_web_ui_is_audited(client, alice):
    key, _ = api_key_issue(user=alice, name="laptop")
    client.force_login(alice)
    assert client.post(f"/keys/{key.key_id}/revoke/").status_code == 302
    row = AuditEvent.objects.get(operation=Operation.API_KEY_REVOKE)
    assert row.channel == Channel.UI and row.detail["key_id"] == key.key_id


# --- 11: every surface's delete takes both rows of a stored message ----------------------------
def test_deleting_either_row_of_a_stored_message_on_any_surface_trashes_both(alice, alice_scope, client, api_client):
    client.force_login(alice)
    rest = api_client(api_key_issue(user=alice, name="agent")[1])
    for surface, which in (("ui", "ltm"), ("rest", "stm")):
        message = {"role": "human", "content": ADDRESS}
        stored = run(alice, "store_memory", {"conversation_id": "c1", "messages": [message]})
        stm_id = stored["stm_ids"][0]
        (ltm,) = [m for m in live_rows(alice_scope) if m.metadata.get("tier") == "ltm"]
        target = ltm.id if which == "ltm" else stm_id
        mark = AuditEvent.objects.order_by("-id").values_list("id", flat=True).first()
        if surface == "ui":
            assert client.post(f"/memories/{target}/delete/").status_code == 302
        else:
            assert rest.delete(f"/v1/memories/{target}").status_code == 200
        assert live_rows(alice_scope) == [], surface
        assert "Lilas" not in json.dumps(run(alice, "recall_memory", {"query": "home address"})["results"])
        (row,) = AuditEvent.objects.filter(id__gt=mark, operation=Operation.DELETE_MEMORY)
        twin = stm_id if which == "ltm" else ltm.id
        assert row.memory_ids == [target, twin] and row.detail["linked"] == [twin]
        # Undoing the call brings both back, the hash with the long-term one.
        memory_services.memory_restore(alice_scope, request_id=row.request_id, call=internal_call())
        assert sorted(m.id for m in live_rows(alice_scope)) == sorted([stm_id, ltm.id])
        assert [str(h) for h in ContentHash.objects.values_list("memory_id", flat=True)] == [ltm.id]
        memory_services.memory_clear_all(alice_scope, confirm=True, call=internal_call())
        memory_purge(alice_scope, call=internal_call())
