"""The end user's web UI: browse, search, pin, edit and delete my memories; API keys;
usage. Server-rendered; every memory action goes through the same operation dispatcher as MCP and REST
(same scope, rate limits, audit rows and usage events)."""

from __future__ import annotations

from contextlib import AbstractContextManager
from datetime import date, timedelta

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpResponseRedirect
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from core.calls import call_context_from_request
from core.choices import ALL_PERMISSIONS, Channel, MemoryType, Operation, Permission
from core.errors import ErrorCode, ServiceError
from core.inputs import digits_int
from core.metrics import CallObservation, call_observed, lines_observed
from core.scope import CallContext, MemoryScope
from memories import schemas
from memories.auth import Principal
from memories.interfaces.downloads import EXPORT_DOWNLOADS, streaming_download
from memories.interfaces.web.paging import Listing, page_read, pager_of
from memories.interfaces.wellknown import MEMORY_MCP_PATH
from memories.models import ApiKey
from memories.operations import operation_execute
from memories.schemas import MEMORY_MAX_CHARS, TAGS_MAX
from memories.selectors import (
    ACTIVITY_COUNT_CAP,
    ACTIVITY_LIMIT,
    memory_activity,
    memory_activity_count,
    memory_client_apps,
    memory_trash_count,
    memory_trash_page,
    memory_versions,
    usage_by_day,
)
from memories.services import api_key_issue, api_key_revoke, memory_export_stream

PAGE_SIZE = 25
SEARCH_RESULTS = 50
TRASH_PAGE_SIZE = 200
WEB_CLIENT = "web"
ACTIVITY = Listing("activity", kinds=("int",))  # audit row ids, newest first
TRASH = Listing("trash", kinds=("stamp", "uuid"))  # (trashed at, memory id), most recently deleted first


def _principal(request) -> Principal:
    return Principal(user=request.user, method="session", client_app=WEB_CLIENT)


def _scope(request) -> MemoryScope:
    return _principal(request).scope()


def web_call(request) -> CallContext:
    """The call context of a web UI change made outside the dispatcher (API keys, the
    chat proxy's key settings, decisions): the signed-in user as the actor, as
    operation_execute records it for the UI's other calls."""
    return _principal(request).call_attributed(call_context_from_request(request, channel=Channel.UI))


def ui_call_observed(operation: str) -> AbstractContextManager[CallObservation]:
    """The metrics of a web UI call made outside the dispatcher (with `web_call`): counted
    and timed as operation_execute does the UI's other calls, a refusal under its code."""
    return call_observed(operation=operation, channel=Channel.UI)


def _execute(request, name: str, arguments: dict | schemas.RejectedArguments) -> dict:
    """The same dispatcher MCP and REST use (audit row, usage event, rate limit)."""
    call = call_context_from_request(request, channel=Channel.UI)
    return operation_execute(_principal(request), name, arguments, call=call)


def _owned_or_404(request, name: str, arguments: dict) -> dict:
    """Run an operation on one memory; a missing or foreign id is a 404 (and audited)."""
    try:
        return _execute(request, name, arguments)
    except ServiceError as exc:
        if exc.code == ErrorCode.NOT_FOUND:
            raise Http404("No memory with that id.") from None
        raise


def _date_param(request, name: str) -> str | None:
    raw = request.GET.get(name, "").strip()
    if not raw:
        return None
    try:
        return date.fromisoformat(raw).isoformat()
    except ValueError:
        messages.error(request, f"Ignored the {name.replace('_', ' ')}: use a date like 2026-01-31.")
        return None


@require_GET
def home(request):
    return redirect("web-memories" if request.user.is_authenticated else "login")


