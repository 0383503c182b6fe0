"""Enrichment never holds a transaction or a row lock while the LLM answers: a candidate
is claimed in one short transaction, the LLM is called with none open, and the result is
applied in a second one only if the row is still the claimed, unchanged candidate. The
`llm` fake is held mid-call to look at the database from outside while it "thinks"."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection, transaction

from audit.models import AuditEvent
from core.choices import Operation
from core.errors import ErrorCode, ServiceError
from core.scope import MemoryScope
from memories.auth import Principal
from memories.operations import operation_execute
from memories.selectors import memory_get_owned
from memories.services import memory_delete, memory_update
from memories.toolkit import enrichment
from memories.toolkit.services import ENRICHMENT_MAX_ATTEMPTS, toolkit_candidates_enrich
from tests.conftest import InThread, internal_call

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]

DARK_MODE = "I always prefer dark mode interfaces in every editor I use"
KEYS = "I always keep the spare keys in the left drawer of the desk"
CLAIM = "enrichment_claim"


def store_candidate(user, text: str) -> str:
    """A long-term candidate (pending enrichment) through store_memory; its id."""
    principal = Principal(user=user, method="api_key", client_app="seed003-agent")
    arguments = {"conversation_id": "c-1", "messages": [{"role": "human", "content": text}]}
    operation_execute(principal, "store_memory", arguments, call=internal_call())
    with connection.cursor() as cursor:
        cursor.execute("SELECT id FROM memories WHERE payload->>'data' = %s AND payload->>'tier' = 'ltm'", [text])
        return str(cursor.fetchone()[0])


def payload_of(memory_id: str) -> dict | None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT payload FROM memories WHERE id = %s", [memory_id])
        row = cursor.fetchone()
    if row is None:
        return None
    return row[0] if isinstance(row[0], dict) else json.loads(row[0])


def enrich_rows(memory_id: str | None = None):
    rows = AuditEvent.objects.filter(operation=Operation.ENRICH_MEMORY)
    return rows.filter(memory_ids__contains=[memory_id]) if memory_id else rows


@pytest.fixture
def held_llm(llm) -> Iterator[Any]:
    """The fake LLM, holding every call until released (and at the latest after 30 s, so a
    test that fails while it is held ends instead of hanging)."""
    llm.hold()
    failsafe = threading.Timer(30, llm.release)
    failsafe.start()
    yield llm
    llm.release()
    failsafe.cancel()


def idle_transactions() -> int:
    """Other sessions sitting in an open transaction (a run waiting on the LLM inside one)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND state LIKE 'idle in transaction%%' AND pid <> pg_backend_pid()"
        )
        return cursor.fetchone()[0]


# --- (a) nothing is held while the LLM answers ----------------------------------------------
def test_no_transaction_or_row_lock_is_held_during_the_llm_call(alice, held_llm):
    memory_id = store_candidate(alice, DARK_MODE)
    held_llm.queue_answer({"summary": "Prefers dark mode", "importance": 0.8, "tags": ["ui"], "memory_type": "user"})
    run = InThread(toolkit_candidates_enrich)
    held_llm.wait_held()
    assert run.thread.is_alive()  # still waiting on the LLM
    with transaction.atomic(), connection.cursor() as cursor:  # the row is not locked
        cursor.execute("SELECT id FROM memories WHERE id = %s FOR UPDATE NOWAIT", [memory_id])
    assert idle_transactions() == 0
    assert payload_of(memory_id)[CLAIM]["until"]  # claimed, and the claim committed
    # The user's own edit of another field goes through at once, and is kept by the apply.
    scope = MemoryScope.for_user(alice)
    memory_update(scope, memory_id=memory_id, pinned=True, fields={"why_stored": "asked to"}, call=internal_call())
    held_llm.release()
    assert run.result() == 1
    payload = payload_of(memory_id)
    assert (payload["enrichment_status"], payload["summary"], payload["enriched_by"]) == (
        "completed",
        "Prefers dark mode",
        "llm",
    )
    assert payload["pinned"] is True and payload["attrs"]["why_stored"] == "asked to"
    assert payload["attrs"]["tags"] == ["ui"] and CLAIM not in payload
    assert enrich_rows(memory_id).filter(outcome=AuditEvent.Outcome.OK).count() == 1


# --- (b) a change made during the LLM call wins ----------------------------------------------
@pytest.mark.parametrize("trash_days", [30, 0], ids=["trashed", "deleted-for-good"])
def test_a_memory_deleted_during_the_llm_call_is_not_written_or_resurrected(alice, held_llm, settings, trash_days):
    settings.TRASH_RETENTION_DAYS = trash_days
    memory_id = store_candidate(alice, DARK_MODE)
    run = InThread(toolkit_candidates_enrich)
    held_llm.wait_held()
    scope = MemoryScope.for_user(alice)
    memory_delete(scope, memory_id=memory_id, call=internal_call())  # not blocked by the run
    held_llm.release()
    assert run.result() == 0
    payload = payload_of(memory_id)
    if trash_days:  # still in the trash, untouched by the enrichment
        assert payload["trash"] and payload["enrichment_status"] == "pending"
        assert "summary" not in payload and "enrichment_attempts" not in payload
    else:
        assert payload is None
    with pytest.raises(ServiceError) as gone:
        memory_get_owned(scope, memory_id=memory_id)
    assert gone.value.code == ErrorCode.NOT_FOUND
    assert not enrich_rows().exists()  # neither a success nor a failure


