"""A reviewer's probes, each reproduced and then fixed:

1. A failing or retrying Celery task printed the database error's text (psycopg's
   `CONTEXT: JSON data, line 1: ...` quotes the stored data) in celery.app.trace's
   "retry: ..." and "raised unexpected: ..." lines; the text formatter did not scrub
   secrets from tracebacks.
2. One enrichment candidate whose LLM summary held a NUL stayed pending forever and
   blocked every other candidate (each sweep died on it).
3. The chat proxy billed (and rate limited) its background extraction as a second call
   (`ingest`) after the one billed chat completion.
4. memory_run_turn was rate limited, billed and audited as memory_before_turn.
"""

from __future__ import annotations

import json
import logging
import re
import uuid

import psycopg
import pytest
from django.db import DataError, connection

from audit.models import AuditEvent
from billing.models import UsageEvent
from core.choices import Operation
from core.log_safety import ContentSafeFilter
from core.logs import JsonFormatter, TextFormatter
from memories import services as memory_services
from memories.auth import Principal
from memories.models import IngestIntent
from memories.operations import operation_execute
from memories.toolkit import enrichment
from memories.toolkit import services as toolkit_services
from memories.toolkit.services import ENRICHMENT_MAX_ATTEMPTS, toolkit_candidates_enrich
from proxy.models import ProxyTurn
from proxy.services import proxy_turn_extract
from tests.conftest import internal_call

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]

MARKER = "Qwyzzle-marker-5150"


def run(user, name: str, arguments: dict | None = None) -> dict:
    principal = Principal(user=user, method="api_key", client_app="probe-agent")
    return operation_execute(principal, name, arguments or {}, call=internal_call())


def store_candidate(user, text: str) -> str:
    """A long-term candidate (pending enrichment) through store_memory; its id."""
    run(user, "store_memory", {"conversation_id": "c-1", "messages": [{"role": "human", "content": text}]})
    with connection.cursor() as cursor:
        cursor.execute("SELECT id FROM memories WHERE payload->>'data' = %s AND payload->>'tier' = 'ltm'", [text])
        return str(cursor.fetchone()[0])


def payload_of(memory_id: str) -> dict:
    with connection.cursor() as cursor:
        cursor.execute("SELECT payload FROM memories WHERE id = %s", [memory_id])
        payload = cursor.fetchone()[0]
    return payload if isinstance(payload, dict) else json.loads(payload)


def database_error_quoting(text: str) -> DataError:
    """What PostgreSQL answers a jsonb with a NUL: its CONTEXT line quotes the data."""
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT %s::jsonb", [json.dumps({"summary": text + " \u0000"})])
    except DataError as exc:
        assert MARKER in str(exc)  # the probe is real: the driver's message quotes the data
        return exc
    raise AssertionError("PostgreSQL accepted a NUL in jsonb")


def printed(records: list[logging.LogRecord], formatter: logging.Formatter) -> str:
    """The records as the worker's console handler prints them: through the handler's own
    filters (settings.LOGGING) and the given formatter."""
    console = next(h for h in logging.getLogger().handlers if any(isinstance(f, ContentSafeFilter) for f in h.filters))
    lines = []
    for record in records:
        copy = logging.makeLogRecord(record.__dict__)
        if all(f.filter(copy) for f in console.filters):
            lines.append(formatter.format(copy))
    return "\n".join(lines)


# --- 1. Celery's task lines never print the exception's text ------------------------------
@pytest.mark.parametrize("formatter", [TextFormatter(), JsonFormatter()], ids=["text", "json"])
def test_a_failing_and_retrying_task_logs_the_error_type_without_its_text(caplog, monkeypatch, formatter):
    from memsite.celery import app

    error = database_error_quoting(MARKER)

    def poisoned(**kwargs):
        raise error

    monkeypatch.setattr(toolkit_services, "toolkit_candidates_enrich", poisoned)
    task = app.tasks["toolkit.enrich_pending"]
    caplog.set_level(logging.DEBUG)
    # Run eagerly, the task's autoretries (autoretry_for) run at once, each logging its
    # "retry: Retry in Ns: DataError(...)" line, and the last one fails ("raised unexpected",
    # with the traceback), as in the worker.
    result = task.apply(throw=False)
    assert result.failed()
    records = [r for r in caplog.records if r.name == "celery.app.trace"]
    text = printed(records, formatter)
    assert re.search(r"retry: Retry in \d+s: DataError\(", text) and "raised unexpected: DataError(" in text
    assert "message withheld" in text
    assert MARKER not in text and "CONTEXT" not in text
    # The record's `data` extra (for custom handlers) is withheld too.
    for record in records:
        copy = logging.makeLogRecord(record.__dict__)
        ContentSafeFilter().filter(copy)
        assert MARKER not in repr(getattr(copy, "data", ""))


