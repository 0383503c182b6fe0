"""The retention prunes of tables that take rows per call delete a backlog in short
statements (core.batched), oldest first from an index: never one DELETE of them all,
which holds every row lock and runs as long as the backlog is big."""

import uuid
from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from audit import services as audit_services
from audit.models import AuthFailureWindow, LoginFailure
from memories import rate_limits
from memories.models import RateEvent, RateWindow
from memories.toolkit import services as toolkit_services
from memories.toolkit.models import CacheEntry, Decision
from memsite import services as memsite_services
from tests.test_per_call_indexes import BY_CONDITION, WHOLE_SORT, _sql_plan


def _statements(captured, verb: str, table: str) -> list[str]:
    return [q["sql"] for q in captured.captured_queries if q["sql"].lstrip().startswith(verb) and table in q["sql"]]


@pytest.mark.django_db
def test_the_rate_limit_prune_deletes_a_backlog_in_batches_oldest_first(alice, monkeypatch):
    """7 aged-out sliding-window calls and 5 fixed windows at 2 a batch: 4 and 3 DELETEs,
    each batch read from an index in its order; the recent rows stay."""
    now = timezone.now()
    old, recent = now - timedelta(days=3), now - timedelta(hours=1)
    RateEvent.objects.bulk_create(
        [RateEvent(user=alice, operation="clear_all_memory", at=old + timedelta(minutes=n)) for n in range(7)]
        + [RateEvent(user=alice, operation="clear_all_memory", at=recent) for _ in range(2)]
    )
    RateWindow.objects.bulk_create(
        RateWindow(user=alice, operation="search_memory", window_seconds=60, window_start=start, count=1)
        for start in [old + timedelta(minutes=n) for n in range(5)] + [recent]
    )
    monkeypatch.setattr(rate_limits, "RATE_PRUNE_BATCH", 2, raising=False)

    with CaptureQueriesContext(connection) as prune:
        assert rate_limits.rate_windows_prune() == 12

    assert list(RateEvent.objects.values_list("at", flat=True)) == [recent, recent]
    assert list(RateWindow.objects.values_list("window_start", flat=True)) == [recent]
    assert len(_statements(prune, "DELETE", '"memories_rateevent"')) == 4
    assert len(_statements(prune, "DELETE", '"memories_ratewindow"')) == 3
    windows_batch = _statements(prune, "SELECT", '"memories_ratewindow"')[0]
    events_batch = _statements(prune, "SELECT", '"memories_rateevent"')[0]
    plan = _sql_plan(windows_batch)
    assert "rate_window_recent" in plan and "Seq Scan" not in plan and not WHOLE_SORT.search(plan), plan
    # The calls' batch by `at` from rate_event_at (memories 0037), not a walk of the primary
    # key testing each row: decided without statistics, as no other index gives the order
    # and sorting is priced out (a skip scan of (user, operation, at) would need a sort).
    plan = _sql_plan(events_batch)
    assert "rate_event_at" in plan and "Index Cond: (at < " in plan, plan
    assert "Seq Scan" not in plan and not WHOLE_SORT.search(plan), plan


@pytest.mark.django_db
def test_the_auth_failure_prune_deletes_windows_and_login_failures_in_batches(monkeypatch, settings):
    now = timezone.now()
    AuthFailureWindow.objects.bulk_create(
        AuthFailureWindow(ip=f"10.0.0.{n}", window_start=now - timedelta(days=31 if n < 5 else 1), last_seen_at=now)
        for n in range(6)
    )
    aged_out = now - timedelta(seconds=settings.LOGIN_FAILURE_WINDOW_S + 60)
    LoginFailure.objects.bulk_create(
        LoginFailure(key=f"ip:10.0.0.{n}", at=aged_out if n < 3 else now) for n in range(4)
    )
    monkeypatch.setattr(audit_services, "AUTH_FAILURE_PRUNE_BATCH", 2, raising=False)

    with CaptureQueriesContext(connection) as prune:
        assert audit_services.auth_failure_windows_prune() == 8

    assert list(AuthFailureWindow.objects.values_list("ip", flat=True)) == ["10.0.0.5"]
    assert list(LoginFailure.objects.values_list("key", flat=True)) == ["ip:10.0.0.3"]
    assert len(_statements(prune, "DELETE", '"audit_authfailurewindow"')) == 3
    assert len(_statements(prune, "DELETE", '"audit_loginfailure"')) == 2
    plan = _sql_plan(_statements(prune, "SELECT", '"audit_authfailurewindow"')[0])
    assert "auth_failure_window_start" in plan and not WHOLE_SORT.search(plan), plan
    # From login_failure_at (audit 0024), the range alone: as the rate-limit calls' above.
    plan = _sql_plan(_statements(prune, "SELECT", '"audit_loginfailure"')[0])
    assert "login_failure_at" in plan and "Index Cond: (at <= " in plan, plan
    assert "Seq Scan" not in plan and not WHOLE_SORT.search(plan), plan


