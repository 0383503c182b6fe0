"""Issue 13: the agent turn lifecycle (seed 002) through the one dispatcher: before_turn,
after_turn (exactly once, busy, serialised), maintenance (retention time-travel,
compaction, kill and re-run), extraction (rules; fake LLM), limits, tenancy, audit."""

from __future__ import annotations

import threading
from datetime import timedelta

import psycopg
import pytest
from django.db import connection, connections
from django.test import override_settings
from django.utils import timezone

from audit.models import AuditEvent
from core.errors import ErrorCode, ServiceError
from core.scope import CallContext
from memories.auth import Principal
from memories.engine import attrs_containment, engine_memory_of, engine_rows_owned
from memories.models import SessionArchive, SessionEvent, SessionState, TurnGuard
from memories.operations import operation_execute
from memories.turns import services as turns
from memories.turns.extraction import FACT_MAX_CHARS, FACT_TAG, FACTS_PER_TURN_MAX, facts_heuristic, tier_tag
from memories.turns.items import items_token_count

pytestmark = pytest.mark.django_db


def run(user, name: str, **arguments):
    return operation_execute(Principal(user=user, method="api_key"), name, arguments, call=CallContext(channel="mcp"))


def fails(user, name: str, **arguments) -> ServiceError:
    with pytest.raises(ServiceError) as info:
        run(user, name, **arguments)
    return info.value


def user_msg(text: str) -> dict:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def assistant_msg(text: str) -> dict:
    return {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}


def turn(user, session: str, turn_id: str, said: str, answer: str = "Noted.", **extra) -> dict:
    return run(
        user,
        "memory_after_turn",
        session_id=session,
        turn_id=turn_id,
        input_items=[user_msg(said)],
        output_items=[assistant_msg(answer)],
        **extra,
    )


def facts_of(scope, tier: str | None = None) -> list:
    tags = [FACT_TAG] + ([tier_tag(tier)] if tier else [])
    return list(engine_rows_owned(scope, containment=attrs_containment(tags=tags)))


def test_before_after_roundtrip_recalls_turn_one_facts_in_turn_three(alice, alice_scope, clean_vectors):
    first = run(alice, "memory_before_turn", session_id="s1", current_input=[user_msg("Hello there")])
    assert first["recall_fact_ids"] == []
    assert first["input_items"][-1] == user_msg("Hello there")
    stored = turn(alice, "s1", "t1", "My favourite editor is Helix. What time is it?")
    assert len(stored["fact_ids"]) == 1 and not stored["duplicate"]
    turn(alice, "s1", "t2", "Let's talk about lunch plans.", "Sure, what do you fancy?")
    third = run(
        alice,
        "memory_before_turn",
        session_id="s1",
        turn_id="t3",
        current_input=[user_msg("Which editor is my favourite?")],
        base_instructions="Be brief.",
    )
    assert stored["fact_ids"][0] in third["recall_fact_ids"]
    items = third["input_items"]
    assert third["context_token_count"] == items_token_count(items)
    assert items[0] == {"type": "message", "role": "system", "content": "Be brief."}
    assert "Helix" in items[1]["content"]  # the memory block
    assert items[-1] == user_msg("Which editor is my favourite?")
    assert assistant_msg("Sure, what do you fancy?") in items  # recent context from the session log


def test_compaction_in_before_turn_never_drops_the_current_input(alice, clean_vectors):
    for n in range(12):
        turn(alice, "long", f"t{n}", f"Paragraph {n}: " + "lorem ipsum dolor " * 40)
    current = [user_msg("And now the actual question " + "x" * 400)]
    result = run(alice, "memory_before_turn", session_id="long", current_input=current, max_input_tok=600)
    items = result["input_items"]
    assert items[-1] == current[0]
    assert result["context_token_count"] == items_token_count(items) <= 0.8 * 600
    assert any(isinstance(i["content"], str) and i["content"].startswith(turns.SUMMARY_HEADER) for i in items)
    # Even a budget smaller than the input keeps it.
    tiny = run(alice, "memory_before_turn", session_id="long", current_input=current, max_input_tok=256)
    assert tiny["input_items"][-1] == current[0]


