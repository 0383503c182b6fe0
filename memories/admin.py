import uuid

from django import forms
from django.conf import settings
from django.contrib import admin, messages
from django.contrib.auth import get_user_model
from django.db import transaction
from django.db.models import Q

from audit.admin import ContentListAudited, IndexOrderedChangeList, LargeTableAdmin, ReadOnlyAdmin, history_table
from audit.services import audit_staff_action
from core.choices import Operation
from core.errors import ServiceError
from core.inputs import digits_int
from core.scope import DEFAULT_TENANT, MemoryScope, user_tenant
from memories.engine import (
    EngineMemory,
    engine_memory_of,
    engine_rows_matching,
    engine_rows_newest_first,
    engine_rows_of,
)
from memories.interfaces.web.login import AdminLoginForm
from memories.models import ApiKey, EngineMemoryRow, ExternalIdentity, RateWindow, Tenant, TenantMembership
from memories.selectors import SYSTEM_KEYS
from memories.services import api_key_revoke
from memories.tenancy import tenant_name_check

# The admin's sign-in counts against the login throttle too (else a way around it).
admin.site.login_form = AdminLoginForm


def _memory(row: EngineMemoryRow) -> EngineMemory:
    return engine_memory_of(row)


def _user_pk(engine_user_id: str) -> int | None:
    _, _, pk = (engine_user_id or "").rpartition(":")
    return digits_int(pk)


def _partitions_of_user(user_pk: int) -> list[MemoryScope]:
    """Where `user:<pk>` looks. A user's tenant never changes, so their memories are in one
    partition, `<tenant>:<pk>`: an exact lookup in the engine's paging index (a match on
    the key's end read every row). Rows left behind by a deleted account may be under
    any tenant: then each tenant's partition of that pk is looked up."""
    user = get_user_model().objects.select_related("tenant_membership").filter(pk=user_pk).first()
    if user is not None:
        tenants = [user_tenant(user)]
    else:
        tenants = sorted({DEFAULT_TENANT, *Tenant.objects.values_list("name", flat=True)})
    return [MemoryScope(tenant=tenant, user_pk=user_pk) for tenant in tenants]


class _MemoriesChangeList(IndexOrderedChangeList):
    """A search for one memory id orders by id alone: one row needs no order, and newest
    first let the planner, on a small table, walk the (created_at, id) index testing each
    entry's id (a coin toss against the primary key at equal cost)."""

    def get_ordering(self, request, queryset):
        try:
            uuid.UUID(self.query.strip())
        except ValueError:
            return super().get_ordering(request, queryset)
        return ["pk"]


