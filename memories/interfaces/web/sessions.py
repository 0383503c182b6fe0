"""The user's agent sessions (issue 13): summaries, facts by tier, and deleting a
session's raw events. Reads are selectors; the delete goes through the dispatcher."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.shortcuts import redirect, render
from django.views.decorators.http import require_GET, require_POST

from core.errors import ServiceError
from memories.interfaces.web.views import _execute, _scope
from memories.turns.extraction import TIERS
from memories.turns.selectors import facts_by_tier, sessions_of_user

TIER_TITLES = {"l1": "Today (L1)", "l2": "This week (L2)", "long_term": "Long-term"}


@login_required
@require_GET
def sessions(request):
    scope = _scope(request)
    facts = facts_by_tier(scope)
    tiers = [{"tier": tier, "title": TIER_TITLES[tier], "facts": facts[tier]} for tier in TIERS]
    return render(request, "web/sessions.html", {"sessions": sessions_of_user(scope), "tiers": tiers})


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