def test_recall_fact_ids_are_the_facts_shown_when_the_budget_cuts_some(alice, alice_scope, clean_vectors):
    """A fact whose own text holds "- " lines must not make the facts the budget cut
    count as shown."""
    from memories.services import memory_remember
    from tests.conftest import internal_call

    listed = memory_remember(
        alice_scope, memory="Garden jobs for Saturday:\n- prune the roses\n- mow the lawn", call=internal_call()
    ).id
    for n in range(2):
        memory_remember(
            alice_scope, memory=f"Garden note {n}: " + "compost turning schedule " * 60, call=internal_call()
        )
    result = run(
        alice,
        "memory_before_turn",
        session_id="g",
        current_input=[user_msg("Which garden jobs for Saturday: prune the roses?")],
        max_input_tok=256,
    )
    block = next(i["content"] for i in result["input_items"] if i["role"] == "developer")
    assert result["recall_fact_ids"] == [listed]
    assert "Garden note" not in block


def test_after_turn_exactly_once_and_audit_has_only_hashes(alice, alice_scope, clean_vectors):
    from billing.models import UsageEvent

    said = "I prefer green tea over coffee."
    first = turn(alice, "s", "t1", said)
    billed = UsageEvent.objects.filter(operation="memory_after_turn").count()
    again = turn(alice, "s", "t1", said)
    assert again == {**first, "duplicate": True, "events_stored": 0, "input_items_skipped": 0}
    assert billed == 1 == UsageEvent.objects.filter(operation="memory_after_turn").count()  # billed once
    assert len(facts_of(alice_scope)) == 1
    assert SessionEvent.objects.filter(session_id="s").count() == 2
    rows = AuditEvent.objects.filter(operation="memory_after_turn")
    assert rows.count() == 2
    for row in rows:
        assert "green tea" not in str(row.detail) and "green tea" not in str(row.after)
        assert row.detail["input_items"]["sha256"]


def test_a_fresh_processing_turn_is_busy_and_a_stale_one_is_taken_over(alice, alice_scope, clean_vectors):
    guard = TurnGuard.objects.create(
        engine_user_id=alice_scope.engine_user_id, project="", session_id="s", turn_id="t1", owner="someone"
    )
    busy = fails(alice, "memory_after_turn", session_id="s", turn_id="t1", input_items=[user_msg("I live in Oslo.")])
    assert busy.code == ErrorCode.RESOURCE_BUSY and busy.retry_after_s
    TurnGuard.objects.filter(pk=guard.pk).update(updated_at=timezone.now() - timedelta(hours=1))
    done = turn(alice, "s", "t1", "I live in Oslo.")
    assert not done["duplicate"] and TurnGuard.objects.get(pk=guard.pk).state == "done"


def test_a_turn_id_sent_again_with_other_items_is_refused_not_dropped(alice, bob, alice_scope, clean_vectors):
    """A true retry is a duplicate as before; the same turn id with other items (a client
    reusing ids) is `conflict`: nothing of it stored, not billed, audited, no content in
    the error. The check is the caller's own: bob's turn with the same ids is his."""
    from billing.models import UsageEvent

    first = turn(alice, "s", "t1", "I prefer green tea.", "Noted.")
    assert turn(alice, "s", "t1", "I prefer green tea.", "Noted.") == {
        **first,
        "duplicate": True,
        "events_stored": 0,
        "input_items_skipped": 0,
    }
    reordered = {"content": [{"text": "I prefer green tea.", "type": "input_text"}], "role": "user", "type": "message"}
    same = run(
        alice,
        "memory_after_turn",
        session_id="s",
        turn_id="t1",
        input_items=[reordered],
        output_items=[assistant_msg("Noted.")],
    )
    assert same["duplicate"]  # the items' key order is no difference
    guard = TurnGuard.objects.get(turn_id="t1")
    assert len(guard.content_sha256) == 64 and "tea" not in guard.content_sha256
    billed, audited = UsageEvent.objects.count(), AuditEvent.objects.count()

    for said, answer in (("I live in Oslo.", "Noted."), ("I prefer green tea.", "Oslo is lovely.")):
        refused = fails(
            alice,
            "memory_after_turn",
            session_id="s",
            turn_id="t1",
            input_items=[user_msg(said)],
            output_items=[assistant_msg(answer)],
        )
        assert refused.code == ErrorCode.CONFLICT and refused.retry_after_s is None
        assert refused.details == {"reason": "turn_id_reused"} and "Oslo" not in refused.message
        row = AuditEvent.objects.latest("id")
        assert (row.operation, row.outcome, row.error_code) == ("memory_after_turn", "error", "conflict")
        assert "Oslo" not in str(row.detail)
    assert AuditEvent.objects.count() == audited + 2
    assert UsageEvent.objects.count() == billed  # refusals are not billed
    assert [engine_memory_of(row).text for row in facts_of(alice_scope)] == ["I prefer green tea."]
    events = SessionEvent.objects.filter(engine_user_id=alice_scope.engine_user_id)
    assert events.count() == 2 and "Oslo" not in str(list(events.values_list("item", flat=True)))
    assert TurnGuard.objects.get(pk=guard.pk).content_sha256 == guard.content_sha256

    theirs = turn(bob, "s", "t1", "I live in Oslo.")
    assert not theirs["duplicate"] and len(theirs["fact_ids"]) == 1
    assert turn(alice, "s", "t1", "I prefer green tea.", "Noted.")["duplicate"]


