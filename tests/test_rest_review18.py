"""Review 18 of the REST surface: the trash listing goes through the dispatcher (audited,
billed, delegation and permissions checked), /v1/memory answers the real body error,
maintenance needs delete as well as write, /forget refuses unknown keys, a refused
scope claim names whom it claimed, and a refused call is no turn event."""

from __future__ import annotations

import json
import uuid

import pytest

from audit.crypto import content_open
from audit.models import AuditEvent
from billing.models import UsageEvent
from core.choices import Role
from core.errors import ServiceError
from core.scope import CallContext
from memories.auth import Principal
from memories.operations import operation_execute, operations_permitted
from memories.services import api_key_issue
from memories.tenancy import tenant_create, tenant_user_create
from tests.test_tenants import mcp_headers, mcp_sessions

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]

SUBJECT = "HTTP_X_MEMORY_SUBJECT"


@pytest.fixture
def acme():
    tenant_create(name="acme")
    return "acme"


def _key(user, *permissions: str, role: str = Role.USER) -> str:
    return api_key_issue(user=user, name=f"k-{uuid.uuid4().hex[:6]}", role=role, permissions=frozenset(permissions))[1]


def _last_audit_id() -> int:
    last = AuditEvent.objects.order_by("-id").first()
    return last.pk if last else 0


def _message(row: AuditEvent) -> str:
    return content_open(row.detail["content"])["message"]


# --- 1: GET /v1/trash --------------------------------------------------------------------------
def test_a_delegated_trash_listing_is_audited_and_billed_and_refusals_are_audited(acme, api_client):
    ann = tenant_user_create(tenant=acme, username="ann")
    bot = tenant_user_create(tenant=acme, username="acme-bot")
    mallory = tenant_user_create(tenant=acme, username="mallory")
    owner = api_client(_key(ann, "read", "write", "delete"))
    memory_id = owner.post("/v1/memory", {"content": "Ann's door code is 4412"}, format="json").json()["memory"]["id"]
    assert owner.delete(f"/v1/memory/{memory_id}").status_code == 200
    # The owner's own listing keeps its shape.
    (own,) = owner.get("/v1/trash").json()["memories"]
    assert own["id"] == memory_id and own["memory"] == "Ann's door code is 4412"
    assert {"trashed_at", "request_id", "operation"} <= set(own)

    before = _last_audit_id()
    reader = api_client(_key(bot, "read", role=Role.TENANT_ADMIN))
    response = reader.get("/v1/trash", **{SUBJECT: "acme/ann"})
    assert response.status_code == 200 and [m["id"] for m in response.json()["memories"]] == [memory_id]
    (row,) = AuditEvent.objects.filter(pk__gt=before, channel="rest")
    assert (row.operation, row.outcome, row.channel) == ("list_memory", "ok", "rest")
    assert (row.actor_user_id, row.actor_role) == (bot.pk, "tenant_admin")
    assert (row.subject_user_id, row.tenant) == (ann.pk, acme)
    assert row.detail["trash"] is True and row.detail["subject_claim"] == "acme/ann"
    assert row.memory_ids == [memory_id]
    usage = UsageEvent.objects.get(request_id=row.request_id)
    assert (usage.user_id, usage.operation) == (str(ann.pk), "list_memory")

    # Refused: a key without read (acting for ann), an ordinary key naming ann.
    before = _last_audit_id()
    writer = api_client(_key(bot, "write", role=Role.TENANT_ADMIN))
    refused = writer.get("/v1/trash", **{SUBJECT: "acme/ann"})
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "forbidden"
    nosy = api_client(_key(mallory, "read", "write", "delete"))
    refused = nosy.get("/v1/trash", **{SUBJECT: "acme/ann"})
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "forbidden"
    assert "4412" not in refused.content.decode()
    rows = list(AuditEvent.objects.filter(pk__gt=before, channel="rest").order_by("id"))
    assert [(r.outcome, r.error_code, r.actor_user_id) for r in rows] == [
        ("denied", "forbidden", bot.pk),
        ("denied", "forbidden", mallory.pk),
    ]
    assert [r.detail["subject_claim"] for r in rows] == ["acme/ann", "acme/ann"]
    assert UsageEvent.objects.filter(request_id__in=[r.request_id for r in rows]).count() == 0


# --- 2: POST /v1/memory answers the body's real error --------------------------------------------
BAD_BODIES = [
    ("too large", json.dumps({"content": "x" * 300_000}), 413, "payload_too_large"),
    ("not json", '{"content": ', 400, "invalid_argument"),
    ("huge number", '{"content": "x", "importance": 1e400}', 400, "invalid_argument"),
    ("lone surrogate", '{"content": "\\ud800"}', 400, "invalid_argument"),
    ("NUL in content", '{"content": "a\\u0000b"}', 400, "invalid_argument"),
    ("NUL in scope", '{"content": "x", "scope": {"user_id": "alice\\u0000"}}', 400, "invalid_argument"),
]


