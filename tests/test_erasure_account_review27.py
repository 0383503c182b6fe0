"""A writer that waited for a staff erasure which also deleted the account stored its rows
for a user who no longer exists: no one could reach or erase them. Writers now check,
under the erasure lock, that the account still exists (and hold it until they commit)."""

from __future__ import annotations

import threading

import pytest
from django.db import connection, transaction

from core.errors import ErrorCode, ServiceError
from core.locks import advisory_xact_lock
from memories import engine
from memories.models import ContentHash
from memories.services import erasure_lock_key, memory_remember
from tests.conftest import InThread, internal_call, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]


def _advisory_waiters() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted")
        return cursor.fetchone()[0]


def test_a_write_that_waited_for_an_account_deletion_stores_nothing(alice, alice_scope, settings):
    settings.RATE_LIMITS = {op: (0, 60) for op in settings.RATE_LIMITS}
    holding, release = threading.Event(), threading.Event()

    def delete_account() -> None:
        # As the admin's delete does: the erasure lock, the wipe, then the account.
        with transaction.atomic():
            advisory_xact_lock(erasure_lock_key(alice_scope))
            alice.delete()
            holding.set()
            assert release.wait(30)

    deleter = InThread(delete_account)
    assert holding.wait(30)
    writer = InThread(lambda: memory_remember(alice_scope, memory="Alice's new PIN is 4321", call=internal_call()))
    wait_for(lambda: _advisory_waiters() == 1 or writer.done(), timeout=20, what="the writer waiting")
    release.set()
    deleter.result()
    with pytest.raises(ServiceError) as refused:
        writer.result()
    assert refused.value.code == ErrorCode.UNAUTHENTICATED
    assert not engine.engine_rows_owned(alice_scope)
    assert not ContentHash.objects.filter(engine_user_id=alice_scope.engine_user_id).exists()
