"""Usage delivery holds each event only while its lease lasts, settles only what it still
holds, and reports a redirecting or garbling gateway plainly. The gateway is a real HTTP
server on 127.0.0.1 (the session's fake gateway, or a raw one for bytes JSON cannot carry).
"""

from __future__ import annotations

import json
import threading
import time
import unicodedata
from collections import Counter
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.db import connection
from django.utils import timezone

from billing.models import UsageEvent
from billing.services import (
    DeliveryReport,
    _claim_batch,
    _Outcome,
    _settle,
    usage_events_deliver,
    usage_events_retry,
)
from tests.conftest import GATEWAY_KEY

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def gateway(fake_gateway, settings):
    settings.PAYMENT_GATEWAY_URL = f"{fake_gateway.url}/usage"
    settings.USAGE_INGEST_API_KEY = GATEWAY_KEY
    settings.USAGE_RETRY_BASE_S = 0.05
    settings.USAGE_RETRY_MAX_S = 0.2
    return fake_gateway


def _events(n: int) -> list[UsageEvent]:
    return [UsageEvent.objects.create(user_id="42", operation="remember", channel="rest") for _ in range(n)]


def _slowed(gateway, monkeypatch, delay_s: float) -> None:
    """Every answer of the fake gateway, refusals included, takes `delay_s`."""
    answer = gateway.handle

    def slow(method, path, headers, payload):
        time.sleep(delay_s)
        return answer(method, path, headers, payload)

    monkeypatch.setattr(gateway, "handle", slow)


def _sent_ids(gateway) -> list[str]:
    """Every event in every POST that reached the gateway, accepted or refused."""
    return [e["request_id"] for r in list(gateway.requests) for e in r["json"]["events"]]


