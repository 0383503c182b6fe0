"""Usage events: recorded with each successful call, delivered by a worker."""

from __future__ import annotations

import logging
import random
import threading
import time
import unicodedata
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import httpx
from django.conf import settings
from django.db import transaction
from django.db.models import F, Q
from django.db.models.functions import Now
from django.utils import timezone

from billing.models import UsageEvent
from billing.tasks import deliver_usage_events as deliver_usage_events_task
from core.http_deadline import deadline_client, response_head
from core.logs import scrub_secrets
from core.scope import CallContext, MemoryScope

logger = logging.getLogger(__name__)

NO_GATEWAY = "undeliverable: no gateway configured"


def usage_event_record(scope: MemoryScope, *, operation: str, call: CallContext) -> UsageEvent:
    """Add the call's event to the outbox. Call it inside the transaction that holds the
    call's own writes, after everything else succeeded; delivery starts on commit."""
    event = UsageEvent.objects.create(
        request_id=call.request_id, user_id=str(scope.user_pk), operation=operation, channel=call.channel
    )
    transaction.on_commit(_enqueue_delivery)
    return event


_window_lock = threading.Lock()
_window_ends_at = 0.0
_publish_waiting = False
# Publishing is a few broker round trips (about 4 ms on the default SQLAlchemy transport),
# paid by the one call per window that opens it: a p99 cost at a few dozen calls a second.
# So it runs on this thread instead. The events are in the outbox already: a publish lost
# with the process leaves them to the minute sweep, as a broker outage does.
_publisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memsite-usage-enqueue")


def _enqueue_delivery() -> None:
    """Start a delivery for this commit, at most one per window per process: a run
    sends every due event in batches, so one task per window covers all calls in it
    (and publishing to the broker costs more than recording the event)."""
    global _window_ends_at, _publish_waiting
    window = settings.USAGE_ENQUEUE_WINDOW_S
    with _window_lock:
        now = time.monotonic()
        if now < _window_ends_at:
            return
        _window_ends_at = now + window
        if _publish_waiting:  # a publish not sent yet covers this commit too
            return
        _publish_waiting = True
    _publisher.submit(_publish_delivery, window)


def _publish_delivery(window: float) -> None:
    global _publish_waiting
    with _window_lock:
        _publish_waiting = False
    try:
        # Runs after the window closes, so it sees every event committed inside it.
        deliver_usage_events_task.apply_async(countdown=window or None)
    except Exception as exc:  # the broker is down: the minute sweep will deliver it
        logger.warning("could not enqueue usage delivery (%s); the sweep will pick it up", type(exc).__name__)


# --- delivery ---------------------------------------------------------------------------
# Reasons an operator must act on (configuration, not a gateway hiccup); the admin shows
# them above the outbox. Every 3xx reason starts with "HTTP 3"; a refused key's with its
# status (_KEY_REFUSED).
BAD_GATEWAY_URL = "the payment gateway URL is not usable (PAYMENT_GATEWAY_URL)"
NEEDS_OPERATOR = (NO_GATEWAY, BAD_GATEWAY_URL, "HTTP 3", "HTTP 401", "HTTP 403", "HTTP 407")
_QUOTED_BODY_CHARS = 200
# Enough of an error answer for _quoted, which looks at 10 x the characters it keeps (up to
# 4 bytes each in UTF-8); the rest is not read.
_QUOTED_BODY_BYTES = 4 * 10 * _QUOTED_BODY_CHARS
_LAST_ERROR_CHARS = UsageEvent._meta.get_field("last_error").max_length or 500


@dataclass
class DeliveryReport:
    delivered: int = 0
    retrying: int = 0
    failed: int = 0
    released: int = 0  # given back unsent before the lease ran short: due again, no attempt spent
    superseded: int = 0  # another worker had claimed them by the time this one settled
    errors: list[str] = field(default_factory=list)


