"""The chat proxy section of the user's API-key page: one key's upstream configuration
(the owner's own keys only; another user's key id is a 404 like a missing one)."""

from __future__ import annotations

import json
from typing import Any

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_http_methods

from core.choices import Operation
from core.errors import ErrorCode, ServiceError
from core.inputs import InputError, digits_int, json_loads_safe, text_problem
from memories.interfaces.web.views import ui_call_observed, web_call
from memories.models import ApiKey
from proxy import services
from proxy.models import TokenConfig

JSON_FIELDS = ("extra_body", "memory_llm")
INT_FIELDS = ("memory_limit", "session_window_size")


def _form_fields(post) -> dict:
    """The form as token_config_save's fields; every value is checked there or here
    (JSON through core.inputs: no RecursionError, NaN or NUL), so a bad one is this
    page again with a message (400), never a 500 or a row that fails later."""
    fields: dict = {"upstream_base_url": post.get("upstream_base_url", "").strip()}
    if post.get("upstream_api_key", "").strip():  # blank keeps the stored key
        fields["upstream_api_key"] = post["upstream_api_key"].strip()
    fields["memory_prompt"] = post.get("memory_prompt", "")
    for name in JSON_FIELDS:
        text = post.get(name, "").strip() or "{}"
        try:
            fields[name] = json_loads_safe(text)
        except InputError as exc:
            raise ServiceError(ErrorCode.INVALID_ARGUMENT, f"{name} must be a JSON object: {exc.message}.") from None
    for name in INT_FIELDS:
        number = digits_int(post.get(name, "").strip(), max_digits=9)
        if number is None:
            raise ServiceError(ErrorCode.INVALID_ARGUMENT, f"{name} must be a whole number.")
        fields[name] = number
    return fields


@login_required
@require_http_methods(["GET", "POST"])
def key_chat_config(request: HttpRequest, key_id: str) -> HttpResponse:
    user: Any = request.user  # a signed-in User (login_required), whatever the stubs say
    # A NUL would reach the database as a DataError: no key id has one.
    api_key = (
        None
        if text_problem(key_id)
        else ApiKey.objects.filter(user=user, key_id=key_id, revoked_at__isnull=True).first()
    )
    if api_key is None:
        raise Http404("No such key.")
    row = TokenConfig.objects.filter(api_key=api_key).first()
    call = web_call(request)
    status = 200
    if request.method == "POST":
        if "delete" in request.POST:
            with ui_call_observed(Operation.PROXY_TOKEN_CONFIG):
                services.token_config_delete(api_key=api_key, call=call)
            messages.success(request, "Configuration removed: this key uses the deployment's default upstream.")
            return redirect(reverse("proxy-key-config", args=[key_id]))
        try:
            with ui_call_observed(Operation.PROXY_TOKEN_CONFIG):
                services.token_config_save(api_key=api_key, fields=_form_fields(request.POST), partial=True, call=call)
        except ServiceError as exc:
            messages.error(request, exc.message)
            status = 400
        else:
            messages.success(request, "Saved. The upstream API key is stored encrypted and not shown again.")
            return redirect(reverse("proxy-key-config", args=[key_id]))
    return render(
        request,
        "proxy/key_config.html",
        {"key": api_key, "config": row, "extra_body": json.dumps(row.extra_body if row else {}),
         "memory_llm": json.dumps(row.memory_llm if row else {}),
         "chat_url": request.build_absolute_uri("/v1")},
        status=status,
    )  # fmt: skip
