"""A chat turn's memory extraction outlasts a backend outage: a passing failure
(backend_unavailable, ...) is retried with a growing delay for PROXY_EXTRACTION_RETRY_FOR_S,
a permanent one fails the turn at once, and a turn given up is logged as an error and kept
(messages included) for staff to re-queue; erasure and clear-all still wipe it.

The sweep's clock is the test's (`clock`): every minute of an outage is a sweep tick,
without waiting for it."""

from __future__ import annotations

import logging
import uuid
from datetime import timedelta
from types import SimpleNamespace

import pytest
from django.db import connection
from django.utils import timezone

import proxy.services as proxy_services
from audit.models import AuditEvent
from billing.models import UsageEvent
from core.choices import Operation
from core.errors import ErrorCode, ServiceError
from memories.auth import Principal
from memories.operations import operation_execute
from memsite.observability import DatabaseCollector
from proxy.models import ProxyTurn
from proxy.services import proxy_turn_extract, proxy_turns_sweep
from tests.conftest import internal_call

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]

SECRET_TEXT = "My sister Ingrid is called Ingrid."


class Clock:
    """What proxy.services reads as now: the real time, moved on by the test."""

    def __init__(self) -> None:
        self.offset = timedelta()

    def now(self):
        return timezone.now() + self.offset

    def advance(self, seconds: float) -> None:
        self.offset += timedelta(seconds=seconds)


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(proxy_services, "timezone", SimpleNamespace(now=clock.now))
    return clock


@pytest.fixture
def enqueued(monkeypatch) -> list[int]:
    """The turns the sweep (or a re-queue) hands to the worker; the test runs them."""
    published: list[int] = []
    monkeypatch.setattr(proxy_services, "turn_extract_task", SimpleNamespace(delay=published.append))
    return published


@pytest.fixture
def backend(monkeypatch):
    """memory_ingest as the worker calls it, failing with `code` while `down`."""
    real = proxy_services.memory_ingest
    state = SimpleNamespace(down=True, code=ErrorCode.BACKEND_UNAVAILABLE, calls=0)

    def ingest(*args, **kwargs):
        state.calls += 1
        if state.down:
            raise ServiceError(state.code, "The memory engine is unavailable; retry later.")
        return real(*args, **kwargs)

    monkeypatch.setattr(proxy_services, "memory_ingest", ingest)
    return state


@pytest.fixture
def extraction_llm(settings, fake_llm):
    from memories import engine

    engine.engine_close()  # mem0's client is built from the LLM settings
    settings.LLM_BASE_URL = f"{fake_llm.url}/v1"
    settings.LLM_MODEL = "fake-model"
    settings.LLM_API_KEY = "fake-key"
    settings.PROXY_EXTRACTION_RETRY_BASE_S = 60.0
    settings.PROXY_EXTRACTION_RETRY_MAX_S = 3600.0
    settings.PROXY_EXTRACTION_RETRY_FOR_S = 86400.0
    yield fake_llm
    engine.engine_close()


def answered_turn(user) -> ProxyTurn:
    """What the proxy leaves for the worker after an answered (and billed) chat completion."""
    return ProxyTurn.objects.create(
        request_id=str(uuid.uuid4()),
        user=user,
        tenant="default",
        session_id="s-1",
        messages=[{"role": "user", "content": SECRET_TEXT}, {"role": "assistant", "content": "Noted."}],
    )


def tick(clock: Clock, enqueued: list[int], *, seconds: float = 60.0) -> list[str]:
    """One beat of `proxy.turns_sweep`, then the worker runs what it published."""
    clock.advance(seconds)
    enqueued.clear()
    proxy_turns_sweep()
    return [proxy_turn_extract(turn_pk=pk) for pk in list(enqueued)]


def fresh(turn: ProxyTurn) -> ProxyTurn:
    turn.refresh_from_db()
    return turn


def stored_memories() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM memories")
        return cursor.fetchone()[0]


