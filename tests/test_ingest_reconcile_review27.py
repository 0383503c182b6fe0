"""The ingest reconciler (session 27): one intent it cannot close now (its user's lock
busy) no longer stops the run for every later intent, and a lease shorter than the
slowest ingest is refused at start-up (it would close a call still running as undone)."""

from __future__ import annotations

import psycopg
import pytest
from django.db import connection

from memories.models import IngestIntent
from memories.services import ingest_intents_reconcile
from memsite.checks import ingest_intent_lease_check

pytestmark = [pytest.mark.django_db(transaction=True)]


def _intent(scope, request_id: str) -> IngestIntent:
    return IngestIntent.objects.create(
        request_id=request_id,
        engine_user_id=scope.engine_user_id,
        scope={"tenant": scope.tenant, "user_pk": scope.user_pk, "client_app": None},
        call={"channel": "mcp", "ip": None, "user_agent": "", "actor_username": "", "actor_auth": "api_key",
              "turn_id": ""},
    )  # fmt: skip


def test_an_intent_whose_user_is_busy_does_not_hold_up_the_others(alice_scope, bob_scope, settings, caplog):
    settings.MEMORY_LOCK_TIMEOUT_S = 0.3
    _intent(alice_scope, "req-alice")  # first in pk order
    _intent(bob_scope, "req-bob")
    params = {k: v for k, v in connection.get_connection_params().items() if k not in ("cursor_factory", "context")}
    with psycopg.connect(**params, autocommit=True) as other:
        # Alice's erasure under way: her intent cannot be closed until it commits.
        other.execute("SELECT pg_advisory_lock(hashtextextended(%s, 0))", [f"clear_all:{alice_scope.engine_user_id}"])
        counts = ingest_intents_reconcile(older_than_s=0)
    assert counts == {"completed": 0, "undone": 1, "failed": 1}
    states = dict(IngestIntent.objects.values_list("request_id", "state"))
    assert states == {"req-alice": IngestIntent.State.OPEN, "req-bob": IngestIntent.State.UNDONE}
    assert "the next run retries" in caplog.text
    # The lock released, the next run closes Alice's.
    assert ingest_intents_reconcile(older_than_s=0) == {"completed": 0, "undone": 1}


def test_a_lease_shorter_than_the_slowest_ingest_is_refused(settings):
    settings.LLM_TIMEOUT_S, settings.LLM_MAX_RETRIES = 30.0, 1
    settings.INGEST_INTENT_LEASE_S = 600.0
    assert ingest_intent_lease_check() == []
    settings.INGEST_INTENT_LEASE_S = 120.0  # two requests x two tries x 30 s = 120 s of LLM alone
    (error,) = ingest_intent_lease_check()
    assert error.id == "memsite.E002" and "INGEST_INTENT_LEASE_S (120)" in error.msg
