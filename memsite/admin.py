"""Admin for the service's own rows: the erasure ledger's outbox (read-only: support
checks that every erasure reached the backups, and which were re-applied after a restore)."""

import contextlib
import uuid

from django.contrib import admin

from audit.admin import ReadOnlyAdmin
from core.inputs import digits_int
from memsite.models import ErasureLedger


@admin.register(ErasureLedger)
class ErasureLedgerAdmin(ReadOnlyAdmin):
    # Pseudonymous ids and times only, like the record itself: nothing to audit as a read.
    list_display = (
        "erased_at",
        "user_pk",
        "account_deleted",
        "state",
        "written_at",
        "attempts",
        "last_error",
        "reapplied_at",
    )
    list_filter = ("state", "account_deleted")
    search_fields = ("user_pk", "request_id")  # shows the search box; see get_search_results
    search_help_text = "A user id (digits) or an erasure's request id."
    ordering = ("-erased_at",)

    def get_search_results(self, request, queryset, search_term):
        """Exact lookups on the columns' indexes (memsite 0004). Django's "=" prefix means
        iexact: upper() of every row's user id as text, which no index serves."""
        term = search_term.strip()
        if not term:
            return queryset, False
        user_pk = digits_int(term)
        if user_pk is not None:
            return queryset.filter(user_pk=user_pk), False
        with contextlib.suppress(ValueError):  # request ids are ours: uuid4, as stored
            return queryset.filter(request_id=str(uuid.UUID(term))), False
        return queryset.none(), False
