"""Issue 12, acceptance 2 (UI part): a service acting for alice shows in her activity page
and in the memory's history; keys are created with permissions and an expiry."""

from __future__ import annotations

import json
import urllib.request

import pytest

from audit.models import AuditEvent
from billing.models import UsageEvent
from core.choices import Role
from memories.models import ApiKey
from memories.services import api_key_issue
from memories.tenancy import tenant_user_create
from tests.test_browser import Page, _login, browser  # noqa: F401 - the fixture

pytestmark = pytest.mark.slow


def test_subject_sees_a_service_acting_for_them_and_creates_a_read_only_key(browser, memsite_server, alice):  # noqa: F811
    bot = tenant_user_create(tenant="default", username="support-bot")
    key = api_key_issue(user=bot, name="support-bot", role=Role.TENANT_ADMIN)[1]
    request = urllib.request.Request(
        f"{memsite_server}/v1/memories",
        data=json.dumps({"memory": "Alice asked for invoices by email"}).encode(),
        headers={
            "Authorization": f"Bearer {key}",
            "Content-Type": "application/json",
            "X-Memory-Subject": "default/alice",
        },
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=30) as response:  # noqa: S310 - the local live server
        memory_id = json.load(response)["id"]
    row = AuditEvent.objects.get(operation="remember")
    assert (row.actor_user_id, row.subject_user_id, row.actor_role) == (bot.pk, alice.pk, "tenant_admin")
    assert list(UsageEvent.objects.values_list("user_id", "operation")) == [(str(alice.pk), "remember")]

    page = Page(browser, memsite_server)
    _login(page, "alice")
    page.open("/activity/")
    assert "Activity" in page.text
    by = page.text_of("#activity tr.by-service td:nth-child(3)")
    assert "by support-bot, tenant admin" in by
    assert "remember" in page.text_of("#activity tr.by-service td:nth-child(2)")
    page.shot("11-activity")
    page.click_text("Show only actions by services")
    assert "support-bot" in page.text

    page.open(f"/memories/{memory_id}/")
    assert "support-bot, tenant admin (rest)" in page.text

    page.open("/keys/")
    page.fill("#name", "cursor-read-only")
    for permission in ("write", "delete"):
        page.find(f"input[name=permissions][value={permission}]").click()
    page.find("#expires_days option[value='30']").click()
    page.click_text("Create key")
    assert page.text_of("#key-value").startswith("msk_")
    created = ApiKey.objects.get(name="cursor-read-only")
    assert created.permission_set == {"read"} and created.expires_at is not None and created.role == "user"
    assert "read" in page.text and "cursor-read-only" in page.text
