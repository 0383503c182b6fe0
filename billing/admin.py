import contextlib
import uuid

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db import transaction
from django.db.models import Count, Q
from django.template.response import TemplateResponse
from django.urls import path
from django.utils import timezone

from audit.admin import CHANNELS, OPERATIONS, LargeTableAdmin, fixed_choices_filter
from audit.services import audit_staff_action
from billing.models import UsageEvent
from billing.services import NEEDS_OPERATOR, usage_events_retry
from core.choices import Operation
from core.inputs import digits_int


@admin.register(UsageEvent)
class UsageEventAdmin(LargeTableAdmin, admin.ModelAdmin):
    list_display = ("created_at", "user_id", "operation", "channel", "status", "attempts", "last_error", "delivered_at")
    # The outbox gains a row per billed call, so nothing on this page may read the whole
    # table: fixed choices instead of Django's SELECT DISTINCT per filter, a bounded count
    # (LargeTableAdmin), and no date hierarchy (a DISTINCT date_trunc() over every row on
    # each page; the created_at filter covers the same need).
    list_filter = (
        "status",
        fixed_choices_filter("operation", OPERATIONS),
        fixed_choices_filter("channel", CHANNELS),
        ("created_at", admin.DateFieldListFilter),
    )
    search_fields = ("user_id", "request_id")  # shows the search box; see get_search_results
    search_help_text = "An exact user id or request id."
    ordering = ("-created_at",)
    # Its index, both ways (events of the same microsecond, if any, are sorted by id).
    sortable_by = ("created_at",)
    actions = ("retry_delivery",)
    list_per_page = 100
    readonly_fields = [f.name for f in UsageEvent._meta.fields]
    change_list_template = "admin/billing/usageevent/change_list.html"

    def has_add_permission(self, request):
        return False

    def has_delete_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False  # the outbox is read-only; the retry action is the only change staff make

    def changelist_view(self, request, extra_context=None):
        if request.method == "GET":
            # A misconfigured gateway (unset, unusable, redirecting) stops every delivery
            # at once: say so above the list, not only in each row's last error. The pending
            # event scheduled last carries the latest answer; one probe of the index of
            # pending events finds it, however deep the outbox.
            latest = (
                UsageEvent.objects.filter(status=UsageEvent.Status.PENDING)
                .order_by("-next_attempt_at")
                .values_list("last_error", flat=True)
                .first()
            )
            if latest and latest.startswith(NEEDS_OPERATOR):
                self.message_user(request, f"Usage events are not being delivered: {latest}", messages.WARNING)
        return super().changelist_view(request, extra_context)

    def get_search_results(self, request, queryset, search_term):
        """Exact matches, each served by its column's index: the outbox holds one row per
        billed call. (Django's "=" prefix means iexact, a sequential scan comparing upper()
        of every row; and a request id that is not a UUID cannot match at all.)"""
        term = search_term.strip()
        if not term:
            return queryset, False
        match = Q(user_id=term)
        with contextlib.suppress(ValueError):
            match |= Q(request_id=uuid.UUID(term))
        return queryset.filter(match), False

    @admin.action(description="Retry delivery of the selected events", permissions=["retry"])
    def retry_delivery(self, request, queryset):
        ids = list(queryset.values_list("pk", flat=True))
        with transaction.atomic():  # the audit row commits with the change or not at all
            count = usage_events_retry(event_ids=ids)
            audit_staff_action(
                request, operation=Operation.ADMIN_RETRY_USAGE_EVENTS, detail={"event_ids": ids, "queued": count}
            )
        self.message_user(request, f"{count} event(s) queued for delivery.", messages.SUCCESS)

    def has_retry_permission(self, request):
        return request.user.has_perm("billing.change_usageevent")

    def get_urls(self):
        totals = path("totals/", self.admin_site.admin_view(self.totals_view), name="billing_usageevent_totals")
        return [totals, *super().get_urls()]

    def totals_view(self, request):
        """Calls per user and operation (optionally for the last N days), for support:
        for staff who may view usage events, as the list is (admin_view checks only staff)."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        days = request.GET.get("days", "30")
        rows = UsageEvent.objects.all()
        within = digits_int(days, max_digits=5)  # up to 99,999 days, in timedelta's range
        if within is not None:
            rows = rows.filter(created_at__gte=timezone.now() - timezone.timedelta(days=within))
        totals = (
            rows.values("user_id", "operation", "status").annotate(calls=Count("id")).order_by("user_id", "operation")
        )
        context = {
            **self.admin_site.each_context(request),
            "title": "Usage totals",
            "opts": self.model._meta,
            "totals": totals[:2000],
            "days": days,
        }
        return TemplateResponse(request, "admin/billing/usageevent/totals.html", context)