def test_a_turn_id_sent_with_other_items_while_the_first_is_processing_is_refused(alice, monkeypatch, clean_vectors):
    """Not resource_busy (a retry could never succeed) nor counted as a busy turn; the
    first call goes on and stores its turn."""
    from core import metrics

    extract = turns.facts_extract
    refusals: list[ServiceError] = []
    busy_before = metrics.TURN_IDEMPOTENCY_CONFLICTS._value.get()

    def another_turn_meanwhile(items):
        refusals.append(fails(alice, "memory_after_turn", session_id="s", turn_id="t1", input_items=[user_msg("x")]))
        return extract(items)

    monkeypatch.setattr(turns, "facts_extract", another_turn_meanwhile)
    first = turn(alice, "s", "t1", "I am vegetarian.")
    assert [error.code for error in refusals] == [ErrorCode.CONFLICT] and refusals[0].retry_after_s is None
    assert metrics.TURN_IDEMPOTENCY_CONFLICTS._value.get() == busy_before
    assert not first["duplicate"] and len(first["fact_ids"]) == 1
    assert SessionEvent.objects.filter(session_id="s").count() == 2


def test_a_stale_processing_turn_taken_over_with_other_items_keeps_the_takers(alice, alice_scope, clean_vectors):
    """A crashed call stored nothing: the call that takes its row over stores its own
    items, and from then on those are the turn's."""
    from memories.turns.items import turn_content_sha256

    crashed = turn_content_sha256(input_items=[user_msg("I live in Rome.")], output_items=[])
    TurnGuard.objects.create(
        engine_user_id=alice_scope.engine_user_id,
        project="",
        session_id="s",
        turn_id="t1",
        owner="someone",
        content_sha256=crashed,
        updated_at=timezone.now() - timedelta(hours=1),
    )
    assert not turn(alice, "s", "t1", "I live in Oslo.")["duplicate"]
    refused = fails(alice, "memory_after_turn", session_id="s", turn_id="t1", input_items=[user_msg("I live in Rome.")])
    assert refused.code == ErrorCode.CONFLICT
    assert turn(alice, "s", "t1", "I live in Oslo.")["duplicate"]


def test_a_guard_from_before_item_hashes_answers_every_retry_as_a_duplicate(alice, alice_scope, clean_vectors):
    TurnGuard.objects.create(
        engine_user_id=alice_scope.engine_user_id, project="", session_id="s", turn_id="t1", owner="x", state="done"
    )
    assert turn(alice, "s", "t1", "Anything at all.")["duplicate"]
    assert not SessionEvent.objects.exists()


def test_a_failed_after_turn_releases_its_guard(alice, monkeypatch, clean_vectors):
    def broken(*args, **kwargs):
        raise ServiceError(ErrorCode.LLM_UNAVAILABLE, "down")

    monkeypatch.setattr(turns, "facts_extract", broken)
    assert fails(alice, "memory_after_turn", session_id="s", turn_id="t", input_items=[user_msg("hi")]).code == (
        ErrorCode.LLM_UNAVAILABLE
    )
    assert not TurnGuard.objects.exists() and not SessionEvent.objects.exists()
    monkeypatch.undo()
    assert not turn(alice, "s", "t", "I am vegetarian.")["duplicate"]


