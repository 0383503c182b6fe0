"""Closed ingest intents are pruned INGEST_INTENT_RETENTION_DAYS after they closed (a row
per ingest call, kept forever before unless the user was erased); open ones never are.
A user's clear-all, its undo and their erasure mark, unmark and delete only that user's
intents (through the per-user indexes of memories 0033)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.conf import settings as django_settings
from django.utils import timezone

from audit.models import AuditEvent
from memories import services, tasks
from memories.models import IngestIntent
from memories.services import ingest_intents_prune, memory_clear_all, memory_remember, memory_restore
from memsite.checks import ingest_intent_retention_check
from tests.conftest import internal_call

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]

State = IngestIntent.State


def _intent(scope, request_id: str, *, state: str = State.OPEN, age: timedelta | None = None, detail=None):
    now = timezone.now()
    closed = state != State.OPEN
    return IngestIntent.objects.create(
        request_id=request_id,
        engine_user_id=scope.engine_user_id,
        scope={"tenant": scope.tenant, "user_pk": scope.user_pk, "client_app": None},
        call={"channel": "internal"},
        detail=detail or {"messages": 1},
        state=state,
        created_at=now - (age or timedelta()) - timedelta(minutes=1),
        closed_at=now - (age or timedelta()) if closed else None,
    )


def test_only_closed_intents_past_the_retention_are_pruned_for_every_user(
    alice_scope, bob_scope, settings, monkeypatch
):
    settings.INGEST_INTENT_RETENTION_DAYS = 7
    monkeypatch.setattr(services, "INGEST_INTENT_PRUNE_BATCH", 2)  # several batches
    old, recent = timedelta(days=8), timedelta(days=6)
    for scope in (alice_scope, bob_scope):
        name = scope.engine_user_id
        _intent(scope, f"{name}-done-old", state=State.DONE, age=old)
        _intent(scope, f"{name}-undone-old", state=State.UNDONE, age=old)
        _intent(scope, f"{name}-done-recent", state=State.DONE, age=recent)
        _intent(scope, f"{name}-undone-recent", state=State.UNDONE, age=recent)
        # A call cut short long ago, still owed its completion by the reconciler.
        _intent(scope, f"{name}-open-old", age=timedelta(days=30))
    # Opened long ago but closed only now (the reconciler was held up): its age counts
    # from its close, so the proxy's sweep can still find it done.
    late = _intent(alice_scope, "closed-late", state=State.DONE)
    IngestIntent.objects.filter(pk=late.pk).update(created_at=timezone.now() - timedelta(days=30))

    assert ingest_intents_prune() == 4
    left = set(IngestIntent.objects.values_list("request_id", flat=True))
    assert left == {
        "closed-late",
        *(
            f"{scope.engine_user_id}-{kind}"
            for scope in (alice_scope, bob_scope)
            for kind in ("done-recent", "undone-recent", "open-old")
        ),
    }
    assert ingest_intents_prune() == 0
    # Eight days on, the others closed have gone too; the open ones still stay.
    assert ingest_intents_prune(now=timezone.now() + timedelta(days=8)) == 5
    assert set(IngestIntent.objects.values_list("state", flat=True)) == {State.OPEN}


def test_the_prune_runs_daily_from_beat_under_a_stable_task_name():
    assert tasks.ingest_intents_prune.name == "memories.ingest_intents_prune"
    entries = [e for e in django_settings.CELERY_BEAT_SCHEDULE.values() if e["task"] == "memories.ingest_intents_prune"]
    assert len(entries) == 1


def test_a_retention_shorter_than_the_proxys_retry_delay_is_refused(settings):
    settings.PROXY_EXTRACTION_RETRY_MAX_S = 3600.0
    settings.INGEST_INTENT_RETENTION_DAYS = 1
    assert ingest_intent_retention_check() == []
    settings.PROXY_EXTRACTION_RETRY_MAX_S = 86400.0  # a due turn may come back 28.8 h later
    (error,) = ingest_intent_retention_check()
    assert error.id == "memsite.E003" and "INGEST_INTENT_RETENTION_DAYS (1)" in error.msg
    settings.INGEST_INTENT_RETENTION_DAYS = 2
    assert ingest_intent_retention_check() == []


def test_alices_clear_all_and_its_undo_never_touch_bobs_intents(alice_scope, bob_scope, settings):
    settings.TRASH_RETENTION_DAYS = 30
    memory_remember(alice_scope, memory="Alice lives in Tromsø", call=internal_call())
    alices = _intent(alice_scope, "alice-in-flight")
    bobs = _intent(bob_scope, "bob-in-flight")
    bobs_closed = _intent(bob_scope, "bob-done", state=State.DONE)

    memory_clear_all(alice_scope, confirm=True, call=internal_call())
    clear_row = AuditEvent.objects.get(operation="clear_all_memory", outcome="ok")
    mark = IngestIntent.objects.get(pk=alices.pk).detail["superseded_by"]
    assert mark["request_id"] == clear_row.request_id and mark["erased"] is False
    assert IngestIntent.objects.get(pk=bobs.pk).detail == {"messages": 1}
    assert IngestIntent.objects.get(pk=bobs_closed.pk).detail == {"messages": 1}

    # Even an intent of Bob's carrying that very mark is not Alice's undo to lift.
    IngestIntent.objects.filter(pk=bobs.pk).update(detail={"messages": 1, "superseded_by": mark})
    memory_restore(alice_scope, request_id=clear_row.request_id, call=internal_call())
    assert "superseded_by" not in IngestIntent.objects.get(pk=alices.pk).detail
    assert IngestIntent.objects.get(pk=bobs.pk).detail == {"messages": 1, "superseded_by": mark}
