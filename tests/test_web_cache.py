"""The web UI's "Cached answers" page: a person sees the answers agents cached for them
(seed 003's store_cache), deletes one or all of them, and never sees, counts or deletes
anyone else's. Deletions are audited (with the actor), never billed. "Your data" also
downloads the decisions and cached answers."""

from __future__ import annotations

import json
import re
import uuid
from datetime import timedelta

import pytest
from django.utils import timezone

from audit.models import AuditEvent
from billing.models import UsageEvent
from core.scope import MemoryScope
from memories.auth import Principal
from memories.interfaces.web import toolkit_views
from memories.operations import operation_execute
from memories.toolkit.models import CacheEntry, Decision
from tests.conftest import internal_call

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]


def cache(user, query: str, response: str) -> str:
    principal = Principal(user=user, method="api_key", client_app="cache-agent")
    arguments = {"query": query, "response": response}
    return operation_execute(principal, "store_cache", arguments, call=internal_call())["cache_id"]


def decide(user, key: str, value: str) -> None:
    now = timezone.now()
    Decision.objects.create(user=user, key=key, value=value, created_at=now, updated_at=now)


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
    assert response.streaming and response["Content-Type"] == "application/json"
    body = b"".join(response.streaming_content).decode()
    document = json.loads(body)
    assert document["format"] == "memsite.decisions_and_cache" and document["version"] == 1
    assert [(d["key"], d["value"]) for d in document["decisions"]] == [("tone", "short-answers")]
    assert [(c["query"], c["response"]) for c in document["cached_answers"]] == [("When is the dentist?", "Tuesday")]
    assert "bob" not in body
    row = AuditEvent.objects.get(operation="export_decisions_and_cache")
    assert row.actor_user_id == alice.pk and row.detail == {"decisions": 1, "cached_answers": 1}
    assert UsageEvent.objects.count() == billed


def test_the_streamed_download_is_the_json_document_it_was(alice, bob, client, settings):
    """Streamed in pieces, the file is still the one JSON document (its bytes as
    `json.dumps(..., indent=1)` gives them): lists empty or not, text beyond ASCII."""
    settings.RATE_LIMITS = {**settings.RATE_LIMITS, "store_cache": (0, 60)}
    client.force_login(alice)
    empty = b"".join(client.post("/data/export/decisions-and-cache/").streaming_content).decode()
    assert json.loads(empty)["decisions"] == [] and json.loads(empty)["cached_answers"] == []
    assert empty == json.dumps(json.loads(empty), ensure_ascii=False, indent=1)
    for key, value in (("b-ton", "kurz, «bitte»"), ("a-lang", 'say "no"\nthen stop')):
        decide(alice, key, value)
    decide(bob, "bobs-key", "bob-decision")
    cache(alice, "Où est la gare ?", "Tout droit 🚉")
    cache(alice, "second question", "second answer")
    cache(bob, "bob's question", "bob-answer")
    body = b"".join(client.post("/data/export/decisions-and-cache/").streaming_content).decode()
    document = json.loads(body)
    assert body == json.dumps(document, ensure_ascii=False, indent=1)
    assert list(document) == ["format", "version", "exported_at", "decisions", "cached_answers"]
    assert [(d["key"], d["value"], d["user_id"]) for d in document["decisions"]] == [
        ("a-lang", 'say "no"\nthen stop', "alice"),
        ("b-ton", "kurz, «bitte»", "alice"),
    ]
    assert [c["response"] for c in document["cached_answers"]] == ["second answer", "Tout droit 🚉"]
    assert "bob" not in body


