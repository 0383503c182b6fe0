"""The audit trail: one row per call with the right outcome, history with who did it,
a forensic admin that support can browse but not change, and append-only storage."""

import json
import re
import uuid
from datetime import timedelta

import pytest
from django.contrib.auth.models import Group
from django.db import DatabaseError, connection, transaction
from django.utils import timezone

from audit.crypto import content_open
from audit.models import AuditEvent, AuditExportBatch, MemoryHistory
from core.scope import MemoryScope
from memories.services import memory_remember
from tests.conftest import internal_call

pytestmark = pytest.mark.slow


def _rows_added(fn) -> list[AuditEvent]:
    before = AuditEvent.objects.order_by("-id").values_list("id", flat=True).first() or 0
    fn()
    return list(AuditEvent.objects.filter(id__gt=before).order_by("id"))


def test_every_mcp_call_leaves_exactly_one_row(mcp_as, alice, bob, alice_key, bob_key):
    alice_mcp, bob_mcp = mcp_as(alice_key), mcp_as(bob_key)
    memory_id = alice_mcp.ok("remember", {"memory": "Alice's gym is on Rua Augusta"})["id"]
    cases = [
        (alice_mcp, "remember", {"memory": "Alice's gym is on Rua Augusta"}, "ok", ""),
        (alice_mcp, "search_memory", {"query": "gym"}, "ok", ""),
        (alice_mcp, "list_memory", {}, "ok", ""),
        (alice_mcp, "update_memory", {"memory_id": memory_id, "pinned": True}, "ok", ""),
        (alice_mcp, "search_memory", {"query": "gym", "top_k": 0}, "error", "invalid_argument"),
        (alice_mcp, "ingest", {"messages": []}, "error", "invalid_argument"),
        (bob_mcp, "update_memory", {"memory_id": memory_id, "memory": "x"}, "denied", "not_found"),
        (bob_mcp, "delete_memory", {"memory_id": memory_id}, "denied", "not_found"),
        (bob_mcp, "delete_memory", {"memory_id": str(uuid.uuid4())}, "error", "not_found"),
        (bob_mcp, "clear_all_memory", {}, "error", "confirmation_required"),
        (bob_mcp, "clear_all_memory", {"confirm": True}, "ok", ""),
        (alice_mcp, "delete_memory", {"memory_id": memory_id}, "ok", ""),
    ]
    for mcp, tool, arguments, outcome, code in cases:
        rows = _rows_added(lambda mcp=mcp, tool=tool, arguments=arguments: mcp.call(tool, arguments))
        assert len(rows) == 1, (tool, arguments, rows)
        row = rows[0]
        actor = bob if mcp is bob_mcp else alice
        assert (row.operation, row.outcome, row.error_code, row.channel) == (tool, outcome, code, "mcp"), tool
        assert row.actor_user_id == actor.pk and row.actor_username == actor.username
        assert row.actor_client_app in ("alice-agent", "bob-agent") and row.actor_auth == "api_key"
        assert row.subject_user_id == actor.pk and row.ip == "127.0.0.1" and row.duration_ms is not None
        if tool in ("update_memory", "delete_memory") and outcome != "error":
            assert row.memory_ids == [memory_id]


def test_every_rest_call_leaves_exactly_one_row(api_client, alice, alice_key, transactional_db, clean_vectors):
    client = api_client(alice_key)
    cases = [
        ("post", "/v1/memories", {"memory": "Alice reads Saramago"}, "remember", "ok"),
        ("post", "/v1/memories", {"memory": ""}, "remember", "error"),
        ("post", "/v1/memories/search", {"query": "books"}, "search_memory", "ok"),
        ("get", "/v1/memories", None, "list_memory", "ok"),
        ("post", "/v1/memories/ingest", {"messages": [{"role": "user", "content": "hi"}]}, "ingest", "error"),
        ("post", "/v1/memories/clear", {"confirm": True}, "clear_all_memory", "ok"),
    ]
    for method, path, body, operation, outcome in cases:
        rows = _rows_added(
            lambda method=method, path=path, body=body: getattr(client, method)(path, body, format="json")
        )
        assert [(r.operation, r.outcome, r.channel) for r in rows] == [(operation, outcome, "rest")], path


