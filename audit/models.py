import uuid

from django.contrib.postgres.indexes import GinIndex
from django.db import models
from django.utils import timezone


class MemoryHistory(models.Model):
    """Every version of every memory, written by the engine (mem0's history store,
    kept in Postgres so that all processes and hosts share it). Rows copy what they
    need and outlive the memory they describe."""

    class Event(models.TextChoices):
        ADD = "ADD"
        UPDATE = "UPDATE"
        DELETE = "DELETE"
        NONE = "NONE"
        RESTORE = "RESTORE"  # out of the trash (issue 11); a DELETE row marks moving in

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    # Looked up through (memory_id, recorded_at) below: no index of its own (audit 0021).
    memory_id = models.CharField(max_length=64)
    old_memory = models.TextField(null=True, blank=True)
    new_memory = models.TextField(null=True, blank=True)
    event = models.CharField(max_length=16, choices=Event.choices)
    created_at = models.CharField(max_length=64, null=True, blank=True)
    updated_at = models.CharField(max_length=64, null=True, blank=True)
    is_deleted = models.BooleanField(default=False)
    actor_id = models.CharField(max_length=255, null=True, blank=True)
    role = models.CharField(max_length=32, null=True, blank=True)
    recorded_at = models.DateTimeField(auto_now_add=True)
    # Who caused this version (the engine does not know; the service tells the store).
    # Indexed in Meta (history_request), not by db_index, which adds a LIKE twin (audit 0023).
    request_id = models.CharField(max_length=64, blank=True)
    changed_by = models.CharField(max_length=300, blank=True)
    # Whose memory this version is of (the engine's partition key, "tenant:user pk"), so
    # that erasing a user finds every version by owner, also of memories long deleted
    # whose audit rows retention has removed. Writers need not know it: a database
    # trigger (migration 0013) fills it on insert from the engine row or the memory's
    # earlier versions. "" = unknown (rows that predate it and could not be attributed).
    engine_user_id = models.CharField(max_length=255, blank=True, db_default="")

    class Meta:
        verbose_name_plural = "memory history"
        indexes = [
            models.Index(fields=["memory_id", "recorded_at"]),
            models.Index(fields=["engine_user_id"], name="history_owner", condition=~models.Q(engine_user_id="")),
            # The admin's list, newest first (the admin adds the id), unfiltered and by
            # event: a page reads its rows from an index instead of sorting every version.
            models.Index(fields=["-recorded_at", "-id"], name="history_recent"),
            models.Index(fields=["event", "-recorded_at", "-id"], name="history_event_recent"),
            # A call's versions (ingest's reconcile, the admin's search by request id).
            models.Index(fields=["request_id"], name="history_request"),
        ]

    def __str__(self) -> str:
        return f"{self.event} {self.memory_id}"


# Rows whose actor is not their subject (a service or tenant admin acting for a user; no
# subject at all). NULL-safe: Django negates the equality with IS NOT NULL checks. The
# admin's search by user id repeats this condition so that the planner can use the
# partial index built on it.
ACTED_FOR_ANOTHER = ~models.Q(actor_user_id=models.F("subject_user_id"))


