"""The session event log contract (session2_shared.md): append, dedupe window, recent, tenancy."""

from __future__ import annotations

import pytest

from memories.sessions import (
    session_events_append,
    session_events_recent,
    session_item_hash,
    session_item_hashes_recent,
)

pytestmark = pytest.mark.django_db


def msg(role: str, content: str, **extra) -> dict:
    return {"type": "message", "role": role, "content": content, **extra}


def test_append_and_recent_oldest_first(alice_scope):
    items = [msg("user", "hi"), msg("assistant", "hello"), {"type": "function_call", "name": "f", "arguments": "{}"}]
    assert session_events_append(alice_scope, session_id="s1", items=items, turn_id="t1") == 3
    assert session_events_append(alice_scope, session_id="s1", items=[msg("user", "again")]) == 1
    assert session_events_recent(alice_scope, session_id="s1", limit=10) == [*items, msg("user", "again")]
    assert session_events_recent(alice_scope, session_id="s1", limit=2) == [items[2], msg("user", "again")]
    assert session_events_recent(alice_scope, session_id="s1", limit=0) == []


def test_project_and_session_narrow(alice_scope):
    session_events_append(alice_scope, session_id="s1", project="p1", items=[msg("user", "in p1")])
    session_events_append(alice_scope, session_id="s1", items=[msg("user", "no project")])
    session_events_append(alice_scope, session_id="s2", project="p1", items=[msg("user", "other session")])
    assert session_events_recent(alice_scope, session_id="s1", project="p1", limit=5) == [msg("user", "in p1")]
    assert session_events_recent(alice_scope, session_id="s1", limit=5) == [msg("user", "no project")]


def test_dedupe_window(alice_scope):
    session_events_append(alice_scope, session_id="s", items=[msg("user", "a"), msg("assistant", "b")])
    # "a" is within the last 2 items -> skipped; a repeat inside the same call is skipped too.
    stored = session_events_append(
        alice_scope, session_id="s", items=[msg("user", "a"), msg("user", "c"), msg("user", "c")], dedupe_window=2
    )
    assert stored == 1
    # Outside the window (last 1 is "c"): "a" is stored again. Key order never matters.
    assert (
        session_events_append(
            alice_scope, session_id="s", items=[{"content": "a", "role": "user", "type": "message"}], dedupe_window=1
        )
        == 1
    )
    # Same content, different role or metadata: a different item.
    assert session_events_append(alice_scope, session_id="s", items=[msg("assistant", "a")], dedupe_window=5) == 1
    assert (
        session_events_append(
            alice_scope, session_id="s", items=[msg("assistant", "a", metadata={"k": 1})], dedupe_window=5
        )
        == 1
    )
    # Without a window everything is stored.
    assert session_events_append(alice_scope, session_id="s", items=[msg("user", "a"), msg("user", "a")]) == 2


def test_tenancy_bob_never_sees_alices_session(alice_scope, bob_scope):
    session_events_append(alice_scope, session_id="shared-name", items=[msg("user", "alice's secret")])
    assert session_events_recent(bob_scope, session_id="shared-name", limit=10) == []
    # Bob's dedupe window does not look at alice's items either.
    assert (
        session_events_append(
            bob_scope, session_id="shared-name", items=[msg("user", "alice's secret")], dedupe_window=5
        )
        == 1
    )
    assert session_events_recent(alice_scope, session_id="shared-name", limit=10) == [msg("user", "alice's secret")]
    assert session_events_recent(bob_scope, session_id="shared-name", limit=10) == [msg("user", "alice's secret")]


def test_recent_hashes_are_the_recent_items_hashes(alice_scope, bob_scope):
    """The two recent reads are one query on two columns: same rows, same order, same
    narrowing by project and session, and another user's log never read."""
    session_events_append(alice_scope, session_id="s", items=[msg("user", f"m{n}") for n in range(4)])
    session_events_append(alice_scope, session_id="s", project="p", items=[msg("user", "in p")])
    session_events_append(bob_scope, session_id="s", items=[msg("user", "bob's")])
    for project in ("", "p"):
        for limit in (0, 2, 10):
            items = session_events_recent(alice_scope, session_id="s", project=project, limit=limit)
            hashes = session_item_hashes_recent(alice_scope, session_id="s", project=project, limit=limit)
            assert hashes == [session_item_hash(item) for item in items]
    assert session_item_hashes_recent(alice_scope, session_id="s", limit=2) == [
        session_item_hash(msg("user", "m2")),
        session_item_hash(msg("user", "m3")),
    ]
    assert session_item_hashes_recent(bob_scope, session_id="s", limit=10) == [session_item_hash(msg("user", "bob's"))]
