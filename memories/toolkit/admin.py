"""Issue 14 in the admin: decisions and cache entries (read-only; content stays the
user's), the audited "erase all data" action for erasure requests, the user admin,
whose delete runs that erasure first, and the audited permission group admin."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.utils import unquote
from django.contrib.auth import get_user_model
from django.contrib.auth.admin import GroupAdmin, UserAdmin
from django.contrib.auth.models import Group
from django.db import transaction
from django.db.models import Q
from django.http import HttpRequest, HttpResponseRedirect
from django.urls import reverse
from django.utils.decorators import method_decorator
from django.views.decorators.debug import sensitive_post_parameters

from audit.admin import LargeTableAdmin, ReadOnlyAdmin
from audit.services import audit_failure, audit_record, audit_staff_action
from core.calls import call_context_from_request
from core.choices import Channel, Operation
from core.errors import ServiceError
from core.inputs import digits_int
from core.scope import MemoryScope, user_tenant
from memories.sessions import erasure_account_deleted
from memories.toolkit.models import CacheEntry, Decision, ErasureSubject
from memories.toolkit.services import toolkit_user_data_wipe

logger = logging.getLogger(__name__)


class UserRowsAdmin(LargeTableAdmin, ReadOnlyAdmin):
    """Rows every user adds to with use (decisions, cached answers): listed newest id
    first with a bounded count and no column sort (LargeTableAdmin), searched by exact
    username or user id."""

    list_select_related = ("user",)
    search_fields = ("user__username",)  # shows the search box; see get_search_results
    search_help_text = "A username (exact) or user id."

    def get_search_results(self, request, queryset, search_term):
        """The user the term names, found through auth_user's indexes, then their rows
        through the table's (user, ...) index. A substring of the username (Django's
        default) compared upper() of every user's name; and an OR of the username and
        the row's user id cannot be split over the join, so it read every row too."""
        term = search_term.strip()
        if not term:
            return queryset, False
        named = Q(username=term)
        user_id = digits_int(term)
        if user_id is not None:
            named |= Q(pk=user_id)
        return queryset.filter(user_id__in=get_user_model().objects.filter(named).values("pk")), False


@admin.register(Decision)
class DecisionAdmin(UserRowsAdmin):
    """Staff see that a decision exists, whose it is and when, not what it says: its key
    (e.g. "hiv_medication_schedule") is content like its value, sealed in the audit trail,
    so it is neither shown nor searched, as a cached answer's query is not."""

    list_display = ("id", "user", "created_at", "updated_at", "expires_at")
    fields = ("user", "created_at", "updated_at", "expires_at")


@admin.register(CacheEntry)
class CacheEntryAdmin(UserRowsAdmin):
    list_display = ("id", "user", "created_at", "expires_at")
    exclude = ("query", "response", "embedding")


@admin.register(ErasureSubject)
class ErasureSubjectAdmin(ReadOnlyAdmin):
    list_display = ("username", "email", "date_joined", "last_login", "is_active")
    search_fields = ("=username", "=email")
    fields = ("username", "email", "date_joined", "last_login", "is_active")
    actions = ("erase",)

    @admin.action(description="Erase ALL data of the selected users (erasure request)", permissions=["erase"])
    def erase(self, request, queryset):
        erased: list[str] = []
        failed: list[str] = []
        for user in queryset:
            # A user whose erasure fails is named, and the others still go: staff must know
            # exactly who was erased (each one's audit row says so too).
            if user_erase_by_staff(request, user, delete_account=False):
                erased.append(user.get_username())
            else:
                failed.append(user.get_username())
        if erased:
            self.message_user(
                request, f"Erased all data of {len(erased)} user(s): {', '.join(erased)}.", messages.SUCCESS
            )
        if failed:
            self.message_user(
                request,
                f"Could not erase {len(failed)} user(s): {', '.join(failed)}. Nothing of theirs was deleted; retry.",
                messages.ERROR,
            )

    def has_erase_permission(self, request):
        return request.user.has_perm("toolkit.erase_user_data")