@login_required
@require_GET
def memory_index(request):
    scope = _scope(request)
    query = request.GET.get("q", "").strip()[:2000]
    pinned = request.GET.get("pinned", "")
    source = request.GET.get("source", "")
    date_from, date_to = _date_param(request, "date_from"), _date_param(request, "date_to")
    filters = {}
    if pinned in ("yes", "no"):
        filters["pinned"] = pinned == "yes"
    if source:
        filters["client_app"] = source
    field_filters = _field_filters(request)
    context = {
        "query": query,
        "pinned": pinned,
        "source": source,
        "memory_type": field_filters.get("memory_type", ""),
        "tags": ", ".join(field_filters.get("tags", [])),
        "memory_types": MemoryType.values,
        # Bulk forget selects by type, tags and dates only: offered while the list shows
        # exactly what it would delete (no search, pinned or source filter narrowing it).
        "can_forget": bool(field_filters or date_from or date_to) and not (query or filters),
        "forget_blocked": bool(field_filters or date_from or date_to) and bool(query or filters),
        "date_from": date_from or "",
        "date_to": date_to or "",
        "sources": memory_client_apps(scope),
        "next_cursor": None,
    }
    if query and request.headers.get("Sec-Fetch-Site") == "cross-site":
        # A search is billed and rate limited, and another site can navigate a signed-in
        # browser here (Lax cookies go along): it would spend the user's money and limit.
        # The browser says where the navigation came from; a cross-site one shows the
        # search unrun (the query filled in, nothing billed) until the user presses Apply.
        # Same-origin, typed or bookmarked (`none`) and header-less requests run as always.
        return render(request, "web/memory_list.html", {**context, "memories": [], "search_held": True})
    try:
        if query:
            arguments = {"query": query, "top_k": SEARCH_RESULTS, "filters": filters or None, **field_filters}
            found = _execute(request, "search_memory", arguments)["results"]
            if date_from or date_to:
                found = [m for m in found if _within(m["created_at"], date_from, date_to)]
            context["memories"] = found
        else:
            page = _execute(
                request,
                "list_memory_dated",
                {
                    "cursor": request.GET.get("cursor") or None,
                    "page_size": PAGE_SIZE,
                    "filters": filters or None,
                    "created_from": date_from,
                    "created_before": _day_after(date_to),
                    **field_filters,
                },
            )
            context.update(memories=page["memories"], next_cursor=page["next_cursor"])
    except ServiceError as exc:
        # The page still renders (with the message), under the error's status: a bad
        # cursor or query is a 400, like the same mistake over REST.
        messages.error(request, exc.message)
        context["memories"] = []
        return render(request, "web/memory_list.html", context, status=exc.http_status)
    return render(request, "web/memory_list.html", context)


def _tags_param(raw: str) -> list[str]:
    return [t.strip() for t in raw.split(",") if t.strip()][: TAGS_MAX + 1]


def _field_filters(request) -> dict:
    """memory_type and tags (comma-separated) from the list page's query string."""
    found: dict = {}
    memory_type = request.GET.get("memory_type", "")
    if memory_type:
        found["memory_type"] = memory_type
    tags = _tags_param(request.GET.get("tags", ""))
    if tags:
        found["tags"] = tags
    return found


def _day_after(day: str | None) -> str | None:
    """The exclusive upper bound for "created on or before `day`"; none after 9999-12-31."""
    if not day:
        return None
    try:
        return (date.fromisoformat(day) + timedelta(days=1)).isoformat()
    except OverflowError:
        return None


def _within(created_at: str | None, date_from: str | None, date_to: str | None) -> bool:
    day = (created_at or "")[:10]
    return (not date_from or day >= date_from) and (not date_to or day <= date_to)


@login_required
@require_GET
def memory_detail(request, memory_id: str):
    memory = _owned_or_404(request, "get_memory", {"memory_id": str(memory_id)})["memory"]
    versions = memory_versions(_scope(request), memory_id=memory["id"])
    return render(
        request,
        "web/memory_detail.html",
        {"memory": memory, "versions": versions, "max_chars": MEMORY_MAX_CHARS, "memory_types": MemoryType.values},
    )


def _update(request, memory_id: str, arguments: dict) -> HttpResponseRedirect:
    try:
        _owned_or_404(request, "update_memory", {"memory_id": str(memory_id), **arguments})
        messages.success(request, "Saved.")
    except ServiceError as exc:
        messages.error(request, exc.message)
    return redirect("web-memory", memory_id=memory_id)


@login_required
@require_POST
def memory_pin(request, memory_id: str):
    return _update(request, memory_id, {"pinned": request.POST.get("pinned") == "true"})


@login_required
@require_POST
def memory_edit(request, memory_id: str):
    return _update(request, memory_id, {"memory": _form_text(request.POST.get("memory", ""))})


def _form_text(text: str) -> str:
    """A textarea as typed: browsers submit its line breaks as CRLF, which would store
    CRLF and count two characters per line break against the limit."""
    return text.replace("\r\n", "\n").replace("\r", "\n")


