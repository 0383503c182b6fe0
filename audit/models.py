import uuid

from django.db import models


class MemoryHistory(models.Model):
    """Every version of every memory, written by the engine (mem0's history store,
    kept in Postgres so that all processes and hosts share it). Rows copy what they
    need and outlive the memory they describe."""

    class Event(models.TextChoices):
        ADD = "ADD"
        UPDATE = "UPDATE"
        DELETE = "DELETE"
        NONE = "NONE"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    memory_id = models.CharField(max_length=64, db_index=True)
    old_memory = models.TextField(null=True, blank=True)
    new_memory = models.TextField(null=True, blank=True)
    event = models.CharField(max_length=16, choices=Event.choices)
    created_at = models.CharField(max_length=64, null=True, blank=True)
    updated_at = models.CharField(max_length=64, null=True, blank=True)
    is_deleted = models.BooleanField(default=False)
    actor_id = models.CharField(max_length=255, null=True, blank=True)
    role = models.CharField(max_length=32, null=True, blank=True)
    recorded_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        verbose_name_plural = "memory history"
        indexes = [models.Index(fields=["memory_id", "recorded_at"])]

    def __str__(self) -> str:
        return f"{self.event} {self.memory_id}"