@override_settings(MCP_MEMORY_SESSION_LOCK_TIMEOUT_S=0.2)
def test_a_locked_session_answers_resource_busy(alice, alice_scope, clean_vectors):
    params = connection.get_connection_params()
    other = psycopg.connect(**{k: v for k, v in params.items() if k not in ("cursor_factory", "context")})
    try:
        key = f"session:{alice_scope.engine_user_id}::s"
        other.execute("SELECT pg_advisory_lock(hashtextextended(%s, 0))", [key])
        error = fails(alice, "memory_after_turn", session_id="s", turn_id="t", input_items=[user_msg("I am Al.")])
        assert error.code == ErrorCode.RESOURCE_BUSY
        assert not TurnGuard.objects.exists()  # released: a retry goes straight in
    finally:
        other.close()
    assert not turn(alice, "s", "t", "I am Al.")["duplicate"]


def test_heuristic_extraction_and_tiers():
    facts = facts_heuristic(
        [
            user_msg("Hi! I prefer dark mode in every editor. Can you help me?\nToday I am working from the cafe."),
            user_msg("This week I am on call for the payments team."),
            assistant_msg("I like that you prefer dark mode."),  # not the user's words
            {"type": "function_call", "name": "lookup", "arguments": "{}"},
        ]
    )
    assert [(f.text, f.tier) for f in facts] == [
        ("I prefer dark mode in every editor.", "long_term"),
        ("Today I am working from the cafe.", "l1"),
        ("This week I am on call for the payments team.", "l2"),
    ]


def test_after_turn_says_which_facts_it_left_out_or_shortened(alice, alice_scope, clean_vectors):
    """The per-turn limit counts storable facts only (an unstorable first fact does not cost
    a stored one), and the result and the audit row say what was cut; the log keeps all."""
    unstorable = "I like \x1b[1mbold\x1b[0m tea."
    long = "I like " + "very " * 120 + "long walks."
    storable = [f"I like hobby number {n}." for n in range(FACTS_PER_TURN_MAX)]
    said = " ".join([unstorable, long, *storable])
    result = turn(alice, "s", "t1", said)
    assert len(result["fact_ids"]) == FACTS_PER_TURN_MAX
    assert result["facts_left_out"] == 2 and result["facts_shortened"] == 1
    texts = [engine_memory_of(row).text for row in facts_of(alice_scope)]
    assert [len(text) for text in texts if text.startswith("I like very very")] == [FACT_MAX_CHARS]
    assert f"I like hobby number {FACTS_PER_TURN_MAX - 2}." in texts
    assert f"I like hobby number {FACTS_PER_TURN_MAX - 1}." not in texts  # the 21st storable fact
    row = AuditEvent.objects.get(operation="memory_after_turn")
    assert row.detail["facts_left_out"] == {"over_limit": 1, "unstorable": 1, "shortened": 1}
    assert "bold" not in str(row.detail)
    assert SessionEvent.objects.filter(session_id="s").count() == 2  # both items, whole

    again = turn(alice, "s", "t1", said)  # a retry whose first answer was lost: the same counts
    assert again["duplicate"] and again["fact_ids"] == result["fact_ids"]
    assert again["facts_left_out"] == 2 and again["facts_shortened"] == 1
    plain = turn(alice, "s", "t2", "I prefer green tea.")
    assert plain["facts_left_out"] == plain["facts_shortened"] == 0
    assert "facts_left_out" not in AuditEvent.objects.filter(operation="memory_after_turn").latest("id").detail


