"""The user's agent sessions (issue 13): summaries, facts by tier, and deleting a
session's raw events. Reads are selectors; the delete goes through the dispatcher."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.shortcuts import redirect, render
from django.views.decorators.http import require_GET, require_POST

from core.errors import ServiceError
from memories.interfaces.web.views import _execute, _scope, page_of
from memories.turns.extraction import FACT_TAG, TIERS, tier_tag
from memories.turns.selectors import fact_counts_by_tier, facts_by_tier, session_count, sessions_of_user

TIER_TITLES = {"l1": "Today (L1)", "l2": "This week (L2)", "long_term": "Long-term"}
SESSIONS_PAGE_SIZE = 50
FACTS_PER_TIER = 100  # the newest; the rest are a link to My memories filtered by the tier's tags


@login_required
@require_GET
def sessions(request):
    scope = _scope(request)
    facts, counts = facts_by_tier(scope, limit=FACTS_PER_TIER), fact_counts_by_tier(scope)
    tiers = [
        {
            "tier": tier,
            "title": TIER_TITLES[tier],
            "facts": facts[tier],
            "count": counts[tier],
            "tags": f"{FACT_TAG}, {tier_tag(tier)}",
        }
        for tier in TIERS
    ]
    page = page_of(request, total=session_count(scope), page_size=SESSIONS_PAGE_SIZE)
    shown = sessions_of_user(scope, limit=SESSIONS_PAGE_SIZE, offset=page.object_list.start)
    return render(request, "web/sessions.html", {"sessions": shown, "tiers": tiers, "page": page})


@login_required
@require_POST
def session_events_delete(request):
    arguments = {"session_id": request.POST.get("session_id", ""), "project": request.POST.get("project", "")}
    try:
        deleted = _execute(request, "delete_session_events", arguments)["deleted"]
        messages.success(request, f"Deleted {deleted} raw events of the session.")
    except ServiceError as exc:
        messages.error(request, exc.message)
    return redirect("web-sessions")
