"""Clients, pending authorizations, grants, codes and tokens. Codes and tokens are stored
as sha256 digests only: the database never holds a usable credential."""

from __future__ import annotations

from django.conf import settings
from django.db import models


class OAuthClient(models.Model):
    class Kind(models.TextChoices):
        DCR = "dcr"  # RFC 7591 dynamic registration; client_id is ours (uuid)
        CIMD = "cimd"  # client ID metadata document; client_id is the document's https URL

    client_id = models.CharField(max_length=512, unique=True)
    kind = models.CharField(max_length=8, choices=Kind.choices)
    client_name = models.CharField(max_length=200, blank=True)
    client_uri = models.CharField(max_length=512, blank=True)
    redirect_uris = models.JSONField(default=list)
    grant_types = models.JSONField(default=list)
    response_types = models.JSONField(default=list)
    scope = models.CharField(max_length=200, blank=True)
    token_endpoint_auth_method = models.CharField(max_length=32, default="none")  # noqa: S106
    secret_sha256 = models.CharField(max_length=64, blank=True)
    # DCR: the digest of the registered metadata (public clients with the same metadata
    # share one registration); CIMD: the digest of the fetched document.
    metadata_sha256 = models.CharField(max_length=64, blank=True, db_index=True)
    fetched_at = models.DateTimeField(null=True, blank=True)  # CIMD cache age
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["metadata_sha256"],
                condition=models.Q(kind="dcr", token_endpoint_auth_method="none"),  # noqa: S106
                name="oauth_client_public_dcr_dedupe",
            )
        ]

    def __str__(self) -> str:
        return self.client_name or self.client_id


class OAuthAuthorizationRequest(models.Model):
    """An /authorize request waiting for the user's consent (short-lived)."""

    request_key = models.CharField(max_length=64, unique=True)
    client = models.ForeignKey(OAuthClient, on_delete=models.CASCADE)
    redirect_uri = models.CharField(max_length=2048)
    redirect_uri_explicit = models.BooleanField(default=True)
    state = models.CharField(max_length=1024, blank=True)
    scopes = models.JSONField(default=list)
    code_challenge = models.CharField(max_length=128)
    resource = models.CharField(max_length=2048)
    expires_at = models.DateTimeField()
    decided_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"authorization request {self.pk}"


class OAuthGrant(models.Model):
    """What one user granted one client, for one resource: the 'connected app'."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="oauth_grants")
    client = models.ForeignKey(OAuthClient, on_delete=models.CASCADE, related_name="grants")
    scopes = models.JSONField(default=list)
    resource = models.CharField(max_length=2048)
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    revoked_reason = models.CharField(max_length=40, blank=True)

    class Meta:
        indexes = [models.Index(fields=["user", "revoked_at"])]

    def __str__(self) -> str:
        return f"grant {self.pk}"


class OAuthCode(models.Model):
    code_sha256 = models.CharField(max_length=64, unique=True)
    grant = models.ForeignKey(OAuthGrant, on_delete=models.CASCADE, related_name="codes")
    redirect_uri = models.CharField(max_length=2048)
    redirect_uri_explicit = models.BooleanField(default=True)
    code_challenge = models.CharField(max_length=128)
    expires_at = models.DateTimeField()
    used_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"code {self.pk}"


class OAuthToken(models.Model):
    class Kind(models.TextChoices):
        ACCESS = "access"
        REFRESH = "refresh"

    token_sha256 = models.CharField(max_length=64, unique=True)
    kind = models.CharField(max_length=8, choices=Kind.choices)
    grant = models.ForeignKey(OAuthGrant, on_delete=models.CASCADE, related_name="tokens")
    scopes = models.JSONField(default=list)
    expires_at = models.DateTimeField()
    used_at = models.DateTimeField(null=True, blank=True)  # a refresh token is used once (rotation)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"{self.kind} token {self.pk}"
