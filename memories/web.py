"""The end user's web UI: browse, search, pin, edit and delete my memories; API keys;
usage. Server-rendered; every action goes through the same services as MCP and REST
(same scope, rate limits, audit rows and usage events)."""

from __future__ import annotations

from datetime import date

from django.conf import settings
from django.contrib import messages
from django.contrib.auth import views as auth_views
from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpResponseRedirect
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from memories.accounting import failures_audited
from memories.errors import ErrorCode, ServiceError
from memories.mcp_paths import MCP_PATH
from memories.models import ApiKey
from memories.schemas import MEMORY_MAX_CHARS, UpdateInput, validate_input
from memories.scope import CallContext, MemoryScope
from memories.selectors import (
    memory_client_apps,
    memory_get,
    memory_list,
    memory_search,
    memory_versions,
    usage_by_day,
)
from memories.services import api_key_issue, api_key_revoke, memory_clear_all, memory_delete, memory_update

PAGE_SIZE = 25
SEARCH_RESULTS = 50
WEB_CLIENT = "web"


def _scope(request) -> MemoryScope:
    return MemoryScope.for_user(request.user, client_app=WEB_CLIENT)


def _call(request) -> CallContext:
    return CallContext(
        channel="ui",
        ip=request.META.get("REMOTE_ADDR"),
        user_agent=request.META.get("HTTP_USER_AGENT", "")[:300],
        actor_username=request.user.get_username(),
        actor_auth="session",
    )


def _owned_or_404(operation: str, fn, scope: MemoryScope, *, call: CallContext, **kwargs):
    """Run a service on one memory; a missing or foreign id is a 404 (and audited)."""
    try:
        with failures_audited(scope, call=call, operation=operation, memory_id=kwargs.get("memory_id")):
            return fn(scope, call=call, **kwargs)
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
    scope, call = _scope(request), _call(request)
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
            with failures_audited(scope, call=call, operation="search_memory"):
                found = memory_search(scope, query=query, top_k=SEARCH_RESULTS, filters=filters or None, call=call)
            if date_from or date_to:
                found = [m for m in found if _within(m.created_at, date_from, date_to)]
            context["memories"] = found
        else:
            with failures_audited(scope, call=call, operation="list_memory"):
                page = memory_list(
                    scope,
                    cursor=request.GET.get("cursor") or None,
                    page_size=PAGE_SIZE,
                    filters=filters or None,
                    created_from=date_from,
                    created_before=_day_after(date_to),
                    call=call,
                )
            context.update(memories=page.memories, next_cursor=page.next_cursor)
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
    scope = _scope(request)
    memory = _owned_or_404("get_memory", memory_get, scope, memory_id=str(memory_id), call=_call(request))
    versions = memory_versions(scope, memory_id=memory.id)
    return render(
        request, "web/memory_detail.html", {"memory": memory, "versions": versions, "max_chars": MEMORY_MAX_CHARS}
    )


def _update(request, memory_id: str, arguments: dict) -> HttpResponseRedirect:
    scope, call = _scope(request), _call(request)

    def validated_update(scope, *, call, memory_id):
        data = validate_input(UpdateInput, {"memory_id": memory_id, **arguments})
        return memory_update(scope, memory_id=data.memory_id, memory=data.memory, pinned=data.pinned, call=call)

    try:
        _owned_or_404("update_memory", validated_update, scope, memory_id=str(memory_id), call=call)
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
    scope, call = _scope(request), _call(request)
    if request.method == "GET":
        memory = _owned_or_404("get_memory", memory_get, scope, memory_id=str(memory_id), call=call)
        return render(request, "web/memory_delete.html", {"memory": memory})
    try:
        _owned_or_404("delete_memory", memory_delete, scope, memory_id=str(memory_id), call=call)
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
        scope, call = _scope(request), _call(request)
        confirmed = request.POST.get("confirmation", "").strip().lower() == CLEAR_PHRASE
        try:
            with failures_audited(scope, call=call, operation="clear_all_memory"):
                deleted = memory_clear_all(scope, confirm=confirmed, call=call)
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
    return render(request, "web/api_keys.html", {"keys": keys, "new_key": new_key, "mcp_url": f"{base}{MCP_PATH}"})


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
