"""Staff view of the chat proxy's extraction outbox: which turns wait or were given up,
and a re-queue for those given up. The turns' messages (memory content) are not shown."""

from django.contrib import admin, messages
from django.db import transaction

from audit.admin import LargeTableAdmin
from audit.services import audit_staff_action
from core.choices import Operation
from proxy.models import ProxyTurn
from proxy.services import proxy_turns_requeue


@admin.register(ProxyTurn)
class ProxyTurnAdmin(LargeTableAdmin, admin.ModelAdmin):
    list_display = (
        "created_at",
        "user_id",
        "state",
        "attempts",
        "last_error",
        "next_attempt_at",
        "retry_until",
        "closed_at",
    )
    list_filter = ("state",)
    ordering = ("-created_at",)
    sortable_by = ("created_at",)  # proxy_turn_recent, both ways
    actions = ("requeue_extraction",)
    list_per_page = 100
    # Everything but the messages: reading them would be reading the user's content.
    fields = readonly_fields = tuple(f.name for f in ProxyTurn._meta.fields if f.name not in ("id", "messages"))

    def has_add_permission(self, request):
        return False

    def has_delete_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False  # the re-queue action is the only change staff make

    @admin.action(description="Re-queue memory extraction of the selected failed turns", permissions=["requeue"])
    def requeue_extraction(self, request, queryset):
        ids = list(queryset.values_list("pk", flat=True))
        with transaction.atomic():  # the audit row commits with the change or not at all
            queued = proxy_turns_requeue(turn_ids=ids)
            audit_staff_action(
                request, operation=Operation.ADMIN_REQUEUE_PROXY_TURNS, detail={"turn_ids": ids, "queued": queued}
            )
        self.message_user(request, f"{len(queued)} turn(s) queued for extraction.", messages.SUCCESS)

    def has_requeue_permission(self, request):
        return request.user.has_perm("proxy.change_proxyturn")
