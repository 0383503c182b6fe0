"""Issue 11: one memory model for every seed — typed fields, expiry, the trash, bulk
forget, seed 001's /v1/memory and X-Turn-Id turn events."""

from __future__ import annotations

import html
import re
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection

from audit.models import AuditEvent, MemoryHistory
from memories import engine
from memories.models import ContentHash
from memories.services import memory_purge_due, memory_recalls_fold, memory_remember
from tests.conftest import internal_call

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]

FUTURE = (datetime.now(UTC) + timedelta(days=400)).strftime("%Y-%m-%dT%H:%M:%SZ")
FIELDS = {
    "memory_type": "project",
    "tags": ["work", "berlin"],
    "importance": 0.9,
    "agent_id": "planner",
    "session_id": "s-1",
    "expires_at": FUTURE,
    "source": "chat",
    "why_stored": "the user asked to keep it",
}


def _assert_fields(memory: dict, fields: dict = FIELDS) -> None:
    for key in ("memory_type", "tags", "importance", "agent_id", "session_id", "source", "why_stored"):
        assert memory[key] == fields[key], key
    assert memory["expires_at"].startswith(fields["expires_at"][:19])
    assert memory["access_count"] == 0 and memory["last_recalled_at"] is None


def _set_payload(memory_id: str, path: list[str], value: str) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE memories SET payload = jsonb_set(payload, %s, to_jsonb(%s::text)) WHERE id = %s",
            [path, value, memory_id],
        )


# --- fields --------------------------------------------------------------------------------
def test_rest_fields_round_trip(api_client, alice_key):
    alice = api_client(alice_key)
    created = alice.post("/v1/memories", {"memory": "Project Kite ships in May", **FIELDS}, format="json")
    assert created.status_code == 201, created.json()
    memory_id = created.json()["id"]
    other = alice.post("/v1/memories", {"memory": "Alice likes tea"}, format="json").json()["id"]

    listed = alice.get("/v1/memories").json()["memories"]
    by_id = {m["id"]: m for m in listed}
    _assert_fields(by_id[memory_id])
    # Defaults (also what migration 0006 gives existing memories).
    assert by_id[other]["memory_type"] == "user" and by_id[other]["importance"] == 0.5
    assert by_id[other]["tags"] == [] and by_id[other]["source"] == "remember"

    for query in ("memory_type=project", "tags=work,berlin", "tags=work&tags=berlin", "agent_id=planner"):
        ids = [m["id"] for m in alice.get(f"/v1/memories?{query}").json()["memories"]]
        assert ids == [memory_id], query
    assert alice.get("/v1/memories?tags=work,nope").json()["memories"] == []
    assert [m["id"] for m in alice.get("/v1/memories?memory_type=user").json()["memories"]] == [other]

    search = {"query": "When does Kite ship?", "memory_type": "project", "tags": ["berlin"], "session_id": "s-1"}
    assert [m["id"] for m in alice.post("/v1/memories/search", search, format="json").json()["results"]] == [memory_id]
    search["memory_type"] = "feedback"
    assert alice.post("/v1/memories/search", search, format="json").json()["results"] == []

    edited = {"memory_type": "reference", "tags": ["archive"], "importance": 0.2, "agent_id": None}
    updated = alice.patch(f"/v1/memories/{memory_id}", edited, format="json")
    assert updated.status_code == 200, updated.json()
    memory = updated.json()["memory"]
    assert (memory["memory_type"], memory["tags"], memory["importance"], memory["agent_id"]) == (
        "reference",
        ["archive"],
        0.2,
        None,
    )
    assert memory["session_id"] == "s-1" and memory["why_stored"] == FIELDS["why_stored"]  # untouched
    assert memory["memory"] == "Project Kite ships in May"


def test_mcp_fields_round_trip(mcp_as, alice_key):
    mcp = mcp_as(alice_key)
    memory_id = mcp.ok("remember", {"memory": "Dana prefers morning meetings", **FIELDS})["id"]
    found = mcp.ok("search_memory", {"query": "meetings", "memory_type": "project", "tags": ["work"]})["results"]
    assert [m["id"] for m in found] == [memory_id]
    _assert_fields(found[0])
    listed = mcp.ok("list_memory", {"agent_id": "planner"})["memories"]
    assert [m["id"] for m in listed] == [memory_id]
    assert mcp.ok("list_memory", {"agent_id": "someone-else"})["memories"] == []
    updated = mcp.ok("update_memory", {"memory_id": memory_id, "memory_type": "feedback", "ttl_days": 2})["memory"]
    assert updated["memory_type"] == "feedback"
    assert updated["expires_at"] < (datetime.now(UTC) + timedelta(days=3)).isoformat()


