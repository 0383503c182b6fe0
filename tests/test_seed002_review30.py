"""Review 30 of the turn lifecycle (seed 002).

F3: a turn fact its owner edited (text, fields, metadata), on any surface, is theirs: it
becomes durable as a pinned one does. Before, only a pin did, and retention deleted an
edited L1 fact for good (its history blanked) once the day was out.

F4: every lock wait of the lifecycle that times out (a clear-all or erasure under way, a
session busy, a text being written) answers `resource_busy` (retryable, `retry_after_s`),
seed 002 §7.3. Before, after_turn and maintenance without a session answered `conflict`,
which after_turn also answers for a reused turn id (never to be retried).

F8: the same fact twice in one LLM answer is one fact: the audit detail, the fact-write
metric and the per-turn limit count it once. Before, one memory was stored and two
counted."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import timedelta

import psycopg
import pytest
from django.db import connection
from django.test import override_settings
from django.utils import timezone

from audit.models import AuditEvent, MemoryHistory
from core import metrics
from core.errors import ErrorCode
from memories.models import TurnGuard
from memories.turns import services as turns
from memories.turns.extraction import FACTS_PER_TURN_MAX
from tests.test_turns import facts_of, fails, run, turn, user_msg

pytestmark = pytest.mark.django_db

CAFE = "Today I am working from the cafe."  # the rule extractor's L1 ("today")
EDITED = "I work from the Blue Door cafe every Tuesday."


def attrs_of(scope, memory_id: str) -> dict:
    return next(row.payload["attrs"] for row in facts_of(scope) if str(row.id) == memory_id)


def texts_of(scope) -> list[str]:
    return [row.payload["data"] for row in facts_of(scope)]


def two_days_later(monkeypatch) -> None:
    later = timezone.now() + timedelta(days=2)
    monkeypatch.setattr(turns, "_now", lambda: later)


def l1_fact(user, scope) -> str:
    (fact_id,) = turn(user, "s", "t1", CAFE)["fact_ids"]
    assert "tier:l1" in attrs_of(scope, fact_id)["tags"] and attrs_of(scope, fact_id)["expires_at"]
    return fact_id


def assert_durable(scope, fact_id: str) -> dict:
    attrs = attrs_of(scope, fact_id)
    assert attrs.get("expires_at") is None
    assert "tier:long_term" in attrs["tags"] and "tier:l1" not in attrs["tags"]
    return attrs


# --- F3: an owner's edit keeps a turn fact -----------------------------------------------------------
@pytest.mark.django_db(transaction=True)  # update_memory reads through the engine's own pool
def test_an_l1_fact_whose_text_the_owner_edited_outlives_its_tier(alice, alice_scope, monkeypatch, clean_vectors):
    fact_id = l1_fact(alice, alice_scope)
    run(alice, "update_memory", memory_id=fact_id, memory=EDITED)
    assert_durable(alice_scope, fact_id)
    two_days_later(monkeypatch)
    assert run(alice, "memory_run_maintenance", session_id="s")["expired_facts"] == 0
    assert texts_of(alice_scope) == [EDITED]
    assert MemoryHistory.objects.filter(memory_id=fact_id, new_memory=EDITED).exists()  # not blanked


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "change",
    [
        {"tags": ["turn-fact", "tier:l1", "work"]},
        {"importance": 0.2},
        {"metadata": {"where": "cafe"}},
        {"tags": ["work"]},  # no longer tagged a turn fact: the purge of expired rows would take it
    ],
    ids=["tags", "importance", "metadata", "untagged"],
)
def test_an_l1_fact_whose_fields_the_owner_edited_outlives_its_tier(
    alice, alice_scope, monkeypatch, clean_vectors, change
):
    fact_id = l1_fact(alice, alice_scope)
    updated = run(alice, "update_memory", memory_id=fact_id, **change)["memory"]
    assert updated["expires_at"] is None
    if "importance" in change:
        assert updated["importance"] == 0.2  # the owner's importance stays as set
    if change.get("tags") == ["work"]:
        assert updated["tags"] == ["work"]
        return
    assert_durable(alice_scope, fact_id)
    two_days_later(monkeypatch)
    assert run(alice, "memory_run_maintenance", session_id="s")["expired_facts"] == 0
    assert texts_of(alice_scope) == [CAFE]


@pytest.mark.django_db(transaction=True)
def test_an_expiry_the_owner_sets_in_the_edit_is_theirs(alice, alice_scope, monkeypatch, clean_vectors):
    fact_id = l1_fact(alice, alice_scope)
    soon = (timezone.now() + timedelta(hours=30)).isoformat()
    updated = run(alice, "update_memory", memory_id=fact_id, memory=EDITED, expires_at=soon)["memory"]
    assert updated["expires_at"] is not None
    two_days_later(monkeypatch)
    assert run(alice, "memory_run_maintenance", session_id="s")["expired_facts"] == 1


@pytest.mark.django_db(transaction=True)
def test_an_unpin_or_the_same_text_again_is_no_edit_and_keeps_the_expiry(
    alice, alice_scope, monkeypatch, clean_vectors
):
    fact_id = l1_fact(alice, alice_scope)
    run(alice, "update_memory", memory_id=fact_id, pinned=False)
    run(alice, "update_memory", memory_id=fact_id, memory=CAFE)
    assert attrs_of(alice_scope, fact_id)["expires_at"]
    two_days_later(monkeypatch)
    assert run(alice, "memory_run_maintenance", session_id="s")["expired_facts"] == 1


@pytest.mark.django_db(transaction=True)
def test_every_edit_surface_keeps_the_edited_fact(alice, alice_key, alice_scope, api_client, client, clean_vectors):
    """REST PATCH, seed 001's PUT and the web UI's edit forms all run memory_update."""
    rest = api_client(alice_key)
    edits = {
        "rest": lambda fid: rest.patch(f"/v1/memories/{fid}", {"memory": EDITED + " (rest)"}, format="json"),
        "seed001": lambda fid: rest.put(f"/v1/memory/{fid}", {"content": EDITED + " (seed 001)"}, format="json"),
        "web": lambda fid: client.post(f"/memories/{fid}/edit/", {"memory": EDITED + " (web)"}),
        "web-fields": lambda fid: client.post(
            f"/memories/{fid}/fields/", {"memory_type": "user", "tags": "turn-fact, tier:l1, work", "importance": "0.3"}
        ),
    }
    client.force_login(alice)
    for number, (surface, edit) in enumerate(edits.items()):
        (fact_id,) = turn(alice, f"s{number}", "t1", f"Today I am working from cafe number {number}.")["fact_ids"]
        assert attrs_of(alice_scope, fact_id)["expires_at"], surface
        response = edit(fact_id)
        assert response.status_code in (200, 302), (surface, response.content)
        assert attrs_of(alice_scope, fact_id).get("expires_at") is None, surface


# --- F4: a lock wait that times out is resource_busy everywhere --------------------------------------
@contextlib.contextmanager
def lock_held(key: str) -> Iterator[None]:
    params = connection.get_connection_params()
    other = psycopg.connect(**{k: v for k, v in params.items() if k not in ("cursor_factory", "context")})
    try:
        other.execute("SELECT pg_advisory_lock(hashtextextended(%s, 0))", [key])
        yield
    finally:
        other.close()


def assert_busy(error) -> None:
    assert (error.code, error.retry_after_s) == (ErrorCode.RESOURCE_BUSY, 1), (error.code, error.message)


@pytest.mark.django_db(transaction=True)
@override_settings(MEMORY_LOCK_TIMEOUT_S=0.3, MCP_MEMORY_SESSION_LOCK_TIMEOUT_S=0.3)
def test_an_erasure_under_way_is_resource_busy_on_every_lifecycle_path(alice, alice_scope, clean_vectors):
    turn(alice, "s", "t0", "I like tea.")
    with lock_held(f"clear_all:{alice_scope.engine_user_id}"):
        assert_busy(fails(alice, "memory_after_turn", session_id="s", turn_id="t", input_items=[user_msg("I am Al.")]))
        assert_busy(fails(alice, "memory_run_maintenance", session_id="s"))
        assert_busy(fails(alice, "memory_run_maintenance", session_id="nosuch"))  # retention first, no session
        assert_busy(fails(alice, "memory_run_maintenance"))
        assert not TurnGuard.objects.filter(turn_id="t").exists()
    # Retried once the erasure is over: it goes through.
    assert not turn(alice, "s", "t", "I am Al.")["duplicate"]
    failures = AuditEvent.objects.filter(outcome="error").values_list("error_code", flat=True)
    assert set(failures) == {"resource_busy"}


@pytest.mark.django_db(transaction=True)
@override_settings(MEMORY_LOCK_TIMEOUT_S=0.3)
def test_a_fact_text_being_written_elsewhere_is_resource_busy(alice, alice_scope, clean_vectors):
    from memories.services import _text_lock_key, content_sha256

    with lock_held(_text_lock_key(alice_scope, content_sha256("I prefer tea over coffee."))):
        error = fails(
            alice, "memory_after_turn", session_id="s", turn_id="t", input_items=[user_msg("I prefer tea over coffee.")]
        )
    assert_busy(error)
    assert not TurnGuard.objects.exists()  # released: the retry goes straight in
    assert not turn(alice, "s", "t", "I prefer tea over coffee.")["duplicate"]


@pytest.mark.django_db(transaction=True)
@override_settings(MEMORY_LOCK_TIMEOUT_S=0.3)
@pytest.mark.parametrize("step", ["_guards_prune", "_retention_sweep", "_consolidate"])
def test_each_maintenance_step_answers_resource_busy(alice, alice_scope, clean_vectors, monkeypatch, step):
    """Each step that takes the user's locks, reached with the erasure lock held (the
    steps before it skipped)."""
    turn(alice, "s", "t0", "I like tea.")
    order = ["_compact", "_guards_prune", "_retention_sweep", "_consolidate"]
    for earlier in order[: order.index(step)]:
        skipped = [] if earlier == "_retention_sweep" else 0
        monkeypatch.setattr(turns, earlier, lambda *args, skipped=skipped, **kwargs: skipped)
    with lock_held(f"clear_all:{alice_scope.engine_user_id}"):
        assert_busy(fails(alice, "memory_run_maintenance", session_id="s"))


# --- F8: one fact said twice in an answer is one -----------------------------------------------------
def llm_on(fake_llm):
    return override_settings(MCP_MEMORY_HEURISTIC_ENABLED=True, MCP_MEMORY_HEURISTIC_BASE_URL=f"{fake_llm.url}/v1")


def test_the_same_fact_twice_in_one_answer_is_counted_once(
    alice, alice_scope, fake_llm, clean_vectors, django_capture_on_commit_callbacks
):
    before = {tier: metrics.TURN_FACT_WRITE.labels(tier=tier)._value.get() for tier in ("l1", "long_term")}
    fake_llm.queue_answer(
        {
            "memory": [
                {"text": "User is in Rome", "tier": "l1"},
                {"text": "user  is in ROME", "tier": "long_term"},  # the same text (the dedupe rule's hash)
                {"text": "User is in Rome", "tier": "l1"},
            ]
        }
    )
    with llm_on(fake_llm), django_capture_on_commit_callbacks(execute=True):
        result = turn(alice, "s", "t1", "hello", "Nice")
    (fact_id,) = result["fact_ids"]
    assert texts_of(alice_scope) == ["User is in Rome"]
    # The most durable of the tiers it was given (as said again in one turn after another).
    assert attrs_of(alice_scope, fact_id).get("expires_at") is None
    row = AuditEvent.objects.filter(operation="memory_after_turn").latest("id")
    assert row.detail["facts"] == {"l1": 0, "l2": 0, "long_term": 1}
    after = {tier: metrics.TURN_FACT_WRITE.labels(tier=tier)._value.get() for tier in ("l1", "long_term")}
    assert after == {"l1": before["l1"], "long_term": before["long_term"] + 1}


def test_duplicates_take_no_place_under_the_per_turn_limit(alice, alice_scope, fake_llm, clean_vectors):
    twice = [{"text": f"User owns bike number {n}", "tier": "long_term"} for n in range(FACTS_PER_TURN_MAX)]
    fake_llm.queue_answer({"memory": [entry for entry in twice for _ in range(2)]})
    with llm_on(fake_llm):
        result = turn(alice, "s", "t1", "hello", "Nice")
    assert len(result["fact_ids"]) == FACTS_PER_TURN_MAX and result["facts_left_out"] == 0
