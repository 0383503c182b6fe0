"""Staff changes to users and reading users' decisions in the admin leave an audit trail.

- adding a user, changing one (superuser, staff, active, groups, permissions) and setting
  or disabling a password each write a staff audit row, in the change's transaction, with
  the subject, their tenant and the NAMES of the changed fields (never a password); the
  rows are on the subject's Activity page;
- adding a group, changing one (its name, its permissions: what every member may do) and
  deleting one each write a staff audit row in the change's transaction, naming the
  permissions added and removed;
- the decisions admin shows that a decision exists, never its key (content the audit
  trail seals), and is searched by username or user id."""

from __future__ import annotations

import json

import pytest
from django.contrib.auth.models import Group, Permission

from audit.models import AuditEvent
from core.choices import Operation
from core.scope import MemoryScope
from memories.selectors import memory_activity
from memories.tenancy import tenant_create, tenant_user_create

pytestmark = [pytest.mark.django_db(transaction=True)]

NEW_PASSWORD = "Qz-new-secret-pw-4471"  # noqa: S105 - a test password


def _last_id() -> int:
    row = AuditEvent.objects.order_by("-id").first()
    return row.pk if row else 0


def _admin_rows_after(mark: int) -> list[AuditEvent]:
    return list(AuditEvent.objects.filter(id__gt=mark, channel="admin").order_by("id"))


def _change_form(user, **fields) -> dict:
    """The user change form as the admin posts it, unchanged except for `fields`."""
    joined = user.date_joined
    day, time = joined.strftime("%Y-%m-%d"), joined.strftime("%H:%M:%S")
    data = {
        "username": user.username,
        "email": user.email,
        "first_name": user.first_name,
        "last_name": user.last_name,
        # The page also posts the date as it showed it (a field with a callable default).
        "date_joined_0": day,
        "date_joined_1": time,
        "initial-date_joined_0": day,
        "initial-date_joined_1": time,
        "is_active": "on",
    }
    data.update(fields)
    return data


# --- 1: changes to users -------------------------------------------------------------------------
def test_making_a_user_superuser_is_audited_on_their_activity_page(admin_client):
    tenant_create(name="acme")
    ann = tenant_user_create(tenant="acme", username="ann")
    support = Group.objects.create(name="fixg-reviewers")
    mark = _last_id()
    response = admin_client.post(
        f"/admin/auth/user/{ann.pk}/change/",
        _change_form(ann, is_staff="on", is_superuser="on", groups=[support.pk]),
    )
    assert response.status_code == 302
    ann.refresh_from_db()
    assert ann.is_superuser and ann.is_staff
    rows = [(r.operation, r.subject_user_id, r.tenant, r.staff_username, r.detail) for r in _admin_rows_after(mark)]
    assert rows == [
        (Operation.ADMIN_CHANGE_USER, ann.pk, "acme", "admin", {"changed": ["groups", "is_staff", "is_superuser"]})
    ]
    assert "admin_change_user" in [a["operation"] for a in memory_activity(MemoryScope.for_user(ann))]


def test_revoking_access_is_audited(admin_client, bob):
    bob.is_staff = True
    bob.save()
    mark = _last_id()
    assert admin_client.post(f"/admin/auth/user/{bob.pk}/change/", _change_form(bob, is_active="")).status_code == 302
    bob.refresh_from_db()
    assert not bob.is_active and not bob.is_staff
    rows = [(r.operation, r.subject_user_id, r.tenant, r.detail) for r in _admin_rows_after(mark)]
    assert rows == [(Operation.ADMIN_CHANGE_USER, bob.pk, "default", {"changed": ["is_active", "is_staff"]})]


def test_adding_a_user_is_audited_without_the_password(admin_client, django_user_model):
    mark = _last_id()
    response = admin_client.post(
        "/admin/auth/user/add/",
        {"username": "carol", "usable_password": "true", "password1": NEW_PASSWORD, "password2": NEW_PASSWORD},
    )
    assert response.status_code == 302
    carol = django_user_model.objects.get(username="carol")
    rows = _admin_rows_after(mark)
    assert [(r.operation, r.subject_user_id, r.tenant, r.staff_username) for r in rows] == [
        (Operation.ADMIN_CREATE_USER, carol.pk, "default", "admin")
    ]
    assert rows[0].detail == {"changed": ["password1", "password2", "username"]}
    assert NEW_PASSWORD not in json.dumps(rows[0].detail)
    assert "admin_create_user" in [a["operation"] for a in memory_activity(MemoryScope.for_user(carol))]


