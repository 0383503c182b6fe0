"""Pure reads of the toolkit's tables (the web UI's decisions and cached answers pages)."""

from __future__ import annotations

from django.db.models import Q, QuerySet
from django.utils import timezone

from core.scope import MemoryScope
from memories.toolkit.models import CacheEntry, Decision


def _page_end(offset: int, limit: int | None) -> int | None:
    return None if limit is None else offset + limit


def _decisions_live(scope: MemoryScope) -> QuerySet[Decision]:
    """Expired decisions are gone for every reader."""
    live = Q(expires_at__isnull=True) | Q(expires_at__gt=timezone.now())
    return Decision.objects.filter(live, user_id=scope.user_pk)


def decision_list(scope: MemoryScope, *, limit: int | None = 500, offset: int = 0) -> QuerySet[Decision]:
    """The scope's live decisions by key: `limit` of them after the first `offset` (None:
    all of them, in one statement; a count read before would miss rows written meanwhile)."""
    return _decisions_live(scope).order_by("key")[offset : _page_end(offset, limit)]


def decision_count(scope: MemoryScope) -> int:
    """How many live decisions the scope has (all of decision_list's pages)."""
    return _decisions_live(scope).count()


def _cache_entries_live(scope: MemoryScope) -> QuerySet[CacheEntry]:
    """Expired entries are gone for every reader (the purge job deletes them later)."""
    return CacheEntry.objects.filter(user_id=scope.user_pk, expires_at__gt=timezone.now())


def cache_entry_list(scope: MemoryScope, *, limit: int | None = 500, offset: int = 0) -> QuerySet[CacheEntry]:
    """The scope's live cached answers, newest first: `limit` of them after the first `offset`
    (None: all, as decision_list). The embedding is left out: nobody reads it here."""
    entries = _cache_entries_live(scope).defer("embedding").order_by("-created_at", "id")
    return entries[offset : _page_end(offset, limit)]


def cache_entry_count(scope: MemoryScope) -> int:
    """How many live cached answers the scope has (all of cache_entry_list's pages)."""
    return _cache_entries_live(scope).count()
