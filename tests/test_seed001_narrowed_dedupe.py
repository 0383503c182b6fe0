"""A store narrowed to an agent or session keeps to it (seed 001: "a store puts the memory
there"). The dedupe rule was one hash per user and text: storing in agent-b a text agent-a
had answered 200 `duplicate: true` with agent-a's memory, billed, which agent-b could then
neither list nor forget. Now the same text is one memory inside one narrowing (none
included), and a text the user has only outside it is stored again, inside it; an
ingest's facts likewise."""

from __future__ import annotations

import json

import pytest

from audit.models import AuditEvent
from billing.models import UsageEvent
from core.errors import ServiceError
from memories.models import ContentHash
from memories.services import (
    api_key_issue,
    content_sha256,
    memory_export,
    memory_import_file,
    memory_ingest,
    memory_list,
    memory_remember,
    memory_update,
)
from tests.conftest import internal_call

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]

ALICE = {"tenant_id": "default", "user_id": "alice"}
AGENT_A = {**ALICE, "agent_id": "agent-a"}
AGENT_B = {**ALICE, "agent_id": "agent-b"}


@pytest.fixture
def client(api_client, alice):
    return api_client(api_key_issue(user=alice, name="narrowed-dedupe")[1])


def store(client, text: str, scope: dict):
    return client.post("/v1/memory", {"content": text, "scope": scope}, format="json")


def listed(client, query: str = "") -> list[str]:
    return [m["id"] for m in client.get(f"/v1/memory{query}").json()["memories"]]


def test_a_store_in_another_agent_lands_there_visible_and_forgettable(client):
    a = store(client, "Alice walks daily", AGENT_A)
    b = store(client, "Alice walks daily", AGENT_B)
    assert a.status_code == 201 and b.status_code == 201, b.content
    memory = b.json()["memory"]
    assert b.json()["duplicate"] is False and memory["id"] != a.json()["memory"]["id"]
    assert memory["scope"]["agent_id"] == "agent-b" and memory["content"] == "Alice walks daily"
    assert listed(client, "?agent_id=agent-b") == [memory["id"]]
    assert listed(client, "?agent_id=agent-a") == [a.json()["memory"]["id"]]
    forgot = client.post(f"/v1/memory/{memory['id']}/forget", {"scope": {"agent_id": "agent-b"}}, format="json")
    assert forgot.status_code == 200, forgot.content
    assert listed(client) == [a.json()["memory"]["id"]]  # agent-a's memory untouched


def test_the_same_text_in_the_same_narrowing_is_one_memory(client):
    first = store(client, "Alice walks daily", AGENT_B)
    again = store(client, "  alice WALKS   daily ", AGENT_B)
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json()["duplicate"] is True and again.json()["memory"]["id"] == first.json()["memory"]["id"]
    # A copy stored beside another agent's memory (it holds no hash) is found as well.
    store(client, "Alice swims on Sundays", AGENT_A)
    copy = store(client, "Alice swims on Sundays", AGENT_B)
    twice = store(client, "alice swims on sundays", AGENT_B)
    assert copy.status_code == 201 and twice.status_code == 200
    assert twice.json()["duplicate"] is True and twice.json()["memory"]["id"] == copy.json()["memory"]["id"]
    # An agent's memory in a session is inside the agent's narrowing (as a list or forget sees it).
    in_session = store(client, "Alice runs at dawn", {**AGENT_A, "session_id": "s-1"})
    agent_wide = store(client, "Alice runs at dawn", AGENT_A)
    assert agent_wide.status_code == 200 and agent_wide.json()["memory"]["id"] == in_session.json()["memory"]["id"]
    assert len(listed(client)) == 4


def test_a_narrowed_store_of_an_un_narrowed_text_gets_its_own_memory(client):
    plain = store(client, "Alice likes tea", ALICE)
    narrowed = store(client, "Alice likes tea", {**ALICE, "session_id": "s-9"})
    assert narrowed.status_code == 201 and narrowed.json()["memory"]["scope"]["session_id"] == "s-9"
    assert narrowed.json()["memory"]["id"] != plain.json()["memory"]["id"]
    assert UsageEvent.objects.filter(operation="remember").count() == 2


