"""Review 20: staff actions in the admin, turn events and sealed lifecycle names.

- the admin adds no tenant membership (adding one moved a user's partition, hiding their
  memories, unaudited);
- deleting a user in the admin erases their data first and is audited;
- the toolkit's searches and stores inside a turn are turn events; a dry-run delete is not;
- staff rows name the subject's tenant (their Activity page lists them);
- session names and projects in audit details are sealed (erased with the user)."""

from __future__ import annotations

import json

import pytest

from audit.crypto import ERASED, content_display, is_sealed
from audit.models import AuditEvent, SubjectKey
from core.choices import Operation
from core.scope import CallContext, MemoryScope
from memories.auth import Principal
from memories.models import ApiKey, ContentHash, TenantMembership
from memories.operations import operation_execute
from memories.services import api_key_issue, memory_list, memory_remember
from memories.tenancy import tenant_create, tenant_user_create
from tests.conftest import internal_call
from tests.engine_helpers import memory_gone

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]


def _last_id() -> int:
    row = AuditEvent.objects.order_by("-id").first()
    return row.pk if row else 0


def _admin_rows_after(mark: int) -> list[AuditEvent]:
    return list(AuditEvent.objects.filter(id__gt=mark, channel="admin").order_by("id"))


def _run(user, name: str, arguments: dict, *, turn_id: str = "") -> AuditEvent:
    call = CallContext(channel="mcp", turn_id=turn_id)
    operation_execute(Principal(user=user, method="api_key", client_app="agent"), name, arguments, call=call)
    return AuditEvent.objects.get(request_id=call.request_id)


# --- 1: tenants and tenant membership -------------------------------------------------------------
def test_admin_tenant_changes_follow_the_name_rule_and_are_audited(admin_client):
    """Adding a tenant in the admin took any slug ('Acme' could then never be named in
    X-Memory-Subject) and left no audit row; so did changing a display name."""
    from memories.models import Tenant

    mark = _last_id()
    refused = admin_client.post("/admin/memories/tenant/add/", {"name": "Acme", "display_name": "Acme"})
    assert refused.status_code == 200 and "lowercase letters" in refused.content.decode()
    assert not Tenant.objects.filter(name__iexact="acme").exists()
    assert admin_client.post("/admin/memories/tenant/add/", {"name": "acme", "display_name": "Acme"}).status_code == 302
    changed = admin_client.post("/admin/memories/tenant/acme/change/", {"display_name": "Acme Inc."})
    assert changed.status_code == 302 and Tenant.objects.get(name="acme").display_name == "Acme Inc."
    rows = _admin_rows_after(mark)
    assert [(r.operation, r.detail, r.staff_username) for r in rows] == [
        (
            Operation.ADMIN_SAVE_TENANT,
            {"tenant": "acme", "created": True, "changed": ["display_name", "name"]},
            "admin",
        ),
        (Operation.ADMIN_SAVE_TENANT, {"tenant": "acme", "created": False, "changed": ["display_name"]}, "admin"),
    ]


# --- 1: tenant membership ------------------------------------------------------------------------
def test_admin_adds_no_tenant_membership_and_the_users_memories_stay_reachable(admin_client, alice):
    tenant_create(name="acme")
    mid = memory_remember(MemoryScope.for_user(alice), memory="Alice's sister is Maja", call=internal_call()).id
    assert admin_client.get("/admin/memories/tenantmembership/add/").status_code == 403
    response = admin_client.post("/admin/memories/tenantmembership/add/", {"user": alice.pk, "tenant": "acme"})
    assert response.status_code == 403
    assert not TenantMembership.objects.filter(user=alice).exists()
    alice_now = type(alice).objects.get(pk=alice.pk)
    page = memory_list(MemoryScope.for_user(alice_now), call=internal_call())
    assert [m.id for m in page.memories] == [mid]
    # The list page says where a user's tenant is set.
    listing = admin_client.get("/admin/memories/tenantmembership/").content.decode()
    assert "--create-user" in listing


