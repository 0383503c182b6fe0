"""Review 31 of the turn lifecycle (seed 002) and its neighbours.

F1: a lock wait that timed out is a wait, not a conflict: `resource_busy` with
`retry_after_s` on every path and surface. Before, `remember` and `store_decision` (and
every writer outside the turn lifecycle) answered `conflict` on the user's erasure lock
held past MEMORY_LOCK_TIMEOUT_S, which tells a client not to retry; so did a deadlock in
maintenance and a fact text stored and removed by others while a turn stored it.
A turn whose guard a clear-all deleted keeps `conflict` (the clear wins: a client's
automatic retry would store after it what was said before it), now with a reason.

F4: the session-log download (Your data) left out stored data of the user: the input
memory_run_turn keeps for a turn not committed yet, and the summary before_turn shows
(`context_summary`). Both are in it now, as new keys and a new line kind only.

F5: memory_list_dir_with_abstract's tier stats took two statements per tier (six); one."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

import psycopg
import pytest
from django.db import connection
from django.test import override_settings

from audit.models import AuditEvent
from core.errors import ErrorCode
from memories.models import ContentHash, SessionEvent, TurnGuard
from memories.toolkit.models import Decision
from memories.turns import services as turns
from tests.test_turns import facts_of, fails, turn, user_msg

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]


@contextlib.contextmanager
def erasure_held(scope) -> Iterator[None]:
    """The user's erasure lock held exclusively by another connection (a clear-all or
    erasure under way)."""
    params = connection.get_connection_params()
    other = psycopg.connect(**{k: v for k, v in params.items() if k not in ("cursor_factory", "context")})
    try:
        other.execute("SELECT pg_advisory_lock(hashtextextended(%s, 0))", [f"clear_all:{scope.engine_user_id}"])
        yield
    finally:
        other.close()


def test_remember_and_store_decision_over_mcp_answer_resource_busy_during_an_erasure(
    alice, alice_scope, alice_key, mcp_as
):
    """The live server waits MEMORY_LOCK_TIMEOUT_S (its default) for the erasure lock."""
    memory = mcp_as(alice_key)
    toolkit = mcp_as(alice_key)
    toolkit.url = toolkit.url.replace("/engines/memory/mcp", "/engines/memory-toolkit/mcp")
    with erasure_held(alice_scope):
        remembered = memory.error("remember", {"memory": "Alice collects stamps"})
        decided = json.loads(toolkit.call("store_decision", {"key": "k", "value": "v"}).content[0].text)
    assert (remembered["code"], remembered["retry_after_s"]) == ("resource_busy", 1), remembered
    assert (decided["code"], decided["retry_after_s"]) == ("resource_busy", 1), decided  # seed 003's shape
    assert not ContentHash.objects.exists() and not Decision.objects.exists()
    # The retry the answer asks for goes through once the erasure is over.
    assert memory.ok("remember", {"memory": "Alice collects stamps"})["duplicate"] is False
    assert toolkit.call("store_decision", {"key": "k", "value": "v"}).is_error is False


@override_settings(MEMORY_LOCK_TIMEOUT_S=0.3)
@pytest.mark.parametrize(
    ("path", "body"),
    [("/v1/memories", {"memory": "Alice collects stamps"}), ("/v1/memory", {"content": "Alice collects stamps"})],
    ids=["rest", "seed001"],
)
def test_remember_over_rest_answers_resource_busy_with_retry_after_during_an_erasure(
    alice, alice_scope, alice_key, api_client, path, body
):
    client = api_client(alice_key)
    with erasure_held(alice_scope):
        response = client.post(path, body, format="json")
    assert response.status_code == 409, response.content
    error = response.json()["error"]
    assert (error["code"], error["retry_after_s"], response["Retry-After"]) == ("resource_busy", 1, "1")
    assert not ContentHash.objects.exists()
    assert AuditEvent.objects.get(outcome="error").error_code == "resource_busy"
    assert client.post(path, body, format="json").status_code in (200, 201)


def test_a_fact_text_stored_and_removed_meanwhile_is_resource_busy(alice, alice_scope, monkeypatch):
    """An import stored the text between the hash claim and the insert, and it went
    again before the turn could find it: a race, retried into a stored fact."""
    insert = turns._text_insert_claimed
    monkeypatch.setattr(turns, "_text_insert_claimed", lambda *args, **kwargs: None)
    error = fails(
        alice, "memory_after_turn", session_id="s", turn_id="t", input_items=[user_msg("I prefer tea over coffee.")]
    )
    assert (error.code, error.retry_after_s) == (ErrorCode.RESOURCE_BUSY, 1), error.message
    assert not TurnGuard.objects.exists() and not SessionEvent.objects.exists()  # nothing half-stored
    monkeypatch.setattr(turns, "_text_insert_claimed", insert)
    assert len(turn(alice, "s", "t", "I prefer tea over coffee.")["fact_ids"]) == 1
    assert len(facts_of(alice_scope)) == 1


# --- F4: the session-log download holds run_turn's kept inputs and before_turn's summary ------------
def test_the_session_log_download_holds_kept_inputs_and_the_context_summary_of_mine_only(
    alice, alice_scope, bob, bob_scope, client
):
    """Everything stored of the user is theirs to download: the input memory_run_turn
    keeps for a turn not committed yet, and the summary before_turn shows. Another
    user's, in a session of the same id, never appears."""
    from memories.models import SessionState
    from tests.test_turns import run

    mine = run(alice, "memory_run_turn", session_id="s", current_input=[user_msg("alice-kept-input")])
    run(bob, "memory_run_turn", session_id="s", current_input=[user_msg("bob-kept-secret")])
    for scope, summary in ((alice_scope, "alice-context-summary"), (bob_scope, "bob-summary-secret")):
        SessionState.objects.update_or_create(
            engine_user_id=scope.engine_user_id, project="", session_id="s", defaults={"context_summary": summary}
        )
    client.force_login(alice)
    response = client.post("/data/export/session-logs/")
    assert response.status_code == 200
    body = b"".join(response.streaming_content).decode()
    header, *rest = [json.loads(line) for line in body.splitlines()]
    # The keys an older reader knows are all still there, as they were.
    assert (header["format"], header["version"], header["sessions"], header["events"], header["archives"]) == (
        "memsite.session_logs",
        1,
        1,
        0,
        0,
    )
    assert header["pending_inputs"] == 1
    (session,) = [line["session"] for line in rest if "session" in line]
    assert session["context_summary"] == "alice-context-summary"
    assert {"abstract", "overview", "created_at", "last_active_at"} <= set(session)
    (kept,) = [line["pending_input"] for line in rest if "pending_input" in line]
    assert (kept["session_id"], kept["operation_token"]) == ("s", mine["operation_token"])
    assert "alice-kept-input" in json.dumps(kept["items"])
    assert "bob-kept-secret" not in body and "bob-summary-secret" not in body
    audited = AuditEvent.objects.get(operation="export_session_logs").detail
    assert audited == {"sessions": 1, "events": 0, "archives": 0, "pending_inputs": 1, "turns": 0}


