from django.db import models


class WorkerHeartbeat(models.Model):
    """Written by a Celery worker when it runs `memsite.worker_heartbeat`; shows in
    /healthz that a worker consumes the broker."""

    token = models.CharField(max_length=64, unique=True)
    hostname = models.CharField(max_length=255)
    seen_at = models.DateTimeField(auto_now_add=True, db_index=True)

    def __str__(self) -> str:
        return f"{self.hostname} @ {self.seen_at:%Y-%m-%d %H:%M:%S}"