@pytest.mark.parametrize(
    ("bad", "code"),
    [
        ({"memory_type": "secret"}, "invalid_argument"),
        ({"tags": [f"t{i}" for i in range(1000)]}, "payload_too_large"),
        ({"importance": 7}, "invalid_argument"),
        ({"expires_at": "2020-01-01T00:00:00Z"}, "invalid_argument"),
        ({"expires_at": "soon"}, "invalid_argument"),
        ({"ttl_days": 0}, "invalid_argument"),
        ({"expires_at": FUTURE, "ttl_days": 3}, "invalid_argument"),
        ({"agent_id": "has spaces"}, "invalid_argument"),
    ],
)
def test_bad_field_values_change_nothing(api_client, alice_key, bad, code):
    alice = api_client(alice_key)
    memory_id = alice.post("/v1/memories", {"memory": "Alice rides a bike"}, format="json").json()["id"]
    before = engine.engine_get(memory_id)

    created = alice.post("/v1/memories", {"memory": "Another fact", **bad}, format="json")
    assert created.status_code in (400, 413) and created.json()["error"]["code"] == code
    updated = alice.patch(f"/v1/memories/{memory_id}", bad, format="json")
    assert updated.status_code in (400, 413) and updated.json()["error"]["code"] == code
    stored = alice.post("/v1/memory", {"content": "Third", "scope": {"user_id": "alice"}, **bad}, format="json")
    assert stored.json()["error"]["code"] == code

    assert [m["id"] for m in alice.get("/v1/memories").json()["memories"]] == [memory_id]
    assert engine.engine_get(memory_id) == before


# --- expiry --------------------------------------------------------------------------------
def test_expired_memory_is_invisible_at_once_and_purged(api_client, alice_key):
    alice = api_client(alice_key)
    memory_id = alice.post("/v1/memories", {"memory": "Gate code 1234", "ttl_days": 1}, format="json").json()["id"]
    keep = alice.post("/v1/memories", {"memory": "Gate is green"}, format="json").json()["id"]
    _set_payload(memory_id, ["attrs", "expires_at"], (datetime.now(UTC) - timedelta(seconds=1)).isoformat())

    assert [m["id"] for m in alice.get("/v1/memories").json()["memories"]] == [keep]
    found = alice.post("/v1/memories/search", {"query": "gate code"}, format="json").json()["results"]
    assert [m["id"] for m in found] == [keep]
    assert alice.patch(f"/v1/memories/{memory_id}", {"memory": "x"}, format="json").status_code == 404
    # Remembering the same text makes a fresh memory (the expired one does not dedupe).
    again = alice.post("/v1/memories", {"memory": "Gate code 1234"}, format="json").json()
    assert again["duplicate"] is False and again["id"] != memory_id

    assert memory_purge_due() == 1
    assert engine.engine_get(memory_id) is None and engine.engine_get(keep) is not None
    purge = AuditEvent.objects.get(operation="purge_due")
    assert purge.memory_ids == [memory_id] and purge.subject_user_id is not None


