"""Review 30 of seed 002's turn lifecycle.

F1: memory_run_turn keeps the current input under its operation token, so after_turn with
the token and the output alone commits the whole turn (§4.5); an unknown server-issued
token with no input is refused, never a turn stored without its input.
F2: before_turn's prepared input_items sent back to after_turn are recognised: the notes,
summary, instructions and replayed context are not stored again.
F7: after maintenance, the summary before_turn shows covers only what its recent context
window does not."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.test import override_settings
from django.utils import timezone

from audit.models import AuditEvent
from core.errors import ErrorCode
from memories.models import SessionEvent, TurnGuard
from memories.turns import services as turns
from tests.test_turns import assistant_msg, facts_of, fails, run, turn, user_msg

pytestmark = pytest.mark.django_db


def _log(session: str = "s") -> list[dict]:
    return list(SessionEvent.objects.filter(session_id=session).order_by("id").values_list("item", flat=True))


def _pending():  # imported here: the file's tests run (and fail) on code without the model
    from memories.models import TurnPending

    return TurnPending.objects


def _ours(item: dict) -> bool:
    """before_turn's memory block or summary."""
    content = item.get("content")
    return isinstance(content, str) and content.startswith((turns.MEMORY_BLOCK_HEADER, turns.SUMMARY_HEADER))


def _texts(items: list[dict]) -> list[str]:
    return [i["content"] if isinstance(i["content"], str) else i["content"][0]["text"] for i in items]


# --- F1: run_turn's token commits the turn's input ---------------------------------------------
def test_run_turn_token_and_output_alone_commit_the_input_too(alice, alice_scope, clean_vectors):
    said = user_msg("I am allergic to peanuts.")
    started = run(alice, "memory_run_turn", session_id="s", current_input=[said])
    token = started["operation_token"]
    assert re.fullmatch(r"rt-[0-9a-f]{32}", token)  # server-issued: no turn_id was given
    committed = run(alice, "memory_after_turn", session_id="s", turn_id=token, output_items=[assistant_msg("Noted.")])
    assert committed["ok"] and not committed["duplicate"] and committed["events_stored"] == 2
    assert _log() == [said, assistant_msg("Noted.")]
    assert len(committed["fact_ids"]) == 1 and "peanuts" in facts_of(alice_scope)[0].payload["data"]
    assert not _pending().exists()  # consumed with the turn
    # A retry of the commit is the duplicate it is: nothing stored twice.
    again = run(alice, "memory_after_turn", session_id="s", turn_id=token, output_items=[assistant_msg("Noted.")])
    assert again["duplicate"] and again["fact_ids"] == committed["fact_ids"] and len(_log()) == 2


def test_run_turn_with_a_turn_id_keeps_the_input_under_it(alice, clean_vectors):
    said = user_msg("My favourite editor is Helix.")
    started = run(alice, "memory_run_turn", session_id="s", turn_id="t1", current_input=[said])
    assert started["operation_token"] == "t1"
    run(alice, "memory_after_turn", session_id="s", turn_id="t1", output_items=[assistant_msg("Nice.")])
    assert _log() == [said, assistant_msg("Nice.")]


@pytest.mark.parametrize("sent", ["current_input", "prepared"])
def test_run_turn_input_sent_again_is_stored_once(alice, clean_vectors, sent):
    turn(alice, "s", "t0", "Let us plan the offsite.", "Sure.")
    said = user_msg("Venue near Lisbon.")
    started = run(alice, "memory_run_turn", session_id="s", current_input=[said], base_instructions="Be brief.")
    items = [said] if sent == "current_input" else started["input_items"]
    run(
        alice,
        "memory_after_turn",
        session_id="s",
        turn_id=started["operation_token"],
        input_items=items,
        output_items=[assistant_msg("Lisbon it is.")],
    )
    assert _texts(_log()) == ["Let us plan the offsite.", "Sure.", "Venue near Lisbon.", "Lisbon it is."]


def test_unknown_or_foreign_token_with_output_alone_is_refused(alice, bob, clean_vectors):
    never = "rt-" + "0" * 32
    refused = fails(alice, "memory_after_turn", session_id="s", turn_id=never, output_items=[assistant_msg("x")])
    assert refused.code == ErrorCode.NOT_FOUND and refused.details == {"reason": "operation_token_unknown"}
    # Bob's token is, to alice, one never issued; bob's kept input stays his.
    token = run(bob, "memory_run_turn", session_id="s", current_input=[user_msg("I live in Oslo.")])["operation_token"]
    refused = fails(alice, "memory_after_turn", session_id="s", turn_id=token, output_items=[assistant_msg("x")])
    assert refused.code == ErrorCode.NOT_FOUND
    assert not SessionEvent.objects.exists() and not TurnGuard.objects.exists()
    assert AuditEvent.objects.filter(operation="memory_after_turn", error_code="not_found").count() == 2
    run(bob, "memory_after_turn", session_id="s", turn_id=token, output_items=[assistant_msg("Noted.")])
    assert _texts(_log()) == ["I live in Oslo.", "Noted."]
    # With its input sent, an unknown token is an ordinary turn id: nothing is missing.
    done = run(alice, "memory_after_turn", session_id="s", turn_id=never, input_items=[user_msg("hi")])
    assert done["events_stored"] == 1


def test_plain_after_turn_with_output_alone_is_unchanged(alice, clean_vectors):
    """A client's own turn id is no server token: output alone is stored, as before."""
    done = run(alice, "memory_after_turn", session_id="s", turn_id="my-turn-7", output_items=[assistant_msg("Hi.")])
    assert done["events_stored"] == 1 and _log() == [assistant_msg("Hi.")]