@pytest.mark.django_db
def test_the_toolkit_purge_deletes_expired_cache_entries_and_decisions_in_batches(alice, bob, monkeypatch):
    now = timezone.now()
    CacheEntry.objects.bulk_create(
        CacheEntry(
            user=alice, query=f"q{n}", response="r", embedding=[1.0, 0.0, 0.0],
            expires_at=now - timedelta(minutes=n + 1) if n < 5 else now + timedelta(days=1),
        )
        for n in range(6)
    )  # fmt: skip
    Decision.objects.bulk_create(
        Decision(
            user=user, key=f"k{n}", value="v", created_at=now, updated_at=now,
            expires_at=now - timedelta(minutes=n + 1) if n < 3 else None,
        )
        for user in (alice, bob) for n in range(4)
    )  # fmt: skip
    monkeypatch.setattr(toolkit_services, "EXPIRED_PURGE_BATCH", 2, raising=False)

    with CaptureQueriesContext(connection) as purge:
        assert toolkit_services.toolkit_expired_purge() == {"cache": 5, "decisions": 6}

    assert list(CacheEntry.objects.values_list("query", flat=True)) == ["q5"]
    assert len(_statements(purge, "DELETE", '"toolkit_cacheentry"')) == 3
    assert sorted(Decision.objects.values_list("key", flat=True)) == ["k3", "k3"]
    assert len(_statements(purge, "DELETE", '"toolkit_decision"')) == 3
    plan = _sql_plan(_statements(purge, "SELECT", '"toolkit_cacheentry"')[0])
    assert "expires_at" in plan and "Seq Scan" not in plan and not WHOLE_SORT.search(plan), plan


@pytest.mark.django_db
def test_expired_decisions_are_found_through_their_index(alice, bob, settings):
    """The purge deletes every user's expired decisions and a store at the cap the user's:
    from decision_expires (toolkit 0006, partial on the decisions that expire), not a read
    of every decision kept. Decided without statistics: sequential and plain index scans
    priced out, so each table is read through an index condition or shows a Seq Scan."""
    from core.scope import MemoryScope

    now = timezone.now()

    def decision(user, key: str, expires_at) -> Decision:
        return Decision(user=user, key=key, value="v", created_at=now, updated_at=now, expires_at=expires_at)

    Decision.objects.bulk_create(
        [decision(user, f"gone-{n}", now - timedelta(minutes=n + 1)) for user in (alice, bob) for n in range(2)]
        + [decision(alice, "later", now + timedelta(days=1)), decision(alice, "forever", None)]
    )
    settings.DECISION_MAX_PER_USER = 4  # alice is at the cap: her expired ones go first

    with CaptureQueriesContext(connection) as room:
        toolkit_services._decision_room(MemoryScope.for_user(alice), now=now)
    # The cap's DELETE goes by pk: the rows it takes are read (SKIP LOCKED) by the user.
    (cap_read,) = [sql for sql in _statements(room, "SELECT", '"toolkit_decision"') if "SKIP LOCKED" in sql]
    plan = _sql_plan(cap_read, priced_out=BY_CONDITION)
    assert f"user_id = {alice.pk}" in plan and "Seq Scan" not in plan, plan
    assert Decision.objects.filter(user=alice).count() == 2

    with CaptureQueriesContext(connection) as purge:
        assert toolkit_services.toolkit_expired_purge(now=now) == {"cache": 0, "decisions": 2}
    assert sorted(Decision.objects.values_list("key", flat=True)) == ["forever", "later"]
    purge_batch = _statements(purge, "SELECT", '"toolkit_decision"')[0]  # the DELETE goes by pk
    plan = _sql_plan(purge_batch, priced_out=BY_CONDITION)
    assert "decision_expires" in plan and "Index Cond: (expires_at <= " in plan and "Seq Scan" not in plan, plan


def _broker_rows(visible: bool) -> set[int]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT id FROM kombu_message WHERE visible = %s", [visible])
        return {row[0] for row in cursor.fetchall()}


def test_the_broker_cleanup_deletes_consumed_messages_in_batches(transactional_db, monkeypatch):
    from memsite.tasks import worker_heartbeat

    worker_heartbeat.delay(uuid.uuid4().hex)  # creates the broker tables if need be
    before = _broker_rows(visible=True)
    for _ in range(6):
        worker_heartbeat.delay(uuid.uuid4().hex)  # no worker here: they stay queued
    sent = sorted(_broker_rows(visible=True) - before)
    consumed, waiting = sent[:5], sent[5:]
    with connection.cursor() as cursor:  # as kombu marks a message it handed out
        cursor.execute(
            "UPDATE kombu_message SET visible = false, timestamp = now() - interval '1 hour' WHERE id = ANY(%s)",
            [consumed],
        )
    monkeypatch.setattr(memsite_services, "BROKER_CLEANUP_BATCH", 2, raising=False)

    with CaptureQueriesContext(connection) as cleanup:
        assert memsite_services.broker_messages_cleanup(older_than_s=60) >= 5

    assert not set(consumed) & (_broker_rows(visible=False) | _broker_rows(visible=True))
    assert set(waiting) <= _broker_rows(visible=True)
    assert len(_statements(cleanup, "DELETE", "kombu_message")) >= 3