def test_admin_cannot_change_an_existing_membership(admin_client):
    tenant_create(name="acme")
    tenant_create(name="other")
    ann = tenant_user_create(tenant="acme", username="ann")
    url = f"/admin/memories/tenantmembership/{ann.pk}/change/"
    assert admin_client.get(url).status_code == 200  # view only
    admin_client.post(url, {"user": ann.pk, "tenant": "other"})
    assert TenantMembership.objects.get(user=ann).tenant_id == "acme"


# --- 2: user delete ------------------------------------------------------------------------------
def _web_only_user_with_a_memory(user) -> str:
    return memory_remember(MemoryScope.for_user(user), memory="Alice's PIN hint is her cat", call=internal_call()).id


def test_admin_user_delete_erases_the_users_data_and_is_audited(admin_client, alice):
    scope = MemoryScope.for_user(alice)
    mid = _web_only_user_with_a_memory(alice)
    assert admin_client.get(f"/admin/auth/user/{alice.pk}/delete/").status_code == 200  # the confirmation page
    mark = _last_id()
    response = admin_client.post(f"/admin/auth/user/{alice.pk}/delete/", {"post": "yes"}, follow=True)
    assert response.redirect_chain[-1][0] == "/admin/auth/user/"
    assert "All data of" in response.content.decode()
    assert not type(alice).objects.filter(pk=alice.pk).exists()
    assert memory_gone(mid)
    assert not ContentHash.objects.filter(engine_user_id=scope.engine_user_id).exists()
    assert not SubjectKey.objects.filter(subject_user_id=alice.pk).exists()
    rows = [(r.operation, r.subject_user_id, r.staff_username, r.tenant) for r in _admin_rows_after(mark)]
    assert rows == [
        (Operation.ADMIN_WIPE_USER_DATA, alice.pk, "admin", "default"),
        (Operation.ADMIN_DELETE_USER, alice.pk, "admin", "default"),
    ]


def test_user_delete_needs_the_erase_permission_and_has_no_bulk_action(client, django_user_model, alice):
    from django.contrib.auth.models import Permission

    staff = django_user_model.objects.create_user("staffer", password="pw-staffer-1", is_staff=True)
    staff.user_permissions.add(*Permission.objects.filter(codename__in=("view_user", "delete_user")))
    client.force_login(staff)
    assert client.post(f"/admin/auth/user/{alice.pk}/delete/", {"post": "yes"}).status_code == 403
    assert type(alice).objects.filter(pk=alice.pk).exists()
    staff.user_permissions.add(Permission.objects.get(codename="erase_user_data"))
    listing = client.get("/admin/auth/user/").content.decode()
    assert "delete_selected" not in listing


def test_a_failed_erasure_deletes_nothing_and_is_audited(admin_client, alice, monkeypatch):
    from core.errors import ErrorCode, ServiceError
    from memories.toolkit import services as toolkit_services

    mid = _web_only_user_with_a_memory(alice)

    def fail(*args, **kwargs):
        raise ServiceError(ErrorCode.BACKEND_UNAVAILABLE, "engine down")

    monkeypatch.setattr(toolkit_services, "engine_purge_messages", fail)
    mark = _last_id()
    response = admin_client.post(f"/admin/auth/user/{alice.pk}/delete/", {"post": "yes"}, follow=True)
    assert "Could not erase" in response.content.decode()
    assert type(alice).objects.filter(pk=alice.pk).exists()
    assert not memory_gone(mid)
    rows = [(r.operation, r.outcome) for r in _admin_rows_after(mark)]
    assert rows == [(Operation.ADMIN_WIPE_USER_DATA, "error")]