def test_an_expired_token_is_refused_and_pruned(alice, clean_vectors):
    token = run(alice, "memory_run_turn", session_id="s", current_input=[user_msg("I like tea.")])["operation_token"]
    _pending().update(created_at=timezone.now() - timedelta(hours=25))
    refused = fails(alice, "memory_after_turn", session_id="s", turn_id=token, output_items=[assistant_msg("x")])
    assert refused.code == ErrorCode.NOT_FOUND
    run(alice, "memory_run_maintenance", session_id="s")  # the session exists (run_turn kept its input)
    assert not _pending().exists()


def test_deleting_a_sessions_events_deletes_its_kept_input(alice, clean_vectors):
    turn(alice, "s", "t0", "hello")
    token = run(alice, "memory_run_turn", session_id="s", current_input=[user_msg("I like tea.")])["operation_token"]
    run(alice, "delete_session_events", session_id="s")
    assert not _pending().exists()
    assert fails(alice, "memory_after_turn", session_id="s", turn_id=token, output_items=[assistant_msg("x")]).code
    assert not SessionEvent.objects.exists()


def test_a_clear_all_drops_the_kept_input_of_a_turn_not_yet_committed(alice, bob, clean_vectors):
    """What the user said before a clear-all must not come back as a fact after it."""
    mine = run(alice, "memory_run_turn", session_id="s", current_input=[user_msg("I live in Porto.")])
    bobs = run(bob, "memory_run_turn", session_id="s", current_input=[user_msg("I live in Oslo.")])
    run(alice, "clear_all_memory", confirm=True)
    late = fails(
        alice, "memory_after_turn", session_id="s", turn_id=mine["operation_token"], output_items=[assistant_msg("x")]
    )
    assert late.code == ErrorCode.NOT_FOUND and late.details == {"reason": "operation_token_unknown"}
    # Bob's kept input is his: his turn still commits whole.
    done = run(
        bob, "memory_after_turn", session_id="s", turn_id=bobs["operation_token"], output_items=[assistant_msg("Ok.")]
    )
    assert done["events_stored"] == 2


# --- F2: before_turn's prepared input sent back ---------------------------------------------------
def test_prepared_input_sent_back_stores_each_item_once(alice, clean_vectors):
    said = ["I prefer green tea over coffee.", "What should I drink now?", "And tomorrow?", "Thanks."]
    sizes = []
    for n, text in enumerate(said):
        before = run(
            alice, "memory_before_turn", session_id="s", current_input=[user_msg(text)], base_instructions="Be brief."
        )
        after = run(
            alice,
            "memory_after_turn",
            session_id="s",
            turn_id=f"t{n}",
            input_items=before["input_items"],
            output_items=[assistant_msg(f"answer {n}")],
        )
        assert after["events_stored"] + after.get("input_items_skipped", 0) == len(before["input_items"]) + 1
        sizes.append(len(_log()))
    # The first turn's prepared input (no notes, no context yet) is the instructions and
    # the input as a plain client sends them; from then on each turn adds its two items.
    assert sizes == [3, 5, 7, 9]
    log = _log()
    assert not any(_ours(item) for item in log)
    assert _texts(log)[1:] == [t for n, text in enumerate(said) for t in (text, f"answer {n}")]
    last = run(alice, "memory_before_turn", session_id="s", current_input=[user_msg("bye")])
    texts = _texts(last["input_items"])
    assert texts.count("What should I drink now?") == 1 and texts.count("answer 3") == 1


def test_plain_client_repeats_are_stored_every_time(alice, clean_vectors):
    """Only a replay of the log's last items is recognised: a client saying the same
    thing again in a new turn (or sending its own system message) has it stored."""
    for n in range(3):
        run(
            alice,
            "memory_after_turn",
            session_id="s",
            turn_id=f"t{n}",
            input_items=[{"type": "message", "role": "system", "content": "Be brief."}, user_msg("ok")],
            output_items=[assistant_msg("Done.")],
        )
    assert _texts(_log()) == ["Be brief.", "ok", "Done."] * 3


# --- F7: the summary leaves the recent window to itself -------------------------------------------
def test_summary_after_maintenance_does_not_repeat_the_recent_context(alice, clean_vectors):
    turn(alice, "s", "t1", "Let us plan the quarterly offsite agenda.", "Sure: venue, dates, speakers.")
    turn(alice, "s", "t2", "Venue first: somewhere near Lisbon.", "Noted, Lisbon area.")
    run(alice, "memory_run_maintenance", session_id="s")
    out = run(alice, "memory_before_turn", session_id="s", current_input=[user_msg("And the dates?")])
    texts = _texts(out["input_items"])
    assert sum("Lisbon area" in t for t in texts) == 1
    assert not any(t.startswith(turns.SUMMARY_HEADER) for t in texts)


@override_settings(MCP_MEMORY_RECENT_CONTEXT_ITEMS=2)
def test_summary_covers_what_the_recent_window_leaves_out(alice, clean_vectors):
    turn(alice, "s", "t1", "Let us plan the quarterly offsite agenda.", "Sure: venue, dates, speakers.")
    turn(alice, "s", "t2", "Venue first: somewhere near Lisbon.", "Noted, Lisbon area.")
    run(alice, "memory_run_maintenance", session_id="s")
    out = run(alice, "memory_before_turn", session_id="s", current_input=[user_msg("And the dates?")])
    texts = _texts(out["input_items"])
    summary = next(t for t in texts if t.startswith(turns.SUMMARY_HEADER))
    assert "offsite agenda" in summary and "Lisbon" not in summary
    assert sum("Lisbon area" in t for t in texts) == 1
