"""Writers of a user's rows wait for an erasure (or clear-all) under way: they hold the
user's `clear_all:` advisory lock shared, which the erasure holds exclusively from before
its DELETE until its commit. Without that, a writer committing after the DELETE took its
snapshot left its rows behind a "complete" erasure (READ COMMITTED).

Each test holds the exclusive lock on a connection of its own, as an erasure in the
middle of its transaction does, runs the writer on a thread (its own connection), sees it
wait with nothing committed, releases the lock and sees it complete. Real Postgres, the
real embedder."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
from django.db import connection, transaction

from audit.models import AuditEvent
from core.errors import ErrorCode, ServiceError
from core.scope import CallContext, MemoryScope
from memories import engine
from memories import services as memory_services
from memories.auth import Principal
from memories.models import ContentHash, SessionEvent, TurnGuard
from memories.operations import operation_execute
from memories.services import memory_import_file, memory_remember, memory_update, user_write_locks
from memories.toolkit.models import CacheEntry, Decision
from memories.toolkit.services import toolkit_cache_store, toolkit_decision_store, toolkit_memory_store
from memories.turns import services as turns
from proxy.models import ProxyTurn
from proxy.services import chat_call_finish, chat_caller_authenticate
from tests.conftest import InThread, internal_call, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]

FIXTURES = Path(__file__).parent / "fixtures"
WAITED_S = 1.0


def _other_connection() -> psycopg.Connection:
    params = {k: v for k, v in connection.get_connection_params().items() if k not in ("cursor_factory", "context")}
    return psycopg.connect(**params, autocommit=True)


def _key(scope: MemoryScope) -> str:
    # Spelled out here on purpose: the wire format an erasure and its writers must share.
    return f"clear_all:{scope.engine_user_id}"


@contextmanager
def erasure_under_way(scope: MemoryScope) -> Iterator[Callable[[], None]]:
    """The user's erasure lock held exclusively elsewhere; yields its release."""
    other = _other_connection()
    held = [True]

    def release() -> None:
        if held[0]:
            other.execute("SELECT pg_advisory_unlock(hashtextextended(%s, 0))", [_key(scope)])
            held[0] = False

    try:
        other.execute("SELECT pg_advisory_lock(hashtextextended(%s, 0))", [_key(scope)])
        yield release
    finally:
        release()
        other.close()


def _advisory_waiters() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted")
        return cursor.fetchone()[0]


def waits_then_completes(scope: MemoryScope, work: Callable[[], Any], *, written: Callable[[], bool]) -> Any:
    """`work` started during an erasure waits for its lock with nothing committed, and
    completes (its rows written) once the erasure is over."""
    with erasure_under_way(scope) as release:
        writer = InThread(work)
        wait_for(lambda: _advisory_waiters() == 1 or writer.done(), timeout=20, what="the writer waiting")
        time.sleep(WAITED_S)
        assert not writer.done(), f"the writer did not wait: {writer.error!r}"
        assert _advisory_waiters() == 1
        assert not written()
        release()
        value = writer.result()
    assert written()
    return value


def _texts(scope: MemoryScope) -> list[str]:
    return [engine.engine_memory_of(row).text for row in engine.engine_rows_owned(scope)]


def run(user, name: str, arguments: dict[str, Any]) -> Any:
    principal = Principal(user=user, method="api_key", client_app="erasure-writers")
    return operation_execute(principal, name, arguments, call=internal_call())


# --- each writer waits for the erasure ---------------------------------------------------------
def test_remember_waits_for_an_erasure_under_way(alice_scope):
    text = "Alice keeps bees on her roof"
    result = waits_then_completes(
        alice_scope,
        lambda: memory_remember(alice_scope, memory=text, call=internal_call()),
        written=lambda: text in _texts(alice_scope),
    )
    assert ContentHash.objects.filter(engine_user_id=alice_scope.engine_user_id, memory_id=result.id).exists()


def test_update_with_new_text_waits_for_an_erasure_under_way(alice_scope):
    memory_id = memory_remember(alice_scope, memory="Alice drinks coffee", call=internal_call()).id
    waits_then_completes(
        alice_scope,
        lambda: memory_update(alice_scope, memory_id=memory_id, memory="Alice drinks tea", call=internal_call()),
        written=lambda: _texts(alice_scope) == ["Alice drinks tea"],
    )


