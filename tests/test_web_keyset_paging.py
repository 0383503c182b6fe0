"""The web UI's lists page by position (a keyset cursor), not by row number: calls recorded,
rows added or deleted while someone pages through a list neither repeat nor skip a row on
the next page; a garbage, tampered or foreign cursor is a 400 that shows the first page;
another user's rows never appear, whatever the cursor says."""

from __future__ import annotations

import base64
import html
import re
from collections.abc import Callable

import pytest
from django.utils.http import urlencode

from audit.models import AuditEvent
from core.scope import MemoryScope
from memories.auth import Principal
from memories.interfaces.web import views as web
from memories.operations import operation_execute
from tests.conftest import internal_call
from tests.test_bad_input import BAD_CURSORS

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]

MAX_PAGES = 12  # a pager that never ends (the old one past a count that changed) fails, not hangs


def link(page: str, rel: str) -> str | None:
    found = re.search(rf'rel="{rel}" href="([^"]+)"', page)
    return html.unescape(found.group(1)) if found else None


def walk(client, url: str, pattern: str, *, between: Callable[[list[str]], None] | None = None) -> list[list[str]]:
    """The markers (`pattern`'s group) each page shows, from `url` through its "next"
    links; `between(markers)` changes the list after a page is read, before the next is."""
    path, pages = url.split("?")[0], []
    while url and len(pages) < MAX_PAGES:
        response = client.get(url)
        assert response.status_code == 200, url
        page = response.content.decode()
        pages.append(re.findall(pattern, page))
        if between is not None:
            between(pages[-1])
        following = link(page, "next")
        url = path + following if following else None
    return pages


def with_cursor(url: str, cursor: str) -> str:
    return url + ("&" if "?" in url else "?") + urlencode({"cursor": cursor})


def flat(pages: list[list[str]]) -> list[str]:
    return [marker for page in pages for marker in page]


def assert_bad_cursors_show_the_first_page(client, path: str, first_page: list[str], pattern: str, *, real: str):
    """Garbage, a damaged real cursor, the API's cursors: 400 with the message, first page."""
    tampered = real[:10] + ("A" if real[10] != "A" else "B") + real[11:]
    for cursor in [tampered, "garbage", real + "x", *[c for c in BAD_CURSORS if "\x00" not in c]]:
        response = client.get(with_cursor(path, cursor))
        page = response.content.decode()
        assert response.status_code == 400, cursor
        assert "cursor is not one this server issued: showing the first page." in page
        assert re.findall(pattern, page) == first_page, cursor


# --- Activity ---------------------------------------------------------------------------------
APP = r"you \((app-\d+)\)"


def _call(user, app: str) -> None:
    AuditEvent.objects.create(
        request_id="r", channel="mcp", operation="remember", outcome="ok", actor_user_id=user.pk,
        actor_username=user.username, actor_client_app=app, tenant=MemoryScope.for_user(user).tenant,
        subject_user_id=user.pk,
    )  # fmt: skip


def test_activity_pages_neither_repeat_nor_skip_calls_recorded_meanwhile(alice, bob, client, monkeypatch):
    """An agent working while the user reads page 2 used to push page 1's rows onto it."""
    monkeypatch.setattr(web, "ACTIVITY_LIMIT", 3)
    for n in range(8):
        _call(alice, f"app-{n}")
        _call(bob, f"app-{100 + n}")  # bob's ids between alice's: never shown to her
    client.force_login(alice)
    newest_first = [f"app-{n}" for n in reversed(range(8))]

    pages = walk(client, "/activity/", APP, between=lambda shown: _call(alice, f"app-new-{shown[0]}"))
    assert flat(pages) == newest_first  # each once, in order; the calls made meanwhile are newer
    assert [len(page) for page in pages] == [3, 3, 2]


