"""A turn fact said again is refreshed by after_turn (the dedupe rule answers the memory
it already is): a more durable tier promotes it, the same tier extends its expiry from
now, and nothing shortens a memory's life. Before, the first statement's tier and expiry
stayed, and retention deleted a fact the user had just said again, for good."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import override_settings
from django.utils import timezone

from audit.models import AuditEvent, MemoryHistory
from memories.engine import engine_rows_owned, engine_timestamp
from memories.turns import services as turns
from tests.test_turns import facts_of, run, turn

pytestmark = pytest.mark.django_db

CAFE = "Today I am working from the cafe."  # the rule extractor's L1 ("today")
BERLIN = "User lives in Berlin"


def attrs_of(scope) -> dict:
    (row,) = facts_of(scope)
    return row.payload["attrs"]


def clock_at(monkeypatch, when) -> None:
    monkeypatch.setattr(turns, "_now", lambda: when)


def test_a_fact_restated_as_long_term_is_promoted_and_kept(alice, alice_scope, fake_llm, monkeypatch, clean_vectors):
    with override_settings(MCP_MEMORY_HEURISTIC_ENABLED=True, MCP_MEMORY_HEURISTIC_BASE_URL=f"{fake_llm.url}/v1"):
        fake_llm.queue_answer({"memory": [{"text": BERLIN, "tier": "l1"}]})
        first = turn(alice, "s", "t1", "I'm in Berlin today")
        fake_llm.queue_answer({"memory": [{"text": BERLIN, "tier": "long_term"}]})
        second = turn(alice, "s", "t2", "I have lived in Berlin for ten years")
    assert second["fact_ids"] == first["fact_ids"]  # still one memory (the dedupe rule)
    attrs = attrs_of(alice_scope)
    assert "tier:long_term" in attrs["tags"] and "tier:l1" not in attrs["tags"]
    assert attrs.get("expires_at") is None
    # In the turn's transaction, with its history row and its audit row naming it.
    (fact_id,) = first["fact_ids"]
    row = AuditEvent.objects.filter(operation="memory_after_turn").latest("id")
    assert row.detail["facts_refreshed"] == [fact_id]
    update = MemoryHistory.objects.get(memory_id=fact_id, event=MemoryHistory.Event.UPDATE)
    assert update.request_id == row.request_id
    clock_at(monkeypatch, timezone.now() + timedelta(days=2))
    assert run(alice, "memory_run_maintenance", session_id="s")["expired_facts"] == 0
    assert [str(r.id) for r in facts_of(alice_scope)] == [fact_id]


def test_a_fact_restated_at_its_tier_expires_a_tier_after_it_was_last_said(
    alice, alice_scope, monkeypatch, clean_vectors
):
    t0 = timezone.now()
    clock_at(monkeypatch, t0)
    first = turn(alice, "s", "t1", CAFE)
    clock_at(monkeypatch, t0 + timedelta(hours=23))
    second = turn(alice, "s", "t2", CAFE)
    assert second["fact_ids"] == first["fact_ids"] and not second["duplicate"]
    attrs = attrs_of(alice_scope)
    assert "tier:l1" in attrs["tags"]
    assert attrs["expires_at"] == engine_timestamp(t0 + timedelta(hours=23, days=1))
    clock_at(monkeypatch, t0 + timedelta(hours=24, minutes=30))  # past the first statement's expiry
    assert run(alice, "memory_run_maintenance", session_id="s")["expired_facts"] == 0
    clock_at(monkeypatch, t0 + timedelta(hours=23, days=1, minutes=1))  # a day after the second
    assert run(alice, "memory_run_maintenance", session_id="s")["expired_facts"] == 1
    assert facts_of(alice_scope) == []


def test_a_fact_repeated_every_turn_is_refreshed_once_half_its_life_is_gone(
    alice, alice_scope, monkeypatch, clean_vectors
):
    """Refreshed on every statement, a fact repeated each turn wrote an update and a
    history row each turn, without limit."""
    t0 = timezone.now()
    for minutes in range(0, 60, 10):  # six statements within the hour
        clock_at(monkeypatch, t0 + timedelta(minutes=minutes))
        turn(alice, "s", f"t{minutes}", CAFE)
    (fact_id,) = [str(row.id) for row in facts_of(alice_scope)]
    assert not MemoryHistory.objects.filter(memory_id=fact_id, event=MemoryHistory.Event.UPDATE).exists()
    assert attrs_of(alice_scope)["expires_at"] == engine_timestamp(t0 + timedelta(days=1))
    clock_at(monkeypatch, t0 + timedelta(hours=13))  # less than half of the day left
    turn(alice, "s", "t-late", CAFE)
    assert MemoryHistory.objects.filter(memory_id=fact_id, event=MemoryHistory.Event.UPDATE).count() == 1
    assert attrs_of(alice_scope)["expires_at"] == engine_timestamp(t0 + timedelta(hours=13, days=1))


def test_restating_never_shortens_a_facts_life(alice, alice_scope, fake_llm, monkeypatch, clean_vectors):
    t0 = timezone.now()
    clock_at(monkeypatch, t0)

    def said(turn_id: str, text: str, tier: str) -> str:
        fake_llm.queue_answer({"memory": [{"text": text, "tier": tier}]})
        (fact_id,) = turn(alice, "s", turn_id, f"about {text}")["fact_ids"]
        return fact_id

    def attrs(fact_id: str) -> dict:
        return next(r.payload["attrs"] for r in facts_of(alice_scope) if str(r.id) == fact_id)

    with override_settings(MCP_MEMORY_HEURISTIC_ENABLED=True, MCP_MEMORY_HEURISTIC_BASE_URL=f"{fake_llm.url}/v1"):
        durable = said("t1", "User likes jazz", "long_term")
        weekly = said("t2", "User is on call this week", "l2")
        daily = said("t3", "User is at the office", "l1")
        clock_at(monkeypatch, t0 + timedelta(hours=1))
        assert said("t4", "User likes jazz", "l1") == durable
        assert said("t5", "User is on call this week", "l1") == weekly
        assert said("t6", "User is at the office", "l2") == daily
    # A long-term fact stays long-term (no history row: nothing changed).
    assert attrs(durable).get("expires_at") is None and "tier:long_term" in attrs(durable)["tags"]
    assert not MemoryHistory.objects.filter(memory_id=durable, event=MemoryHistory.Event.UPDATE).exists()
    # An L2 fact said as L1 keeps its tier and its later expiry.
    assert "tier:l2" in attrs(weekly)["tags"] and "tier:l1" not in attrs(weekly)["tags"]
    assert attrs(weekly)["expires_at"] == engine_timestamp(t0 + timedelta(days=7))
    # An L1 fact said as L2 is promoted: L2's tag and expiry, from now.
    assert "tier:l2" in attrs(daily)["tags"] and "tier:l1" not in attrs(daily)["tags"]
    assert attrs(daily)["expires_at"] == engine_timestamp(t0 + timedelta(hours=1, days=7))


@pytest.mark.django_db(transaction=True)  # update_memory reads through the engine's own pool
def test_a_pinned_or_remembered_memory_said_again_never_gets_an_expiry(alice, alice_scope, clean_vectors):
    pinned = turn(alice, "s", "t1", CAFE)["fact_ids"][0]
    run(alice, "update_memory", memory_id=pinned, pinned=True)  # made durable (long-term, no expiry)
    assert turn(alice, "s", "t2", CAFE)["fact_ids"] == [pinned]
    attrs = attrs_of(alice_scope)
    assert attrs.get("expires_at") is None and "tier:long_term" in attrs["tags"]
    # A remembered memory (the user's own fields, no turn fact) keeps them too.
    remembered = run(alice, "remember", memory="Today I am working from the library.")["id"]
    assert turn(alice, "s", "t3", "Today I am working from the library.")["fact_ids"] == [remembered]
    (row,) = [r for r in engine_rows_owned(alice_scope) if str(r.id) == remembered]
    assert row.payload["attrs"].get("expires_at") is None and "turn-fact" not in row.payload["attrs"]["tags"]
