"""The periodic purge of expired cache entries and decisions deletes rows of every user,
in batches, while a user's own deletes (wipe_user_data, store_cache's eviction, cache
invalidation) delete several of theirs: two multi-row DELETEs lock their rows in scan
order, and when their plans differ (the purge's batch by primary key or heap order, the
user's through the (user, expires_at) index) they can lock two rows in opposite orders.
The purge now never waits for a row: it locks its batch with SKIP LOCKED."""

from __future__ import annotations

import threading
import uuid
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.utils import timezone

from memories.auth import Principal
from memories.operations import operation_execute
from memories.toolkit import services as toolkit_services
from memories.toolkit.models import CacheEntry
from tests.conftest import internal_call

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]


@pytest.fixture(autouse=True)
def unlimited(settings):
    settings.RATE_LIMITS = {op: (0, 60) for op in settings.RATE_LIMITS}


def _lock_waiters() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'transactionid' AND NOT granted")
        return cursor.fetchone()[0]


def _elsewhere(outcomes: dict[str, object], name: str, work, *, plan: str) -> threading.Thread:
    """`work` on its own connection, its planner told `plan` (SET statements): the plans a
    big table gets, which a test table of three rows would not."""

    def target() -> None:
        try:
            if plan:
                with connection.cursor() as cursor:
                    cursor.execute(plan)
            outcomes[name] = work()
        except Exception as error:  # handed to the assertions of the test
            outcomes[name] = error
        finally:
            connection.close()

    thread = threading.Thread(target=target)
    thread.start()
    return thread


def _entry(user, pk: int, *, created_ago: int, expired_ago: int) -> CacheEntry:
    now = timezone.now()
    entry = CacheEntry.objects.create(
        id=uuid.UUID(int=pk),
        user=user,
        query=f"q{pk}",
        response="r",
        embedding=[1.0, 0.0, 0.0],
        expires_at=now - timedelta(hours=expired_ago),
    )
    CacheEntry.objects.filter(pk=entry.pk).update(created_at=now - timedelta(hours=created_ago))
    return entry


def test_the_erasure_and_the_purge_of_the_same_expired_entries_do_not_deadlock(alice):
    """Three expired entries of alice, x1 x2 x3 in the heap and by primary key, x2 x3 x1
    by expiry (and by creation, newest first). The erasure deletes hers through its
    index (x2, then x3, which another transaction holds for a moment); the purge's
    batch of all three, deleted in heap order, took x1 and waited for x2. Once x3 was
    free the erasure waited for x1: a deadlock, Postgres ended the purge. The purge now
    skips the rows it cannot lock at once (x2 and x3, being deleted by the erasure, or
    held) and deletes x1; the erasure deletes x2 and x3, waiting for nothing the purge
    holds. Nothing of alice is left."""
    x1 = _entry(alice, 1, created_ago=30, expired_ago=1)
    x2 = _entry(alice, 2, created_ago=10, expired_ago=3)
    x3 = _entry(alice, 3, created_ago=20, expired_ago=2)
    outcomes: dict[str, object] = {}
    principal = Principal(user=alice, method="api_key", client_app="seed003-agent")

    with transaction.atomic():
        CacheEntry.objects.select_for_update().filter(pk=x3.pk).get()  # held for a moment
        wipe = _elsewhere(
            outcomes,
            "wipe",
            lambda: operation_execute(principal, "wipe_user_data", {"confirm": True}, call=internal_call()),
            plan="SET enable_seqscan = off; SET enable_bitmapscan = off",
        )
        while _lock_waiters() < 1 and wipe.is_alive():  # the erasure holds x2, waits for x3
            threading.Event().wait(0.05)
        purge = _elsewhere(
            outcomes,
            "purge",
            lambda: toolkit_services.toolkit_expired_purge()["cache"],
            plan="SET enable_indexscan = off; SET enable_bitmapscan = off",
        )
        while _lock_waiters() < 2 and purge.is_alive():  # the old purge: holds x1, waits for x2
            threading.Event().wait(0.05)
    wipe.join(60)
    purge.join(60)

    assert outcomes["purge"] == 1, outcomes
    wiped = outcomes["wipe"]
    assert isinstance(wiped, dict) and wiped["cache_deleted"] == 2, outcomes
    assert not CacheEntry.objects.filter(pk__in=[x1.pk, x2.pk, x3.pk]).exists()


def test_an_expired_entry_the_purge_skipped_is_purged_by_its_next_run(alice):
    """A row another transaction holds (and does not delete: it rolls back) is left by
    the purge, which does not wait for it, and deleted by the next run."""
    held = _entry(alice, 1, created_ago=2, expired_ago=1)
    _entry(alice, 2, created_ago=1, expired_ago=1)
    outcomes: dict[str, object] = {}
    with transaction.atomic():
        CacheEntry.objects.select_for_update().filter(pk=held.pk).get()
        purge = _elsewhere(outcomes, "purge", lambda: toolkit_services.toolkit_expired_purge()["cache"], plan="")
        purge.join(20)
    assert outcomes == {"purge": 1}, outcomes
    assert list(CacheEntry.objects.values_list("pk", flat=True)) == [held.pk]

    assert toolkit_services.toolkit_expired_purge() == {"cache": 1, "decisions": 0}
    assert not CacheEntry.objects.exists()