def test_activity_links_back_to_the_rows_before_and_bad_cursors_show_the_first_page(alice, bob, client, monkeypatch):
    monkeypatch.setattr(web, "ACTIVITY_LIMIT", 3)
    for n in range(7):
        _call(alice, f"app-{n}")
    client.force_login(alice)
    first = client.get("/activity/").content.decode()
    assert re.findall(APP, first) == ["app-6", "app-5", "app-4"] and link(first, "prev") is None
    assert "Showing 3 of 7 calls" in first and ">Older<" in first
    second = client.get("/activity/" + link(first, "next")).content.decode()
    assert re.findall(APP, second) == ["app-3", "app-2", "app-1"]
    _call(alice, "app-70")
    back = client.get("/activity/" + link(second, "prev")).content.decode()
    assert re.findall(APP, back) == ["app-6", "app-5", "app-4"]  # the rows before, not the newest
    assert ">Newer<" in back  # app-70 is newer still

    # Imported in the tests that need it, so that the others also run (and fail) on the
    # pages by row number that came before.
    from memories.cursors import position_encode

    real = link(first, "next").split("cursor=")[1]
    assert_bad_cursors_show_the_first_page(client, "/activity/", ["app-70", "app-6", "app-5"], APP, real=real)
    # A cursor of another list, or one issued to another user, does not open.
    alices_trash = position_encode(["after", "2026-01-01T00:00:00+00:00", "5b3a3c1e-1111-4444-8888-123456789abc"],
                                   bound_to=f"{alice.pk}:trash")  # fmt: skip
    assert client.get("/activity/", {"cursor": alices_trash}).status_code == 400
    client.force_login(bob)
    response = client.get("/activity/", {"cursor": real})
    assert response.status_code == 400 and "app-" not in response.content.decode()


def test_a_cursor_is_only_a_position_the_rows_are_the_signed_in_users(alice, bob, client, monkeypatch):
    """Even a cursor sealed for her (a forged position) only says where to start: she
    sees her own rows after it, never bob's."""
    from memories.cursors import position_encode

    monkeypatch.setattr(web, "ACTIVITY_LIMIT", 3)
    for n in range(4):
        _call(bob, f"app-{100 + n}")
        _call(alice, f"app-{n}")
    top = AuditEvent.objects.order_by("-id").values_list("id", flat=True).first()
    forged = position_encode(["after", top + 1], bound_to=f"{alice.pk}:activity")
    client.force_login(alice)
    page = client.get("/activity/", {"cursor": forged}).content.decode()
    assert re.findall(APP, page) == ["app-3", "app-2", "app-1"]
    pages = walk(client, "/activity/?by=services", r"(app-\d+)")
    assert flat(pages) == []  # bob acted on his own memories, not for her


def run(user, name: str, **arguments) -> dict:
    principal = Principal(user=user, method="api_key", client_app="paging-agent")
    return operation_execute(principal, name, arguments, call=internal_call())


# --- Trash ------------------------------------------------------------------------------------
TRASHED = r"Trash paging fact (\d+)"


def test_trash_pages_neither_repeat_nor_skip_while_memories_are_deleted_and_restored(alice, bob, client, monkeypatch):
    monkeypatch.setattr(web, "TRASH_PAGE_SIZE", 2)
    ids = {}
    for n in range(7):
        ids[str(n)] = run(alice, "remember", memory=f"Trash paging fact {n}")["id"]
        run(alice, "delete_memory", memory_id=ids[str(n)])  # a group of one each, in order
        run(bob, "delete_memory", memory_id=run(bob, "remember", memory=f"Trash paging fact {100 + n}")["id"])
    client.force_login(alice)
    newest_first = [str(n) for n in reversed(range(7))]
    assert flat(walk(client, "/trash/", TRASHED)) == newest_first  # never bob's

    def trash_another(shown: list[str]) -> None:
        memory_id = run(alice, "remember", memory=f"Trash paging fact {50 + int(shown[0])}")["id"]
        run(alice, "delete_memory", memory_id=memory_id)

    assert flat(walk(client, "/trash/", TRASHED, between=trash_another)) == newest_first
    newest_first = flat(walk(client, "/trash/", TRASHED))  # with the three trashed meanwhile

    def restore_one_shown(shown: list[str]) -> None:
        run(alice, "restore_memory", memory_id=ids.get(shown[0]) or _trashed_id(alice, shown[0]))

    assert flat(walk(client, "/trash/", TRASHED, between=restore_one_shown)) == newest_first