# --- 3, 4: turn events ---------------------------------------------------------------------------
def test_toolkit_searches_and_stores_inside_a_turn_are_turn_events(alice):
    memory_remember(MemoryScope.for_user(alice), memory="Alice drinks green tea", call=internal_call())
    _run(alice, "store_decision", {"key": "drink", "value": "tea"})
    events = {
        name: _run(alice, name, arguments, turn_id="turn-1").turn_event
        for name, arguments in (
            ("recall_memory", {"query": "tea"}),
            ("hybrid_search", {"query": "tea"}),
            ("check_cache", {"query": "what do I drink?"}),
            ("recall_decision", {"key": "drink"}),
            (
                "store_memory",
                {"conversation_id": "c1", "messages": [{"role": "user", "content": "I moved to Lyon last spring"}]},
            ),
            ("store_decision", {"key": "editor", "value": "helix"}),
            ("store_cache", {"query": "what do I drink?", "response": "green tea"}),
            ("cache_invalidate", {"pattern": "drink"}),
        )
    }
    assert events == {
        "recall_memory": "memory_recall",
        "hybrid_search": "memory_recall",
        "check_cache": "memory_recall",
        "recall_decision": "memory_recall",
        "store_memory": "memory_write",
        "store_decision": "memory_write",
        "store_cache": "memory_write",
        "cache_invalidate": "memory_forget",
    }


def test_a_dry_run_delete_is_no_forget_event(alice):
    mid = memory_remember(MemoryScope.for_user(alice), memory="Alice drinks green tea", call=internal_call()).id
    bulk = _run(alice, "delete_memory", {"memory_type": "user", "dry_run": True}, turn_id="turn-1")
    by_id = _run(alice, "toolkit_delete_memory", {"memory_id": mid, "dry_run": True}, turn_id="turn-1")
    assert not memory_gone(mid)
    assert (bulk.turn_id, bulk.turn_event) == ("turn-1", "")
    assert (by_id.turn_id, by_id.turn_event) == ("turn-1", "")
    # A real delete in the same turn still is one.
    assert _run(alice, "delete_memory", {"memory_id": mid}, turn_id="turn-1").turn_event == "memory_forget"


# --- 5: staff rows name the subject's tenant -----------------------------------------------------
def test_admin_key_revocation_is_on_the_subjects_activity_page(admin_client):
    from memories.selectors import memory_activity

    tenant_create(name="acme")
    ann = tenant_user_create(tenant="acme", username="ann")
    key, _ = api_key_issue(user=ann, name="ann-agent")
    response = admin_client.post("/admin/memories/apikey/", {"action": "revoke", "_selected_action": [key.pk]})
    assert response.status_code in (200, 302)
    key.refresh_from_db()
    assert key.revoked_at is not None
    row = AuditEvent.objects.get(operation=Operation.ADMIN_REVOKE_API_KEY)
    assert (row.tenant, row.subject_user_id, row.staff_username) == ("acme", ann.pk, "admin")
    assert "admin_revoke_api_key" in [a["operation"] for a in memory_activity(MemoryScope.for_user(ann))]
    assert ApiKey.objects.filter(user=ann, revoked_at__isnull=True).count() == 0


# --- 6: lifecycle names are sealed ---------------------------------------------------------------
def test_session_names_and_projects_in_audit_details_are_sealed_and_erased(alice, client):
    mark = "Qzxsealed"
    _run(
        alice,
        "memory_after_turn",
        {
            "project": f"{mark}proj",
            "session_id": f"{mark}-session",
            "turn_id": "t-1",
            "input_items": [{"type": "message", "role": "user", "content": "I prefer coffee over tea."}],
            "output_items": [{"type": "message", "role": "assistant", "content": "Noted."}],
        },
    )
    _run(alice, "memory_run_maintenance", {"project": f"{mark}proj", "session_id": f"{mark}-session"})
    rows = list(AuditEvent.objects.filter(subject_user_id=alice.pk, detail__has_key="content"))
    assert {r.operation for r in rows} >= {"memory_after_turn", "memory_run_maintenance"}
    for row in rows:
        assert mark not in json.dumps(row.detail)
        assert is_sealed(row.detail["content"])
        assert content_display(row.detail["content"])["session_id"] == f"{mark}-session"
    client.force_login(alice)
    assert client.post("/erase/", {"confirmation": "erase all my data"}).status_code == 302
    for row in AuditEvent.objects.filter(pk__in=[r.pk for r in rows]):
        assert content_display(row.detail["content"]) == ERASED
