"""Review 20, the web UI: long lists page and count everything, changes made outside the
dispatcher are audited with their actor, "Delete all matching…" deletes only what the list
shows, the copy follows the trash setting, and the edit form's CRLF line breaks."""

from __future__ import annotations

import re

import pytest
from django.urls import reverse

from audit.models import AuditEvent
from core.scope import CallContext, MemoryScope
from memories.auth import Principal
from memories.interfaces.web import sessions as web_sessions
from memories.interfaces.web import toolkit_views
from memories.interfaces.web import views as web
from memories.models import ApiKey
from memories.operations import operation_execute
from tests.test_proxy_bad_input import WEB_FORM

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]


def run(user, name: str, *, client_app: str = "r20-agent", **arguments) -> dict:
    principal = Principal(user=user, method="api_key", client_app=client_app)
    return operation_execute(principal, name, arguments, call=CallContext(channel="mcp"))


def shown_items(page: str) -> int:
    return len(re.findall(r'<p class="text">', page))


def next_link(page: str) -> str:
    return re.search(r'rel="next" href="([^"]+)"', page).group(1).replace("&amp;", "&")


# --- 1. long lists: pages, and counts of everything ------------------------------------------
def test_trash_page_pages_and_counts_the_whole_trash(alice, client, monkeypatch):
    # raising=False: on code without paging the test still runs (and fails on what it shows)
    monkeypatch.setattr(web, "TRASH_PAGE_SIZE", 4, raising=False)
    ids = [run(alice, "remember", memory=f"Trash paging fact number {n}")["id"] for n in range(7)]
    run(alice, "delete_memory", memory_id=ids[0])  # a group of one, deleted first
    client.force_login(alice)
    client.post("/memories/clear/", {"confirmation": "delete all my memories"})  # a group of six

    first = client.get("/trash/").content.decode()
    assert shown_items(first) == 4
    assert "Empty trash (7)" in first and "Showing 4 of 7" in first
    assert "Restore all 6" in first and "(4 on this page)" in first  # the group runs onto page 2

    second = client.get("/trash/" + next_link(first)).content.decode()
    assert shown_items(second) == 3 and "Showing 3 of 7" in second
    assert "Restore all 6" in second and "(2 on this page)" in second and "Restore all 1" in second
    assert 'rel="next"' not in second

    emptied = client.post("/trash/purge/", {"all": "true"}, follow=True).content.decode()
    assert "Deleted 7 forever" in emptied  # what the button said


def test_another_users_rows_are_neither_shown_nor_counted_on_any_page(alice, bob, client, monkeypatch):
    """The pages' counts and pages are the signed-in user's own (tenancy)."""
    monkeypatch.setattr(web, "TRASH_PAGE_SIZE", 2)
    for n in range(3):
        run(bob, "delete_memory", memory_id=run(bob, "remember", memory=f"Bob's trashed fact {n}")["id"])
        run(bob, "store_decision", key=f"bob_{n}", value="v")
    run(bob, "memory_after_turn", session_id="bob-s", turn_id="t1",
        input_items=[{"type": "message", "role": "user", "content": "I prefer tea over coffee."}],
        output_items=[{"type": "message", "role": "assistant", "content": "Noted."}])  # fmt: skip
    client.force_login(alice)
    for url in ("/trash/", "/decisions/", "/sessions/"):
        page = client.get(url).content.decode()
        assert "Bob" not in page and "bob_" not in page and "bob-s" not in page and "Showing" not in page, url
    assert "Empty trash (3)" not in client.get("/trash/").content.decode()  # bob's three are not counted


def test_activity_page_pages_through_every_call_and_its_links_keep_the_filter(alice, bob, client, monkeypatch):
    """The Activity page stopped at the newest 200 calls without saying so."""
    monkeypatch.setattr(web, "ACTIVITY_LIMIT", 3, raising=False)
    for n in range(4):
        run(alice, "remember", memory=f"Activity paging fact {n}")
    run(bob, "remember", memory="Bob's own call")  # bob's: neither shown nor counted
    client.force_login(alice)
    first = client.get("/activity/").content.decode()
    assert first.count("<td>remember</td>") == 3 and "Showing 3 of 4 calls" in first
    second = client.get("/activity/" + next_link(first)).content.decode()
    assert second.count("<td>remember</td>") == 1 and "Showing 1 of 4 calls" in second

    # Calls by a service acting for alice: the filtered pages link to the filtered pages.
    tenant = MemoryScope.for_user(alice).tenant
    for _ in range(4):
        AuditEvent.objects.create(
            request_id="r", channel="rest", operation="search_memory", outcome="ok", actor_user_id=bob.pk,
            actor_username="svc", actor_role="tenant_admin", tenant=tenant, subject_user_id=alice.pk,
        )  # fmt: skip
    services = client.get("/activity/?by=services").content.decode()
    assert services.count("<td>search_memory</td>") == 3 and "Showing 3 of 4 calls" in services
    assert next_link(services).startswith("?by=services&cursor=")
    last = client.get("/activity/" + next_link(services)).content.decode()
    assert last.count("<td>search_memory</td>") == 1 and "<td>remember</td>" not in last


