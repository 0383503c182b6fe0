"""Writes to the audit trail. Rows copy everything they need (actor, scope, content)."""

from __future__ import annotations

import hashlib
import ipaddress
import math
import time
import unicodedata
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import connection, transaction
from django.db.models import Q
from django.utils import timezone
from django.utils.crypto import salted_hmac

from audit.crypto import Sealer
from audit.models import AuditEvent, AuthFailureWindow, LoginFailure, MemoryHistory
from core.batched import rows_delete_in_batches
from core.calls import call_context_from_request
from core.choices import Channel, Operation
from core.errors import ErrorCode, ServiceError
from core.metrics import rate_limit_rejection_record
from core.scope import DEFAULT_TENANT, MemoryScope

if TYPE_CHECKING:
    from core.scope import CallContext

TURN_EVENTS: dict[str, str] = {
    Operation.REMEMBER: AuditEvent.TurnEvent.WRITE,
    Operation.INGEST: AuditEvent.TurnEvent.WRITE,
    Operation.UPDATE_MEMORY: AuditEvent.TurnEvent.WRITE,
    Operation.SEARCH_MEMORY: AuditEvent.TurnEvent.RECALL,
    Operation.LIST_MEMORY: AuditEvent.TurnEvent.RECALL,
    Operation.DELETE_MEMORY: AuditEvent.TurnEvent.FORGET,
    Operation.CLEAR_ALL_MEMORY: AuditEvent.TurnEvent.FORGET,
    Operation.RESTORE_MEMORY: AuditEvent.TurnEvent.WRITE,
    Operation.PURGE_MEMORY: AuditEvent.TurnEvent.FORGET,
    # Seed 003's toolkit: its searches are recalls, its stores writes (seed 001's events).
    Operation.RECALL_MEMORY: AuditEvent.TurnEvent.RECALL,
    Operation.HYBRID_SEARCH: AuditEvent.TurnEvent.RECALL,
    Operation.CHECK_CACHE: AuditEvent.TurnEvent.RECALL,
    Operation.RECALL_DECISION: AuditEvent.TurnEvent.RECALL,
    Operation.STORE_MEMORY: AuditEvent.TurnEvent.WRITE,
    # An agent's cached answers and decisions are what it keeps about the user too.
    Operation.STORE_CACHE: AuditEvent.TurnEvent.WRITE,
    Operation.STORE_DECISION: AuditEvent.TurnEvent.WRITE,
    Operation.CACHE_INVALIDATE: AuditEvent.TurnEvent.FORGET,
    Operation.DELETE_DECISION: AuditEvent.TurnEvent.FORGET,
    Operation.DELETE_CACHE_ENTRY: AuditEvent.TurnEvent.FORGET,
}
# The ids one audit row lists; a call that touched more says how many it left out.
MAX_MEMORY_IDS = 10_000


def audit_text(text: str | None) -> Any:
    """Content as it may appear in an audit row: verbatim, or hash + length when
    AUDIT_REDACT_CONTENT is on."""
    if text is None or not settings.AUDIT_REDACT_CONTENT:
        return text
    return {"sha256": hashlib.sha256(text.encode()).hexdigest(), "length": len(text)}


def audit_snapshot(*, memory: str, pinned: bool, metadata: dict[str, Any]) -> dict[str, Any]:
    return {"memory": audit_text(memory), "pinned": pinned, "metadata": metadata}


