"""Pure reads of the toolkit's tables (the web UI's decisions and cached answers pages)."""

from __future__ import annotations

from django.db.models import Q, QuerySet
from django.utils import timezone

from core.scope import MemoryScope
from memories.keyset import KeysetPage, Seek, queryset_page
from memories.toolkit.models import CacheEntry, Decision

# The web UI's pages (memories.keyset): orders ending with a unique key, served by an
# index that starts with the user.
DECISIONS_ORDER = ("key",)  # unique per user: the (user, key) constraint's index
CACHE_ENTRIES_ORDER = ("-created_at", "id")  # index cache_user_recent


def _decisions_live(scope: MemoryScope) -> QuerySet[Decision]:
    """Expired decisions are gone for every reader."""
    live = Q(expires_at__isnull=True) | Q(expires_at__gt=timezone.now())
    return Decision.objects.filter(live, user_id=scope.user_pk)


def decision_list(scope: MemoryScope) -> QuerySet[Decision]:
    """All the scope's live decisions by key, in one statement (a count read before would
    miss rows written meanwhile)."""
    return _decisions_live(scope).order_by(*DECISIONS_ORDER)


def decision_page(scope: MemoryScope, *, limit: int = 200, seek: Seek | None = None) -> KeysetPage[Decision]:
    """A page of the scope's live decisions by key: the first, or the one `seek` names by
    key (decisions stored or deleted meanwhile shift nothing)."""
    return queryset_page(_decisions_live(scope), order=DECISIONS_ORDER, seek=seek, limit=limit)


def decision_count(scope: MemoryScope) -> int:
    """How many live decisions the scope has (all of decision_list's)."""
    return _decisions_live(scope).count()


def _cache_entries_live(scope: MemoryScope) -> QuerySet[CacheEntry]:
    """Expired entries are gone for every reader (the purge job deletes them later).
    The embedding is left out: nobody reads it here."""
    return CacheEntry.objects.filter(user_id=scope.user_pk, expires_at__gt=timezone.now()).defer("embedding")


def cache_entry_list(scope: MemoryScope) -> QuerySet[CacheEntry]:
    """All the scope's live cached answers, newest first, in one statement (as decision_list)."""
    return _cache_entries_live(scope).order_by(*CACHE_ENTRIES_ORDER)


def cache_entry_page(scope: MemoryScope, *, limit: int = 100, seek: Seek | None = None) -> KeysetPage[CacheEntry]:
    """A page of the scope's live cached answers, newest first: the first, or the one
    `seek` names by (created at, id) (answers cached or deleted meanwhile shift nothing)."""
    return queryset_page(_cache_entries_live(scope), order=CACHE_ENTRIES_ORDER, seek=seek, limit=limit)


def cache_entry_count(scope: MemoryScope) -> int:
    """How many live cached answers the scope has (all of cache_entry_list's)."""
    return _cache_entries_live(scope).count()