# --- 1: passwords --------------------------------------------------------------------------------
def test_setting_a_users_password_is_audited_without_the_password(admin_client, bob):
    mark = _last_id()
    response = admin_client.post(
        f"/admin/auth/user/{bob.pk}/password/",
        {"usable_password": "true", "password1": NEW_PASSWORD, "password2": NEW_PASSWORD},
    )
    assert response.status_code == 302
    bob.refresh_from_db()
    assert bob.check_password(NEW_PASSWORD)
    rows = _admin_rows_after(mark)
    assert [(r.operation, r.subject_user_id, r.tenant, r.staff_username, r.detail) for r in rows] == [
        (Operation.ADMIN_SET_PASSWORD, bob.pk, "default", "admin", {"changed": ["password"], "password_usable": True})
    ]
    assert NEW_PASSWORD not in json.dumps([rows[0].detail, rows[0].before, rows[0].after])
    assert "admin_set_password" in [a["operation"] for a in memory_activity(MemoryScope.for_user(bob))]


def test_disabling_a_users_password_is_audited(admin_client, bob):
    mark = _last_id()
    response = admin_client.post(
        f"/admin/auth/user/{bob.pk}/password/", {"usable_password": "false", "unset-password": "1"}
    )
    assert response.status_code == 302
    bob.refresh_from_db()
    assert not bob.has_usable_password()
    rows = [(r.operation, r.subject_user_id, r.detail) for r in _admin_rows_after(mark)]
    assert rows == [(Operation.ADMIN_SET_PASSWORD, bob.pk, {"changed": ["password"], "password_usable": False})]


def test_a_refused_password_change_is_not_audited(admin_client, bob):
    mark = _last_id()
    response = admin_client.post(
        f"/admin/auth/user/{bob.pk}/password/",
        {"usable_password": "true", "password1": NEW_PASSWORD, "password2": "something else"},
    )
    assert response.status_code == 200  # the form again, with its error
    bob.refresh_from_db()
    assert bob.check_password("bob-password-1")
    assert _admin_rows_after(mark) == []


def test_a_password_change_whose_audit_row_fails_is_not_applied(admin_client, bob, monkeypatch):
    from memories.toolkit import admin as toolkit_admin

    def fail(*args, **kwargs):
        raise RuntimeError("audit down")

    monkeypatch.setattr(toolkit_admin, "audit_staff_action", fail)
    with pytest.raises(RuntimeError):
        admin_client.post(
            f"/admin/auth/user/{bob.pk}/password/",
            {"usable_password": "true", "password1": NEW_PASSWORD, "password2": NEW_PASSWORD},
        )
    bob.refresh_from_db()
    assert bob.check_password("bob-password-1")


# --- 1: groups -----------------------------------------------------------------------------------
def _permission(label: str) -> Permission:
    app_label, codename = label.split(".")
    return Permission.objects.get(content_type__app_label=app_label, codename=codename)


def _group_rows_after(mark: int) -> list[tuple]:
    return [(r.operation, r.subject_user_id, r.staff_username, r.detail) for r in _admin_rows_after(mark)]


def test_adding_a_group_is_audited_with_its_permissions(admin_client):
    mark = _last_id()
    response = admin_client.post(
        "/admin/auth/group/add/",
        {"name": "fixg-erasers", "permissions": [_permission("toolkit.erase_user_data").pk]},
    )
    assert response.status_code == 302
    assert Group.objects.filter(name="fixg-erasers").exists()
    detail = {
        "group": "fixg-erasers",
        "changed": ["name", "permissions"],
        "permissions_added": ["toolkit.erase_user_data"],
        "permissions_removed": [],
    }
    assert _group_rows_after(mark) == [(Operation.ADMIN_CREATE_GROUP, None, "admin", detail)]


def test_changing_a_groups_permissions_is_audited_by_codename(admin_client, bob):
    group = Group.objects.create(name="fixg-support")
    group.permissions.set([_permission("auth.view_user"), _permission("auth.change_user")])
    bob.groups.add(group)
    mark = _last_id()
    granted = [_permission("auth.view_user").pk, _permission("toolkit.erase_user_data").pk]
    response = admin_client.post(
        f"/admin/auth/group/{group.pk}/change/", {"name": "fixg-support", "permissions": granted}
    )
    assert response.status_code == 302
    assert bob.has_perm("toolkit.erase_user_data")
    detail = {
        "group": "fixg-support",
        "changed": ["permissions"],
        "permissions_added": ["toolkit.erase_user_data"],
        "permissions_removed": ["auth.change_user"],
    }
    assert _group_rows_after(mark) == [(Operation.ADMIN_CHANGE_GROUP, None, "admin", detail)]