def _backoff(attempts: int) -> timedelta:
    base = settings.USAGE_RETRY_BASE_S * 2 ** max(0, attempts - 1)
    return timedelta(seconds=min(settings.USAGE_RETRY_MAX_S, base) * random.uniform(0.5, 1.5))  # noqa: S311


def _due(now: datetime) -> Q:
    # Leases are stamped and compared on the database's clock: workers on hosts whose
    # clocks disagree still agree on when a lease ends.
    return Q(status=UsageEvent.Status.PENDING, next_attempt_at__lte=now) & (
        Q(claimed_until__isnull=True) | Q(claimed_until__lt=Now())
    )


def _post_budget_s() -> float:
    """The lease one POST needs: its total deadline (USAGE_DELIVERY_TIMEOUT_S, enforced in
    `_post` however slowly the gateway answers) and as long again to settle the answer
    before the lease ends; billing.E001 keeps the lease above it."""
    return 2 * settings.USAGE_DELIVERY_TIMEOUT_S


@dataclass(frozen=True)
class _Claim:
    """Events leased to this worker. `token` marks the rows as this claim's: another
    worker's claim replaces it, and then nothing this one does touches them."""

    token: uuid.UUID
    events: list[UsageEvent]
    # On this worker's monotonic clock, read before the claim's transaction began: never
    # later than the lease's end in the database.
    lease_ends: float

    def can_post(self) -> bool:
        """Whether a POST started now is answered before the lease ends."""
        return time.monotonic() + _post_budget_s() <= self.lease_ends


def _claim_batch(*, limit: int) -> _Claim | None:
    """Lease up to `limit` due events to this worker (SKIP LOCKED: workers never share)."""
    lease_s = settings.USAGE_CLAIM_LEASE_S
    lease_ends = time.monotonic() + lease_s
    token = uuid.uuid4()
    with transaction.atomic():
        events = list(
            UsageEvent.objects.select_for_update(skip_locked=True).filter(_due(timezone.now())).order_by("id")[:limit]
        )
        if not events:
            return None
        UsageEvent.objects.filter(pk__in=[e.pk for e in events]).update(
            claimed_until=Now() + timedelta(seconds=lease_s), claim_token=token, attempts=F("attempts") + 1
        )
    return _Claim(token=token, events=events, lease_ends=lease_ends)


@dataclass(frozen=True)
class _Outcome:
    kind: str  # "ok", "retry", "refused"
    reason: str = ""


_UNPRINTABLE = frozenset(("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"))


def _quoted(text: str, *, limit: int) -> str:
    """The gateway's own text, safe to store and show: our key and anything shaped like a
    secret redacted, control and format characters (terminal escapes, NUL, which
    PostgreSQL refuses in text, bidi overrides) and line breaks turned into spaces."""
    text = text[: limit * 10]  # enough to redact a secret that straddles the cut
    if settings.USAGE_INGEST_API_KEY:
        text = text.replace(settings.USAGE_INGEST_API_KEY, "[redacted]")
    text = scrub_secrets(text)
    text = "".join(" " if unicodedata.category(c) in _UNPRINTABLE else c for c in text)
    return " ".join(text.split())[:limit]


# 4xx answers that say nothing against the events themselves: our key is wrong or lacks a
# right (an operator's fix, as a redirect is), or the gateway timed out or is busy. Failing
# the events for good would leave them undelivered after the fix until staff re-queued
# them, so they wait with the capped backoff instead, the status quoted for staff. A 404
# is not among them: a gateway may answer it for one event (an account it does not know),
# and that event must be found (sent one at a time) and failed, not retried for ever.
_NOT_ABOUT_THE_EVENTS = frozenset((401, 403, 407, 408, 421, 425, 429))
# Of those, the ones only an operator can end: nothing goes until the key (or the proxy's
# credentials) is fixed, so the reason says so, and the admin shows it above the outbox.
_KEY_REFUSED = {
    401: "the payment gateway refused our key (USAGE_INGEST_API_KEY is wrong, rotated or revoked)",
    403: "the payment gateway refused our key (USAGE_INGEST_API_KEY lacks the right to send usage events)",
    407: "a proxy on the way to the payment gateway refused the request (it wants proxy credentials)",
}


