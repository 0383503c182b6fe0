"""The end user's web UI: browse, search, pin, edit and delete my memories; API keys;
usage. Server-rendered; every memory action goes through the same operation dispatcher as MCP and REST
(same scope, rate limits, audit rows and usage events)."""

from __future__ import annotations

from datetime import date

from django.conf import settings
from django.contrib import messages
from django.contrib.auth import views as auth_views
from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpResponse, HttpResponseRedirect
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from core.calls import call_context_from_request
from core.choices import Channel
from core.errors import ErrorCode, ServiceError
from core.scope import MemoryScope
from memories.auth import Principal
from memories.interfaces.wellknown import MEMORY_MCP_PATH
from memories.models import ApiKey
from memories.operations import operation_execute
from memories.schemas import MEMORY_MAX_CHARS
from memories.selectors import memory_client_apps, memory_versions, usage_by_day
from memories.services import api_key_issue, api_key_revoke

PAGE_SIZE = 25
SEARCH_RESULTS = 50
WEB_CLIENT = "web"


def _principal(request) -> Principal:
    return Principal(user=request.user, method="session", client_app=WEB_CLIENT)


def _scope(request) -> MemoryScope:
    return _principal(request).scope()


def _execute(request, name: str, arguments: dict) -> dict:
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


class LoginView(auth_views.LoginView):
    def get_context_data(self, **kwargs):
        return {**super().get_context_data(**kwargs), "oidc_enabled": settings.OIDC_WEB_LOGIN}


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
    context = {
        "query": query,
        "pinned": pinned,
        "source": source,
        "date_from": date_from or "",
        "date_to": date_to or "",
        "sources": memory_client_apps(scope),
        "next_cursor": None,
    }
    try:
        if query:
            arguments = {"query": query, "top_k": SEARCH_RESULTS, "filters": filters or None}
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
                },
            )
            context.update(memories=page["memories"], next_cursor=page["next_cursor"])
    except ServiceError as exc:
        messages.error(request, exc.message)
        context["memories"] = []
    return render(request, "web/memory_list.html", context)


def _day_after(day: str | None) -> str | None:
    if not day:
        return None
    from datetime import timedelta

    return (date.fromisoformat(day) + timedelta(days=1)).isoformat()


def _within(created_at: str | None, date_from: str | None, date_to: str | None) -> bool:
    day = (created_at or "")[:10]
    return (not date_from or day >= date_from) and (not date_to or day <= date_to)


@login_required
@require_GET
def memory_detail(request, memory_id: str):
    memory = _owned_or_404(request, "get_memory", {"memory_id": str(memory_id)})["memory"]
    versions = memory_versions(_scope(request), memory_id=memory["id"])
    return render(
        request, "web/memory_detail.html", {"memory": memory, "versions": versions, "max_chars": MEMORY_MAX_CHARS}
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
    return _update(request, memory_id, {"memory": request.POST.get("memory", "")})


@login_required
@require_http_methods(["GET", "POST"])
def memory_delete_view(request, memory_id: str):
    if request.method == "GET":
        memory = _owned_or_404(request, "get_memory", {"memory_id": str(memory_id)})["memory"]
        return render(request, "web/memory_delete.html", {"memory": memory})
    try:
        _owned_or_404(request, "delete_memory", {"memory_id": str(memory_id)})
    except ServiceError as exc:
        messages.error(request, exc.message)
        return redirect("web-memory", memory_id=memory_id)
    messages.success(request, "Memory deleted.")
    return redirect("web-memories")


CLEAR_PHRASE = "delete all my memories"


@login_required
@require_http_methods(["GET", "POST"])
def memory_clear(request):
    if request.method == "POST":
        confirmed = request.POST.get("confirmation", "").strip().lower() == CLEAR_PHRASE
        try:
            deleted = _execute(request, "clear_all_memory", {"confirm": confirmed})["deleted"]
            messages.success(request, f"Deleted {deleted} memories.")
            return redirect("web-memories")
        except ServiceError as exc:
            if exc.code == ErrorCode.CONFIRMATION_REQUIRED:
                messages.error(request, f'Type "{CLEAR_PHRASE}" to confirm.')
            else:
                messages.error(request, exc.message)
    return render(request, "web/memory_clear.html", {"phrase": CLEAR_PHRASE})


@login_required
@require_http_methods(["GET", "POST"])
def api_keys(request):
    new_key = None
    if request.method == "POST":
        name = request.POST.get("name", "").strip()[:100] or "web"
        _, new_key = api_key_issue(user=request.user, name=name)
        messages.success(request, "Key created. Copy it now: it will not be shown again.")
    keys = ApiKey.objects.filter(user=request.user).order_by("-created_at")
    base = settings.PUBLIC_BASE_URL or request.build_absolute_uri("/").rstrip("/")
    return render(
        request, "web/api_keys.html", {"keys": keys, "new_key": new_key, "mcp_url": f"{base}{MEMORY_MCP_PATH}"}
    )


@login_required
@require_POST
def api_key_revoke_view(request, key_id: str):
    if not api_key_revoke(user=request.user, key_id=key_id):
        raise Http404("No such key.")
    messages.success(request, "Key revoked.")
    return redirect(reverse("web-keys"))


@login_required
@require_GET
def usage(request):
    rows = usage_by_day(_scope(request), days=30)
    return render(request, "web/usage.html", {"rows": rows})


EXPORT_DOWNLOADS = {"jsonl": ("application/x-ndjson", "memories.jsonl"), "markdown": ("text/markdown", "memories.md")}
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
@require_GET
def data_export(request):
    try:
        result = _execute(request, "export_memories", {"format": request.GET.get("format", "jsonl")})
    except ServiceError as exc:
        messages.error(request, exc.message)
        return redirect("web-data")
    content_type, filename = EXPORT_DOWNLOADS[result["format"]]
    response = HttpResponse(result["content"], content_type=f"{content_type}; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="{filename}"'
    return response


@login_required
@require_POST
def data_import(request):
    upload = request.FILES.get("file")
    if upload is None:
        messages.error(request, "Choose a file to import.")
        return redirect("web-data")
    if upload.size > settings.IMPORT_MAX_BYTES:
        messages.error(request, f"The file exceeds {settings.IMPORT_MAX_BYTES} bytes; nothing was imported.")
        return redirect("web-data")
    try:
        result = _execute(
            request, "import_memories", {"data": upload.read(), "source": request.POST.get("source", "memsite")}
        )
    except ServiceError as exc:
        messages.error(request, f"Nothing was imported: {exc.message}")
        return redirect("web-data")
    messages.success(
        request,
        f"Imported {result['imported']} memories; {result['duplicates']} you already had were skipped.",
    )
    return redirect("web-data")
