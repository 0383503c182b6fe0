"""Review 20: maintenance and the user's erasure lock (consolidation and retention took
none, so a clear-all or erasure deadlocked with them; the nightly job stopped at one
user's failure), integers past 100 digits on surfaces whose JSON parser is not ours
(MCP), and control characters in a turn's conversation items (kept in the session log,
as the chat proxy keeps them; never in a memory's text)."""

from __future__ import annotations

import json
import logging
from datetime import timedelta

import psycopg
import pytest
from django.conf import settings as django_settings
from django.db import OperationalError, connection
from django.utils import timezone

from core.errors import ErrorCode, ServiceError
from core.inputs import InputError, json_loads_safe, json_value_check, transcript_text_problem
from core.scope import CallContext, MemoryScope
from memories.auth import Principal
from memories.engine import attrs_containment, engine_memory_of, engine_rows_owned
from memories.models import SessionEvent, SessionState
from memories.operations import operation_execute
from memories.services import api_key_issue, erasure_lock_key, memory_export, memory_import_file
from memories.turns import services as turns
from memories.turns.extraction import FACT_TAG
from memories.turns.schemas import AfterTurnInput, BeforeTurnInput, MaintenanceInput, RunTurnInput
from tests.conftest import InThread, internal_call, wait_for

# Engine rows are written outside test transactions: every database test cleans them.
with_vectors = pytest.mark.usefixtures("clean_vectors")


def run(user, name: str, **arguments):
    return operation_execute(Principal(user=user, method="api_key"), name, arguments, call=CallContext(channel="mcp"))


def fails(user, name: str, **arguments) -> ServiceError:
    with pytest.raises(ServiceError) as info:
        run(user, name, **arguments)
    return info.value


def _msg(role: str, text: str) -> dict:
    kind = "input_text" if role == "user" else "output_text"
    return {"type": "message", "role": role, "content": [{"type": kind, "text": text}]}


def _other() -> psycopg.Connection:
    params = {k: v for k, v in connection.get_connection_params().items() if k not in ("cursor_factory", "context")}
    return psycopg.connect(**params, autocommit=False)


def _waiters(*locktypes: str) -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_locks WHERE locktype = ANY(%s) AND NOT granted", [list(locktypes)])
        return cursor.fetchone()[0]


def _facts(scope) -> list:
    rows = engine_rows_owned(scope, containment=attrs_containment(tags=[FACT_TAG]))
    return sorted(rows, key=lambda r: (r.payload["created_at"], str(r.id)))


# --- 1. maintenance takes the user's write locks first -------------------------------------------
@pytest.mark.django_db(transaction=True)
@with_vectors
@pytest.mark.parametrize("eraser", ["clear_all_memory", "wipe_user_data"])
def test_consolidation_waits_for_no_held_row_and_an_erasure_after_it_completes(alice, alice_scope, settings, eraser):
    """Consolidation row-locked the facts it trashes in id order, an erasure all the user's
    rows in scan order: without the user's erasure lock taken first, the two deadlocked
    and Postgres aborted one (an unexpected error). Since 9e5b661 consolidation waits for
    no row at all (SKIP LOCKED: a pair with a row another call holds is left for the next
    run), so it cannot be in such a cycle. A third connection holds the row consolidation
    would lock first: maintenance completes without it, an erasure then waits for that
    row, and once it is let go both have completed and nothing of the user is left."""
    settings.RATE_LIMITS = {**settings.RATE_LIMITS, "clear_all_memory": (0, 60), "wipe_user_data": (0, 60)}
    settings.MEMORY_LOCK_TIMEOUT_S = 60  # the erasure waits for the held row, not times out
    # Near-duplicate facts (same words): consolidation keeps the newest, trashes the rest.
    # Add more until the lowest id among the doomed ones is not the oldest of them.
    for k in range(1, 12):
        said = "I prefer tea over coffee in the morning" + ("!" * k)
        run(alice, "memory_after_turn", session_id="s", turn_id=f"t{k}", input_items=[_msg("user", said)],
            output_items=[_msg("assistant", "Noted.")])  # fmt: skip
        doomed = _facts(alice_scope)[:-1]  # all but the newest
        if len(doomed) >= 2 and min(doomed, key=lambda r: str(r.id)).id != doomed[0].id:
            break
    first_locked = str(min(doomed, key=lambda r: str(r.id)).id)  # consolidation would lock this one first

    holder = _other()
    try:
        holder.execute(
            f'SELECT 1 FROM "{django_settings.MEMORY_COLLECTION}" WHERE id = %s FOR UPDATE',  # noqa: S608
            [first_locked],
        )
        maintenance = InThread(lambda: run(alice, "memory_run_maintenance", session_id="s"))
        wait_for(maintenance.done, timeout=60, what="maintenance, which waits for no row")
        eraser_call = InThread(lambda: run(alice, eraser, confirm=True))
        wait_for(
            lambda: _waiters("transactionid", "tuple") >= 1 or eraser_call.done(),
            timeout=60,
            what="the erasure waiting for the held row",
        )
        assert not eraser_call.done()
    finally:
        holder.rollback()  # release: the erasure takes the row
        holder.close()
    consolidated = maintenance.result()
    eraser_call.result()
    # The held fact's pair was left for the next run; each other doomed fact was trashed.
    assert consolidated["consolidated_facts"] == len(doomed) - 1
    assert _facts(alice_scope) == []


