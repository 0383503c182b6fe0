import uuid

from django.conf import settings
from django.db import models
from django.utils import timezone

from core.choices import ALL_PERMISSIONS, Role


class EngineMessage(models.Model):
    """mem0's raw-message store: the last turns per session scope, fed back into the
    next `ingest` extraction. In Postgres so it can be purged with a user's data."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    # Both indexed in Meta, not by db_index, which adds a LIKE twin (memories 0032).
    session_scope = models.CharField(max_length=512)
    user_id = models.CharField(max_length=255, blank=True)
    role = models.CharField(max_length=32)
    content = models.TextField()
    name = models.CharField(max_length=255, null=True, blank=True)
    # Not indexed: every read orders a session's rows (engine_message_scope) by it, and
    # nothing ranges over every session's by time (memories 0036 dropped its index).
    created_at = models.DateTimeField()

    class Meta:
        # Plain indexes: `db_index` on a CharField also builds a varchar_pattern_ops twin
        # for LIKE 'prefix%', and mem0 and the purges match both columns exactly, while
        # every ingest writes its messages into all of them (memories 0032).
        indexes = [
            # A session's last turns (mem0's get_last_messages, the trim after each save).
            models.Index(fields=["session_scope"], name="engine_message_scope"),
            # A user's raw messages, purged with their data (purge_messages).
            models.Index(fields=["user_id"], name="engine_message_user"),
        ]

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
    # Issue 12: least privilege. Defaults keep the old behaviour (acts as its own user,
    # may read, write and delete, never expires).
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.USER)
    permissions = models.CharField(max_length=32, default="read,write,delete")
    expires_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [models.Index(fields=["user", "revoked_at"])]
        constraints = [
            models.CheckConstraint(condition=models.Q(role__in=Role.values), name="api_key_role_known"),
        ]

    def __str__(self) -> str:
        return f"{self.PREFIX}{self.key_id}… ({self.user})"

    @property
    def is_active(self) -> bool:
        return self.revoked_at is None and not self.is_expired

    @property
    def is_expired(self) -> bool:
        return self.expires_at is not None and self.expires_at <= timezone.now()

    @property
    def permission_set(self) -> frozenset[str]:
        return frozenset(p for p in self.permissions.split(",") if p in ALL_PERMISSIONS)


class ContentHash(models.Model):
    """SHA-256 of a remembered text's normalised form, per user: makes `remember`
    idempotent. Written in the transaction that stores the memory (claimed first, under
    the id the memory gets: `services._text_insert_claimed`)."""

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

    # No index of its own: rate_window_unique starts with the user (one index less per window).
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="rate_windows", db_index=False
    )
    # An operation, or `operation@credential` for a service credential's own limit (issue 12).
    operation = models.CharField(max_length=96)
    window_start = models.DateTimeField()
    window_seconds = models.PositiveIntegerField()
    count = models.PositiveIntegerField(default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["user", "operation", "window_seconds", "window_start"], name="rate_window_unique"
            )
        ]
        indexes = [
            # The admin's list, newest first (the admin adds the id), unfiltered and by
            # operation: a page reads its rows from an index instead of sorting the windows
            # of a minute, which every active user shares. The first also serves the prune.
            models.Index(fields=["-window_start", "-id"], name="rate_window_recent"),
            models.Index(fields=["operation", "-window_start", "-id"], name="rate_window_operation_recent"),
        ]

    def __str__(self) -> str:
        return f"{self.user_id} {self.operation} {self.window_start:%H:%M} = {self.count}"


class RateEvent(models.Model):
    """One call under a long ("per hour" or longer) limit: the log an exact sliding
    window counts, so "5 per hour" holds in any 60-minute span, not per clock hour."""

    # No index of its own: the (user, operation, at) index starts with the user.
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="rate_events", db_index=False
    )
    operation = models.CharField(max_length=96)
    at = models.DateTimeField()

    class Meta:
        indexes = [
            # A key's calls in its window (the sliding-window count, and its trim of older ones).
            models.Index(fields=["user", "operation", "at"]),
            # Every key's calls older than a cutoff, oldest first: the prune (memories 0037).
            models.Index(fields=["at"], name="rate_event_at"),
        ]

    def __str__(self) -> str:
        return f"{self.user_id} {self.operation} {self.at:%H:%M:%S}"


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


class IngestIntent(models.Model):
    """An `ingest` call in flight. mem0 commits its rows on its own connection, so the
    call is recorded (committed) before the engine call and closed, with its hashes,
    audit row and usage event, in one transaction after it. One left open by a crash is
    completed or undone by `services.ingest_intents_reconcile`."""

    class State(models.TextChoices):
        OPEN = "open"
        DONE = "done"
        UNDONE = "undone"

    # Unique through Meta.constraints, not `unique=True`, which adds a LIKE twin (memories 0032).
    request_id = models.CharField(max_length=64)
    engine_user_id = models.CharField(max_length=255)
    # What completing the call later needs: its scope and call context (no content).
    scope = models.JSONField()
    call = models.JSONField()
    detail = models.JSONField(default=dict, blank=True)
    state = models.CharField(max_length=8, choices=State.choices, default=State.OPEN)
    results = models.JSONField(default=list, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    closed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [
            # Every user's open ones by age: the reconciler's and the /metrics gauge's. Only
            # the open rows: nothing reads the closed ones by creation time (memories 0036).
            models.Index(fields=["created_at"], condition=models.Q(state="open"), name="ingest_intent_open_created"),
            # A user's open ones (calls in flight), in pk order: what an erasure or clear-all
            # marks and its undo unmarks (`ingest_intents_supersede`). Only the open rows,
            # so it stays as small as the calls in flight (memories 0033).
            models.Index(
                fields=["engine_user_id", "id"], condition=models.Q(state="open"), name="ingest_intent_user_open"
            ),
            # A user's closed ones: the erasure deletes them.
            models.Index(
                fields=["engine_user_id"], condition=~models.Q(state="open"), name="ingest_intent_user_closed"
            ),
            # Closed ones by the time they closed: `ingest_intents_prune`.
            models.Index(fields=["closed_at"], condition=~models.Q(state="open"), name="ingest_intent_closed_at"),
        ]
        constraints = [
            # One intent per call (the proxy's attempts look theirs up by request id). A
            # constraint rather than `unique=True` on the field, which also builds a
            # varchar_pattern_ops index for LIKE 'prefix%' that nothing runs on request
            # ids, at the cost of an entry per ingest call (memories 0032).
            models.UniqueConstraint(fields=["request_id"], name="ingest_intent_request_unique"),
        ]

    def __str__(self) -> str:
        return f"ingest {self.request_id} {self.state}"


class EmbedderState(models.Model):
    """Which embedder made the vectors in the engine's table (one row, pk 1) and the
    re-embedding under way, if any (issue 17, `manage.py reembed`). No row: the
    configured EMBEDDER made them. Every process reads it, so a switch needs no restart."""

    name = models.CharField(max_length=32)
    dims = models.PositiveIntegerField()
    target_name = models.CharField(max_length=32, blank=True)
    target_dims = models.PositiveIntegerField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    switched_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        target = f" -> {self.target_name}:{self.target_dims}" if self.target_name else ""
        return f"{self.name}:{self.dims}{target}"


class SessionEvent(models.Model):
    """One raw item (Responses-style message, function_call or function_call_output) of an
    agent session's event log, in order. Scoped by the engine user id, like memories;
    `project` and `session_id` narrow inside the user's log. Issue 13 (seed 002)."""

    engine_user_id = models.CharField(max_length=255)
    project = models.CharField(max_length=128, blank=True, default="")
    session_id = models.CharField(max_length=128)
    turn_id = models.CharField(max_length=128, blank=True, default="")
    item = models.JSONField()
    # sha256 of the item's role + content + metadata (the dedupe window compares it).
    item_hash = models.CharField(max_length=64)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        indexes = [
            models.Index(fields=["engine_user_id", "project", "session_id", "id"], name="session_event_order"),
            models.Index(fields=["created_at"], name="session_event_created"),
        ]

    def __str__(self) -> str:
        return f"{self.session_id} #{self.pk}"


