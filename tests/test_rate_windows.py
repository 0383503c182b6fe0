""" "At most 5 per hour" holds in any 60-minute span (issue 10, D8): an exact sliding
window for per-hour limits, atomic across processes."""

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import UTC, datetime

import pytest
from django.db import connection, connections, transaction

from core.errors import ErrorCode, ServiceError
from memories import rate_limits
from memories.models import RateEvent, RateWindow
from memories.services import memory_clear_all
from tests.conftest import InThread, internal_call, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]


@pytest.fixture
def clock(monkeypatch):
    now = {"t": datetime(2026, 11, 22, 10, 52, tzinfo=UTC).timestamp()}
    monkeypatch.setattr(rate_limits, "clock", lambda: now["t"])
    return now


def _clear(scope) -> int | str:
    try:
        return memory_clear_all(scope, confirm=True, call=internal_call())
    except ServiceError as exc:
        return exc.retry_after_s if exc.code == "rate_limited" else exc.code.value


def test_ten_clear_alls_over_16_minutes_across_an_hour_boundary_allow_five(alice_scope, clock, settings):
    assert settings.RATE_LIMITS["clear_all_memory"] == (5, 3600)
    start = clock["t"]
    outcomes = []
    for i in range(10):  # 10:52:00 .. 11:08:00, every 106.7 s: crosses 11:00
        clock["t"] = start + i * 16 * 60 / 9
        outcomes.append(_clear(alice_scope))
    assert outcomes[:5] == [0] * 5
    # Refused, each told to come back when the 10:52 call turns one hour old.
    assert all(isinstance(o, int) and o > 0 for o in outcomes[5:])
    assert [start + 3600 - (start + i * 16 * 60 / 9) for i in range(5, 10)] == pytest.approx(outcomes[5:], abs=1)
    assert not RateWindow.objects.filter(operation="clear_all_memory").exists()

    clock["t"] = start + 3600 + 1  # the first call aged out: one slot is free, one only
    assert _clear(alice_scope) == 0
    assert isinstance(_clear(alice_scope), int)
    assert RateEvent.objects.filter(operation="clear_all_memory").count() == 5


def test_the_sliding_window_is_per_user(alice_scope, bob_scope, clock):
    for _ in range(5):
        assert _clear(alice_scope) == 0
    assert _clear(alice_scope) != 0
    assert _clear(bob_scope) == 0


def test_concurrent_calls_never_pass_the_limit(alice_scope, clock):
    def call(_):
        try:
            return _clear(alice_scope)
        finally:
            connections.close_all()

    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(call, range(12)))
    assert outcomes.count(0) == 5
    assert RateEvent.objects.count() == 5


def test_short_limits_keep_the_fixed_window(alice_scope, settings, clock):
    settings.RATE_LIMITS = {**settings.RATE_LIMITS, "clear_all_memory": (2, 60)}
    assert [_clear(alice_scope) for _ in range(3)][:2] == [0, 0]
    # The refused third call counts nowhere (review 18, F6).
    assert RateWindow.objects.filter(operation="clear_all_memory").get().count == 2
    assert not RateEvent.objects.exists()


# --- an account deleted while a call of it is counted ---------------------------------------------
def _lock_waiters() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_locks WHERE NOT granted")
        return cursor.fetchone()[0]


@pytest.mark.parametrize(
    ("operation", "credential"),
    [("search_memory", False), ("clear_all_memory", False), ("search_memory", True)],
    ids=["fixed window", "sliding window", "credential and user windows"],
)
def test_a_call_counted_as_its_account_is_deleted_is_unauthenticated(alice, alice_scope, operation, credential):
    """The window's row refers to the user: a deletion that commits while the call is
    counted (its foreign key check waits for it) was an IntegrityError, a 500."""
    holding, release = threading.Event(), threading.Event()
    scope = replace(alice_scope, credential="svc", credential_user_pk=alice.pk) if credential else alice_scope

    def delete_account() -> None:
        with transaction.atomic():
            alice.delete()
            holding.set()
            assert release.wait(30)

    deleter = InThread(delete_account)
    assert holding.wait(30)
    counter = InThread(lambda: rate_limits.rate_limit_consume(scope, operation=operation))
    wait_for(lambda: _lock_waiters() >= 1 or counter.done(), timeout=20, what="the count waiting")
    release.set()
    deleter.result()
    with pytest.raises(ServiceError) as refused:
        counter.result()
    assert (refused.value.code, refused.value.message) == (ErrorCode.UNAUTHENTICATED, "This account no longer exists.")
    assert not RateWindow.objects.exists() and not RateEvent.objects.exists()


def test_a_rest_call_whose_account_goes_before_it_is_counted_is_a_401(api_client, alice_key, monkeypatch):
    from django.contrib.auth import get_user_model

    from memories import services

    counted = services.rate_limit_consume

    def after_a_deletion(scope, *, operation):  # the deletion commits between auth and the count
        get_user_model().objects.filter(pk=scope.user_pk).delete()
        counted(scope, operation=operation)

    monkeypatch.setattr(services, "rate_limit_consume", after_a_deletion)
    client = api_client(alice_key)
    client.raise_request_exception = False
    response = client.post("/v1/memories/search", {"query": "cat"}, format="json")
    assert response.status_code == 401, response.content
    assert response.json()["error"] == {"code": "unauthenticated", "message": "This account no longer exists."}


def test_the_chat_proxy_answers_an_account_gone_before_its_count_with_a_401(alice_scope, monkeypatch):
    from types import SimpleNamespace

    from proxy import services as proxy_services
    from proxy.errors import ProxyError

    def gone(scope, *, operation):
        raise ServiceError(ErrorCode.UNAUTHENTICATED, "This account no longer exists.")

    monkeypatch.setattr(proxy_services, "rate_limit_consume", gone)
    with pytest.raises(ProxyError) as refused:
        proxy_services.chat_rate_limit_consume(SimpleNamespace(scope=alice_scope))
    assert (refused.value.status, refused.value.code) == (401, "invalid_api_key")
