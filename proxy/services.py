"""The chat proxy's writes: token configurations (validated, secret encrypted), the
per-call record (rate limit, usage event, audit row, session turn, extraction outbox)
and the extraction itself. Keyword-only; scope first."""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import random
import threading
import uuid
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlsplit

import httpx
from django.conf import settings
from django.db import models, transaction
from django.db.models import Q
from django.utils import timezone

from audit.models import AuditEvent
from audit.services import audit_failure, audit_record, auth_failure_record
from billing.services import usage_event_record
from core.batched import rows_delete_in_batches
from core.choices import Channel, Operation, Permission
from core.errors import ErrorCode, ServiceError
from core.inputs import InputError, json_value_check, text_problem
from core.netaddr import address_is_public
from core.scope import CallContext, MemoryScope
from memories.auth import Principal, authenticate_bearer, bearer_token, principal_of_api_key
from memories.call_record import failures_audited
from memories.models import ApiKey, IngestIntent
from memories.operations import principal_effective
from memories.rate_limits import rate_limit_consume
from memories.schemas import INGEST_MAX_MESSAGES, INGEST_MAX_TOTAL_CHARS
from memories.services import api_key_authenticate, memory_ingest, user_write_locks
from memories.sessions import (
    session_events_append,
    session_events_recent,
    session_item_hash,
    session_item_hashes_recent,
    session_logs_delete,
    sessions_replayed,
)
from proxy.crypto import secret_encrypt
from proxy.errors import ProxyError, unauthenticated
from proxy.messages import conversation_overlap, turn_items
from proxy.models import ProxyTurn, TokenConfig
from proxy.selectors import (
    UpstreamConfig,
    token_config_effective,
    token_config_of_key,
    token_configs_of_live_keys,
)
from proxy.tasks import turn_extract as turn_extract_task

logger = logging.getLogger(__name__)

# What the session log (and its SessionState row) can hold: a longer id would be accepted,
# forwarded, then fail to be recorded (503 recording_failed after the upstream answered).
MAX_SESSION_ID_CHARS = 128  # SessionEvent.session_id and SessionState.session_id
# Body fields a key's extra_body may not set (the proxy's own, or the client's choice).
EXTRA_BODY_RESERVED = frozenset({"messages", "stream"})
# Extraction failures that pass: the embedder, database or mem0's LLM down
# (backend_unavailable), a rate limit, a lock another change holds. They are retried with
# a growing delay for PROXY_EXTRACTION_RETRY_FOR_S, as are the deadline and unexpected
# exceptions (a dropped database connection is one). Any other code (invalid_argument,
# llm_unavailable: no LLM is configured, ...) would fail the same way again: the turn fails
# at once, kept for staff to re-queue once the cause is fixed.
TRANSIENT_EXTRACTION_ERRORS = frozenset(
    {ErrorCode.BACKEND_UNAVAILABLE, ErrorCode.RATE_LIMITED, ErrorCode.CONFLICT, ErrorCode.RESOURCE_BUSY}
)


@dataclass(frozen=True)
class ChatCaller:
    principal: Principal
    scope: MemoryScope
    api_key: ApiKey | None
    config: UpstreamConfig

    @property
    def default_session_id(self) -> str:
        # Seed 004: one token, one conversation stream, unless the client names a session.
        return f"key:{self.api_key.key_id}" if self.api_key is not None else "default"


def chat_caller_authenticate(*, authorization: str | None) -> ChatCaller:
    """The caller and its configuration; 401 for a missing/invalid key or config."""
    token = bearer_token(authorization)
    if token is None:
        raise unauthenticated()
    api_key = None
    principal: Principal | None
    if token.startswith(ApiKey.PREFIX):
        api_key = api_key_authenticate(token=token)
        if api_key is None:
            raise unauthenticated()
        principal = principal_of_api_key(api_key)
    else:
        principal = authenticate_bearer(authorization)
    if principal is None:
        raise unauthenticated()
    config = token_config_effective(api_key=api_key)
    return ChatCaller(principal=principal, scope=principal.scope(), api_key=api_key, config=config)


# A chat call reads the user's memories (injection) and writes them (the turn, extraction).
CHAT_PERMISSIONS = frozenset({Permission.READ, Permission.WRITE})
_SUBJECT_ERRORS = {ErrorCode.FORBIDDEN: 403, ErrorCode.NOT_FOUND: 404, ErrorCode.INVALID_ARGUMENT: 422}


def chat_caller_authorize(caller: ChatCaller, *, subject: str | None) -> ChatCaller:
    """The caller a chat call runs as (issue 12's rules, as on every surface): a credential
    without read and write is refused (403 `forbidden`); `X-Memory-Subject` names the user
    a tenant_admin or platform service acts for, and is refused for anyone else (403), a
    user outside the admin's tenant or missing answering 404 alike. Never ignored."""
    if not caller.principal.permissions >= CHAT_PERMISSIONS:
        raise ProxyError(403, "forbidden", "This credential lacks the read and write permissions the chat proxy needs.")
    if not subject:
        return caller
    try:
        effective = principal_effective(caller.principal, subject=subject)
    except ServiceError as error:
        raise ProxyError(_SUBJECT_ERRORS.get(error.code, 403), error.code.value, error.message) from None
    return replace(caller, principal=effective, scope=effective.scope())


def chat_call_context(call: CallContext, *, caller: ChatCaller) -> CallContext:
    """The call as the dispatcher records it: the authenticated actor (the service account
    when delegating), its method and role; the scope is the subject's."""
    return caller.principal.call_attributed(call)