def _trashed_id(user, marker: str) -> str:
    from memories.selectors import memory_trash_list

    (found,) = [t for t in memory_trash_list(MemoryScope.for_user(user)) if t.memory.memory.endswith(f" {marker}")]
    return found.memory.id


def test_trash_bad_cursors_show_the_first_page(alice, client, monkeypatch):
    monkeypatch.setattr(web, "TRASH_PAGE_SIZE", 2)
    for n in range(3):
        run(alice, "delete_memory", memory_id=run(alice, "remember", memory=f"Trash paging fact {n}")["id"])
    client.force_login(alice)
    first = client.get("/trash/").content.decode()
    real = link(first, "next").split("cursor=")[1]
    assert re.findall(TRASHED, client.get("/trash/" + link(first, "next")).content.decode()) == ["0"]
    assert_bad_cursors_show_the_first_page(client, "/trash/", ["2", "1"], TRASHED, real=real)


# --- Sessions, a session's raw log, its archives ------------------------------------------------
SESSION = r"<h2>(sess-\d+)</h2>"


def _log(scope, session_id: str, texts: list[str]) -> None:
    from django.db import transaction

    from memories import sessions

    with transaction.atomic():
        items = [{"type": "message", "role": "user", "content": text} for text in texts]
        sessions.session_events_append(scope, session_id=session_id, items=items, turn_id="t-1")


def test_sessions_pages_neither_repeat_nor_skip_while_sessions_start_and_go(
    alice, alice_scope, bob_scope, client, monkeypatch
):
    from memories.interfaces.web import sessions as web_sessions

    monkeypatch.setattr(web_sessions, "SESSIONS_PAGE_SIZE", 2)
    for n in range(7):
        _log(alice_scope, f"sess-{n}", [f"hello {n}"])
        _log(bob_scope, f"sess-{100 + n}", ["bob's"])
    client.force_login(alice)
    newest_first = [f"sess-{n}" for n in reversed(range(7))]
    assert flat(walk(client, "/sessions/", SESSION)) == newest_first

    def new_session(shown: list[str]) -> None:
        _log(alice_scope, f"sess-{50 + int(shown[0][5:])}", ["a new session"])

    assert flat(walk(client, "/sessions/", SESSION, between=new_session)) == newest_first
    newest_first = flat(walk(client, "/sessions/", SESSION))  # with the new ones

    def delete_one_shown(shown: list[str]) -> None:
        client.post("/sessions/delete-events/", {"session_id": shown[0], "project": ""})

    assert flat(walk(client, "/sessions/", SESSION, between=delete_one_shown)) == newest_first

    first = client.get("/sessions/").content.decode()
    real = link(first, "next").split("cursor=")[1]
    assert_bad_cursors_show_the_first_page(client, "/sessions/", re.findall(SESSION, first), SESSION, real=real)


LINE = r"(line-\d+)-"