# --- trash -------------------------------------------------------------------------------
def test_delete_goes_to_trash_restore_keeps_id_and_history(api_client, alice_key):
    alice = api_client(alice_key)
    memory_id = alice.post("/v1/memories", {"memory": "Alice's dentist is Dr. Lima"}, format="json").json()["id"]
    assert alice.delete(f"/v1/memories/{memory_id}").json() == {"id": memory_id, "deleted": True}

    assert alice.get("/v1/memories").json()["memories"] == []
    assert alice.post("/v1/memories/search", {"query": "dentist"}, format="json").json()["results"] == []
    assert alice.delete(f"/v1/memories/{memory_id}").status_code == 404
    trash = alice.get("/v1/trash").json()["memories"]
    assert [m["id"] for m in trash] == [memory_id] and trash[0]["operation"] == "delete_memory"
    assert not ContentHash.objects.filter(memory_id=memory_id).exists()

    # The same text again is a fresh memory; restoring brings the old one back beside it.
    fresh = alice.post("/v1/memories", {"memory": "Alice's dentist is Dr. Lima"}, format="json").json()
    assert fresh["duplicate"] is False and fresh["id"] != memory_id
    assert alice.post("/v1/trash/restore", {"memory_id": memory_id}, format="json").json() == {"restored": [memory_id]}
    ids = {m["id"] for m in alice.get("/v1/memories").json()["memories"]}
    assert ids == {memory_id, fresh["id"]}
    # The newer memory keeps the dedupe hash.
    assert (
        alice.post("/v1/memories", {"memory": "alice's dentist is dr. lima"}, format="json").json()["id"] == fresh["id"]
    )
    events = list(MemoryHistory.objects.filter(memory_id=memory_id).order_by("recorded_at", "id"))
    assert [e.event for e in events] == ["ADD", "DELETE", "RESTORE"]
    assert set(AuditEvent.objects.values_list("operation", flat=True)) >= {"delete_memory", "restore_memory"}


def test_clear_all_restore_by_call_then_purge_after_retention(api_client, alice_key, alice, settings):
    alice_api = api_client(alice_key)
    ids = [alice_api.post("/v1/memories", {"memory": f"Fact {i}"}, format="json").json()["id"] for i in range(3)]
    alice_api.delete(f"/v1/memories/{ids[0]}")  # a separate call: not restored with the clear
    assert alice_api.post("/v1/memories/clear", {"confirm": True}, format="json").json() == {"deleted": 2}
    clear = AuditEvent.objects.get(operation="clear_all_memory")
    assert sorted(clear.memory_ids) == sorted(ids[1:])

    restored = alice_api.post("/v1/trash/restore", {"request_id": clear.request_id}, format="json").json()
    assert sorted(restored["restored"]) == sorted(ids[1:])
    assert sorted(m["id"] for m in alice_api.get("/v1/memories").json()["memories"]) == sorted(ids[1:])
    assert [m["id"] for m in alice_api.get("/v1/trash").json()["memories"]] == [ids[0]]

    assert memory_purge_due() == 0  # within retention
    assert memory_purge_due(now=datetime.now(UTC) + timedelta(days=settings.TRASH_RETENTION_DAYS + 1)) == 1
    assert engine.engine_get(ids[0]) is None
    assert alice_api.get("/v1/trash").json()["memories"] == []


def test_the_trash_pages_with_a_cursor_a_restore_does_not_shift(api_client, alice_key, bob_key):
    """GET /v1/trash was cut at 500 rows with nothing to say so; it now pages like the
    memory list, each memory exactly once, and each page is billed and audited."""
    from billing.models import UsageEvent

    alice, bob = api_client(alice_key), api_client(bob_key)
    ids = [alice.post("/v1/memories", {"memory": f"Trashed fact {i}"}, format="json").json()["id"] for i in range(5)]
    # One clear-all: five rows trashed at one time, so the id orders them.
    assert alice.post("/v1/memories/clear", {"confirm": True}, format="json").json() == {"deleted": 5}
    billed_before = UsageEvent.objects.filter(operation="list_memory").count()
    first = alice.get("/v1/trash", {"page_size": 2}).json()
    assert len(first["memories"]) == 2 and first["next_cursor"]
    # Restoring a memory already shown moves nothing on the later pages.
    alice.post("/v1/trash/restore", {"memory_id": first["memories"][0]["id"]}, format="json")
    second = alice.get("/v1/trash", {"page_size": 2, "cursor": first["next_cursor"]}).json()
    third = alice.get("/v1/trash", {"page_size": 2, "cursor": second["next_cursor"]}).json()
    assert len(second["memories"]) == 2 and len(third["memories"]) == 1 and third["next_cursor"] is None
    shown = [m["id"] for m in first["memories"] + second["memories"] + third["memories"]]
    assert sorted(shown) == sorted(ids)
    assert UsageEvent.objects.filter(operation="list_memory").count() == billed_before + 3
    pages = AuditEvent.objects.filter(operation="list_memory", detail__trash=True).order_by("id")
    assert [row.memory_ids for row in pages] == [[m["id"] for m in page["memories"]] for page in (first, second, third)]
    # By default one page holds up to 200.
    whole = alice.get("/v1/trash").json()
    assert len(whole["memories"]) == 4 and whole["next_cursor"] is None
    # A cursor is a position, not a grant: bob's trash stays his own (empty).
    assert bob.get("/v1/trash", {"cursor": first["next_cursor"]}).json() == {"memories": [], "next_cursor": None}
    for params in ({"cursor": "not-ours"}, {"page_size": 0}, {"page_size": 201}, {"page_size": "2x"}, {"offset": 3}):
        refused = alice.get("/v1/trash", params)
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_argument", params


