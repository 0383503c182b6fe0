"""The web UI's "Cached answers" page: a person sees the answers agents cached for them
(seed 003's store_cache), deletes one or all of them, and never sees, counts or deletes
anyone else's. Deletions are audited (with the actor), never billed. "Your data" also
downloads the decisions and cached answers."""

from __future__ import annotations

import re
import uuid
from datetime import timedelta

import pytest
from django.utils import timezone

from audit.models import AuditEvent
from billing.models import UsageEvent
from memories.auth import Principal
from memories.interfaces.web import toolkit_views
from memories.operations import operation_execute
from memories.toolkit.models import CacheEntry
from tests.conftest import internal_call

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]


def cache(user, query: str, response: str) -> str:
    principal = Principal(user=user, method="api_key", client_app="cache-agent")
    arguments = {"query": query, "response": response}
    return operation_execute(principal, "store_cache", arguments, call=internal_call())["cache_id"]


def test_the_page_shows_only_my_live_cached_answers(alice, bob, client):
    cache(alice, "When is the dentist?", "Tuesday at 9 - bring the x-rays")
    gone = cache(alice, "Old question", "stale-answer")
    CacheEntry.objects.filter(id=gone).update(expires_at=timezone.now() - timedelta(seconds=1))
    cache(bob, "What is bob's locker code?", "bob-4711")
    client.force_login(alice)
    page = client.get("/cache/").content.decode()
    assert "When is the dentist?" in page and "Tuesday at 9 - bring the x-rays" in page
    assert "stale-answer" not in page  # expired: gone for every reader
    assert "bob-4711" not in page and "locker" not in page
    assert "Delete all cached answers (1)" in page
    assert 'href="/cache/"' in client.get("/memories/").content.decode()  # in the menu


def test_the_page_pages_through_every_entry(alice, client, settings, monkeypatch):
    monkeypatch.setattr(toolkit_views, "CACHE_PAGE_SIZE", 3)
    settings.RATE_LIMITS = {**settings.RATE_LIMITS, "store_cache": (0, 60)}
    for n in range(5):
        cache(alice, f"question {n}", f"answer {n}")
    client.force_login(alice)
    first = client.get("/cache/").content.decode()
    assert first.count('name="id"') == 3 and "Showing 3 of 5 cached answers" in first
    following = re.search(r'rel="next" href="([^"]+)"', first).group(1).replace("&amp;", "&")
    second = client.get("/cache/" + following).content.decode()
    assert second.count('name="id"') == 2 and "answer 0" in second  # newest first


def test_deleting_one_is_audited_and_not_billed(alice, client):
    keep = cache(alice, "keep me", "kept")
    drop = cache(alice, "drop me", "dropped")
    billed = UsageEvent.objects.count()
    client.force_login(alice)
    response = client.post("/cache/delete/", {"id": drop}, follow=True)
    assert "Deleted the cached answer." in response.content.decode()
    assert set(CacheEntry.objects.values_list("id", flat=True)) == {uuid.UUID(keep)}
    row = AuditEvent.objects.get(operation="delete_cache_entry")
    assert row.actor_user_id == alice.pk and row.channel == "ui"
    assert row.detail == {"cache_id": drop, "deleted": True}
    assert UsageEvent.objects.count() == billed


def test_another_users_entry_is_exactly_like_a_missing_one(alice, bob, client):
    bobs = cache(bob, "bob's question", "bob's answer")
    client.force_login(alice)
    for entry_id in (bobs, str(uuid.uuid4()), "not-a-uuid", ""):
        response = client.post("/cache/delete/", {"id": entry_id}, follow=True)
        assert response.status_code == 200
        assert "No such cached answer." in response.content.decode()
    assert CacheEntry.objects.filter(id=bobs).exists()
    # Nothing in alice's audit tells her whether bob's id exists.
    rows = AuditEvent.objects.filter(operation="delete_cache_entry", actor_user_id=alice.pk)
    assert [r.detail["deleted"] for r in rows] == [False, False]  # the two well-formed ids
    assert all(r.subject_user_id == alice.pk for r in rows)


