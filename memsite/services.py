"""Service-level housekeeping: worker heartbeats and broker cleanup."""

import socket
from datetime import datetime, timedelta

from django.conf import settings
from django.db import connection
from django.utils import timezone

from memsite.models import WorkerHeartbeat

HEARTBEAT_KEEP = timedelta(days=1)


def worker_heartbeat_record(*, token: str) -> WorkerHeartbeat:
    heartbeat, _ = WorkerHeartbeat.objects.get_or_create(token=token, defaults={"hostname": socket.gethostname()})
    WorkerHeartbeat.objects.filter(seen_at__lt=timezone.now() - HEARTBEAT_KEEP).delete()
    return heartbeat


def broker_messages_cleanup(*, older_than_s: int | None = None) -> int:
    """Delete consumed messages of kombu's SQLAlchemy transport, which never deletes
    them itself. Returns how many rows went. A no-op on any other broker."""
    if not settings.CELERY_BROKER_URL.startswith("sqla+"):
        return 0
    retention = settings.BROKER_MESSAGE_RETENTION_S if older_than_s is None else older_than_s
    # kombu stamps rows with naive local time (datetime.now) when it consumes them.
    cutoff = datetime.now() - timedelta(seconds=retention)
    with connection.cursor() as cursor:
        cursor.execute("SELECT to_regclass('kombu_message') IS NOT NULL")
        if not cursor.fetchone()[0]:
            return 0
        cursor.execute("DELETE FROM kombu_message WHERE visible = false AND timestamp <= %s", [cutoff])
        return cursor.rowcount
