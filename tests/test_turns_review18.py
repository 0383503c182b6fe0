"""Review 18 of the turn lifecycle (seed 002): facts across projects, consolidation and
retention that keep what differs or what the user made their own, maintenance that
records all it did, LLM facts that cannot be stored, the documented base URLs."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.test import override_settings
from django.utils import timezone

from audit.crypto import content_open
from audit.models import AuditEvent
from core.errors import ErrorCode
from memories.engine import EngineError, engine_trashed
from memories.models import SessionState
from memories.turns import extraction
from memories.turns import services as turns
from tests.test_turns import facts_of, fails, run, turn, user_msg

pytestmark = pytest.mark.django_db

TEA = "I prefer green tea over coffee."
ANNA = "My sister Anna lives in Berlin and works as a nurse at the city hospital."
MARIA = "My sister Maria lives in Berlin and works as a nurse at the city hospital."
MORNING = "I prefer tea over coffee in the morning."


def recall(user, query: str, **arguments) -> list[str]:
    arguments.setdefault("session_id", "recall")
    return run(user, "memory_before_turn", current_input=[user_msg(query)], **arguments)["recall_fact_ids"]


def live_ids(scope) -> set[str]:
    return {str(row.id) for row in facts_of(scope)}


def texts_of(scope) -> list[str]:
    return sorted(row.payload["data"] for row in facts_of(scope))


# --- F1: the same fact in a second project --------------------------------------------------------
def test_the_same_fact_said_in_a_second_project_is_recalled_there(alice, alice_scope, clean_vectors):
    a = turn(alice, "s", "t1", TEA, project="a")
    b = turn(alice, "s", "t1", TEA, project="b")
    assert b["fact_ids"] == a["fact_ids"]  # one memory (the dedupe rule) ...
    assert recall(alice, "green tea or coffee", project="b", session_id="s2") == b["fact_ids"]  # ... of both
    assert recall(alice, "green tea or coffee", project="a", session_id="s2") == a["fact_ids"]
    assert recall(alice, "green tea or coffee", project="c", session_id="s2") == []
    # The project is sealed with the rest of the row's content (a client-chosen name).
    rows = AuditEvent.objects.filter(operation="memory_after_turn")
    (row,) = [r for r in rows if content_open(r.detail["content"])["project"] == "b"]
    assert row.memory_ids == b["fact_ids"] and row.detail["project_tagged"] == b["fact_ids"]


# --- F2: consolidation within one project, never over a differing name -------------------------------
def test_maintenance_of_one_project_keeps_a_fact_differing_in_a_name_from_another_projects(
    alice, alice_scope, clean_vectors
):
    turn(alice, "s1", "t1", ANNA, project="apollo")
    turn(alice, "s2", "t1", MARIA, project="hermes")
    result = run(alice, "memory_run_maintenance", project="apollo", session_id="s1")
    assert result["consolidated_facts"] == 0
    assert texts_of(alice_scope) == [ANNA, MARIA]
    assert run(alice, "memory_run_maintenance", project="hermes")["consolidated_facts"] == 0


def test_facts_differing_in_a_name_or_number_are_never_merged_near_duplicates_are(alice, alice_scope, clean_vectors):
    turn(alice, "s", "t1", ANNA)
    turn(alice, "s", "t2", MARIA)
    turn(alice, "s", "t3", "My flat is on floor 3 of the old brick building near the central station.")
    turn(alice, "s", "t4", "My flat is on floor 4 of the old brick building near the central station.")
    turn(alice, "s", "t5", MORNING)
    turn(alice, "s", "t6", "I prefer tea over coffee in the morning!")
    turn(alice, "s", "t7", "I really prefer tea over coffee in the morning.")
    assert len(facts_of(alice_scope)) == 7
    assert run(alice, "memory_run_maintenance", session_id="s")["consolidated_facts"] == 2
    kept = texts_of(alice_scope)
    assert ANNA in kept and MARIA in kept and len(kept) == 5
    assert sum("floor" in text for text in kept) == 2
    assert kept.count("I really prefer tea over coffee in the morning.") == 1  # the newest stays


def test_maintenance_consolidates_only_the_project_it_is_called_for(alice, alice_scope, clean_vectors):
    turn(alice, "s", "t1", MORNING, project="hermes")
    turn(alice, "s", "t2", "I prefer tea over coffee in the morning!", project="hermes")
    turn(alice, "s", "t1", "I live in Oslo.", project="apollo")
    assert run(alice, "memory_run_maintenance", project="apollo")["consolidated_facts"] == 0
    assert len(facts_of(alice_scope)) == 3
    assert run(alice, "memory_run_maintenance", project="hermes")["consolidated_facts"] == 1
    assert len(facts_of(alice_scope)) == 2


def test_maintenance_expires_only_the_project_it_is_called_for(alice, alice_scope, monkeypatch, clean_vectors):
    turn(alice, "s", "t1", "Today I am working from the cafe.", project="hermes")
    turn(alice, "s", "t1", "Today I am working from the library.", project="apollo")
    monkeypatch.setattr(turns, "_now", lambda: timezone.now() + timedelta(days=2))
    assert run(alice, "memory_run_maintenance", project="apollo")["expired_facts"] == 1
    assert run(alice, "memory_run_maintenance", project="hermes")["expired_facts"] == 1


# --- F3: pinned (or edited) facts stay -------------------------------------------------------------
@pytest.mark.django_db(transaction=True)  # update_memory reads through the engine's own pool
def test_consolidation_never_trashes_a_pinned_or_edited_fact(alice, alice_scope, clean_vectors):
    older = turn(alice, "s", "t1", MORNING)["fact_ids"][0]
    newer = turn(alice, "s", "t2", "I prefer tea over coffee in the morning!")["fact_ids"][0]
    run(alice, "update_memory", memory_id=older, pinned=True)
    assert run(alice, "memory_run_maintenance", session_id="s")["consolidated_facts"] == 1
    assert live_ids(alice_scope) == {older}  # the group keeps its pinned fact
    assert [m.id for m in engine_trashed(alice_scope)] == [newer]
    # An edited fact is the user's too.
    edited = turn(alice, "s", "t3", "I like to read in the evening.")["fact_ids"][0]
    run(alice, "update_memory", memory_id=edited, memory="I like to read in the evening!!")
    turn(alice, "s", "t4", "I like to read in the evening.")
    assert run(alice, "memory_run_maintenance", session_id="s")["consolidated_facts"] == 1
    assert edited in live_ids(alice_scope)


def test_retention_deletes_an_expired_pinned_fact_as_the_purge_does(alice, alice_scope, monkeypatch, clean_vectors):
    pinned = turn(alice, "s", "t1", "Today I am working from the cafe.")["fact_ids"][0]
    turn(alice, "s", "t2", "Today I am working late.")
    # Pinned in the row itself, as a fact pinned before pinning made turn facts durable at
    # once (memory_update) still is: expired, it is gone from every read and the purge of
    # expired memories deletes it, so retention does too (it is not brought back).
    with connection.cursor() as cursor:
        cursor.execute("UPDATE memories SET payload = payload || '{\"pinned\": true}' WHERE id = %s", [pinned])
    monkeypatch.setattr(turns, "_now", lambda: timezone.now() + timedelta(days=2))
    result = run(alice, "memory_run_maintenance", session_id="s")
    assert result["expired_facts"] == 2
    assert facts_of(alice_scope) == []
    final = AuditEvent.objects.filter(operation="memory_run_maintenance", detail__step__isnull=True).get()
    assert pinned in final.memory_ids and "made_durable" not in final.detail


# --- F4: remember of an expiring turn fact makes it durable --------------------------------------
def test_remembering_an_expiring_turn_fact_keeps_it_past_retention(alice, alice_scope, monkeypatch, clean_vectors):
    fact = turn(alice, "s", "t1", "Today I am working from the cafe.")["fact_ids"][0]
    remembered = run(alice, "remember", memory="Today I am working from the cafe.")
    assert remembered == {"id": fact, "duplicate": True}
    row = AuditEvent.objects.get(operation="remember")
    assert row.memory_ids == [fact] and row.detail["made_durable"] == [fact]
    monkeypatch.setattr(turns, "_now", lambda: timezone.now() + timedelta(days=2))
    result = run(alice, "memory_run_maintenance", session_id="s")
    assert result["expired_facts"] == 0
    (live,) = facts_of(alice_scope)
    assert str(live.id) == fact and "expires_at" not in live.payload["attrs"]
    # A long-term fact (nothing to make durable) is remembered as before.
    long_term = turn(alice, "s", "t2", TEA)["fact_ids"][0]
    assert run(alice, "remember", memory=TEA) == {"id": long_term, "duplicate": True}
    assert "made_durable" not in AuditEvent.objects.filter(operation="remember").latest("id").detail


# --- F5: a maintenance call records what it did, even when it fails ---------------------------------
def _two_near_duplicates(alice) -> None:
    turn(alice, "s", "t1", MORNING)
    turn(alice, "s", "t2", "I prefer tea over coffee in the morning!")


def test_a_busy_summary_is_skipped_and_the_call_records_what_it_trashed(alice, alice_scope, monkeypatch, clean_vectors):
    _two_near_duplicates(alice)

    def busy(*args, **kwargs):
        raise turns._busy("busy")

    monkeypatch.setattr(turns, "_summary_refresh", busy)
    result = run(alice, "memory_run_maintenance", session_id="s")
    assert result["consolidated_facts"] == 1 and result["summaries_skipped"] == 1
    (trashed,) = [m.id for m in engine_trashed(alice_scope)]
    rows = AuditEvent.objects.filter(operation="memory_run_maintenance")
    assert {row.outcome for row in rows} == {"ok"}
    step = rows.get(detail__step="consolidation")
    final = rows.get(detail__step__isnull=True)
    assert step.memory_ids == final.memory_ids == [trashed] and step.request_id == final.request_id


def test_a_maintenance_call_failing_later_leaves_its_trash_moves_audited(
    alice, alice_scope, monkeypatch, clean_vectors
):
    from billing.models import UsageEvent

    _two_near_duplicates(alice)

    def broken(*args, **kwargs):
        raise EngineError("down")

    monkeypatch.setattr(turns, "_summary_refresh", broken)
    usage = UsageEvent.objects.count()
    assert fails(alice, "memory_run_maintenance", session_id="s").code == ErrorCode.BACKEND_UNAVAILABLE
    assert UsageEvent.objects.count() == usage  # failed: not billed
    (trashed,) = [m.id for m in engine_trashed(alice_scope)]
    step = AuditEvent.objects.get(operation="memory_run_maintenance", detail__step="consolidation")
    failed = AuditEvent.objects.get(operation="memory_run_maintenance", outcome="error")
    assert step.memory_ids == [trashed] and step.request_id == failed.request_id


def test_expired_facts_deleted_by_maintenance_are_named_in_audit_rows(alice, alice_scope, monkeypatch, clean_vectors):
    expired = turn(alice, "s", "t1", "Today I am working from the cafe.")["fact_ids"][0]
    monkeypatch.setattr(turns, "_now", lambda: timezone.now() + timedelta(days=2))
    run(alice, "memory_run_maintenance", session_id="s")
    step = AuditEvent.objects.get(operation="memory_run_maintenance", detail__step="retention")
    final = AuditEvent.objects.get(operation="memory_run_maintenance", detail__step__isnull=True)
    assert step.memory_ids == final.memory_ids == [expired]


# --- F6: LLM facts that cannot be stored are dropped ----------------------------------------------
def test_llm_facts_with_nul_or_a_lone_surrogate_are_dropped(alice, alice_scope, fake_llm, clean_vectors):
    fake_llm.queue_facts("User likes \u0000 tea", "User is learning Rust")
    fake_llm.queue_facts("User likes \ud800 coffee")
    with override_settings(MCP_MEMORY_HEURISTIC_ENABLED=True, MCP_MEMORY_HEURISTIC_BASE_URL=f"{fake_llm.url}/v1"):
        first = turn(alice, "s", "t1", "I read the rust book with tea")
        second = turn(alice, "s", "t2", "Coffee now")
    assert len(first["fact_ids"]) == 1 and second["fact_ids"] == []
    assert first["facts_left_out"] == second["facts_left_out"] == 1
    assert texts_of(alice_scope) == ["User is learning Rust"]


# --- F7: the base URLs seed 002 §9.3 documents -------------------------------------------------------
@pytest.mark.parametrize(
    ("base", "endpoint"),
    [
        ("https://api.openai.com", "https://api.openai.com/v1/chat/completions"),
        ("https://oneapi.example.com/v1", "https://oneapi.example.com/v1/chat/completions"),
        ("https://oneapi.example.com/v1/", "https://oneapi.example.com/v1/chat/completions"),
        ("https://oneapi.example.com/v1/responses", "https://oneapi.example.com/v1/chat/completions"),
        ("https://gw.example.com/openai/responses", "https://gw.example.com/openai/chat/completions"),
        ("https://oneapi.example.com/v1/chat/completions", "https://oneapi.example.com/v1/chat/completions"),
    ],
)
def test_documented_base_urls_reach_chat_completions(settings, base, endpoint):
    settings.MCP_MEMORY_HEURISTIC_BASE_URL = base
    assert extraction._endpoint() == endpoint


def test_an_explicit_responses_endpoint_extracts_facts(alice, alice_scope, fake_llm, clean_vectors):
    fake_llm.queue_facts("User is learning Rust")
    with override_settings(
        MCP_MEMORY_HEURISTIC_ENABLED=True, MCP_MEMORY_HEURISTIC_BASE_URL=f"{fake_llm.url}/v1/responses"
    ):
        assert len(turn(alice, "s", "t1", "I read the rust book")["fact_ids"]) == 1
    assert fake_llm.requests[-1]["path"] == "/v1/chat/completions"


# --- F8: facts without a project are user-wide ------------------------------------------------------
def test_a_projects_recall_includes_user_wide_memories_not_other_projects(alice, alice_scope, clean_vectors):
    user_wide = run(alice, "remember", memory="My favourite editor is Helix.")["id"]
    no_project = turn(alice, "s", "t1", "My favourite editor font is Iosevka.")["fact_ids"][0]
    other = turn(alice, "s", "t1", "My favourite editor theme is Solarized.", project="other")["fact_ids"][0]
    own = turn(alice, "s", "t1", "My favourite editor plugin is Harpoon.", project="mine")["fact_ids"][0]
    recalled = recall(alice, "my favourite editor", project="mine")
    assert set(recalled) == {user_wide, no_project, own}
    assert other not in recalled
    assert set(recall(alice, "my favourite editor")) == {user_wide, no_project, other, own}


def test_a_projects_recall_is_not_crowded_out_by_other_projects(alice, settings, clean_vectors):
    settings.MCP_MEMORY_RECALL_FACTS_LIMIT = 1
    settings.SEARCH_CANDIDATE_FACTOR = 1
    turn(alice, "s", "t1", "My favourite editor is Helix.", project="other")
    own = turn(alice, "s", "t1", "I use an editor at work.", project="mine")["fact_ids"]
    assert recall(alice, "my favourite editor is Helix", project="mine") == own


# --- F9: maintenance never creates a session ---------------------------------------------------------
def test_maintenance_of_a_missing_session_creates_nothing(alice, clean_vectors):
    result = run(alice, "memory_run_maintenance", session_id="nope", project="p")
    assert result["ok"] and result["sessions"] == 0
    assert not SessionState.objects.exists()
    assert run(alice, "memory_list_dir_with_abstract", project="p", path="/memory/nope")["summaries"] == []