def audit_record(
    scope: MemoryScope | None,
    *,
    call: CallContext,
    operation: str,
    outcome: str = AuditEvent.Outcome.OK,
    error_code: str = "",
    memory_ids: list[str] | tuple[str, ...] = (),
    before: Any = None,
    after: Any = None,
    detail: dict[str, Any] | None = None,
) -> AuditEvent:
    """One audit row. Inside the transaction of the change it records, if there is one.
    The actor is the authenticated principal (`call.actor_user_id`: a service acting for
    the scope's user, issue 12), the subject the scope's user."""
    if call.actor_user_id is not None and not call.staff_username:
        actor_user_id: int | None = call.actor_user_id
    else:
        actor_user_id = scope.user_pk if scope and not call.staff_username else None
    if call.subject:
        detail = {**(detail or {}), "subject_claim": call.subject}
    if len(memory_ids) > MAX_MEMORY_IDS:
        # The row keeps the first MAX_MEMORY_IDS ids (a bounded row); it says how many more
        # the call touched, so a reader never takes the list for all of them.
        detail = {**(detail or {}), "memory_ids_omitted": len(memory_ids) - MAX_MEMORY_IDS}
    detail = detail or {}
    if scope is not None:
        # Content is sealed with the subject's data key (crypto-shredding, issue 14):
        # the snapshots, and the detail keys that can hold what the user said or stored.
        sealer = Sealer(scope.user_pk)
        before, after = sealer.seal(before), sealer.seal(after)
        detail = sealer.seal_detail(detail)
    return AuditEvent.objects.create(
        request_id=call.request_id,
        channel=call.channel,
        operation=operation,
        outcome=outcome,
        error_code=error_code,
        actor_user_id=actor_user_id,
        actor_username=call.actor_username,
        actor_auth=call.actor_auth,
        actor_role=call.actor_role,
        actor_client_app=(scope.client_app or "") if scope else "",
        actor_credential=call.actor_credential[:100],
        staff_user_id=call.staff_user_id,
        staff_username=call.staff_username,
        tenant=scope.tenant if scope else "",
        subject_user_id=scope.user_pk if scope else None,
        memory_ids=[str(m) for m in memory_ids][:MAX_MEMORY_IDS],
        before=before,
        after=after,
        detail=detail,
        duration_ms=round((time.monotonic() - call.started_at) * 1000, 2),
        ip=call.ip or None,
        user_agent=(call.user_agent or "")[:300],
        turn_id=call.turn_id[:128],
        turn_event=_turn_event(operation, call=call, outcome=outcome, detail=detail),
    )


def _turn_event(operation: str, *, call: CallContext, outcome: str, detail: dict[str, Any]) -> str:
    """A refused or failed call keeps its turn id (the row stays grouped with the turn)
    but is no memory_write/recall/forget: nothing was written, recalled or forgotten.
    Nor is a dry run (a bulk or toolkit delete that only counts what it would delete)."""
    if not call.turn_id or outcome != AuditEvent.Outcome.OK or detail.get("dry_run") is True:
        return ""
    return TURN_EVENTS.get(operation, "")


def audit_failure(
    scope: MemoryScope | None, *, call: CallContext, operation: str, error: ServiceError, memory_id: Any = None
) -> AuditEvent:
    outcome = AuditEvent.Outcome.DENIED if error.denied else AuditEvent.Outcome.ERROR
    memory_ids = [str(memory_id)[:64]] if isinstance(memory_id, str) and memory_id else []
    return audit_record(
        scope,
        call=call,
        operation=operation,
        outcome=outcome,
        error_code=error.code.value,
        memory_ids=memory_ids,
        detail={"message": error.message},
    )


def audit_staff_action(
    request,
    *,
    operation: str,
    subject_user_id: int | None = None,
    memory_ids: list[str] | tuple[str, ...] = (),
    detail: dict[str, Any] | None = None,
    tenant: str = DEFAULT_TENANT,
) -> AuditEvent:
    """Staff actions in the admin are audited like any other call. Call it inside the
    transaction of the change it records. `tenant`: the subject's (their Activity page
    lists the rows of their tenant); the caller knows it, audit cannot look it up."""
    call = call_context_from_request(request, channel=Channel.ADMIN, staff=True)
    scope = MemoryScope(tenant=tenant, user_pk=subject_user_id) if subject_user_id is not None else None
    return audit_record(scope, call=call, operation=operation, memory_ids=memory_ids, detail=detail)


AUTH_FAILURE_WINDOW_S = 60
_AUTH_FAILURE_UPSERT = f"""
INSERT INTO {AuthFailureWindow._meta.db_table} (ip, window_start, count, first_channel, last_seen_at)
VALUES (%s, %s, 1, %s, %s)
ON CONFLICT (ip, window_start)
DO UPDATE SET count = {AuthFailureWindow._meta.db_table}.count + 1, last_seen_at = EXCLUDED.last_seen_at
RETURNING count
"""  # noqa: S608 - table name from our own model