class TurnGuard(models.Model):
    """Exactly-once `memory_after_turn` (seed 002 §7.2): one row per (user, project,
    session, turn_id). Committed as `processing` before the slow work; the commit
    transaction turns it `done` together with the turn's events and facts."""

    class State(models.TextChoices):
        PROCESSING = "processing"
        DONE = "done"

    engine_user_id = models.CharField(max_length=255)
    project = models.CharField(max_length=128, blank=True, default="")
    session_id = models.CharField(max_length=128)
    turn_id = models.CharField(max_length=128)
    state = models.CharField(max_length=16, choices=State.choices, default=State.PROCESSING)
    # The request that owns a `processing` row (a stale one is taken over by a retry).
    owner = models.CharField(max_length=64)
    fact_ids = models.JSONField(default=list, blank=True)
    # What the turn left out and shortened, so a retry answered as a duplicate says so too.
    facts_left_out = models.PositiveIntegerField(default=0)
    facts_shortened = models.PositiveIntegerField(default=0)
    # The sha256 of the turn's items (`turn_content_sha256`), never the items: the same turn
    # id sent with other items is refused, not answered as a duplicate of what is stored.
    # Empty on rows from before it was kept (their retries are duplicates, as they were).
    content_sha256 = models.CharField(max_length=64, blank=True, default="")
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["engine_user_id", "project", "session_id", "turn_id"], name="turn_guard_unique"
            )
        ]
        indexes = [models.Index(fields=["engine_user_id", "project", "session_id", "state", "updated_at"])]

    def __str__(self) -> str:
        return f"{self.session_id}/{self.turn_id} {self.state}"


