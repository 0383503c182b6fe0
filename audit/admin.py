"""Forensic admin: read-only views of the audit trail, memory history and memories."""

from __future__ import annotations

import json
import re
import uuid
from typing import ClassVar

from django.contrib import admin
from django.contrib.admin.views.main import ORDER_VAR, ChangeList
from django.core.paginator import Paginator
from django.db import connection
from django.db.models import Q
from django.urls import reverse
from django.utils.functional import cached_property
from django.utils.html import format_html, format_html_join

from audit.crypto import content_display
from audit.models import ACTED_FOR_ANOTHER, AuditEvent, AuditExportBatch, AuthFailureWindow, MemoryHistory
from audit.services import audit_staff_action
from core.choices import Channel, Operation
from core.inputs import digits_int
from core.scope import DEFAULT_TENANT

_UUID = re.compile(r"^[0-9a-fA-F-]{32,36}$")


def _canonical_uuid(term: str) -> str:
    """A UUID as the rows store it (lowercase, hyphenated), however it was pasted; any
    other term as it is."""
    try:
        return str(uuid.UUID(term))
    except ValueError:
        return term


class EstimatedCountPaginator(Paginator):
    """COUNT(*) over millions of rows is the slow part of a changelist. Unfiltered, the
    list shows the planner's row estimate of the table. Filtered, matches are counted
    exactly up to COUNT_EXACT_UP_TO (a LIMITed scan that stops there); past that, the
    planner's estimate of the filtered query stands in, so "the last 7 days" of a table
    that grows by a row per call costs the same at 10M rows as at 100k."""

    COUNT_EXACT_UP_TO = 10_000

    @cached_property
    def count(self):
        query = getattr(self.object_list, "query", None)
        if query is None:
            return super().count
        if not query.where:
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT reltuples::bigint FROM pg_class WHERE relname = %s", [query.model._meta.db_table]
                )
                row = cursor.fetchone()
            if row and row[0] > self.COUNT_EXACT_UP_TO:
                return row[0]
            return super().count
        # Unordered: an ORDER BY under the LIMIT can make the planner walk the primary key
        # backwards through every row looking for matches that are not there.
        counted = self.object_list.order_by()[: self.COUNT_EXACT_UP_TO + 1].count()
        if counted <= self.COUNT_EXACT_UP_TO:
            return counted
        return max(counted, _planner_rows(self.object_list))


def _planner_rows(queryset) -> int:
    """The planner's estimate of how many rows `queryset` returns (no rows are read)."""
    plan = json.loads(queryset.explain(format="json"))
    return int(plan[0]["Plan"]["Plan Rows"])


def fixed_choices_filter(field: str, values: list[str]):
    """A list filter with known values: the default one runs SELECT DISTINCT over the
    whole table on every page, which is the slow part at millions of rows."""

    class FixedChoicesFilter(admin.SimpleListFilter):
        title = field.replace("_", " ")
        parameter_name = field

        def lookups(self, request, model_admin):
            return [(v, v) for v in values]

        def queryset(self, request, queryset):
            return queryset.filter(**{field: self.value()}) if self.value() else queryset

    return FixedChoicesFilter


OPERATIONS = list(Operation.values)
CHANNELS = list(Channel.values)


class IndexOrderedChangeList(ChangeList):
    """A changelist ordered only by what `sortable_by` names. Django hides the other
    columns' sort links but still sorts by whatever `?o=` a bookmarked or edited address
    asks for: such parts are dropped (the default order stands). And Django breaks ties
    by `-pk` whatever the direction, so "oldest first" was (time ASC, id DESC), an order
    no index holds; the tie-break follows the first column's direction instead, so that
    the index that serves newest first serves oldest first too, read backwards."""

    def get_ordering(self, request, queryset):
        requested = self.params.get(ORDER_VAR)
        if requested and self.sortable_by is not None:
            kept = [part for part in requested.split(".") if self._sortable(part, self.sortable_by)]
            if kept:
                self.params[ORDER_VAR] = ".".join(kept)
            else:
                del self.params[ORDER_VAR]
        ordering = super().get_ordering(request, queryset)
        first = ordering[0] if ordering else None
        if len(ordering) > 1 and ordering[-1] == "-pk" and isinstance(first, str) and not first.startswith("-"):
            ordering[-1] = "pk"
        return ordering

    def _sortable(self, part: str, sortable_by) -> bool:
        _, _, column = part.rpartition("-")
        try:
            return self.list_display[int(column)] in sortable_by
        except (IndexError, ValueError):
            return False