def test_un_narrowed_remember_stays_idempotent_per_user(client, alice_scope):
    """Seed 000's contract: an un-narrowed store answers the user's memory of the text,
    whatever agent or session it belongs to."""
    a = store(client, "Alice walks daily", AGENT_A)
    b = store(client, "Alice walks daily", AGENT_B)
    for _ in range(2):
        plain = memory_remember(alice_scope, memory="alice walks daily", call=internal_call())
        assert plain.duplicate is True and plain.id == a.json()["memory"]["id"]
    own = memory_remember(alice_scope, memory="Alice reads", call=internal_call())
    assert memory_remember(alice_scope, memory="Alice reads", call=internal_call()).id == own.id
    # The hash holder forgotten, its hash goes to the copy: un-narrowed stores answer it.
    forgot = client.post(f"/v1/memory/{a.json()['memory']['id']}/forget", {"scope": AGENT_A}, format="json")
    assert forgot.status_code == 200
    after = memory_remember(alice_scope, memory="Alice walks daily", call=internal_call())
    assert after.duplicate is True and after.id == b.json()["memory"]["id"]
    assert ContentHash.objects.filter(memory_id=b.json()["memory"]["id"]).exists()


def test_mcp_remember_with_agent_id_keeps_to_it(alice_scope):
    """The tools' `agent_id` field narrows a store as seed 001's scope does."""
    a = memory_remember(alice_scope, memory="Alice codes in Rust", fields={"agent_id": "a"}, call=internal_call())
    b = memory_remember(alice_scope, memory="Alice codes in Rust", fields={"agent_id": "b"}, call=internal_call())
    b2 = memory_remember(alice_scope, memory="Alice codes in Rust", fields={"agent_id": "b"}, call=internal_call())
    assert (a.duplicate, b.duplicate, b2.duplicate) == (False, False, True)
    assert b.id != a.id and b2.id == b.id
    views = {v.id: v for v in memory_list(alice_scope, call=internal_call()).memories}
    assert (views[a.id].agent_id, views[b.id].agent_id) == ("a", "b")


def test_an_agents_copy_survives_export_and_import(client, alice_scope, bob_scope):
    store(client, "Alice walks daily", AGENT_A)
    store(client, "Alice walks daily", AGENT_B)
    exported = memory_export(alice_scope, file_format="jsonl", call=internal_call()).content
    assert len(exported.splitlines()) == 3
    result = memory_import_file(bob_scope, data=exported.encode(), source="memsite", call=internal_call())
    assert (result.imported, result.duplicates) == (2, 0)
    agents = sorted(v.agent_id or "" for v in memory_list(bob_scope, call=internal_call()).memories)
    assert agents == ["agent-a", "agent-b"]
    again = memory_import_file(bob_scope, data=exported.encode(), source="memsite", call=internal_call())
    assert (again.imported, again.duplicates) == (0, 2)
    assert json.loads(exported.splitlines()[0])["count"] == 2


# --- ingest: mem0's facts keep to the narrowing as a remember does ------------------------
TURN = [{"role": "user", "content": "I walk every day."}]


def ingest(client, scope: dict):
    response = client.post("/v1/memory", {"messages": TURN, "scope": scope}, format="json")
    assert response.status_code == 201, response.content
    return response.json()["memories"]


def answered(memories: list[dict]) -> list[tuple]:
    return [(m["id"], m["content"], m["scope"]["agent_id"], m["event"]) for m in memories]


def test_a_narrowed_ingest_of_another_agents_text_lands_in_its_agent(client, llm):
    a = store(client, "Alice walks daily", AGENT_A).json()["memory"]["id"]
    # Case and spacing apart (the exact text: test_a_narrowed_ingest_of_another_agents_exact_text_...).
    llm.queue_facts("alice walks  daily")
    [added] = ingest(client, AGENT_B)
    assert added["event"] == "ADD" and added["id"] != a, added
    assert listed(client, "?agent_id=agent-b") == [added["id"]]
    assert listed(client, "?agent_id=agent-a") == [a]
    # The same narrowed ingest again answers the agent's copy; an un-narrowed one the holder.
    llm.queue_facts("ALICE walks daily")
    # Each answered whole, in the seed's shape (its own text, not the fact's), with the event.
    assert answered(ingest(client, AGENT_B)) == [(added["id"], "alice walks  daily", "agent-b", "NONE")]
    llm.queue_facts("Alice Walks Daily")
    assert answered(ingest(client, ALICE)) == [(a, "Alice walks daily", "agent-a", "NONE")]
    assert sorted(listed(client)) == sorted([a, added["id"]])
    assert str(ContentHash.objects.get().memory_id) == a  # the copy holds no hash
    forgot = client.post(f"/v1/memory/{added['id']}/forget", {"scope": {"agent_id": "agent-b"}}, format="json")
    assert forgot.status_code == 200, forgot.content
    assert listed(client) == [a]


