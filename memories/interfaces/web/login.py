"""Sign-in with a password (the web UI's login page and the admin's), behind the login
throttle (audit.services.login_attempt_begin): a refused attempt never reaches the
password check; a failed one is counted and audited. The form does it, not a signal
handler: no side effects in signals."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from django.conf import settings
from django.contrib.admin.forms import AdminAuthenticationForm
from django.contrib.auth import views as auth_views
from django.contrib.auth.forms import AuthenticationForm
from django.core.exceptions import ValidationError
from django.http import HttpResponse
from django.urls import reverse
from mozilla_django_oidc.views import get_next_url

from audit.services import login_attempt_begin, login_attempt_failed, login_attempt_succeeded
from core.calls import call_context_from_request
from core.choices import Channel
from core.errors import ServiceError


class ThrottledLoginForm(AuthenticationForm):
    """Django's sign-in form, its password check between the throttle's admission and
    the attempt's outcome."""

    channel: Channel = Channel.UI
    # Set when the throttle refused the attempt: the page answers 429 with its message.
    refusal: ServiceError | None = None

    def clean(self) -> dict[str, Any]:
        username, password = self.cleaned_data.get("username"), self.cleaned_data.get("password")
        if not username or not password:
            return self.cleaned_data  # the fields' own errors: no password to check
        call = call_context_from_request(self.request, channel=self.channel)
        try:
            attempt = login_attempt_begin(call=call, username=username)
        except ServiceError as refusal:
            self.refusal = refusal
            raise ValidationError(refusal.message, code=refusal.code.value) from None
        # Anything but a success (a wrong password, an inactive account, a crash before
        # the answer) leaves the attempt counted as a failure.
        try:
            cleaned = super().clean()
        except ValidationError:
            login_attempt_failed(attempt, call=call, username=username)
            raise
        login_attempt_succeeded(attempt)
        return cleaned


class AdminLoginForm(ThrottledLoginForm, AdminAuthenticationForm):
    """The admin's sign-in (staff only) under the same limits: otherwise /admin/login/
    would be a way around them."""

    channel = Channel.ADMIN


class LoginView(auth_views.LoginView):
    authentication_form = ThrottledLoginForm

    def get_context_data(self, **kwargs: Any) -> dict[str, Any]:
        context = super().get_context_data(**kwargs)
        context["oidc_enabled"] = settings.OIDC_WEB_LOGIN
        if settings.OIDC_WEB_LOGIN:
            context["oidc_login_url"] = self._oidc_login_url()
        return context

    def _oidc_login_url(self) -> str:
        """The provider sign-in, carrying this page's `next` (e.g. the consent page of an
        app being connected) when mozilla-django-oidc's own check lets it through (this
        host or OIDC_REDIRECT_ALLOWED_HOSTS, https when required): it sends the user
        there after the callback."""
        url = reverse("oidc_authentication_init")
        next_url = get_next_url(self.request, self.redirect_field_name)
        if not next_url:
            return url
        return f"{url}?{urlencode({getattr(settings, 'OIDC_REDIRECT_FIELD_NAME', 'next'): next_url})}"

    def form_invalid(self, form: AuthenticationForm) -> HttpResponse:
        response = super().form_invalid(form)
        refusal = getattr(form, "refusal", None)
        if refusal is not None:
            response.status_code = refusal.http_status
            response["Retry-After"] = str(refusal.retry_after_s)
        return response
