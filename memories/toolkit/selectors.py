"""Pure reads of the toolkit's tables (the web UI's decisions page)."""

from __future__ import annotations

from django.db.models import Q, QuerySet
from django.utils import timezone

from core.scope import MemoryScope
from memories.toolkit.models import Decision


def decision_list(scope: MemoryScope, *, limit: int = 500) -> QuerySet[Decision]:
    """The scope's live decisions (expired ones are gone for every reader), by key."""
    live = Q(expires_at__isnull=True) | Q(expires_at__gt=timezone.now())
    return Decision.objects.filter(live, user_id=scope.user_pk).order_by("key")[:limit]