def test_a_session_log_pages_neither_repeat_nor_skip_while_events_come_and_are_compacted(
    alice, alice_scope, bob, bob_scope, client, monkeypatch
):
    from memories.interfaces.web import sessions as web_sessions
    from memories.models import SessionEvent

    monkeypatch.setattr(web_sessions, "SESSION_ITEMS_PAGE_SIZE", 3)
    for n in range(8):
        _log(alice_scope, "long", [f"line-{n}-"])
        _log(bob_scope, "long", [f"line-{100 + n}-"])  # the same session name, bob's
    client.force_login(alice)
    url = "/sessions/log/?session_id=long&project="
    in_order = [f"line-{n}" for n in range(8)]
    assert flat(walk(client, url, LINE)) == in_order

    def later_event(shown: list[str]) -> None:
        if int(shown[0][5:]) < 8:
            _log(alice_scope, "long", [f"line-{50 + int(shown[0][5:])}-"])

    # Events written meanwhile come after the others, on the last pages.
    assert flat(walk(client, url, LINE, between=later_event)) == [*in_order, "line-50", "line-53", "line-56"]
    in_order = flat(walk(client, url, LINE))

    def compact_the_oldest(shown: list[str]) -> None:  # noqa: ARG001 - maintenance archives the oldest events
        oldest = SessionEvent.objects.filter(engine_user_id=alice_scope.engine_user_id).order_by("id")[:2]
        SessionEvent.objects.filter(id__in=[e.id for e in oldest]).delete()

    assert flat(walk(client, url, LINE, between=compact_the_oldest)) == in_order

    _log(alice_scope, "other", [f"line-{n}-" for n in range(7)])
    url = "/sessions/log/?session_id=other&project="
    first = client.get(url).content.decode()
    assert "Showing 3 of 7 raw events" in first
    assert 'rel="next" href="?session_id=other&amp;project=&amp;cursor=' in first  # the links keep the session
    real = link(first, "next").split("cursor=")[1]
    assert_bad_cursors_show_the_first_page(client, url, ["line-0", "line-1", "line-2"], LINE, real=real)
    client.force_login(bob)
    _log(bob_scope, "other", ["line-100-"])
    response = client.get(with_cursor(url, real))  # bob's own session of that name: her cursor does not open
    assert response.status_code == 400 and re.findall(LINE, response.content.decode()) == ["line-100"]


ARCHIVED = r"(archived-\d+)-a"


def test_a_sessions_archives_page_neither_repeat_nor_skip_while_runs_come_and_go(
    alice, alice_scope, bob_scope, client, monkeypatch
):
    from memories.interfaces.web import sessions as web_sessions
    from memories.models import SessionArchive

    monkeypatch.setattr(web_sessions, "SESSION_ARCHIVES_PAGE_SIZE", 2)
    _log(alice_scope, "long", ["still-raw"])
    _log(bob_scope, "long", ["bob-raw"])

    def archive(scope, n: int) -> None:
        SessionArchive.objects.create(
            engine_user_id=scope.engine_user_id, session_id="long", first_event_id=100 * n + 1,
            last_event_id=100 * n + 2, items=[{"type": "message", "role": "user", "content": f"archived-{n}-a"}],
        )  # fmt: skip

    for n in range(6):
        archive(alice_scope, n)
        archive(bob_scope, 50 + n)
    client.force_login(alice)
    url = "/sessions/log/archives/?session_id=long&project="
    in_order = [f"archived-{n}" for n in range(6)]
    assert flat(walk(client, url, ARCHIVED)) == in_order

    def compacted_later(shown: list[str]) -> None:
        if int(shown[0][9:]) < 6:
            archive(alice_scope, 20 + int(shown[0][9:]))

    assert flat(walk(client, url, ARCHIVED, between=compacted_later)) == [
        *in_order,
        "archived-20",
        "archived-22",
        "archived-24",
    ]
    in_order = flat(walk(client, url, ARCHIVED))

    def delete_one_shown(shown: list[str]) -> None:
        SessionArchive.objects.filter(items__0__content=f"{shown[0]}-a").delete()

    assert flat(walk(client, url, ARCHIVED, between=delete_one_shown)) == in_order

    first = client.get(url).content.decode()
    real = link(first, "next").split("cursor=")[1]
    assert_bad_cursors_show_the_first_page(client, url, re.findall(ARCHIVED, first), ARCHIVED, real=real)


# --- Decisions, cached answers ------------------------------------------------------------------
DECISION = r"<code>(pref_\d+)</code>"


