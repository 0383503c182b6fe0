from django.db import models


class WorkerHeartbeat(models.Model):
    """Written by a Celery worker when it runs `memsite.worker_heartbeat`; shows in
    /healthz that a worker consumes the broker."""

    token = models.CharField(max_length=64, unique=True)
    hostname = models.CharField(max_length=255)
    seen_at = models.DateTimeField(auto_now_add=True, db_index=True)

    def __str__(self) -> str:
        return f"{self.hostname} @ {self.seen_at:%Y-%m-%d %H:%M:%S}"


class ErasureLedger(models.Model):
    """The outbox of the erasure ledger (memsite/services.py): one row per erasure, added in
    the erasure's own transaction, then written by a worker as a record next to the backups
    (`erasures/<time>-<id>.json`), so that a restore to a point before the erasure can do it
    again. Only pseudonymous ids and times: no names, no content. Rows are never deleted:
    a restored database holds exactly the rows of the erasures it already contains, which
    is how a restore tells which erasures it must re-apply."""

    class State(models.TextChoices):
        PENDING = "pending"  # in the database only; the worker has not stored the record yet
        WRITTEN = "written"  # stored durably on the backup target (or re-applied from there)

    id = models.UUIDField(primary_key=True)
    user_pk = models.BigIntegerField()
    engine_user_id = models.CharField(max_length=255)
    request_id = models.CharField(max_length=64, blank=True)
    erased_at = models.DateTimeField()
    state = models.CharField(max_length=8, choices=State.choices, default=State.PENDING)
    written_at = models.DateTimeField(null=True, blank=True)
    attempts = models.PositiveIntegerField(default=0)
    last_error = models.CharField(max_length=100, blank=True)  # an exception's type, never its text
    # Set when this erasure was done again after a restore (its record came from the ledger).
    reapplied_at = models.DateTimeField(null=True, blank=True)
    # The erasure also deleted the account (the admin's user delete): a restore deletes it
    # again, or the user would come back with their password, keys and grants.
    account_deleted = models.BooleanField(default=False, db_default=False)

    class Meta:
        indexes = [
            models.Index(fields=["erased_at"], name="erasure_ledger_pending", condition=models.Q(state="pending")),
            # Support's search by user id or request id (the admin), and the account
            # deletion's lookup of a user's pending rows: rows are never deleted.
            models.Index(fields=["user_pk"], name="erasure_ledger_user"),
            models.Index(fields=["request_id"], name="erasure_ledger_request"),
        ]

    def __str__(self) -> str:
        return f"erasure {self.id} ({self.state})"
