"""Nothing billed starts from another site. Another site can navigate a signed-in browser
to any GET of ours (the Lax session cookie goes along): the web UI's downloads are POSTs
with the CSRF token, and a search reached by a cross-site navigation is shown unrun."""

import re

import pytest
from django.test import Client

from audit.models import AuditEvent
from billing.models import UsageEvent
from memories.services import memory_remember
from tests.conftest import internal_call

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]

EXPORTS = ("export_memories", "export_decisions_and_cache", "export_session_logs")
# (the form's id on the Your data page, its action, the data it posts)
DOWNLOADS = [
    ("export-memories", "/data/export/", {"format": "jsonl"}),
    ("export-memories", "/data/export/", {"format": "markdown"}),
    ("export-decisions-and-cache", "/data/export/decisions-and-cache/", {}),
    ("export-session-logs", "/data/export/session-logs/", {}),
]


def _body(response) -> bytes:
    return b"".join(response.streaming_content) if response.streaming else response.content


def _csrf_token(page) -> str:
    return re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.content.decode()).group(1)


def test_a_get_of_a_download_bills_and_spends_nothing(alice, client, settings):
    settings.RATE_LIMITS = {**settings.RATE_LIMITS, **{name: (1, 3600) for name in EXPORTS}}
    client.force_login(alice)
    billed = UsageEvent.objects.count()
    for _, action, data in DOWNLOADS:
        for _ in range(3):  # the 31 navigations of the report, in small
            assert client.get(action, data, HTTP_SEC_FETCH_SITE="cross-site").status_code == 405
    assert UsageEvent.objects.count() == billed
    assert not AuditEvent.objects.filter(operation__in=EXPORTS).exists()
    # The export limit (1 an hour here) is untouched: the person's own download works.
    assert client.post("/data/export/", {"format": "jsonl"}).status_code == 200
    assert UsageEvent.objects.filter(operation="export_memories").count() == 1


def test_each_download_is_a_post_with_the_csrf_token(alice):
    browser = Client(enforce_csrf_checks=True)
    browser.force_login(alice)
    page = browser.get("/data/")
    for form_id, action, data in DOWNLOADS:
        assert f'<form method="post" action="{action}" id="{form_id}">' in page.content.decode()
        assert browser.post(action, data).status_code == 403  # no token: refused, not run
    assert not AuditEvent.objects.filter(operation__in=EXPORTS).exists()

    token = _csrf_token(page)
    for _, action, data in DOWNLOADS:
        response = browser.post(action, {**data, "csrfmiddlewaretoken": token})
        assert response.status_code == 200 and response["Content-Disposition"].startswith("attachment;")
        assert _body(response)
    assert browser.post("/data/export/", {"format": "jsonl", "csrfmiddlewaretoken": token}).streaming
    assert UsageEvent.objects.filter(operation="export_memories").count() == 3
    assert AuditEvent.objects.filter(operation__in=EXPORTS, outcome="ok").count() == 5


def test_a_search_from_another_site_is_shown_unrun_and_not_billed(alice, alice_scope, client):
    memory_remember(alice_scope, memory="Alice keeps a sourdough starter", call=internal_call())
    client.force_login(alice)
    billed = UsageEvent.objects.count()
    page = client.get("/memories/", {"q": "sourdough starter"}, HTTP_SEC_FETCH_SITE="cross-site")
    assert page.status_code == 200
    assert b'value="sourdough starter"' in page.content and b'id="search-held"' in page.content
    assert b"Alice keeps a sourdough starter" not in page.content
    assert UsageEvent.objects.count() == billed
    assert not AuditEvent.objects.filter(operation="search_memory").exists()

    # Pressing Apply (same-origin), a typed or bookmarked URL (none), a client without the
    # header: searched as always.
    for headers in ({"HTTP_SEC_FETCH_SITE": "same-origin"}, {"HTTP_SEC_FETCH_SITE": "none"}, {}):
        searched = client.get("/memories/", {"q": "sourdough starter"}, **headers)
        assert b"Alice keeps a sourdough starter" in searched.content and b"search-held" not in searched.content
    assert UsageEvent.objects.filter(operation="search_memory").count() == 3