def test_decisions_pages_neither_repeat_nor_skip_while_decisions_are_stored_and_deleted(
    alice, bob, client, settings, monkeypatch
):
    from memories.interfaces.web import toolkit_views

    monkeypatch.setattr(toolkit_views, "DECISIONS_PAGE_SIZE", 2)
    settings.RATE_LIMITS = {**settings.RATE_LIMITS, "store_decision": (0, 60)}
    for n in range(10, 17):
        run(alice, "store_decision", key=f"pref_{n:04d}", value=f"value {n}")
        run(bob, "store_decision", key=f"pref_{n + 100:04d}", value="bob's")
    client.force_login(alice)
    by_key = [f"pref_{n:04d}" for n in range(10, 17)]
    assert flat(walk(client, "/decisions/", DECISION)) == by_key

    def store_one_before(shown: list[str]) -> None:  # a key that sorts before the page read
        run(alice, "store_decision", key=f"pref_{int(shown[0][5:]) - 10:04d}", value="new")

    assert flat(walk(client, "/decisions/", DECISION, between=store_one_before)) == by_key
    by_key = flat(walk(client, "/decisions/", DECISION))

    def delete_one_shown(shown: list[str]) -> None:
        client.post("/decisions/delete/", {"key": shown[0]})

    assert flat(walk(client, "/decisions/", DECISION, between=delete_one_shown)) == by_key

    first = client.get("/decisions/").content.decode()
    real = link(first, "next").split("cursor=")[1]
    # The position is a decision's key, which is content: the cursor does not show it.
    assert b"pref_" not in base64.urlsafe_b64decode(real + "=" * (-len(real) % 4))
    assert_bad_cursors_show_the_first_page(client, "/decisions/", re.findall(DECISION, first), DECISION, real=real)


CACHED = r"<td>(question \d+)</td>"


def test_cached_answers_pages_neither_repeat_nor_skip_while_answers_are_cached_and_deleted(
    alice, bob, client, settings, monkeypatch
):
    from memories.interfaces.web import toolkit_views
    from memories.toolkit.models import CacheEntry

    monkeypatch.setattr(toolkit_views, "CACHE_PAGE_SIZE", 2)
    settings.RATE_LIMITS = {**settings.RATE_LIMITS, "store_cache": (0, 60)}
    for n in range(6):
        run(alice, "store_cache", query=f"question {n}", response=f"answer {n}")
        run(bob, "store_cache", query=f"question {100 + n}", response="bob's")
    client.force_login(alice)
    newest_first = [f"question {n}" for n in reversed(range(6))]
    assert flat(walk(client, "/cache/", CACHED)) == newest_first

    def cache_another(shown: list[str]) -> None:
        run(alice, "store_cache", query=f"question {50 + int(shown[0][9:])}", response="new")

    assert flat(walk(client, "/cache/", CACHED, between=cache_another)) == newest_first
    newest_first = flat(walk(client, "/cache/", CACHED))

    def delete_one_shown(shown: list[str]) -> None:
        client.post("/cache/delete/", {"id": str(CacheEntry.objects.get(user=alice, query=shown[0]).id)})

    assert flat(walk(client, "/cache/", CACHED, between=delete_one_shown)) == newest_first

    first = client.get("/cache/").content.decode()
    real = link(first, "next").split("cursor=")[1]
    assert_bad_cursors_show_the_first_page(client, "/cache/", re.findall(CACHED, first), CACHED, real=real)


def test_a_sealed_position_holds_only_values_of_its_kinds(alice):
    """Even under a valid seal (a leaked key), a value the database would refuse or
    misread never reaches it: the wrong kind, an out-of-range id, a naive time."""
    from memories.cursors import CursorError, position_decode, position_encode

    bound = f"{alice.pk}:activity"
    for values, kinds in (
        (["after", 2**63], ("text", "int")),
        (["after", -1], ("text", "int")),
        (["after", True], ("text", "int")),
        (["after", "12"], ("text", "int")),
        (["after", "2026-01-01T00:00:00"], ("text", "time")),
        (["after", "not-a-uuid"], ("text", "uuid")),
        (["after", "x" * 300], ("text", "text")),
        (["after", 1, 2], ("text", "int")),
    ):
        with pytest.raises(CursorError):
            position_decode(position_encode(values, bound_to=bound), kinds=kinds, bound_to=bound)
    cursor = position_encode(["after", 7], bound_to=bound)
    assert position_decode(cursor, kinds=("text", "int"), bound_to=bound) == ("after", 7)
    with pytest.raises(CursorError):
        position_decode(cursor, kinds=("text", "int"), bound_to=f"{alice.pk + 1}:activity")
