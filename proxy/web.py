"""The chat proxy section of the user's API-key page: one key's upstream configuration
(the owner's own keys only; another user's key id is a 404 like a missing one). A revoked
or expired key's configuration can only be removed."""

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
from proxy import selectors, services

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
    """A live key's settings, shown and changed; a revoked or expired key's (it never
    authenticates again) neither shown nor changed, only removed, so its owner can take
    the encrypted upstream key out of the database themselves."""
    user: Any = request.user  # a signed-in User (login_required), whatever the stubs say
    # A NUL would reach the database as a DataError: no key id has one.
    api_key = None if text_problem(key_id) else selectors.token_owner_key(user, key_id=key_id)
    if api_key is None:
        raise Http404("No such key.")
    retired = not api_key.is_active
    call = web_call(request)
    status = 200
    if request.method == "POST":
        if "delete" in request.POST:
            with ui_call_observed(Operation.PROXY_TOKEN_CONFIG):
                deleted = services.token_config_delete(api_key=api_key, call=call)
            if not deleted:
                messages.info(request, "This key has no chat proxy settings.")
            elif retired:
                messages.success(request, "Settings removed, the upstream API key with them.")
            else:
                messages.success(request, "Configuration removed: this key uses the deployment's default upstream.")
            return redirect(reverse("proxy-key-config", args=[key_id]))
        try:
            with ui_call_observed(Operation.PROXY_TOKEN_CONFIG):
                # A retired key's save is refused by the service (conflict), whatever the form says.
                fields = _form_fields(request.POST) if not retired else {}
                services.token_config_save(api_key=api_key, fields=fields, partial=True, call=call)
        except ServiceError as exc:
            messages.error(request, exc.message)
            status = 409 if exc.code == ErrorCode.CONFLICT else 400
        else:
            messages.success(request, "Saved. The upstream API key is stored encrypted and not shown again.")
            return redirect(reverse("proxy-key-config", args=[key_id]))
    row = selectors.token_config_of_key(api_key=api_key)
    return render(
        request,
        "proxy/key_config.html",
        {"key": api_key, "config": row, "retired": retired,
         "extra_body": json.dumps(row.extra_body if row and not retired else {}),
         "memory_llm": json.dumps(row.memory_llm if row and not retired else {}),
         "chat_url": request.build_absolute_uri("/v1")},
        status=status,
    )  # fmt: skip
