"""Review 32 of the turn lifecycle (seed 002) and its neighbours.

F1: the Sessions page's tier lists (`facts_by_tier`) and counts (`fact_counts_by_tier`)
took one statement per tier each (three and three); one each now, with the same answers.
The summary refresh's per-tier counts (`turns.services`, its own copy) use the selector.

F3: the session-log download (Your data) left out the turn guards: what memory_after_turn
recorded of each turn (done or under way, the facts it stored, what it left out or
shortened, its items' sha256). They are the user's data about their sessions: one `turn`
line each now, counted as `turns` (a new line kind and key only: version 1 still).

F4: the audit row of a `remember` that made an expiring turn fact durable said
`made_durable: true`; the toolkit's store_memory names the facts (a list of ids). Both
name them now, so one forensic query reads either.

F5: `manage.py reembed` whose switch kept losing to concurrent writes (each try found more
late rows than it embeds while writes wait) answered `conflict: ... fill first`, though it
had filled six times and a later run resumes and may win: `resource_busy` with
`retry_after_s` now, saying that the filled vectors are kept and to run it again. A state
that forbids the run (another target under way) stays `conflict`."""

from __future__ import annotations

import json

import pytest

from audit.models import AuditEvent
from memories.models import TurnGuard
from memories.turns.extraction import TIERS
from tests.test_turns import turn

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]


# --- F1: the tiers' facts and counts in one statement each -------------------------------------------
@pytest.fixture
def facts_in_every_tier(alice, bob, clean_vectors):
    """Alice: two L1 facts (two sessions), one L2, two long-term; bob one of each tier."""
    for n, said in enumerate(
        [
            "Today I am working from the cafe.",
            "Right now I am using a borrowed laptop.",
            "This week I am planning a trip to Porto.",
            "I prefer tea over coffee.",
            "My favourite editor is Helix.",
        ]
    ):
        turn(alice, "s" if n != 1 else "other", f"t{n}", said)
    for n, said in enumerate(["Today I am at home.", "Tomorrow I am going hiking.", "I prefer coffee over tea."]):
        turn(bob, "s", f"t{n}", said)


@pytest.mark.usefixtures("facts_in_every_tier")
def test_the_tiers_facts_are_one_statement_for_all_tiers(alice_scope, django_assert_num_queries):
    from memories.turns.selectors import facts_by_tier

    with django_assert_num_queries(1):
        facts = facts_by_tier(alice_scope)
    texts = {tier: [f["text"] for f in facts[tier]] for tier in TIERS}
    # Newest first within each tier; bob's facts never listed.
    assert texts == {
        "l1": ["Right now I am using a borrowed laptop.", "Today I am working from the cafe."],
        "l2": ["This week I am planning a trip to Porto."],
        "long_term": ["My favourite editor is Helix.", "I prefer tea over coffee."],
    }
    assert [f["session_id"] for f in facts["l1"]] == ["other", "s"]
    assert facts["l1"][0]["expires_at"] and facts["long_term"][0]["expires_at"] is None
    assert set(facts["l2"][0]) == {"id", "text", "session_id", "expires_at"}
    # At most `limit` of each tier, the newest.
    with django_assert_num_queries(1):
        one = facts_by_tier(alice_scope, limit=1)
    assert {tier: [f["text"] for f in one[tier]] for tier in TIERS} == {tier: texts[tier][:1] for tier in TIERS}
    assert facts_by_tier(alice_scope, limit=0) == {tier: [] for tier in TIERS}


@pytest.mark.usefixtures("facts_in_every_tier")
def test_the_tiers_counts_are_one_statement_for_all_tiers(alice_scope, bob_scope, django_assert_num_queries):
    from memories.turns.selectors import fact_counts_by_tier

    with django_assert_num_queries(1):
        counts = fact_counts_by_tier(alice_scope)
    assert counts == {"l1": 2, "l2": 1, "long_term": 2}  # bob's never counted
    assert fact_counts_by_tier(bob_scope) == {"l1": 1, "l2": 1, "long_term": 1}
    assert fact_counts_by_tier(alice_scope, session_id="other") == {"l1": 1, "l2": 0, "long_term": 0}


