"""Exactly one usage event per successful call, delivered through the outbox by a real
worker to a real (fake) payment gateway on loopback."""

from __future__ import annotations

import signal
import threading
import uuid
from collections import Counter
from contextlib import contextmanager

import pytest
from django.utils import timezone

from billing.models import UsageEvent
from billing.services import NO_GATEWAY, usage_events_deliver, usage_events_retry
from billing.tasks import deliver_usage_events
from tests.conftest import GATEWAY_KEY, wait_for

pytestmark = pytest.mark.slow


@contextmanager
def beat_sweep(interval: float = 0.5):
    """Stand-in for celery beat's minute sweep, at test speed."""
    stop = threading.Event()

    def sweep():
        while not stop.wait(interval):
            deliver_usage_events.delay()

    thread = threading.Thread(target=sweep, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _outbox_ids() -> list[str]:
    return [str(r) for r in UsageEvent.objects.values_list("request_id", flat=True)]


def _all_delivered(gateway) -> bool:
    pending = UsageEvent.objects.exclude(status=UsageEvent.Status.DELIVERED).exists()
    return not pending and set(gateway.received_ids()) == set(_outbox_ids())


def test_one_event_per_successful_call_and_none_for_failures(
    mcp_as, api_client, alice, bob, alice_key, bob_key, fake_gateway, billing_worker
):
    expected: Counter = Counter()
    calls = 0

    def mcp_call(user, key, tool, arguments):
        nonlocal calls
        calls += 1
        result = mcp_as(key).call(tool, arguments)
        if not result.is_error:
            expected[(str(user.pk), tool)] += 1
        return result

    def rest_call(user, key, method, path, body, operation):
        nonlocal calls
        calls += 1
        response = getattr(api_client(key), method)(path, body, format="json")
        if response.status_code < 400:
            expected[(str(user.pk), operation)] += 1
        return response

    memory_id = mcp_call(alice, alice_key, "remember", {"memory": "Alice surfs in Ericeira"}).structured_content["id"]
    mcp_call(alice, alice_key, "remember", {"memory": "Alice surfs in Ericeira"})  # duplicate: still a success
    mcp_call(alice, alice_key, "search_memory", {"query": "surf"})
    mcp_call(alice, alice_key, "search_memory", {"query": "surf", "top_k": 500})  # invalid
    mcp_call(alice, alice_key, "update_memory", {"memory_id": memory_id, "pinned": True})
    mcp_call(bob, bob_key, "update_memory", {"memory_id": memory_id, "pinned": False})  # not_found
    mcp_call(bob, bob_key, "delete_memory", {"memory_id": memory_id})  # not_found
    mcp_call(bob, bob_key, "list_memory", {})
    mcp_call(bob, bob_key, "clear_all_memory", {})  # confirmation_required
    mcp_call(bob, bob_key, "clear_all_memory", {"confirm": True})
    mcp_call(alice, alice_key, "ingest", {"messages": [{"role": "user", "content": "hi"}], "bogus": 1})  # invalid
    rest_call(bob, bob_key, "post", "/v1/memories", {"memory": "Bob bakes bread"}, "remember")
    rest_call(bob, bob_key, "post", "/v1/memories", {"memory": ""}, "remember")  # invalid
    rest_call(bob, bob_key, "post", "/v1/memories/search", {"query": "bread"}, "search_memory")
    rest_call(alice, alice_key, "get", "/v1/memories", None, "list_memory")
    rest_call(alice, alice_key, "delete", f"/v1/memories/{uuid.uuid4()}", None, "delete_memory")  # not_found
    rest_call(alice, "msk_000000000000_bad", "get", "/v1/memories", None, "list_memory")  # 401
    rest_call(alice, alice_key, "delete", f"/v1/memories/{memory_id}", None, "delete_memory")

    billing_worker.start()
    with beat_sweep():
        wait_for(lambda: _all_delivered(fake_gateway), timeout=60, what=lambda: billing_worker.log()[-3000:])

    received = Counter((e["user_id"], e["operation"]) for e in fake_gateway.received)
    assert received == expected
    assert sum(expected.values()) == 10 and calls == 18
    assert len(fake_gateway.received_ids()) == len(set(fake_gateway.received_ids()))
    event = fake_gateway.received[0]
    assert set(event) == {"user_id", "product_id", "operation", "count", "request_id"}
    assert event["product_id"] == "memory" and event["count"] == 1
    assert fake_gateway.requests[0]["headers"]["authorization"] == f"Bearer {GATEWAY_KEY}"
    assert GATEWAY_KEY not in billing_worker.log()


def test_gateway_errors_and_a_timeout_are_retried_until_everything_arrives(
    api_client, alice, alice_key, fake_gateway, billing_worker
):
    fake_gateway.fail_next = 3
    fake_gateway.hang_next = 1
    client = api_client(alice_key)
    for i in range(10):
        assert client.post("/v1/memories", {"memory": f"Fact {i}"}, format="json").status_code == 201

    billing_worker.start()
    with beat_sweep():
        wait_for(lambda: _all_delivered(fake_gateway), timeout=90, what=lambda: billing_worker.log()[-3000:])

    assert UsageEvent.objects.count() == 10
    assert len(set(_outbox_ids())) == 10
    assert set(fake_gateway.received_ids()) == set(_outbox_ids())
    assert UsageEvent.objects.filter(attempts__gt=1).exists()  # the failures were real


def test_worker_killed_mid_delivery_loses_nothing(api_client, alice_key, fake_gateway, billing_worker):
    fake_gateway.slow_s = 4.0
    client = api_client(alice_key)
    for i in range(5):
        client.post("/v1/memories", {"memory": f"Killed fact {i}"}, format="json")

    billing_worker.start()
    deliver_usage_events.delay()
    assert fake_gateway.started.wait(60), billing_worker.log()[-3000:]
    billing_worker.stop(signal.SIGKILL)  # the POST is in flight
    assert UsageEvent.objects.filter(status=UsageEvent.Status.PENDING).count() == 5

    fake_gateway.slow_s = 0.0
    billing_worker.start()
    with beat_sweep():
        wait_for(lambda: _all_delivered(fake_gateway), timeout=90, what=lambda: billing_worker.log()[-3000:])

    received = fake_gateway.received_ids()
    assert set(received) == set(_outbox_ids()) and len(set(received)) == 5
    # Duplicates are possible (the gateway finished the killed request); ids make them harmless.
    assert all(received.count(rid) <= 2 for rid in received)


@pytest.mark.django_db(transaction=True)
def test_without_a_gateway_events_wait_then_go(api_client, alice_key, fake_gateway, settings):
    settings.PAYMENT_GATEWAY_URL = None
    client = api_client(alice_key)
    client.post("/v1/memories", {"memory": "Waiting fact"}, format="json")
    client.post("/v1/memories/search", {"query": "fact"}, format="json")

    usage_events_deliver()
    assert list(UsageEvent.objects.values_list("status", "last_error")) == [("pending", NO_GATEWAY)] * 2

    # A URL httpx cannot use is a retry with a reason staff can read, not a crashed task
    # that leaves the batch claimed.
    settings.PAYMENT_GATEWAY_URL = "http://[::1"
    report = usage_events_deliver()
    assert report.retrying == 2 and report.delivered == 0
    assert {e for _, e in UsageEvent.objects.values_list("status", "last_error")} == {
        "the payment gateway URL is not usable (PAYMENT_GATEWAY_URL)"
    }
    assert not UsageEvent.objects.filter(claimed_until__isnull=False).exists()
    UsageEvent.objects.update(next_attempt_at=timezone.now())

    settings.PAYMENT_GATEWAY_URL = f"{fake_gateway.url}/usage"
    settings.USAGE_INGEST_API_KEY = GATEWAY_KEY
    report = usage_events_deliver()
    assert report.delivered == 2
    assert set(fake_gateway.received_ids()) == set(_outbox_ids())
    assert set(UsageEvent.objects.values_list("status", flat=True)) == {"delivered"}


@pytest.mark.django_db(transaction=True)
def test_a_refused_event_is_isolated_and_retryable(api_client, alice_key, fake_gateway, settings):
    settings.PAYMENT_GATEWAY_URL = f"{fake_gateway.url}/usage"
    settings.USAGE_INGEST_API_KEY = GATEWAY_KEY
    client = api_client(alice_key)
    for i in range(3):
        client.post("/v1/memories", {"memory": f"Batch fact {i}"}, format="json")
    poisoned = UsageEvent.objects.order_by("id")[1]
    fake_gateway.refuse_ids = {str(poisoned.request_id)}

    report = usage_events_deliver()

    assert (report.delivered, report.failed) == (2, 1)
    poisoned.refresh_from_db()
    assert poisoned.status == "failed" and poisoned.last_error.startswith("HTTP 422")
    fake_gateway.refuse_ids = set()
    assert usage_events_retry(event_ids=[poisoned.pk]) == 1
    assert usage_events_deliver().delivered == 1
    assert set(fake_gateway.received_ids()) == set(_outbox_ids())


def test_the_call_that_opens_a_window_does_not_wait_for_the_broker(monkeypatch, settings):
    """Publishing the delivery task runs on the publisher thread: the commit hook returns
    while the broker is still busy, and commits meanwhile do not queue a second publish."""
    from billing import services

    started, release, published = threading.Event(), threading.Event(), []

    def slow_publish(**options):
        started.set()
        release.wait(5)
        published.append(options)

    monkeypatch.setattr(services.deliver_usage_events_task, "apply_async", slow_publish)
    monkeypatch.setattr(services, "_window_ends_at", 0.0)
    settings.USAGE_ENQUEUE_WINDOW_S = 0.0  # every commit may publish
    blocker = threading.Event()
    services._publisher.submit(blocker.wait, 5)  # holds the publisher: the next publish waits
    services._enqueue_delivery()
    services._enqueue_delivery()  # covered by the one still waiting
    blocker.set()
    assert started.wait(5) and not published
    release.set()
    services._publisher.submit(lambda: None).result(5)
    assert published == [{"countdown": None}]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("status", [401, 403, 408])
def test_a_wrong_key_keeps_the_events_waiting_for_the_fix(api_client, alice_key, fake_gateway, settings, status):
    """A 401 (our key rotated), 403 (a key without the right) or 408 (the gateway timed
    out) says nothing against the events: they failed for good, and after the operator's fix
    nothing went until staff re-queued every one of them."""
    settings.PAYMENT_GATEWAY_URL = f"{fake_gateway.url}/usage"
    settings.USAGE_INGEST_API_KEY = GATEWAY_KEY
    client = api_client(alice_key)
    for i in range(3):
        client.post("/v1/memories", {"memory": f"Waiting for the key {i}"}, format="json")
    fake_gateway.answer_status = status

    report = usage_events_deliver()

    assert (report.retrying, report.failed, report.delivered) == (3, 0, 0)
    assert {e.last_error[:8] for e in UsageEvent.objects.all()} == {f"HTTP {status}"}
    assert set(UsageEvent.objects.values_list("status", flat=True)) == {"pending"}
    fake_gateway.answer_status = None  # the operator's fix
    UsageEvent.objects.update(next_attempt_at=timezone.now())  # past the backoff
    assert usage_events_deliver().delivered == 3
    assert set(fake_gateway.received_ids()) == set(_outbox_ids())