def test_delete_all_deletes_only_mine(alice, bob, client):
    cache(alice, "one", "1")
    cache(alice, "two", "2")
    bobs = cache(bob, "bob's", "b")
    client.force_login(alice)
    response = client.post("/cache/clear/", follow=True)
    assert "Deleted 2 cached answers." in response.content.decode()
    assert list(CacheEntry.objects.values_list("id", flat=True)) == [uuid.UUID(bobs)]
    row = AuditEvent.objects.get(operation="delete_cache_entry")
    assert row.detail == {"all": True, "deleted": 2} and row.actor_user_id == alice.pk
    assert "No cached answers." in client.get("/cache/").content.decode()


def test_the_pages_need_a_login_and_changes_need_post(alice, client):
    assert client.get("/cache/").status_code == 302
    assert client.post("/data/export/decisions-and-cache/").status_code == 302
    assert client.post("/cache/clear/").status_code == 302
    assert client.post("/cache/delete/", {"id": str(uuid.uuid4())}).status_code == 302
    client.force_login(alice)
    cache(alice, "q", "r")
    assert client.get("/cache/clear/").status_code == 405
    assert client.get("/cache/delete/").status_code == 405
    assert CacheEntry.objects.count() == 1


def test_your_data_downloads_my_decisions_and_cached_answers_only(alice, bob, client):
    principal = Principal(user=alice, method="api_key", client_app="cache-agent")
    operation_execute(principal, "store_decision", {"key": "tone", "value": "short-answers"}, call=internal_call())
    cache(alice, "When is the dentist?", "Tuesday")
    bobs = Principal(user=bob, method="api_key", client_app="cache-agent")
    operation_execute(bobs, "store_decision", {"key": "bob-key", "value": "bob-value"}, call=internal_call())
    cache(bob, "bob's question", "bob-answer")
    billed = UsageEvent.objects.count()
    client.force_login(alice)
    assert "/data/export/decisions-and-cache/" in client.get("/data/").content.decode()
    response = client.post("/data/export/decisions-and-cache/")
    assert response.status_code == 200 and "attachment" in response["Content-Disposition"]
    document = response.json()
    assert document["format"] == "memsite.decisions_and_cache" and document["version"] == 1
    assert [(d["key"], d["value"]) for d in document["decisions"]] == [("tone", "short-answers")]
    assert [(c["query"], c["response"]) for c in document["cached_answers"]] == [("When is the dentist?", "Tuesday")]
    assert "bob" not in response.content.decode()
    row = AuditEvent.objects.get(operation="export_decisions_and_cache")
    assert row.actor_user_id == alice.pk and row.detail == {"decisions": 1, "cached_answers": 1}
    assert UsageEvent.objects.count() == billed


def test_clear_all_memories_drops_the_cached_answers_too(alice, bob):
    """A cached answer was worked out from the memories: a hit would hand cleared facts back."""
    cache(alice, "What is my bank PIN?", "pin-4321")
    bobs = cache(bob, "bob's question", "b")
    principal = Principal(user=alice, method="api_key", client_app="cache-agent")
    operation_execute(principal, "clear_all_memory", {"confirm": True}, call=internal_call())
    assert list(CacheEntry.objects.values_list("id", flat=True)) == [uuid.UUID(bobs)]
    hit = operation_execute(principal, "check_cache", {"query": "What is my bank PIN?"}, call=internal_call())
    assert hit == {"cache_hit": False}


def test_the_decisions_and_cache_download_is_rate_limited(alice, client, settings):
    settings.RATE_LIMITS = {**settings.RATE_LIMITS, "export_decisions_and_cache": (1, 60)}
    client.force_login(alice)
    assert client.post("/data/export/decisions-and-cache/").status_code == 200
    refused = client.post("/data/export/decisions-and-cache/", follow=True)
    assert (
        refused.redirect_chain[-1][0] == "/data/"
        and "Too many export_decisions_and_cache calls" in refused.content.decode()
    )
    rows = AuditEvent.objects.filter(operation="export_decisions_and_cache").order_by("id")
    assert [(r.outcome, r.error_code) for r in rows] == [("ok", ""), ("error", "rate_limited")]