def test_a_celery_line_with_the_exception_as_argument_keeps_only_its_type(caplog):
    caplog.set_level(logging.DEBUG)
    error = database_error_quoting(MARKER)
    logging.getLogger("celery.worker.request").error("Task handler raised error: %r", error)
    text = printed(caplog.records, TextFormatter())
    assert "Task handler raised error: DataError(" in text and MARKER not in text


def test_a_safe_retry_line_keeps_its_delay(caplog):
    from celery.app import trace

    caplog.set_level(logging.DEBUG)
    trace.info(trace.LOG_RETRY, {"id": "t-2", "name": "toolkit.enrich_pending", "exc": "Retry in 5s"})
    assert "retry: Retry in 5s" in printed(caplog.records, TextFormatter())


@pytest.mark.parametrize("formatter", [TextFormatter(), JsonFormatter()], ids=["text", "json"])
def test_both_formatters_scrub_secrets_from_tracebacks(caplog, formatter):
    caplog.set_level(logging.DEBUG)

    class VendorError(Exception):
        log_safe_message = True  # even a message declared safe is scrubbed of keys

    try:
        raise VendorError("request failed: Authorization: Bearer sk-live-abcdef123 api_key=hunter2")
    except VendorError:
        logging.getLogger("memsite.probe").exception("vendor call failed")
    text = printed(caplog.records, formatter)
    assert "vendor call failed" in text and "VendorError" in text
    assert "sk-live-abcdef123" not in text and "hunter2" not in text


# --- 2. one poisoned enrichment candidate never blocks the others ---------------------------
def llm_answers(monkeypatch, summary_of):
    monkeypatch.setattr(enrichment, "llm_configured", lambda: True)

    def answer(prompt: str) -> dict:
        return {"summary": summary_of(prompt), "importance": 0.7, "tags": ["a\u0000b", "\ud800"], "memory_type": "user"}

    monkeypatch.setattr(enrichment, "engine_llm_json", answer)


def test_an_llm_summary_with_nul_or_lone_surrogates_is_cleaned_and_stored(alice, monkeypatch):
    first = store_candidate(alice, f"I always keep the {MARKER} notes in the blue folder")
    second = store_candidate(alice, "I always prefer dark mode interfaces in every editor I use")
    llm_answers(monkeypatch, lambda prompt: f"{MARKER} \u0000 summary \ud800 end")
    assert toolkit_candidates_enrich() == 2
    stored = payload_of(first)
    assert stored["enrichment_status"] == "completed" and stored["enriched_by"] == "llm"
    assert stored["summary"] == f"{MARKER}  summary \ufffd end"
    assert stored["attrs"]["tags"] == ["ab", "\ufffd"]
    assert payload_of(second)["enrichment_status"] == "completed"