def user_erase_by_staff(request: HttpRequest, user: Any, *, delete_account: bool) -> bool:
    """Erase all data of `user` for staff (and, with `delete_account`, delete the account
    too), in one transaction with the staff audit rows. False when the erasure failed:
    nothing of the user's was deleted, and the attempt is audited."""
    scope = MemoryScope.for_user(user)
    staff_call = call_context_from_request(request, channel=Channel.ADMIN, staff=True)
    call = replace(staff_call, actor_username=user.get_username())
    try:
        with transaction.atomic():
            toolkit_user_data_wipe(scope, confirm=True, call=call, operation=Operation.ADMIN_WIPE_USER_DATA)
            if delete_account:
                # The erasure ledger's record says so: a restore must delete the account again.
                erasure_account_deleted(scope)
                # The erasure's request id: the audit trail ties the deletion to the erasure
                # (`manage.py erasures --since` lists it as deleting the account). The tenant
                # is named: the membership goes with the user.
                audit_record(scope, call=staff_call, operation=Operation.ADMIN_DELETE_USER)
                user.delete()
    except ServiceError as exc:
        logger.warning("admin erasure failed for user %s (%s)", user.pk, exc.code.value)
        # The wipe rolled back with its own audit row: record the attempt.
        audit_failure(scope, call=call, operation=Operation.ADMIN_WIPE_USER_DATA, error=exc)
        return False
    return True


User = get_user_model()
if admin.site.is_registered(User):
    admin.site.unregister(User)


@admin.register(User)
class ErasingUserAdmin(UserAdmin):
    """Django's user admin, except that deleting a user first erases all of their data
    (memories, history, session log, data key...: what "erase all data" does), audited.
    A plain delete would leave that data behind, unreachable and never erased. One user
    at a time (no bulk delete): each deletion's outcome is reported truthfully; bulk
    erasure is the "erasure requests" page's action.

    Adding a user, changing one (staff, superuser, active, groups, permissions...) and
    setting or disabling a password are audited in the change's transaction: which fields
    changed (their names, never a password), on the subject's Activity page."""

    def has_delete_permission(self, request, obj=None):
        return super().has_delete_permission(request, obj) and request.user.has_perm("toolkit.erase_user_data")

    def get_actions(self, request):
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)
        return actions

    def get_deleted_objects(self, objs, request):
        """Django's confirmation, except that the user's own rows in read-only admins
        (tenant membership, API keys, rate windows, decisions, OIDC identities...) do not
        block the delete: the erasure removes them first and the cascade the rest. Staff
        who may delete (and erase) users are allowed that by this admin alone."""
        deleted, counts, perms_needed, protected = super().get_deleted_objects(objs, request)
        if self.has_delete_permission(request):
            perms_needed = set()
        return deleted, counts, perms_needed, protected

    def delete_model(self, request, obj):
        request._user_erase_failed = not user_erase_by_staff(request, obj, delete_account=True)

    def delete_queryset(self, request, queryset):
        for user in queryset:
            self.delete_model(request, user)

    def response_delete(self, request, obj_display, obj_id):
        if getattr(request, "_user_erase_failed", False):
            self.message_user(
                request,
                f"Could not erase the data of {obj_display}: nothing was deleted, the account stays. Retry.",
                messages.ERROR,
            )
            opts = self.opts
            return HttpResponseRedirect(reverse(f"admin:{opts.app_label}_{opts.model_name}_change", args=[obj_id]))
        self.message_user(request, f"All data of {obj_display} was erased.", messages.INFO)
        return super().response_delete(request, obj_display, obj_id)

    def save_model(self, request, obj, form, change):
        super().save_model(request, obj, form, change)
        # Inside the admin's transaction of the change, which also saves the groups and
        # permissions (save_related): named here as changed fields like any other.
        audit_staff_action(
            request,
            operation=Operation.ADMIN_CHANGE_USER if change else Operation.ADMIN_CREATE_USER,
            subject_user_id=obj.pk,
            detail={"changed": sorted(form.changed_data)},
            tenant=user_tenant(obj),
        )

    @method_decorator(sensitive_post_parameters())
    def user_change_password(self, request, id, form_url=""):
        if request.method != "POST":
            return super().user_change_password(request, id, form_url)
        # Django saves the new password outside any transaction: here the password and its
        # audit row commit together or not at all. Whether it changed is read from the row
        # (locked, so no concurrent change is taken for this one): a refused form, or
        # conflicting submit buttons, change nothing and are not audited.
        with transaction.atomic():
            user = self.get_object(request, unquote(id))
            before = self._password_hash_locked(user)
            response = super().user_change_password(request, id, form_url)
            if user is not None:
                user.refresh_from_db(fields=["password"])
                if user.password != before:
                    audit_staff_action(
                        request,
                        operation=Operation.ADMIN_SET_PASSWORD,
                        subject_user_id=user.pk,
                        detail={"changed": ["password"], "password_usable": user.has_usable_password()},
                        tenant=user_tenant(user),
                    )
        return response

    def _password_hash_locked(self, user: Any) -> str | None:
        if user is None:
            return None
        # NO KEY UPDATE: serialises password changes, but not the user's writers, which
        # key-share lock the row (`user_write_locks`) and would otherwise wait for the hash.
        rows = type(user).objects.select_for_update(no_key=True).filter(pk=user.pk)
        return rows.values_list("password", flat=True).first()


