"""Seed 002 §4.4, `memory_list_dir_with_abstract` (review 30): every depth lists the
directories down to it with their abstracts, a small `limit` reads little however many
sessions there are (archives counted in SQL, never loaded), the fact tiers sit where no
session name can reach, and another user's sessions never show."""

from __future__ import annotations

import re

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from memories.models import SessionArchive, SessionState
from memories.sessions import session_events_append
from tests.test_turns import run, turn

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("clean_vectors")]

RFC3339_UTC = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")


def tree(user, **arguments) -> list[dict]:
    return run(user, "memory_list_dir_with_abstract", **arguments)["summaries"]


def paths(user, **arguments) -> list[str]:
    return [e["path"] for e in tree(user, **arguments)]


def test_each_depth_lists_the_directories_down_to_it(alice):
    turn(alice, "s1", "t1", "I prefer tea.")
    run(alice, "memory_run_maintenance", session_id="s1")
    assert paths(alice, depth=0) == ["/"]
    assert paths(alice, depth=1) == ["/", "/memory", "/memory_tiers"]
    assert paths(alice, depth=2) == [
        "/", "/memory", "/memory/s1",
        "/memory_tiers", "/memory_tiers/l1", "/memory_tiers/l2", "/memory_tiers/long_term",
    ]  # fmt: skip
    assert paths(alice, depth=3) == [
        "/", "/memory", "/memory/s1", "/memory/s1/meta", "/memory/s1/events", "/memory/s1/archives",
        "/memory_tiers", "/memory_tiers/l1", "/memory_tiers/l2", "/memory_tiers/long_term",
    ]  # fmt: skip
    # From a directory: depth counts from it, and depth 0 is the directory itself.
    assert paths(alice, path="/memory", depth=0) == ["/memory"]
    assert paths(alice, path="/memory", depth=1) == ["/memory", "/memory/s1"]
    assert paths(alice, path="/memory/s1/", depth=1) == [
        "/memory/s1", "/memory/s1/meta", "/memory/s1/events", "/memory/s1/archives",
    ]  # fmt: skip
    assert paths(alice, path="/memory/s1/meta") == ["/memory/s1/meta"]
    assert paths(alice, path="/memory/none-such") == [] and paths(alice, path="/elsewhere") == []
    entries = {e["path"]: e for e in tree(alice)}
    assert "1 session" in entries["/"]["abstract"] and "1 live fact" in entries["/"]["abstract"]
    assert entries["/memory"]["abstract"].startswith("1 session,")
    session = entries["/memory/s1"]
    assert session["abstract"].startswith("Session s1: 2 raw events, 0 archives") and session["has_overview"]
    assert entries["/memory_tiers"]["abstract"] == "1 live fact by tier: l1 0, l2 0, long_term 1."
    assert entries["/memory_tiers/long_term"]["abstract"] == "1 facts"
    # §4.4's shape: these four fields, updated_at in RFC 3339 UTC to the second (or null).
    for entry in entries.values():
        assert set(entry) == {"path", "abstract", "updated_at", "has_overview"}
        assert entry["updated_at"] is None or RFC3339_UTC.match(entry["updated_at"]), entry
    assert entries["/memory/s1/meta"]["updated_at"] and entries["/memory_tiers/long_term"]["updated_at"]


def test_archives_are_directories_and_counted_without_their_items(alice, alice_scope):
    uid = alice_scope.engine_user_id
    SessionState.objects.create(engine_user_id=uid, session_id="s")
    SessionArchive.objects.bulk_create(
        [
            SessionArchive(engine_user_id=uid, session_id="s", first_event_id=1, last_event_id=9, items=[{}] * 3),
            SessionArchive(engine_user_id=uid, session_id="s", first_event_id=10, last_event_id=12, items=[{}] * 2),
        ]
    )
    entries = {e["path"]: e for e in tree(alice, path="/memory/s/archives")}
    assert list(entries) == ["/memory/s/archives", "/memory/s/archives/1-9", "/memory/s/archives/10-12"]
    assert entries["/memory/s/archives"]["abstract"].startswith("2 archives of 5 compacted events")
    assert entries["/memory/s/archives/1-9"]["abstract"].startswith("3 archived events.")
    assert paths(alice, path="/memory/s/archives/10-12", limit=1) == ["/memory/s/archives/10-12"]