def test_update_then_delete_shows_versions_and_who(
    mcp_as, alice, alice_key, admin_client, admin_user, django_user_model
):
    mcp = mcp_as(alice_key)
    memory_id = mcp.ok("remember", {"memory": "Alice's dentist is Dr. Sousa"})["id"]
    mcp.ok("update_memory", {"memory_id": memory_id, "memory": "Alice's dentist is Dr. Lima"})
    mcp.ok("delete_memory", {"memory_id": memory_id})

    history = list(MemoryHistory.objects.filter(memory_id=memory_id).order_by("recorded_at", "id"))
    assert [(h.event, h.old_memory, h.new_memory) for h in history] == [
        ("ADD", None, "Alice's dentist is Dr. Sousa"),
        ("UPDATE", "Alice's dentist is Dr. Sousa", "Alice's dentist is Dr. Lima"),
        ("DELETE", "Alice's dentist is Dr. Lima", None),
    ]
    assert {h.changed_by for h in history} == {"alice (mcp)"}
    assert all(h.request_id for h in history)

    page = admin_client.get(f"/admin/audit/memoryhistory/?q={memory_id}")
    assert page.status_code == 200
    for text in (b"Dr. Sousa", b"Dr. Lima", b"DELETE", b"alice (mcp)"):
        assert text in page.content
    by_request = admin_client.get(f"/admin/audit/memoryhistory/?q={history[1].request_id}")
    assert [h.event for h in by_request.context["cl"].result_list] == ["UPDATE"]
    pasted = admin_client.get("/admin/audit/memoryhistory/", {"q": f" {memory_id.upper()} "})
    assert len(pasted.context["cl"].result_list) == 3  # a UUID in any spelling
    # Exact lookups, which the columns' indexes serve (not iexact's upper() of every row).
    searched = str(page.context["cl"].queryset.query)
    assert "UPPER" not in searched and f'"memory_id" = {memory_id}' in searched
    events = admin_client.get(f"/admin/audit/auditevent/?q={memory_id}")
    assert events.status_code == 200
    listed = list(events.context["cl"].result_list)
    # The three history pages above were staff reading this memory: each is on its trail.
    assert [e.operation for e in listed if e.staff_username] == ["admin_list_content"] * 3
    assert [(e.operation, e.actor_username) for e in reversed(listed) if not e.staff_username] == [
        ("remember", "alice"),
        ("update_memory", "alice"),
        ("delete_memory", "alice"),
    ]
    update = next(e for e in listed if e.operation == "update_memory")
    assert content_open(update.before)["memory"] == "Alice's dentist is Dr. Sousa"
    assert content_open(update.after)["memory"] == "Alice's dentist is Dr. Lima"


@pytest.fixture
def support_user(django_user_model):
    from django.contrib.auth.models import Permission

    from audit.support import support_group_ensure

    user = django_user_model.objects.create_user("sam", password="sam-password-1", is_staff=True)
    user.groups.add(support_group_ensure(Group, Permission))
    return user


def test_support_browses_but_changes_nothing(client, support_user, alice, transactional_db, clean_vectors):
    from billing.models import UsageEvent

    memory_id = memory_remember(MemoryScope.for_user(alice), memory="Visible to support", call=internal_call()).id
    event = UsageEvent.objects.create(user_id=str(alice.pk), operation="remember", status="failed")
    client.force_login(support_user)
    for url in (
        "/admin/",
        "/admin/audit/auditevent/",
        f"/admin/audit/auditevent/?subject_user_id={alice.pk}",
        "/admin/audit/memoryhistory/",
        "/admin/memories/enginememoryrow/",
        f"/admin/memories/enginememoryrow/{memory_id}/change/",
        "/admin/memories/apikey/",
        "/admin/memories/ratewindow/",
        "/admin/billing/usageevent/",
    ):
        assert client.get(url).status_code == 200, url
    # Opening a memory's content was itself audited.
    viewed = AuditEvent.objects.get(operation="admin_view_memory")
    assert (viewed.staff_username, viewed.memory_ids, viewed.subject_user_id) == ("sam", [memory_id], alice.pk)

    response = client.post("/admin/billing/usageevent/", {"action": "retry_delivery", "_selected_action": [event.pk]})
    event.refresh_from_db()
    assert event.status == "failed"
    assert response.status_code in (200, 302, 403)
    assert client.get("/admin/auth/user/add/").status_code == 403
    audit_row = AuditEvent.objects.first()
    assert client.post(f"/admin/audit/auditevent/{audit_row.pk}/delete/", {"post": "yes"}).status_code == 403
    assert AuditEvent.objects.filter(pk=audit_row.pk).exists()