def test_the_export_streams_its_rows_a_chunk_at_a_time(alice, bob, settings, monkeypatch):
    """The export held every decision and cached answer (and JsonResponse a copy): up to
    ~420 M characters at the caps. It is an iterator now, reading rows from server-side
    cursors a chunk at a time: the first rows are written before the rest are loaded."""
    from django.db import connection

    from memories.toolkit import services as toolkit_services

    monkeypatch.setattr(toolkit_services, "EXPORT_DECISIONS_CHUNK", 2)
    monkeypatch.setattr(toolkit_services, "EXPORT_CACHED_ANSWERS_CHUNK", 2)
    settings.RATE_LIMITS = {**settings.RATE_LIMITS, "store_cache": (0, 60)}
    for n in range(7):
        decide(alice, f"k{n}", f"v{n}")
    for n in range(5):
        cache(alice, f"question {n}", f"answer {n}")
    decide(bob, "bobs", "bob-decision")
    cache(bob, "bob's question", "bob-answer")
    loaded: list[tuple[str, int]] = []
    for model in (Decision, CacheEntry):
        from_db = model.from_db

        def counted(cls, db, field_names, values, from_db=from_db):
            row = from_db.__func__(cls, db, field_names, values)
            loaded.append((cls.__name__, row.user_id))
            return row

        monkeypatch.setattr(model, "from_db", classmethod(counted))

    pieces = toolkit_services.toolkit_data_export(MemoryScope.for_user(alice), call=internal_call())
    assert not isinstance(pieces, dict) and iter(pieces) is pieces
    produced = []
    while '"key": "k0"' not in "".join(produced):
        produced.append(next(pieces))
    assert loaded == [("Decision", alice.pk)]  # one of seven
    with connection.cursor() as cursor:  # the rest wait in the snapshot's cursor
        cursor.execute("SELECT count(*) FROM pg_cursors WHERE statement LIKE '%toolkit_decision%'")
        assert cursor.fetchone()[0] == 1
    while '"query": "question 4"' not in produced[-1]:
        produced.append(next(pieces))
    assert [m for m, _ in loaded].count("CacheEntry") == 1  # one of five
    document = json.loads("".join(produced) + "".join(pieces))
    assert len(document["decisions"]) == 7 and len(document["cached_answers"]) == 5
    assert {user for _, user in loaded} == {alice.pk}  # bob's rows are never read


def test_the_download_streams_under_asgi_in_batches(alice, bob, client, monkeypatch):
    """Under ASGI the pieces are sent in batches as they are read, not read whole first."""
    from memories.interfaces import downloads
    from tests.conftest import asgi_post, lines_counted

    monkeypatch.setattr(downloads, "DOWNLOAD_BATCH_LINES", 4)
    for n in range(12):
        decide(alice, f"k{n:02}", f"alice-{n}")
    decide(bob, "bobs", "bob-secret")
    produced = lines_counted(monkeypatch, toolkit_views, "toolkit_data_export")
    client.force_login(alice)
    status, body, sent_at = asgi_post(
        "/data/export/decisions-and-cache/", {}, session=client.cookies["sessionid"].value, produced=produced
    )
    document = json.loads(body)
    assert status == 200 and [d["value"] for d in document["decisions"]] == [f"alice-{n}" for n in range(12)]
    assert b"bob-secret" not in body and body.decode() == "".join(produced)
    assert sent_at[0] <= 4 < len(produced) and len(sent_at) >= len(produced) // 4


def test_the_export_is_one_snapshot_from_its_first_piece(alice):
    """Another request writing while the file downloads: the file is the data as of its
    first piece, whole (the audit row's counts are those at the call's start)."""
    from memories.toolkit.services import toolkit_data_export
    from tests.conftest import elsewhere

    principal = Principal(user=alice, method="api_key", client_app="cache-agent")
    operation_execute(principal, "store_decision", {"key": "before", "value": "v"}, call=internal_call())
    cache(alice, "asked before", "r")
    pieces = toolkit_data_export(MemoryScope.for_user(alice), call=internal_call())
    head = next(pieces)  # the snapshot starts here

    def written_meanwhile():
        operation_execute(principal, "store_decision", {"key": "meanwhile", "value": "v"}, call=internal_call())
        Decision.objects.filter(user=alice, key="before").delete()
        cache(alice, "asked meanwhile", "r")

    elsewhere(written_meanwhile)
    document = json.loads(head + "".join(pieces))
    assert [d["key"] for d in document["decisions"]] == ["before"]
    assert [c["query"] for c in document["cached_answers"]] == ["asked before"]
    row = AuditEvent.objects.get(operation="export_decisions_and_cache")
    assert row.detail == {"decisions": 1, "cached_answers": 1}


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
    allowed = client.post("/data/export/decisions-and-cache/")
    assert allowed.status_code == 200 and json.loads(b"".join(allowed.streaming_content))["decisions"] == []
    refused = client.post("/data/export/decisions-and-cache/", follow=True)
    assert (
        refused.redirect_chain[-1][0] == "/data/"
        and "Too many export_decisions_and_cache calls" in refused.content.decode()
    )
    rows = AuditEvent.objects.filter(operation="export_decisions_and_cache").order_by("id")
    assert [(r.outcome, r.error_code) for r in rows] == [("ok", ""), ("error", "rate_limited")]
