"""The toolkit's own tables: the semantic cache and keyed decisions (seed 003)."""

from __future__ import annotations

import uuid

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import models
from pgvector.django import VectorField


class CacheEntry(models.Model):
    """A cached query/response pair. The query's embedding is a pgvector column without a
    fixed dimension (the embedder decides it); lookups are an exact scan of one user's
    live rows, at most CACHE_MAX_ENTRIES_PER_USER (store_cache evicts beyond it).
    `embedder` names the embedder that made the embedding
    (`EmbedderSpec.label`, e.g. "local:384"): after a switch (`manage.py reembed`, which
    leaves cache rows alone) only rows of the active one are compared, as vectors of two
    models are not comparable (nor, with other dimensions, computable). Empty: unknown
    (rows from before it was recorded), never a hit."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    # No index of its own: cache_user_expires and cache_user_recent start with the user.
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+", db_index=False)
    query = models.TextField()
    response = models.TextField()
    embedding = VectorField()
    embedder = models.CharField(max_length=64, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(db_index=True)

    class Meta:
        indexes = [
            models.Index(fields=["user", "expires_at"], name="cache_user_expires"),
            # The Cached answers page: one user's answers, newest first (keyset pages).
            models.Index(fields=["user", "-created_at", "id"], name="cache_user_recent"),
        ]

    def __str__(self) -> str:
        return f"cache {self.id}"


class Decision(models.Model):
    """A keyed decision (preference, choice, sticky setting), one per (user, key)."""

    # No index of its own: decision_unique_user_key starts with the user.
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+", db_index=False)
    key = models.CharField(max_length=128)
    value = models.TextField()
    created_at = models.DateTimeField()
    updated_at = models.DateTimeField()
    expires_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["user", "key"], name="decision_unique_user_key")]
        indexes = [
            # Every user's expired decisions: the purge (toolkit 0006). Partial: a decision
            # stored without ttl_days never expires and is not in it.
            models.Index(fields=["expires_at"], condition=models.Q(expires_at__isnull=False), name="decision_expires"),
        ]

    def __str__(self) -> str:
        # Not the key: it is what the user stored, and the admin names objects by this.
        return f"decision {self.pk}"


class ErasureSubject(get_user_model()):  # type: ignore[misc]
    """Users as support sees them when handling an erasure request (the admin's
    "erase all data" action); a proxy, no table of its own."""

    class Meta:
        proxy = True
        verbose_name = "erasure request"
        verbose_name_plural = "erasure requests"
        permissions = [("erase_user_data", "Can erase all data of a user")]