def test_a_turn_in_flight_during_a_clear_all_stores_nothing_after_it(alice, alice_scope, monkeypatch, clean_vectors):
    """The clear-all commits while the turn's facts are extracted (its guard claimed):
    the turn answers conflict (reason memories_cleared: not resource_busy, which a client
    would retry into storing after the clear what was said before it) and stores neither
    facts nor events; the user's own resend is a new turn after the clear. Memory ingest
    discards the same case (ingest_intents_supersede)."""
    from core.errors import ServiceError
    from memories.services import memory_clear_all
    from tests.conftest import internal_call

    extract = turns.facts_extract

    def cleared_meanwhile(items):
        memory_clear_all(alice_scope, confirm=True, call=internal_call())
        return extract(items)

    monkeypatch.setattr(turns, "facts_extract", cleared_meanwhile)
    with pytest.raises(ServiceError) as refused:
        turn(alice, "s", "t1", "I am allergic to peanuts.")
    assert refused.value.code == "conflict" and "cleared" in refused.value.message
    assert refused.value.details == {"reason": "memories_cleared"} and refused.value.retry_after_s is None
    assert facts_of(alice_scope) == [] and not SessionEvent.objects.exists()
    monkeypatch.setattr(turns, "facts_extract", extract)
    assert len(turn(alice, "s", "t1", "I am allergic to peanuts.")["fact_ids"]) == 1


def test_extraction_with_a_fake_openai_compatible_llm(alice, alice_scope, fake_llm, clean_vectors):
    fake_llm.queue_facts("User's dog is called Rex", "User is learning Rust")
    with override_settings(MCP_MEMORY_HEURISTIC_ENABLED=True, MCP_MEMORY_HEURISTIC_BASE_URL=f"{fake_llm.url}/v1"):
        result = turn(alice, "s", "t1", "rex barked while I read the rust book", "Nice")
    texts = sorted(row.payload["data"] for row in facts_of(alice_scope))
    assert texts == ["User is learning Rust", "User's dog is called Rex"]
    assert len(result["fact_ids"]) == 2
    assert "rex barked" in fake_llm.prompts()[-1]