def test_a_candidate_whose_write_fails_is_counted_then_failed_and_the_others_go_on(alice, bob, monkeypatch, caplog):
    poisoned = store_candidate(alice, f"I always keep the {MARKER} notes in the blue folder")  # the oldest
    healthy = store_candidate(bob, "I always prefer dark mode interfaces in every editor I use")
    real = enrichment.enrich_text

    def enrich(text: str) -> enrichment.Enrichment:
        result = real(text)
        if MARKER in text:  # an answer the database refuses, past every clean-up
            return enrichment.Enrichment(f"{MARKER} \u0000", 0.5, [], "user", "llm")
        return result

    monkeypatch.setattr(enrichment, "enrich_text", enrich)
    caplog.set_level(logging.DEBUG)
    # The sweep goes past the poisoned (oldest) candidate and enriches the other.
    assert toolkit_candidates_enrich() == 1
    assert payload_of(healthy)["enrichment_status"] == "completed"
    row = payload_of(poisoned)
    assert row["enrichment_status"] == "pending" and row["enrichment_attempts"] == 1
    assert row["enrichment_error"] == "DataError"
    # Later sweeps try it again, up to ENRICHMENT_MAX_ATTEMPTS; then it is failed, not pending.
    for attempt in range(2, ENRICHMENT_MAX_ATTEMPTS + 1):
        assert toolkit_candidates_enrich() == 0
        assert payload_of(poisoned)["enrichment_attempts"] == attempt
    assert payload_of(poisoned)["enrichment_status"] == "failed"
    assert toolkit_candidates_enrich() == 0  # nothing pending is left, nothing raises
    assert run(alice, "memory_health")["enrichment_stats"] == {"pending": 0, "completed": 0, "failed": 1}
    # Each attempt is audited (as an error), the enrichment of the other one as a success.
    rows = AuditEvent.objects.filter(operation=Operation.ENRICH_MEMORY)
    failures = rows.filter(memory_ids__contains=[poisoned])
    assert failures.count() == ENRICHMENT_MAX_ATTEMPTS
    assert set(failures.values_list("outcome", flat=True)) == {AuditEvent.Outcome.ERROR}
    assert rows.filter(memory_ids__contains=[healthy], outcome=AuditEvent.Outcome.OK).count() == 1
    assert not UsageEvent.objects.filter(operation=Operation.ENRICH_MEMORY).exists()
    assert MARKER not in printed(caplog.records, TextFormatter())
    assert MARKER not in json.dumps(list(failures.values_list("detail", flat=True)))


def test_a_candidate_of_no_known_user_is_failed_at_once_and_blocks_nothing(alice):
    stray = store_candidate(alice, "I always keep the spare keys in the left drawer")
    healthy = store_candidate(alice, "I always prefer dark mode interfaces in every editor I use")
    with connection.cursor() as cursor:
        cursor.execute(
            'UPDATE memories SET payload = payload || \'{"user_id": "nobody"}\'::jsonb WHERE id = %s', [stray]
        )
    assert toolkit_candidates_enrich() == 1
    assert payload_of(healthy)["enrichment_status"] == "completed"
    assert payload_of(stray)["enrichment_status"] == "failed"
    assert payload_of(stray)["enrichment_error"] == "unknown_owner"


# --- 3. the chat proxy's extraction is audited, not billed or rate limited -----------------
@pytest.fixture
def extraction_llm(settings, fake_llm):
    from memories import engine

    engine.engine_close()  # mem0's client is built from the LLM settings
    settings.LLM_BASE_URL = f"{fake_llm.url}/v1"
    settings.LLM_MODEL = "fake-model"
    settings.LLM_API_KEY = "fake-key"
    yield fake_llm
    engine.engine_close()


def answered_turn(user, text: str) -> ProxyTurn:
    """What the proxy leaves for the worker after an answered (and billed) chat completion."""
    return ProxyTurn.objects.create(
        request_id=str(uuid.uuid4()),
        user=user,
        tenant="default",
        session_id="s-1",
        messages=[{"role": "user", "content": text}, {"role": "assistant", "content": "Noted."}],
    )


def test_proxy_extraction_is_audited_but_neither_billed_nor_rate_limited(alice, alice_scope, extraction_llm, settings):
    settings.RATE_LIMITS = {**settings.RATE_LIMITS, Operation.INGEST: (1, 60)}
    extraction_llm.queue_facts("User's sister is called Ingrid")
    extraction_llm.queue_facts("User's brother is called Olaf")
    first = answered_turn(alice, "My sister is called Ingrid.")
    second = answered_turn(alice, "My brother is called Olaf.")
    assert proxy_turn_extract(turn_pk=first.pk) == "done"
    assert proxy_turn_extract(turn_pk=second.pk) == "done"  # the INGEST limit (1/min) is not the user's
    assert not UsageEvent.objects.exists()
    audited = AuditEvent.objects.filter(operation=Operation.INGEST)
    assert audited.count() == 2
    assert all(row.outcome == AuditEvent.Outcome.OK and row.detail.get("billed") is False for row in audited)
    # The user's own ingest calls still count and are billed once.
    memory_services.memory_ingest(
        alice_scope, messages=[{"role": "user", "content": "I live in Oslo."}], call=internal_call()
    )
    assert UsageEvent.objects.filter(operation=Operation.INGEST).count() == 1


