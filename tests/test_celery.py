"""A real worker process on the default broker: kombu's SQLAlchemy transport on Postgres."""

import uuid

import pytest
from django.db import connection

from memsite.models import WorkerHeartbeat
from memsite.services import broker_messages_cleanup
from memsite.tasks import worker_heartbeat
from tests.conftest import wait_for

pytestmark = pytest.mark.slow


def _broker_rows(visible: bool) -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM kombu_message WHERE visible = %s", [visible])
        return cursor.fetchone()[0]


def test_task_round_trip_through_a_worker_and_broker_cleanup(celery_worker_process, settings):
    assert settings.CELERY_BROKER_URL.startswith("sqla+postgresql+psycopg://")
    # Earlier tests leave delivery tasks queued; a 1-process worker drains them at about one
    # per second, which would eat this test's timeout before it reaches the tasks below.
    from memsite.celery import app

    app.control.purge()
    tokens = [uuid.uuid4().hex for _ in range(3)]
    for token in tokens:
        worker_heartbeat.delay(token)

    wait_for(
        lambda: WorkerHeartbeat.objects.filter(token__in=tokens).count() == 3,
        timeout=60,
        what=lambda: f"the worker to run 3 tasks; worker log:\n{celery_worker_process.log()}",
    )
    # Consumed messages stay in the table (visible=false) until cleaned up.
    wait_for(lambda: _broker_rows(visible=False) >= 3, timeout=10, what="consumed messages")
    assert _broker_rows(visible=True) == 0

    removed = broker_messages_cleanup(older_than_s=0)

    assert removed >= 3
    assert _broker_rows(visible=False) == 0


def test_cleanup_keeps_unconsumed_messages(transactional_db):
    worker_heartbeat.delay(uuid.uuid4().hex)  # creates the broker tables if need be
    waiting = _broker_rows(visible=True)
    worker_heartbeat.delay(uuid.uuid4().hex)  # no worker here: stays visible
    assert _broker_rows(visible=True) == waiting + 1
    broker_messages_cleanup(older_than_s=0)
    assert _broker_rows(visible=True) == waiting + 1