def test_a_narrowed_ingest_answers_a_copy_it_can_see(alice_scope, llm):
    """The tools' `session_id` field (MCP/REST ingest) narrows as seed 001's scope does; two
    facts of one text in one call are one memory, and a copy a remember stored is found."""
    plain = memory_remember(alice_scope, memory="Alice likes tea", call=internal_call())
    llm.queue_facts("alice likes tea", "Alice likes  TEA")
    first, second = memory_ingest(alice_scope, messages=TURN, fields={"session_id": "s-1"}, call=internal_call())
    assert first["event"] == "ADD" and first["id"] != plain.id
    assert second == {"id": first["id"], "memory": "Alice likes  TEA", "event": "NONE"}
    views = {v.id: v for v in memory_list(alice_scope, call=internal_call()).memories}
    assert set(views) == {plain.id, first["id"]} and views[first["id"]].session_id == "s-1"
    memory_remember(alice_scope, memory="Alice reads", call=internal_call())  # the holder, in no agent
    copy = memory_remember(alice_scope, memory="Alice reads", fields={"agent_id": "b"}, call=internal_call())
    llm.queue_facts("alice reads")
    assert memory_ingest(alice_scope, messages=TURN, fields={"agent_id": "b"}, call=internal_call()) == [
        {"id": copy.id, "memory": "alice reads", "event": "NONE"}
    ]


def test_another_users_copy_in_the_same_agent_is_as_missing_as_none(client, api_client, bob):
    """Tenancy: bob's memory of the same text, in the same agent and outside it, is never
    alice's duplicate nor her copy; each store lands in its own user's memories."""
    bob_client = api_client(api_key_issue(user=bob, name="narrowed-dedupe-bob")[1])
    bob_scope = {"tenant_id": "default", "user_id": "bob"}
    bobs = [store(bob_client, "Alice walks daily", {**bob_scope, "agent_id": a}) for a in ("agent-a", "agent-b")]
    assert [r.status_code for r in bobs] == [201, 201], bobs[1].content
    bob_ids = {r.json()["memory"]["id"] for r in bobs}

    a = store(client, "Alice walks daily", AGENT_A)
    b = store(client, "alice walks daily", AGENT_B)
    assert (a.status_code, b.status_code) == (201, 201), b.content
    assert a.json()["duplicate"] is False and b.json()["duplicate"] is False
    mine = {a.json()["memory"]["id"], b.json()["memory"]["id"]}
    assert not mine & bob_ids and set(listed(client)) == mine
    assert set(listed(bob_client)) == bob_ids  # bob's untouched
    for bob_id in bob_ids:  # and his ids answer alice as missing ones do
        gone = client.post(f"/v1/memory/{bob_id}/forget", {"scope": {"agent_id": "agent-b"}}, format="json")
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "not_found"


# --- update: a conflict names only a memory the caller's narrowing can see ---------------
def put(client, memory_id: str, text: str, scope: dict):
    return client.put(f"/v1/memory/{memory_id}", {"content": text, "scope": scope}, format="json")


def test_a_narrowed_update_to_another_agents_text_keeps_it_in_its_agent(client, alice_scope):
    """It answered 409 naming agent-a's memory, which agent-b could neither list nor
    forget. Now the memory takes the text beside it, without the hash, as a narrowed
    store's copy does."""
    a = store(client, "Alice walks daily", AGENT_A).json()["memory"]["id"]
    b = store(client, "Alice swims", AGENT_B).json()["memory"]["id"]
    response = put(client, b, "alice walks  DAILY", AGENT_B)
    assert response.status_code == 200, response.content
    assert response.json()["memory"]["id"] == b and response.json()["memory"]["content"] == "alice walks  DAILY"
    assert listed(client, "?agent_id=agent-b") == [b] and listed(client, "?agent_id=agent-a") == [a]
    # The hash stays with its holder: un-narrowed stores answer it; the old text is free.
    assert sorted(str(m) for m in ContentHash.objects.values_list("memory_id", flat=True)) == [a]
    assert memory_remember(alice_scope, memory="Alice walks daily", call=internal_call()).id == a
    assert memory_remember(alice_scope, memory="Alice swims", call=internal_call()).duplicate is False
    # The holder forgotten, its hash goes to the updated copy.
    assert client.post(f"/v1/memory/{a}/forget", {"scope": AGENT_A}, format="json").status_code == 200
    assert memory_remember(alice_scope, memory="Alice walks daily", call=internal_call()).id == b