def test_a_slow_refusing_gateway_with_a_short_lease_bills_each_event_once(gateway, settings, monkeypatch):
    """The batch is refused (one poisoned event) and the one-by-one fallback is slower than
    the lease. Two delivery loops run at once, as two workers' sweeps would: whoever holds
    an event sends it; nobody sends an event whose lease ran out, nor settles it."""
    settings.USAGE_CLAIM_LEASE_S = 2.5
    settings.USAGE_DELIVERY_TIMEOUT_S = 0.5  # a POST may take up to 2 x 0.5 s (connect + answer)
    _slowed(gateway, monkeypatch, 0.4)
    events = _events(8)
    poisoned = events[0]  # found first: every other event goes one by one after it
    gateway.refuse_ids = {str(poisoned.request_id)}
    reports: list[DeliveryReport] = []
    errors: list[BaseException] = []

    def worker(start_after: float) -> None:
        try:
            time.sleep(start_after)
            ends = time.monotonic() + 20
            while time.monotonic() < ends and UsageEvent.objects.filter(status="pending").exists():
                reports.append(usage_events_deliver())
                time.sleep(0.05)
        except BaseException as exc:  # surfaced below, not lost with the thread
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=worker, args=(delay,)) for delay in (0.0, 0.1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors and not any(t.is_alive() for t in threads)

    accepted = Counter(gateway.received_ids())
    others = {str(e.request_id) for e in events[1:]}
    assert set(accepted) == others and set(accepted.values()) == {1}, "an event was billed twice"
    # Nor was any event sent on its own twice (a refused batch that carried the poisoned
    # event is the only way an event reaches the gateway more than once, never accepted).
    alone = Counter(r["json"]["events"][0]["request_id"] for r in gateway.requests if len(r["json"]["events"]) == 1)
    assert set(alone.values()) <= {1}, alone
    rows = {str(e.request_id): e for e in UsageEvent.objects.all()}
    assert rows[str(poisoned.request_id)].status == "failed"
    assert rows[str(poisoned.request_id)].last_error.startswith("HTTP 422")
    assert {rows[rid].status for rid in others} == {"delivered"}
    assert not UsageEvent.objects.filter(claimed_until__isnull=False).exists()
    # Events given back unsent did not spend an attempt: each was decided by one POST of its own
    # or by one accepted batch.
    assert set(UsageEvent.objects.values_list("attempts", flat=True)) == {1}
    assert sum(r.delivered for r in reports) == 7 and sum(r.failed for r in reports) == 1
    # The fallback really outran the lease: it stopped, gave events back, and nobody
    # settled an event another worker had claimed.
    assert sum(r.released for r in reports) > 0 and sum(r.superseded for r in reports) == 0


def test_a_stale_worker_does_not_settle_events_claimed_again(gateway):
    """Worker A's lease ran out mid-POST and worker B claimed the events: A's outcome,
    arriving late, changes nothing; B's settles them."""
    _events(2)
    stale = _claim_batch(limit=10)
    assert stale is not None and len(stale.events) == 2
    ids = [e.pk for e in stale.events]
    assert usage_events_retry(event_ids=ids) == 0  # staff cannot pull events out of a live claim
    UsageEvent.objects.update(claimed_until=timezone.now() - timedelta(seconds=1))  # A's lease ran out
    fresh = _claim_batch(limit=10)
    assert fresh is not None and {e.pk for e in fresh.events} == {e.pk for e in stale.events}

    late = DeliveryReport()
    _settle(stale, stale.events, _Outcome("refused", "HTTP 422: too late"), late)
    assert (late.failed, late.superseded) == (0, 2)
    rows = list(UsageEvent.objects.values_list("status", "last_error", "claim_token", "attempts"))
    assert rows == [("pending", "", fresh.token, 2)] * 2

    report = DeliveryReport()
    _settle(fresh, fresh.events, _Outcome("ok"), report)
    assert report.delivered == 2
    assert list(UsageEvent.objects.values_list("status", "claim_token")) == [("delivered", None)] * 2


def test_a_redirecting_gateway_keeps_events_pending_and_says_so(gateway, admin_client, caplog, settings):
    # Not due again within one run (the fixture's 0.05 s backoff let a slow run send the
    # same events again and count them twice): each run below makes them due itself.
    settings.USAGE_RETRY_BASE_S = settings.USAGE_RETRY_MAX_S = 600
    target = "https://elsewhere.example:8443/v2/usage?token=s3cret-in-the-query"
    answer = gateway.handle
    gateway.handle = lambda method, path, headers, payload: (302, target)  # noqa: ARG005
    try:
        events = _events(3)
        before = timezone.now()
        report = usage_events_deliver()
    finally:
        gateway.handle = answer

    assert (report.retrying, report.delivered, report.failed) == (3, 0, 0)
    assert len(gateway.requests) == 1  # not followed: the key went to the configured URL only
    rows = list(UsageEvent.objects.all())
    assert {e.status for e in rows} == {"pending"} and {e.attempts for e in rows} == {1}
    assert all(e.claimed_until is None and e.next_attempt_at > before for e in rows)
    reason = rows[0].last_error
    assert "HTTP 302" in reason and "redirect" in reason and "PAYMENT_GATEWAY_URL" in reason
    assert "https://elsewhere.example:8443" in reason  # where it points, for the operator
    assert "s3cret" not in reason and "/v2/usage" not in reason and GATEWAY_KEY not in reason
    assert "s3cret" not in caplog.text and GATEWAY_KEY not in caplog.text

    # Still retried (with the capped backoff), never dropped, and shown where staff look.
    UsageEvent.objects.update(next_attempt_at=timezone.now())
    gateway.handle = lambda method, path, headers, payload: (301, target)  # noqa: ARG005
    try:
        assert usage_events_deliver().retrying == 3
    finally:
        gateway.handle = answer
    assert set(UsageEvent.objects.values_list("status", "attempts")) == {("pending", 2)}
    page = admin_client.get("/admin/billing/usageevent/")
    shown = [str(m) for m in page.context["messages"]]
    assert any("redirect" in m and "PAYMENT_GATEWAY_URL" in m for m in shown), shown

    UsageEvent.objects.update(next_attempt_at=timezone.now())
    assert usage_events_deliver().delivered == 3  # the gateway is fixed: everything goes
    assert sorted(gateway.received_ids()) == sorted(str(e.request_id) for e in events)


@pytest.mark.parametrize("status", [401, 403, 407])
def test_a_refused_key_is_named_above_the_outbox(gateway, admin_client, settings, status):
    """A 401/403/407 put the events back to wait, but the admin named only a missing or
    unusable gateway and redirects above the list: staff saw nothing until they opened a
    row, and nothing went until the key was fixed."""
    settings.USAGE_RETRY_BASE_S = settings.USAGE_RETRY_MAX_S = 600  # not due again in this run
    _events(3)
    gateway.answer_status = status
    report = usage_events_deliver()

    assert (report.retrying, report.delivered, report.failed) == (3, 0, 0)
    reason = UsageEvent.objects.values_list("last_error", flat=True).first()
    assert reason.startswith(f"HTTP {status}: ") and "answered as configured" in reason  # the gateway's own text
    assert "refused" in reason and GATEWAY_KEY not in reason
    if status != 407:
        assert "refused our key" in reason and "USAGE_INGEST_API_KEY" in reason
    page = admin_client.get("/admin/billing/usageevent/")
    shown = [str(m) for m in page.context["messages"]]
    assert shown == [f"Usage events are not being delivered: {reason}"]

    gateway.answer_status = None  # the operator's fix: the next run delivers them all
    UsageEvent.objects.update(next_attempt_at=timezone.now())
    assert usage_events_deliver().delivered == 3


def test_a_busy_gateway_is_not_named_above_the_outbox(gateway, admin_client, settings):
    """A 429 or 408 is the gateway's timing, not the operator's: the events wait, quietly."""
    settings.USAGE_RETRY_BASE_S = settings.USAGE_RETRY_MAX_S = 600
    _events(1)
    gateway.answer_status = 429
    assert usage_events_deliver().retrying == 1
    assert [str(m) for m in admin_client.get("/admin/billing/usageevent/").context["messages"]] == []


class _RawGateway:
    """Answers every POST with the given status and raw body bytes (JSON would escape them)."""

    def __init__(self, status: int, body: bytes, content_type: str | None = "text/plain; charset=utf-8") -> None:
        raw = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):  # noqa: N802 - http.server API
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                raw.posts += 1
                self.send_response(raw.status)
                if raw.content_type:
                    self.send_header("Content-Type", raw.content_type)
                self.send_header("Content-Length", str(len(raw.body)))
                self.end_headers()
                self.wfile.write(raw.body)

        self.status, self.body, self.content_type, self.posts = status, body, content_type, 0
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/usage"

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


