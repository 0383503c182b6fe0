"""Issue 14 in the web UI: my decisions and cached answers (view, delete) and "erase all my data"."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.shortcuts import redirect, render
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from core.choices import Channel, Operation
from core.errors import ErrorCode, ServiceError
from core.metrics import lines_observed
from memories.interfaces.downloads import streaming_download
from memories.interfaces.web.paging import Listing, page_read, pager_of
from memories.interfaces.web.views import _execute, _scope, ui_call_observed, web_call
from memories.toolkit.schemas import DECISION_KEY_MAX_CHARS
from memories.toolkit.selectors import cache_entry_count, cache_entry_page, decision_count, decision_page
from memories.toolkit.services import (
    toolkit_cache_entries_clear,
    toolkit_cache_entry_delete,
    toolkit_data_export,
    toolkit_decision_delete,
)

ERASE_PHRASE = "erase all my data"
DECISIONS_PAGE_SIZE = 200
CACHE_PAGE_SIZE = 100
# Cursors' positions: the orders' keys (memories.toolkit.selectors). A decision's key is
# content: the sealed cursor keeps it out of URLs and logs.
DECISIONS = Listing("decisions", kinds=("text",))  # key
CACHE_ENTRIES = Listing("cache", kinds=("time", "uuid"))  # (created at, id), newest first


@login_required
@require_GET
def decisions(request):
    scope = _scope(request)
    shown, status = page_read(
        request, DECISIONS, lambda seek: decision_page(scope, limit=DECISIONS_PAGE_SIZE, seek=seek)
    )
    pager = pager_of(request, DECISIONS, shown, total=decision_count(scope))
    return render(request, "web/decisions.html", {"decisions": shown, "pager": pager}, status=status)


@login_required
@require_POST
def decision_delete(request):
    key = request.POST.get("key", "")
    if not key or len(key) > DECISION_KEY_MAX_CHARS or "\x00" in key:
        messages.error(request, "No such decision.")
        return redirect("web-decisions")
    with ui_call_observed(Operation.DELETE_DECISION):
        deleted = toolkit_decision_delete(_scope(request), key=key, call=web_call(request))
    if deleted:
        messages.success(request, f"Deleted the decision {key}.")
    else:
        messages.error(request, "No such decision.")
    return redirect("web-decisions")


@login_required
@require_GET
def cache_entries(request):
    """The answers agents cached for you (seed 003's store_cache), until they expire."""
    scope = _scope(request)
    shown, status = page_read(
        request, CACHE_ENTRIES, lambda seek: cache_entry_page(scope, limit=CACHE_PAGE_SIZE, seek=seek)
    )
    count = cache_entry_count(scope)
    pager = pager_of(request, CACHE_ENTRIES, shown, total=count)
    return render(request, "web/cache.html", {"entries": shown, "count": count, "pager": pager}, status=status)


@login_required
@require_POST
def cache_entry_delete(request):
    entry_id = request.POST.get("id", "")
    with ui_call_observed(Operation.DELETE_CACHE_ENTRY):
        deleted = toolkit_cache_entry_delete(_scope(request), entry_id=entry_id, call=web_call(request))
    if deleted:
        messages.success(request, "Deleted the cached answer.")
    else:
        messages.error(request, "No such cached answer.")
    return redirect("web-cache")


@login_required
@require_POST
def cache_entries_clear(request):
    with ui_call_observed(Operation.DELETE_CACHE_ENTRY):
        deleted = toolkit_cache_entries_clear(_scope(request), call=web_call(request))
    messages.success(request, f"Deleted {deleted} cached answer{'' if deleted == 1 else 's'}.")
    return redirect("web-cache")


@login_required
@require_POST
def decisions_and_cache_export(request):
    """The "Your data" page's second download: decisions and cached answers as one JSON
    document, streamed. A POST with the CSRF token, so another site cannot spend the
    user's export limit."""
    try:
        pieces = lines_observed(
            operation=Operation.EXPORT_DECISIONS_AND_CACHE,
            channel=Channel.UI,
            start=lambda: toolkit_data_export(_scope(request), call=web_call(request)),
        )
    except ServiceError as exc:
        messages.error(request, exc.message)
        return redirect("web-data")
    return streaming_download(
        request, pieces, content_type="application/json", filename="decisions-and-cached-answers.json"
    )


@login_required
@require_http_methods(["GET", "POST"])
def erase_all(request):
    """Typed confirmation, then seed 003's wipe_user_data through the dispatcher (audited)."""
    if request.method == "POST":
        confirmed = request.POST.get("confirmation", "").strip().lower() == ERASE_PHRASE
        try:
            wiped = _execute(request, "wipe_user_data", {"confirm": confirmed})
            messages.success(
                request,
                f"Erased {wiped['memories_deleted']} memories, {wiped['cache_deleted']} cached answers and "
                f"{wiped['decisions_deleted']} decisions. This cannot be undone.",
            )
            return redirect("web-memories")
        except ServiceError as exc:
            if exc.code == ErrorCode.CONFIRMATION_REQUIRED:
                messages.error(request, f'Type "{ERASE_PHRASE}" to confirm.')
            else:
                messages.error(request, exc.message)
    return render(request, "web/erase_all.html", {"phrase": ERASE_PHRASE})
