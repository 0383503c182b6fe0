"""One dedupe rule for every path that sets a memory's text (issue 10, D5): remember,
update (MCP, REST, web UI) and ingest. A change that would make a memory identical to
another of the user's memories answers `conflict` with that memory's id and changes
nothing but leaving one audit row."""

import pytest

from audit.models import AuditEvent, MemoryHistory
from billing.models import UsageEvent
from core.errors import ServiceError
from memories import engine
from memories.models import ContentHash, IngestIntent
from memories.services import memory_ingest, memory_list, memory_remember, memory_update
from tests.conftest import internal_call

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]


def _rows(scope):
    return engine.engine_rows_owned(scope)


def _state(scope) -> dict:
    return {
        # Read without a call: listing is billed and audited.
        "memories": sorted(
            (m.id, m.text, m.metadata.get("pinned")) for m in map(engine.engine_memory_of, _rows(scope))
        ),
        "hashes": sorted(ContentHash.objects.values_list("sha256", "memory_id")),
        "history": MemoryHistory.objects.count(),
        "usage": UsageEvent.objects.count(),
    }


def test_update_to_another_memorys_text_is_a_conflict_and_changes_nothing(alice_scope, alice_key, api_client):
    a = memory_remember(alice_scope, memory="Alice drinks oolong tea", call=internal_call())
    b = memory_remember(alice_scope, memory="Alice drinks rooibos", call=internal_call())
    before, audits = _state(alice_scope), AuditEvent.objects.count()

    response = api_client(alice_key).patch(
        f"/v1/memories/{b.id}", {"memory": "  alice DRINKS oolong   tea", "pinned": True}, format="json"
    )

    assert response.status_code == 409, response.json()
    error = response.json()["error"]
    assert error["code"] == "conflict" and error["details"] == {"existing_id": a.id}
    assert _state(alice_scope) == before
    assert AuditEvent.objects.count() == audits + 1
    row = AuditEvent.objects.latest("id")
    assert (row.operation, row.outcome, row.error_code) == ("update_memory", "error", "conflict")


def test_update_to_its_own_text_or_a_new_one_rehashes(alice_scope):
    b = memory_remember(alice_scope, memory="Bob's birthday is in May", call=internal_call())
    memory_update(alice_scope, memory_id=b.id, memory="bob's birthday is in may", call=internal_call())
    memory_update(alice_scope, memory_id=b.id, memory="Bob's birthday is on 3 June", call=internal_call())

    again = memory_remember(alice_scope, memory="Bob's birthday is on 3 June", call=internal_call())
    assert again.duplicate is True and again.id == b.id
    # The old text is free again.
    old = memory_remember(alice_scope, memory="Bob's birthday is in May", call=internal_call())
    assert old.duplicate is False
    assert ContentHash.objects.count() == 2


def test_the_same_text_in_another_users_memories_is_no_conflict(alice_scope, bob_scope):
    memory_remember(alice_scope, memory="Likes hiking", call=internal_call())
    b = memory_remember(bob_scope, memory="Likes climbing", call=internal_call())
    updated = memory_update(bob_scope, memory_id=b.id, memory="Likes hiking", call=internal_call())
    assert updated.memory == "Likes hiking"


def test_web_ui_edit_shows_the_conflict(client, alice, alice_scope):
    a = memory_remember(alice_scope, memory="Plays the cello", call=internal_call())
    b = memory_remember(alice_scope, memory="Plays the viola", call=internal_call())
    client.force_login(alice)
    response = client.post(f"/memories/{b.id}/edit/", {"memory": "Plays the cello"}, follow=True)
    assert response.status_code == 200
    assert "already has this text" in response.content.decode()
    assert engine.engine_get(b.id).text == "Plays the viola"
    assert ContentHash.objects.filter(memory_id=a.id).exists()


def test_concurrent_updates_to_the_same_text_keep_one(alice_scope):
    from concurrent.futures import ThreadPoolExecutor

    from django.db import connections

    ids = [memory_remember(alice_scope, memory=f"Fact number {i}", call=internal_call()).id for i in range(4)]

    def update(memory_id):
        try:
            return memory_update(alice_scope, memory_id=memory_id, memory="The one text", call=internal_call()).id
        except ServiceError as exc:
            return exc.code.value
        finally:
            connections.close_all()

    with ThreadPoolExecutor(4) as pool:
        outcomes = list(pool.map(update, ids))
    assert sorted(outcomes, key=str).count("conflict") == 3
    texts = [m.memory for m in memory_list(alice_scope, call=internal_call()).memories]
    assert texts.count("The one text") == 1


def test_ingest_skips_facts_already_remembered_and_hashes_new_ones(alice_scope, llm):
    known = memory_remember(alice_scope, memory="Alice lives in Oslo", call=internal_call())
    # Differs only in case and spacing (mem0's own md5 check misses it; our hash does not).
    llm.queue_facts("alice lives in  Oslo", "Alice has a cat named Miso")

    results = memory_ingest(alice_scope, messages=[{"role": "user", "content": "I live in Oslo"}], call=internal_call())

    by_text = {r["memory"]: r for r in results}
    assert by_text["alice lives in  Oslo"] == {"id": known.id, "memory": "alice lives in  Oslo", "event": "NONE"}
    new = by_text["Alice has a cat named Miso"]
    assert new["event"] == "ADD"
    texts = sorted(m.memory for m in memory_list(alice_scope, call=internal_call()).memories)
    assert texts == ["Alice has a cat named Miso", "Alice lives in Oslo"]
    # The ingested memory got a hash: remembering it again is a duplicate.
    again = memory_remember(alice_scope, memory="alice has a cat named miso", call=internal_call())
    assert again.duplicate is True and again.id == new["id"]
    assert IngestIntent.objects.get().state == IngestIntent.State.DONE
    ingest_row = AuditEvent.objects.get(operation="ingest")
    assert set(ingest_row.memory_ids) == {known.id, new["id"]}
    assert UsageEvent.objects.filter(operation="ingest").count() == 1