class LargeTableAdmin(admin.ModelAdmin):
    """The changelist of a table that grows with use (a row per call, per 401, per rate
    window...): neither a page nor a click on it reads the whole table. A bounded count
    (EstimatedCountPaginator, no full count beside a filtered one), no facet counts (a
    COUNT per filter choice over the whole table), and sorting only by the columns in
    `sortable_by`, each an order an index serves (none by default): a click on any other
    column header sorted every row."""

    paginator = EstimatedCountPaginator
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER
    sortable_by: ClassVar[tuple[str, ...] | None] = ()

    def get_changelist(self, request, **kwargs):
        return IndexOrderedChangeList


class ReadOnlyAdmin(admin.ModelAdmin):
    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


class ContentListAudited:
    """A changelist whose rows show memory text leaves one audit row per page shown: which
    memories staff saw, and whether they searched (not the search term, which may itself
    be memory text). Opening one memory is audited by each change view."""

    def shown_memory_id(self, obj) -> str:
        raise NotImplementedError

    def changelist_view(self, request, extra_context=None):
        response = super().changelist_view(request, extra_context)
        changelist = (getattr(response, "context_data", None) or {}).get("cl")
        if changelist is not None and request.method == "GET":
            shown = [self.shown_memory_id(obj) for obj in changelist.result_list]
            if shown:
                audit_staff_action(
                    request,
                    operation=Operation.ADMIN_LIST_CONTENT,
                    memory_ids=list(dict.fromkeys(shown)),
                    detail={
                        "page": self.model._meta.label_lower,
                        "rows": len(shown),
                        "searched": bool(changelist.query),
                    },
                )
        return response


def _snapshot_display(value):
    opened = content_display(value)
    return "-" if opened is None else opened if isinstance(opened, str) else json.dumps(opened, indent=1)


@admin.register(AuditEvent)
class AuditEventAdmin(LargeTableAdmin, ReadOnlyAdmin):
    list_display = (
        "id", "occurred_at", "channel", "operation", "outcome", "error_code", "actor", "actor_client_app",
        "subject_timeline", "memories_short", "turn_id", "duration_ms",
    )  # fmt: skip
    list_filter = (
        "outcome",
        fixed_choices_filter("operation", OPERATIONS),
        fixed_choices_filter("channel", CHANNELS),
        "turn_event",
        ("occurred_at", admin.DateFieldListFilter),
    )
    search_fields = ("actor_username",)
    search_help_text = "A request id, memory id, turn id, user id (digits), username or credential (key:<key id>)."
    ordering = ("-id",)
    sortable_by = ("id",)  # the primary key, both ways (ids follow the time of the call)
    list_per_page = 100
    # The sealed snapshots and detail content are shown opened (or "erased"), never as ciphertext.
    readonly_fields = [
        {"before": "before_content", "after": "after_content", "detail": "detail_content"}.get(f.name, f.name)
        for f in AuditEvent._meta.fields
    ]

    def change_view(self, request, object_id, form_url="", extra_context=None):
        # A row holding a memory's text (a change's before and after, a stored turn) shows
        # it opened: reading it is audited like opening the memory itself.
        event = self.get_object(request, object_id)
        if (
            event is not None
            and self.has_view_or_change_permission(request, event)
            and (event.before is not None or event.after is not None or "content" in event.detail)
        ):
            audit_staff_action(
                request,
                operation=Operation.ADMIN_VIEW_MEMORY,
                subject_user_id=event.subject_user_id,
                memory_ids=list(event.memory_ids or []),
                tenant=event.tenant or DEFAULT_TENANT,
                detail={"audit_event": event.pk},
            )
        return super().change_view(request, object_id, form_url, extra_context)

    @admin.display(description="before")
    def before_content(self, obj):
        return _snapshot_display(obj.before)

    @admin.display(description="after")
    def after_content(self, obj):
        return _snapshot_display(obj.after)

    @admin.display(description="detail")
    def detail_content(self, obj):
        detail = dict(obj.detail or {})
        if "content" in detail:
            detail["content"] = content_display(detail["content"])
        return json.dumps(detail, indent=1)

    def lookup_allowed(self, lookup, value, request=None):
        # Links from timelines and turns filter on these directly.
        if lookup in ("subject_user_id", "actor_user_id", "turn_id", "request_id", "staff_user_id", "actor_credential"):
            return True
        return super().lookup_allowed(lookup, value, request)

    def get_search_results(self, request, queryset, search_term):
        term = search_term.strip()
        if not term:
            return queryset, False
        user_id = digits_int(term)
        if user_id is not None:
            return queryset.filter(Q(subject_user_id=user_id) | (Q(actor_user_id=user_id) & ACTED_FOR_ANOTHER)), False
        if _UUID.match(term):
            canonical = _canonical_uuid(term)
            return queryset.filter(Q(request_id=canonical) | Q(memory_ids__contains=[canonical])), False
        if term.startswith(("key:", "oidc:")):  # one credential's calls, e.g. a leaked key's
            return queryset.filter(actor_credential=term), False
        return queryset.filter(Q(actor_username=term) | Q(staff_username=term) | Q(turn_id=term)), False

    @admin.display(description="actor")
    def actor(self, obj):
        return f"staff:{obj.staff_username}" if obj.staff_username else obj.actor_username

    @admin.display(description="user (timeline)")
    def subject_timeline(self, obj):
        if obj.subject_user_id is None:
            return "-"
        url = reverse("admin:audit_auditevent_changelist") + f"?subject_user_id={obj.subject_user_id}"
        return format_html('<a href="{}">{}</a>', url, obj.subject_user_id)

    @admin.display(description="memories")
    def memories_short(self, obj):
        ids = obj.memory_ids or []
        shown = ", ".join(str(i)[:8] for i in ids[:3])
        return f"{shown} (+{len(ids) - 3})" if len(ids) > 3 else shown


