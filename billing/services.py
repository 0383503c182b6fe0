"""Usage events: recorded with each successful call, delivered by a worker."""

from __future__ import annotations

import logging
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import httpx
from django.conf import settings
from django.db import transaction
from django.db.models import F, Q
from django.utils import timezone

from billing.models import UsageEvent
from billing.tasks import deliver_usage_events as deliver_usage_events_task
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
@dataclass
class DeliveryReport:
    delivered: int = 0
    retrying: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)


def _backoff(attempts: int) -> timedelta:
    base = settings.USAGE_RETRY_BASE_S * 2 ** max(0, attempts - 1)
    return timedelta(seconds=min(settings.USAGE_RETRY_MAX_S, base) * random.uniform(0.5, 1.5))  # noqa: S311


def _due(now: datetime) -> Q:
    return Q(status=UsageEvent.Status.PENDING, next_attempt_at__lte=now) & (
        Q(claimed_until__isnull=True) | Q(claimed_until__lt=now)
    )


def _claim_batch(limit: int) -> list[UsageEvent]:
    """Lease up to `limit` due events to this worker (SKIP LOCKED: workers never share)."""
    now = timezone.now()
    with transaction.atomic():
        events = list(UsageEvent.objects.select_for_update(skip_locked=True).filter(_due(now)).order_by("id")[:limit])
        if events:
            UsageEvent.objects.filter(pk__in=[e.pk for e in events]).update(
                claimed_until=now + timedelta(seconds=settings.USAGE_CLAIM_LEASE_S), attempts=F("attempts") + 1
            )
    return events


@dataclass(frozen=True)
class _Outcome:
    kind: str  # "ok", "retry", "refused"
    reason: str = ""


def _post(events: list[UsageEvent]) -> _Outcome:
    headers = {"Content-Type": "application/json"}
    if settings.USAGE_INGEST_API_KEY:
        headers["Authorization"] = f"Bearer {settings.USAGE_INGEST_API_KEY}"
    try:
        response = httpx.post(
            settings.PAYMENT_GATEWAY_URL or "",
            json={"events": [e.payload() for e in events]},
            headers=headers,
            timeout=settings.USAGE_DELIVERY_TIMEOUT_S,
        )
    except httpx.TimeoutException:
        return _Outcome("retry", "timeout")
    except httpx.HTTPError as exc:
        return _Outcome("retry", f"connection error ({type(exc).__name__})")
    except (httpx.InvalidURL, ValueError):
        # A gateway URL httpx cannot use (an operator's typo) raised out of the task and
        # left the batch claimed until its lease ran out, on every run; staff see this.
        return _Outcome("retry", "the payment gateway URL is not usable (PAYMENT_GATEWAY_URL)")
    if response.is_success:
        return _Outcome("ok")
    reason = f"HTTP {response.status_code}: {response.text[:200]}"
    return _Outcome("refused" if 400 <= response.status_code < 500 and response.status_code != 429 else "retry", reason)


def _settle(events: list[UsageEvent], outcome: _Outcome, report: DeliveryReport) -> None:
    now = timezone.now()
    ids = [e.pk for e in events]
    rows = UsageEvent.objects.filter(pk__in=ids)
    if outcome.kind == "ok":
        rows.update(
            status=UsageEvent.Status.DELIVERED, delivered_at=now, claimed_until=None, last_error="", updated_at=now
        )
        report.delivered += len(events)
        return
    if outcome.kind == "refused":
        rows.update(status=UsageEvent.Status.FAILED, claimed_until=None, last_error=outcome.reason, updated_at=now)
        report.failed += len(events)
        report.errors.append(outcome.reason)
        return
    for event in events:
        due = now + _backoff(event.attempts + 1)  # the claim counted this attempt
        UsageEvent.objects.filter(pk=event.pk).update(
            next_attempt_at=due, claimed_until=None, last_error=outcome.reason, updated_at=now
        )
    report.retrying += len(events)
    report.errors.append(outcome.reason)


def _deliver(events: list[UsageEvent], report: DeliveryReport) -> None:
    outcome = _post(events)
    if outcome.kind == "refused" and len(events) > 1:
        # One bad event must not fail its neighbours: find it by sending one at a time.
        for event in events:
            _settle([event], _post([event]), report)
        return
    _settle(events, outcome, report)


def usage_events_deliver(*, batch_size: int | None = None, max_batches: int = 100) -> DeliveryReport:
    """Send due events to the payment gateway in batches. Safe to run concurrently."""
    report = DeliveryReport()
    if not settings.PAYMENT_GATEWAY_URL:
        UsageEvent.objects.filter(status=UsageEvent.Status.PENDING).exclude(last_error=NO_GATEWAY).update(
            last_error=NO_GATEWAY
        )
        return report
    for _ in range(max_batches):
        events = _claim_batch(batch_size or settings.USAGE_BATCH_SIZE)
        if not events:
            break
        _deliver(events, report)
    return report


def usage_events_retry(*, event_ids: list[int]) -> int:
    """Staff action: put failed (or stuck) events back in the queue, due now."""
    updated = (
        UsageEvent.objects.filter(pk__in=event_ids)
        .exclude(status=UsageEvent.Status.DELIVERED)
        .update(status=UsageEvent.Status.PENDING, next_attempt_at=timezone.now(), claimed_until=None)
    )
    if updated:
        transaction.on_commit(_enqueue_delivery)
    return updated
