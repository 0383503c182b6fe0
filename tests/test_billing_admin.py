import pytest

from billing.models import UsageEvent

pytestmark = pytest.mark.django_db


@pytest.fixture
def events(alice, bob):
    UsageEvent.objects.create(user_id=str(alice.pk), operation="remember", channel="mcp")
    UsageEvent.objects.create(user_id=str(alice.pk), operation="remember", channel="rest")
    failed = UsageEvent.objects.create(
        user_id=str(bob.pk), operation="search_memory", status="failed", last_error="HTTP 422: unknown user"
    )
    return failed


def test_staff_browse_filter_totals_and_retry(admin_client, events):
    listing = admin_client.get("/admin/billing/usageevent/?status__exact=failed")
    assert listing.status_code == 200
    assert b"HTTP 422: unknown user" in listing.content
    assert admin_client.get("/admin/billing/usageevent/?operation=remember&channel=mcp").status_code == 200

    totals = admin_client.get("/admin/billing/usageevent/totals/?days=7")
    assert totals.status_code == 200
    rows = {(r["user_id"], r["operation"], r["status"]): r["calls"] for r in totals.context["totals"]}
    assert rows[(events.user_id, "search_memory", "failed")] == 1
    assert sum(rows.values()) == 3

    detail = admin_client.get(f"/admin/billing/usageevent/{events.pk}/change/")
    assert detail.status_code == 200 and b'name="_save"' not in detail.content

    response = admin_client.post(
        "/admin/billing/usageevent/", {"action": "retry_delivery", "_selected_action": [events.pk]}
    )
    assert response.status_code == 302
    events.refresh_from_db()
    assert events.status == "pending"


def test_plain_users_cannot_reach_it(client, alice):
    client.force_login(alice)
    response = client.get("/admin/billing/usageevent/")
    assert response.status_code == 302 and "/admin/login/" in response["Location"]