def auth_failure_record(
    *, call: CallContext, credential_presented: bool, error_code: str = ErrorCode.UNAUTHENTICATED
) -> int:
    """Count one unauthenticated request (a 401, a failed or refused sign-in) per client
    address and minute; the first of each window also leaves one audit row (outcome
    denied, operation `authenticate`). Returns the window's count so far: the hook for a
    metric."""
    now = timezone.now()
    window_start = now.replace(second=0, microsecond=0)
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(_AUTH_FAILURE_UPSERT, [(call.ip or "")[:45], window_start, call.channel, now])
            count = int(cursor.fetchone()[0])
        if count == 1:
            audit_record(
                None,
                call=call,
                operation=Operation.AUTHENTICATE,
                outcome=AuditEvent.Outcome.DENIED,
                error_code=error_code,
                detail={"credential_presented": credential_presented, "sampled": "first failure per ip per minute"},
            )
    return count


# Rows deleted per statement by the two prunes below: a flood of failed calls or
# sign-ins (a row per address per minute, a row per failure) must not make one long one.
AUTH_FAILURE_PRUNE_BATCH = 5000


def auth_failure_windows_prune(*, older_than_days: int = 30) -> int:
    """Failure windows older than `older_than_days`, oldest first from their index, in
    batches; then the login throttle's aged-out failures."""
    cutoff = timezone.now() - timedelta(days=older_than_days)
    windows = AuthFailureWindow.objects.filter(window_start__lt=cutoff)
    deleted = rows_delete_in_batches(windows, order_by="window_start", batch_size=AUTH_FAILURE_PRUNE_BATCH)
    return deleted + login_failures_prune()


# --- The login throttle (web and admin sign-in forms) -----------------------------------------
LOGIN_KEY_SALT = "memsite.audit.login_failures"


@dataclass(frozen=True)
class LoginAttempt:
    """A sign-in let through to its password check: its place under each throttle key
    (LoginFailure rows, kept as its failure or deleted when it succeeds), and the limits
    its failure brings to their end (audited when it fails)."""

    failure_ids: tuple[int, ...]
    fills: tuple[str, ...]


def login_attempt_begin(*, call: CallContext, username: str) -> LoginAttempt:
    """Admit one sign-in with a password before the password is checked, or refuse it
    (`rate_limited`, with retry_after_s) while the username (LOGIN_FAILURES_PER_USERNAME)
    or the client address (LOGIN_FAILURES_PER_ADDRESS) has had that many failed sign-ins in
    the last LOGIN_FAILURE_WINDOW_S. A refused attempt never checks a password, so
    guessing stops; the same for every username, existing or not, so the answer says
    nothing about accounts. An admitted attempt counts as a failure from the start (a row
    per key, written under each key's advisory lock): concurrent guesses cannot overrun a
    limit while their passwords are being checked. A refusal is counted like a 401
    (AuthFailureWindow, its sampled audit row under `rate_limited`)."""
    window = settings.LOGIN_FAILURE_WINDOW_S
    keys = _login_throttle_keys(username=username, ip=call.ip)
    now = timezone.now()
    since = now - timedelta(seconds=window)
    retry_after: float | None = None
    fills: list[str] = []
    rows: list[LoginFailure] = []
    with transaction.atomic():
        with connection.cursor() as cursor:
            for key in sorted(key for _, key, _ in keys):  # one lock order: never a deadlock
                cursor.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", [f"login:{key}"])
        for kind, key, limit in keys:
            failures = LoginFailure.objects.filter(key=key)
            failures.filter(at__lte=since).delete()  # aged out: a key keeps at most `limit` rows
            counted = failures.count()
            if counted >= limit:
                # A place frees up when the limit-th newest failure ages out of the window.
                oldest_counted = failures.order_by("-at").values_list("at", flat=True)[limit - 1]
                retry_after = max(retry_after or 0.0, (oldest_counted - since).total_seconds())
            elif counted + 1 == limit:
                fills.append(kind)
        if retry_after is None:
            rows = LoginFailure.objects.bulk_create([LoginFailure(key=key, at=now) for _, key, _ in keys])
    if retry_after is not None:
        _login_refusal_record(call=_login_call(call, username=username))
        seconds = max(1, math.ceil(retry_after))
        raise ServiceError(
            ErrorCode.RATE_LIMITED,
            f"Too many failed sign-ins. Try again in {_minutes(seconds)}.",
            retry_after_s=seconds,
        )
    return LoginAttempt(failure_ids=tuple(row.pk for row in rows), fills=tuple(fills))