# --- F3: the session-log download holds the turn guards ----------------------------------------------
def test_the_session_log_download_holds_my_turns_and_never_bobs(alice, bob, alice_scope, client):
    done = turn(alice, "s", "t1", "I prefer tea over coffee.")
    turn(bob, "s", "bob-turn-secret", "I prefer coffee over tea.")  # same session id, bob's
    # A turn under way (its guard `processing`, committed before the slow work).
    TurnGuard.objects.create(
        engine_user_id=alice_scope.engine_user_id, project="p", session_id="s2", turn_id="t9", owner="req-x"
    )
    client.force_login(alice)
    response = client.post("/data/export/session-logs/")
    assert response.status_code == 200
    body = b"".join(response.streaming_content).decode()
    header, *rest = [json.loads(line) for line in body.splitlines()]
    assert (header["format"], header["version"], header["turns"]) == ("memsite.session_logs", 1, 2)
    turns = [line["turn"] for line in rest if "turn" in line]
    assert [(t["project"], t["session_id"], t["turn_id"], t["state"]) for t in turns] == [
        ("", "s", "t1", "done"),
        ("p", "s2", "t9", "processing"),
    ]
    committed = turns[0]
    assert committed["fact_ids"] == done["fact_ids"] and len(committed["content_sha256"]) == 64
    assert (committed["facts_left_out"], committed["facts_shortened"]) == (0, 0)
    assert {"created_at", "updated_at"} <= set(committed) and "owner" not in committed
    assert "bob-turn-secret" not in body and "req-x" not in body
    assert AuditEvent.objects.get(operation="export_session_logs").detail["turns"] == 2


# --- F4: made_durable is a list of memory ids on remember's audit row as on store_memory's ----------
def test_remember_and_store_memory_name_the_facts_they_made_durable(alice, settings):
    from memories.auth import Principal
    from memories.operations import operation_execute
    from tests.conftest import internal_call

    settings.RATE_LIMITS = {op: (0, 60) for op in settings.RATE_LIMITS}
    principal = Principal(user=alice, method="api_key", client_app="agent")
    remembered = turn(alice, "s", "t1", "Today I am working from the cafe.")["fact_ids"][0]
    stored = turn(alice, "s", "t2", "Right now I am using a borrowed laptop.")["fact_ids"][0]
    operation_execute(principal, "remember", {"memory": "Today I am working from the cafe."}, call=internal_call())
    operation_execute(
        principal,
        "store_memory",
        {"conversation_id": "c", "messages": [{"role": "human", "content": "Right now I am using a borrowed laptop."}]},
        call=internal_call(),
    )
    details = {
        row.operation: row.detail for row in AuditEvent.objects.filter(operation__in=["remember", "store_memory"])
    }
    assert details["remember"]["made_durable"] == [remembered]
    assert details["store_memory"]["made_durable"] == [stored]


# --- F5: a re-embedding switch that keeps losing to writes is resource_busy, not conflict -----------
def test_a_reembed_switch_losing_to_writes_is_resource_busy_and_a_rerun_switches(alice_scope, fake_gemini, monkeypatch):
    from django.core.management import call_command
    from django.core.management.base import CommandError

    from core.errors import ErrorCode, ServiceError
    from memories import reembed
    from memories.engine import engine_reembed_progress
    from memories.engine import reembed as engine_reembed
    from memories.services import memory_remember
    from tests.conftest import internal_call

    for n in range(3):
        memory_remember(alice_scope, memory=f"Alice's note number {n}", call=internal_call())
    # Writes arrive after every fill, more than the switch embeds while writes wait.
    monkeypatch.setattr(engine_reembed, "SWITCH_MAX_LATE_ROWS", 1)
    fill, written = reembed.engine_reembed_fill, []

    def fill_then_writes(**kwargs):
        filled = fill(**kwargs)
        for _ in range(2):
            written.append(len(written))
            memory_remember(alice_scope, memory=f"Alice's late note {len(written)}", call=internal_call())
        return filled

    monkeypatch.setattr(reembed, "engine_reembed_fill", fill_then_writes)
    target = reembed.embedder_target(name="gemini", dims=64)
    with pytest.raises(ServiceError) as busy:
        reembed.embedder_reembed(target=target, batch=4)
    assert (busy.value.code, busy.value.retry_after_s) == (ErrorCode.RESOURCE_BUSY, 1)
    assert "run the command again" in busy.value.message
    assert len(written) == 2 * reembed.SWITCH_ATTEMPTS  # a fill before each of the six tries
    with pytest.raises(CommandError, match="^resource_busy: writes kept coming"):
        call_command("reembed", "--to", "gemini", "--dims", "64")
    # Nothing filled is lost: the target is still under way, and a quieter re-run switches.
    progress = engine_reembed_progress()
    assert progress.target == "gemini:64" and progress.done > 0
    monkeypatch.setattr(reembed, "engine_reembed_fill", fill)
    call_command("reembed", "--to", "gemini", "--dims", "64")
    assert engine_reembed_progress().active == "gemini:64"
    # Another target while one is under way is a conflict still (not a wait).
    reembed.embedder_reembed(target=reembed.embedder_target(name="gemini", dims=32), switch=False)
    with pytest.raises(CommandError, match="^conflict: a re-embedding to gemini:32 is under way"):
        call_command("reembed", "--to", "local")