def test_after_turn_waits_for_an_erasure_under_way(alice_scope):
    items = [turns.message("user", "I live in Oslo and I am vegetarian.")]

    def after_turn() -> dict:
        return turns.turn_after(
            alice_scope,
            project="",
            session_id="s",
            turn_id="t1",
            input_items=items,
            output_items=[],
            call=CallContext(channel="mcp"),
        )

    result = waits_then_completes(alice_scope, after_turn, written=lambda: SessionEvent.objects.exists())
    assert result["fact_ids"] and set(result["fact_ids"]) <= {str(r.id) for r in engine.engine_rows_owned(alice_scope)}


def test_after_turn_past_its_guard_waits_for_an_erasure_under_way(alice_scope, monkeypatch):
    """The erasure starts while the facts are extracted (the guard is committed): the
    turn's own transaction waits for it at the session lock."""
    other = _other_connection()
    extract = turns.facts_extract

    def erasure_starts_meanwhile(items):
        other.execute("SELECT pg_advisory_lock(hashtextextended(%s, 0))", [_key(alice_scope)])
        return extract(items)

    monkeypatch.setattr(turns, "facts_extract", erasure_starts_meanwhile)
    try:
        writer = InThread(
            lambda: turns.turn_after(
                alice_scope,
                project="",
                session_id="s",
                turn_id="t1",
                input_items=[turns.message("user", "I live in Oslo.")],
                output_items=[],
                call=CallContext(channel="mcp"),
            )
        )
        wait_for(lambda: _advisory_waiters() == 1 or writer.done(), timeout=20, what="after_turn waiting")
        time.sleep(WAITED_S)
        assert not writer.done()
        assert TurnGuard.objects.get().state == TurnGuard.State.PROCESSING
        assert not SessionEvent.objects.exists() and not _texts(alice_scope)
        other.execute("SELECT pg_advisory_unlock(hashtextextended(%s, 0))", [_key(alice_scope)])
        assert writer.result()["events_stored"] == 1
    finally:
        other.close()
    assert TurnGuard.objects.get().state == TurnGuard.State.DONE


def test_toolkit_store_of_short_term_rows_only_waits_for_an_erasure_under_way(alice_scope):
    # Short human and assistant messages: no long-term candidate, so no text lock.
    messages = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}]
    result = waits_then_completes(
        alice_scope,
        lambda: toolkit_memory_store(alice_scope, conversation_id="c-1", messages=messages, call=internal_call()),
        written=lambda: len(_texts(alice_scope)) == 2,
    )
    assert result["count"] == 2


def test_decision_store_waits_for_an_erasure_under_way(alice_scope):
    waits_then_completes(
        alice_scope,
        lambda: toolkit_decision_store(alice_scope, key="editor", value="vim", call=internal_call()),
        written=lambda: Decision.objects.filter(user_id=alice_scope.user_pk).exists(),
    )


def test_cache_store_waits_for_an_erasure_under_way(alice_scope):
    waits_then_completes(
        alice_scope,
        lambda: toolkit_cache_store(alice_scope, query="deadline?", response="March 31", call=internal_call()),
        written=lambda: CacheEntry.objects.filter(user_id=alice_scope.user_pk).exists(),
    )


def test_import_waits_for_an_erasure_under_way(alice_scope):
    data = (FIXTURES / "mem0_export.json").read_bytes()
    result = waits_then_completes(
        alice_scope,
        lambda: memory_import_file(alice_scope, data=data, source="mem0", call=internal_call()),
        written=lambda: bool(_texts(alice_scope)),
    )
    assert result.imported == len(_texts(alice_scope)) > 0


# --- tenancy, sharing, the bound --------------------------------------------------------------
def test_bobs_erasure_does_not_hold_up_alices_writers(alice_scope, bob_scope):
    with erasure_under_way(bob_scope):
        memory_remember(alice_scope, memory="Alice sails on Sundays", call=internal_call())
        toolkit_decision_store(alice_scope, key="boat", value="dinghy", call=internal_call())
        toolkit_memory_store(
            alice_scope, conversation_id="c", messages=[{"role": "user", "content": "ahoy"}], call=internal_call()
        )
    assert "Alice sails on Sundays" in _texts(alice_scope)