def test_trash_selectors_count_beyond_one_page(alice):
    from memories.keyset import Seek
    from memories.selectors import memory_trash_count, memory_trash_list, memory_trash_page

    ids = [run(alice, "remember", memory=f"Counted trash fact {n}")["id"] for n in range(3)]
    for memory_id in ids:
        run(alice, "delete_memory", memory_id=memory_id)
    scope = MemoryScope.for_user(alice)
    first = memory_trash_page(scope, limit=2)
    assert len(first) == 2 and first.previous is None
    last = memory_trash_page(scope, limit=2, seek=Seek(first.next))
    assert [t.memory.id for t in last] == [ids[0]] and last.next is None  # oldest last
    assert memory_trash_count(scope) == 3
    request_id = memory_trash_list(scope, limit=1)[0].request_id
    assert memory_trash_count(scope, request_id=request_id) == 1


def test_decisions_page_pages_through_every_decision(alice, client, settings, monkeypatch):
    monkeypatch.setattr(toolkit_views, "DECISIONS_PAGE_SIZE", 4, raising=False)
    settings.RATE_LIMITS = {**settings.RATE_LIMITS, "store_decision": (0, 60)}
    for n in range(7):
        run(alice, "store_decision", key=f"pref_{n:04d}", value=f"value {n}")
    client.force_login(alice)
    first = client.get("/decisions/").content.decode()
    assert first.count('name="key"') == 4 and "Showing 4 of 7 decisions" in first
    second = client.get("/decisions/" + next_link(first)).content.decode()
    assert second.count('name="key"') == 3 and "pref_0006" in second and "Showing 3 of 7" in second


def test_sessions_page_counts_all_facts_and_pages_sessions(alice, client, monkeypatch):
    monkeypatch.setattr(web_sessions, "FACTS_PER_TIER", 3, raising=False)
    monkeypatch.setattr(web_sessions, "SESSIONS_PAGE_SIZE", 2, raising=False)
    for n in range(5):
        run(
            alice,
            "memory_after_turn",
            session_id=f"s{n % 3}",
            turn_id=f"t{n}",
            input_items=[{"type": "message", "role": "user", "content": f"I prefer brand{n}x coffee over tea."}],
        )
    client.force_login(alice)
    page = client.get("/sessions/").content.decode()
    assert re.search(r"Long-term \((\d+)\)", page).group(1) == "5"
    assert sum(f"brand{n}x" in page for n in range(5)) == 3  # the newest three
    link = re.search(r'href="([^"]+)">see all 5 in My memories', page).group(1).replace("&amp;", "&")
    everything = client.get(link).content.decode()
    assert all(f"brand{n}x" in everything for n in range(5))
    assert "Showing 2 of 3 sessions" in page and page.count("Delete raw events") == 2
    assert client.get("/sessions/" + next_link(page)).content.decode().count("Delete raw events") == 1


# --- 2 and 3. changes outside the dispatcher: audited, with their actor ----------------------
ACTOR = ("alice", "session", "user")


def _actor(row: AuditEvent) -> tuple:
    return (row.actor_username, row.actor_auth, row.actor_role)


def test_key_revocation_in_the_web_ui_is_audited_with_its_actor(alice, client):
    client.force_login(alice)
    client.post("/keys/", {"name": "laptop", "permissions_shown": "1", "permissions": ["read"]})
    key = ApiKey.objects.get(user=alice)
    assert client.post(f"/keys/{key.key_id}/revoke/").status_code == 302
    row = AuditEvent.objects.get(operation="api_key_revoke")
    assert _actor(row) == ACTOR and row.actor_user_id == alice.pk and row.channel == "ui"
    assert row.detail["key_id"] == key.key_id


def test_web_rows_outside_the_dispatcher_name_the_actor_like_dispatcher_rows(alice, client):
    client.force_login(alice)
    client.get("/memories/")
    listed = AuditEvent.objects.filter(operation="list_memory").last()
    assert (*_actor(listed), listed.actor_user_id) == (*ACTOR, alice.pk)

    client.post("/keys/", {"name": "laptop", "permissions_shown": "1", "permissions": ["read"]})
    key = ApiKey.objects.get(user=alice)
    run(alice, "store_decision", key="tone", value="short")
    client.post("/decisions/delete/", {"key": "tone"})
    assert client.post(reverse("proxy-key-config", args=[key.key_id]), WEB_FORM).status_code == 302
    for operation in ("api_key_issue", "delete_decision", "proxy_token_config"):
        row = AuditEvent.objects.filter(operation=operation).last()
        assert row is not None, operation
        assert (*_actor(row), row.actor_user_id) == (*ACTOR, alice.pk), operation