def test_delete_forever_and_empty_trash(api_client, alice_key):
    alice = api_client(alice_key)
    ids = [alice.post("/v1/memories", {"memory": f"Thing {i}"}, format="json").json()["id"] for i in range(3)]
    for memory_id in ids:
        alice.delete(f"/v1/memories/{memory_id}")
    assert alice.post("/v1/trash/purge", {"memory_id": ids[0]}, format="json").json() == {"purged": 1}
    assert engine.engine_get(ids[0]) is None
    assert alice.post("/v1/trash/purge", {"memory_id": ids[0]}, format="json").status_code == 404
    assert alice.post("/v1/trash/purge", {"all": True}, format="json").json() == {"purged": 2}
    assert all(engine.engine_get(i) is None for i in ids)
    assert AuditEvent.objects.filter(operation="purge_memory").count() == 3  # two ok, one not_found


def test_trash_retention_zero_deletes_at_once(api_client, alice_key, settings):
    settings.TRASH_RETENTION_DAYS = 0
    alice = api_client(alice_key)
    memory_id = alice.post("/v1/memories", {"memory": "Short-lived"}, format="json").json()["id"]
    alice.delete(f"/v1/memories/{memory_id}")
    assert engine.engine_get(memory_id) is None


# --- bulk forget -------------------------------------------------------------------------
def test_bulk_forget_dry_run_count_equals_real_count(api_client, alice_key, bob_key):
    alice, bob = api_client(alice_key), api_client(bob_key)
    for i in range(3):
        alice.post("/v1/memories", {"memory": f"Trip note {i}", "tags": ["travel", "2026"]}, format="json")
    alice.post("/v1/memories", {"memory": "Work note", "tags": ["work"]}, format="json")
    alice.post("/v1/memories", {"memory": "Travel only", "tags": ["travel"]}, format="json")
    for i in range(2):
        bob.post("/v1/memories", {"memory": f"Bob trip {i}", "tags": ["travel", "2026"]}, format="json")

    body = {"tags": ["travel", "2026"]}
    refused = alice.post("/v1/memories/forget", body, format="json")
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "confirmation_required"
    dry = alice.post("/v1/memories/forget", {**body, "dry_run": True}, format="json").json()
    assert dry == {"deleted_count": 3, "dry_run": True}
    assert len(alice.get("/v1/memories").json()["memories"]) == 5  # nothing changed
    real = alice.post("/v1/memories/forget", {**body, "confirm": True}, format="json").json()
    assert real == {"deleted_count": 3, "dry_run": False}
    assert sorted(m["memory"] for m in alice.get("/v1/memories").json()["memories"]) == ["Travel only", "Work note"]
    assert len(bob.get("/v1/memories").json()["memories"]) == 2  # bob's are never counted or touched

    start = (datetime.now(UTC) - timedelta(hours=1)).isoformat()
    end = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    ranged = {"time_range": {"start": start, "end": end}, "memory_type": "user", "dry_run": True}
    assert alice.post("/v1/memories/forget", ranged, format="json").json()["deleted_count"] == 2
    past = {"time_range": {"end": start}, "dry_run": True}
    assert alice.post("/v1/memories/forget", past, format="json").json()["deleted_count"] == 0
    bad = alice.post("/v1/memories/forget", {"time_range": {"start": end, "end": start}}, format="json")
    assert bad.json()["error"]["code"] == "invalid_argument"