@pytest.mark.django_db(transaction=True)
@with_vectors
def test_retention_sweep_waits_for_an_erasure_under_way(alice, alice_scope, settings, monkeypatch):
    """The retention sweep deletes expired facts: while an erasure holds the user's lock,
    it waits (here: times out as `resource_busy`, seed 002 §7.3) instead of row-locking beside it."""
    run(alice, "memory_after_turn", session_id="s", turn_id="t1", input_items=[_msg("user", "I am in Rome today.")],
        output_items=[_msg("assistant", "Noted.")])  # fmt: skip
    assert _facts(alice_scope)
    monkeypatch.setattr(turns, "_now", lambda: timezone.now() + timedelta(days=2))
    settings.MEMORY_LOCK_TIMEOUT_S = 0.3
    holder = _other()
    try:
        holder.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", [erasure_lock_key(alice_scope)])
        # No such session: no compaction or summary (they take the lock too); retention first.
        error = fails(alice, "memory_run_maintenance", session_id="no-such-session")
    finally:
        holder.rollback()
        holder.close()
    assert error.code == ErrorCode.RESOURCE_BUSY and error.retry_after_s
    assert _facts(alice_scope)  # nothing deleted beside the erasure
    assert run(alice, "memory_run_maintenance", session_id="no-such-session")["expired_facts"] == 1


@pytest.mark.django_db
@with_vectors
def test_a_deadlock_in_maintenance_is_resource_busy(alice, monkeypatch):
    def deadlocked(*args, **kwargs):
        raise OperationalError("deadlock detected") from psycopg.errors.DeadlockDetected("deadlock detected")

    monkeypatch.setattr(turns, "_consolidate", deadlocked)
    error = fails(alice, "memory_run_maintenance")
    # A transient race, and maintenance is safe to re-run: retry, not a conflict.
    assert (error.code, error.retry_after_s) == (ErrorCode.RESOURCE_BUSY, 1)
    assert "retry" in error.message


@pytest.mark.django_db
@with_vectors
def test_nightly_maintenance_goes_on_after_one_users_failure(alice, bob, alice_scope, bob_scope, monkeypatch, caplog):
    now = timezone.now()
    for scope in (alice_scope, bob_scope):
        SessionState.objects.create(engine_user_id=scope.engine_user_id, project="", session_id="s", last_active_at=now)
    ran: list[str] = []
    original = turns.turn_maintenance_run

    def first_fails(scope: MemoryScope, **kwargs):
        ran.append(scope.engine_user_id)
        if len(ran) == 1:
            raise OperationalError("deadlock detected: Alice's secret row")
        return original(scope, **kwargs)

    monkeypatch.setattr(turns, "turn_maintenance_run", first_fails)
    with caplog.at_level(logging.WARNING, logger="memories.turns.services"):
        assert turns.turn_maintenance_nightly() == 1
    assert sorted(ran) == sorted([alice_scope.engine_user_id, bob_scope.engine_user_id])
    assert "OperationalError" in caplog.text
    assert "secret" not in caplog.text


# --- 2. integers past 100 digits, on every surface ------------------------------------------------
def test_json_value_check_refuses_integers_past_100_digits_by_magnitude():
    json_value_check({"n": 10**100 - 1, "m": -(10**100 - 1), "b": True, "z": 0})
    for big in (10**100, -(10**100), 10**100_000):  # the last: no str() of it (Python refuses)
        with pytest.raises(InputError, match="at most 100 digits"):
            json_value_check({"metadata": {"n": [big]}})
    # The same limit as the REST parser's:
    json_loads_safe("9" * 100)
    with pytest.raises(InputError, match="at most 100 digits"):
        json_loads_safe("1" + "0" * 100)


@pytest.mark.django_db(transaction=True)
@with_vectors
def test_a_huge_integer_over_mcp_is_refused_like_rest(alice, alice_scope, api_client):
    from tests.test_mcp_asgi import _run

    big = int("7" * 4000)
    token = api_key_issue(user=alice, name="alice-agent")[1]
    rest = api_client(token).post(
        "/v1/memories", data=json.dumps({"memory": "rest big", "metadata": {"n": big}}), content_type="application/json"
    )
    assert rest.status_code == 400

    async def work(client):
        return await client.call_tool("remember", {"memory": "Alice's lucky number is long", "metadata": {"n": big}})

    result = _run(token, work)
    assert result.is_error
    assert "at most 100 digits" in json.dumps(result.structured_content or result.content[0].text)
    # What is stored still comes back from its owner's own export.
    run(alice, "remember", memory="Alice's lucky number is short", metadata={"n": 10**99})
    exported = memory_export(alice_scope, file_format="jsonl", call=internal_call())
    imported = memory_import_file(alice_scope, data=exported.content.encode(), source="memsite", call=internal_call())
    assert imported.imported + imported.duplicates == 1