def test_a_narrowed_update_conflicts_with_a_copy_it_can_see(client):
    a = store(client, "Alice walks daily", AGENT_A).json()["memory"]["id"]
    copy = store(client, "Alice walks daily", AGENT_B).json()["memory"]["id"]
    b = store(client, "Alice swims", AGENT_B).json()["memory"]["id"]
    response = put(client, b, "alice walks daily", AGENT_B)
    assert response.status_code == 409, response.content
    assert response.json()["error"]["code"] == "conflict"
    assert response.json()["error"]["details"] == {"existing_id": copy}
    assert {copy, b} == set(listed(client, "?agent_id=agent-b")) and a not in listed(client, "?agent_id=agent-b")
    # Un-narrowed (seed 000 and a scope without agent or session), the holder as before.
    plain = put(client, b, "alice walks daily", ALICE)
    assert plain.status_code == 409 and plain.json()["error"]["details"] == {"existing_id": a}
    rest = client.patch(f"/v1/memories/{b}", {"memory": "alice walks daily"}, format="json")
    assert rest.status_code == 409 and rest.json()["error"]["details"] == {"existing_id": a}


def test_an_un_narrowed_update_to_another_agents_text_is_still_a_conflict(alice_scope):
    """Seed 000's contract (MCP update_memory, REST PATCH): the user's memory of the text."""
    a = memory_remember(alice_scope, memory="Alice codes in Rust", fields={"agent_id": "a"}, call=internal_call())
    b = memory_remember(alice_scope, memory="Alice codes in Go", fields={"agent_id": "b"}, call=internal_call())
    with pytest.raises(ServiceError) as raised:
        memory_update(alice_scope, memory_id=b.id, memory="Alice codes in Rust", call=internal_call())
    assert raised.value.code.value == "conflict" and raised.value.details == {"existing_id": a.id}


def test_racing_narrowed_updates_to_another_agents_text_keep_one_copy_and_one_hash(alice_scope):
    from concurrent.futures import ThreadPoolExecutor

    from django.db import connections

    holder = memory_remember(alice_scope, memory="The one text", fields={"agent_id": "a"}, call=internal_call())
    ids = [
        memory_remember(alice_scope, memory=f"Fact {i}", fields={"agent_id": "b"}, call=internal_call()).id
        for i in range(4)
    ]

    def update(memory_id):
        try:
            memory_update(
                alice_scope, memory_id=memory_id, memory="the one  text", within={"agent_id": "b"}, call=internal_call()
            )
            return memory_id
        except ServiceError as exc:
            return exc.details["existing_id"]
        finally:
            connections.close_all()

    with ThreadPoolExecutor(4) as pool:
        outcomes = list(pool.map(update, ids))
    [winner] = set(outcomes)  # the first one's copy is every other one's conflict
    assert winner in ids
    views = memory_list(alice_scope, call=internal_call()).memories
    assert sorted(v.id for v in views if v.memory.lower().split() == ["the", "one", "text"]) == sorted(
        [holder.id, winner]
    )
    assert str(ContentHash.objects.get(sha256=content_sha256("The one text")).memory_id) == holder.id
    assert not ContentHash.objects.filter(memory_id=winner).exists()


def test_a_narrowed_update_never_names_or_takes_bobs_memory(client, api_client, bob, alice_scope):
    """Tenancy: bob's memory of the text, in the caller's agent and outside it, is as
    missing as none: alice's update claims the text's hash for her memory."""
    bob_client = api_client(api_key_issue(user=bob, name="narrowed-update-bob")[1])
    bob_scope = {"tenant_id": "default", "user_id": "bob"}
    bob_ids = {
        store(bob_client, "Alice walks daily", {**bob_scope, "agent_id": a}).json()["memory"]["id"]
        for a in ("agent-a", "agent-b")
    }
    b = store(client, "Alice swims", AGENT_B).json()["memory"]["id"]
    response = put(client, b, "Alice walks daily", AGENT_B)
    assert response.status_code == 200, response.content
    assert (
        str(
            ContentHash.objects.get(
                sha256=content_sha256("Alice walks daily"), engine_user_id=alice_scope.engine_user_id
            ).memory_id
        )
        == b
    )
    other = store(client, "Alice rows", AGENT_A).json()["memory"]["id"]
    moved = put(client, other, "Alice walks daily", AGENT_A)  # alice's holder is in agent-b: no copy in agent-a
    assert moved.status_code == 200, moved.content
    again = store(client, "Alice reads", AGENT_A).json()["memory"]["id"]
    conflict = put(client, again, "alice walks daily", AGENT_A)
    assert conflict.status_code == 409 and conflict.json()["error"]["details"] == {"existing_id": other}
    assert set(listed(bob_client)) == bob_ids
    assert not bob_ids & set(listed(client))


