"""The user's agent sessions (issue 13): summaries, facts by tier, and deleting a
session's raw events. Reads are selectors; the delete goes through the dispatcher."""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import Http404
from django.shortcuts import redirect, render
from django.utils.http import urlencode
from django.views.decorators.http import require_GET, require_POST

from core.choices import Channel, Operation
from core.errors import ServiceError
from core.inputs import text_problem
from core.metrics import lines_observed
from memories.interfaces.downloads import streaming_download
from memories.interfaces.web.paging import Listing, page_read, pager_of
from memories.interfaces.web.views import _execute, _scope, web_call
from memories.sessions import session_logs_export
from memories.turns.extraction import FACT_TAG, TIERS, tier_tag
from memories.turns.selectors import (
    fact_counts_by_tier,
    facts_by_tier,
    session_archive_count,
    session_archives,
    session_count,
    session_exists,
    session_item_count,
    session_items,
    sessions_of_user,
)

TIER_TITLES = {"l1": "Today (L1)", "l2": "This week (L2)", "long_term": "Long-term"}
SESSIONS_PAGE_SIZE = 50
SESSION_ITEMS_PAGE_SIZE = 200
SESSION_ARCHIVES_PAGE_SIZE = 5  # runs of up to 200 items each
SESSION_KEY_MAX_CHARS = 128  # SessionState's project and session_id columns
FACTS_PER_TIER = 100  # the newest; the rest are a link to My memories filtered by the tier's tags
# Cursors' positions: the orders' keys (memories.turns.selectors *_ORDER).
SESSIONS = Listing("sessions", kinds=("time", "int"))  # (last active at, id), most recent first
SESSION_LOG = Listing("session-log", kinds=("int",))  # event id, oldest first
SESSION_ARCHIVES = Listing("session-archives", kinds=("int", "int"))  # (first event id, id), oldest first


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
    shown, status = page_read(
        request, SESSIONS, lambda seek: sessions_of_user(scope, limit=SESSIONS_PAGE_SIZE, seek=seek)
    )
    pager = pager_of(request, SESSIONS, shown, total=session_count(scope))
    return render(request, "web/sessions.html", {"sessions": shown, "tiers": tiers, "pager": pager}, status=status)


def _session_of(request) -> tuple[Any, str, str]:
    """The signed-in user's scope and the session the query names; a 404 for one they do
    not have (another user's, with the same id or not, is as missing as an unknown one)."""
    session_id, project = request.GET.get("session_id", ""), request.GET.get("project", "")
    if not session_id or any(
        len(name) > SESSION_KEY_MAX_CHARS or text_problem(name) for name in (session_id, project)
    ):  # no stored session has such a name (a NUL would also fail the query itself)
        raise Http404("No such session.")
    scope = _scope(request)
    if not session_exists(scope, project=project, session_id=session_id):
        raise Http404("No such session.")
    return scope, session_id, project


@login_required
@require_GET
def session_log(request):
    """One session's raw log, in order, paged: what the agent or the chat proxy kept of the
    conversation. The session is named by query parameters (ids are free text); another
    user's session is a 404 like an unknown one."""
    scope, session_id, project = _session_of(request)
    items, status = page_read(
        request,
        SESSION_LOG,
        lambda seek: session_items(
            scope, project=project, session_id=session_id, limit=SESSION_ITEMS_PAGE_SIZE, seek=seek
        ),
    )
    total = session_item_count(scope, project=project, session_id=session_id)
    session = {"session_id": session_id, "project": project}
    context = {
        **session,
        "items": items,
        "count": total,
        "pager": pager_of(request, SESSION_LOG, items, total=total, keep=session),
        "archives": session_archive_count(scope, project=project, session_id=session_id),
        "query": urlencode(session),
    }
    return render(request, "web/session_log.html", context, status=status)


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


@login_required
@require_POST
def session_logs_download(request):
    """The "Your data" page's download of every session log, streamed as JSONL. A POST
    with the CSRF token, so another site cannot spend the user's export limit."""
    try:
        lines = lines_observed(
            operation=Operation.EXPORT_SESSION_LOGS,
            channel=Channel.UI,
            start=lambda: session_logs_export(_scope(request), call=web_call(request)),
        )
    except ServiceError as exc:
        messages.error(request, exc.message)
        return redirect("web-data")
    return streaming_download(
        request, lines, content_type="application/x-ndjson; charset=utf-8", filename="session-logs.jsonl"
    )


@login_required
@require_GET
def session_log_archives(request):
    """A session's archived runs (older events maintenance compacted), oldest first, paged."""
    scope, session_id, project = _session_of(request)
    archives, status = page_read(
        request,
        SESSION_ARCHIVES,
        lambda seek: session_archives(
            scope, project=project, session_id=session_id, limit=SESSION_ARCHIVES_PAGE_SIZE, seek=seek
        ),
    )
    total = session_archive_count(scope, project=project, session_id=session_id)
    session = {"session_id": session_id, "project": project}
    context = {
        **session,
        "archives": archives,
        "pager": pager_of(request, SESSION_ARCHIVES, archives, total=total, keep=session),
        "session_query": urlencode(session),
    }
    return render(request, "web/session_archives.html", context, status=status)