def test_mcp_delete_memory_bulk_arguments(mcp_as, alice_key, bob_key):
    alice, bob = mcp_as(alice_key), mcp_as(bob_key)
    for i in range(2):
        alice.ok("remember", {"memory": f"Kite {i}", "memory_type": "project"})
    bob.ok("remember", {"memory": "Bob kite", "memory_type": "project"})
    assert alice.error("delete_memory", {"memory_type": "project"})["code"] == "confirmation_required"
    assert bob.ok("delete_memory", {"memory_type": "project", "dry_run": True}) == {
        "deleted_count": 1,
        "dry_run": True,
    }
    assert alice.ok("delete_memory", {"memory_type": "project", "confirm": True}) == {
        "deleted_count": 2,
        "dry_run": False,
    }
    assert alice.error("delete_memory", {})["code"] == "invalid_argument"
    assert alice.error("delete_memory", {"memory_id": str(uuid.uuid4()), "tags": ["x"]})["code"] == "invalid_argument"
    assert len(bob.ok("list_memory", {})["memories"]) == 1


# --- tenancy of the new routes --------------------------------------------------------------
def test_bob_cannot_restore_purge_or_see_alices_trash(api_client, alice_key, bob_key):
    alice, bob = api_client(alice_key), api_client(bob_key)
    memory_id = alice.post("/v1/memories", {"memory": "Alice's secret"}, format="json").json()["id"]
    alice.delete(f"/v1/memories/{memory_id}")
    request_id = AuditEvent.objects.get(operation="delete_memory").request_id

    assert bob.get("/v1/trash").json()["memories"] == []
    for body in ({"memory_id": memory_id}, {"request_id": request_id}):
        response = bob.post("/v1/trash/restore", body, format="json")
        assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"
    assert bob.post("/v1/trash/purge", {"memory_id": memory_id}, format="json").status_code == 404
    assert bob.post("/v1/trash/purge", {"all": True}, format="json").json() == {"purged": 0}
    assert bob.get(f"/v1/memory/{memory_id}").status_code == 405
    assert bob.post(f"/v1/memory/{memory_id}/forget").status_code == 404
    assert [m["id"] for m in alice.get("/v1/trash").json()["memories"]] == [memory_id]


# --- seed 001: /v1/memory -------------------------------------------------------------------
SEED_KEYS = {
    "id", "content", "memory_type", "scope", "pinned", "expires_at", "source", "last_recalled_at", "why_stored",
    "created_at", "updated_at",
}  # fmt: skip


def test_v1_memory_store_search_list_update_delete_forget(api_client, alice_key, alice):
    client = api_client(alice_key)
    scope = {"tenant_id": "default", "user_id": "alice", "agent_id": "assistant"}
    stored = client.post(
        "/v1/memory",
        {"content": "User prefers concise TypeScript examples", "memory_type": "user", "scope": scope},
        format="json",
    )
    assert stored.status_code == 201, stored.json()
    memory = stored.json()["memory"]
    assert set(memory) >= SEED_KEYS
    assert memory["scope"] == {"tenant_id": "default", "user_id": "alice", "agent_id": "assistant", "session_id": None}
    other = client.post(
        "/v1/memory", {"content": "Project Kite uses Rust", "memory_type": "project", "scope": scope}, format="json"
    ).json()["memory"]

    found = client.post(
        "/v1/memory/search",
        {"query": "coding style preference TypeScript", "scope": scope, "memory_type": "user", "limit": 5},
        format="json",
    ).json()["memories"]
    assert [m["id"] for m in found] == [memory["id"]]
    assert SEED_KEYS | {"score"} <= set(found[0])

    listed = client.get("/v1/memory?tenant_id=default&user_id=alice&memory_type=project").json()["memories"]
    assert [m["id"] for m in listed] == [other["id"]]
    assert client.get("/v1/memory?agent_id=nobody").json()["memories"] == []

    updated = client.put(
        f"/v1/memory/{memory['id']}",
        {"content": "User prefers concise TypeScript examples with tests", "scope": scope, "memory_type": "feedback"},
        format="json",
    )
    assert updated.status_code == 200, updated.json()
    assert updated.json()["memory"]["content"].endswith("with tests")
    assert updated.json()["memory"]["memory_type"] == "feedback"

    assert client.delete(f"/v1/memory/{memory['id']}?tenant_id=default&user_id=alice").status_code == 200
    forgot = client.post(f"/v1/memory/{other['id']}/forget")
    assert forgot.status_code == 200
    assert client.get("/v1/memory").json()["memories"] == []
    forget_row = AuditEvent.objects.filter(operation="delete_memory", memory_ids__contains=[other["id"]]).get()
    assert forget_row.detail["forget"] is True and forget_row.outcome == "ok"
    # Same usage events and audit rows as the rest of the API.
    ops = list(AuditEvent.objects.filter(channel="rest").values_list("operation", flat=True))
    assert {"remember", "search_memory", "list_memory", "update_memory", "delete_memory"} <= set(ops)