def test_a_small_limit_reads_little_however_many_sessions(alice, alice_scope):
    uid = alice_scope.engine_user_id

    def sessions(first: int, count: int) -> None:
        SessionState.objects.bulk_create(
            [SessionState(engine_user_id=uid, session_id=f"s{n:03}") for n in range(first, first + count)]
        )
        SessionArchive.objects.bulk_create(
            [
                SessionArchive(
                    engine_user_id=uid,
                    session_id=f"s{n:03}",
                    first_event_id=n,
                    last_event_id=n,
                    items=[{"x": "y" * 1000}] * 200,
                )
                for n in range(first, first + count)
            ]
        )

    def listing(**arguments) -> tuple[list[str], list[str]]:
        with CaptureQueriesContext(connection) as captured:
            listed = paths(alice, **arguments)
        return listed, [q["sql"] for q in captured.captured_queries]

    sessions(0, 3)
    few_one, few_one_sql = listing(limit=1)
    few_all, few_all_sql = listing(limit=1000)
    assert few_one == ["/"] and "/memory/s002/archives/2-2" in few_all
    sessions(3, 57)
    many_one, many_one_sql = listing(limit=1)
    many_all, many_all_sql = listing(limit=1000)
    assert many_one == ["/"] and "/memory/s059/archives/59-59" in many_all
    # The same statements for 3 sessions or 60, whether it lists one entry or all of them.
    assert len(many_one_sql) == len(few_one_sql) and len(many_all_sql) == len(few_all_sql)
    # A first call with a `path` makes the user's audit key (its arguments are sealed), once:
    # not counted below, where the whole tree (one statement for all tiers) is the bound.
    listing(path="/memory", limit=1)
    some, some_sql = listing(path="/memory", limit=7)
    assert some == ["/memory", "/memory/s000", "/memory/s000/meta", "/memory/s000/events", "/memory/s000/archives"] + [
        "/memory/s000/archives/0-0",
        "/memory/s001",
    ]
    assert len(some_sql) <= len(many_all_sql)
    # An archive's items are never read into Python: only counted in the database.
    items = re.compile(r'"memories_sessionarchive"\."items"')
    for sql in many_all_sql + some_sql:
        for found in items.finditer(sql):
            assert sql[: found.start()].endswith("jsonb_array_length("), sql
    assert any("jsonb_array_length" in sql for sql in many_all_sql)


def test_a_session_named_tiers_or_with_a_slash_is_its_own_directory(alice, alice_scope):
    turn(alice, "tiers", "t1", "I prefer tea.")
    # The chat proxy's sessions take any printable name.
    session_events_append(alice_scope, session_id="memory_tiers/l1", items=[{"role": "user", "content": "hi"}])
    assert paths(alice, path="/memory/tiers", depth=1) == [
        "/memory/tiers", "/memory/tiers/meta", "/memory/tiers/events", "/memory/tiers/archives",
    ]  # fmt: skip
    assert paths(alice, path="/memory", depth=1) == ["/memory", "/memory/memory_tiers%2Fl1", "/memory/tiers"]
    assert paths(alice, path="/memory/memory_tiers%2Fl1/events") == ["/memory/memory_tiers%2Fl1/events"]
    tiers = {e["path"]: e["abstract"] for e in tree(alice, path="/memory_tiers")}
    assert list(tiers) == ["/memory_tiers", "/memory_tiers/l1", "/memory_tiers/l2", "/memory_tiers/long_term"]
    assert tiers["/memory_tiers/long_term"] == "1 facts" and tiers["/memory_tiers/l1"] == "0 facts"


def test_another_users_sessions_never_show(alice, bob, bob_scope):
    turn(alice, "shared", "t1", "I prefer tea.", project="p")
    turn(alice, "alices", "t1", "My favourite editor is Helix.", project="p")
    SessionState.objects.create(engine_user_id=bob_scope.engine_user_id, project="p", session_id="bobs")
    for arguments in ({}, {"session_id": "shared"}, {"path": "/memory/shared"}, {"path": "/memory/alices/meta"}):
        listed = tree(bob, project="p", **arguments)
        assert not any("shared" in e["path"] or "alices" in e["path"] for e in listed), arguments
        assert not any("tea" in e["abstract"] or "Helix" in e["abstract"] for e in listed), arguments
    entries = {e["path"]: e["abstract"] for e in tree(bob, project="p")}
    assert [p for p in entries if p.startswith("/memory/")] == ["/memory/bobs", "/memory/bobs/meta"] + [
        "/memory/bobs/events",
        "/memory/bobs/archives",
    ]
    assert entries["/memory"].startswith("1 session,") and entries["/memory_tiers/long_term"] == "0 facts"
    assert "2 sessions" in tree(alice, project="p", depth=0)[0]["abstract"]
