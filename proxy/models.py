"""The chat proxy's rows: per-key upstream configuration and the extraction outbox."""

from __future__ import annotations

from django.conf import settings
from django.db import models

from memories.models import ApiKey


class TokenConfig(models.Model):
    """How one API key's chat calls are forwarded (seed 004's service token config).
    Keys without a row use the deployment default (CHAT_UPSTREAM_BASE_URL/_API_KEY).
    The upstream API key is stored encrypted (proxy/crypto.py) and never shown again."""

    api_key = models.OneToOneField(ApiKey, on_delete=models.CASCADE, related_name="proxy_config")
    upstream_base_url = models.CharField(max_length=500)
    upstream_api_key_encrypted = models.TextField()
    # Added to the forwarded body when the client did not send the field (transparent JSON).
    extra_body = models.JSONField(default=dict, blank=True)
    # The extraction LLM (transparent JSON: model, base_url, ...); recorded, see README.
    memory_llm = models.JSONField(default=dict, blank=True)
    memory_prompt = models.TextField(blank=True)
    memory_limit = models.PositiveIntegerField(default=5)
    session_window_size = models.PositiveIntegerField(default=20)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.CheckConstraint(condition=models.Q(memory_limit__gt=0), name="proxy_memory_limit_positive"),
            models.CheckConstraint(condition=models.Q(session_window_size__gt=0), name="proxy_session_window_positive"),
            models.CheckConstraint(condition=~models.Q(upstream_base_url=""), name="proxy_base_url_set"),
            models.CheckConstraint(condition=~models.Q(upstream_api_key_encrypted=""), name="proxy_api_key_set"),
        ]

    def __str__(self) -> str:
        return f"proxy config of key {self.api_key_id}"


class ProxyTurn(models.Model):
    """One answered chat call waiting for memory extraction (outbox: committed with the
    call's usage event and audit row, processed by the `proxy.turn_extract` task, swept
    by `proxy.turns_sweep`, so a turn is never lost to a crash or a broker outage)."""

    class State(models.TextChoices):
        PENDING = "pending"
        DONE = "done"
        FAILED = "failed"

    # Unique through Meta.constraints, not `unique=True`, which adds a LIKE twin (proxy 0007).
    request_id = models.CharField(max_length=64)
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    tenant = models.CharField(max_length=64)
    client_app = models.CharField(max_length=200, blank=True)
    session_id = models.CharField(max_length=200)
    # Who made the chat call (a service acting for `user`, or the user): the extraction's
    # writes are recorded as theirs, as the call itself was (CallContext's actor fields).
    actor_user_id = models.BigIntegerField(null=True, blank=True)
    actor_username = models.CharField(max_length=150, blank=True, default="")
    actor_auth = models.CharField(max_length=16, blank=True, default="")
    actor_role = models.CharField(max_length=16, blank=True, default="")
    actor_credential = models.CharField(max_length=100, blank=True, default="")
    # The turn's messages, cleared once extracted (the session log keeps the turn). A turn
    # given up keeps them, for staff to re-queue, until it is pruned or the user erased.
    messages = models.JSONField(default=list, blank=True)
    state = models.CharField(max_length=16, choices=State.choices, default=State.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    last_error = models.CharField(max_length=100, blank=True)
    # Retries after a passing failure: the sweep enqueues the turn once this has passed
    # (null: due since it was created), and gives it up after a failure past `retry_until`
    # (set by its first failure; cleared when staff re-queue it).
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    retry_until = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    closed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [
            # Partial on the few rows still owed work or a person (proxy 0008): the sweep
            # (pending ones by age), the /metrics gauges and the admin's state filter never
            # walk the extracted turns, which are most of the table (that filter's "done"
            # reads proxy_turn_recent, where nearly every row matches).
            models.Index(fields=["-created_at", "-id"], condition=models.Q(state="pending"), name="proxy_turn_pending"),
            models.Index(fields=["-created_at", "-id"], condition=models.Q(state="failed"), name="proxy_turn_failed"),
            # The prune: closed turns oldest closed first, past the retention.
            models.Index(fields=["closed_at"], condition=~models.Q(state="pending"), name="proxy_turn_closed_at"),
            # The admin's unfiltered list, newest first (the admin adds the id).
            models.Index(fields=["-created_at", "-id"], name="proxy_turn_recent"),
        ]
        constraints = [
            # One turn per chat call. A constraint rather than `unique=True` on the field,
            # which also builds a varchar_pattern_ops index for LIKE 'prefix%' that nothing
            # runs on request ids, at the cost of an entry per turn (proxy 0007). The name is
            # the one PostgreSQL gave the field's UNIQUE in proxy 0001, so nothing is rebuilt.
            models.UniqueConstraint(fields=["request_id"], name="proxy_proxyturn_request_id_key"),
        ]

    def __str__(self) -> str:
        return f"turn {self.request_id} ({self.state})"