def test_a_session_log_download_given_to_the_memories_import_is_refused_whole(alice, alice_scope, client):
    """No import reads the session-log file: the memories import refuses it by its
    header's format, and nothing of it is stored."""
    from tests.test_turns import run

    run(alice, "memory_run_turn", session_id="s", current_input=[user_msg("I live in Porto.")])
    client.force_login(alice)
    body = b"".join(client.post("/data/export/session-logs/").streaming_content)
    error = fails(alice, "import_memories", data=body, source="memsite")
    assert error.code == ErrorCode.INVALID_ARGUMENT and "memsite.memories header" in error.message
    assert not ContentHash.objects.exists() and not facts_of(alice_scope)


# --- F5: the tree's tier stats in one statement ------------------------------------------------------
def test_the_trees_tier_stats_are_one_statement_for_all_tiers(alice, alice_scope, bob, django_assert_num_queries):
    from memories.turns.selectors import _Tree, fact_counts_by_tier

    turn(alice, "s", "t1", "Today I am working from the cafe.")  # l1
    turn(alice, "s", "t2", "I prefer tea over coffee.")  # long-term
    turn(alice, "other", "t1", "I prefer green tea over black tea.", project="p")
    turn(bob, "s", "t1", "I prefer coffee over tea.")  # bob's: never counted for alice
    expected = fact_counts_by_tier(alice_scope)
    with django_assert_num_queries(1):
        stats = _Tree(scope=alice_scope, project="", session_id="", limit=100).tier_stats()
    assert {tier: n for tier, (n, _) in stats.items()} == expected == {"l1": 1, "l2": 0, "long_term": 2}
    assert stats["l2"][1] is None and stats["l1"][1] is not None and stats["long_term"][1] is not None
    projected = _Tree(scope=alice_scope, project="p", session_id="", limit=100).tier_stats()
    assert {tier: n for tier, (n, _) in projected.items()} == {"l1": 0, "l2": 0, "long_term": 1}
    narrowed = _Tree(scope=alice_scope, project="", session_id="other", limit=100).tier_stats()
    assert narrowed["long_term"][0] == 1 and narrowed["l1"][0] == 0
    entries = {e["path"]: e for e in run_tree(alice)}
    assert entries["/memory_tiers"]["abstract"] == "3 live facts by tier: l1 1, l2 0, long_term 2."


def run_tree(user) -> list[dict]:
    from tests.test_turns import run

    return run(user, "memory_list_dir_with_abstract")["summaries"]