# --- 4. "Delete all matching…" only where it deletes what the list shows ---------------------
def test_delete_all_matching_is_not_offered_under_filters_it_cannot_honour(alice, client):
    run(alice, "remember", memory="Use shorter answers in app A", memory_type="feedback", client_app="app-a")
    run(alice, "remember", memory="Never send drafts unasked", memory_type="feedback", client_app="app-b", pinned=True)
    client.force_login(alice)
    for narrowed in ("source=app-a&", "pinned=no&", "q=answers&"):
        page = client.get(f"/memories/?{narrowed}memory_type=feedback").content.decode()
        assert 'id="forget-matching"' not in page, narrowed
        assert 'id="forget-unavailable"' in page, narrowed
    page = client.get("/memories/?memory_type=feedback").content.decode()
    assert 'id="forget-matching"' in page and 'id="forget-unavailable"' not in page
    link = re.search(r'id="forget-matching" href="([^"]+)"', page).group(1).replace("&amp;", "&")
    confirm = client.get(link).content.decode()
    assert "Delete 2 matching" in confirm and "Pinned or not, from every source" in confirm
    assert 'id="forget-unavailable"' not in client.get("/memories/?source=app-a").content.decode()  # nothing to offer


# --- 5. the copy follows the trash setting ---------------------------------------------------
def test_delete_copy_follows_the_trash_setting(alice, client, settings):
    client.force_login(alice)
    settings.TRASH_RETENTION_DAYS = 30
    kept = run(alice, "remember", memory="Alice's library card is 5521")["id"]
    assert "where you can restore it" in client.get(f"/memories/{kept}/delete/").content.decode()
    done = client.post(f"/memories/{kept}/delete/", follow=True).content.decode()
    assert "You can restore it from the trash." in done

    settings.TRASH_RETENTION_DAYS = 0
    gone = run(alice, "remember", memory="Alice's passport number is X1234567")["id"]
    confirm = client.get(f"/memories/{gone}/delete/").content.decode()
    assert "This cannot be undone." in confirm and "restore" not in confirm
    done = client.post(f"/memories/{gone}/delete/", follow=True).content.decode()
    assert "restore it from the trash" not in done and "It is gone for good." in done
    cleared = client.post("/memories/clear/", {"confirmation": "delete all my memories"}, follow=True)
    assert "They are gone for good." in cleared.content.decode()
    assert "The trash is turned off" in client.get("/trash/").content.decode()


# --- 6. the edit form's CRLF line breaks ------------------------------------------------------
def test_saving_an_unchanged_multiline_memory_from_the_web_form(client, alice):
    lines = [f"line {n:03d} " + "x" * 70 for n in range(100)]  # 100 lines
    text = "\n".join(lines)[:7990]
    memory_id = run(alice, "remember", memory=text)["id"]
    client.force_login(alice)
    assert 'maxlength="8000"' in client.get(f"/memories/{memory_id}/").content.decode()
    posted = text.replace("\n", "\r\n")  # what a browser submits for the unchanged textarea
    assert len(posted) > 8000
    response = client.post(f"/memories/{memory_id}/edit/", {"memory": posted}, follow=True)
    assert [str(m) for m in response.context["messages"]] == ["Saved."]
    assert run(alice, "get_memory", memory_id=memory_id)["memory"]["memory"] == text

    client.post(f"/memories/{memory_id}/edit/", {"memory": "one\r\ntwo\rthree\nfour"})
    assert run(alice, "get_memory", memory_id=memory_id)["memory"]["memory"] == "one\ntwo\nthree\nfour"


def test_activity_shows_another_users_id_as_missing_as_an_unknown_one(alice, bob, client):
    """bob asking for alice's memory is answered not_found, as for an id nobody has; the
    trail keeps it as denied for staff, but bob's Activity page must not tell the two apart."""
    from core.errors import ServiceError

    alices = run(alice, "remember", memory="Alice's private fact")["id"]
    for memory_id in (alices, "6f1c3a52-0c1e-4c55-9d1c-8f0f5b1d2e3a"):
        with pytest.raises(ServiceError):
            run(bob, "delete_memory", memory_id=memory_id)
    rows = AuditEvent.objects.filter(actor_user_id=bob.pk, operation="delete_memory").order_by("id")
    assert [r.outcome for r in rows] == ["denied", "error"]  # what staff see
    client.force_login(bob)
    page = client.get("/activity/").content.decode()
    assert page.count("<td>error (not_found)</td>") == 2 and "denied" not in page


def test_a_trash_page_emptied_by_a_purge_meanwhile_is_shown_empty(alice, client, monkeypatch):
    """The count said there was more; a purge emptied the trash before it was read. The
    page used to fail (IndexError, a 500) looking for the first group on it."""
    from memories.keyset import KeysetPage

    monkeypatch.setattr(web, "memory_trash_count", lambda scope, request_id=None: 3 * web.TRASH_PAGE_SIZE)  # noqa: ARG005
    monkeypatch.setattr(web, "memory_trash_page", lambda scope, limit, seek: KeysetPage(rows=[]))  # noqa: ARG005
    client.force_login(alice)
    assert client.get("/trash/").status_code == 200