def gauge(name: str) -> float:
    for family in DatabaseCollector().collect():
        if family.name == name:
            return family.samples[0].value
    raise AssertionError(name)


def test_an_outage_longer_than_five_sweeps_loses_no_turn_and_extracts_it_once(
    alice, extraction_llm, backend, clock, enqueued
):
    extraction_llm.queue_facts("User's sister is called Ingrid")
    turn = answered_turn(alice)
    outcomes = [outcome for _ in range(30) for outcome in tick(clock, enqueued)]  # half an hour down
    assert outcomes and set(outcomes) == {"failed"}
    assert len(outcomes) < 10  # backed off: not one attempt per sweep
    turn = fresh(turn)
    assert (turn.state, turn.last_error) == (ProxyTurn.State.PENDING, "backend_unavailable")
    assert turn.messages[0]["content"] == SECRET_TEXT
    assert gauge("memsite_proxy_turns_pending") == 1

    backend.down = False
    for _ in range(24 * 60):
        if fresh(turn).state != ProxyTurn.State.PENDING:
            break
        tick(clock, enqueued)
    assert (turn.state, turn.messages) == (ProxyTurn.State.DONE, [])
    # exactly one memory write, audited (not billed) as one extraction always was
    assert stored_memories() == 1
    ok = AuditEvent.objects.filter(operation=Operation.INGEST, outcome=AuditEvent.Outcome.OK).get()
    assert ok.detail.get("billed") is False and len(ok.memory_ids) == 1
    assert not UsageEvent.objects.exists()
    assert tick(clock, enqueued, seconds=7200) == []  # nothing left to sweep


def test_the_retry_delay_doubles_and_the_sweep_waits_for_it(alice, extraction_llm, backend, clock, enqueued):
    turn = answered_turn(alice)
    delays = []
    for attempt in range(1, 9):
        clock.advance(61)
        enqueued.clear()
        proxy_turns_sweep()
        assert enqueued == [turn.pk], attempt
        assert proxy_turn_extract(turn_pk=turn.pk) == "failed"
        due = fresh(turn).next_attempt_at
        delay = (due - clock.now()).total_seconds()
        expected = min(3600.0, 60.0 * 2 ** (attempt - 1))
        assert 0.8 * expected - 1 <= delay <= 1.2 * expected, (attempt, delay)
        delays.append(delay)
        # not due yet: the sweep leaves it alone until then
        clock.advance(delay - 5)
        enqueued.clear()
        proxy_turns_sweep()
        assert enqueued == []
    assert all(later > earlier for earlier, later in zip(delays[:6], delays[1:7], strict=True))
    assert fresh(turn).attempts == 8 and turn.state == ProxyTurn.State.PENDING


def test_a_permanent_error_fails_the_turn_at_once(alice, extraction_llm, backend, clock, enqueued, caplog):
    backend.code = ErrorCode.INVALID_ARGUMENT
    turn = answered_turn(alice)
    with caplog.at_level(logging.WARNING, logger="proxy.services"):
        assert proxy_turn_extract(turn_pk=turn.pk) == "failed"
    turn = fresh(turn)
    assert (turn.state, turn.attempts, turn.last_error) == (ProxyTurn.State.FAILED, 1, "invalid_argument")
    assert turn.messages[0]["content"] == SECRET_TEXT  # kept for staff
    assert [r.levelname for r in caplog.records if "given up" in r.getMessage()] == ["ERROR"]
    assert tick(clock, enqueued, seconds=3600) == []  # never retried by the sweep
    assert backend.calls == 1


