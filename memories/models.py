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
