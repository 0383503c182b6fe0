"""Deleting a user in the admin: the user's own rows (tenant membership, API keys, rate
windows, decisions, OIDC identities...) sit in read-only admins, and Django's delete
confirmation refused the whole delete for them (403, even for a superuser), so no user with
a membership or a key could be deleted at all. The erasure removes them first, and the
cascade whatever is left: they must not block."""

from __future__ import annotations

import pytest

from audit.models import AuditEvent, SubjectKey
from core.choices import Operation
from core.scope import MemoryScope
from memories.auth import authenticate_bearer
from memories.models import ApiKey, ContentHash, ExternalIdentity, RateWindow, TenantMembership
from memories.services import api_key_issue, memory_remember
from memories.tenancy import tenant_create, tenant_user_create
from memories.toolkit.models import Decision
from memories.toolkit.services import toolkit_decision_store
from tests.conftest import internal_call
from tests.engine_helpers import memory_gone

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]


def _user_with_everything():
    """A user as they are in real life: a tenant membership, a key, an OIDC identity, and
    a remember and a decision (which leave rate rows)."""
    tenant_create(name="acme")
    ann = tenant_user_create(tenant="acme", username="ann")
    _, secret = api_key_issue(user=ann, name="ann-agent")
    ExternalIdentity.objects.create(user=ann, issuer="https://idp.example", subject="ann-sub")
    scope = MemoryScope.for_user(ann)
    mid = memory_remember(scope, memory="Ann's locker code is 4711", call=internal_call()).id
    toolkit_decision_store(scope, key="editor", value="helix", call=internal_call())
    assert RateWindow.objects.filter(user=ann).exists()  # what blocked the delete too
    return ann, scope, secret, mid


def test_admin_deletes_a_user_with_a_membership_keys_and_data(admin_client):
    ann, scope, secret, mid = _user_with_everything()
    page = admin_client.get(f"/admin/auth/user/{ann.pk}/delete/")
    assert page.status_code == 200
    assert "permission to delete" not in page.content.decode()
    mark = AuditEvent.objects.order_by("-id").values_list("id", flat=True).first() or 0

    response = admin_client.post(f"/admin/auth/user/{ann.pk}/delete/", {"post": "yes"})

    assert response.status_code == 302 and response["Location"] == "/admin/auth/user/"
    assert not type(ann).objects.filter(pk=ann.pk).exists()
    assert memory_gone(mid)
    assert not ContentHash.objects.filter(engine_user_id=scope.engine_user_id).exists()
    assert not SubjectKey.objects.filter(subject_user_id=ann.pk).exists()
    for model in (ApiKey, Decision, RateWindow, ExternalIdentity, TenantMembership):
        assert not model.objects.filter(user_id=ann.pk).exists(), model.__name__
    assert authenticate_bearer(f"Bearer {secret}") is None
    rows = AuditEvent.objects.filter(id__gt=mark, channel="admin").order_by("id")
    assert [(r.operation, r.subject_user_id, r.staff_username, r.tenant) for r in rows] == [
        (Operation.ADMIN_WIPE_USER_DATA, ann.pk, "admin", "acme"),
        (Operation.ADMIN_DELETE_USER, ann.pk, "admin", "acme"),
    ]


def test_the_related_rows_do_not_open_the_delete_to_staff_without_the_erase_permission(client, django_user_model):
    from django.contrib.auth.models import Permission

    ann, _, _, mid = _user_with_everything()
    staff = django_user_model.objects.create_user("staffer", password="pw-staffer-1", is_staff=True)
    staff.user_permissions.add(*Permission.objects.filter(codename__in=("view_user", "delete_user")))
    client.force_login(staff)
    assert client.post(f"/admin/auth/user/{ann.pk}/delete/", {"post": "yes"}).status_code == 403
    assert type(ann).objects.filter(pk=ann.pk).exists() and not memory_gone(mid)
    # No bulk delete on the user list either: it would skip the erasure.
    staff.user_permissions.add(Permission.objects.get(codename="erase_user_data"))
    response = client.post(
        "/admin/auth/user/", {"action": "delete_selected", "_selected_action": [ann.pk], "post": "yes"}
    )
    assert response.status_code in (200, 302)
    assert type(ann).objects.filter(pk=ann.pk).exists() and not memory_gone(mid)