@admin.register(EngineMemoryRow)
class MemoryAdmin(ContentListAudited, LargeTableAdmin, ReadOnlyAdmin):
    """The engine's table, read-only. Opening a memory (its content), or a page of them,
    is audited."""

    list_display = (
        "id",
        "owner",
        "text_short",
        "memory_type",
        "tags",
        "pinned",
        "source",
        "state",
        "created",
        "updated",
    )
    search_fields = ("id",)
    search_help_text = 'Whole words of the memory text ("a phrase" in quotes), a memory id, or user:<id>.'
    fields = (
        "id", "owner", "text", "memory_type", "tags", "importance", "agent_id", "session_id", "expires_at",
        "why_stored", "recalls", "state", "pinned", "source", "client_app", "metadata", "created", "updated",
        "history",
    )  # fmt: skip
    readonly_fields = fields
    list_per_page = 100  # newest first only (LargeTableAdmin: no column sorts)

    def get_queryset(self, request):
        return engine_rows_newest_first(super().get_queryset(request))

    def get_changelist(self, request, **kwargs):
        return _MemoriesChangeList

    def get_search_results(self, request, queryset, search_term):
        term = search_term.strip()
        if not term:
            return queryset, False
        user_pk = digits_int(term.removeprefix("user:")) if term.startswith("user:") else None
        if user_pk is not None:
            return engine_rows_of(queryset, _partitions_of_user(user_pk)), False
        return engine_rows_matching(queryset, term), False

    def shown_memory_id(self, obj) -> str:
        return str(obj.id)

    def change_view(self, request, object_id, form_url="", extra_context=None):
        memory = self.get_object(request, object_id)
        # Audited only when it will be shown: staff without the permission get 403.
        if memory is not None and self.has_view_or_change_permission(request, memory):
            audit_staff_action(
                request,
                operation=Operation.ADMIN_VIEW_MEMORY,
                subject_user_id=_user_pk(engine_memory_of(memory).user_id),
                memory_ids=[str(memory.id)],
                tenant=(engine_memory_of(memory).user_id or "").rpartition(":")[0] or DEFAULT_TENANT,
            )
        return super().change_view(request, object_id, form_url, extra_context)

    @admin.display(description="user")
    def owner(self, obj):
        return _user_pk(_memory(obj).user_id)

    @admin.display(description="text")
    def text_short(self, obj):
        return (_memory(obj).text or "")[:100]

    @admin.display(description="text")
    def text(self, obj):
        return _memory(obj).text

    @admin.display(boolean=True)
    def pinned(self, obj):
        return bool(_memory(obj).metadata.get("pinned"))

    def source(self, obj):
        return _memory(obj).metadata.get("source")

    @admin.display(description="type")
    def memory_type(self, obj):
        return _memory(obj).attrs.memory_type

    def tags(self, obj):
        return ", ".join(_memory(obj).attrs.tags)

    def importance(self, obj):
        return _memory(obj).attrs.importance

    def agent_id(self, obj):
        return _memory(obj).attrs.agent_id

    def session_id(self, obj):
        return _memory(obj).attrs.session_id

    def expires_at(self, obj):
        return _memory(obj).attrs.expires_at

    def why_stored(self, obj):
        return _memory(obj).attrs.why_stored

    @admin.display(description="recalled")
    def recalls(self, obj):
        memory = _memory(obj)
        return f"{memory.access_count} times, last {memory.last_recalled_at or 'never'}"

    @admin.display(description="state")
    def state(self, obj):
        trash = _memory(obj).trash
        return f"in trash since {trash.at} ({trash.operation})" if trash else "live"

    def client_app(self, obj):
        return _memory(obj).metadata.get("client_app")

    def metadata(self, obj):
        return {k: v for k, v in _memory(obj).metadata.items() if k not in SYSTEM_KEYS}

    def created(self, obj):
        return _memory(obj).created_at

    def updated(self, obj):
        return _memory(obj).updated_at

    @admin.display(description="history")
    def history(self, obj):
        return history_table(str(obj.id))


@admin.register(ApiKey)
class ApiKeyAdmin(ReadOnlyAdmin):
    list_display = (
        "key_id", "user", "name", "role", "permissions", "expires_at", "created_at", "last_used_at", "revoked_at"
    )  # fmt: skip
    list_filter = (("revoked_at", admin.EmptyFieldListFilter), "role")
    search_fields = ("=key_id", "user__username")
    actions = ("revoke",)
    readonly_fields = (
        "user", "name", "key_id", "role", "permissions", "expires_at", "created_at", "last_used_at", "revoked_at"
    )  # fmt: skip
    exclude = ("secret_hash",)

    @admin.action(description="Revoke the selected keys", permissions=["revoke"])
    def revoke(self, request, queryset):
        revoked = 0
        for key in queryset.select_related("user", "user__tenant_membership"):
            # The audit row commits with the revocation or not at all.
            with transaction.atomic():
                # call=None: the owner's own revocation row is not written; staff get theirs below.
                if api_key_revoke(user=key.user, key_id=key.key_id, call=None):
                    revoked += 1
                    audit_staff_action(
                        request,
                        operation=Operation.ADMIN_REVOKE_API_KEY,
                        subject_user_id=key.user_id,
                        detail={"key_id": key.key_id},
                        tenant=user_tenant(key.user),  # on the owner's Activity page
                    )
        self.message_user(request, f"{revoked} key(s) revoked.", messages.SUCCESS)

    def has_revoke_permission(self, request):
        return request.user.has_perm("memories.change_apikey")


