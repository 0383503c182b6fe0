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


def test_totals_need_the_permission_to_view_usage_events(client, django_user_model, events):  # noqa: ARG001
    """The totals list every user's calls: staff without billing's view permission get 403,
    as the event list answers them."""
    from django.contrib.auth.models import Permission

    support = django_user_model.objects.create_user("support", password="x", is_staff=True)
    client.force_login(support)
    assert client.get("/admin/billing/usageevent/totals/").status_code == 403
    assert client.get("/admin/billing/usageevent/").status_code == 403
    support.user_permissions.add(Permission.objects.get(codename="view_usageevent"))
    client.force_login(django_user_model.objects.get(pk=support.pk))  # permissions cached per object
    assert client.get("/admin/billing/usageevent/totals/").status_code == 200


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


def test_pages_never_read_the_whole_outbox(admin_client, events):
    """The outbox gains a row per billed call: no filter choices by SELECT DISTINCT, no
    date hierarchy, and support's "failed" filter goes through its own index."""
    from django.db import connection, transaction
    from django.test.utils import CaptureQueriesContext

    for url in (
        "/admin/billing/usageevent/",
        "/admin/billing/usageevent/?status__exact=failed",
        "/admin/billing/usageevent/?operation=remember&channel=mcp",
    ):
        with CaptureQueriesContext(connection) as queries:
            page = admin_client.get(url)
        assert page.status_code == 200, url
        statements = " ".join(q["sql"] for q in queries.captured_queries)
        assert "DISTINCT" not in statements and "DATE_TRUNC" not in statements, url
    failed = admin_client.get("/admin/billing/usageevent/?status__exact=failed").context["cl"]
    assert [e.pk for e in failed.result_list] == [events.pk]
    # Plain index scans are priced out too: on a few rows the planner may as well walk
    # another index testing each row's status, at equal cost. A bitmap needs an index
    # condition or a partial index's predicate: the failed rows' own index, or a Seq Scan.
    with transaction.atomic():
        connection.cursor().execute("SET LOCAL enable_seqscan = off")
        connection.cursor().execute("SET LOCAL enable_indexscan = off")
        plan = failed.queryset.explain()
    assert "usage_event_failed" in plan and "Seq Scan" not in plan, plan


def test_filtered_counts_stop_at_a_bound(admin_client, events, monkeypatch):
    """Past COUNT_EXACT_UP_TO matches, a filtered page shows the planner's estimate
    instead of counting every match; below it, the exact count."""
    from audit.admin import EstimatedCountPaginator

    # A user id no fixture user has (alice or bob could be user 9 and add their events).
    for _ in range(4):
        UsageEvent.objects.create(user_id="987654", operation="remember", channel="mcp")
    monkeypatch.setattr(EstimatedCountPaginator, "COUNT_EXACT_UP_TO", 2)
    over = admin_client.get("/admin/billing/usageevent/", {"q": "987654"})
    assert over.status_code == 200 and over.context["cl"].result_count >= 3
    assert len(over.context["cl"].result_list) == 4
    monkeypatch.setattr(EstimatedCountPaginator, "COUNT_EXACT_UP_TO", 10)
    assert admin_client.get("/admin/billing/usageevent/", {"q": "987654"}).context["cl"].result_count == 4


def test_a_misconfigured_gateway_is_named_above_the_list(admin_client, events):
    """Events that wait on the operator (no gateway, an unusable URL, a redirect) are
    named in a warning above the outbox, found with one probe of the pending index."""
    from django.db import connection, transaction

    from billing.services import NO_GATEWAY

    def warnings() -> list[str]:
        page = admin_client.get("/admin/billing/usageevent/")
        assert page.status_code == 200
        return [str(m) for m in page.context["messages"]]

    assert warnings() == []  # pending events with no error: nothing to say
    UsageEvent.objects.filter(status="pending").update(last_error="timeout")
    assert warnings() == []  # a gateway hiccup retries by itself
    UsageEvent.objects.filter(status="pending").update(last_error=NO_GATEWAY)
    assert warnings() == [f"Usage events are not being delivered: {NO_GATEWAY}"]

    probe = UsageEvent.objects.filter(status="pending").order_by("-next_attempt_at").values_list("last_error")[:1]
    with transaction.atomic(), connection.cursor() as cursor:
        # Sorting priced out too: a Sort then shows only if the index cannot give the
        # order (a few rows may otherwise be sorted, the planner's coin toss).
        cursor.execute("SET LOCAL enable_seqscan = off")
        cursor.execute("SET LOCAL enable_sort = off")
        plan = probe.explain()
    assert "usage_event_undelivered" in plan and "Sort" not in plan, plan