# --- import: a file's narrowed copies come in as a narrowed store would keep them ----------
def _exported(scope) -> bytes:
    return memory_export(scope, file_format="jsonl", call=internal_call()).content.encode()


def _imported(scope, data: bytes):
    return memory_import_file(scope, data=data, source="memsite", call=internal_call())


def _agents(scope) -> list[tuple[str, str]]:
    return sorted((v.agent_id or "", v.memory) for v in memory_list(scope, call=internal_call()).memories)


def test_an_import_keeps_a_files_agent_copies_of_a_text_the_user_has(client, api_client, bob, alice_scope, bob_scope):
    """They were skipped with the whole text: alice, holding "Alice walks daily" in no
    agent, imported a file with agent-a's and agent-b's copies of it and got neither,
    although a store narrowed to either agent would have stored one there."""
    bob_client = api_client(api_key_issue(user=bob, name="narrowed-import-bob")[1])
    bob_claim = {"tenant_id": "default", "user_id": "bob"}
    for agent in ("agent-a", "agent-b"):
        store(bob_client, "Alice walks daily", {**bob_claim, "agent_id": agent})
    store(bob_client, "Alice swims", {**bob_claim, "agent_id": "agent-b"})
    data = _exported(bob_scope)
    mine = memory_remember(alice_scope, memory="alice walks daily", call=internal_call()).id
    in_b = store(client, "Alice swims", AGENT_B).json()["memory"]["id"]

    result = _imported(alice_scope, data)
    assert (result.imported, result.duplicates) == (2, 1)  # agent-b already has "Alice swims"
    assert _agents(alice_scope) == [
        ("", "alice walks daily"),
        ("agent-a", "Alice walks daily"),
        ("agent-b", "Alice swims"),
        ("agent-b", "Alice walks daily"),
    ]
    # The hash stays with the user's own memory; the copies are each agent's to see and forget.
    assert memory_remember(alice_scope, memory="Alice walks daily", call=internal_call()).id == mine
    assert (
        str(
            ContentHash.objects.get(
                sha256=content_sha256("Alice swims"), engine_user_id=alice_scope.engine_user_id
            ).memory_id
        )
        == in_b
    )
    [copy_b] = [i for i in listed(client, "?agent_id=agent-b") if i != in_b]
    assert client.post(f"/v1/memory/{copy_b}/forget", {"scope": AGENT_B}, format="json").status_code == 200
    # Idempotent: the same file again adds what is missing only (the forgotten copy).
    again = _imported(alice_scope, data)
    assert (again.imported, again.duplicates) == (1, 2)
    assert (_imported(alice_scope, data).imported, len(listed(client))) == (0, 4)
    # Tenancy: bob's memories and hashes are his own, untouched.
    assert (
        sorted(listed(bob_client)) == sorted(v.id for v in memory_list(bob_scope, call=internal_call()).memories)
        and len(listed(bob_client)) == 3
    )
    assert not set(listed(bob_client)) & set(listed(client))


def test_an_import_skips_a_copy_where_the_holder_or_a_copy_already_is(alice_scope, bob_scope):
    for agent in (None, "agent-a", "agent-b"):
        memory_remember(
            bob_scope, memory="Alice reads", fields={"agent_id": agent} if agent else None, call=internal_call()
        )
    data = _exported(bob_scope)
    holder = memory_remember(alice_scope, memory="Alice reads", fields={"agent_id": "agent-a"}, call=internal_call())
    memory_remember(
        alice_scope, memory="Alice reads", fields={"agent_id": "agent-b", "session_id": "s-1"}, call=internal_call()
    )
    result = _imported(alice_scope, data)
    # agent-a holds it; agent-b has a copy (in a session: inside agent-b); no agent: the holder is inside.
    assert (result.imported, result.duplicates) == (0, 3)
    assert len(_agents(alice_scope)) == 2
    assert [
        str(m)
        for m in ContentHash.objects.filter(engine_user_id=alice_scope.engine_user_id).values_list(
            "memory_id", flat=True
        )
    ] == [holder.id]