def _redirect_reason(response: httpx.Response) -> str:
    # Following it would send the API key wherever the answer points, so the events wait
    # (retried with the capped backoff) until an operator sets the final URL. Only the
    # target's origin is quoted: its path or query may carry a token.
    target = ""
    location = response.headers.get("location")
    if location:
        try:
            url = response.request.url.join(location)
            origin = f"{url.scheme}://{url.netloc.decode('ascii')}"
            target = f" to {_quoted(origin, limit=120)}"
        except (httpx.InvalidURL, UnicodeDecodeError, ValueError):
            target = " to a URL that cannot be parsed"
    return (
        f"HTTP {response.status_code}: the payment gateway redirected{target}; redirects are not followed "
        "(the API key would go with them): set PAYMENT_GATEWAY_URL to the final URL"
    )


def _post(events: list[UsageEvent]) -> _Outcome:
    headers = {"Content-Type": "application/json"}
    if settings.USAGE_INGEST_API_KEY:
        headers["Authorization"] = f"Bearer {settings.USAGE_INGEST_API_KEY}"
    try:
        # A total deadline, not httpx's per-read timeout: a gateway that drips its answer
        # kept the POST going past the lease, and another worker sent the events again.
        with (
            deadline_client(total_s=settings.USAGE_DELIVERY_TIMEOUT_S, max_bytes=None) as client,
            client.stream(
                "POST",
                settings.PAYMENT_GATEWAY_URL or "",
                json={"events": [e.payload() for e in events]},
                headers=headers,
                follow_redirects=False,  # the default, stated: see _redirect_reason
            ) as response,
        ):
            # A 2xx is the gateway's receipt whatever its body says: the body is not
            # read, so a slow one can neither fail a delivered batch nor send it again.
            if response.is_success:
                return _Outcome("ok")
            body = response_head(response, max_bytes=_QUOTED_BODY_BYTES)
    except httpx.TimeoutException:
        return _Outcome("retry", "timeout")
    except httpx.HTTPError as exc:
        return _Outcome("retry", f"connection error ({type(exc).__name__})")
    except (httpx.InvalidURL, ValueError):
        # A gateway URL httpx cannot use (an operator's typo) raised out of the task and
        # left the batch claimed until its lease ran out, on every run; staff see this.
        return _Outcome("retry", BAD_GATEWAY_URL)
    if 300 <= response.status_code < 400:
        return _Outcome("retry", _redirect_reason(response))
    text = body.decode(response.encoding or "utf-8", errors="replace")
    said = _quoted(text, limit=_QUOTED_BODY_CHARS)
    refusal = _KEY_REFUSED.get(response.status_code)
    if refusal:
        said = f"{refusal}; the events wait and go once it is fixed." + (f" It said: {said}" if said else "")
    reason = f"HTTP {response.status_code}: {said}".rstrip()
    refused = 400 <= response.status_code < 500 and response.status_code not in _NOT_ABOUT_THE_EVENTS
    return _Outcome("refused" if refused else "retry", reason)


def _superseded(count: int, report: DeliveryReport) -> None:
    if count <= 0:
        return
    report.superseded += count
    # Not an error in itself (the other worker settles them, and `request_id` lets the
    # gateway drop a second copy), but it means the lease is short for this gateway.
    logger.warning(
        "usage delivery: %d event(s) were claimed by another worker before this one settled them "
        "(USAGE_CLAIM_LEASE_S=%s, USAGE_DELIVERY_TIMEOUT_S=%s)",
        count,
        settings.USAGE_CLAIM_LEASE_S,
        settings.USAGE_DELIVERY_TIMEOUT_S,
    )