def login_attempt_failed(attempt: LoginAttempt, *, call: CallContext, username: str) -> None:
    """A wrong username or password (or an account that may not sign in here): its rows
    stay as the failure. Counted like a 401 (AuthFailureWindow, the sampled audit row);
    a failure that brings a limit to its end also leaves its own audit row, so staff can
    tell why an account or address cannot sign in. Rows name the account tried only when
    it exists (actor_username, as actors are recorded); never what was typed otherwise,
    never a password."""
    call = _login_call(call, username=username)
    auth_failure_record(call=call, credential_presented=True)
    if attempt.fills:
        with transaction.atomic():
            audit_record(
                None,
                call=call,
                operation=Operation.AUTHENTICATE,
                outcome=AuditEvent.Outcome.DENIED,
                error_code=ErrorCode.UNAUTHENTICATED,
                detail={
                    "login_throttled": list(attempt.fills),
                    "window_s": settings.LOGIN_FAILURE_WINDOW_S,
                },
            )


def login_attempt_succeeded(attempt: LoginAttempt) -> None:
    """The password was right: the attempt is no failure. Earlier failures keep counting
    (a success resets nothing: per address, an attacker signing in to an account of their
    own would otherwise lift the limit on guessing everyone else's)."""
    LoginFailure.objects.filter(pk__in=attempt.failure_ids).delete()


def login_failures_prune() -> int:
    """Failures out of the throttle's window, in batches, oldest first from
    login_failure_at (not in id order: the last batch would read every failure in the
    window to find none)."""
    cutoff = timezone.now() - timedelta(seconds=settings.LOGIN_FAILURE_WINDOW_S)
    aged_out = LoginFailure.objects.filter(at__lte=cutoff)
    return rows_delete_in_batches(aged_out, order_by="at", batch_size=AUTH_FAILURE_PRUNE_BATCH)


def _login_throttle_keys(*, username: str, ip: str | None) -> list[tuple[str, str, int]]:
    """(kind, key, limit) of each limit a sign-in counts against. The username as a keyed
    digest of its case-folded form (the row never holds what was typed; "Alice" and
    "alice" share a limit); the address as given, an IPv6 client by its /64 (one client's
    usual allocation, which it could otherwise walk through)."""
    digest = salted_hmac(LOGIN_KEY_SALT, unicodedata.normalize("NFKC", username).casefold()).hexdigest()
    return [
        ("username", f"user:{digest}", settings.LOGIN_FAILURES_PER_USERNAME),
        ("address", f"ip:{_address_key(ip)}", settings.LOGIN_FAILURES_PER_ADDRESS),
    ]


def _address_key(ip: str | None) -> str:
    try:
        address = ipaddress.ip_address(ip or "")
    except ValueError:
        return "?"  # unknown: such clients share one limit
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is None:
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(getattr(address, "ipv4_mapped", None) or address)


def _login_call(call: CallContext, *, username: str) -> CallContext:
    """The call as its audit rows record it: the account tried as the actor's username,
    only if one of that name exists (an unknown name may be a password typed into the
    wrong box); never authenticated, so no actor id."""
    user_model = get_user_model()
    account = (
        user_model._default_manager.filter(**{user_model.USERNAME_FIELD: username})
        .values_list(user_model.USERNAME_FIELD, flat=True)
        .first()
    )
    return replace(call, actor_username=str(account or ""))


def _login_refusal_record(*, call: CallContext) -> None:
    rate_limit_rejection_record(operation=Operation.AUTHENTICATE)
    auth_failure_record(call=call, credential_presented=True, error_code=ErrorCode.RATE_LIMITED)


def _minutes(seconds: int) -> str:
    minutes = math.ceil(seconds / 60)
    return "1 minute" if minutes == 1 else f"{minutes} minutes"


# Issue 13: the turn lifecycle's calls are turn events too.
TURN_EVENTS.update(
    {
        Operation.MEMORY_BEFORE_TURN: AuditEvent.TurnEvent.RECALL,
        Operation.MEMORY_AFTER_TURN: AuditEvent.TurnEvent.WRITE,
        Operation.MEMORY_RUN_TURN: AuditEvent.TurnEvent.RECALL,
        Operation.MEMORY_PREFETCH: AuditEvent.TurnEvent.RECALL,
    }
)


