import uuid

from django.db import models
from django.db.models import Q


class UsageEvent(models.Model):
    """One successful memory call, to be billed once by the payment gateway.

    The outbox row is written in the same transaction as the call's own writes; a
    worker delivers it. `request_id` is the idempotency key the gateway deduplicates
    on: we never create two rows for one call, and a redelivery after a crash carries
    the same id. Rows copy the user id so they outlive the user."""

    class Status(models.TextChoices):
        PENDING = "pending"
        DELIVERED = "delivered"
        FAILED = "failed"  # the gateway refused it (4xx): needs a person, retryable in admin

    request_id = models.UUIDField(unique=True, default=uuid.uuid4, editable=False)
    # Indexed in Meta (usage_event_user_created), not by db_index, which adds a LIKE twin
    # (billing 0004).
    user_id = models.CharField(max_length=64)
    product_id = models.CharField(max_length=32, default="memory")
    operation = models.CharField(max_length=32)
    count = models.PositiveSmallIntegerField(default=1)
    channel = models.CharField(max_length=16, blank=True)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    last_error = models.CharField(max_length=500, blank=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    updated_at = models.DateTimeField(auto_now=True)
    next_attempt_at = models.DateTimeField(auto_now_add=True)
    # A worker holds the row while its POST is in flight; a crashed worker's lease expires.
    claimed_until = models.DateTimeField(null=True, blank=True)
    # Which claim holds the row: a worker settles only rows still carrying its own token,
    # so one whose lease ran out cannot overwrite the outcome of the worker that took over.
    claim_token = models.UUIDField(null=True, blank=True, editable=False)
    delivered_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [
            models.Index(fields=["next_attempt_at"], name="usage_event_undelivered", condition=Q(status="pending")),
            models.Index(fields=["operation", "created_at"]),
            # What support looks for among millions of delivered rows (the admin's
            # status filter, newest first); few rows, and only rows that failed.
            models.Index(fields=["-created_at"], name="usage_event_failed", condition=Q(status="failed")),
            # A user's events in a time range (their usage page: the last 30 days; the
            # admin's search by user id, newest first, and with its date filter): the
            # range is read from the index, not every event the user ever had (billing
            # 0005). A plain index: `db_index` on a CharField also builds a
            # varchar_pattern_ops twin for LIKE 'prefix%', which nothing runs on user ids,
            # at the cost of an entry per billed call (billing 0004).
            models.Index(fields=["user_id", "created_at"], name="usage_event_user_created"),
        ]
        constraints = [
            models.CheckConstraint(condition=Q(count__gte=1), name="usage_event_count_positive"),
        ]

    def __str__(self) -> str:
        return f"{self.operation} for {self.user_id} ({self.status})"

    def payload(self) -> dict:
        return {
            "user_id": self.user_id,
            "product_id": self.product_id,
            "operation": self.operation,
            "count": self.count,
            "request_id": str(self.request_id),
        }