GARBLED = (
    "bad\x00 request\x1b[2J\x1b[31m red\r\nX-Injected: 1\u202e\u200bgnirts tupni "
    f"Authorization: Bearer {GATEWAY_KEY} key={GATEWAY_KEY} msk_abc123_secretpart"
).encode()


@pytest.mark.parametrize(("status", "kind"), [(422, "failed"), (503, "pending")])
def test_the_gateway_error_body_is_quoted_without_control_characters_or_secrets(
    settings, admin_client, caplog, status, kind
):
    raw = _RawGateway(status, GARBLED)
    settings.PAYMENT_GATEWAY_URL = raw.url
    settings.USAGE_INGEST_API_KEY = GATEWAY_KEY
    try:
        _events(1)
        report = usage_events_deliver()
    finally:
        raw.stop()

    assert (report.failed, report.retrying) == ((1, 0) if kind == "failed" else (0, 1))
    event = UsageEvent.objects.get()
    assert event.status == kind and event.claimed_until is None
    reason = event.last_error
    assert reason.startswith(f"HTTP {status}: bad request")
    assert not [c for c in reason if unicodedata.category(c) in ("Cc", "Cf")], repr(reason)
    assert GATEWAY_KEY not in reason and "secretpart" not in reason
    assert "X-Injected: 1" in reason  # the text stays readable, on one line
    assert GATEWAY_KEY not in caplog.text and "\x1b" not in caplog.text
    page = admin_client.get("/admin/billing/usageevent/")
    assert page.status_code == 200 and b"\x1b" not in page.content


# --- what a 2xx says ---------------------------------------------------------------------------
@pytest.fixture
def no_retry_within_a_run(settings):
    settings.USAGE_RETRY_BASE_S = settings.USAGE_RETRY_MAX_S = 600


def _answered(status: int, body: bytes, content_type: str | None, settings) -> tuple[DeliveryReport, int]:
    """One delivery run against a gateway giving this one answer: (report, POSTs made)."""
    raw = _RawGateway(status, body, content_type)
    settings.PAYMENT_GATEWAY_URL = raw.url
    settings.USAGE_INGEST_API_KEY = GATEWAY_KEY
    try:
        return usage_events_deliver(), raw.posts
    finally:
        raw.stop()


@pytest.mark.usefixtures("no_retry_within_a_run")
@pytest.mark.parametrize("content_type", ["text/html; charset=utf-8", "application/xhtml+xml", "TEXT/HTML"])
def test_a_2xx_html_page_is_not_a_delivery(settings, admin_client, fake_gateway, content_type):
    """A captive portal or proxy answering 200 "Sign in to the network" marked every event
    delivered: never sent again, and missing from the outbox gauges and the admin."""
    events = _events(3)
    report, posts = _answered(200, b"<html><body>Sign in to the network</body></html>", content_type, settings)

    assert (report.retrying, report.delivered, report.failed, posts) == (3, 0, 0, 1)
    rows = list(UsageEvent.objects.all())
    assert {(e.status, e.claimed_until) for e in rows} == {("pending", None)}
    reason = rows[0].last_error
    assert reason.startswith("HTTP 200: the answer is an HTML page (") and "not the payment gateway" in reason
    shown = [str(m) for m in admin_client.get("/admin/billing/usageevent/").context["messages"]]
    assert shown == [f"Usage events are not being delivered: {reason}"]

    settings.PAYMENT_GATEWAY_URL = f"{fake_gateway.url}/usage"  # the network is fixed
    UsageEvent.objects.update(next_attempt_at=timezone.now())
    assert usage_events_deliver().delivered == 3
    assert sorted(fake_gateway.received_ids()) == sorted(str(e.request_id) for e in events)