# --- mem0's own exact-text check (md5 of the text, over the memories its add searched) ------
def test_a_narrowed_ingest_of_another_agents_exact_text_lands_in_its_agent(client, llm, alice_scope):
    """mem0 skipped the fact before our rule ran: its add drops an extracted text whose md5
    one of the user's memories it found carries, whatever their agent (our agent is our
    field, not mem0's), so the call answered [] and agent-b got nothing."""
    a = store(client, "Alice walks daily", AGENT_A).json()["memory"]["id"]
    llm.queue_facts("Alice walks daily")
    [added] = ingest(client, AGENT_B)
    assert added["event"] == "ADD" and added["id"] != a, added
    assert listed(client, "?agent_id=agent-b") == [added["id"]]
    # Again: the agent's copy, NONE; un-narrowed: the holder, NONE (session 32: both were []).
    llm.queue_facts("Alice walks daily")
    assert answered(ingest(client, AGENT_B)) == [(added["id"], "Alice walks daily", "agent-b", "NONE")]
    llm.queue_facts("Alice walks daily")
    assert answered(ingest(client, ALICE)) == [(a, "Alice walks daily", "agent-a", "NONE")]
    assert sorted(listed(client)) == sorted([a, added["id"]])


def test_an_ingest_whose_facts_are_all_exact_texts_the_user_has_answers_each_as_none(alice_scope, llm):
    """mem0 dropped a fact whose md5 one of the memories its add searched carries, before our
    rule ran: when every fact was one, the call answered [] (billed, audited with no ids),
    where README promises `NONE` with the id of the memory that holds it; a retry of the
    same turn (the intent's docs: "answered as NONE") learnt nothing either."""
    tea = memory_remember(alice_scope, memory="Alice likes tea", call=internal_call())
    rust = memory_remember(alice_scope, memory="Alice codes in Rust", fields={"agent_id": "b"}, call=internal_call())
    on_call = {"session_id": "s-1"}
    session = memory_remember(alice_scope, memory="Alice is on call", fields=on_call, call=internal_call())
    hashes = sorted(ContentHash.objects.values_list("sha256", "memory_id"))

    llm.queue_facts("Alice likes tea", "Alice codes in Rust")
    assert memory_ingest(alice_scope, messages=TURN, call=internal_call()) == [
        {"id": tea.id, "memory": "Alice likes tea", "event": "NONE"},
        {"id": rust.id, "memory": "Alice codes in Rust", "event": "NONE"},
    ]
    llm.queue_facts("Alice codes in Rust")
    assert memory_ingest(alice_scope, messages=TURN, fields={"agent_id": "b"}, call=internal_call()) == [
        {"id": rust.id, "memory": "Alice codes in Rust", "event": "NONE"}
    ]
    llm.queue_facts("Alice is on call")
    assert memory_ingest(alice_scope, messages=TURN, fields={"session_id": "s-1"}, call=internal_call()) == [
        {"id": session.id, "memory": "Alice is on call", "event": "NONE"}
    ]
    # Each call's audit row names the memories it answered; nothing was stored, no hash moved.
    rows = AuditEvent.objects.filter(operation="ingest").order_by("id")
    assert [sorted(r.memory_ids) for r in rows] == [sorted([tea.id, rust.id]), [rust.id], [session.id]]
    assert sorted(v.id for v in memory_list(alice_scope, call=internal_call()).memories) == sorted(
        [tea.id, rust.id, session.id]
    )
    assert sorted(ContentHash.objects.values_list("sha256", "memory_id")) == hashes


def test_bobs_exact_text_is_never_alices_in_a_narrowed_ingest(client, api_client, bob, llm, alice_scope):
    bob_client = api_client(api_key_issue(user=bob, name="narrowed-ingest-bob")[1])
    bob_claim = {"tenant_id": "default", "user_id": "bob"}
    bobs = {
        store(bob_client, "Alice walks daily", {**bob_claim, "agent_id": a}).json()["memory"]["id"]
        for a in ("agent-a", "agent-b")
    }
    llm.queue_facts("Alice walks daily")
    [added] = ingest(client, AGENT_B)
    assert added["event"] == "ADD" and added["id"] not in bobs
    holder = ContentHash.objects.get(
        sha256=content_sha256("Alice walks daily"), engine_user_id=alice_scope.engine_user_id
    )
    assert str(holder.memory_id) == added["id"] and set(listed(bob_client)) == bobs


