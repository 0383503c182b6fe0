"""Session 32 on the owner's chat proxy settings page (`/keys/<key_id>/chat/`): a revoked
or expired key's settings (it never authenticates again) are neither shown nor changed,
as at the admin token API, but the owner can remove them, the encrypted upstream key
with them; another user's key id stays a 404 like a missing one."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from audit.models import AuditEvent
from core.choices import Operation
from memories.models import ApiKey
from memories.services import api_key_issue
from proxy.models import TokenConfig
from proxy.services import token_config_save
from tests.conftest import internal_call

pytestmark = pytest.mark.django_db

FORM = {
    "upstream_base_url": "https://api.changed.example",
    "upstream_api_key": "sk-changed",
    "memory_limit": "3",
    "session_window_size": "10",
    "extra_body": "{}",
    "memory_llm": "{}",
    "memory_prompt": "",
}


def configured(user, name: str) -> ApiKey:
    api_key, _ = api_key_issue(user=user, name=name)
    fields = {"upstream_base_url": f"https://api.{name}.example", "upstream_api_key": f"sk-{name}"}
    token_config_save(api_key=api_key, fields=fields, partial=False, call=internal_call())
    return api_key


def retire(api_key: ApiKey, how: str) -> None:
    column = "revoked_at" if how == "revoked" else "expires_at"
    ApiKey.objects.filter(pk=api_key.pk).update(**{column: timezone.now() - timedelta(minutes=1)})


def web_rows() -> list[tuple]:
    rows = AuditEvent.objects.filter(operation=Operation.PROXY_TOKEN_CONFIG).exclude(channel="internal")
    return list(rows.order_by("id").values_list("subject_user_id", "outcome", "detail__action"))


def csrf_token(page) -> str:
    return re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.content.decode()).group(1)


@pytest.mark.parametrize("how", ["revoked", "expired"])
def test_a_retired_keys_settings_are_not_shown_nor_changed_but_can_be_removed(alice, how):
    """An expired key's settings were shown and editable, a revoked key's page a 404, so
    its owner could not remove its settings (the encrypted upstream key among them)."""
    api_key = configured(alice, "alice")
    retire(api_key, how)
    browser = Client(enforce_csrf_checks=True)
    browser.force_login(alice)
    url = reverse("proxy-key-config", args=[api_key.key_id])

    page = browser.get(url)
    assert page.status_code == 200
    text = page.content.decode()
    assert f"This key is {how}" in text
    assert "api.alice.example" not in text and 'name="upstream_base_url"' not in text
    assert 'name="delete"' in text

    token = csrf_token(page)
    refused = browser.post(url, {**FORM, "csrfmiddlewaretoken": token})
    assert refused.status_code == 409
    assert "cannot be changed, only removed" in refused.content.decode()
    row = TokenConfig.objects.get(api_key=api_key)
    assert row.upstream_base_url == "https://api.alice.example" and row.memory_limit != 3

    assert browser.post(url, {"delete": "1"}).status_code == 403  # no CSRF token: refused, not run
    assert TokenConfig.objects.filter(api_key=api_key).exists()
    removed = browser.post(url, {"delete": "1", "csrfmiddlewaretoken": token})
    assert removed.status_code == 302
    assert not TokenConfig.objects.filter(api_key=api_key).exists()
    assert web_rows() == [(alice.pk, AuditEvent.Outcome.OK, "delete")]
    after = browser.get(url).content.decode()
    assert "no chat proxy settings stored" in after and 'name="delete"' not in after


@pytest.mark.parametrize("how", ["live", "revoked", "expired"])
def test_another_users_key_is_a_404_like_a_missing_one(alice, bob, how):
    bob_key = configured(bob, "bob")
    if how != "live":
        retire(bob_key, how)
    browser = Client()
    browser.force_login(alice)
    url = reverse("proxy-key-config", args=[bob_key.key_id])
    missing = reverse("proxy-key-config", args=["nosuchkey"])
    for target in (url, missing):
        assert browser.get(target).status_code == 404
        assert browser.post(target, FORM).status_code == 404
        assert browser.post(target, {"delete": "1"}).status_code == 404
    assert TokenConfig.objects.get(api_key=bob_key).upstream_base_url == "https://api.bob.example"
    assert web_rows() == []


def test_the_keys_page_links_a_retired_keys_settings(alice):
    api_key = configured(alice, "alice")
    retire(api_key, "revoked")
    browser = Client()
    browser.force_login(alice)
    page = browser.get(reverse("web-keys")).content.decode()
    assert reverse("proxy-key-config", args=[api_key.key_id]) in page


def test_a_live_keys_settings_are_still_shown_and_changed(alice):
    api_key = configured(alice, "alice")
    browser = Client()
    browser.force_login(alice)
    url = reverse("proxy-key-config", args=[api_key.key_id])
    assert "api.alice.example" in browser.get(url).content.decode()
    assert browser.post(url, FORM).status_code == 302
    assert TokenConfig.objects.get(api_key=api_key).upstream_base_url == "https://api.changed.example"
    assert web_rows() == [(alice.pk, AuditEvent.Outcome.OK, "save")]
