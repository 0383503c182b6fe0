"""Which credential made a call: two keys may share a name (and a leaked key is what
support looks for), so every audit row of a call names it (`actor_credential`, the key id,
never the secret), delegated calls the service's own key, and the admin finds one key's
calls with `key:<key id>`."""

from __future__ import annotations

import pytest

from audit.models import AuditEvent
from core.choices import Role
from memories.services import api_key_issue
from memories.tenancy import tenant_user_create
from tests.test_rest_review18 import SUBJECT, _key, acme  # noqa: F401 - acme is a fixture

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]


def test_calls_name_their_key_and_the_admin_finds_one_keys_calls(alice, api_client, admin_client):
    laptop, laptop_token = api_key_issue(user=alice, name="laptop")
    phone, phone_token = api_key_issue(user=alice, name="laptop")  # the same name
    memory_id = api_client(laptop_token).post("/v1/memories", {"memory": "Alice rows on Sundays"}, format="json")
    memory_id = memory_id.json()["id"]
    assert api_client(phone_token).post("/v1/memories/search", {"query": "rowing"}, format="json").status_code == 200
    refused = api_client(phone_token).delete("/v1/memories/6f1c3a52-0c1e-4c55-9d1c-8f0f5b1d2e3a")
    assert refused.status_code == 404

    rows = {row.operation: row for row in AuditEvent.objects.filter(subject_user_id=alice.pk, channel="rest")}
    assert rows["remember"].actor_credential == f"key:{laptop.key_id}"
    assert rows["search_memory"].actor_credential == f"key:{phone.key_id}"
    assert rows["delete_memory"].actor_credential == f"key:{phone.key_id}"  # a refusal too
    assert laptop_token not in str(rows["remember"].actor_credential)

    found = admin_client.get("/admin/audit/auditevent/", {"q": f"key:{laptop.key_id}"})
    assert [(e.operation, e.memory_ids) for e in found.context["cl"].result_list] == [("remember", [memory_id])]


def test_a_delegated_call_names_the_services_key(acme, api_client):  # noqa: F811
    ann = tenant_user_create(tenant=acme, username="ann")
    bot = tenant_user_create(tenant=acme, username="acme-bot")
    service = api_client(_key(bot, "read", "write", role=Role.TENANT_ADMIN))
    bot_key = bot.api_keys.get()
    response = service.post("/v1/memories", {"memory": "Ann's locker is 12"}, format="json", **{SUBJECT: "acme/ann"})
    assert response.status_code == 201
    row = AuditEvent.objects.get(subject_user_id=ann.pk, operation="remember")
    assert row.actor_user_id == bot.pk and row.actor_credential == f"key:{bot_key.key_id}"
