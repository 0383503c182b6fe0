"""Issue 14 in the admin: decisions and cache entries (read-only; content stays the
user's), and the audited "erase all data" action for erasure requests."""

from __future__ import annotations

import logging
from dataclasses import replace

from django.contrib import admin, messages

from audit.admin import ReadOnlyAdmin
from audit.services import audit_failure
from core.calls import call_context_from_request
from core.choices import Channel, Operation
from core.errors import ServiceError
from core.scope import MemoryScope
from memories.toolkit.models import CacheEntry, Decision, ErasureSubject
from memories.toolkit.services import toolkit_user_data_wipe

logger = logging.getLogger(__name__)


@admin.register(Decision)
class DecisionAdmin(ReadOnlyAdmin):
    list_display = ("user", "key", "created_at", "updated_at", "expires_at")
    search_fields = ("=key", "user__username")
    exclude = ("value",)  # staff see that a decision exists, not what it says


@admin.register(CacheEntry)
class CacheEntryAdmin(ReadOnlyAdmin):
    list_display = ("id", "user", "created_at", "expires_at")
    search_fields = ("user__username",)
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
            call = replace(
                call_context_from_request(request, channel=Channel.ADMIN, staff=True),
                actor_username=user.get_username(),
            )
            # One transaction per user: the deletions and the staff audit row commit together.
            # A user whose erasure fails is named, and the others still go: staff must know
            # exactly who was erased (each one's audit row says so too).
            try:
                toolkit_user_data_wipe(
                    MemoryScope.for_user(user), confirm=True, call=call, operation=Operation.ADMIN_WIPE_USER_DATA
                )
            except ServiceError as exc:
                logger.warning("admin erasure failed for user %s (%s)", user.pk, exc.code.value)
                # The wipe rolled back with its own audit row: record the attempt.
                audit_failure(
                    MemoryScope.for_user(user), call=call, operation=Operation.ADMIN_WIPE_USER_DATA, error=exc
                )
                failed.append(user.get_username())
            else:
                erased.append(user.get_username())
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
