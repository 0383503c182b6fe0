"""Admin for the service's own rows: the erasure ledger's outbox (read-only: support
checks that every erasure reached the backups, and which were re-applied after a restore)."""

from django.contrib import admin

from audit.admin import ReadOnlyAdmin
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
    search_fields = ("=user_pk", "=request_id")
    ordering = ("-erased_at",)