def test_fields_the_user_sets_during_the_llm_call_are_kept_and_the_rest_enriched(alice, held_llm):
    memory_id = store_candidate(alice, DARK_MODE)
    held_llm.queue_answer({"summary": "Prefers dark mode", "importance": 0.8, "tags": ["ui"], "memory_type": "user"})
    run = InThread(toolkit_candidates_enrich)
    held_llm.wait_held()
    scope = MemoryScope.for_user(alice)
    memory_update(scope, memory_id=memory_id, fields={"tags": ["mine"], "importance": 0.1}, call=internal_call())
    held_llm.release()
    assert run.result() == 1
    payload = payload_of(memory_id)
    assert (payload["attrs"]["tags"], payload["attrs"]["importance"]) == (["mine"], 0.1)  # the user's
    assert payload["attrs"]["memory_type"] == "user"  # untouched by the user: enriched
    assert (payload["enrichment_status"], payload["summary"]) == ("completed", "Prefers dark mode")


def test_a_memory_edited_during_the_llm_call_keeps_its_new_text_and_is_enriched_later(alice, held_llm):
    memory_id = store_candidate(alice, DARK_MODE)
    run = InThread(toolkit_candidates_enrich)
    held_llm.wait_held()
    scope = MemoryScope.for_user(alice)
    memory_update(scope, memory_id=memory_id, memory=KEYS, call=internal_call())
    held_llm.release()
    assert run.result() == 0  # the summary of the old text is not written over the new one
    payload = payload_of(memory_id)
    assert (payload["data"], payload["enrichment_status"]) == (KEYS, "pending")
    assert "summary" not in payload and "enrichment_attempts" not in payload
    assert not enrich_rows().exists()
    # The run gave its lease back: the next sweep enriches the new text at once.
    assert "enrichment_claim" not in payload
    assert toolkit_candidates_enrich() == 1
    payload = payload_of(memory_id)
    assert payload["enrichment_status"] == "completed" and payload["summary"] == KEYS
    assert enrich_rows(memory_id).count() == 1


def lapse_claim(memory_id: str) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE memories SET payload = jsonb_set(payload, '{enrichment_claim,until}', '\"2000-01-01T00:00:00\"')"
            " WHERE id = %s",
            [memory_id],
        )


class WorkerDied(BaseException):
    """The worker process going away mid-call (not an error it could count)."""


def test_a_crashed_workers_claim_lapses(alice, monkeypatch):
    memory_id = store_candidate(alice, DARK_MODE)

    def crash(text: str) -> enrichment.Enrichment:
        raise WorkerDied

    monkeypatch.setattr(enrichment, "enrich_text", crash)
    with pytest.raises(WorkerDied):
        toolkit_candidates_enrich()
    monkeypatch.undo()
    assert payload_of(memory_id)[CLAIM]
    assert toolkit_candidates_enrich() == 0  # another worker keeps off while the lease runs
    lapse_claim(memory_id)
    assert toolkit_candidates_enrich() == 1
    assert "enrichment_attempts" not in payload_of(memory_id)  # a crash is no failed attempt


# --- (c) two runs at once enrich each candidate once ------------------------------------------
def test_two_concurrent_runs_enrich_each_candidate_once(alice, bob, held_llm):
    ids = [
        store_candidate(alice, DARK_MODE),
        store_candidate(alice, KEYS),
        store_candidate(bob, "Bob always wants the release notes before every deploy"),
        store_candidate(bob, "Bob prefers tea over coffee in the mornings at the office"),
    ]
    first, second = InThread(toolkit_candidates_enrich), InThread(toolkit_candidates_enrich)
    held_llm.wait_held(2)  # both runs are in an LLM call at the same time, on different rows
    held_llm.release()
    assert first.result() + second.result() == len(ids)
    assert len(held_llm.prompts()) == len(ids)  # no candidate was sent to the LLM twice
    for memory_id in ids:
        payload = payload_of(memory_id)
        assert payload["enrichment_status"] == "completed" and CLAIM not in payload
        assert enrich_rows(memory_id).count() == 1
        assert enrich_rows(memory_id).get().outcome == AuditEvent.Outcome.OK


# --- (d) failures are still counted, retried and finally marked -------------------------------
def test_a_failing_candidate_is_counted_retried_then_failed_and_the_others_go_on(alice, bob, monkeypatch):
    poisoned = store_candidate(alice, KEYS)  # the oldest
    healthy = store_candidate(bob, DARK_MODE)
    real = enrichment.enrich_text

    def enrich(text: str) -> enrichment.Enrichment:
        if text == KEYS:
            raise RuntimeError("the enrichment blew up")
        return real(text)

    monkeypatch.setattr(enrichment, "enrich_text", enrich)
    assert toolkit_candidates_enrich() == 1
    assert payload_of(healthy)["enrichment_status"] == "completed"
    row = payload_of(poisoned)
    assert (row["enrichment_status"], row["enrichment_attempts"], row["enrichment_error"]) == (
        "pending",
        1,
        "RuntimeError",
    )
    assert CLAIM not in row  # released with the attempt: the next sweep tries it at once
    for attempt in range(2, ENRICHMENT_MAX_ATTEMPTS + 1):
        assert toolkit_candidates_enrich() == 0
        assert payload_of(poisoned)["enrichment_attempts"] == attempt
    assert payload_of(poisoned)["enrichment_status"] == "failed"
    assert toolkit_candidates_enrich() == 0
    failures = enrich_rows(poisoned)
    assert failures.count() == ENRICHMENT_MAX_ATTEMPTS
    assert set(failures.values_list("outcome", flat=True)) == {AuditEvent.Outcome.ERROR}
    assert enrich_rows(healthy).filter(outcome=AuditEvent.Outcome.OK).count() == 1