class AuditEvent(models.Model):
    """One row per call that reads or changes memories (MCP, REST, UI, admin), success or
    not. Append-only: database triggers refuse UPDATE, DELETE and TRUNCATE except for the
    retention job. Actor and scope are copied, so rows outlive users and memories."""

    class Outcome(models.TextChoices):
        OK = "ok"
        ERROR = "error"
        DENIED = "denied"  # e.g. another user's memory id (answered as not_found)

    class TurnEvent(models.TextChoices):
        WRITE = "memory_write"
        RECALL = "memory_recall"
        FORGET = "memory_forget"

    id = models.BigAutoField(primary_key=True)
    occurred_at = models.DateTimeField(default=timezone.now)
    # Indexed in Meta (audit_request), not by db_index, which adds a LIKE twin (audit 0023).
    request_id = models.CharField(max_length=64)
    channel = models.CharField(max_length=16)
    operation = models.CharField(max_length=40)
    outcome = models.CharField(max_length=8, choices=Outcome.choices)
    error_code = models.CharField(max_length=40, blank=True)
    actor_user_id = models.BigIntegerField(null=True, blank=True)
    actor_username = models.CharField(max_length=150, blank=True)
    actor_auth = models.CharField(max_length=16, blank=True)
    actor_client_app = models.CharField(max_length=200, blank=True)
    # Which of the actor's credentials made the call: "key:<key id>" (two keys may share a
    # name), "oidc:<client>"; empty for web sessions, staff and operators.
    actor_credential = models.CharField(max_length=100, blank=True, default="")
    # Issue 12: the actor's role (user, tenant_admin, platform). actor_user_id differs from
    # subject_user_id when a service acted for the subject.
    actor_role = models.CharField(max_length=16, blank=True)
    staff_user_id = models.BigIntegerField(null=True, blank=True)
    staff_username = models.CharField(max_length=150, blank=True)
    tenant = models.CharField(max_length=64, blank=True)
    subject_user_id = models.BigIntegerField(null=True, blank=True)
    memory_ids = models.JSONField(default=list, blank=True)
    before = models.JSONField(null=True, blank=True)
    after = models.JSONField(null=True, blank=True)
    detail = models.JSONField(default=dict, blank=True)
    duration_ms = models.FloatField(null=True, blank=True)
    ip = models.GenericIPAddressField(null=True, blank=True)
    user_agent = models.CharField(max_length=300, blank=True)
    turn_id = models.CharField(max_length=128, blank=True)
    turn_event = models.CharField(max_length=16, choices=TurnEvent.choices, blank=True)

    class Meta:
        indexes = [
            models.Index(fields=["subject_user_id", "-id"], name="audit_subject_recent"),
            models.Index(fields=["operation", "-id"], name="audit_operation_recent"),
            models.Index(fields=["outcome", "-id"], name="audit_outcome_recent"),
            models.Index(fields=["occurred_at"], name="audit_occurred_at"),
            models.Index(fields=["turn_id", "id"], name="audit_turn", condition=~models.Q(turn_id="")),
            # The admin's search by user id or username and its actor/staff links: without
            # these, "subject or actor is user 7" and a username scan the whole table.
            # Most rows are a user acting on their own memories, which audit_subject_recent
            # already finds by id: only rows where the actor is someone else (a delegated
            # role) need an index by actor id, which keeps it off most inserts.
            models.Index(fields=["actor_user_id", "-id"], name="audit_actor_recent", condition=ACTED_FOR_ANOTHER),
            models.Index(fields=["actor_username", "-id"], name="audit_actor_name_recent"),
            # Staff act on few rows: index only those.
            models.Index(
                fields=["staff_user_id", "-id"],
                name="audit_staff_recent",
                condition=models.Q(staff_user_id__isnull=False),
            ),
            models.Index(
                fields=["staff_username", "-id"], name="audit_staff_name_recent", condition=~models.Q(staff_username="")
            ),
            # One credential's calls, newest first (the admin's `key:<id>` search: a leaked
            # key's). Rows without one (the web UI, jobs) stay out of it.
            models.Index(
                fields=["actor_credential", "-id"],
                name="audit_credential_recent",
                condition=~models.Q(actor_credential=""),
            ),
            GinIndex(fields=["memory_ids"], name="audit_memory_ids"),
            # A call's rows (the admin's search by request id, a turn's lifecycle, erasure).
            # A plain index: `db_index` on a CharField also builds a varchar_pattern_ops
            # twin for LIKE 'prefix%', which nothing runs on request ids, at the cost of
            # an entry per audited call (audit 0023).
            models.Index(fields=["request_id"], name="audit_request"),
        ]

    def __str__(self) -> str:
        return f"#{self.id} {self.operation} {self.outcome}"


class AuditExportBatch(models.Model):
    """One exported object (gzipped JSONL) plus its manifest. The highest `last_id` is
    the export watermark: the next run starts after it."""

    first_id = models.BigIntegerField()
    last_id = models.BigIntegerField(unique=True)
    row_count = models.PositiveIntegerField()
    sha256 = models.CharField(max_length=64)
    object_key = models.CharField(max_length=300)
    manifest_key = models.CharField(max_length=300)
    exported_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"{self.first_id}-{self.last_id} ({self.row_count} rows)"


class AuthFailureWindow(models.Model):
    """Unauthenticated requests (401s) from one client address in one minute, counted
    atomically (INSERT ... ON CONFLICT DO UPDATE): brute force shows up here and in one
    sampled audit row per window, without a row per attempt."""

    ip = models.CharField(max_length=45, blank=True)  # "" when the address is unknown
    window_start = models.DateTimeField()
    count = models.PositiveIntegerField(default=0)
    first_channel = models.CharField(max_length=16, blank=True)
    last_seen_at = models.DateTimeField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["ip", "window_start"], name="auth_failure_window_unique")]
        indexes = [models.Index(fields=["window_start"], name="auth_failure_window_start")]

    def __str__(self) -> str:
        return f"{self.ip or '?'} {self.window_start:%Y-%m-%d %H:%M} = {self.count}"


class LoginFailure(models.Model):
    """A failed sign-in with a password (web or admin login form), or one whose password is
    being checked, once under each key it counts against: `user:<keyed digest of the
    username>` and `ip:<client address, an IPv6 client's /64>`. The login throttle
    counts a key's rows over the last LOGIN_FAILURE_WINDOW_S (a sliding window); older
    rows are pruned. Only a digest of the username: what was typed there may be a
    password typed into the wrong box."""

    key = models.CharField(max_length=80)
    at = models.DateTimeField()

    class Meta:
        indexes = [
            # A key's failures in the window (the throttle's count, and its trim of older ones).
            models.Index(fields=["key", "at"], name="login_failure_key_at"),
            # Every key's failures out of the window, oldest first: the prune (audit 0024).
            models.Index(fields=["at"], name="login_failure_at"),
        ]

    def __str__(self) -> str:
        return f"{self.key} {self.at:%Y-%m-%d %H:%M:%S}"


class SubjectKey(models.Model):
    """A user's data key (issue 14, crypto-shredding): the content snapshots of their
    audit rows (`before`/`after`) are sealed with it, AES-256-GCM. The key is stored
    wrapped by the deployment's master key (`AUDIT_MASTER_KEY`). Erasing the user deletes
    this row, so every sealed snapshot (and every audit export made earlier) can no
    longer be decrypted, while the rows themselves (actor, time, operation, ids) stay.
    Not append-only, unlike the audit tables: deleting it is what erasure means."""

    subject_user_id = models.BigIntegerField(unique=True)
    wrapped = models.BinaryField()
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"data key #{self.pk} of user {self.subject_user_id}"