def subject_content_erase(*, subject_user_id: int, engine_user_id: str, memory_ids: list[str]) -> dict[str, int]:
    """Erasure of a user (issue 14), in the caller's transaction:
    - destroys the user's data key, so the content snapshots of their audit rows (and of
      every audit export already made) can no longer be decrypted; the rows stay, with
      actor, time, operation and ids;
    - deletes the version history of their memories, which holds memory texts: every row
      the user owns (`engine_user_id`, their engine partition), which also finds memories
      deleted long ago whose audit rows retention has removed; plus rows of unknown owner
      (written before owners were recorded) among the given ids or the ids the user's
      successful calls name (and no other user's do). Never by ids from failed or denied
      calls (anyone's id can be tried and is recorded as given), never a row another user
      owns.
    The history table is append-only; an erasure is, with retention, the one sanctioned
    delete, and it is itself audited by the caller."""
    from audit.crypto import subject_key_destroy

    sealed = (
        AuditEvent.objects.filter(subject_user_id=subject_user_id)
        .filter(Q(before__isnull=False) | Q(after__isnull=False) | Q(detail__has_key="content"))
        .count()
    )
    keys = subject_key_destroy(subject_user_id)
    history_table, audit_table = MemoryHistory._meta.db_table, AuditEvent._meta.db_table
    ok = AuditEvent.Outcome.OK.value
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL memsite.audit_retention = 'on'")
        try:
            # Never loaded into Python. By owner (the `history_owner` index), then the
            # unowned rows among the trusted ids (the (memory_id, recorded_at) index). An
            # unowned row that another user's successful calls name too is left alone:
            # never guess. Only versions of memories that no longer exist (the trigger
            # refuses others): one mem0 stored for the user meanwhile keeps its history
            # until the ingest's completion deletes it and blanks that (see
            # `ingest_intents_supersede`).
            cursor.execute(
                f'DELETE FROM "{history_table}" WHERE engine_user_id = %s'  # noqa: S608
                " AND NOT memsite_memory_live(memory_id)",
                [engine_user_id],
            )
            history = cursor.rowcount
            cursor.execute(
                f"DELETE FROM \"{history_table}\" WHERE engine_user_id = '' AND NOT memsite_memory_live(memory_id)"  # noqa: S608
                " AND memory_id IN ("
                " SELECT unnest(%s::text[]) UNION ALL SELECT ids.id"
                f' FROM "{audit_table}" e, jsonb_array_elements_text(e.memory_ids) AS ids(id)'
                " WHERE e.subject_user_id = %s AND e.outcome = %s AND NOT EXISTS ("
                f'  SELECT 1 FROM "{audit_table}" o WHERE o.memory_ids @> jsonb_build_array(ids.id)'
                "  AND o.outcome = %s AND o.subject_user_id <> %s))",
                [list(memory_ids), subject_user_id, ok, ok, subject_user_id],
            )
            history += cursor.rowcount
        finally:
            cursor.execute("SET LOCAL memsite.audit_retention = 'off'")
    return {"audit_rows_shredded": sealed if keys else 0, "history_rows_deleted": history}


def history_content_erase(*, engine_user_id: str, memory_ids: list[str]) -> int:
    """A memory deleted for good (purge, the purge job) keeps its history as a record of
    what happened (events, times, who) but not what it said: the texts of its versions
    are blanked, in the caller's transaction. Only rows of the given owner (or of unknown
    owner: the caller has just deleted the memory from that owner's partition). The
    history's append-only trigger lets exactly this change through while
    `memsite.history_redact` is on. Returns how many rows were blanked."""
    if not memory_ids:
        return 0
    history_table = MemoryHistory._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL memsite.history_redact = 'on'")
        try:
            cursor.execute(
                f'UPDATE "{history_table}" SET old_memory = NULL, new_memory = NULL'  # noqa: S608
                " WHERE memory_id = ANY(%s) AND engine_user_id IN (%s, '')"
                " AND (old_memory IS NOT NULL OR new_memory IS NOT NULL) AND NOT memsite_memory_live(memory_id)",
                [list(memory_ids), engine_user_id],
            )
            blanked = cursor.rowcount
        finally:
            cursor.execute("SET LOCAL memsite.history_redact = 'off'")
    return blanked