def test_a_failed_proxy_extraction_is_audited_once_and_not_billed(alice, settings):
    settings.LLM_BASE_URL = None  # no extraction LLM: llm_unavailable
    turn = answered_turn(alice, "My sister is called Ingrid.")
    assert proxy_turn_extract(turn_pk=turn.pk) == "failed"
    rows = AuditEvent.objects.filter(operation=Operation.INGEST)
    assert rows.count() == 1 and rows.get().outcome == AuditEvent.Outcome.ERROR
    assert not UsageEvent.objects.exists()


def test_an_unbilled_ingest_cut_short_after_its_writes_is_completed_unbilled(alice_scope, extraction_llm, monkeypatch):
    extraction_llm.queue_facts("User's sister is called Ingrid")

    def crash(*args, **kwargs):
        raise SystemExit("the worker died after mem0's writes")

    monkeypatch.setattr(memory_services, "_ingest_complete", crash)
    call = internal_call()
    with pytest.raises(SystemExit):
        memory_services.memory_ingest(
            alice_scope,
            messages=[{"role": "user", "content": "My sister is Ingrid."}],
            call=call,
            billed=False,
        )
    monkeypatch.undo()
    assert memory_services.ingest_intents_reconcile(older_than_s=0) == {"completed": 1, "undone": 0}
    assert IngestIntent.objects.get(request_id=call.request_id).state == IngestIntent.State.DONE
    assert not UsageEvent.objects.exists()
    assert AuditEvent.objects.filter(operation=Operation.INGEST, request_id=call.request_id).count() == 1


# --- 4. memory_run_turn is recorded and limited as itself ----------------------------------
def test_run_turn_is_billed_audited_and_rate_limited_as_memory_run_turn(alice, settings):
    settings.RATE_LIMITS = {
        **settings.RATE_LIMITS,
        Operation.MEMORY_RUN_TURN: (1, 60),
        Operation.MEMORY_BEFORE_TURN: (0, 60),
    }
    arguments = {"session_id": "s", "current_input": [{"role": "user", "content": "tea?"}]}
    assert run(alice, "memory_run_turn", arguments)["operation_token"]
    assert list(UsageEvent.objects.values_list("operation", flat=True)) == [Operation.MEMORY_RUN_TURN]
    assert list(AuditEvent.objects.values_list("operation", flat=True)) == [Operation.MEMORY_RUN_TURN]
    # Its own limit: the second call is refused (and audited under the same name), before_turn is not.
    from core.errors import ServiceError

    with pytest.raises(ServiceError) as refused:
        run(alice, "memory_run_turn", arguments)
    assert refused.value.code.value == "rate_limited"
    assert run(alice, "memory_before_turn", arguments)["input_items"]
    assert sorted(UsageEvent.objects.values_list("operation", flat=True)) == [
        Operation.MEMORY_BEFORE_TURN,
        Operation.MEMORY_RUN_TURN,
    ]
    assert sorted(AuditEvent.objects.values_list("operation", "error_code")) == sorted(
        [
            (Operation.MEMORY_RUN_TURN, ""),
            (Operation.MEMORY_RUN_TURN, "rate_limited"),
            (Operation.MEMORY_BEFORE_TURN, ""),
        ]
    )


def test_run_turn_has_a_rate_limit_setting():
    from django.conf import settings

    assert settings.RATE_LIMITS[Operation.MEMORY_RUN_TURN] == settings.RATE_LIMITS[Operation.MEMORY_BEFORE_TURN]


def test_the_probe_error_is_a_psycopg_data_error():
    """database_error_quoting raises what the driver raises (guards the probes above)."""
    error = database_error_quoting(MARKER)
    assert isinstance(error.__cause__, psycopg.Error)