@pytest.mark.parametrize(
    "scope",
    [{"tenant_id": "default", "user_id": "bob"}, {"tenant_id": "acme", "user_id": "alice"}, {"user_id": "bob"}],
)
def test_v1_memory_scope_naming_someone_else_is_refused(api_client, alice_key, bob, scope):  # noqa: ARG001
    client = api_client(alice_key)
    for method, path, body in [
        ("post", "/v1/memory", {"content": "x", "scope": scope}),
        ("post", "/v1/memory/search", {"query": "x", "scope": scope}),
    ]:
        response = getattr(client, method)(path, body, format="json")
        assert response.status_code == 403, path
        assert response.json()["error"]["code"] == "forbidden"
    query = "&".join(f"{k}={v}" for k, v in scope.items())
    assert client.get(f"/v1/memory?{query}").status_code == 403
    assert client.delete(f"/v1/memory/{uuid.uuid4()}?{query}").status_code == 403
    assert client.get("/v1/memory").json()["memories"] == []
    assert AuditEvent.objects.filter(outcome="denied", error_code="forbidden").count() == 4


def test_x_turn_id_groups_turn_events(api_client, alice_key):
    client = api_client(alice_key)
    turn = {"HTTP_X_TURN_ID": "turn-42"}
    memory_id = client.post(
        "/v1/memory", {"content": "Alice flies on Friday", "scope": {"user_id": "alice"}}, format="json", **turn
    ).json()["memory"]["id"]
    client.post("/v1/memory/search", {"query": "flight"}, format="json", **turn)
    client.post(f"/v1/memory/{memory_id}/forget", **turn)
    client.post("/v1/memories", {"memory": "no turn here"}, format="json")
    rows = AuditEvent.objects.filter(turn_id="turn-42").order_by("id")
    assert [r.turn_event for r in rows] == ["memory_write", "memory_recall", "memory_forget"]
    # metadata.turn_id keeps working.
    client.post("/v1/memories", {"memory": "x1", "metadata": {"turn_id": "turn-7"}}, format="json")
    assert AuditEvent.objects.get(turn_id="turn-7").turn_event == "memory_write"


# --- recall counters -------------------------------------------------------------------------
def test_recall_counters_are_folded_from_audit_rows(api_client, alice_key, alice_scope):
    memory_id = memory_remember(alice_scope, memory="Alice's cat is Miso", call=internal_call()).id
    client = api_client(alice_key)
    for _ in range(3):
        assert client.post("/v1/memories/search", {"query": "cat"}, format="json").json()["results"]
    listed = client.get("/v1/memories").json()["memories"][0]
    assert listed["access_count"] == 0  # no write on search's path
    assert memory_recalls_fold(settle_seconds=0) == 3
    assert memory_recalls_fold(settle_seconds=0) == 0  # each audit row is counted once
    listed = client.get("/v1/memories").json()["memories"][0]
    assert listed["id"] == memory_id and listed["access_count"] == 3
    assert listed["last_recalled_at"] is not None


def test_a_fold_meeting_an_edit_of_the_same_memory_loses_no_count(api_client, alice_key, alice_scope, monkeypatch):
    """The edit rewrites the whole payload, but under the row's lock and from what it reads
    after taking it; the fold's one UPDATE waits for that lock and then adds to the edited
    row. Neither loses the other's change."""
    import time

    from memories import services as memory_services
    from memories.services import memory_update
    from tests.conftest import InThread, held_after

    memory_id = memory_remember(alice_scope, memory="Alice's cat is Miso", call=internal_call()).id
    client = api_client(alice_key)
    for _ in range(3):
        assert client.post("/v1/memories/search", {"query": "cat"}, format="json").json()["results"]
    locked, go = held_after(monkeypatch, memory_services, "engine_lock_owned")
    edited = "Alice's cat is Miso, a tabby"
    editing = InThread(lambda: memory_update(alice_scope, memory_id=memory_id, memory=edited, call=internal_call()))
    try:
        assert locked.wait(60)
        folding = InThread(lambda: memory_recalls_fold(settle_seconds=0))
        time.sleep(1)
        assert not folding.done()  # waiting for the edit's row lock
    finally:
        go.set()
    editing.result()
    assert folding.result() == 3
    listed = client.get("/v1/memories").json()["memories"][0]
    assert listed["memory"] == edited and listed["access_count"] == 3


