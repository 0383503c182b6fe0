"""Usage events: recorded with each successful call, delivered by a worker."""

from __future__ import annotations

import json
import logging
import random
import threading
import time
import unicodedata
import uuid
from collections.abc import Mapping
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
# status (_KEY_REFUSED). A pending event's 2xx reason is always an answer that was not the
# gateway's (_not_the_gateway); a 2xx rejection fails its event, and the admin looks only
# at pending ones.
BAD_GATEWAY_URL = "the payment gateway URL is not usable (PAYMENT_GATEWAY_URL)"
NEEDS_OPERATOR = (NO_GATEWAY, BAD_GATEWAY_URL, "HTTP 2", "HTTP 3", "HTTP 401", "HTTP 403", "HTTP 407")
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
    kind: str  # "ok", "retry", "refused", "partial"
    reason: str = ""
    # "partial": the events the gateway's 2xx answer rejected (request_id -> reason); the
    # rest of the batch is delivered.
    rejected: Mapping[str, str] = field(default_factory=dict)


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


# --- what a 2xx says --------------------------------------------------------------------
# The gateway's answer contract is not specified (one event per call, an outbox on 5xx), so
# a 2xx is its receipt for the whole batch unless the answer says otherwise, in one of two
# ways only:
# - its Content-Type is an HTML page: a captive portal, a proxy's sign-in or error page,
#   or a URL pointing at a website, answering 200 for a gateway it never reached. Nothing
#   was delivered: the events wait (retried with the capped backoff) and staff see why.
# - it is JSON, an object whose "rejected" or "failed" field lists events: each item a
#   request_id, or an object {"request_id": ..., "error": ...} ("reason" or "message" are
#   read when "error" is absent). Those events fail with the gateway's reason (staff
#   re-queue them from the admin); the rest are delivered. A field that rejects something
#   without naming an event of the batch (a count, an id we did not send, an item we
#   cannot read) fails the one event of a single-event batch, and a batch is sent again
#   one event at a time (as after a 4xx) so that each answer names its own event.
# Any other 2xx (no body, empty lists, text, JSON without those fields, JSON that does not
# parse) is delivered as before: an unreadable answer must not bill a batch twice.
_HTML = frozenset(("text/html", "application/xhtml+xml"))
_REJECTION_FIELDS = {"rejected": "rejected this event", "failed": "reported this event as failed"}
# A rejection list for a whole batch (100 events of id and reason) is well under this.
_JSON_ANSWER_BYTES = 1024 * 1024


def _media_type(response: httpx.Response) -> str:
    return response.headers.get("content-type", "").split(";", 1)[0].strip().lower()


def _not_the_gateway(response: httpx.Response, media_type: str) -> _Outcome:
    return _Outcome(
        "retry",
        f"HTTP {response.status_code}: the answer is an HTML page ({media_type}), not the payment gateway's: a "
        "proxy or captive portal is in the way, or PAYMENT_GATEWAY_URL points at a website; the events were not "
        "delivered and are retried",
    )


def _canonical_id(value: object) -> str | None:
    if not isinstance(value, str):
        return None
    try:
        return str(uuid.UUID(value))
    except ValueError:
        return None


def _rejected_item(item: object) -> tuple[str | None, str]:
    """(the request_id named, the gateway's reason) of one rejection list item."""
    if not isinstance(item, dict):
        return _canonical_id(item), ""
    error = next((item[k] for k in ("error", "reason", "message") if item.get(k) not in (None, "")), "")
    text = error if isinstance(error, str) else json.dumps(error, ensure_ascii=False)
    return _canonical_id(item.get("request_id")), text


def _answer_outcome(status: int, answer: object, events: list[UsageEvent]) -> _Outcome:
    """What a 2xx JSON answer says about each event of the batch (see above)."""
    if not isinstance(answer, dict):
        return _Outcome("ok")
    ours = {str(e.request_id) for e in events}
    rejected: dict[str, str] = {}
    unnamed: list[str] = []
    for name, says in _REJECTION_FIELDS.items():
        value = answer.get(name)
        if not value:  # absent, null, 0, false, "" or an empty list: nothing rejected
            continue
        for item in value if isinstance(value, list) else [None]:
            request_id, error = _rejected_item(item)
            if request_id not in ours:
                unnamed.append(name)
                continue
            said = _quoted(error, limit=_QUOTED_BODY_CHARS)
            rejected.setdefault(request_id, f"HTTP {status}: the payment gateway {says}: {said or '(no reason given)'}")
    if unnamed:
        fields = " and ".join(f'"{name}"' for name in dict.fromkeys(unnamed))
        return _Outcome(
            "refused",
            f"HTTP {status}: the payment gateway's answer rejects events in {fields} without naming one that was "
            "sent (a count, an id we did not send, or an item that is not an id)",
        )
    return _Outcome("partial", rejected=rejected) if rejected else _Outcome("ok")


def _accepted(response: httpx.Response, events: list[UsageEvent]) -> _Outcome:
    """The outcome of a 2xx: read inside the POST's deadline, and only when it is JSON."""
    media_type = _media_type(response)
    if media_type in _HTML:
        return _not_the_gateway(response, media_type)
    if media_type != "application/json" and not media_type.endswith("+json"):
        return _Outcome("ok")
    try:
        body = response_head(response, max_bytes=_JSON_ANSWER_BYTES + 1)
    except httpx.HTTPError as exc:  # the deadline passed, or the connection dropped
        body, unread = b"", type(exc).__name__
    else:
        unread = "too large" if len(body) > _JSON_ANSWER_BYTES else ""
    if unread:
        # The status is the receipt: sending the batch again for an answer we could not
        # read is what the deadline is there to prevent.
        logger.warning(
            "usage delivery: HTTP %d accepted %d event(s); its answer was not read whole (%s), so any rejection "
            "in it is not seen",
            response.status_code,
            len(events),
            unread,
        )
        return _Outcome("ok")
    try:
        answer = json.loads(body)
    except ValueError:
        return _Outcome("ok")
    return _answer_outcome(response.status_code, answer, events)


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
            # A 2xx is the gateway's receipt unless its answer says otherwise (_accepted);
            # a body that is slow or too large is not waited for and delivers the batch.
            if response.is_success:
                return _accepted(response, events)
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
    elif outcome.kind == "partial":
        refused = {e.pk: outcome.rejected[str(e.request_id)] for e in events if str(e.request_id) in outcome.rejected}
        delivered = rows.exclude(pk__in=refused).update(
            status=UsageEvent.Status.DELIVERED, delivered_at=now, last_error="", **released
        )
        report.delivered += delivered
        settled = delivered
        for pk, why in refused.items():
            failed = rows.filter(pk=pk).update(
                status=UsageEvent.Status.FAILED, last_error=why[:_LAST_ERROR_CHARS], **released
            )
            settled += failed
            report.failed += failed
            if failed:
                report.errors.append(why[:_LAST_ERROR_CHARS])
    elif outcome.kind == "refused":
        settled = rows.update(status=UsageEvent.Status.FAILED, last_error=reason, **released)
        report.failed += settled
    else:
        settled = 0
        for event in events:
            due = now + _backoff(event.attempts + 1)  # the claim counted this attempt
            settled += rows.filter(pk=event.pk).update(next_attempt_at=due, last_error=reason, **released)
        report.retrying += settled
    if settled and outcome.kind not in ("ok", "partial"):
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