@pytest.mark.usefixtures("no_retry_within_a_run")
@pytest.mark.parametrize("field", ["rejected", "failed"])
@pytest.mark.parametrize("shape", ["ids", "objects"])
def test_a_2xx_naming_rejected_events_fails_those_and_delivers_the_rest(settings, fake_gateway, field, shape):
    """A JSON 200 listing rejected event ids marked the whole batch delivered."""
    kept, *refused = _events(3)
    ids = [str(e.request_id) for e in refused]
    if shape == "ids":
        listed: list = [ids[0], ids[1].upper()]  # a UUID in any case names the event
    else:
        listed = [
            {"request_id": ids[0], "error": f"unknown user\u001b[2J key={GATEWAY_KEY}"},
            {"request_id": ids[1], "reason": {"code": "no_account"}},
        ]
    body = json.dumps({"accepted": 1, field: listed}).encode()
    report, posts = _answered(200, body, "application/json; charset=utf-8", settings)

    assert (report.delivered, report.failed, report.retrying, posts) == (1, 2, 0, 1)
    kept.refresh_from_db()
    assert (kept.status, kept.last_error) == ("delivered", "")
    failed = {str(e.request_id): e for e in UsageEvent.objects.filter(status="failed")}
    assert set(failed) == set(ids) and all(e.claimed_until is None for e in failed.values())
    says = "rejected this event" if field == "rejected" else "reported this event as failed"
    for event in failed.values():
        assert event.last_error.startswith(f"HTTP 200: the payment gateway {says}: ")
    if shape == "objects":
        assert "unknown user" in failed[ids[0]].last_error and GATEWAY_KEY not in failed[ids[0]].last_error
        assert "\x1b" not in failed[ids[0]].last_error
        assert "no_account" in failed[ids[1]].last_error
    else:
        assert failed[ids[0]].last_error.endswith("(no reason given)")

    # Staff re-queue them from the admin; a gateway that takes them now delivers them.
    settings.PAYMENT_GATEWAY_URL = f"{fake_gateway.url}/usage"
    assert usage_events_retry(event_ids=[e.pk for e in failed.values()]) == 2
    assert usage_events_deliver().delivered == 2
    assert sorted(fake_gateway.received_ids()) == sorted(ids)


@pytest.mark.usefixtures("no_retry_within_a_run")
@pytest.mark.parametrize("unnamed", [1, True, ["00000000-0000-4000-8000-000000000000"], ["not an id"]])
def test_a_2xx_rejecting_events_it_does_not_name_finds_them_one_at_a_time(gateway, monkeypatch, unnamed):
    """A count of rejected events (or an id we did not send) names none: the batch is sent
    one event at a time, as after a 4xx, and only the event rejected on its own fails."""
    events = _events(3)
    poisoned = str(events[1].request_id)

    def answer(method, path, headers, payload):  # noqa: ARG001
        sent = [e["request_id"] for e in payload["events"]]
        if poisoned in sent:
            return 200, {"accepted": len(sent) - 1, "rejected": unnamed}
        return 200, {"accepted": len(sent), "rejected": []}

    monkeypatch.setattr(gateway, "handle", answer)
    report = usage_events_deliver()

    assert (report.delivered, report.failed, report.retrying) == (2, 1, 0)
    assert len(gateway.requests) == 4  # the batch, then each event on its own
    event = UsageEvent.objects.get(request_id=poisoned)
    assert event.status == "failed"
    assert event.last_error.startswith('HTTP 200: the payment gateway\'s answer rejects events in "rejected"')


@pytest.mark.parametrize(
    ("status", "body", "content_type"),
    [
        (200, b'{"accepted": 3}', "application/json"),
        (200, b'{"accepted": 3, "rejected": [], "failed": 0}', "application/json"),
        (202, b'{"status": "queued"}', "application/vnd.gateway+json"),
        (200, b"not json", "application/json"),
        (200, b'["a list"]', "application/json"),
        (200, b"OK", "text/plain"),
        (204, b"", None),
    ],
)
def test_any_other_2xx_delivers_the_batch(settings, status, body, content_type):
    _events(3)
    report, posts = _answered(status, body, content_type, settings)
    assert (report.delivered, report.failed, report.retrying, posts) == (3, 0, 0, 1)
    assert set(UsageEvent.objects.values_list("status", "last_error")) == {("delivered", "")}