def _permission_labels(group: Group) -> set[str]:
    """The group's permissions as `has_perm` names them ("toolkit.erase_user_data")."""
    rows = group.permissions.values_list("content_type__app_label", "codename") if group.pk else []
    return {f"{app_label}.{codename}" for app_label, codename in rows}


if admin.site.is_registered(Group):
    admin.site.unregister(Group)


@admin.register(Group)
class AuditedGroupAdmin(GroupAdmin):
    """Django's group admin, audited as the user admin is: a group's permissions are what
    every member may do (view memories, erase users...), so adding, changing and deleting
    a group each write a staff row in the change's transaction, naming the permissions
    added and removed (names, not secrets). Rows name no subject user: membership changes
    are on the user's own row (`admin_change_user`, `groups`)."""

    def save_related(self, request, form, formsets, change):
        # After save_model: the group's row is locked by its UPDATE (a change) or new (an
        # add), so no concurrent edit of it slips between the two readings.
        before = _permission_labels(form.instance) if change else set()
        super().save_related(request, form, formsets, change)
        after = _permission_labels(form.instance)
        audit_staff_action(
            request,
            operation=Operation.ADMIN_CHANGE_GROUP if change else Operation.ADMIN_CREATE_GROUP,
            detail={
                "group": form.instance.name,
                "changed": sorted(form.changed_data),
                "permissions_added": sorted(after - before),
                "permissions_removed": sorted(before - after),
            },
        )

    def delete_model(self, request, obj):
        self.delete_queryset(request, Group.objects.filter(pk=obj.pk))

    def delete_queryset(self, request, queryset):
        # The delete view opens a transaction, Django's "delete selected" action none: the
        # rows and the deletion commit together here. Locked (a concurrent edit of a group
        # locks it too), so each row names what its group had when it went.
        with transaction.atomic():
            groups = list(Group.objects.select_for_update().filter(pk__in=queryset.values("pk")).order_by("pk"))
            for group in groups:
                audit_staff_action(
                    request,
                    operation=Operation.ADMIN_DELETE_GROUP,
                    detail={
                        "group": group.name,
                        "members": User.objects.filter(groups=group).count(),
                        "permissions_removed": sorted(_permission_labels(group)),
                    },
                )
            super().delete_queryset(request, Group.objects.filter(pk__in=[group.pk for group in groups]))