def test_a_turn_given_up_after_the_retry_window_is_logged_kept_and_requeued_by_staff(
    alice, extraction_llm, backend, clock, enqueued, caplog, settings
):
    settings.PROXY_EXTRACTION_RETRY_FOR_S = 3 * 3600.0
    extraction_llm.queue_facts("User's sister is called Ingrid")
    turn = answered_turn(alice)
    first_failure = None
    with caplog.at_level(logging.WARNING, logger="proxy.services"):
        for _ in range(6 * 60):
            outcomes = tick(clock, enqueued)
            if outcomes and first_failure is None:
                first_failure = clock.now()
            if fresh(turn).state != ProxyTurn.State.PENDING:
                break
    assert turn.state == ProxyTurn.State.FAILED
    assert clock.now() - first_failure >= timedelta(hours=3)  # on elapsed time, not a count
    assert turn.attempts > 5 and turn.last_error == "backend_unavailable"
    assert turn.messages[0]["content"] == SECRET_TEXT  # what a re-queue needs
    given_up = [r for r in caplog.records if "given up" in r.getMessage()]
    assert [r.levelname for r in given_up] == ["ERROR"]
    line = given_up[0].getMessage()
    assert str(turn.pk) in line and "backend_unavailable" in line
    assert "Ingrid" not in caplog.text and "sister" not in caplog.text  # no content in the log
    assert gauge("memsite_proxy_turns_failed") == 1
    assert gauge("memsite_proxy_turns_pending") == 0

    # Staff re-queue it once the backend is back: extracted once, with a fresh window.
    backend.down = False
    enqueued.clear()
    assert proxy_services.proxy_turns_requeue(turn_ids=[turn.pk]) == [turn.pk]
    assert enqueued == [turn.pk]
    assert proxy_turn_extract(turn_pk=turn.pk) == "done"
    assert (fresh(turn).state, turn.messages) == (ProxyTurn.State.DONE, [])
    assert stored_memories() == 1
    assert gauge("memsite_proxy_turns_failed") == 0
    assert proxy_services.proxy_turns_requeue(turn_ids=[turn.pk]) == []  # an extracted turn stays done


def test_the_admin_requeues_failed_turns_without_showing_their_messages(admin_client, alice, extraction_llm, enqueued):
    failed = answered_turn(alice)
    ProxyTurn.objects.filter(pk=failed.pk).update(
        state=ProxyTurn.State.FAILED, closed_at=timezone.now(), last_error="backend_unavailable"
    )
    listing = admin_client.get("/admin/proxy/proxyturn/?state__exact=failed")
    assert listing.status_code == 200 and b"backend_unavailable" in listing.content
    detail = admin_client.get(f"/admin/proxy/proxyturn/{failed.pk}/change/")
    assert detail.status_code == 200 and b"Ingrid" not in detail.content
    response = admin_client.post(
        "/admin/proxy/proxyturn/", {"action": "requeue_extraction", "_selected_action": [failed.pk]}
    )
    assert response.status_code == 302
    assert fresh(failed).state == ProxyTurn.State.PENDING and enqueued == [failed.pk]
    row = AuditEvent.objects.get(operation=Operation.ADMIN_REQUEUE_PROXY_TURNS)
    assert row.detail == {"turn_ids": [failed.pk], "queued": [failed.pk]}


def test_erasure_and_clear_all_still_wipe_a_given_up_turns_messages(alice, bob, extraction_llm, backend):
    backend.code = ErrorCode.INVALID_ARGUMENT
    alices, bobs = answered_turn(alice), answered_turn(bob)
    assert proxy_turn_extract(turn_pk=alices.pk) == "failed"
    assert proxy_turn_extract(turn_pk=bobs.pk) == "failed"

    def run(user, name: str) -> dict:
        principal = Principal(user=user, method="api_key", client_app="retry-test")
        return operation_execute(principal, name, {"confirm": True}, call=internal_call())

    run(alice, "wipe_user_data")
    assert not ProxyTurn.objects.filter(user=alice).exists()
    run(bob, "clear_all_memory")
    bobs = fresh(bobs)
    assert (bobs.state, bobs.messages, bobs.last_error) == (ProxyTurn.State.FAILED, [], proxy_services.CLEARED_REASON)
    assert proxy_services.proxy_turns_requeue(turn_ids=[bobs.pk]) == []  # nothing left to extract
