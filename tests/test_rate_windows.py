""" "At most 5 per hour" holds in any 60-minute span (issue 10, D8): an exact sliding
window for per-hour limits, atomic across processes."""

from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

import pytest
from django.db import connections

from core.errors import ServiceError
from memories import rate_limits
from memories.models import RateEvent, RateWindow
from memories.services import memory_clear_all
from tests.conftest import internal_call

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
