"""The web UI shows a session's raw log (what the agent or the chat proxy kept of the
conversation), in order and paged, to its owner only: another user's session, with the
same id or not, is a 404 like an unknown one."""

from __future__ import annotations

import json
import re

import pytest
from django.db import transaction

from memories import sessions
from memories.interfaces import downloads
from memories.interfaces.web import sessions as web_sessions
from memories.models import SessionArchive
from tests.conftest import asgi_post, lines_counted

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]


def log(scope, session_id: str, items: list[dict], *, project: str = "") -> None:
    with transaction.atomic():
        sessions.session_events_append(scope, session_id=session_id, project=project, items=items, turn_id="t-1")


def link_of(page: str) -> str:
    return re.search(r'href="(/sessions/log/[^"]+)"', page).group(1).replace("&amp;", "&")


def test_the_owner_reads_the_log_in_order_from_the_sessions_page(alice, alice_scope, bob_scope, client):
    log(
        alice_scope,
        "trip/planning",
        [
            {"type": "message", "role": "user", "content": "I fly to Lisbon on <b>Friday</b>"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Noted: Friday."}]},
            {"type": "function_call", "name": "book", "arguments": '{"city": "Lisbon"}', "call_id": "c1"},
            {"type": "function_call_output", "call_id": "c1", "output": "booked-ok"},
        ],
        project="travel",
    )
    log(
        bob_scope,
        "trip/planning",
        [{"type": "message", "role": "user", "content": "bob-secret-plan"}],
        project="travel",
    )
    client.force_login(alice)
    page = client.get(link_of(client.get("/sessions/").content.decode())).content.decode()
    assert "travel / trip/planning" in page
    texts = [
        "I fly to Lisbon on &lt;b&gt;Friday&lt;/b&gt;",
        "Noted: Friday.",
        "book({&quot;city&quot;: &quot;Lisbon&quot;})",
        "booked-ok",
    ]
    positions = [page.index(text) for text in texts]
    assert positions == sorted(positions)  # oldest first, escaped
    assert "bob-secret-plan" not in page
    assert "Delete all 4 raw events" in page
    assert "archive" not in page
    SessionArchive.objects.create(
        engine_user_id=alice_scope.engine_user_id,
        project="travel",
        session_id="trip/planning",
        first_event_id=1,
        last_event_id=2,
        items=[],
    )
    again = client.get(link_of(client.get("/sessions/").content.decode())).content.decode()
    assert "compacted by maintenance into 1 archive:" in again


def test_another_users_session_is_a_404_like_an_unknown_one(alice, bob_scope, client):
    log(bob_scope, "bobs-session", [{"type": "message", "role": "user", "content": "bob-secret"}])
    client.force_login(alice)
    for query in (
        "session_id=bobs-session",
        "session_id=nobody-has-this",
        "session_id=bobs-session&project=x",
        "",
        "session_id=" + "s" * 129,
        "session_id=s&project=" + "p" * 129,
        "session_id=%00",  # text the database cannot compare: as unknown, not a 500
        "session_id=bobs-session&project=%00",
    ):
        for page in ("/sessions/log/", "/sessions/log/archives/"):
            response = client.get(f"{page}?{query}")
            assert response.status_code == 404, (page, query)
            assert "bob-secret" not in response.content.decode()
    client.logout()
    assert client.get("/sessions/log/?session_id=bobs-session").status_code == 302


def test_a_long_log_pages_and_the_links_keep_the_session(alice, alice_scope, client, monkeypatch):
    monkeypatch.setattr(web_sessions, "SESSION_ITEMS_PAGE_SIZE", 3)
    log(alice_scope, "a b&c", [{"type": "message", "role": "user", "content": f"line-{n}-"} for n in range(7)])
    client.force_login(alice)
    first = client.get("/sessions/log/", {"session_id": "a b&c"}).content.decode()
    assert "Showing 3 of 7 raw events" in first and "line-0-" in first and "line-3-" not in first
    following = re.search(r'rel="next" href="([^"]+)"', first).group(1).replace("&amp;", "&")
    second = client.get(f"/sessions/log/{following}").content.decode()
    assert "line-3-" in second and "line-5-" in second and "line-2-" not in second


def test_your_data_streams_every_session_log_of_mine_only(alice, alice_scope, bob_scope, client):
    from audit.models import AuditEvent
    from billing.models import UsageEvent

    log(alice_scope, "s1", [{"type": "message", "role": "user", "content": f"alice-{n}"} for n in range(3)])
    log(alice_scope, "s2", [{"type": "message", "role": "user", "content": "alice-other"}], project="p")
    SessionArchive.objects.create(
        engine_user_id=alice_scope.engine_user_id,
        session_id="s1",
        first_event_id=1,
        last_event_id=2,
        items=[{"type": "message", "role": "user", "content": "alice-archived"}],
    )
    log(bob_scope, "s1", [{"type": "message", "role": "user", "content": "bob-secret"}])
    billed = UsageEvent.objects.count()
    client.force_login(alice)
    assert "/data/export/session-logs/" in client.get("/data/").content.decode()
    response = client.post("/data/export/session-logs/")
    assert response.status_code == 200 and "attachment" in response["Content-Disposition"]
    body = b"".join(response.streaming_content).decode()
    lines = [json.loads(line) for line in body.splitlines()]
    header, rest = lines[0], lines[1:]
    assert header["format"] == "memsite.session_logs" and (
        header["sessions"],
        header["events"],
        header["archives"],
    ) == (2, 4, 1)
    assert [line["session"]["session_id"] for line in rest if "session" in line] == ["s1", "s2"]
    assert [line["event"]["item"]["content"] for line in rest if "event" in line] == [
        "alice-0",
        "alice-1",
        "alice-2",
        "alice-other",
    ]
    assert [line["archive"]["items"][0]["content"] for line in rest if "archive" in line] == ["alice-archived"]
    assert "bob-secret" not in body
    row = AuditEvent.objects.get(operation="export_session_logs")
    assert row.actor_user_id == alice.pk
    assert row.detail == {"sessions": 2, "events": 4, "archives": 1, "pending_inputs": 0, "turns": 0}
    assert UsageEvent.objects.count() == billed
    client.logout()
    assert client.post("/data/export/session-logs/").status_code == 302


def test_the_download_streams_under_asgi_without_reading_it_all_first(
    alice, alice_scope, bob_scope, client, monkeypatch
):
    """Django reads a sync streaming iterator whole before sending under ASGI; the download
    is sent in batches as its lines are read, on the request's own database connection."""
    monkeypatch.setattr(downloads, "DOWNLOAD_BATCH_LINES", 40)
    for n in range(4):
        log(alice_scope, f"s{n}", [{"type": "message", "role": "user", "content": f"alice-{n}-{i}"} for i in range(50)])
    log(bob_scope, "s0", [{"type": "message", "role": "user", "content": "bob-secret"}])
    produced = lines_counted(monkeypatch, web_sessions, "session_logs_export")
    client.force_login(alice)
    status, body, sent_at = asgi_post(
        "/data/export/session-logs/", {}, session=client.cookies["sessionid"].value, produced=produced
    )
    lines = [json.loads(line) for line in body.decode().splitlines()]
    assert status == 200 and len(lines) == 1 + 4 + 200 == len(produced)
    assert (lines[0]["sessions"], lines[0]["events"]) == (4, 200) and b"bob-secret" not in body
    assert [line["event"]["item"]["content"] for line in lines if "event" in line][:2] == ["alice-0-0", "alice-0-1"]
    assert sent_at[0] <= 40 < len(produced) and len(sent_at) >= len(produced) // 40


def test_the_download_is_rate_limited_and_a_refusal_is_audited(alice, alice_scope, client, settings):
    from audit.models import AuditEvent

    settings.RATE_LIMITS = {**settings.RATE_LIMITS, "export_session_logs": (1, 60)}
    log(alice_scope, "s1", [{"type": "message", "role": "user", "content": "hello"}])
    client.force_login(alice)
    assert client.post("/data/export/session-logs/").status_code == 200
    refused = client.post("/data/export/session-logs/", follow=True)
    assert (
        refused.redirect_chain[-1][0] == "/data/" and "Too many export_session_logs calls" in refused.content.decode()
    )
    rows = AuditEvent.objects.filter(operation="export_session_logs").order_by("id")
    assert [(r.outcome, r.error_code) for r in rows] == [("ok", ""), ("error", "rate_limited")]


def test_archived_runs_are_readable_oldest_first_and_only_by_their_owner(
    alice, alice_scope, bob, bob_scope, client, monkeypatch
):
    monkeypatch.setattr(web_sessions, "SESSION_ARCHIVES_PAGE_SIZE", 2)
    log(alice_scope, "long", [{"type": "message", "role": "user", "content": "still-raw"}])
    for n in range(3):
        SessionArchive.objects.create(
            engine_user_id=alice_scope.engine_user_id,
            session_id="long",
            first_event_id=100 * n + 1,
            last_event_id=100 * n + 2,
            items=[
                {"type": "message", "role": "user", "content": f"archived-{n}-a"},
                {"type": "function_call", "name": "lookup", "arguments": f'{{"n": {n}}}'},
            ],
        )
    log(bob_scope, "bobs", [{"type": "message", "role": "user", "content": "x"}])
    SessionArchive.objects.create(
        engine_user_id=bob_scope.engine_user_id,
        session_id="bobs",
        first_event_id=1,
        last_event_id=1,
        items=[{"type": "message", "role": "user", "content": "bob-archived-secret"}],
    )
    client.force_login(alice)
    raw = client.get("/sessions/log/", {"session_id": "long"}).content.decode()
    assert "compacted by maintenance into 3 archives:" in raw and "archived-0-a" not in raw
    archives_link = re.search(r'href="(/sessions/log/archives/[^"]+)"', raw).group(1).replace("&amp;", "&")
    first = client.get(archives_link).content.decode()
    assert "Showing 2 of 3 archived runs" in first
    assert first.index("archived-0-a") < first.index("archived-1-a") and "archived-2-a" not in first
    assert "lookup({&quot;n&quot;: 0})" in first and "A run of 2 events" in first
    following = re.search(r'rel="next" href="([^"]+)"', first).group(1).replace("&amp;", "&")
    second = client.get(f"/sessions/log/archives/{following}").content.decode()
    assert "archived-2-a" in second and "archived-1-a" not in second
    for query in ("session_id=bobs", "session_id=nobody", ""):
        response = client.get(f"/sessions/log/archives/?{query}")
        assert response.status_code == 404 and "bob-archived-secret" not in response.content.decode()


def test_the_download_is_one_snapshot_its_counts_exactly_its_lines(alice_scope):
    """An agent writing to a session while the log is downloaded: the header's counts are
    always the lines that follow, so a short file is told from a complete one."""
    from tests.conftest import elsewhere, internal_call

    log(alice_scope, "s1", [{"type": "message", "role": "user", "content": f"alice-{n}"} for n in range(3)])
    lines = sessions.session_logs_export(alice_scope, call=internal_call())
    header = json.loads(next(lines))  # the snapshot starts here
    elsewhere(lambda: log(alice_scope, "s1", [{"type": "message", "role": "user", "content": "written meanwhile"}]))
    elsewhere(lambda: log(alice_scope, "s2", [{"type": "message", "role": "user", "content": "a new session"}]))
    rest = [json.loads(line) for line in lines]
    assert (header["sessions"], header["events"]) == (1, 3)
    assert len([r for r in rest if "event" in r]) == 3 and len([r for r in rest if "session" in r]) == 1
