"""The web UI's memory download is streamed: the same file and the same billed, audited
call as the API's export_memories (also streamed, test_portability.py), read a page at a
time and sent in batches under ASGI, never built whole in memory. Only the signed-in person's memories are in it."""

from __future__ import annotations

import json

import pytest

from audit.models import AuditEvent
from billing.models import UsageEvent
from core.scope import CallContext
from memories import services
from memories.interfaces import downloads
from memories.interfaces.web import views as web_views
from memories.services import memory_delete, memory_export, memory_export_stream, memory_remember, memory_update
from tests.conftest import asgi_post, elsewhere, internal_call, lines_counted

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]


@pytest.fixture
def alices(alice_scope, bob_scope) -> list[str]:
    ids = [memory_remember(alice_scope, memory=f"Alice fact number {n}", call=internal_call()).id for n in range(7)]
    memory_update(alice_scope, memory_id=ids[2], pinned=True, call=internal_call())
    memory_update(alice_scope, memory_id=ids[3], memory="Alice fact number three, edited", call=internal_call())
    memory_remember(bob_scope, memory="bob-private-fact", call=internal_call())
    return ids


def body_of(response) -> str:
    return b"".join(response.streaming_content).decode()


def without_time(text: str, exported_at: str) -> str:
    return text.replace(exported_at, "<time>")


@pytest.mark.parametrize("file_format", ["jsonl", "markdown"])
def test_the_download_is_the_api_export_of_the_person_billed_and_audited_once(
    alice, alice_scope, alices, client, monkeypatch, file_format
):
    monkeypatch.setattr(services, "EXPORT_PAGE_SIZE", 3)  # several pages, both passes of Markdown
    billed = UsageEvent.objects.count()
    client.force_login(alice)
    response = client.post("/data/export/", {"format": file_format})
    assert response.status_code == 200 and response.streaming
    streamed = body_of(response)
    assert "bob-private-fact" not in streamed
    row = AuditEvent.objects.filter(operation="export_memories").latest("id")
    assert row.outcome == "ok" and row.detail == {"format": file_format, "memories": 7}
    assert row.actor_user_id == alice.pk and row.channel == "ui"
    assert sorted(row.memory_ids) == sorted(alices)
    assert UsageEvent.objects.count() == billed + 1
    # Read in pages of 3 (and Markdown in two passes), the file is the one read in one page.
    monkeypatch.setattr(services, "EXPORT_PAGE_SIZE", 500)
    built = memory_export(
        alice_scope, file_format=file_format, call=CallContext(channel="internal", actor_username="alice")
    ).content
    if file_format == "jsonl":
        exported_at = json.loads(streamed.splitlines()[0])["exported_at"]
        assert json.loads(built.splitlines()[0])["count"] == 7
        built_at = json.loads(built.splitlines()[0])["exported_at"]
        assert without_time(streamed, exported_at) == without_time(built, built_at)
        assert len(streamed.splitlines()) == 8
    else:
        assert streamed.index("## Pinned") < streamed.index("Alice fact number 2") < streamed.index("## Memories")
        exported_at = streamed.split("exported ")[1].split(".\n")[0]
        built_at = built.split("exported ")[1].split(".\n")[0]
        assert without_time(streamed, exported_at) == without_time(built, built_at)


def test_a_bad_format_or_the_rate_limit_is_refused_audited_and_not_billed(alice, alices, client, settings):
    client.force_login(alice)
    billed = UsageEvent.objects.count()
    refused = client.post("/data/export/", {"format": "pdf"}, follow=True)
    assert refused.redirect_chain[-1][0] == "/data/" and "format must be one of" in refused.content.decode()
    settings.RATE_LIMITS = {**settings.RATE_LIMITS, "export_memories": (1, 60)}
    assert client.post("/data/export/").status_code == 200
    limited = client.post("/data/export/", follow=True)
    assert "Too many export_memories calls" in limited.content.decode()
    rows = AuditEvent.objects.filter(operation="export_memories").order_by("id")
    assert [(r.outcome, r.error_code) for r in rows] == [
        ("error", "invalid_argument"),
        ("ok", ""),
        ("error", "rate_limited"),
    ]
    assert UsageEvent.objects.count() == billed + 1


def test_the_file_is_one_snapshot_and_imports_whole_whatever_is_written_meanwhile(
    alice_scope, bob_scope, alices, monkeypatch
):
    """The audit row names the memories live at the call; the file is read in one snapshot
    taken at its first line, so its count always matches its lines (the import refuses a
    file whose count does not) and no memory is in it twice or missing."""
    monkeypatch.setattr(services, "EXPORT_PAGE_SIZE", 2)
    for file_format, pinned, deleted, count in (("jsonl", 4, 5, 7), ("markdown", 1, 6, 7)):
        lines = memory_export_stream(alice_scope, file_format=file_format, call=internal_call())
        first = next(lines)  # the snapshot starts here
        stored = f"Stored while the {file_format} download ran"
        elsewhere(lambda text=stored: memory_remember(alice_scope, memory=text, call=internal_call()))
        elsewhere(lambda i=pinned: memory_update(alice_scope, memory_id=alices[i], pinned=True, call=internal_call()))
        elsewhere(lambda i=deleted: memory_delete(alice_scope, memory_id=alices[i], call=internal_call()))
        text = first + "".join(lines)
        assert stored not in text
        if file_format == "jsonl":
            records = [json.loads(line) for line in text.splitlines()]
            assert records[0]["count"] == count and sorted(r["id"] for r in records[1:]) == sorted(alices)
            imported = services.memory_import_file(
                bob_scope, data=text.encode(), source="memsite", call=internal_call()
            )
            assert imported.imported == count
        else:  # one memory pinned between the two passes (pinned first, then the rest): once
            assert f"{count} memories" in text and text.count("- Alice fact number 1\n") == 1
            assert text.count("\n- ") == count
    # A memory deleted between the audit row and the first line is left out of the file
    # (the audit row still names it: it may have been read), and the count says so.
    lines = memory_export_stream(alice_scope, file_format="jsonl", call=internal_call())
    memory_delete(alice_scope, memory_id=alices[0], call=internal_call())
    records = [json.loads(line) for line in lines]
    assert records[0]["count"] == len(records) - 1 == 6


def test_under_asgi_it_is_sent_while_it_is_read(alice, alice_scope, alices, client, monkeypatch):
    monkeypatch.setattr(services, "EXPORT_PAGE_SIZE", 2)
    monkeypatch.setattr(downloads, "DOWNLOAD_BATCH_LINES", 2)
    produced = lines_counted(monkeypatch, web_views, "memory_export_stream")
    client.force_login(alice)
    status, body, sent_at = asgi_post(
        "/data/export/", {"format": "jsonl"}, session=client.cookies["sessionid"].value, produced=produced
    )
    assert status == 200 and len(body.decode().splitlines()) == 8 == len(produced)
    assert b"bob-private-fact" not in body
    assert sent_at[0] <= 2 < len(produced) and len(sent_at) >= 4