# --- a move to another agent or session: the destination keeps a narrowed store's rule ------
def patch(client, memory_id: str, body: dict):
    return client.patch(f"/v1/memories/{memory_id}", body, format="json")


def _where(scope) -> dict[str, tuple]:
    return {
        v.id: (v.agent_id, v.session_id, v.memory, v.pinned) for v in memory_list(scope, call=internal_call()).memories
    }


def _holder(scope, text: str) -> str:
    return str(ContentHash.objects.get(sha256=content_sha256(text), engine_user_id=scope.engine_user_id).memory_id)


def test_a_copy_moved_into_the_holders_agent_is_a_conflict_naming_it(client, alice_scope):
    """PATCH /v1/memories/<agent-b's copy> {"agent_id": "agent-a"} answered 200 and left
    two live copies of the text in agent-a (GET /v1/memory?agent_id=agent-a listed both),
    while a store narrowed to agent-a answers the one there."""
    a = store(client, "Alice walks daily", AGENT_A).json()["memory"]["id"]
    b = store(client, "Alice walks daily", AGENT_B).json()["memory"]["id"]
    before = _where(alice_scope)
    response = patch(client, b, {"agent_id": "agent-a", "pinned": True})
    assert response.status_code == 409, response.content
    assert response.json()["error"]["code"] == "conflict"
    assert response.json()["error"]["details"] == {"existing_id": a}
    assert _where(alice_scope) == before and _holder(alice_scope, "Alice walks daily") == a  # nothing changed
    assert listed(client, "?agent_id=agent-a") == [a]
    # Seed 001's PUT moves nothing: its scope narrows, and the body takes no agent or session.
    put_moved = client.put(f"/v1/memory/{b}", {"agent_id": "agent-a", "scope": ALICE}, format="json")
    assert put_moved.status_code == 400 and _where(alice_scope) == before


def test_the_holder_moved_into_an_agent_with_a_copy_is_a_conflict_naming_the_copy(mcp_as, alice_key, alice_scope):
    """MCP update_memory's `agent_id` moved the hash's holder into agent b beside b's own
    copy: two live copies there. Elsewhere the move goes on, the holder keeping the hash."""
    a = memory_remember(alice_scope, memory="Alice codes in Rust", fields={"agent_id": "a"}, call=internal_call())
    b = memory_remember(alice_scope, memory="Alice codes in Rust", fields={"agent_id": "b"}, call=internal_call())
    before = _where(alice_scope)
    mcp = mcp_as(alice_key)
    error = mcp.error("update_memory", {"memory_id": a.id, "agent_id": "b", "tags": ["moved"]})
    assert error["code"] == "conflict" and error["details"] == {"existing_id": b.id}
    assert _where(alice_scope) == before and _holder(alice_scope, "Alice codes in Rust") == a.id
    moved = mcp.ok("update_memory", {"memory_id": a.id, "agent_id": "c"})
    assert moved["memory"]["agent_id"] == "c"
    assert _holder(alice_scope, "Alice codes in Rust") == a.id
    again = memory_remember(alice_scope, memory="alice codes in rust", fields={"agent_id": "c"}, call=internal_call())
    assert again.duplicate is True and again.id == a.id


def test_the_web_uis_fields_edit_shows_a_moves_conflict(client, alice, alice_scope):
    """The web UI's fields form (agent, session) moved a copy beside the holder."""
    from django.test import Client

    memory_remember(alice_scope, memory="Plays the cello", fields={"agent_id": "a"}, call=internal_call())
    b = memory_remember(alice_scope, memory="Plays the cello", fields={"agent_id": "b"}, call=internal_call())
    browser = Client()
    browser.force_login(alice)
    response = browser.post(f"/memories/{b.id}/fields/", {"agent_id": "a", "importance": "0.5"}, follow=True)
    assert response.status_code == 200
    assert "already has this text" in response.content.decode()
    assert _where(alice_scope)[b.id][0] == "b"