# --- 3. control characters in a turn's conversation items ----------------------------------------
COLOURED = "\x1b[32m3 passed\x1b[0m\x0c"


def _tool_turn(output: str) -> list[dict]:
    return [
        _msg("user", "run the tests"),
        {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": '{"cmd": "pytest"}'},
        {"type": "function_call_output", "call_id": "c1", "output": output},
    ]


def test_transcript_fields_are_the_turn_items_only():
    assert sorted(AfterTurnInput.TRANSCRIPT_FIELDS) == ["input_items", "output_items"]
    assert sorted(BeforeTurnInput.TRANSCRIPT_FIELDS) == sorted(RunTurnInput.TRANSCRIPT_FIELDS) == ["current_input"]
    assert not MaintenanceInput.TRANSCRIPT_FIELDS


def test_transcript_check_refuses_only_what_the_database_cannot_store():
    assert transcript_text_problem(COLOURED + "\x01\x7f") is None
    assert transcript_text_problem("a\x00b") == "contains a NUL character"
    assert transcript_text_problem("a\ud800b") == "contains an invalid code point (a lone surrogate)"
    keys = AfterTurnInput.TRANSCRIPT_FIELDS
    json_value_check({"input_items": _tool_turn(COLOURED), "output_items": [{"k\x1b": COLOURED}]}, transcript_keys=keys)
    for arguments, where in (
        ({"input_items": _tool_turn("a\x00")}, "input_items.2.#3: contains a NUL"),
        ({"output_items": [{"k\ud800": 1}]}, "output_items.0: a key contains an invalid code point"),
        ({"input_items": [], "turn_id": "t\x1b"}, "turn_id: contains the control character U+001B"),
        ({"input_items": [], "metadata": {"n": COLOURED}}, "metadata.#1: contains the control character U+001B"),
        # Only top-level arguments are transcripts, not a key of that name deeper down.
        ({"metadata": {"input_items": COLOURED}}, "metadata.#1: contains the control character U+001B"),
    ):
        with pytest.raises(InputError) as info:
            json_value_check(arguments, transcript_keys=keys)
        assert info.value.message.startswith(where), info.value.message
    with pytest.raises(InputError, match="U\\+001B"):  # without transcript keys: the full check
        json_value_check({"input_items": _tool_turn(COLOURED)})


@pytest.mark.django_db
@with_vectors
def test_a_turn_with_a_coloured_tool_output_is_recorded_as_it_came(alice, alice_scope):
    items = _tool_turn(COLOURED)
    result = run(alice, "memory_after_turn", session_id="s1", turn_id="t1", input_items=items,
                 output_items=[_msg("assistant", "All green.")])  # fmt: skip
    assert result["events_stored"] == 4
    stored = [e.item for e in SessionEvent.objects.filter(engine_user_id=alice_scope.engine_user_id).order_by("id")]
    assert stored[2]["output"] == COLOURED
    before = run(alice, "memory_before_turn", session_id="s1", current_input=_tool_turn("\x1b[31mFAILED\x1b[0m"))
    assert before["input_items"][-1]["output"] == "\x1b[31mFAILED\x1b[0m"
    assert any(item.get("output") == COLOURED for item in before["input_items"])  # the log, as stored
    run(alice, "memory_run_turn", session_id="s1", current_input=[_msg("user", "and \x1b[1mnow\x1b[0m?")])


@pytest.mark.django_db
@with_vectors
def test_a_turn_still_refuses_nul_and_control_characters_outside_its_items(alice):
    error = fails(alice, "memory_after_turn", session_id="s1", turn_id="t1", input_items=_tool_turn("a\x00b"))
    assert error.code == ErrorCode.INVALID_ARGUMENT and "NUL" in error.message
    error = fails(alice, "memory_before_turn", session_id="s1", current_input=[_msg("user", "x\ud800")])
    assert error.code == ErrorCode.INVALID_ARGUMENT and "surrogate" in error.message
    error = fails(alice, "memory_after_turn", session_id="s1", turn_id="t\x1b", input_items=_tool_turn(COLOURED))
    assert "turn_id: contains the control character U+001B" in error.message
    error = fails(alice, "memory_run_maintenance", session_id="s1", project="p\x1b")
    assert "U+001B" in error.message
    # A memory's text keeps the full check: the toolkit and remember refuse it.
    assert "U+001B" in fails(alice, "remember", memory=COLOURED).message


@pytest.mark.django_db
@with_vectors
def test_no_fact_with_control_characters_is_extracted_from_a_turn(alice, alice_scope, caplog):
    said = "I always prefer \x1b[1mgreen tea\x1b[0m in the morning. I live in Rome."
    with caplog.at_level(logging.WARNING, logger="memories.turns.extraction"):
        result = run(alice, "memory_after_turn", session_id="s1", turn_id="t1", input_items=[_msg("user", said)])
    texts = [engine_memory_of(row).text for row in _facts(alice_scope)]
    assert texts == ["I live in Rome."]
    assert len(result["fact_ids"]) == 1 and result["facts_left_out"] == 1
    assert "left out 1 unstorable facts" in caplog.text and "green" not in caplog.text