def test_deleting_a_group_is_audited_with_what_its_members_lose(admin_client, alice, bob):
    kept = Group.objects.create(name="fixg-kept")
    one = Group.objects.create(name="fixg-one")
    one.permissions.set([_permission("toolkit.erase_user_data")])
    bob.groups.add(one)
    two = Group.objects.create(name="fixg-two")
    two.permissions.set([_permission("auth.view_user")])
    alice.groups.add(two)
    bob.groups.add(two)
    mark = _last_id()
    assert admin_client.post(f"/admin/auth/group/{one.pk}/delete/", {"post": "yes"}).status_code == 302
    response = admin_client.post(
        "/admin/auth/group/", {"action": "delete_selected", "_selected_action": [two.pk], "post": "yes"}
    )
    assert response.status_code == 302
    assert list(Group.objects.filter(name__startswith="fixg-").values_list("pk", flat=True)) == [kept.pk]
    assert _group_rows_after(mark) == [
        (
            Operation.ADMIN_DELETE_GROUP,
            None,
            "admin",
            {"group": "fixg-one", "members": 1, "permissions_removed": ["toolkit.erase_user_data"]},
        ),
        (
            Operation.ADMIN_DELETE_GROUP,
            None,
            "admin",
            {"group": "fixg-two", "members": 2, "permissions_removed": ["auth.view_user"]},
        ),
    ]


@pytest.mark.parametrize("action", ["change", "delete", "bulk delete"])
def test_a_group_change_whose_audit_row_fails_is_not_applied(admin_client, bob, monkeypatch, action):
    from memories.toolkit import admin as toolkit_admin

    group = Group.objects.create(name="fixg-support")
    group.permissions.set([_permission("auth.view_user")])

    def fail(*args, **kwargs):
        raise RuntimeError("audit down")

    monkeypatch.setattr(toolkit_admin, "audit_staff_action", fail)
    with pytest.raises(RuntimeError):
        if action == "change":
            granted = [_permission("toolkit.erase_user_data").pk]
            admin_client.post(f"/admin/auth/group/{group.pk}/change/", {"name": "fixg-support", "permissions": granted})
        elif action == "delete":
            admin_client.post(f"/admin/auth/group/{group.pk}/delete/", {"post": "yes"})
        else:
            admin_client.post(
                "/admin/auth/group/", {"action": "delete_selected", "_selected_action": [group.pk], "post": "yes"}
            )
    group.refresh_from_db()
    assert [p.codename for p in group.permissions.all()] == ["view_user"]


# --- 2: decisions --------------------------------------------------------------------------------
SECRET_KEY_NAME = "hiv_medication_schedule"


def _decision(user):
    from django.utils import timezone

    from memories.toolkit.models import Decision

    now = timezone.now()
    return Decision.objects.create(user=user, key=SECRET_KEY_NAME, value="08:00 daily", created_at=now, updated_at=now)


def test_the_decisions_admin_shows_that_a_decision_exists_never_its_key(admin_client, alice):
    decision = _decision(alice)
    listing = admin_client.get("/admin/toolkit/decision/")
    assert listing.status_code == 200
    assert "alice" in listing.content.decode()
    assert SECRET_KEY_NAME not in listing.content.decode()
    detail = admin_client.get(f"/admin/toolkit/decision/{decision.pk}/change/")
    assert detail.status_code == 200
    assert SECRET_KEY_NAME not in detail.content.decode()
    assert "08:00 daily" not in detail.content.decode()


def test_the_decisions_admin_is_searched_by_user_never_by_key(admin_client, alice, bob):
    decision = _decision(alice)
    _decision(bob)

    def found(term: str) -> list[int]:
        response = admin_client.get("/admin/toolkit/decision/", {"q": term})
        return [obj.pk for obj in response.context["cl"].result_list]

    assert found("alice") == [decision.pk]
    assert found(str(alice.pk)) == [decision.pk]
    assert found(SECRET_KEY_NAME) == []
