"""Seed 001: "optional agent and session fields become narrower filters". An update or a
forget naming another agent or session than the memory's answers as for a missing id
(an update moved the memory to the named agent, a forget deleted it), and a prefetch keeps
to the named agent or session as search does."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
from django.db import connection, transaction

from audit.models import AuditEvent
from billing.models import UsageEvent
from memories.engine import engine_lock_owned, engine_update_row
from memories.services import api_key_issue, user_write_locks
from tests.conftest import InThread, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]

ALICE = {"tenant_id": "default", "user_id": "alice"}
AGENT_A = {**ALICE, "agent_id": "agent-a"}
AGENT_B = {**ALICE, "agent_id": "agent-b"}


@pytest.fixture
def client(api_client, alice):
    return api_client(api_key_issue(user=alice, name="narrowing")[1])


def stored(client, text: str, scope: dict) -> dict:
    answer = client.post("/v1/memory", {"content": text, "scope": scope}, format="json")
    assert answer.status_code == 201, answer.content
    return answer.json()["memory"]


def listed(client) -> dict[str, dict]:
    return {m["id"]: m for m in client.get("/v1/memory").json()["memories"]}


def test_an_update_naming_another_agent_is_not_found_and_changes_nothing(client):
    memory = stored(client, "Alice prefers vim", AGENT_A)
    missing = client.put(f"/v1/memory/{uuid.uuid4()}", {"content": "x", "scope": AGENT_B}, format="json")
    other = client.put(f"/v1/memory/{memory['id']}", {"content": "changed by b", "scope": AGENT_B}, format="json")
    assert other.status_code == missing.status_code == 404
    assert other.json() == missing.json()
    kept = listed(client)[memory["id"]]
    assert (kept["content"], kept["scope"]["agent_id"]) == ("Alice prefers vim", "agent-a")
    refused = AuditEvent.objects.filter(operation="update_memory").order_by("id").last()
    assert refused.outcome != "ok" and refused.memory_ids == [memory["id"]]
    assert not UsageEvent.objects.filter(operation="update_memory").exists()
    # Its own agent may update it, and the update keeps it there.
    body = {"content": "Alice prefers neovim", "scope": AGENT_A}
    same = client.put(f"/v1/memory/{memory['id']}", body, format="json")
    assert same.status_code == 200, same.content
    assert same.json()["memory"]["scope"]["agent_id"] == "agent-a"
    assert same.json()["memory"]["content"] == "Alice prefers neovim"


def test_an_update_naming_an_agent_never_moves_the_memory(client):
    memory = stored(client, "Alice reads in the evening", ALICE)  # no agent
    moved = client.put(f"/v1/memory/{memory['id']}", {"importance": 0.9, "scope": AGENT_B}, format="json")
    assert moved.status_code == 404
    assert listed(client)[memory["id"]]["scope"]["agent_id"] is None


def test_a_forget_naming_another_session_is_not_found_and_deletes_nothing(client):
    memory = stored(client, "Alice prefers emacs", {**AGENT_A, "session_id": "s-1"})
    for scope in ({**ALICE, "session_id": "s-2"}, AGENT_B):
        missing = client.post(f"/v1/memory/{uuid.uuid4()}/forget", {"scope": scope}, format="json")
        other = client.post(f"/v1/memory/{memory['id']}/forget", {"scope": scope}, format="json")
        assert other.status_code == missing.status_code == 404
        assert other.json() == missing.json()
    assert memory["id"] in listed(client)
    own = client.post(f"/v1/memory/{memory['id']}/forget", {"scope": {**ALICE, "session_id": "s-1"}}, format="json")
    assert own.status_code == 200 and memory["id"] not in listed(client)


def test_a_prefetch_keeps_to_the_named_agent_as_search_does(client):
    memory = stored(client, "Alice prefers emacs keybindings", AGENT_A)
    for scope, expected in ((AGENT_B, []), (AGENT_A, [memory["id"]]), (ALICE, [memory["id"]])):
        body = {"query": "emacs keybindings", "scope": scope}
        searched = client.post("/v1/memory/search", body, format="json").json()["memories"]
        prefetched = client.post("/v1/memory/prefetch", body, format="json").json()
        assert [m["id"] for m in searched] == expected
        assert [m["id"] for m in prefetched["memories"]] == expected
        assert ("emacs" in prefetched["notes"]) == bool(expected)


def test_a_claim_for_another_user_is_refused_first_even_beside_a_bad_argument(api_client, bob):
    """A body naming another user and holding a bad argument was answered 400 and audited
    without the claim: the refusal of the claim is what the audit row must show."""
    client = api_client(api_key_issue(user=bob, name="claims")[1])
    answer = client.post("/v1/memory/search", {"query": "x", "scope": ALICE, "limit": 0}, format="json")
    assert answer.status_code == 403 and answer.json()["error"]["code"] == "forbidden"
    row = AuditEvent.objects.filter(operation="search_memory").order_by("id").last()
    assert row.outcome == "denied" and row.detail.get("subject_claim") == "default/alice"


def test_the_narrowing_reads_the_id_as_validated(client):
    """Another spelling of the id (`urn:uuid:`) is valid; the narrowing check sent the raw
    text to the database and answered 503."""
    memory = stored(client, "Alice waters the plants", AGENT_A)
    body = {"importance": 0.8, "scope": AGENT_A}
    answer = client.put(f"/v1/memory/urn:uuid:{memory['id']}", body, format="json")
    assert answer.status_code == 200, answer.content


# --- the narrowing is judged on the locked row ----------------------------------------------
def _advisory_waiters() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted")
        return cursor.fetchone()[0]


def _moved_to_agent_b_during(alice_scope, memory_id: str, request: Callable[[], Any]) -> Any:
    """Run `request` while another transaction, holding the memory's lock, moves it to
    agent-b: the request reads the memory (agent-a) before that commits and waits for the
    lock; it must judge the narrowing on what it finds under the lock."""
    holding, release = threading.Event(), threading.Event()

    def move() -> None:
        # As an update moving it does, without its rate-limit row (the request would wait
        # on that before reading the memory).
        with transaction.atomic():
            user_write_locks(alice_scope, f"memory:{memory_id}")
            row = engine_lock_owned(alice_scope, memory_id=memory_id)
            engine_update_row(memory_id, embedded=None, metadata=None, attrs=replace(row.attrs, agent_id="agent-b"))
            holding.set()
            assert release.wait(30)

    mover = InThread(move)
    assert holding.wait(30)
    caller = InThread(request)
    wait_for(lambda: _advisory_waiters() == 1 or caller.done(), timeout=20, what="the request waiting")
    release.set()
    mover.result()
    return caller.result()


def test_an_update_judges_the_agent_on_the_locked_row(client, alice_scope):
    """A concurrent move to another agent committed while the update waited: the update
    naming the old agent must not rewrite the memory now in agent-b."""
    memory = stored(client, "Alice takes the night train", AGENT_A)
    body = {"content": "rewritten by agent a", "scope": AGENT_A}
    answer = _moved_to_agent_b_during(
        alice_scope, memory["id"], lambda: client.put(f"/v1/memory/{memory['id']}", body, format="json")
    )
    assert answer.status_code == 404, answer.content
    kept = listed(client)[memory["id"]]
    assert (kept["content"], kept["scope"]["agent_id"]) == ("Alice takes the night train", "agent-b")
    assert not UsageEvent.objects.filter(operation="update_memory").exists()


def test_a_forget_judges_the_agent_on_the_locked_row(client, alice_scope):
    memory = stored(client, "Alice collects stamps", AGENT_A)
    answer = _moved_to_agent_b_during(
        alice_scope,
        memory["id"],
        lambda: client.post(f"/v1/memory/{memory['id']}/forget", {"scope": AGENT_A}, format="json"),
    )
    assert answer.status_code == 404, answer.content
    assert listed(client)[memory["id"]]["scope"]["agent_id"] == "agent-b"


def test_a_prefetch_with_a_malformed_agent_is_a_clear_400(client):
    for scope in ({**ALICE, "agent_id": 7}, {**ALICE, "agent_id": ["a"]}, {**ALICE, "agent_id": "a\x00b"}):
        answer = client.post("/v1/memory/prefetch", {"query": "anything", "scope": scope}, format="json")
        assert answer.status_code == 400, (scope, answer.content)
        assert answer.json()["error"]["code"] == "invalid_argument"
    answer = client.post("/v1/memory/prefetch", {"query": "anything", "scope": {**ALICE, "agent": "a"}}, format="json")
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "invalid_argument"