def test_staff_reading_memory_text_is_audited(client, support_user, alice, transactional_db, clean_vectors):
    """Every admin page that shows a memory's text leaves an audit row naming what was
    shown: list pages (the ids on the page), a history version, an audit row's opened
    snapshots. The search term is not kept (it may be memory text itself)."""
    scope = MemoryScope.for_user(alice)
    memory_id = memory_remember(scope, memory="Alice bakes sourdough", call=internal_call()).id
    from memories.services import memory_update

    memory_update(scope, memory_id=memory_id, memory="Alice bakes rye sourdough", call=internal_call())
    client.force_login(support_user)

    def staff_rows(fn):
        rows = _rows_added(fn)
        assert all(r.staff_username == "sam" and r.channel == "admin" for r in rows)
        return [(r.operation, r.memory_ids, r.subject_user_id) for r in rows]

    for url in ("/admin/memories/enginememoryrow/", "/admin/audit/memoryhistory/"):
        listed = staff_rows(lambda url=url: client.get(url))
        assert listed == [("admin_list_content", [memory_id], None)], url
    searched = _rows_added(lambda: client.get("/admin/memories/enginememoryrow/", {"q": "sourdough"}))
    assert [r.detail for r in searched] == [{"page": "memories.enginememoryrow", "rows": 1, "searched": True}]
    assert "sourdough" not in json.dumps([r.detail for r in searched])
    version = MemoryHistory.objects.filter(memory_id=memory_id, event="UPDATE").get()
    opened = staff_rows(lambda: client.get(f"/admin/audit/memoryhistory/{version.pk}/change/"))
    assert opened == [("admin_view_memory", [memory_id], None)]
    update_row = AuditEvent.objects.get(operation="update_memory")
    opened = staff_rows(lambda: client.get(f"/admin/audit/auditevent/{update_row.pk}/change/"))
    assert opened == [("admin_view_memory", [memory_id], alice.pk)]
    # Rows without memory text (this staff row itself) open without another one.
    assert staff_rows(lambda: client.get(f"/admin/audit/auditevent/{searched[0].pk}/change/")) == []
    # An empty page shows nothing: nothing to record.
    assert staff_rows(lambda: client.get("/admin/memories/enginememoryrow/", {"q": "no such words"})) == []

    # Staff without the permission to view them get 403, and the trail does not say they
    # read anything.
    from django.contrib.auth import get_user_model

    client.force_login(get_user_model().objects.create_user("trainee", password="x", is_staff=True))
    for url in (
        f"/admin/memories/enginememoryrow/{memory_id}/change/",
        f"/admin/audit/memoryhistory/{version.pk}/change/",
        f"/admin/audit/auditevent/{update_row.pk}/change/",
    ):
        refused = _rows_added(lambda url=url: assert_status(client.get(url), 403))
        assert refused == [], url


def assert_status(response, status: int):
    assert response.status_code == status
    return response


def test_plain_user_cannot_reach_admin(client, alice, transactional_db):
    client.force_login(alice)
    response = client.get("/admin/audit/auditevent/")
    assert response.status_code == 302 and "/admin/login/" in response["Location"]


def test_search_by_user_id_or_username_is_exact_and_index_served(admin_client, alice, bob, db):
    def row(**fields):
        return AuditEvent.objects.create(request_id=str(uuid.uuid4()), channel="mcp", outcome="ok", **fields)

    own = row(operation="remember", actor_user_id=alice.pk, actor_username="alice", subject_user_id=alice.pk)
    # A delegated call: bob's service acted on alice's memories.
    delegated = row(operation="remember", actor_user_id=bob.pk, actor_username="bob", subject_user_id=alice.pk)
    by_staff = row(operation="admin_view_memory", staff_user_id=bob.pk, staff_username="sam", subject_user_id=bob.pk)
    row(operation="remember", actor_user_id=bob.pk, actor_username="alicex", subject_user_id=bob.pk)
    leaked = row(
        operation="search_memory",
        actor_user_id=bob.pk,
        actor_username="bob",
        subject_user_id=bob.pk,
        actor_credential="key:k-leaked",
    )

    def found(term):
        page = admin_client.get("/admin/audit/auditevent/", {"q": term})
        assert page.status_code == 200
        return {e.pk for e in page.context["cl"].result_list}, page.context["cl"].queryset

    assert found(str(alice.pk))[0] == {own.pk, delegated.pk}
    assert found(str(bob.pk))[0] >= {delegated.pk}
    assert found("alice")[0] == {own.pk}  # exact: not "alicex"
    assert found("sam")[0] == {by_staff.pk}
    for odd in ("\u00b2", "9" * 30):  # a digit int() refuses; past bigint: nothing, not an error
        assert found(odd)[0] == set()
    # Each search is served by its columns' indexes, ORed: with sequential scans priced
    # out, the plan reads them and nothing else (a 1M-row table scanned per search took
    # 155 ms, docs/benchmarks.md). Plain index scans are priced out too: on a table of five
    # rows the planner may walk the order's index filtering every row instead (a coin toss
    # that failed once under load); a branch no index serves still shows as a Seq Scan.
    with transaction.atomic():
        connection.cursor().execute("SET LOCAL enable_seqscan = off")
        connection.cursor().execute("SET LOCAL enable_indexscan = off")
        for term, indexes in (
            (str(alice.pk), {"audit_subject_recent", "audit_actor_recent"}),
            ("alice", {"audit_actor_name_recent", "audit_staff_name_recent", "audit_turn"}),
        ):
            plan = found(term)[1].explain()
            scans = set(re.findall(r"Bitmap Index Scan on (\w+)", plan))
            assert scans == indexes and "Filter" not in plan and "Seq Scan" not in plan, plan
        # One credential's calls (a leaked key's): its own partial index, newest first.
        plan = found("key:k-leaked")[1].explain()
        assert "audit_credential_recent" in plan and "Seq Scan" not in plan, plan
    assert found("key:k-leaked")[0] == {leaked.pk}