def test_maintenance_time_travel_retention_compaction_and_rerun(alice, alice_scope, monkeypatch, clean_vectors):
    turn(alice, "s", "t1", "Today I am working from the cafe.")
    turn(alice, "s", "t2", "This week I am on call for payments.")
    turn(alice, "s", "t3", "I prefer tea over coffee.")
    events = list(SessionEvent.objects.order_by("id").values_list("item", flat=True))
    fact_ids = {tier: [str(r.id) for r in facts_of(alice_scope, tier)] for tier in ("l1", "l2", "long_term")}
    assert all(len(ids) == 1 for ids in fact_ids.values())
    later = timezone.now() + timedelta(days=2)
    monkeypatch.setattr(turns, "_now", lambda: later)
    # A run killed mid-way (after the first archive chunk) ...
    monkeypatch.setattr(turns, "ARCHIVE_CHUNK", 2)
    real_create = SessionArchive.objects.create
    calls = []

    def dies_on_second(**kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed")
        return real_create(**kwargs)

    monkeypatch.setattr(SessionArchive.objects, "create", dies_on_second)
    with pytest.raises(KeyboardInterrupt):
        run(alice, "memory_run_maintenance", session_id="s")
    monkeypatch.setattr(SessionArchive.objects, "create", real_create)
    # ... and run again: nothing lost, nothing twice.
    result = run(alice, "memory_run_maintenance", session_id="s")
    assert result["ok"] and result["expired_facts"] == 1 and result["summaries_refreshed"] == 1
    archived = [item for a in SessionArchive.objects.order_by("first_event_id") for item in a.items]
    assert archived == events and not SessionEvent.objects.exists()
    assert facts_of(alice_scope, "l1") == []  # gone after its retention (the row is deleted)
    still = {str(r.id) for r in facts_of(alice_scope)}
    assert still == {*fact_ids["l2"], *fact_ids["long_term"]}  # compaction keeps every other fact
    state = SessionState.objects.get(session_id="s")
    assert "archived" in state.abstract and state.overview
    # A third run changes nothing.
    again = run(alice, "memory_run_maintenance", session_id="s")
    assert again["compacted_events"] == again["expired_facts"] == again["consolidated_facts"] == 0
    # Eight days on, the L2 fact is gone too; the long-term one stays.
    monkeypatch.setattr(turns, "_now", lambda: later + timedelta(days=8))
    run(alice, "memory_run_maintenance", session_id="s")
    assert {str(r.id) for r in facts_of(alice_scope)} == set(fact_ids["long_term"])


def test_maintenance_consolidates_near_duplicates(alice, alice_scope, clean_vectors):
    turn(alice, "s", "t1", "I prefer tea over coffee in the morning.")
    turn(alice, "s", "t2", "I prefer tea over coffee in the morning!")  # another text, same words
    assert len(facts_of(alice_scope)) == 2
    assert run(alice, "memory_run_maintenance", session_id="s")["consolidated_facts"] == 1
    assert len(facts_of(alice_scope)) == 1
    assert run(alice, "memory_run_maintenance", session_id="s")["consolidated_facts"] == 0


def test_maintenance_never_merges_the_same_words_in_another_order(alice, alice_scope, clean_vectors):
    outbound, back = "I have a flight to Rome from Berlin.", "I have a flight to Berlin from Rome."
    turn(alice, "s", "t1", outbound)
    turn(alice, "s", "t2", back)
    assert run(alice, "memory_run_maintenance", session_id="s")["consolidated_facts"] == 0
    assert sorted(row.payload["data"] for row in facts_of(alice_scope)) == [back, outbound]


def test_near_duplicates_differ_only_in_filler_words_in_the_same_order():
    def same(one: str, other: str) -> bool:
        return turns._near_duplicate(turns._words(one), turns._words(other))

    assert same("I prefer tea over coffee in the morning.", "I prefer tea over coffee in the morning!")
    assert same("I prefer tea over coffee in the morning.", "I really prefer tea over coffee in the morning.")
    assert not same("I prefer tea over coffee in the morning.", "I prefer coffee over tea in the morning.")
    assert not same("My sister Anna is older than my sister Maria.", "My sister Maria is older than my sister Anna.")
    assert not same("I have a flight to Rome from Berlin.", "I have a flight to Berlin from Rome.")


def test_list_dir_with_abstract(alice, clean_vectors):
    turn(alice, "s1", "t1", "I prefer tea.")
    run(alice, "memory_run_maintenance", session_id="s1")
    tree = run(alice, "memory_list_dir_with_abstract")["summaries"]
    paths = [e["path"] for e in tree]
    assert "/memory/s1/meta" in paths and "/memory/s1/events" in paths and "/memory_tiers/long_term" in paths
    meta = next(e for e in tree if e["path"] == "/memory/s1/meta")
    assert meta["has_overview"] and meta["updated_at"] and "Session s1" in meta["abstract"]
    tiers = next(e for e in tree if e["path"] == "/memory_tiers/long_term")
    assert tiers["abstract"] == "1 facts"
    only = run(alice, "memory_list_dir_with_abstract", path="/memory/s1", depth=1)["summaries"]
    assert [e["path"] for e in only] == ["/memory/s1", "/memory/s1/meta", "/memory/s1/events", "/memory/s1/archives"]
    assert len(run(alice, "memory_list_dir_with_abstract", limit=1)["summaries"]) == 1


def test_user_id_and_limits_are_refused(alice, settings):
    error = fails(alice, "memory_before_turn", session_id="s", user_id="bob", current_input=[user_msg("hi")])
    assert error.code == ErrorCode.INVALID_ARGUMENT and "user_id" in error.message
    for name in ("memory_after_turn", "memory_run_maintenance", "memory_list_dir_with_abstract", "memory_run_turn"):
        assert fails(alice, name, session_id="s", turn_id="t", user_id="1").code == ErrorCode.INVALID_ARGUMENT
    settings.MCP_MEMORY_MAX_ITEMS = 3
    too_many = fails(alice, "memory_before_turn", session_id="s", current_input=[user_msg("x")] * 4)
    assert too_many.code == ErrorCode.PAYLOAD_TOO_LARGE
    settings.MCP_MEMORY_MAX_PART_CHARS = 100
    long_part = fails(alice, "memory_after_turn", session_id="s", turn_id="t", input_items=[user_msg("x" * 101)])
    assert long_part.code == ErrorCode.PAYLOAD_TOO_LARGE
    settings.MCP_MEMORY_MAX_REQUEST_BYTES = 1024
    settings.MCP_MEMORY_MAX_PART_CHARS = 10_000
    big = fails(alice, "memory_after_turn", session_id="s", turn_id="t", input_items=[user_msg("y" * 2000)])
    assert big.code == ErrorCode.PAYLOAD_TOO_LARGE
    bad = fails(alice, "memory_after_turn", session_id="s", turn_id="t", input_items=[{"type": "image"}])
    assert bad.code == ErrorCode.INVALID_ARGUMENT
    assert fails(alice, "memory_after_turn", session_id="s", turn_id="t").code == ErrorCode.INVALID_ARGUMENT
    assert fails(alice, "memory_before_turn", session_id="", current_input=[user_msg("x")]).code == (
        ErrorCode.INVALID_ARGUMENT
    )
    assert not SessionEvent.objects.exists() and not TurnGuard.objects.exists()


def test_tenancy_on_every_tool(alice, bob, alice_scope, bob_scope, clean_vectors):
    alice_turn = turn(alice, "shared", "t1", "My favourite editor is Helix.", project="p")
    run(alice, "memory_run_maintenance", session_id="shared", project="p")
    # before_turn: no alice facts or context for bob, even with her session, project and words.
    seen = run(
        bob, "memory_before_turn", session_id="shared", project="p", current_input=[user_msg("favourite editor")]
    )
    assert seen["recall_fact_ids"] == [] and len(seen["input_items"]) == 1
    # after_turn: bob's same turn id is his own turn, not alice's duplicate.
    bobs = turn(bob, "shared", "t1", "My favourite editor is Vim.", project="p")
    assert not bobs["duplicate"] and set(bobs["fact_ids"]).isdisjoint(alice_turn["fact_ids"])
    # maintenance and list_dir: bob's run touches and shows only his own.
    run(bob, "memory_run_maintenance", session_id="shared", project="p")
    assert SessionEvent.objects.filter(engine_user_id=alice_scope.engine_user_id).count() == 2
    tree = run(bob, "memory_list_dir_with_abstract", project="p")["summaries"]
    assert next(e for e in tree if e["path"] == "/memory_tiers/long_term")["abstract"] == "1 facts"
    # run_turn and prefetch: nothing of alice's.
    recalled = run(bob, "memory_run_turn", session_id="x", current_input=[user_msg("Helix")])["recall_fact_ids"]
    assert recalled and set(recalled).isdisjoint(alice_turn["fact_ids"])
    notes = run(bob, "memory_prefetch", query="Helix editor")
    assert all("Helix" not in m["memory"] for m in notes["memories"])
    # deleting "his" session's events leaves alice's.
    assert run(bob, "delete_session_events", session_id="shared", project="p")["deleted"] == 2
    assert SessionEvent.objects.filter(engine_user_id=alice_scope.engine_user_id).count() == 2
    assert len(facts_of(alice_scope)) == 1


def test_prefetch_notes_block_is_before_turns_block(alice, clean_vectors):
    turn(alice, "s", "t1", "My favourite editor is Helix.")
    notes = run(alice, "memory_prefetch", messages=[{"role": "user", "content": "which editor do I like?"}])
    assert notes["notes"].startswith(turns.MEMORY_BLOCK_HEADER) and "- My favourite editor is Helix." in notes["notes"]
    assert notes["memories"][0]["memory"] == "My favourite editor is Helix."
    before = run(alice, "memory_before_turn", session_id="other", current_input=[user_msg("which editor do I like?")])
    assert (
        before["input_items"][0]["content"] == notes["notes"].replace("", "")
        or notes["notes"].splitlines()[1] in before["input_items"][0]["content"]
    )
    assert fails(alice, "memory_prefetch").code == ErrorCode.INVALID_ARGUMENT


@pytest.mark.django_db(transaction=True)
def test_twenty_concurrent_after_turns_with_one_turn_id_store_once(alice, alice_scope, clean_vectors):
    outcomes: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(20)

    def worker() -> None:
        start.wait()
        try:
            result = turn(alice, "race", "same", "I prefer rooibos tea.")
            outcome = "duplicate" if result["duplicate"] else "stored"
        except ServiceError as error:
            outcome = error.code.value
        finally:
            connections.close_all()
        with lock:
            outcomes.append(outcome)

    threads = [threading.Thread(target=worker) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(outcomes) == 20
    assert set(outcomes) <= {"stored", "duplicate", "resource_busy"}
    assert outcomes.count("stored") == 1
    assert len(facts_of(alice_scope)) == 1
    assert SessionEvent.objects.filter(session_id="race").count() == 2
    assert turn(alice, "race", "same", "I prefer rooibos tea.")["duplicate"]


@pytest.mark.django_db(transaction=True)
def test_concurrent_turns_of_one_session_serialise(alice, clean_vectors):
    errors: list[Exception] = []

    def worker(n: int) -> None:
        try:
            run(
                alice,
                "memory_after_turn",
                session_id="serial",
                turn_id=f"t{n}",
                input_items=[user_msg(f"message {n} a"), user_msg(f"message {n} b")],
                output_items=[assistant_msg(f"answer {n}")],
            )
        except Exception as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    turn_ids = list(SessionEvent.objects.filter(session_id="serial").order_by("id").values_list("turn_id", flat=True))
    assert len(turn_ids) == 18
    # Each turn's three events are contiguous: the commits did not interleave.
    assert all(len(set(turn_ids[i : i + 3])) == 1 for i in range(0, 18, 3))


def test_lifecycle_results_validate_against_their_output_schemas(alice, clean_vectors):
    import jsonschema

    from memories.interfaces.mcp.lifecycle import LIFECYCLE_TOOLSET

    schemas = {tool.name: tool.output_schema for tool in LIFECYCLE_TOOLSET.tools}
    calls = {
        "memory_after_turn": {"session_id": "s", "turn_id": "t", "input_items": [user_msg("I prefer tea.")]},
        "memory_before_turn": {"session_id": "s", "current_input": [user_msg("tea?")]},
        "memory_run_turn": {"session_id": "s", "current_input": [user_msg("tea?")]},
        "memory_run_maintenance": {"session_id": "s"},
        "memory_list_dir_with_abstract": {},
    }
    assert set(calls) == set(schemas)
    for name, arguments in calls.items():
        jsonschema.validate(run(alice, name, **arguments), schemas[name])


def test_nightly_maintenance_runs_every_active_session_unbilled(alice, bob, alice_scope, monkeypatch, clean_vectors):
    from billing.models import UsageEvent
    from memories.tasks import turns_maintenance_nightly

    turn(alice, "a1", "t", "I prefer tea.")
    turn(bob, "b1", "t", "I prefer coffee.")
    SessionState.objects.filter(session_id="b1").update(last_active_at=timezone.now() - timedelta(days=30))
    monkeypatch.setattr(turns, "_now", lambda: timezone.now() + timedelta(days=2))
    usage = UsageEvent.objects.count()
    assert turns_maintenance_nightly.apply().get() == 1  # bob's session is not active
    assert UsageEvent.objects.count() == usage
    assert AuditEvent.objects.filter(operation="memory_run_maintenance", outcome="ok").count() == 1
    assert SessionArchive.objects.filter(session_id="a1").exists()
    assert not SessionArchive.objects.filter(session_id="b1").exists()


def test_seed_002_metrics_count_facts_busy_turns_and_compactions(
    alice, alice_scope, monkeypatch, clean_vectors, django_capture_on_commit_callbacks
):
    from core import metrics

    def value(counter, **labels) -> float:
        return (counter.labels(**labels) if labels else counter)._value.get()

    facts = value(metrics.TURN_FACT_WRITE, tier="long_term")
    with django_capture_on_commit_callbacks(execute=True):
        turn(alice, "s", "t1", "I prefer tea over coffee.")
    assert value(metrics.TURN_FACT_WRITE, tier="long_term") == facts + 1
    TurnGuard.objects.create(
        engine_user_id=alice_scope.engine_user_id, project="", session_id="s", turn_id="t2", owner="someone"
    )
    conflicts = value(metrics.TURN_IDEMPOTENCY_CONFLICTS)
    fails(alice, "memory_after_turn", session_id="s", turn_id="t2", input_items=[user_msg("I live in Oslo.")])
    assert value(metrics.TURN_IDEMPOTENCY_CONFLICTS) == conflicts + 1
    later = timezone.now() + timedelta(days=2)
    monkeypatch.setattr(turns, "_now", lambda: later)
    compactions = value(metrics.TURN_COMPACTION)
    with django_capture_on_commit_callbacks(execute=True):
        run(alice, "memory_run_maintenance", session_id="s")
    assert value(metrics.TURN_COMPACTION) > compactions
