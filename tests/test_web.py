"""The web UI through Django's test client: scoping, actions, confirmation, keys."""

import pytest

from audit.models import AuditEvent
from billing.models import UsageEvent
from core.scope import MemoryScope
from memories import engine
from memories.models import ApiKey
from memories.services import memory_remember
from tests.conftest import internal_call
from tests.engine_helpers import memory_gone

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]


@pytest.fixture
def alice_memory(alice):
    return memory_remember(
        MemoryScope.for_user(alice), memory="Alice keeps a sourdough starter", call=internal_call()
    ).id


def test_login_required(client):
    response = client.get("/memories/")
    assert response.status_code == 302 and response["Location"].startswith("/accounts/login/")
    assert client.get("/accounts/login/").status_code == 200


def test_local_login_and_browse(client, alice, alice_memory):
    response = client.post("/accounts/login/", {"username": "alice", "password": "alice-password-1"})
    assert response.status_code == 302
    page = client.get("/memories/")
    assert b"Alice keeps a sourdough starter" in page.content
    search = client.get("/memories/?q=bread+fermentation")
    assert b"Alice keeps a sourdough starter" in search.content
    assert client.get(f"/memories/{alice_memory}/").status_code == 200


def test_bob_gets_404_for_every_url_of_alices_memory(client, bob, alice_memory):
    client.force_login(bob)
    for method, url, data in [
        ("get", f"/memories/{alice_memory}/", None),
        ("get", f"/memories/{alice_memory}/delete/", None),
        ("post", f"/memories/{alice_memory}/delete/", {}),
        ("post", f"/memories/{alice_memory}/pin/", {"pinned": "true"}),
        ("post", f"/memories/{alice_memory}/edit/", {"memory": "pwned"}),
    ]:
        assert getattr(client, method)(url, data).status_code == 404, url
    assert b"Alice keeps" not in client.get("/memories/?q=sourdough").content
    stored = engine.engine_get(alice_memory)
    assert stored.text == "Alice keeps a sourdough starter" and not stored.metadata.get("pinned")


def test_pin_edit_delete_go_through_the_services(client, alice, alice_memory):
    client.force_login(alice)
    client.post(f"/memories/{alice_memory}/pin/", {"pinned": "true"})
    client.post(f"/memories/{alice_memory}/edit/", {"memory": "Alice keeps two sourdough starters"})
    stored = engine.engine_get(alice_memory)
    assert stored.text == "Alice keeps two sourdough starters" and stored.metadata["pinned"] is True
    detail = client.get(f"/memories/{alice_memory}/")
    assert b"alice (ui)" in detail.content  # the history says who changed it

    assert client.get(f"/memories/{alice_memory}/delete/").status_code == 200  # confirmation page
    client.post(f"/memories/{alice_memory}/delete/")
    assert memory_gone(alice_memory)
    ui_ops = set(AuditEvent.objects.filter(channel="ui").values_list("operation", flat=True))
    assert {"update_memory", "delete_memory", "get_memory"} <= ui_ops
    assert set(UsageEvent.objects.filter(channel="ui").values_list("operation", flat=True)) >= {
        "update_memory",
        "delete_memory",
    }


def test_bad_edit_is_refused_and_changes_nothing(client, alice, alice_memory):
    client.force_login(alice)
    response = client.post(f"/memories/{alice_memory}/edit/", {"memory": "x" * 9000}, follow=True)
    assert b"at most 8000 characters" in response.content
    assert engine.engine_get(alice_memory).text == "Alice keeps a sourdough starter"


def test_clear_all_needs_the_typed_phrase(client, alice, alice_memory):
    client.force_login(alice)
    response = client.post("/memories/clear/", {"confirmation": "yes"}, follow=True)
    assert b"to confirm" in response.content and engine.engine_get(alice_memory) is not None
    client.post("/memories/clear/", {"confirmation": "Delete all my memories"})
    assert memory_gone(alice_memory)


def test_api_keys_create_show_once_and_revoke(client, alice, bob):
    client.force_login(alice)
    created = client.post("/keys/", {"name": "laptop"})
    assert created.status_code == 200
    plain = created.context["new_key"]
    assert plain.startswith("msk_") and plain.encode() in created.content
    assert b'"Authorization": "Bearer ' in created.content
    assert plain.encode() not in client.get("/keys/").content
    key = ApiKey.objects.get(user=alice)

    client.force_login(bob)
    assert client.post(f"/keys/{key.key_id}/revoke/").status_code == 404
    client.force_login(alice)
    client.post(f"/keys/{key.key_id}/revoke/")
    key.refresh_from_db()
    assert key.revoked_at is not None


def test_usage_page(client, alice, alice_memory):
    client.force_login(alice)
    client.get("/memories/")
    page = client.get("/usage/")
    assert page.status_code == 200 and b"list_memory" in page.content


def test_csrf_is_enforced():
    from django.contrib.auth import get_user_model
    from django.test import Client

    user = get_user_model().objects.create_user("dana", password="dana-password-1")
    client = Client(enforce_csrf_checks=True)
    client.force_login(user)
    assert client.post("/keys/", {"name": "x"}).status_code == 403


def test_each_ui_action_leaves_exactly_one_audit_row(client, alice, alice_memory):
    client.force_login(alice)
    actions = [
        ("get", "/memories/", {}, "list_memory", "ok"),
        ("get", "/memories/?q=bread", {}, "search_memory", "ok"),
        ("get", f"/memories/{alice_memory}/", {}, "get_memory", "ok"),
        ("post", f"/memories/{alice_memory}/pin/", {"pinned": "true"}, "update_memory", "ok"),
        ("post", f"/memories/{alice_memory}/edit/", {"memory": ""}, "update_memory", "error"),
        ("post", f"/memories/{alice_memory}/delete/", {}, "delete_memory", "ok"),
        ("post", "/memories/clear/", {"confirmation": "delete all my memories"}, "clear_all_memory", "ok"),
    ]
    for method, url, data, operation, outcome in actions:
        before = AuditEvent.objects.count()
        getattr(client, method)(url, data)
        rows = list(AuditEvent.objects.order_by("-id")[: AuditEvent.objects.count() - before])
        assert [(r.operation, r.outcome, r.channel) for r in rows] == [(operation, outcome, "ui")], url