class RateWindowOperationFilter(admin.SimpleListFilter):
    """The rate-limited operations, from the settings: Django's filter of the column ran
    SELECT DISTINCT over every window on each page. A window's operation is the limit it
    counts, so the match is exact (the `rate_window_operation_recent` index); a service
    credential's own windows read `operation@credential` and are found by its account."""

    title = "operation"
    parameter_name = "operation"

    def lookups(self, request, model_admin):
        return [(op, op) for op in Operation.values if op in settings.RATE_LIMITS]

    def queryset(self, request, queryset):
        return queryset.filter(operation=self.value()) if self.value() else queryset


@admin.register(RateWindow)
class RateWindowAdmin(LargeTableAdmin, ReadOnlyAdmin):
    """Every rate-limited call writes or bumps a window (pruned after two days): the list
    reads pages from indexes, with a bounded count, like the audit trail's."""

    list_display = ("user", "operation", "window_start", "window_seconds", "count")
    list_filter = (RateWindowOperationFilter,)
    search_fields = ("user__username",)  # shows the search box; see get_search_results
    search_help_text = (
        "A username (exact), the start of one followed by * (e.g. ali*), or a user id. "
        "A service credential's own windows are its account's, as operation@credential."
    )
    ordering = ("-window_start",)
    sortable_by = ("window_start",)  # rate_window_recent, both ways
    list_per_page = 100

    def get_search_results(self, request, queryset, search_term):
        """The users the term names, found through auth_user's indexes (the username's
        unique index, its pattern index for a prefix, the primary key), then their
        windows through the (user, ...) index. A substring match compared upper() of
        every username and joined the windows of all of them."""
        term = search_term.strip()
        if not term:
            return queryset, False
        users = get_user_model().objects.all()
        if term.endswith("*"):
            prefix = term.removesuffix("*")
            if not prefix:
                return queryset, False
            users = users.filter(username__startswith=prefix)  # LIKE 'prefix%', escaped
        else:
            named = Q(username=term)
            user_id = digits_int(term)
            if user_id is not None:
                named |= Q(pk=user_id)
            users = users.filter(named)
        return queryset.filter(user_id__in=users.values("pk")), False


@admin.register(ExternalIdentity)
class ExternalIdentityAdmin(ReadOnlyAdmin):
    list_display = ("user", "issuer", "subject", "created_at")
    search_fields = ("=subject", "user__username")


class TenantForm(forms.ModelForm):
    class Meta:
        model = Tenant
        fields = ("name", "display_name")

    def clean_name(self) -> str:
        # The rule manage.py create_tenant applies (a slug also allows capitals, and
        # X-Memory-Subject could not name such a tenant).
        try:
            return tenant_name_check(self.cleaned_data["name"])
        except ServiceError as exc:
            raise forms.ValidationError(exc.message) from None


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    """Organisations (issue 12). The name is the first half of every partition key of
    the tenant's users, so it is fixed once created. Adding one or renaming its display
    name is audited (in the admin's transaction of the change)."""

    form = TenantForm
    list_display = ("name", "display_name", "created_at")
    search_fields = ("name", "display_name")

    def save_model(self, request, obj, form, change):
        super().save_model(request, obj, form, change)
        audit_staff_action(
            request,
            operation=Operation.ADMIN_SAVE_TENANT,
            detail={"tenant": obj.name, "created": not change, "changed": sorted(form.changed_data)},
        )

    def get_readonly_fields(self, request, obj=None):
        return ("name", "created_at") if obj is not None else ("created_at",)

    def has_delete_permission(self, request, obj=None):
        return False  # users (and their partitions) point at it


TENANT_MEMBERSHIP_HELP = (
    "A user's tenant is set when the user is created (manage.py issue_api_key USERNAME --create-user "
    "--tenant NAME) and never changes here: it is the first half of the user's partition, so moving "
    "a user would hide all of their memories."
)


@admin.register(TenantMembership)
class TenantMembershipAdmin(admin.ModelAdmin):
    """Which tenant a user is in, read-only. A user without a row (create_account,
    createsuperuser) is in the default tenant and already has their partition there:
    adding a row here would move it, so the admin adds none."""

    list_display = ("user", "tenant")
    list_filter = ("tenant",)
    search_fields = ("user__username",)
    readonly_fields = ("user", "tenant")

    def changelist_view(self, request, extra_context=None):
        return super().changelist_view(request, {**(extra_context or {}), "subtitle": TENANT_MEMBERSHIP_HELP})

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False