def test_writers_of_one_user_do_not_wait_for_each_other_but_an_erasure_waits_for_them(alice_scope):
    inside = threading.Event()
    finish = threading.Event()

    def writer_mid_transaction() -> None:
        with transaction.atomic():
            user_write_locks(alice_scope, "erasure-writers:first")
            inside.set()
            assert finish.wait(30)

    first = InThread(writer_mid_transaction)
    try:
        assert inside.wait(20)
        started = time.monotonic()
        memory_remember(alice_scope, memory="Alice paints in watercolour", call=internal_call())
        assert time.monotonic() - started < WAITED_S  # no wait for the first writer
        other = _other_connection()
        try:  # an erasure could not start now: a writer holds the lock shared
            row = other.execute("SELECT pg_try_advisory_lock(hashtextextended(%s, 0))", [_key(alice_scope)])
            assert row.fetchone()[0] is False
        finally:
            other.close()
    finally:
        finish.set()
    first.result()


def test_an_erasure_held_past_the_lock_timeout_is_resource_busy_with_nothing_written(alice, alice_scope, settings):
    settings.MEMORY_LOCK_TIMEOUT_S = 0.3
    with erasure_under_way(alice_scope):
        with pytest.raises(ServiceError) as raised:
            run(alice, "remember", {"memory": "Alice collects stamps"})
        with pytest.raises(ServiceError) as raised_decision:
            run(alice, "store_decision", {"key": "k", "value": "v"})
    for error in (raised.value, raised_decision.value):  # a wait: retry, not a conflict
        assert (error.code, error.retry_after_s) == (ErrorCode.RESOURCE_BUSY, 1)
    assert not _texts(alice_scope)
    assert not ContentHash.objects.exists() and not Decision.objects.exists()
    for operation in ("remember", "store_decision"):
        row = AuditEvent.objects.get(operation=operation)
        assert (row.outcome, row.error_code) == ("error", "resource_busy")
    assert not AuditEvent.objects.filter(outcome="ok").exists()


def test_the_chat_proxys_recorded_turn_waits_for_an_erasure_under_way(alice_scope, alice_key, upstream):
    """The proxy records an answered turn (session log, extraction outbox) in one
    transaction; an erasure under way is waited for, so it cannot miss them."""
    caller = chat_caller_authenticate(authorization=f"Bearer {alice_key}")

    def finish() -> int | None:
        return chat_call_finish(
            caller,
            call=CallContext(channel="proxy"),
            session_id="chat-1",
            status=200,
            stream=False,
            model="m",
            request_messages=[{"role": "user", "content": "My sister Ingrid lives in Narvik"}],
            answer={"role": "assistant", "content": "Noted."},
            memory_ids=[],
            history_items=0,
        )

    turn_pk = waits_then_completes(alice_scope, finish, written=lambda: ProxyTurn.objects.exists())
    assert ProxyTurn.objects.filter(pk=turn_pk, user_id=alice_scope.user_pk).exists()
    assert SessionEvent.objects.filter(engine_user_id=alice_scope.engine_user_id).exists()


def test_a_long_import_does_not_hold_up_the_users_other_writers(alice_scope, monkeypatch):
    """An import holds the erasure lock shared, like every writer: a `remember` during a
    long import goes through at once (it used to wait for the whole import and fail with
    `conflict`), while an erasure would still wait for the import."""
    inside, finish = threading.Event(), threading.Event()
    insert = memory_services.engine_insert_imported

    def slow_insert(*args: Any, **kwargs: Any) -> Any:
        inside.set()
        finish.wait(30)
        return insert(*args, **kwargs)

    monkeypatch.setattr(memory_services, "engine_insert_imported", slow_insert)
    data = (FIXTURES / "mem0_export.json").read_bytes()
    importing = InThread(lambda: memory_import_file(alice_scope, data=data, source="mem0", call=internal_call()))
    try:
        assert inside.wait(30)
        memory_remember(alice_scope, memory="Alice bakes rye bread", call=internal_call())
        assert "Alice bakes rye bread" in _texts(alice_scope)
        assert not importing.done()
    finally:
        finish.set()
    assert importing.result().imported > 0