def _settle(claim: _Claim, events: list[UsageEvent], outcome: _Outcome, report: DeliveryReport) -> None:
    """Record the outcome on the rows this claim still holds, and only those."""
    now = timezone.now()
    reason = outcome.reason[:_LAST_ERROR_CHARS]
    rows = UsageEvent.objects.filter(pk__in=[e.pk for e in events], claim_token=claim.token)
    released = {"claimed_until": None, "claim_token": None, "updated_at": now}
    if outcome.kind == "ok":
        settled = rows.update(status=UsageEvent.Status.DELIVERED, delivered_at=now, last_error="", **released)
        report.delivered += settled
    elif outcome.kind == "refused":
        settled = rows.update(status=UsageEvent.Status.FAILED, last_error=reason, **released)
        report.failed += settled
    else:
        settled = 0
        for event in events:
            due = now + _backoff(event.attempts + 1)  # the claim counted this attempt
            settled += rows.filter(pk=event.pk).update(next_attempt_at=due, last_error=reason, **released)
        report.retrying += settled
    if settled and outcome.kind != "ok":
        report.errors.append(reason)
    _superseded(len(events) - settled, report)


def _release(claim: _Claim, events: list[UsageEvent], report: DeliveryReport) -> None:
    """Give back events this claim did not send: due again at once, and the attempt the
    claim counted is taken back (none was made)."""
    released = UsageEvent.objects.filter(pk__in=[e.pk for e in events], claim_token=claim.token).update(
        claimed_until=None, claim_token=None, attempts=F("attempts") - 1, updated_at=timezone.now()
    )
    report.released += released
    _superseded(len(events) - released, report)


def _deliver(claim: _Claim, report: DeliveryReport) -> None:
    events = claim.events
    # The first POST comes straight after the claim, with the whole lease ahead of it.
    outcome = _post(events)
    if outcome.kind != "refused" or len(events) == 1:
        _settle(claim, events, outcome, report)
        return
    # One bad event must not fail its neighbours: find it by sending one at a time, but
    # only while the lease lasts. Past it another worker may claim and send the same
    # events, so the rest are given back and the next claim (a fresh lease) goes on.
    for index, event in enumerate(events):
        if not claim.can_post():
            if index == 0:
                # Not one could go: the lease is too short for this gateway. Giving them
                # back would send the refused batch again at once, so they wait instead.
                short = f"{outcome.reason[:300]} (the lease ran short before the refused event was found)"
                _settle(claim, events, _Outcome("retry", short), report)
            else:
                _release(claim, events[index:], report)
            return
        _settle(claim, [event], _post([event]), report)


def usage_events_deliver(*, batch_size: int | None = None, max_batches: int = 100) -> DeliveryReport:
    """Send due events to the payment gateway in batches. Safe to run concurrently: an
    event is sent only by the worker whose lease on it is running, and settled only if
    that worker still holds it."""
    report = DeliveryReport()
    if not settings.PAYMENT_GATEWAY_URL:
        UsageEvent.objects.filter(status=UsageEvent.Status.PENDING).exclude(last_error=NO_GATEWAY).update(
            last_error=NO_GATEWAY
        )
        return report
    for _ in range(max_batches):
        claim = _claim_batch(limit=batch_size or settings.USAGE_BATCH_SIZE)
        if claim is None:
            break
        _deliver(claim, report)
    return report


def usage_events_retry(*, event_ids: list[int]) -> int:
    """Staff action: put failed (or stuck) events back in the queue, due now."""
    updated = (
        UsageEvent.objects.filter(pk__in=event_ids)
        .exclude(status=UsageEvent.Status.DELIVERED)
        # A worker is sending these right now: clearing its claim would let another
        # worker send them too. Stuck means the lease ran out.
        .exclude(claimed_until__gte=Now())
        .update(status=UsageEvent.Status.PENDING, next_attempt_at=timezone.now(), claimed_until=None, claim_token=None)
    )
    if updated:
        transaction.on_commit(_enqueue_delivery)
    return updated