# --- web UI and admin ---------------------------------------------------------------------
def test_web_field_edit_keeps_a_tag_holding_a_comma_it_did_not_change(client, alice, alice_scope):
    """The API allows a comma in a tag; the form shows the tags joined by commas. Saving
    only a new importance used to split "work, travel" into two tags."""
    memory_id = memory_remember(
        alice_scope, memory="Alice's badge number", fields={"tags": ["work, travel", "id"]}, call=internal_call()
    ).id
    client.force_login(alice)
    page = client.get(f"/memories/{memory_id}/").content.decode()
    shown = re.search(r'id="f-tags" name="tags" value="([^"]*)"', page).group(1)
    form = {"memory_type": "user", "tags": html.unescape(shown), "importance": "0.9"}
    assert b"Saved." in client.post(f"/memories/{memory_id}/fields/", form, follow=True).content
    stored = engine.engine_get(memory_id)
    assert (stored.attrs.tags, stored.attrs.importance) == (("work, travel", "id"), 0.9)
    form["tags"] = "work, travel, home"  # edited: taken as the form's comma-separated list
    client.post(f"/memories/{memory_id}/fields/", form)
    assert engine.engine_get(memory_id).attrs.tags == ("work", "travel", "home")


def test_web_shows_edits_and_filters_fields(client, alice, alice_scope, admin_client):
    memory_id = memory_remember(alice_scope, memory="Alice plans a trip to Crete", call=internal_call()).id
    memory_remember(alice_scope, memory="Alice's router password is in the drawer", call=internal_call())
    client.force_login(alice)
    saved = client.post(
        f"/memories/{memory_id}/fields/",
        {"memory_type": "project", "tags": "travel, 2026", "importance": "0.8", "agent_id": "planner",
         "session_id": "", "expires_at": FUTURE, "source": "ui-test", "why_stored": "plans"},
        follow=True,
    )  # fmt: skip
    assert b"Saved." in saved.content and b"travel, 2026" in saved.content and b"planner" in saved.content
    stored = engine.engine_get(memory_id)
    assert (stored.attrs.memory_type, stored.attrs.tags, stored.attrs.importance) == (
        "project",
        ("travel", "2026"),
        0.8,
    )
    assert stored.metadata["source"] == "ui-test"

    bad = client.post(f"/memories/{memory_id}/fields/", {"memory_type": "nope", "importance": "7"}, follow=True)
    assert b"memory_type" in bad.content and engine.engine_get(memory_id).attrs.memory_type == "project"

    listed = client.get("/memories/?memory_type=project&tags=travel").content
    assert b"trip to Crete" in listed and b"router password" not in listed
    assert b"router password" in client.get("/memories/?memory_type=user").content
    forget = client.get("/memories/forget/?tags=travel")
    assert b"Delete 1 matching memory?" in forget.content
    client.post("/memories/forget/", {"tags": "travel"})
    assert engine.engine_get(memory_id).trash is not None
    assert b"Alice plans a trip to Crete" in client.get("/trash/").content

    admin_page = admin_client.get(f"/admin/memories/enginememoryrow/{memory_id}/change/").content
    assert b"project" in admin_page and b"in trash since" in admin_page


def test_x_turn_id_is_read_from_django_and_starlette_requests(rf):
    from starlette.requests import Request

    from core.calls import call_context_from_request
    from core.choices import Channel

    django_request = rf.get("/", HTTP_X_TURN_ID="turn-1")
    assert call_context_from_request(django_request, channel=Channel.REST).turn_id == "turn-1"
    scope = {"type": "http", "method": "POST", "path": "/", "headers": [(b"x-turn-id", b"turn-2")], "client": None}
    assert call_context_from_request(Request(scope), channel=Channel.MCP).turn_id == "turn-2"
    assert call_context_from_request(rf.get("/"), channel=Channel.REST).turn_id == ""