@login_required
@require_POST
def memory_fields_edit(request, memory_id: str):
    """The typed fields: type, tags, importance, agent, session, expiry, source, why."""
    post = request.POST
    arguments: dict = {
        "memory_type": post.get("memory_type") or "user",
        "tags": _tags_param(post.get("tags", "")),
        "agent_id": post.get("agent_id", "").strip() or None,
        "session_id": post.get("session_id", "").strip() or None,
        "why_stored": post.get("why_stored", "").strip() or None,
        "expires_at": post.get("expires_at", "").strip() or None,
    }
    if post.get("source", "").strip():
        arguments["source"] = post["source"].strip()
    raw_importance = post.get("importance", "").strip()
    try:
        arguments["importance"] = float(raw_importance) if raw_importance else 0.5
    except ValueError:
        messages.error(request, "Importance must be a number from 0 to 1.")
        return redirect("web-memory", memory_id=memory_id)
    if arguments["expires_at"] and len(arguments["expires_at"]) == 16:  # datetime-local: YYYY-MM-DDTHH:MM
        arguments["expires_at"] += ":00Z"
    current = _owned_or_404(request, "get_memory", {"memory_id": str(memory_id)})["memory"]
    if arguments["expires_at"] == current["expires_at"]:
        arguments.pop("expires_at")  # unchanged (and maybe passed by now); only a new date must be future
    if arguments.get("source") == current["source"]:
        arguments.pop("source")  # unchanged (a store_memory row's own source may not be set)
    if post.get("tags", "").strip() == ", ".join(current["tags"]):
        # Unchanged: the form shows them joined by commas, so a tag holding a comma
        # (the API allows it) would come back as two.
        arguments.pop("tags")
    return _update(request, memory_id, arguments)


@login_required
@require_http_methods(["GET", "POST"])
def memory_forget(request):
    """Bulk forget: the memories matching the list page's type, tags and dates. GET shows
    the count (a dry run); POST moves them to the trash."""
    source = request.POST if request.method == "POST" else request.GET
    arguments: dict = {}
    if source.get("memory_type"):
        arguments["memory_type"] = source["memory_type"]
    tags = _tags_param(source.get("tags", ""))
    if tags:
        arguments["tags"] = tags
    date_from, date_to = source.get("date_from", "").strip(), source.get("date_to", "").strip()
    if date_from or date_to:
        arguments["time_range"] = {
            k: v for k, v in {"start": date_from or None, "end": _safe_day_after(date_to)}.items() if v
        }
    context = {
        "memory_type": arguments.get("memory_type", ""),
        "tags": ", ".join(tags),
        "date_from": date_from,
        "date_to": date_to,
        "trash_on": _trash_on(),
    }
    try:
        if request.method == "POST":
            result = _execute(request, "delete_memory", {**arguments, "confirm": True})
            count = result["deleted_count"]
            messages.success(
                request,
                f"Moved {count} memories to the trash." if _trash_on() else f"Deleted {count} memories for good.",
            )
            return redirect("web-memories")
        context["count"] = _execute(request, "delete_memory", {**arguments, "dry_run": True})["deleted_count"]
    except ServiceError as exc:
        messages.error(request, exc.message)
        return redirect("web-memories")
    return render(request, "web/memory_forget.html", context)


def _safe_day_after(day: str) -> str | None:
    try:
        return _day_after(day) if day else None
    except ValueError:
        return day  # the dispatcher refuses it with a clear message


@login_required
@require_GET
def trash(request):
    scope = _scope(request)
    page, status = page_read(request, TRASH, lambda seek: memory_trash_page(scope, limit=TRASH_PAGE_SIZE, seek=seek))
    trashed = [item.as_dict() for item in page]
    groups: dict[str, dict] = {}
    for item in trashed:
        group = groups.setdefault(
            item["request_id"],
            {"request_id": item["request_id"], "operation": item["operation"], "at": item["trashed_at"], "items": []},
        )
        group["items"].append(item)
    listed = list(groups.values())
    for group in listed:
        group["count"] = len(group["items"])
    # A call's group can run over a page boundary: "Restore all" restores all of it.
    boundary = ([listed[0]] if listed and page.previous else []) + ([listed[-1]] if listed and page.next else [])
    for group in boundary:
        group["count"] = memory_trash_count(scope, request_id=group["request_id"])
    count = memory_trash_count(scope)
    return render(
        request,
        "web/trash.html",
        {
            "groups": listed,
            "count": count,
            "pager": pager_of(request, TRASH, page, total=count),
            "retention_days": settings.TRASH_RETENTION_DAYS,
        },
        status=status,
    )


