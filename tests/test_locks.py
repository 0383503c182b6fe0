"""Transaction-level advisory locks (core.locks): every key held until the transaction ends,
only the wait bounded by the lock timeout, a busy key answered with `resource_busy` (retry
after `retry_after_s`), never `conflict` (which tells a client not to retry)."""

import psycopg
import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from core.errors import ErrorCode, ServiceError
from core.locks import advisory_xact_lock

pytestmark = pytest.mark.django_db(transaction=True)


def _other_connection() -> psycopg.Connection:
    params = {k: v for k, v in connection.get_connection_params().items() if k not in ("cursor_factory", "context")}
    return psycopg.connect(**params, autocommit=True)


def _held_elsewhere(other: psycopg.Connection, key: str) -> bool:
    row = other.execute("SELECT pg_try_advisory_lock(hashtextextended(%s, 0))", [key]).fetchone()
    if row[0]:
        other.execute("SELECT pg_advisory_unlock(hashtextextended(%s, 0))", [key])
    return not row[0]


def test_every_key_is_held_until_the_transaction_ends():
    other = _other_connection()
    try:
        with transaction.atomic():
            advisory_xact_lock("lock-test:b", "lock-test:a", "lock-test:a")
            assert _held_elsewhere(other, "lock-test:a") and _held_elsewhere(other, "lock-test:b")
        assert not _held_elsewhere(other, "lock-test:a") and not _held_elsewhere(other, "lock-test:b")
    finally:
        other.close()


def test_only_the_wait_is_bounded_the_transactions_own_lock_timeout_comes_back():
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL lock_timeout = '7s'")
        advisory_xact_lock("lock-test:timeout", timeout_s=0.25)
        cursor.execute("SELECT current_setting('lock_timeout')")
        assert cursor.fetchone()[0] == "7s"


def test_a_busy_key_is_resource_busy_and_the_transaction_rolls_back():
    other = _other_connection()
    try:
        other.execute("SELECT pg_advisory_lock(hashtextextended(%s, 0))", ["lock-test:busy"])
        with pytest.raises(ServiceError) as raised, transaction.atomic():
            advisory_xact_lock("lock-test:free", "lock-test:busy", timeout_s=0.2)
        assert (raised.value.code, raised.value.retry_after_s) == (ErrorCode.RESOURCE_BUSY, 1)
        assert "lock-test" not in raised.value.message  # no key in the message
        assert not _held_elsewhere(other, "lock-test:free")  # rolled back: released
    finally:
        other.close()


def test_outside_a_transaction_it_refuses():
    with pytest.raises(RuntimeError):
        advisory_xact_lock("lock-test:none")


def _shared_free_elsewhere(other: psycopg.Connection, key: str) -> bool:
    row = other.execute("SELECT pg_try_advisory_lock_shared(hashtextextended(%s, 0))", [key]).fetchone()
    if row[0]:
        other.execute("SELECT pg_advisory_unlock_shared(hashtextextended(%s, 0))", [key])
    return row[0]


def test_shared_keys_admit_other_sharers_keep_out_an_exclusive_holder_and_go_first_in_one_round_trip():
    other = _other_connection()
    try:
        with transaction.atomic(), CaptureQueriesContext(connection) as queries:
            advisory_xact_lock("lock-test:x", shared=["lock-test:s2", "lock-test:s1", "lock-test:s1"])
            assert _held_elsewhere(other, "lock-test:s1") and _held_elsewhere(other, "lock-test:s2")
            assert _shared_free_elsewhere(other, "lock-test:s1")  # sharers do not wait for each other
            assert not _shared_free_elsewhere(other, "lock-test:x")  # the exclusive key stays exclusive
        assert len(queries) == 1
        sql = queries[0]["sql"]
        assert sql.index("lock-test:s1") < sql.index("lock-test:s2") < sql.index("lock-test:x")
        assert sql.count("pg_advisory_xact_lock_shared") == 2
        assert not _held_elsewhere(other, "lock-test:s1") and not _held_elsewhere(other, "lock-test:x")
    finally:
        other.close()


def test_a_shared_key_held_exclusively_elsewhere_is_resource_busy_and_rolls_back():
    other = _other_connection()
    try:
        other.execute("SELECT pg_advisory_lock(hashtextextended(%s, 0))", ["lock-test:erasing"])
        with pytest.raises(ServiceError) as raised, transaction.atomic():
            advisory_xact_lock("lock-test:mine", shared=["lock-test:erasing"], timeout_s=0.2)
        assert (raised.value.code, raised.value.retry_after_s) == (ErrorCode.RESOURCE_BUSY, 1)
        assert not _held_elsewhere(other, "lock-test:mine")
    finally:
        other.close()


def test_the_exclusive_holder_may_take_its_key_shared_too():
    other = _other_connection()
    try:
        with transaction.atomic():
            advisory_xact_lock("lock-test:both")
            # Same backend: no wait (timeout or deadlock) for a lock it holds itself.
            advisory_xact_lock("lock-test:more", shared=["lock-test:both"], timeout_s=0.2)
            assert not _shared_free_elsewhere(other, "lock-test:both")
        assert not _held_elsewhere(other, "lock-test:both")
    finally:
        other.close()