@admin.register(MemoryHistory)
class MemoryHistoryAdmin(ContentListAudited, LargeTableAdmin, ReadOnlyAdmin):
    list_display = ("recorded_at", "memory_id", "event", "old_short", "new_short", "changed_by", "request_id")
    list_filter = ("event",)
    search_fields = ("memory_id", "request_id")  # shows the search box; see get_search_results
    search_help_text = "A memory id or request id."
    ordering = ("-recorded_at",)
    sortable_by = ("recorded_at",)  # history_recent, both ways
    readonly_fields = [f.name for f in MemoryHistory._meta.fields]

    def get_search_results(self, request, queryset, search_term):
        """Exact lookups, served by the columns' indexes. (Django's "=" prefix means iexact,
        which compares upper() of every row: a sequential scan of the whole history.)"""
        term = search_term.strip()
        if not term:
            return queryset, False
        term = _canonical_uuid(term)
        return queryset.filter(Q(memory_id=term) | Q(request_id=term)), False

    def shown_memory_id(self, obj) -> str:
        return obj.memory_id

    def change_view(self, request, object_id, form_url="", extra_context=None):
        version = self.get_object(request, object_id)
        if version is not None and self.has_view_or_change_permission(request, version):
            audit_staff_action(
                request,
                operation=Operation.ADMIN_VIEW_MEMORY,
                memory_ids=[version.memory_id],
                detail={"history_row": str(version.pk)},
            )
        return super().change_view(request, object_id, form_url, extra_context)

    @admin.display(description="old")
    def old_short(self, obj):
        return (obj.old_memory or "")[:80]

    @admin.display(description="new")
    def new_short(self, obj):
        return (obj.new_memory or "")[:80]


@admin.register(AuthFailureWindow)
class AuthFailureWindowAdmin(LargeTableAdmin, ReadOnlyAdmin):
    """401s per client address per minute (the first of each window is also an audit row):
    a row per address and minute, so a spray from many addresses grows it fast."""

    list_display = ("window_start", "ip", "count", "first_channel", "last_seen_at")
    search_fields = ("ip__exact",)  # through the (ip, window_start) index; "=" would be iexact
    search_help_text = "An exact client address."
    ordering = ("-window_start", "-count")
    sortable_by = ("window_start",)  # its index (a minute's windows are then ordered by count)
    list_per_page = 100
    list_filter = (("window_start", admin.DateFieldListFilter),)
    readonly_fields = [f.name for f in AuthFailureWindow._meta.fields]


@admin.register(AuditExportBatch)
class AuditExportBatchAdmin(ReadOnlyAdmin):
    list_display = ("exported_at", "first_id", "last_id", "row_count", "object_key", "sha256")
    ordering = ("-last_id",)


def history_table(memory_id: str):
    rows = MemoryHistory.objects.filter(memory_id=memory_id).order_by("recorded_at", "id")
    return format_html(
        "<table><thead><tr><th>when</th><th>event</th><th>before</th><th>after</th><th>who</th></tr></thead>"
        "<tbody>{}</tbody></table>",
        format_html_join(
            "",
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            ((r.recorded_at, r.event, r.old_memory or "", r.new_memory or "", r.changed_by) for r in rows),
        ),
    )
