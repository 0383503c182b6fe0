"""A `remember` (MCP, /v1/memories, seed 001's POST /v1/memory) of a text the user already
has, asking for `pinned: true`, answered `duplicate: true` and left the memory unpinned.
Now the memory is pinned in the call's transaction, and its audit row holds the change
(before/after, `detail.pinned`); a duplicate with `pinned: false` never unpins."""

from __future__ import annotations

import pytest

from audit.crypto import content_open
from audit.models import AuditEvent
from memories.auth import Principal
from memories.operations import operation_execute
from memories.selectors import memory_get_owned, memory_view
from memories.services import api_key_issue, memory_remember
from tests.conftest import internal_call
from tests.engine_helpers import engine_history

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]


def _pinned(scope, memory_id: str) -> bool:
    return memory_view(memory_get_owned(scope, memory_id=memory_id)).pinned


def _last_remember() -> AuditEvent:
    return AuditEvent.objects.filter(operation="remember").latest("id")


def test_a_duplicate_remember_asking_for_a_pin_pins_the_memory_and_audits_it(alice_scope):
    first = memory_remember(alice_scope, memory="Alice likes green tea", call=internal_call(), with_memory=True)
    assert first.memory.pinned is False
    again = memory_remember(
        alice_scope, memory="alice likes  green tea", pinned=True, call=internal_call(), with_memory=True
    )
    assert (again.id, again.duplicate, again.memory.pinned) == (first.id, True, True)
    assert _pinned(alice_scope, first.id) is True
    row = _last_remember()
    assert row.memory_ids == [first.id] and row.detail == {"duplicate": True, "pinned": True}
    assert (content_open(row.before)["pinned"], content_open(row.after)["pinned"]) == (False, True)
    assert [h["event"] for h in engine_history(first.id)] == ["ADD", "UPDATE"]
    # A duplicate asking for nothing (pinned: false, the default) leaves the pin, and changes nothing.
    kept = memory_remember(
        alice_scope, memory="Alice likes green tea", pinned=False, call=internal_call(), with_memory=True
    )
    assert (kept.duplicate, kept.memory.pinned) == (True, True)
    assert _pinned(alice_scope, first.id) is True
    row = _last_remember()
    assert row.detail == {"duplicate": True} and row.before is None and row.after is None
    # Pinned already: a pin asked again changes nothing either.
    memory_remember(alice_scope, memory="Alice likes green tea", pinned=True, call=internal_call())
    assert _last_remember().detail == {"duplicate": True} and len(engine_history(first.id)) == 2


def test_every_remember_surface_pins_a_duplicate(api_client, alice, alice_scope):
    client = api_client(api_key_issue(user=alice, name="a")[1])
    texts = ["Alice swims on Mondays", "Alice reads on Tuesdays", "Alice cooks on Fridays"]
    ids = [memory_remember(alice_scope, memory=text, call=internal_call()).id for text in texts]
    seed = client.post("/v1/memory", {"content": texts[0], "pinned": True}, format="json")
    assert seed.status_code == 200, seed.content
    assert seed.json()["duplicate"] is True and seed.json()["memory"]["pinned"] is True
    rest = client.post("/v1/memories", {"memory": texts[1], "pinned": True}, format="json")
    assert rest.status_code == 200 and rest.json() == {"id": ids[1], "duplicate": True}
    principal = Principal(user=alice, method="api_key", client_app="probe-agent")
    mcp = operation_execute(principal, "remember", {"memory": texts[2], "pinned": True}, call=internal_call())
    assert mcp == {"id": ids[2], "duplicate": True}
    assert [_pinned(alice_scope, i) for i in ids] == [True, True, True]


def test_a_pinned_remember_of_an_expiring_turn_fact_keeps_and_pins_it_in_one_audit_row(alice):
    from tests.test_turns import run, turn

    fact = turn(alice, "s", "t1", "Today I am working from the cafe.")["fact_ids"][0]
    remembered = run(alice, "remember", memory="Today I am working from the cafe.", pinned=True)
    assert remembered == {"id": fact, "duplicate": True}
    row = _last_remember()
    assert row.detail == {"duplicate": True, "made_durable": [fact], "pinned": True}
    before, after = content_open(row.before), content_open(row.after)
    assert (before["pinned"], after["pinned"]) == (False, True)
    assert before["fields"].get("expires_at") is not None and after["fields"].get("expires_at") is None