@login_required
@require_POST
def trash_restore(request):
    arguments = {"memory_id": request.POST["memory_id"]} if request.POST.get("memory_id") else {}
    if request.POST.get("request_id"):
        arguments = {"request_id": request.POST["request_id"]}
    try:
        restored = _execute(request, "restore_memory", arguments)["restored"]
        messages.success(request, f"Restored {len(restored)} {'memory' if len(restored) == 1 else 'memories'}.")
    except ServiceError as exc:
        messages.error(request, exc.message)
    return redirect("web-trash")


@login_required
@require_POST
def trash_purge(request):
    if request.POST.get("memory_id"):
        arguments: dict = {"memory_id": request.POST["memory_id"]}
    else:
        arguments = {"all": request.POST.get("all") == "true"}
    try:
        purged = _execute(request, "purge_memory", arguments)["purged"]
        messages.success(request, f"Deleted {purged} forever.")
    except ServiceError as exc:
        messages.error(request, exc.message)
    return redirect("web-trash")


@login_required
@require_http_methods(["GET", "POST"])
def memory_delete_view(request, memory_id: str):
    if request.method == "GET":
        memory = _owned_or_404(request, "get_memory", {"memory_id": str(memory_id)})["memory"]
        return render(request, "web/memory_delete.html", {"memory": memory, "trash_on": _trash_on()})
    try:
        _owned_or_404(request, "delete_memory", {"memory_id": str(memory_id)})
    except ServiceError as exc:
        messages.error(request, exc.message)
        return redirect("web-memory", memory_id=memory_id)
    messages.success(request, f"Memory deleted. {_after_delete('it')}")
    return redirect("web-memories")


def _trash_on() -> bool:
    """TRASH_RETENTION_DAYS=0 turns the trash off: a delete is for good."""
    return settings.TRASH_RETENTION_DAYS > 0


def _after_delete(pronoun: str) -> str:
    """What became of deleted memories ("it" or "them"): restorable only with the trash on."""
    if _trash_on():
        return f"You can restore {pronoun} from the trash."
    return f"{'It is' if pronoun == 'it' else 'They are'} gone for good."


CLEAR_PHRASE = "delete all my memories"


@login_required
@require_http_methods(["GET", "POST"])
def memory_clear(request):
    if request.method == "POST":
        confirmed = request.POST.get("confirmation", "").strip().lower() == CLEAR_PHRASE
        try:
            deleted = _execute(request, "clear_all_memory", {"confirm": confirmed})["deleted"]
            messages.success(request, f"Deleted {deleted} memories. {_after_delete('them')}")
            return redirect("web-memories")
        except ServiceError as exc:
            if exc.code == ErrorCode.CONFIRMATION_REQUIRED:
                messages.error(request, f'Type "{CLEAR_PHRASE}" to confirm.')
            else:
                messages.error(request, exc.message)
    return render(request, "web/memory_clear.html", {"phrase": CLEAR_PHRASE, "trash_on": _trash_on()})


@login_required
@require_http_methods(["GET", "POST"])
def api_keys(request):
    new_key = None
    if request.method == "POST":
        name = request.POST.get("name", "").strip()[:100] or "web"
        # Least privilege (issue 12): permissions and an optional expiry. A key made here
        # acts only for its own user (roles are given by staff, in the admin or the CLI).
        chosen = frozenset(request.POST.getlist("permissions")) & ALL_PERMISSIONS
        if "permissions_shown" not in request.POST:
            chosen = ALL_PERMISSIONS  # a form without the choice: today's default
        expires_days = request.POST.get("expires_days", "").strip()
        days = digits_int(expires_days, max_digits=4)
        if not chosen:
            messages.error(request, "Choose at least one permission.")
        elif expires_days and not (days is not None and 1 <= days <= 3650):
            messages.error(request, "Expiry: a number of days from 1 to 3650, or never.")
        else:
            expires_at = timezone.now() + timedelta(days=days) if days is not None else None
            with ui_call_observed(Operation.API_KEY_ISSUE):
                _, new_key = api_key_issue(
                    user=request.user, name=name, permissions=chosen, expires_at=expires_at, call=web_call(request)
                )
            messages.success(request, "Key created. Copy it now: it will not be shown again.")
    keys = ApiKey.objects.filter(user=request.user).order_by("-created_at")
    base = settings.PUBLIC_BASE_URL or request.build_absolute_uri("/").rstrip("/")
    return render(
        request,
        "web/api_keys.html",
        {
            "keys": keys,
            "new_key": new_key,
            "mcp_url": f"{base}{MEMORY_MCP_PATH}",
            "permission_choices": Permission.choices,
            "now": timezone.now(),
        },
    )