def test_rows_are_append_only(transactional_db, alice):
    from audit.export import audit_retention_purge

    two_days_ago = timezone.now() - timedelta(days=2)
    row = AuditEvent.objects.create(
        request_id="r1", channel="mcp", operation="remember", outcome="ok", occurred_at=two_days_ago
    )
    fresh = AuditEvent.objects.create(request_id="r2", channel="mcp", operation="remember", outcome="ok")
    MemoryHistory.objects.create(memory_id="m1", event="ADD", new_memory="x")
    for statement in (
        "UPDATE audit_auditevent SET outcome = 'error'",
        "DELETE FROM audit_auditevent",
        "UPDATE audit_memoryhistory SET event = 'NONE'",
        "DELETE FROM audit_memoryhistory",
    ):
        with pytest.raises(DatabaseError, match="append-only"), transaction.atomic():
            connection.cursor().execute(statement)
    with pytest.raises(DatabaseError, match="append-only"), transaction.atomic():
        cursor = connection.cursor()
        cursor.execute("SET LOCAL memsite.audit_allow_truncate = 'off'")
        cursor.execute("TRUNCATE audit_auditevent")
    assert AuditEvent.objects.filter(pk=row.pk, outcome="ok").exists()

    # Retention removes only rows that are exported and old enough: older than the period
    # and than the database's floor (a day), which holds even for a period of 0.
    assert audit_retention_purge(older_than_days=0) == 0  # not exported yet
    AuditExportBatch.objects.create(
        first_id=row.pk, last_id=fresh.pk, row_count=2, sha256="x", object_key="k", manifest_key="m"
    )
    assert audit_retention_purge(older_than_days=3) == 0  # not older than the period
    assert audit_retention_purge(older_than_days=0) == 1
    assert not AuditEvent.objects.filter(pk=row.pk).exists()
    assert AuditEvent.objects.filter(pk=fresh.pk).exists()  # younger than the floor


def test_turns_are_grouped(mcp_as, alice_key):
    mcp = mcp_as(alice_key)
    memory_id = mcp.ok("remember", {"memory": "Turn fact", "metadata": {"turn_id": "turn-42"}})["id"]
    mcp.ok("update_memory", {"memory_id": memory_id, "metadata": {"turn_id": "turn-42", "x": 1}})
    mcp.ok("remember", {"memory": "Other turn", "metadata": {"session_id": "sess-7"}})
    turn = list(AuditEvent.objects.filter(turn_id="turn-42").order_by("id").values_list("operation", "turn_event"))
    assert turn == [("remember", "memory_write"), ("update_memory", "memory_write")]
    assert AuditEvent.objects.filter(turn_id="sess-7").count() == 1


def test_redaction_keeps_content_out(settings, alice_scope, transactional_db, clean_vectors):
    settings.AUDIT_REDACT_CONTENT = True
    memory_remember(alice_scope, memory="My PIN is 8841", call=internal_call())
    row = AuditEvent.objects.get(operation="remember")
    after = content_open(row.after)
    assert after["memory"]["length"] == len("My PIN is 8841")
    assert "8841" not in str(after) and len(after["memory"]["sha256"]) == 64


def test_a_row_over_the_id_cap_says_how_many_ids_it_left_out(transactional_db, alice_scope, monkeypatch):
    """A call that touched more memories than one row lists (a bulk forget, an export of a
    large user) keeps the first ids and counts the rest, so nobody reads the list as all."""
    from audit import services as audit_services

    monkeypatch.setattr(audit_services, "MAX_MEMORY_IDS", 3)
    ids = [str(uuid.uuid4()) for _ in range(5)]
    with transaction.atomic():
        row = audit_services.audit_record(
            alice_scope, call=internal_call(), operation="export_memories", memory_ids=ids, detail={"memories": 5}
        )
        under = audit_services.audit_record(
            alice_scope, call=internal_call(), operation="export_memories", memory_ids=ids[:3]
        )
    row.refresh_from_db()
    assert row.memory_ids == ids[:3] and row.detail == {"memories": 5, "memory_ids_omitted": 2}
    assert "memory_ids_omitted" not in AuditEvent.objects.get(pk=under.pk).detail
