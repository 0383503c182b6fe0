"""Closed chat turns are pruned after PROXY_TURN_RETENTION_DAYS, and clear-all still finds
every conversation log the proxy replays: those logs are marked on their session state
(`SessionState.replayed`), not found through the turn rows; migration proxy 0004 marks
the logs written before."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.utils import timezone

from core.scope import MemoryScope
from memories import sessions
from memories.models import SessionEvent, SessionState
from memories.services import api_key_issue
from proxy import services
from proxy.models import ProxyTurn
from tests.test_proxy_review20 import clear_all, finish_turn

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]


@pytest.fixture
def caller(alice, settings):
    settings.CHAT_UPSTREAM_BASE_URL = "http://127.0.0.1:9/v1"
    key = api_key_issue(user=alice, name="chat")[1]
    return services.chat_caller_authenticate(authorization=f"Bearer {key}")


def test_only_closed_turns_older_than_the_retention_are_pruned(caller, settings):
    settings.PROXY_TURN_RETENTION_DAYS = 30
    turns = [finish_turn(caller, session_id="s1", text=f"I like colour-{n}.") for n in range(4)]
    now = timezone.now()
    old, recent, pending_old, cleared_old = turns
    ProxyTurn.objects.filter(pk=old).update(state="done", messages=[], closed_at=now - timedelta(days=31))
    ProxyTurn.objects.filter(pk=recent).update(state="done", messages=[], closed_at=now - timedelta(days=29))
    ProxyTurn.objects.filter(pk=pending_old).update(created_at=now - timedelta(days=40))  # owed an extraction
    ProxyTurn.objects.filter(pk=cleared_old).update(state="failed", messages=[], closed_at=now - timedelta(days=45))
    assert services.proxy_turns_prune(now=now) == 2
    assert set(ProxyTurn.objects.values_list("pk", flat=True)) == {recent, pending_old}
    assert services.proxy_turns_prune(now=now) == 0


def test_clear_all_deletes_the_proxys_logs_after_their_turns_were_pruned(alice, caller):
    finish_turn(caller, session_id="named-by-client", text="My therapist is Dr Zorbanek")
    scope = MemoryScope.for_user(alice)
    assert SessionState.objects.get(session_id="named-by-client").replayed
    # An agent's own session (turn tools), also without a project: not the proxy's, it stays.
    sessions.session_events_append(
        scope, session_id="agent-session", items=[{"type": "message", "role": "user", "content": "agent"}]
    )
    # ...and the proxy writing to it later marks it; the agent writing again does not unmark.
    finish_turn(caller, session_id="shared", text="hello")
    sessions.session_events_append(
        scope, session_id="shared", items=[{"type": "message", "role": "user", "content": "agent too"}]
    )
    assert SessionState.objects.get(session_id="shared").replayed
    assert not SessionState.objects.get(session_id="agent-session").replayed
    ProxyTurn.objects.all().delete()  # pruned
    clear_all(scope)
    left = SessionEvent.objects.filter(engine_user_id=scope.engine_user_id)
    assert list(left.values_list("session_id", flat=True).distinct()) == ["agent-session"]


def test_migration_marks_the_logs_the_proxy_wrote_before(alice, bob, caller):
    finish_turn(caller, session_id="with-state", text="one")
    finish_turn(caller, session_id="without-state", text="two")
    finish_turn(caller, session_id="log-deleted", text="three")
    scope = MemoryScope.for_user(alice)
    executor = MigrationExecutor(connection)
    executor.migrate([("proxy", "0003_actor_credential")])
    SessionState.objects.update(replayed=False)
    SessionState.objects.filter(session_id="without-state").delete()  # written before every writer kept one
    SessionEvent.objects.filter(session_id="log-deleted").delete()
    SessionState.objects.filter(session_id="log-deleted").delete()
    bobs = MemoryScope.for_user(bob)
    sessions.session_events_append(
        bobs, session_id="with-state", items=[{"type": "message", "role": "user", "content": "bob"}]
    )

    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(executor.loader.graph.leaf_nodes())

    marked = SessionState.objects.filter(replayed=True)
    assert sorted(marked.values_list("engine_user_id", "session_id")) == [
        (scope.engine_user_id, "with-state"),
        (scope.engine_user_id, "without-state"),
    ]
    assert not SessionState.objects.filter(session_id="log-deleted").exists()
    assert sessions.sessions_replayed(scope) == ["with-state", "without-state"]