@pytest.mark.parametrize(("label", "body", "status", "code"), BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
def test_v1_memory_store_answers_the_real_body_error(api_client, alice_key, label, body, status, code):  # noqa: ARG001
    client = api_client(alice_key)
    response = client.generic("POST", "/v1/memory", body.encode(), content_type="application/json")
    assert response.status_code == status, response.content
    error = response.json()["error"]
    assert error["code"] == code and error["message"] != "give content or messages"
    row = AuditEvent.objects.get(outcome="error", channel="rest")
    assert row.operation == "remember" and row.error_code == code
    assert _message(row) == error["message"]
    assert client.get("/v1/memory").json()["memories"] == []


# --- 3: maintenance needs delete as well as write ----------------------------------------------------
def test_maintenance_needs_the_delete_permission_too(alice):
    def run(*permissions: str):
        principal = Principal(user=alice, method="api_key", permissions=frozenset(permissions))
        return operation_execute(principal, "memory_run_maintenance", {}, call=CallContext(channel="mcp"))

    with pytest.raises(ServiceError) as refused:
        run("write")
    assert refused.value.code.value == "forbidden" and "delete" in refused.value.message
    row = AuditEvent.objects.get(operation="memory_run_maintenance")
    assert (row.outcome, row.error_code) == ("denied", "forbidden")
    with pytest.raises(ServiceError):
        run("delete")
    assert run("read", "write", "delete")["ok"] is True

    assert "memory_run_maintenance" not in operations_permitted(frozenset({"write"}))
    assert "memory_run_maintenance" not in operations_permitted(frozenset({"delete"}))
    assert "memory_run_maintenance" in operations_permitted(frozenset({"write", "delete"}))


def test_a_permission_refusal_names_the_tool_as_the_agent_knows_it(alice):
    """The toolkit's delete tool is `delete_memory` to the agent, `toolkit_delete_memory` inside."""
    principal = Principal(user=alice, method="api_key", permissions=frozenset({"read", "write"}))
    arguments = {"tags": ["x"], "confirm": True}
    with pytest.raises(ServiceError) as refused:
        operation_execute(principal, "toolkit_delete_memory", arguments, call=CallContext(channel="mcp"))
    assert refused.value.message == "This credential lacks the delete permission delete_memory needs."


def test_tools_list_hides_maintenance_from_a_write_only_key(alice):
    write_only = _key(alice, "read", "write")
    full = _key(alice, "read", "write", "delete")

    async def listed(client):
        return {tool.name for tool in (await client.list_tools()).tools}

    limited, everything = mcp_sessions(
        [(mcp_headers(write_only), listed), (mcp_headers(full), listed)], path="/engines/memory-lifecycle/mcp"
    )
    assert "memory_after_turn" in limited and "memory_run_maintenance" not in limited
    assert "memory_run_maintenance" in everything


# --- 4: /forget refuses unknown body keys ----------------------------------------------------------
def test_forget_refuses_unknown_body_keys_and_deletes_nothing(api_client, alice_key):
    client = api_client(alice_key)
    memory_id = client.post("/v1/memory", {"content": "Alice keeps bees"}, format="json").json()["memory"]["id"]
    refused = client.post(f"/v1/memory/{memory_id}/forget", {"dry_run": True}, format="json")
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_argument"
    assert "dry_run" in refused.json()["error"]["message"]
    assert [m["id"] for m in client.get("/v1/memory").json()["memories"]] == [memory_id]
    assert client.get("/v1/trash").json()["memories"] == []
    assert AuditEvent.objects.get(outcome="error", channel="rest").operation == "delete_memory"

    scoped = {"scope": {"tenant_id": "default", "user_id": "alice"}}
    assert client.post(f"/v1/memory/{memory_id}/forget", scoped, format="json").json()["deleted"] is True
    assert client.get("/v1/memory").json()["memories"] == []


# --- 5: a refused scope claim names whom it claimed ------------------------------------------------
def test_a_refused_scope_claim_names_the_claimed_target(acme, api_client, alice, bob_key):  # noqa: ARG001
    bob = api_client(bob_key)
    search = bob.post(
        "/v1/memory/search", {"query": "x", "scope": {"tenant_id": "default", "user_id": "alice"}}, format="json"
    )
    assert search.status_code == 403
    assert bob.get("/v1/memory?tenant_id=default&user_id=alice").status_code == 403
    other_tenant = {"query": "x", "scope": {"tenant_id": "acme"}}
    assert bob.post("/v1/memory/search", other_tenant, format="json").status_code == 403
    rows = AuditEvent.objects.filter(outcome="denied", channel="rest").order_by("id")
    assert [(r.operation, r.detail["subject_claim"]) for r in rows] == [
        ("search_memory", "default/alice"),
        ("list_memory", "default/alice"),
        ("search_memory", "acme/bob"),
    ]

    # A tenant admin naming a user of another tenant (or nobody): not_found, still named.
    admin = api_client(_key(tenant_user_create(tenant=acme, username="boss"), "read", role=Role.TENANT_ADMIN))
    missing = admin.get("/v1/memory?tenant_id=default&user_id=ghost")
    assert missing.status_code == 404 and missing.json()["error"]["message"] == "No such user."
    row = AuditEvent.objects.filter(outcome="denied", channel="rest").latest("id")
    assert (row.error_code, row.detail["subject_claim"]) == ("not_found", "default/ghost")
    assert _message(row) == "No such user."


# --- 6: a refused call is no turn event ---------------------------------------------------------------
def test_only_successful_calls_are_turn_events(api_client, alice_key, bob_key):
    turn = {"HTTP_X_TURN_ID": "turn-9"}
    alice = api_client(alice_key)
    assert alice.post("/v1/memory", {"content": "Alice flies"}, format="json", **turn).status_code == 201
    bob = api_client(bob_key)
    claim = {"content": "x", "scope": {"user_id": "alice"}}
    assert bob.post("/v1/memory", claim, format="json", **turn).status_code == 403
    assert bob.post("/v1/memory", {"content": ""}, format="json", **turn).status_code == 400
    assert bob.post("/v1/memory/search", {"query": "x", "bogus": 1}, format="json", **turn).status_code == 400
    rows = AuditEvent.objects.filter(turn_id="turn-9").order_by("id")
    assert [(r.outcome, r.turn_event) for r in rows] == [
        ("ok", "memory_write"),
        ("denied", ""),
        ("error", ""),
        ("error", ""),
    ]
