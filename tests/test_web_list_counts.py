"""The counts the web UI's list pages show cost the same however much the user has: the
Sessions page counts every shown session's events and archives in one statement each (it
ran two per session), the Trash page counts over the trash alone (it grouped every row
of the user, and loaded a call's whole group to count it), and Activity counts calls up
to a cap and says "more than" past it."""

from __future__ import annotations

import re

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from memories.interfaces.web import views as web
from tests.test_web_keyset_paging import _call, _log, run

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]


def _statements(client, url: str) -> tuple[int, str]:
    with CaptureQueriesContext(connection) as queries:
        response = client.get(url)
    assert response.status_code == 200
    return len(queries), response.content.decode()


def test_the_sessions_page_costs_the_same_statements_for_3_sessions_as_for_15(alice, alice_scope, bob_scope, client):
    for n in range(3):
        _log(alice_scope, f"sess-{n}", [f"hello {n}"] * (n + 1))
    _log(bob_scope, "sess-1", ["bob's own session of the same name"] * 5)
    client.force_login(alice)
    few, page = _statements(client, "/sessions/")
    counts = dict(re.findall(r"<h2>(sess-\d+)</h2>.*?· (\d+) raw events", page, re.S))
    assert counts == {"sess-0": "1", "sess-1": "2", "sess-2": "3"}  # never bob's 5

    for n in range(3, 15):
        _log(alice_scope, f"sess-{n}", ["more"])
    many, page = _statements(client, "/sessions/")
    assert len(re.findall(r"<h2>sess-\d+</h2>", page)) == 15
    assert many == few


def test_the_trash_counts_read_only_the_trash(alice, bob, client, monkeypatch):
    monkeypatch.setattr(web, "TRASH_PAGE_SIZE", 2)
    for n in range(3):
        run(alice, "remember", memory=f"Kept fact {n}")
    for n in range(3):
        run(alice, "remember", memory=f"Trash count fact {n}", tags=["old"])
    run(alice, "delete_memory", tags=["old"], confirm=True)  # one call's group of three, over two pages
    run(bob, "delete_memory", memory_id=run(bob, "remember", memory="Bob's trashed fact")["id"])
    client.force_login(alice)
    with CaptureQueriesContext(connection) as queries:
        page = client.get("/trash/").content.decode()
    assert "Empty trash (3)" in page and "Restore all 3" in page  # the whole group, not bob's
    counts = [q["sql"] for q in queries if "count(" in q["sql"].lower() and "trash" in q["sql"].lower()]
    assert counts, "the trash is counted"
    for statement in counts:
        assert "trashed" in statement and "GROUP BY" not in statement.upper(), statement


def test_activity_counts_calls_up_to_a_cap_and_says_more_than_past_it(alice, bob, client, monkeypatch):
    monkeypatch.setattr(web, "ACTIVITY_LIMIT", 2)
    monkeypatch.setattr(web, "ACTIVITY_COUNT_CAP", 4)
    for n in range(4):
        _call(alice, f"app-{n}")
        _call(bob, f"app-{100 + n}")
    client.force_login(alice)
    assert "Showing 2 of 4" in client.get("/activity/").content.decode()  # at the cap: exact

    _call(alice, "app-4")
    page = client.get("/activity/").content.decode()
    assert "Showing 2 of more than 4" in page