@login_required
@require_POST
def api_key_revoke_view(request, key_id: str):
    with ui_call_observed(Operation.API_KEY_REVOKE) as observation:
        if not api_key_revoke(user=request.user, key_id=key_id, call=web_call(request)):
            # The service answers False, not a ServiceError: the 404 is counted as one here.
            observation.failed(code=ErrorCode.NOT_FOUND)
            raise Http404("No such key.")
    messages.success(request, "Key revoked.")
    return redirect(reverse("web-keys"))


@login_required
@require_GET
def activity(request):
    """What was done with my memories, and by whom: services acting for me show by name
    and role (issue 12)."""
    by_services = request.GET.get("by") == "services"
    scope = _scope(request)
    rows, status = page_read(
        request, ACTIVITY, lambda seek: memory_activity(scope, by_services=by_services, limit=ACTIVITY_LIMIT, seek=seek)
    )
    total = memory_activity_count(scope, by_services=by_services, cap=ACTIVITY_COUNT_CAP)
    # The pager's links keep the filter.
    pager = pager_of(
        request,
        ACTIVITY,
        rows,
        total=total,
        total_cap=ACTIVITY_COUNT_CAP,
        keep={"by": "services"} if by_services else None,
    )
    return render(
        request, "web/activity.html", {"rows": rows, "by_services": by_services, "pager": pager}, status=status
    )


@login_required
@require_GET
def usage(request):
    rows = usage_by_day(_scope(request), days=30)
    return render(request, "web/usage.html", {"rows": rows})


IMPORT_SOURCES = (
    ("memsite", "a memsite export (.jsonl)"),
    ("mem0", "a mem0 export (.json)"),
    ("openmemory", "an OpenMemory export (.zip)"),
)


@login_required
@require_GET
def data_page(request):
    """Your data: download all memories, or bring in a file from memsite, mem0 or OpenMemory."""
    return render(request, "web/data.html", {"sources": IMPORT_SOURCES, "max_bytes": settings.IMPORT_MAX_BYTES})


@login_required
@require_POST
def data_export(request):
    """The memories as a file, streamed (memory_export_stream: the same file and the same
    billed, audited call as the API's export_memories, never held whole in memory). A POST
    with the CSRF token: another site can navigate a signed-in browser to a GET (Lax
    cookies go along), which would bill an export and spend the user's export limit."""
    file_format = request.POST.get("format", "jsonl")
    try:
        lines = lines_observed(
            operation=Operation.EXPORT_MEMORIES,
            channel=Channel.UI,
            start=lambda: memory_export_stream(_scope(request), file_format=file_format, call=web_call(request)),
        )
    except ServiceError as exc:
        messages.error(request, exc.message)
        return redirect("web-data")
    content_type, filename = EXPORT_DOWNLOADS[file_format]
    return streaming_download(request, lines, content_type=f"{content_type}; charset=utf-8", filename=filename)


@login_required
@require_POST
def data_import(request):
    upload = request.FILES.get("file")
    # A refusal before the file is read is still a failed import: it goes to the dispatcher
    # as RejectedArguments (as REST's `upload_bytes` does), which answers and audits it like
    # a bad file the service refuses (one error row, its message only, never the content).
    arguments: dict | schemas.RejectedArguments
    if upload is None:
        arguments = schemas.RejectedArguments(ServiceError(ErrorCode.INVALID_ARGUMENT, "choose a file to import"))
    elif upload.size > settings.IMPORT_MAX_BYTES:
        arguments = schemas.RejectedArguments(
            ServiceError(ErrorCode.PAYLOAD_TOO_LARGE, f"the file exceeds {settings.IMPORT_MAX_BYTES} bytes")
        )
    else:
        arguments = {"data": upload.read(), "source": request.POST.get("source", "memsite")}
    try:
        result = _execute(request, "import_memories", arguments)
    except ServiceError as exc:
        messages.error(request, f"Nothing was imported: {exc.message}")
        return redirect("web-data")
    messages.success(
        request,
        f"Imported {result['imported']} memories; {result['duplicates']} you already had were skipped."
        + (f" {result['expired']} had already expired and were left out." if result.get("expired") else ""),
    )
    return redirect("web-data")
