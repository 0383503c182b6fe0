import uuid

from django.conf import settings
from django.db import models


class EngineMessage(models.Model):
    """mem0's raw-message store: the last turns per session scope, fed back into the
    next `ingest` extraction. In Postgres so it can be purged with a user's data."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    session_scope = models.CharField(max_length=512, db_index=True)
    user_id = models.CharField(max_length=255, db_index=True, blank=True)
    role = models.CharField(max_length=32)
    content = models.TextField()
    name = models.CharField(max_length=255, null=True, blank=True)
    created_at = models.DateTimeField(db_index=True)

    def __str__(self) -> str:
        return f"{self.session_scope} {self.role}"


class ApiKey(models.Model):
    """A per-user bearer key for agents. Only a SHA-256 of the secret is stored; the
    plain key is shown once, when issued."""

    PREFIX = "msk_"

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=100, blank=True)
    # Public, unique lookup part of the key (shown in UIs to tell keys apart).
    key_id = models.CharField(max_length=16, unique=True)
    secret_hash = models.CharField(max_length=64)
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [models.Index(fields=["user", "revoked_at"])]

    def __str__(self) -> str:
        return f"{self.PREFIX}{self.key_id}… ({self.user})"

    @property
    def is_active(self) -> bool:
        return self.revoked_at is None


class ContentHash(models.Model):
    """SHA-256 of a remembered text's normalised form, per user: makes `remember`
    idempotent. Written only after the engine stored the memory."""

    engine_user_id = models.CharField(max_length=255)
    sha256 = models.CharField(max_length=64)
    memory_id = models.UUIDField(db_index=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["engine_user_id", "sha256"], name="content_hash_unique_per_user")
        ]

    def __str__(self) -> str:
        return f"{self.engine_user_id} {self.sha256[:12]}"


class RateWindow(models.Model):
    """Calls of one operation by one user in one fixed window, counted atomically
    (INSERT ... ON CONFLICT DO UPDATE), so limits hold across processes and hosts."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="rate_windows")
    operation = models.CharField(max_length=32)
    window_start = models.DateTimeField()
    window_seconds = models.PositiveIntegerField()
    count = models.PositiveIntegerField(default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["user", "operation", "window_seconds", "window_start"], name="rate_window_unique"
            )
        ]
        indexes = [models.Index(fields=["window_start"])]

    def __str__(self) -> str:
        return f"{self.user_id} {self.operation} {self.window_start:%H:%M} = {self.count}"


class ExternalIdentity(models.Model):
    """An OIDC subject (`iss` + `sub`) mapped to a local user, created on first sight."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="external_identities")
    issuer = models.CharField(max_length=255)
    subject = models.CharField(max_length=255)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["issuer", "subject"], name="external_identity_unique")]

    def __str__(self) -> str:
        return f"{self.issuer} {self.subject}"


class EngineMemoryRow(models.Model):
    """Read-only view of the engine's pgvector table (created by migration 0002). The
    engine writes it; we read it for paging, admin and the UI."""

    id = models.UUIDField(primary_key=True)
    payload = models.JSONField()

    class Meta:
        managed = False
        db_table = settings.MEMORY_COLLECTION

    def __str__(self) -> str:
        return str(self.id)


class JobWatermark(models.Model):
    """How far a background job has read an append-only stream (e.g. the recall
    counters fold audit rows up to `position`), so each row is counted exactly once."""

    name = models.CharField(max_length=64, primary_key=True)
    position = models.BigIntegerField(default=0)
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"{self.name} @ {self.position}"