def test_moves_keep_the_destinations_rule_for_sessions_and_no_agent(client, alice_scope):
    """The destination is narrowed as a store there would be: an agent without a session
    takes in its sessions' copies; no agent and no session is the user's one memory of
    the text, the hash's holder, whichever agent it is in."""
    holder = store(client, "Alice walks daily", AGENT_B).json()["memory"]["id"]
    s1 = store(client, "Alice walks daily", {**AGENT_A, "session_id": "s1"}).json()["memory"]["id"]
    s2 = store(client, "Alice walks daily", {**AGENT_A, "session_id": "s2"}).json()["memory"]["id"]
    c = store(client, "Alice walks daily", {**ALICE, "agent_id": "agent-c"}).json()["memory"]["id"]
    before = _where(alice_scope)
    to_s2 = patch(client, s1, {"session_id": "s2"})
    assert to_s2.status_code == 409 and to_s2.json()["error"]["details"] == {"existing_id": s2}
    whole_agent = patch(client, s1, {"session_id": None})  # agent-a, every session: s2's copy is there
    assert whole_agent.status_code == 409 and whole_agent.json()["error"]["details"] == {"existing_id": s2}
    nowhere = patch(client, c, {"agent_id": None})  # the user's memory of the text
    assert nowhere.status_code == 409 and nowhere.json()["error"]["details"] == {"existing_id": holder}
    assert _where(alice_scope) == before
    # Into a narrowing without the text the move goes on, beside the holder without a hash.
    assert patch(client, s1, {"session_id": "s3"}).status_code == 200
    assert patch(client, c, {"agent_id": "agent-d"}).status_code == 200
    assert listed(client, "?agent_id=agent-d") == [c] and _holder(alice_scope, "Alice walks daily") == holder
    # The holder itself may leave every agent: the copies stay their agents' own.
    assert patch(client, holder, {"agent_id": None}).status_code == 200
    assert _holder(alice_scope, "Alice walks daily") == holder


def test_an_update_that_moves_nothing_is_as_before(client, alice_scope):
    """Naming the agent and session a memory is in is no move: two copies already in one
    agent (a session's copy beside the holder) keep taking updates, and a new text held
    outside the destination is still the un-narrowed `conflict` naming its holder."""
    holder = store(client, "Alice walks daily", AGENT_A).json()["memory"]["id"]
    s1 = store(client, "Alice walks daily", {**AGENT_A, "session_id": "s1"}).json()["memory"]["id"]
    assert patch(client, holder, {"agent_id": "agent-a", "importance": 0.9}).status_code == 200
    assert patch(client, s1, {"agent_id": "agent-a", "session_id": "s1", "tags": ["x"]}).status_code == 200
    other = store(client, "Alice swims", AGENT_B).json()["memory"]["id"]
    moved = patch(client, other, {"memory": "alice walks daily", "agent_id": "agent-c"})
    assert moved.status_code == 409 and moved.json()["error"]["details"] == {"existing_id": holder}


def test_racing_moves_into_one_agent_keep_one_copy_there(alice_scope):
    from concurrent.futures import ThreadPoolExecutor

    from django.db import connections

    holder = memory_remember(alice_scope, memory="The one text", fields={"agent_id": "a"}, call=internal_call())
    ids = [
        memory_remember(alice_scope, memory="The one text", fields={"agent_id": f"b{i}"}, call=internal_call()).id
        for i in range(4)
    ]

    def move(memory_id):
        try:
            memory_update(alice_scope, memory_id=memory_id, fields={"agent_id": "z"}, call=internal_call())
            return memory_id
        except ServiceError as exc:
            return exc.details["existing_id"]
        finally:
            connections.close_all()

    with ThreadPoolExecutor(4) as pool:
        outcomes = list(pool.map(move, ids))
    [winner] = set(outcomes)  # the first one moved is every other one's conflict
    assert winner in ids
    views = _where(alice_scope)
    assert [i for i, where in views.items() if where[0] == "z"] == [winner]
    assert _holder(alice_scope, "The one text") == holder.id


def test_bobs_copy_never_stops_or_names_alices_move(client, api_client, bob, alice_scope, bob_scope):
    bob_client = api_client(api_key_issue(user=bob, name="move-bob")[1])
    bobs = {
        store(bob_client, "Alice walks daily", {"tenant_id": "default", "user_id": "bob", "agent_id": a}).json()[
            "memory"
        ]["id"]
        for a in ("agent-a", "agent-b")
    }
    a = store(client, "Alice walks daily", AGENT_A).json()["memory"]["id"]
    moved = patch(client, a, {"agent_id": "agent-b"})
    assert moved.status_code == 200, moved.content
    assert listed(client, "?agent_id=agent-b") == [a] and _holder(alice_scope, "Alice walks daily") == a
    [bob_a] = [i for i, w in _where(bob_scope).items() if w[0] == "agent-a"]
    bob_moved = patch(bob_client, bob_a, {"agent_id": "agent-c"})
    assert bob_moved.status_code == 200, bob_moved.content
    assert set(_where(bob_scope)) == bobs and set(_where(alice_scope)) == {a}
