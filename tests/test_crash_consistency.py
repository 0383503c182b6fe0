"""Fault injection (issue 10, D1): kill -9 the real web process while a call's
transaction is blocked at a chosen point, restart, reconcile, and check that every
call has all of its records or none, and that a retry does not duplicate.

The block is D1's reproduction: a separate connection holds `LOCK TABLE <t> IN
EXCLUSIVE MODE` on a table the call writes (the dedupe hashes early in the
transaction, the audit trail last), so the server's transaction waits there with the
memory row already written but not committed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from contextlib import contextmanager

import pytest
from django.db import connection, transaction

from audit.models import AuditEvent, MemoryHistory
from billing.models import UsageEvent
from memories import engine
from memories.models import ContentHash, IngestIntent
from memories.services import content_sha256, ingest_intents_reconcile
from tests.conftest import McpCaller, free_port, service_env, wait_for
from tests.environment import ROOT

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]

HASHES = ContentHash._meta.db_table
AUDIT = AuditEvent._meta.db_table
USAGE = UsageEvent._meta.db_table


class WebProcess:
    """uvicorn serving memsite on the test database; killable and restartable."""

    def __init__(self, log_path, env):
        self.log_path, self.env = log_path, env
        self.port = free_port()
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        import socket

        log = open(self.log_path, "ab")  # noqa: SIM115
        self.process = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "memsite.asgi:application", "--host", "127.0.0.1",
             "--port", str(self.port)],
            cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        log.close()

        def up() -> bool:
            if self.process.poll() is not None:
                raise AssertionError(f"web process exited:\n{self.log_path.read_text()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return True
            except OSError:
                return False

        wait_for(up, timeout=60, what="web process")

    def kill9(self) -> None:
        if self.process and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(30)

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.kill9()


@pytest.fixture
def web(tmp_path, fake_llm):
    env = service_env(LLM_BASE_URL=f"{fake_llm.url}/v1", LLM_MODEL="fake-model", LLM_API_KEY="fake-key")
    process = WebProcess(tmp_path / "web.log", env)
    process.start()
    yield process
    process.stop()


def _blocked_backends() -> list[int]:
    with connection.cursor() as cursor:
        # The list of backends is a per-transaction snapshot: we poll inside the locking one.
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
            " AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
        )
        return [row[0] for row in cursor.fetchall()]


def _backend_alive(pid: int) -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", [pid])
        return cursor.fetchone()[0] == 1


@contextmanager
def _table_locked(table: str):
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(f'LOCK TABLE "{table}" IN EXCLUSIVE MODE')
        yield


def crash_during(web: WebProcess, token: str, *, table: str, tool: str, arguments: dict) -> None:
    """Send `tool` while `table` is locked; once the server's transaction waits on the
    lock, kill -9 the web process, release the lock and wait for its backend to end
    (its transaction is then rolled back). Restart the web process."""
    outcome: dict = {}

    def send():
        try:
            outcome["result"] = McpCaller(web.url, token).call(tool, arguments)
        except BaseException as exc:  # noqa: BLE001 - the server dies under the call
            outcome["error"] = exc

    with _table_locked(table):
        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        blocked = wait_for(
            _blocked_backends,
            timeout=60,
            what=lambda: f"{tool} blocked on {table}:\n{web.log_path.read_text()[-3000:]}",
        )
        web.kill9()
    wait_for(lambda: not any(_backend_alive(pid) for pid in blocked), timeout=30, what="the dead call's backend")
    sender.join(30)
    assert "result" not in outcome or outcome["result"].is_error, "the call was acknowledged despite the crash"
    web.start()


def _ok_calls(operation: str) -> tuple[int, int]:
    """(audit rows with outcome ok, usage events) for `operation`."""
    return (
        AuditEvent.objects.filter(operation=operation, outcome=AuditEvent.Outcome.OK).count(),
        UsageEvent.objects.filter(operation=operation).count(),
    )


def _texts(scope) -> list[str]:
    return sorted(engine.engine_memory_of(row).text for row in engine.engine_rows_owned(scope))


def _hashes_match_memories(scope) -> None:
    rows = [engine.engine_memory_of(row) for row in engine.engine_rows_owned(scope)]
    hashes = dict(ContentHash.objects.filter(engine_user_id=scope.engine_user_id).values_list("memory_id", "sha256"))
    assert {str(k): v for k, v in hashes.items()} == {m.id: content_sha256(m.text) for m in rows}


@pytest.mark.parametrize("table", [HASHES, USAGE, AUDIT])
def test_remember_killed_mid_transaction_leaves_nothing_and_the_retry_stores_once(web, alice_key, alice_scope, table):
    mcp = McpCaller(web.url, alice_key)
    assert mcp.ok("remember", {"memory": "Alice keeps bees"})["duplicate"] is False

    crash_during(web, alice_key, table=table, tool="remember", arguments={"memory": "Alice sails on Sundays"})
    ingest_intents_reconcile(older_than_s=0)

    # The crashed call left none of its records: no memory, history, hash, audit row or usage event.
    assert _texts(alice_scope) == ["Alice keeps bees"]
    assert MemoryHistory.objects.count() == 1
    assert _ok_calls("remember") == (1, 1)
    _hashes_match_memories(alice_scope)

    retried = McpCaller(web.url, alice_key).ok("remember", {"memory": "Alice sails on Sundays"})
    assert retried["duplicate"] is False
    again = McpCaller(web.url, alice_key).ok("remember", {"memory": "Alice sails on Sundays"})
    assert again == {"id": retried["id"], "duplicate": True}
    assert _texts(alice_scope) == ["Alice keeps bees", "Alice sails on Sundays"]
    _hashes_match_memories(alice_scope)
    # Every acknowledged call: one audit row and one usage event; no more.
    assert _ok_calls("remember") == (3, 3)


@pytest.mark.parametrize("table", [HASHES, AUDIT])
def test_update_killed_mid_transaction_changes_nothing(web, alice_key, alice_scope, table):
    mcp = McpCaller(web.url, alice_key)
    memory_id = mcp.ok("remember", {"memory": "Alice drives a red car"})["id"]

    crash_during(
        web,
        alice_key,
        table=table,
        tool="update_memory",
        arguments={"memory_id": memory_id, "memory": "Alice drives a blue car", "pinned": True},
    )

    assert _texts(alice_scope) == ["Alice drives a red car"]
    assert engine.engine_get(memory_id).metadata["pinned"] is False
    assert list(MemoryHistory.objects.values_list("event", flat=True)) == ["ADD"]
    assert _ok_calls("update_memory") == (0, 0)
    _hashes_match_memories(alice_scope)

    McpCaller(web.url, alice_key).ok("update_memory", {"memory_id": memory_id, "memory": "Alice drives a blue car"})
    assert _texts(alice_scope) == ["Alice drives a blue car"]
    _hashes_match_memories(alice_scope)
    assert _ok_calls("update_memory") == (1, 1)
    assert McpCaller(web.url, alice_key).ok("remember", {"memory": "Alice drives a blue car"})["duplicate"] is True


@pytest.mark.parametrize("table", [HASHES, AUDIT])
def test_delete_killed_mid_transaction_keeps_the_memory(web, alice_key, alice_scope, table):
    mcp = McpCaller(web.url, alice_key)
    memory_id = mcp.ok("remember", {"memory": "Alice is allergic to cats"})["id"]

    crash_during(web, alice_key, table=table, tool="delete_memory", arguments={"memory_id": memory_id})

    assert _texts(alice_scope) == ["Alice is allergic to cats"]
    _hashes_match_memories(alice_scope)
    assert _ok_calls("delete_memory") == (0, 0)

    McpCaller(web.url, alice_key).ok("delete_memory", {"memory_id": memory_id})
    assert _texts(alice_scope) == []
    assert ContentHash.objects.count() == 0
    assert list(MemoryHistory.objects.values_list("event", flat=True).order_by("recorded_at")) == ["ADD", "DELETE"]
    assert _ok_calls("delete_memory") == (1, 1)
    # A second delete finds nothing (no duplicate effect, no second usage event).
    assert McpCaller(web.url, alice_key).error("delete_memory", {"memory_id": memory_id})["code"] == "not_found"
    assert _ok_calls("delete_memory") == (1, 1)


@pytest.mark.parametrize("table", [HASHES, AUDIT])
def test_clear_all_killed_mid_transaction_keeps_everything(web, alice_key, bob_key, alice_scope, bob_scope, table):
    for fact in ("Alice likes figs", "Alice likes dates"):
        McpCaller(web.url, alice_key).ok("remember", {"memory": fact})
    McpCaller(web.url, bob_key).ok("remember", {"memory": "Bob likes figs"})

    crash_during(web, alice_key, table=table, tool="clear_all_memory", arguments={"confirm": True})

    assert _texts(alice_scope) == ["Alice likes dates", "Alice likes figs"]
    _hashes_match_memories(alice_scope)
    assert _ok_calls("clear_all_memory") == (0, 0)

    assert McpCaller(web.url, alice_key).ok("clear_all_memory", {"confirm": True}) == {"deleted": 2}
    assert (
        _texts(alice_scope) == [] and ContentHash.objects.filter(engine_user_id=alice_scope.engine_user_id).count() == 0
    )
    assert _texts(bob_scope) == ["Bob likes figs"]
    _hashes_match_memories(bob_scope)
    assert _ok_calls("clear_all_memory") == (1, 1)


def test_ingest_killed_before_its_records_is_completed_by_the_reconciler(web, alice_key, alice_scope, fake_llm):
    fake_llm.queue_facts("Alice moved to Bergen", "Alice works as a nurse")

    crash_during(
        web,
        alice_key,
        table=AUDIT,
        tool="ingest",
        arguments={"messages": [{"role": "user", "content": "I moved to Bergen; I'm a nurse."}]},
    )
    # mem0 committed its rows on its own; the intent is still open, nothing else exists.
    assert _texts(alice_scope) == ["Alice moved to Bergen", "Alice works as a nurse"]
    assert IngestIntent.objects.get().state == IngestIntent.State.OPEN
    assert _ok_calls("ingest") == (0, 0) and ContentHash.objects.count() == 0

    assert ingest_intents_reconcile(older_than_s=0) == {"completed": 1, "undone": 0}
    assert ingest_intents_reconcile(older_than_s=0) == {"completed": 0, "undone": 0}

    assert IngestIntent.objects.get().state == IngestIntent.State.DONE
    _hashes_match_memories(alice_scope)
    assert _ok_calls("ingest") == (1, 1)
    # The same facts again (a retry of the turn) add nothing.
    fake_llm.queue_facts("alice moved to Bergen")
    results = McpCaller(web.url, alice_key).ok(
        "ingest", {"messages": [{"role": "user", "content": "I moved to Bergen; I'm a nurse."}]}
    )["results"]
    assert [r["event"] for r in results] in ([], ["NONE"])
    assert _texts(alice_scope) == ["Alice moved to Bergen", "Alice works as a nurse"]
    _hashes_match_memories(alice_scope)


def test_an_ingest_intent_with_no_rows_is_undone(alice_scope):
    from memories.models import IngestIntent as Intent

    Intent.objects.create(
        request_id="req-crashed", engine_user_id=alice_scope.engine_user_id,
        scope={"tenant": alice_scope.tenant, "user_pk": alice_scope.user_pk, "client_app": None},
        call={"channel": "mcp", "ip": None, "user_agent": "", "actor_username": "alice", "actor_auth": "api_key",
              "turn_id": ""},
    )  # fmt: skip
    assert ingest_intents_reconcile(older_than_s=3600) == {"completed": 0, "undone": 0}  # still within its lease
    assert ingest_intents_reconcile(older_than_s=0) == {"completed": 0, "undone": 1}
    assert Intent.objects.get().state == Intent.State.UNDONE
    row = AuditEvent.objects.get(request_id="req-crashed")
    assert (row.operation, row.outcome) == ("ingest", "error")
    assert not UsageEvent.objects.exists()