def session_id_clean(value: str | None, *, caller: ChatCaller) -> str:
    value = (value or "").strip()
    if not value:
        return caller.default_session_id
    if len(value) > MAX_SESSION_ID_CHARS or not value.isprintable():
        message = f"X-Session-Id: at most {MAX_SESSION_ID_CHARS} printable characters."
        raise ProxyError(422, "invalid_session_id", message)
    return value


def chat_rate_limit_consume(caller: ChatCaller) -> None:
    """The per-user limit on chat calls (RATE_LIMIT_CHAT_COMPLETION)."""
    try:
        rate_limit_consume(caller.scope, operation=Operation.CHAT_COMPLETION)
    except ServiceError as error:
        if error.code == ErrorCode.UNAUTHENTICATED:  # the account was deleted meanwhile
            raise unauthenticated(error.message) from None
        raise ProxyError(429, "rate_limited", error.message, retry_after_s=error.retry_after_s) from None


def chat_history_load(caller: ChatCaller, *, session_id: str) -> list[dict[str, Any]]:
    """The session's last `session_window_size` items, oldest first."""
    return session_events_recent(caller.scope, session_id=session_id, limit=caller.config.session_window_size)


def _sha256(value: Any) -> str:
    # surrogatepass: a hash must never be why a call goes unrecorded.
    text = json.dumps(value, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def chat_call_finish(
    caller: ChatCaller,
    *,
    call: CallContext,
    session_id: str,
    status: int,
    stream: bool,
    model: Any,
    request_messages: list[dict[str, Any]],
    answer: dict[str, Any] | None,
    memory_ids: list[str],
    history_items: int,
    failure: ProxyError | None = None,
    stopped_by_client: bool = False,
) -> int | None:
    """After the upstream answered. One transaction: the audit row (content as hashes),
    and for a 2xx answer the usage event, the turn in the session log (`_turn_new_items`)
    and the extraction outbox row with the turn's messages (`_extraction_messages`).
    Returns that row's pk: the caller enqueues it off the answer's path
    (`proxy_turn_enqueue`); the sweep enqueues any it missed.
    `failure`: a 2xx whose answer was unusable or cut off (upstream_error/_timeout):
    audited as an error with the same detail, not billed, no turn stored.
    `stopped_by_client`: the client left mid-stream; what it received is the turn (as
    when a user stops a generation), so it is recorded and billed like a whole answer."""
    detail = {
        "upstream_status": status,
        "stream": stream,
        "model": model[:200] if isinstance(model, str) else None,
        "upstream": caller.config.source,
        "session_sha256": hashlib.sha256(session_id.encode()).hexdigest(),
        "messages": len(request_messages),
        "messages_sha256": _sha256(request_messages),
        "answer_sha256": _sha256(answer) if answer is not None else None,
        "memories_injected": len(memory_ids),
        "history_items": history_items,
    }
    if stopped_by_client:
        detail["stopped_by_client"] = True
    scope = caller.scope
    with transaction.atomic():
        if failure is not None:
            audit_record(
                scope,
                call=call,
                operation=Operation.CHAT_COMPLETION,
                outcome=AuditEvent.Outcome.ERROR,
                error_code=failure.code,
                memory_ids=memory_ids,
                detail={**detail, "message": failure.message},
            )
            return None
        if not 200 <= status < 300:
            audit_record(
                scope,
                call=call,
                operation=Operation.CHAT_COMPLETION,
                outcome=AuditEvent.Outcome.ERROR,
                error_code=f"upstream_{status}",
                memory_ids=memory_ids,
                detail=detail,
            )
            return None
        # The turn's rows (session log, extraction outbox) are the user's: an erasure under
        # way is waited for, so it cannot miss them (see memories.services.user_write_locks).
        # And the session's lock (the turn tools' key, project ""): two calls on one session
        # that overlap each read the log to find what of their request is new, so without
        # it both stored the same items. Taken here, after the upstream answered, it is
        # held only for this transaction, never across the upstream call.
        user_write_locks(scope, _session_lock_key(scope, session_id=session_id))
        turn_new, to_store, held = _turn_new_items(
            scope,
            session_id=session_id,
            request_messages=request_messages,
            answer_items=turn_items([answer]) if answer else [],
        )
        stored = session_events_append(
            scope,
            session_id=session_id,
            items=to_store,
            turn_id=call.turn_id or call.request_id,
            replayed=True,  # the next call sends it upstream as the conversation so far
        )
        detail["session_items_stored"] = stored
        if held:
            detail["session_items_held"] = held
        extract, extract_left_out, extract_shortened = _extraction_messages(turn_new)
        if extract_left_out:
            # Nothing dropped unsaid: the turn's older new messages are in the session log,
            # only not handed to this extraction (INGEST_MAX_*, what an ingest call takes).
            detail["extraction_messages_left_out"] = extract_left_out
        if extract_shortened:
            detail["extraction_messages_shortened"] = extract_shortened  # whole in the log too
        turn_pk = None
        if extract:
            turn = ProxyTurn.objects.create(
                request_id=call.request_id,
                user_id=scope.user_pk,
                tenant=scope.tenant,
                client_app=scope.client_app or "",
                session_id=session_id,
                actor_user_id=call.actor_user_id,
                actor_username=call.actor_username,
                actor_auth=call.actor_auth,
                actor_role=call.actor_role,
                actor_credential=call.actor_credential,
                messages=extract,
            )
            turn_pk = turn.pk
        usage_event_record(scope, operation=Operation.CHAT_COMPLETION, call=call)
        audit_record(scope, call=call, operation=Operation.CHAT_COMPLETION, memory_ids=memory_ids, detail=detail)
    return turn_pk


def _session_lock_key(scope: MemoryScope, *, session_id: str) -> str:
    """The advisory lock of a proxy session's log: the key after_turn and session
    maintenance take for a session (memories.turns), the proxy's sessions having no project."""
    return f"session:{scope.engine_user_id}::{session_id}"


def _turn_new_items(
    scope: MemoryScope, *, session_id: str, request_messages: list[dict[str, Any]], answer_items: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int]:
    """`(turn, stored, held)`: the turn's items (the request's past the part the session
    log already holds, then the answer's), those of them the log stores, and how many of
    the request's the log held already or skipped.
    A client resending the whole conversation (`conversation_overlap` finds the log's last
    items in it): what follows them is the turn, stored as sent, a message said twice
    included, so the log stays the conversation and the next call finds it again however
    long it grew. A request that does not hold the log's last item (a client sending only
    its new messages, a retry, a first call carrying earlier history) is the turn whole;
    the log skips what duplicates its last PROXY_DEDUPE_WINDOW items (or an earlier item
    of the turn), the seed's rule, so a retry is not stored twice."""
    items = turn_items(request_messages)
    digests = [session_item_hash(item) for item in items]
    window = settings.PROXY_DEDUPE_WINDOW
    log = session_item_hashes_recent(scope, session_id=session_id, limit=max(window, len(items)))
    covered, end = conversation_overlap(log, digests)
    turn = [*items[end:], *answer_items]
    if covered:
        return turn, turn, end
    seen = set(log[len(log) - window :]) if window > 0 else set()
    stored: list[dict[str, Any]] = []
    for item in turn:
        digest = session_item_hash(item)
        if window > 0 and digest in seen:
            continue
        seen.add(digest)
        stored.append(item)
    return turn, stored, len(turn) - len(stored)


def _extraction_messages(items: list[dict[str, Any]]) -> tuple[list[dict[str, str]], int, int]:
    """What the turn hands to extraction: its user/assistant messages as plain text (seed
    004: the turn's messages go to `MemoryManager.add`), the answer last. Bounded as
    an `ingest` call is (INGEST_MAX_MESSAGES, INGEST_MAX_TOTAL_CHARS): past that the newest
    are kept, the last two always (as a rule the last user message and the answer). They share
    INGEST_MAX_TOTAL_CHARS when they alone are longer (a pasted document): each is cut
    to its beginning, keeping at least half of it and what the other leaves. Nothing refuses an
    over-long turn on the way (the worker's ingest is no client call), so uncut it went to
    mem0's LLM whole, past what any `ingest` may send. Returns
    `(messages, left_out, shortened)`: how many were left out, and how many cut."""
    messages = [
        {"role": item["role"], "content": _plain(item["content"])}
        for item in items
        if item.get("type") == "message" and item.get("role") in ("user", "assistant")
    ]
    last = messages[-2:]
    room = _pair_room([len(m["content"]) for m in last], INGEST_MAX_TOTAL_CHARS)
    shortened = sum(1 for message, fits in zip(last, room, strict=True) if len(message["content"]) > fits)
    kept = [{**m, "content": m["content"][:fits]} for m, fits in zip(last, room, strict=True)][::-1]
    chars = sum(room)
    for message in reversed(messages[:-2]):
        if len(kept) >= INGEST_MAX_MESSAGES or chars + len(message["content"]) > INGEST_MAX_TOTAL_CHARS:
            break
        kept.append(message)
        chars += len(message["content"])
    kept.reverse()
    return kept, len(messages) - len(kept), shortened


def _pair_room(lengths: list[int], budget: int) -> list[int]:
    """How many characters each of (at most) two messages keeps within `budget`: all of
    them when they fit, else each at least half, the rest to the one that needs it."""
    if sum(lengths) <= budget:
        return lengths
    if len(lengths) == 1:
        return [budget]
    first, second = lengths
    half = budget // 2
    if first <= half:
        return [first, budget - first]
    if second <= budget - half:
        return [budget - second, second]
    return [half, budget - half]


def _plain(content: Any) -> str:
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return content if isinstance(content, str) else ""


def proxy_turn_enqueue(*, turn_pk: int) -> None:
    """Hand a committed turn to the worker (publishing costs a broker round trip, so the
    view calls this after the answer went out)."""
    _enqueue(turn_pk)


def _enqueue(turn_pk: int) -> None:
    try:
        turn_extract_task.delay(turn_pk)
    except Exception as exc:  # broker down: the sweep picks the turn up
        logger.warning("could not enqueue turn extraction (%s); the sweep will pick it up", type(exc).__name__)


def chat_call_failed(
    caller: ChatCaller | None, *, call: CallContext, error: ProxyError, credential_presented: bool = True
) -> None:
    """Our own refusal (401/422/429/502): one audit row, no usage event (a 401 is counted
    per client address with one sampled row, as on every surface). The row names the
    authenticated actor (the service when it delegates), whichever step refused."""
    try:
        if caller is None:
            if error.status == 401:
                auth_failure_record(call=call, credential_presented=credential_presented)
            return
        call = chat_call_context(call, caller=caller)
        with transaction.atomic():
            audit_failure(caller.scope, call=call, operation=Operation.CHAT_COMPLETION, error=error.as_service_error())
    except Exception:  # never hide the caller's error behind an audit failure, but say so
        logger.exception("could not write the audit row for a failed chat call")


# --- extraction (after the answer, in the worker) ---------------------------------------
# Names each attempt's ingest (its request id), so a later attempt finds the intent of one
# that outlived its deadline: uuid5 of the turn and the attempt number.
_ATTEMPT_NAMESPACE = uuid.UUID("6f7c2b1e-52c4-4f0e-9a43-0d9d3d1b7a10")


def _attempt_request_id(turn: ProxyTurn, attempt: int) -> str:
    return str(uuid.uuid5(_ATTEMPT_NAMESPACE, f"{turn.pk}:{turn.request_id}:{attempt}"))


def _attempt_states(turn: ProxyTurn, *, attempts: range) -> set[str]:
    ids = [_attempt_request_id(turn, n) for n in attempts]
    return set(IngestIntent.objects.filter(request_id__in=ids).values_list("state", flat=True))


def _turn_close(turn_pk: int, *, state: str, reason: str | None = None, attempt: int | None = None) -> int:
    """Close the turn; with `attempt`, only while it is still pending on that attempt. An
    extracted turn's messages are blanked; a failed one keeps them for staff to re-queue
    (pruned with the turn, erased with the user, blanked by a clear-all)."""
    fields: dict[str, Any] = {"state": state, "closed_at": timezone.now()}
    if state == ProxyTurn.State.DONE:
        fields["messages"] = []
    if reason is not None:
        fields["last_error"] = reason[:100]
    turns = ProxyTurn.objects.filter(pk=turn_pk)
    if attempt is not None:
        turns = turns.filter(state=ProxyTurn.State.PENDING, attempts=attempt)
    return turns.update(**fields)


def _turn_give_up(turn: ProxyTurn, *, reason: str) -> None:
    """The turn fails for good: said as an error (ids and the error code only), counted by
    the `memsite_proxy_turns_failed` gauge, its messages kept for a staff re-queue."""
    _turn_close(turn.pk, state=ProxyTurn.State.FAILED, reason=reason)
    logger.error(
        "memory extraction for turn %s given up after %s attempt(s) (%s); staff can re-queue it",
        turn.pk,
        turn.attempts,
        reason[:100],
    )


def _retry_delay(attempt: int) -> timedelta:
    """Doubling from PROXY_EXTRACTION_RETRY_BASE_S up to _MAX_S, +-20 % so the turns of one
    outage do not all come back in the same sweep (each one still later than the last)."""
    base = settings.PROXY_EXTRACTION_RETRY_BASE_S * 2 ** max(0, attempt - 1)
    return timedelta(seconds=min(settings.PROXY_EXTRACTION_RETRY_MAX_S, base) * random.uniform(0.8, 1.2))  # noqa: S311


def proxy_turn_extract(*, turn_pk: int) -> str:
    """Extract memories from one answered turn (mem0 infer through `memory_ingest`,
    which keeps the dedupe rule and its own audit row, unbilled: `_ingest_in_thread`) under
    PROXY_MEMORY_STORE_TIMEOUT_S.
    A failure is logged and never touches the chat call, which was answered long ago. A
    passing one (TRANSIENT_EXTRACTION_ERRORS, the deadline, an unexpected exception) is
    retried by the sweep once `next_attempt_at` has passed, the delay doubling, until an
    attempt fails after `retry_until` (PROXY_EXTRACTION_RETRY_FOR_S after the first
    failure); any other fails the turn at once. A turn given up is logged as an error and
    keeps its messages for staff to re-queue (`proxy_turns_requeue`). A turn the user's
    erasure deleted is not extracted (checked as the ingest is recorded, under the
    erasure's lock) nor retried (no row is left to sweep); one erased during the ingest
    keeps nothing (`memory_ingest` discards it).
    An attempt that outlives the deadline cannot be stopped (a thread), so it is never
    raced: a late start (no intent recorded yet) stores nothing once another attempt began
    or the turn closed (`turn_pending` below); a late finish (intent recorded) is the
    turn's extraction: no new attempt starts while it runs, and the turn closes as done
    when it completed (or failed, if it stored nothing past its retry window). So a
    turn is extracted at most once and never stores memories after it was marked failed."""
    with transaction.atomic():
        turn = ProxyTurn.objects.select_for_update(skip_locked=True).filter(pk=turn_pk).first()
        if turn is None or turn.state != ProxyTurn.State.PENDING:
            return "skipped"
        earlier = _attempt_states(turn, attempts=range(1, turn.attempts + 1))
        if IngestIntent.State.DONE in earlier:
            _turn_close(turn.pk, state=ProxyTurn.State.DONE)
            return "done"
        if IngestIntent.State.OPEN in earlier:
            return "in_flight"  # the sweep comes back; the reconciler closes an orphan
        if turn.retry_until is not None and timezone.now() >= turn.retry_until:
            # Its last attempt ended past the deadline without deciding (it overran and
            # stored nothing, or its worker died): no new one starts.
            _turn_give_up(turn, reason=turn.last_error or "timeout")
            return "failed"
        turn.attempts += 1
        # Already due later: a worker that dies in this attempt is not retried every sweep.
        turn.next_attempt_at = timezone.now() + _retry_delay(turn.attempts)
        turn.save(update_fields=["attempts", "next_attempt_at"])
    attempt = turn.attempts
    scope = MemoryScope(tenant=turn.tenant, user_pk=turn.user_id, client_app=turn.client_app or None)
    call = CallContext(
        channel=Channel.PROXY,
        request_id=_attempt_request_id(turn, attempt),
        turn_id=turn.request_id,
        actor_user_id=turn.actor_user_id,
        actor_username=turn.actor_username,
        actor_auth=turn.actor_auth,
        actor_role=turn.actor_role,
        actor_credential=turn.actor_credential,
    )
    try:
        _run_with_deadline(
            _ingest_in_thread,
            scope,
            turn.messages,
            call,
            turn.session_id,
            turn.pk,
            attempt,
            timeout=settings.PROXY_MEMORY_STORE_TIMEOUT_S,
        )
    except Exception as exc:
        reason = "timeout" if isinstance(exc, concurrent.futures.TimeoutError) else type(exc).__name__
        transient = True
        if isinstance(exc, ServiceError):
            reason = exc.code.value
            transient = exc.code in TRANSIENT_EXTRACTION_ERRORS
        logger.warning("memory extraction for turn %s failed (%s)", turn.pk, reason)
        return _attempt_failed(turn, attempt=attempt, reason=reason, transient=transient)
    # Only while the turn still waits for this attempt. Its ingest stored nothing when the
    # turn had moved on (`turn_pending`): a later attempt took it over (a second task for the
    # same turn claimed it first) and will close it itself, or a clear-all closed it.
    if _turn_close(turn.pk, state=ProxyTurn.State.DONE, attempt=attempt):
        return "done"
    return "superseded" if ProxyTurn.objects.filter(pk=turn.pk).exists() else "erased"


def _attempt_failed(turn: ProxyTurn, *, attempt: int, reason: str, transient: bool) -> str:
    """Under the turn's lock, which the attempt's own intent check also takes: its ingest
    either recorded its intent already (seen here) or will find the turn changed."""
    with transaction.atomic():
        current = ProxyTurn.objects.select_for_update().filter(pk=turn.pk, state=ProxyTurn.State.PENDING).first()
        if current is None:
            return "failed"
        state = _attempt_states(turn, attempts=range(attempt, attempt + 1))
        if IngestIntent.State.DONE in state:  # it completed just after the deadline
            _turn_close(turn.pk, state=ProxyTurn.State.DONE, reason=reason)
            return "done"
        now = timezone.now()
        retry_until = current.retry_until or now + timedelta(seconds=settings.PROXY_EXTRACTION_RETRY_FOR_S)
        final = not transient or now >= retry_until
        if final and IngestIntent.State.OPEN not in state:
            _turn_give_up(current, reason=reason)
        elif IngestIntent.State.OPEN in state:  # still running: its outcome decides (the sweep looks)
            ProxyTurn.objects.filter(pk=turn.pk).update(last_error=reason[:100], retry_until=retry_until)
        else:
            ProxyTurn.objects.filter(pk=turn.pk).update(
                last_error=reason[:100], retry_until=retry_until, next_attempt_at=now + _retry_delay(attempt)
            )
    return "failed"


def _run_with_deadline(fn: Any, *args: Any, timeout: float) -> Any:
    """`fn` on a daemon thread, waited for `timeout` seconds. One that overruns goes on
    alone (no thread can be stopped) without holding up the worker's shutdown: an ingest
    cut short by the process exit leaves its intent open, which the reconciler closes."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # handed to the waiting caller
            future.set_exception(exc)

    threading.Thread(target=run, name="proxy-extract", daemon=True).start()
    return future.result(timeout=timeout)


def _ingest_in_thread(
    scope: MemoryScope, messages: list[dict[str, Any]], call: CallContext, session_id: str, turn_pk: int, attempt: int
) -> None:
    """One audited ingest per attempt, never billed nor counted against the user's INGEST
    limit: the chat completion it comes from was the one billed call (core/choices.py)."""
    from django.db import connection

    def turn_pending() -> bool:
        # The turn still waits for this very attempt: not erased (its messages are not to
        # be stored), closed, or taken over by a later attempt after this one overran.
        # Locked: `_attempt_failed` and the next attempt decide after this intent exists.
        rows = ProxyTurn.objects.select_for_update().filter(pk=turn_pk, state=ProxyTurn.State.PENDING, attempts=attempt)
        return bool(list(rows.values_list("pk", flat=True)))

    try:
        with failures_audited(scope, call=call, operation=Operation.INGEST):
            memory_ingest(
                scope,
                messages=messages,
                metadata={"session_id": session_id[:128]},
                call=call,
                billed=False,
                source_present=turn_pending,
            )
    finally:
        connection.close()  # this thread's connection dies with it


def proxy_turns_sweep(*, older_than_s: float = 60.0, batch: int = 100) -> int:
    """Pending turns whose task was lost (broker down, worker killed) or whose retry is
    due (`next_attempt_at`): enqueue again."""
    now = timezone.now()
    cutoff = now - timedelta(seconds=older_than_s)
    due = list(
        ProxyTurn.objects.filter(state=ProxyTurn.State.PENDING, created_at__lt=cutoff)
        .filter(Q(next_attempt_at__isnull=True) | Q(next_attempt_at__lte=now))
        .order_by("created_at")
        .values_list("pk", flat=True)[:batch]
    )
    for pk in due:
        _enqueue(pk)
    return len(due)


def proxy_turns_requeue(*, turn_ids: list[int]) -> list[int]:
    """Staff action (in the caller's transaction, with its audit row): turns that were
    given up, their messages kept, go back to the queue, due now and with a fresh retry
    window; their attempts go on counting (each attempt's ingest keeps its own request
    id). A turn extracted, still pending, or blanked by a clear-all is left alone."""
    with transaction.atomic():
        turns = ProxyTurn.objects.filter(pk__in=turn_ids, state=ProxyTurn.State.FAILED).exclude(messages=[])
        # Under the owners' erasure locks, as a chat call records its turn: a clear-all or
        # erasure under way is waited for, then its blanked or deleted turns are not found.
        for user_pk, tenant in sorted(set(turns.values_list("user_id", "tenant"))):
            user_write_locks(MemoryScope(tenant=tenant, user_pk=user_pk))
        ids = list(turns.select_for_update().values_list("pk", flat=True))
        ProxyTurn.objects.filter(pk__in=ids).update(
            state=ProxyTurn.State.PENDING, closed_at=None, next_attempt_at=timezone.now(), retry_until=None
        )
        transaction.on_commit(lambda: _enqueue_all(ids))
    return ids


def _enqueue_all(turn_pks: list[int]) -> None:
    for pk in turn_pks:
        _enqueue(pk)


# --- token configuration (admin API, web UI) --------------------------------------------
def _config_validate(fields: dict[str, Any], *, partial: bool) -> dict[str, Any]:
    """Empty or zero required fields are refused (seed 004); ServiceError names the field."""
    known = {
        "upstream_base_url",
        "upstream_api_key",
        "extra_body",
        "memory_llm",
        "memory_prompt",
        "memory_limit",
        "session_window_size",
    }
    unknown = set(fields) - known
    if unknown:
        raise ServiceError(ErrorCode.INVALID_ARGUMENT, f"Unknown fields: {sorted(unknown)}.")
    required = {"upstream_base_url", "upstream_api_key"}
    missing = required - set(fields) if not partial else set()
    if missing:
        raise ServiceError(ErrorCode.INVALID_ARGUMENT, f"Required: {sorted(missing)}.")
    clean: dict[str, Any] = {}
    for name, value in fields.items():
        if name == "upstream_base_url":
            if not isinstance(value, str) or not upstream_url_usable(value):
                raise ServiceError(
                    ErrorCode.INVALID_ARGUMENT,
                    "upstream_base_url must be an http(s) URL with a host and, if given, a port from 1 to 65535.",
                )
            if len(value) > 500:
                raise ServiceError(ErrorCode.INVALID_ARGUMENT, "upstream_base_url: at most 500 characters.")
            if not _host_may_be_public(urlsplit(value).hostname or ""):
                raise ServiceError(
                    ErrorCode.INVALID_ARGUMENT,
                    "upstream_base_url must be at a public address (not loopback, private or link-local).",
                )
        elif name == "upstream_api_key":
            if not isinstance(value, str) or not value.strip() or len(value) > 4096:
                raise ServiceError(ErrorCode.INVALID_ARGUMENT, "upstream_api_key must be a non-empty string.")
            # It becomes an Authorization header: anything else fails every later call.
            if not value.strip().isascii() or not value.strip().isprintable():
                raise ServiceError(ErrorCode.INVALID_ARGUMENT, "upstream_api_key: printable ASCII characters only.")
        elif name in ("extra_body", "memory_llm"):
            if not isinstance(value, dict):
                raise ServiceError(ErrorCode.INVALID_ARGUMENT, f"{name} must be a JSON object.")
            try:
                json_value_check(value)
            except InputError as exc:
                raise ServiceError(ErrorCode.INVALID_ARGUMENT, f"{name}: {exc.message}.") from None
            # The proxy decides these from the client's request (the stream flag chooses
            # how the answer is read and recorded).
            if name == "extra_body" and set(value) & EXTRA_BODY_RESERVED:
                raise ServiceError(ErrorCode.INVALID_ARGUMENT, "extra_body cannot set messages or stream.")
        elif name == "memory_prompt":
            if not isinstance(value, str) or len(value) > 20000:
                raise ServiceError(ErrorCode.INVALID_ARGUMENT, "memory_prompt must be a string (20,000 chars max).")
            problem = text_problem(value)
            if problem:
                raise ServiceError(ErrorCode.INVALID_ARGUMENT, f"memory_prompt {problem}.")
        elif name in ("memory_limit", "session_window_size"):
            top = 100 if name == "memory_limit" else 1000
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= top:
                raise ServiceError(ErrorCode.INVALID_ARGUMENT, f"{name} must be an integer from 1 to {top}.")
        clean[name] = value
    return clean


def _host_may_be_public(host: str) -> bool:
    """What can be told at save time: an address literal, or `localhost`, that is not
    public is refused with a clear message. Names are checked where the connection is
    made, on every call (proxy/upstream_network.py): what they resolve to can change."""
    allow_loopback = bool(settings.PROXY_KEY_UPSTREAM_ALLOW_LOOPBACK)
    if host.lower() == "localhost" or host.lower().endswith(".localhost"):
        return allow_loopback
    try:
        return address_is_public(host, allow_loopback=allow_loopback)
    except ValueError:  # a name
        return True


def upstream_url_usable(value: str) -> bool:
    """An http(s) URL the upstream client can call: no invalid characters or whitespace
    (a NUL is a database error, a space an httpx error at every chat call), a host (no
    percent-escapes: no name or address has one) and, if given, a port from 1 to 65535
    (else every chat call fails to connect). A key's URL on save; the deployment's
    CHAT_UPSTREAM_BASE_URL at start-up (memsite.checks)."""
    if not value or text_problem(value) or any(c.isspace() for c in value):
        return False
    try:
        parts = urlsplit(value)
        port = parts.port  # ValueError when out of 0-65535
        httpx.URL(value)
    except (httpx.InvalidURL, ValueError):
        return False
    host = parts.hostname or ""
    return parts.scheme in ("http", "https") and bool(host) and "%" not in host and port != 0


def _staff_call(staff_user: Any, call: CallContext) -> CallContext:
    return replace(call, staff_user_id=staff_user.pk, staff_username=staff_user.get_username())


# The admin token API (`/v1/admin/tokens`) reads and rewrites any user's upstream (where
# their prompts and memories are sent). Each method needs the key's own permission
# (issue 12, as on every surface) and the staff account's Django model permission on
# TokenConfig (the admin's role model: granted through groups; a superuser holds all).
TOKEN_ADMIN_ACCESS: dict[str, tuple[str, str]] = {
    "GET": (Permission.READ, "view"),
    "POST": (Permission.WRITE, "add"),
    "PUT": (Permission.WRITE, "change"),
    "PATCH": (Permission.WRITE, "change"),
    "DELETE": (Permission.DELETE, "delete"),
}


def token_admin_unauthenticated(*, call: CallContext, credential_presented: bool) -> None:
    """A 401 at the admin token API: counted per client address with one sampled audit
    row, as on every surface."""
    auth_failure_record(call=call, credential_presented=credential_presented)


def token_config_admin_authorize(
    principal: Principal, *, method: str, call: CallContext, creates: bool = False
) -> None:
    """May this credential use the admin token API with `method`? Refused: 403 `forbidden`,
    audited as denied under the caller's own scope (nothing is read or changed). As in the
    admin, `change` also lets a staff account view; a `PUT` that creates a configuration
    (`creates`) needs `add` as well."""
    key_permission, action = TOKEN_ADMIN_ACCESS[method]
    user = principal.user
    needed = [f"proxy.{action}_tokenconfig"] + (["proxy.add_tokenconfig"] if creates else [])
    missing = [name for name in needed if not user.has_perm(name)]
    if action == "view" and user.has_perm("proxy.change_tokenconfig"):
        missing = []
    if not user.is_staff:
        message = "Admin routes need a staff user's key."
    elif key_permission not in principal.permissions:
        message = f"This credential lacks the {key_permission} permission this admin route needs."
    elif missing:
        message = f"This staff account lacks the {' and '.join(missing)} permission{'s' if len(missing) > 1 else ''}."
    else:
        return
    error = ProxyError(403, "forbidden", message)
    with transaction.atomic():
        audit_failure(
            principal.scope(),
            call=_caller_call(principal, call),
            operation=Operation.PROXY_TOKEN_CONFIG,
            error=error.as_service_error(),
        )
    raise error


def _caller_call(principal: Principal, call: CallContext) -> CallContext:
    """The call as the authenticated caller's own (a refusal recorded under their scope)."""
    return principal.call_attributed(call)


def token_admin_refused(
    principal: Principal, *, call: CallContext, error: ServiceError, api_key: ApiKey | None = None
) -> None:
    """A refusal at the admin token API after its caller was authorized (404, 409, 413,
    422): one audit row, as on every surface. Once the call named a key that exists
    (`api_key`), under its owner, the staff account as actor, as the change would have
    been: an attempt on their settings shows on their Activity. Before that (an unknown,
    revoked or expired key, a body that is not JSON), under the caller's own scope, as a 403."""
    try:
        with transaction.atomic():
            if api_key is None:
                audit_failure(
                    principal.scope(),
                    call=_caller_call(principal, call),
                    operation=Operation.PROXY_TOKEN_CONFIG,
                    error=error,
                )
            else:
                # audit_failure's row, naming the key tried.
                audit_record(
                    MemoryScope.for_user(api_key.user),
                    call=_staff_call(principal.user, call),
                    operation=Operation.PROXY_TOKEN_CONFIG,
                    outcome=AuditEvent.Outcome.DENIED if error.denied else AuditEvent.Outcome.ERROR,
                    error_code=error.code.value,
                    detail={"key_id": api_key.key_id, "message": error.message},
                )
    except Exception:  # never hide the caller's error behind an audit failure, but say so
        logger.exception("could not write the audit row for a refused admin token call")


def token_configs_admin_list(
    *, call: CallContext, staff_user: Any, after_id: int | None = None, limit: int
) -> tuple[list[TokenConfig], bool]:
    """Staff reading a page of the upstream settings of live keys (the admin API's list):
    up to `limit` rows after `after_id`, and whether more follow. The read is audited, one
    row per user whose settings the page showed (under that user, the staff account as
    actor, with the key ids), in the read's transaction; not billed (a staff surface, as
    the admin's views). Nothing shown, nothing to record."""
    with transaction.atomic():
        rows = token_configs_of_live_keys(after_id=after_id, limit=limit + 1)
        more = len(rows) > limit
        rows = rows[:limit]
        shown: dict[int, tuple[Any, list[str]]] = {}
        for row in rows:
            shown.setdefault(row.api_key.user_id, (row.api_key.user, []))[1].append(row.api_key.key_id)
        staff_call = _staff_call(staff_user, call)
        for user, key_ids in shown.values():
            detail = {"action": "list", "key_ids": key_ids}
            audit_record(
                MemoryScope.for_user(user), call=staff_call, operation=Operation.PROXY_TOKEN_CONFIG, detail=detail
            )
    return rows, more


def token_config_admin_get(*, api_key: ApiKey, call: CallContext, staff_user: Any) -> TokenConfig | None:
    """Staff reading one key's upstream settings (the admin API's show): audited under the
    key's owner, as the list; not billed. None: the key has no configuration."""
    with transaction.atomic():
        row = token_config_of_key(api_key=api_key)
        if row is not None:
            _config_audit(api_key, call=call, staff_user=staff_user, action="view", changed=[])
    return row


_CONFIG_OPTIONAL_FIELDS = frozenset(
    {"extra_body", "memory_llm", "memory_prompt", "memory_limit", "session_window_size"}
)


RETIRED_KEY_MESSAGE = "This key is revoked or expired: its chat proxy settings cannot be changed, only removed."


def token_config_save(
    *,
    api_key: ApiKey,
    fields: dict[str, Any],
    partial: bool,
    call: CallContext,
    staff_user: Any = None,
    must_create: bool = False,
) -> TokenConfig:
    """Create or change a key's configuration (validated; the upstream key encrypted).
    `partial` keeps unspecified fields (PATCH); a new row needs the required ones.
    `must_create` (POST): `conflict` if the key has one already. A revoked or expired
    key's (it never authenticates again) is `conflict` too: it can only be deleted."""
    with transaction.atomic():
        # The key's row, locked: two saves of one key run one after the other. Locking
        # the configuration alone locks nothing while it does not exist, and two creates
        # then met at the unique constraint (a 500). Read locked, so a key revoked since
        # the caller looked it up is refused too.
        locked = ApiKey.objects.select_for_update().filter(pk=api_key.pk).first()
        if locked is None:
            raise ServiceError(ErrorCode.NOT_FOUND, "No such key.")
        if not locked.is_active:
            raise ServiceError(ErrorCode.CONFLICT, RETIRED_KEY_MESSAGE)
        row = TokenConfig.objects.select_for_update().filter(api_key=api_key).first()
        if must_create and row is not None:
            raise ServiceError(ErrorCode.CONFLICT, "This token already has a configuration; use PUT or PATCH.")
        clean = _config_validate(fields, partial=partial and row is not None)
        if row is None:
            row = TokenConfig(api_key=api_key)
        elif not partial:
            # PUT replaces the whole configuration: what it leaves out goes back to its
            # default (PATCH keeps it).
            for name in _CONFIG_OPTIONAL_FIELDS - set(clean):
                field = TokenConfig._meta.get_field(name)
                assert isinstance(field, models.Field)  # a column, not a relation
                setattr(row, name, field.get_default())
        for name, value in clean.items():
            if name == "upstream_api_key":
                row.upstream_api_key_encrypted = secret_encrypt(value.strip())
            else:
                setattr(row, name, value)
        row.save()
        changed = sorted(n for n in clean if n != "upstream_api_key") + (
            ["upstream_api_key"] if "upstream_api_key" in clean else []
        )
        _config_audit(api_key, call=call, staff_user=staff_user, action="save", changed=changed)
    return row


def token_config_delete(*, api_key: ApiKey, call: CallContext, staff_user: Any = None) -> bool:
    with transaction.atomic():
        deleted, _ = TokenConfig.objects.filter(api_key=api_key).delete()
        if deleted:
            _config_audit(api_key, call=call, staff_user=staff_user, action="delete", changed=[])
    return bool(deleted)


def _config_audit(api_key: ApiKey, *, call: CallContext, staff_user: Any, action: str, changed: list[str]) -> None:
    """In the change's transaction; the subject is the key's owner, the actor staff or them."""
    detail = {"key_id": api_key.key_id, "action": action, "fields": changed}
    if staff_user is not None:
        call = _staff_call(staff_user, call)
    audit_record(MemoryScope.for_user(api_key.user), call=call, operation=Operation.PROXY_TOKEN_CONFIG, detail=detail)


def proxy_turns_erase(scope: MemoryScope) -> int:
    """Erasure (registered with memories.sessions): the user's chat turns still holding
    messages for extraction; the session log itself is erased by memories."""
    return ProxyTurn.objects.filter(user_id=scope.user_pk).delete()[0]


CLEARED_REASON = "cleared by clear-all"


def proxy_turns_clear(scope: MemoryScope) -> int:
    """Clear all (registered with memories.sessions): the user's chat turns still waiting
    for extraction are closed with their messages blanked (an attempt under way finds its
    turn closed and stores nothing; one whose ingest already began is superseded by the
    clear-all itself), and the proxy's conversation logs are deleted: replayed to the
    upstream on the next call, they would teach the cleared facts again. In the clear-all's
    transaction, under its erasure lock (a chat call records its turn under that lock too,
    so every turn committed before the clear is seen here)."""
    closed = ProxyTurn.objects.filter(user_id=scope.user_pk, state=ProxyTurn.State.PENDING).update(
        state=ProxyTurn.State.FAILED, closed_at=timezone.now(), messages=[], last_error=CLEARED_REASON
    )
    # Turns given up keep their messages for a re-queue: not after a clear-all.
    ProxyTurn.objects.filter(user_id=scope.user_pk, state=ProxyTurn.State.FAILED).exclude(messages=[]).update(
        messages=[], last_error=CLEARED_REASON
    )
    # The proxy's sessions: every one it wrote (marked replayed: its turn rows are pruned
    # after PROXY_TURN_RETENTION_DAYS, the mark stays), each of the user's keys' default
    # stream, and a login's.
    sessions = set(sessions_replayed(scope, project=""))
    keys = ApiKey.objects.filter(user_id=scope.user_pk).values_list("key_id", flat=True)
    sessions |= {f"key:{key_id}" for key_id in keys} | {"default"}
    return closed + session_logs_delete(scope, project="", session_ids=sorted(sessions))


PRUNE_BATCH = 5000


def proxy_turns_prune(*, now: datetime | None = None) -> int:
    """Closed chat turns (extracted or cleared, their messages blanked; or given up, with
    their messages) older than PROXY_TURN_RETENTION_DAYS: the audit trail and the session
    log keep what they recorded. Pending turns are never pruned (the sweep still owes
    them an extraction). In batches, so the table is never locked long, oldest closed
    first from proxy_turn_closed_at: no batch walks the pending and recent turns."""
    cutoff = (now or timezone.now()) - timedelta(days=settings.PROXY_TURN_RETENTION_DAYS)
    closed = ProxyTurn.objects.exclude(state=ProxyTurn.State.PENDING).filter(closed_at__lt=cutoff)
    return rows_delete_in_batches(closed, order_by="closed_at", batch_size=PRUNE_BATCH)
