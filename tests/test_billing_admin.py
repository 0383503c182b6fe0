import uuid

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


def test_staff_search_by_exact_user_id_or_request_id(admin_client, events, alice):
    def found(term: str) -> list[int]:
        page = admin_client.get("/admin/billing/usageevent/", {"q": term})
        assert page.status_code == 200
        searched = str(page.context["cl"].queryset.query)
        assert "UPPER" not in searched  # exact lookups, served by the indexes
        return sorted(e.pk for e in page.context["cl"].result_list)

    alices = sorted(UsageEvent.objects.filter(user_id=str(alice.pk)).values_list("pk", flat=True))
    assert found(str(alice.pk)) == alices and len(alices) == 2
    assert found(f" {events.request_id} ") == [events.pk]
    assert found(str(events.request_id).upper()) == [events.pk]  # a UUID in any spelling
    assert found(events.request_id.hex) == [events.pk]
    assert found(str(uuid.uuid4())) == []
    assert found("not-a-request-id") == []  # no error for a term that is not a UUID