class TurnPending(models.Model):
    """`memory_run_turn`'s current input, kept under the operation token it issued until
    `memory_after_turn` commits the turn with that token (seed 002 §4.5: the client then
    sends only the output). The commit moves the items into the session log and deletes
    this row in one transaction. A row is usable for `MCP_MEMORY_RUN_TURN_TOKEN_TTL_HOURS`
    after its run_turn; older ones are ignored and pruned (by run_turn and maintenance).
    Scoped like the log: another user's token finds nothing here."""

    engine_user_id = models.CharField(max_length=255)
    project = models.CharField(max_length=128, blank=True, default="")
    session_id = models.CharField(max_length=128)
    token = models.CharField(max_length=128)
    items = models.JSONField(default=list)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["engine_user_id", "project", "session_id", "token"], name="turn_pending_unique"
            )
        ]
        indexes = [models.Index(fields=["engine_user_id", "created_at"], name="turn_pending_age")]

    def __str__(self) -> str:
        return f"{self.session_id}/{self.token} pending"


class SessionState(models.Model):
    """One agent session's metadata: its summary (abstract and overview, refreshed by
    maintenance) and when it was last active (the nightly maintenance picks active ones)."""

    engine_user_id = models.CharField(max_length=255)
    project = models.CharField(max_length=128, blank=True, default="")
    session_id = models.CharField(max_length=128)
    abstract = models.TextField(blank=True, default="")
    overview = models.TextField(blank=True, default="")
    # What before_turn shows as the summary: the overview's archives and the events older
    # than its recent context window (MCP_MEMORY_RECENT_CONTEXT_ITEMS), which it replays
    # beside it; the overview (list_dir, the Sessions page) digests the latest events too.
    context_summary = models.TextField(blank=True, default="")
    summary_updated_at = models.DateTimeField(null=True, blank=True)
    last_active_at = models.DateTimeField(default=timezone.now)
    created_at = models.DateTimeField(default=timezone.now)
    # The log is sent back to a model as conversation history (the chat proxy's sessions):
    # a clear-all deletes it, or the next call would teach the cleared facts again. Set by
    # such a writer, never unset by another.
    replayed = models.BooleanField(default=False)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["engine_user_id", "project", "session_id"], name="session_state_unique")
        ]
        indexes = [
            models.Index(fields=["last_active_at"]),
            # The Sessions page: one user's sessions, most recently active first (keyset pages).
            models.Index(fields=["engine_user_id", "-last_active_at", "id"], name="session_state_recent"),
        ]

    def __str__(self) -> str:
        return f"{self.project}/{self.session_id}"


class SessionArchive(models.Model):
    """Raw session events compacted by maintenance: the items, in order, with a
    deterministic digest. Created in the transaction that deletes the raw events, so a
    killed run leaves either the events or the archive, never both or neither."""

    engine_user_id = models.CharField(max_length=255)
    project = models.CharField(max_length=128, blank=True, default="")
    session_id = models.CharField(max_length=128)
    first_event_id = models.BigIntegerField()
    last_event_id = models.BigIntegerField()
    items = models.JSONField(default=list)
    digest = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        indexes = [models.Index(fields=["engine_user_id", "project", "session_id", "first_event_id"])]

    def __str__(self) -> str:
        return f"{self.session_id} archive {self.first_event_id}-{self.last_event_id}"


class Tenant(models.Model):
    """An organisation (issue 12). Its name is the first half of every partition key
    (`{tenant}:{user}`), so it is the primary key and never changes."""

    name = models.SlugField(max_length=63, primary_key=True)
    display_name = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.name


class TenantMembership(models.Model):
    """The one tenant a user belongs to. A user without a row is in the default tenant
    (`core.scope.user_tenant`); migration 0010 gives every existing user a row there."""

    user = models.OneToOneField(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, primary_key=True, related_name="tenant_membership"
    )
    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="memberships")

    def __str__(self) -> str:
        return f"{self.tenant_id}/{self.user_id}"
