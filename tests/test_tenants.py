"""Issue 12: tenants, roles, delegated access (X-Memory-Subject / seed 001's scope) and
least-privilege credentials (permissions, expiry), through MCP, REST and /v1/memory."""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta
from io import StringIO

import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command
from django.utils import timezone

from audit.models import AuditEvent
from billing.models import UsageEvent
from core.choices import Role
from core.scope import MemoryScope, user_tenant
from memories import engine
from memories.models import ApiKey, RateWindow, Tenant, TenantMembership
from memories.services import api_key_issue, memory_remember
from memories.tenancy import tenant_create, tenant_user_create
from tests.conftest import internal_call

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]

SUBJECT = "HTTP_X_MEMORY_SUBJECT"


# --- in-process MCP ---------------------------------------------------------------------
class Lifespan:
    def __init__(self, app):
        self.app, self.inbox, self.outbox = app, asyncio.Queue(), asyncio.Queue()

    async def __aenter__(self):
        self.task = asyncio.create_task(self.app({"type": "lifespan"}, self.inbox.get, self.outbox.put))
        await self.inbox.put({"type": "lifespan.startup"})
        assert (await self.outbox.get())["type"] == "lifespan.startup.complete"
        return self

    async def __aexit__(self, *exc):
        await self.inbox.put({"type": "lifespan.shutdown"})
        assert (await self.outbox.get())["type"] == "lifespan.shutdown.complete"
        await self.task


def mcp_sessions(sessions: list[tuple[dict[str, str], object]], *, path: str = "/engines/memory/mcp") -> list:
    """Run `work(client)` for each (headers, work) in its own MCP session, against one
    in-process app (the official SDK client over httpx's ASGI transport) at `path`."""

    async def main():
        import httpx2
        from mcp import Client
        from mcp.client.streamable_http import streamable_http_client

        from memsite.asgi import build_application

        application = build_application()
        results = []
        async with Lifespan(application):
            for headers, work in sessions:
                transport = httpx2.ASGITransport(app=application)
                async with httpx2.AsyncClient(
                    transport=transport, base_url="http://localhost", headers=headers, timeout=60
                ) as http:
                    if work is None:
                        results.append(await http.post(path, json={}))
                        continue
                    url = f"http://localhost{path}"
                    async with Client(streamable_http_client(url, http_client=http)) as client:
                        results.append(await work(client))
        return results

    return asyncio.run(main())


def mcp_headers(token: str, subject: str | None = None) -> dict[str, str]:
    headers = {"Authorization": f"Bearer {token}"}
    if subject is not None:
        headers["X-Memory-Subject"] = subject
    return headers


def outcome_of(result) -> tuple[str, dict]:
    """('ok', data) or (error code, error) of a tool result."""
    if result.is_error:  # a tool error is in the text content only
        error = json.loads(result.content[0].text)["error"]
        return error["code"], error
    return "ok", result.structured_content or {}


# --- fixtures -----------------------------------------------------------------------------
@pytest.fixture
def unlimited(settings):
    settings.RATE_LIMITS = {op: (0, 60) for op in settings.RATE_LIMITS}


@pytest.fixture
def acme():
    tenant_create(name="acme", display_name="Acme Corp")
    return "acme"


def _user(tenant: str, username: str):
    return tenant_user_create(tenant=tenant, username=username)


# --- model, migration, CLI ----------------------------------------------------------------
def test_existing_users_migrate_into_the_default_tenant_and_keep_their_memories():
    """Migrate memories back to before 0014 (tenants), write users and a memory, migrate forward:
    every user is in tenant `default`, its partition (`default:{pk}`) and memory unchanged."""
    from django.db import connection
    from django.db.migrations.executor import MigrationExecutor

    executor = MigrationExecutor(connection)
    executor.migrate([("memories", "0013_turn_lifecycle")])
    User = get_user_model()
    old = [User.objects.create_user(name) for name in ("olga", "oscar")]
    memory_id = memory_remember(
        MemoryScope(tenant="default", user_pk=old[0].pk), memory="Olga's old fact", call=internal_call()
    ).id
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(executor.loader.graph.leaf_nodes())

    assert Tenant.objects.filter(name="default").exists()
    for user in old:
        assert TenantMembership.objects.get(user=user).tenant_id == "default"
        user = User.objects.get(pk=user.pk)
        assert MemoryScope.for_user(user).engine_user_id == f"default:{user.pk}"
    stored = engine.engine_get(memory_id)
    assert stored is not None and stored.user_id == f"default:{old[0].pk}"


def test_create_tenant_and_issue_api_key_with_tenant_role_permissions_expiry():
    out = StringIO()
    call_command("create_tenant", "acme", "--display-name", "Acme Corp", stdout=out)
    assert Tenant.objects.get(name="acme").display_name == "Acme Corp"
    with pytest.raises(CommandError, match="already exists"):
        call_command("create_tenant", "acme", stdout=StringIO())
    with pytest.raises(CommandError, match="tenant name"):
        call_command("create_tenant", "Bad Name!", stdout=StringIO())

    out, err = StringIO(), StringIO()
    call_command(
        "issue_api_key", "support-bot", "--create-user", "--tenant", "acme", "--role", "tenant_admin",
        "--permissions", "read,write", "--expires", "30d", "--name", "support-bot", stdout=out, stderr=err,
    )  # fmt: skip
    plain = out.getvalue().strip()
    key = ApiKey.objects.get(key_id=plain.split("_")[1])
    assert user_tenant(key.user) == "acme" and key.role == Role.TENANT_ADMIN
    assert key.permission_set == {"read", "write"}
    assert timedelta(days=29) < key.expires_at - timezone.now() <= timedelta(days=30)
    assert plain not in err.getvalue() and "acme/support-bot" in err.getvalue()

    with pytest.raises(CommandError, match="unknown permission"):
        call_command("issue_api_key", "support-bot", "--permissions", "read,admin", stdout=StringIO())
    with pytest.raises(CommandError, match="No tenant"):
        call_command("issue_api_key", "x", "--create-user", "--tenant", "nowhere", stdout=StringIO())
    with pytest.raises(CommandError, match="is in tenant 'acme'"):
        call_command("issue_api_key", "support-bot", "--tenant", "default", stdout=StringIO(), stderr=StringIO())
    with pytest.raises(CommandError, match="expires"):
        call_command("issue_api_key", "support-bot", "--expires", "soon", stdout=StringIO())
    # Defaults keep the old behaviour.
    call_command("issue_api_key", "dora", "--create-user", stdout=StringIO(), stderr=StringIO())
    dora = ApiKey.objects.get(user__username="dora")
    assert (dora.role, dora.permission_set, dora.expires_at) == ("user", {"read", "write", "delete"}, None)
    assert user_tenant(dora.user) == "default"


# --- least privilege --------------------------------------------------------------------
def test_every_operation_declares_its_permission():
    from memories.operations import OPERATIONS, operations_permitted

    assert {
        name: op.permission for name, op in OPERATIONS.items() if op.permission not in ("read", "write", "delete")
    } == {}
    assert operations_permitted(frozenset({"read"})) == {
        "search_memory", "list_memory", "get_memory", "list_memory_dated", "export_memories", "list_trash",
        # the turn lifecycle (issue 13) and seed 003's toolkit (issue 14)
        "memory_before_turn", "memory_list_dir_with_abstract", "memory_run_turn", "memory_prefetch",
        "recall_memory", "check_cache", "hybrid_search", "search_web", "memory_health", "recall_decision",
    }  # fmt: skip
    assert operations_permitted(frozenset({"delete"})) == {
        "delete_memory", "clear_all_memory", "forget_memory", "purge_memory",
        "delete_session_events", "toolkit_delete_memory", "wipe_user_data", "cache_invalidate",
    }  # fmt: skip


WRITE_AND_DELETE_CALLS = [
    ("remember", {"memory": "should not be stored"}),
    ("ingest", {"messages": [{"role": "user", "content": "I like tea"}]}),
    ("update_memory", {"memory_id": "MEMORY", "memory": "changed"}),
    ("delete_memory", {"memory_id": "MEMORY"}),
    ("delete_memory", {"tags": ["x"], "confirm": True}),
    ("clear_all_memory", {"confirm": True}),
]


def test_read_only_key_searches_and_lists_and_every_write_or_delete_is_forbidden(alice, api_client):
    memory_id = memory_remember(MemoryScope.for_user(alice), memory="Alice drinks green tea", call=internal_call()).id
    key = api_key_issue(user=alice, name="cursor", permissions=frozenset({"read"}))[1]
    billed_before = set(UsageEvent.objects.values_list("id", flat=True))

    async def listing(client):
        return [tool.name for tool in (await client.list_tools()).tools]

    async def calls(client):
        results = {"search": await client.call_tool("search_memory", {"query": "tea"})}
        results["list"] = await client.call_tool("list_memory", {})
        for index, (name, arguments) in enumerate(WRITE_AND_DELETE_CALLS):
            arguments = {k: (memory_id if v == "MEMORY" else v) for k, v in arguments.items()}
            results[f"{index}:{name}"] = await client.call_tool(name, arguments)
        return results

    tools, results = mcp_sessions([(mcp_headers(key), listing), (mcp_headers(key), calls)])
    assert sorted(tools) == ["list_memory", "search_memory"]
    assert [m["memory"] for m in outcome_of(results.pop("search"))[1]["results"]] == ["Alice drinks green tea"]
    assert [m["id"] for m in outcome_of(results.pop("list"))[1]["memories"]] == [memory_id]
    for name, result in results.items():
        code, error = outcome_of(result)
        assert code == "forbidden", name
        assert "permission" in error["message"]

    # REST and /v1/memory too.
    client = api_client(key)
    assert client.get("/v1/memories").status_code == 200
    assert client.post("/v1/memory/search", {"query": "tea"}, format="json").status_code == 200
    for response in (
        client.post("/v1/memories", {"memory": "x"}, format="json"),
        client.patch(f"/v1/memories/{memory_id}", {"memory": "x"}, format="json"),
        client.delete(f"/v1/memories/{memory_id}"),
        client.post("/v1/memories/clear", {"confirm": True}, format="json"),
        client.post("/v1/trash/purge", {"all": True}, format="json"),
        client.post("/v1/memory", {"content": "x"}, format="json"),
        client.post(f"/v1/memory/{memory_id}/forget"),
    ):
        assert response.status_code == 403 and response.json()["error"]["code"] == "forbidden"

    # Nothing changed; each refusal is audited as denied, none billed.
    stored = engine.engine_get(memory_id)
    assert stored is not None and stored.text == "Alice drinks green tea" and stored.trash is None
    assert engine.engine_memory_count(MemoryScope.for_user(alice)) == 1
    denied = AuditEvent.objects.filter(outcome="denied", error_code="forbidden")
    assert denied.count() == len(WRITE_AND_DELETE_CALLS) + 7
    billed = UsageEvent.objects.exclude(id__in=billed_before)
    assert sorted(billed.values_list("operation", flat=True)) == ["list_memory"] * 2 + ["search_memory"] * 2


def test_write_only_key_sees_write_tools_and_delete_is_separate(alice):
    key = api_key_issue(user=alice, permissions=frozenset({"write"}))[1]

    async def listing(client):
        return sorted(tool.name for tool in (await client.list_tools()).tools)

    assert mcp_sessions([(mcp_headers(key), listing)]) == [["ingest", "remember", "update_memory"]]


def test_expired_and_revoked_keys_get_401(alice, api_client):
    key, plain = api_key_issue(user=alice, expires_at=timezone.now() + timedelta(hours=1))
    assert api_client(plain).get("/v1/memories").status_code == 200
    ApiKey.objects.filter(pk=key.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    response = api_client(plain).get("/v1/memories")
    assert response.status_code == 401 and response.json()["error"]["code"] == "unauthenticated"
    (mcp_response,) = mcp_sessions([(mcp_headers(plain), None)])
    assert mcp_response.status_code == 401
    from core.errors import ServiceError

    with pytest.raises(ServiceError):
        api_key_issue(user=alice, expires_at=timezone.now() - timedelta(days=1))


# --- delegation ---------------------------------------------------------------------------
def test_delegated_call_audits_actor_and_subject_and_bills_the_subject(acme, api_client, unlimited):  # noqa: ARG001
    ann = _user(acme, "ann")
    bot = _user(acme, "support-bot")
    key = api_key_issue(user=bot, name="support-bot", role=Role.TENANT_ADMIN)[1]

    client = api_client(key)
    created = client.post("/v1/memories", {"memory": "Ann prefers email"}, format="json", **{SUBJECT: "acme/ann"})
    assert created.status_code == 201, created.json()
    memory_id = created.json()["id"]
    assert engine.engine_get(memory_id).user_id == f"acme:{ann.pk}"

    row = AuditEvent.objects.get(operation="remember", outcome="ok")
    assert (row.actor_user_id, row.actor_username, row.actor_role) == (bot.pk, "support-bot", "tenant_admin")
    assert (row.subject_user_id, row.tenant, row.actor_client_app) == (ann.pk, "acme", "support-bot")
    assert row.detail["subject_claim"] == "acme/ann"
    usage = UsageEvent.objects.get(request_id=row.request_id)
    assert usage.user_id == str(ann.pk) and usage.operation == "remember"
    assert UsageEvent.objects.count() == 1
    # The memory's history says who did it.
    from memories.selectors import memory_activity, memory_versions

    scope = MemoryScope.for_user(ann)
    assert memory_versions(scope, memory_id=memory_id)[0]["changed_by"] == "support-bot, tenant admin (rest)"
    (activity,) = memory_activity(scope, by_services=True)
    assert activity["by_service"] and activity["role_label"] == "tenant admin" and activity["operation"] == "remember"

    # The bot's own memories are untouched; ann sees it as hers.
    assert client.get("/v1/memories").json()["memories"] == []
    listed = client.get("/v1/memories", **{SUBJECT: "acme/ann"}).json()["memories"]
    assert [m["id"] for m in listed] == [memory_id]

    # seed 001's scope selects the subject the same way.
    v1 = client.post(
        "/v1/memory/search", {"query": "email", "scope": {"tenant_id": "acme", "user_id": "ann"}}, format="json"
    )
    assert v1.status_code == 200, v1.json()
    assert [(m["id"], m["scope"]["user_id"], m["scope"]["tenant_id"]) for m in v1.json()["memories"]] == [
        (memory_id, "ann", "acme")
    ]
    stored = client.post(
        "/v1/memory",
        {"content": "Ann's timezone is CET", "scope": {"tenant_id": "acme", "user_id": "ann"}},
        format="json",
    )
    assert stored.status_code == 201 and stored.json()["memory"]["scope"]["user_id"] == "ann"
    prefetched = client.post(
        "/v1/memory/prefetch", {"query": "email", "scope": {"tenant_id": "acme", "user_id": "ann"}}, format="json"
    )
    assert prefetched.status_code == 200, prefetched.json()
    assert {m["scope"]["user_id"] for m in prefetched.json()["memories"]} == {"ann"}  # the subject, not the bot
    # Header and scope naming different users: the scope must match whom the call runs as.
    mixed = client.post(
        "/v1/memory/search", {"query": "x", "scope": {"user_id": "support-bot"}}, format="json", **{SUBJECT: "acme/ann"}
    )
    assert mixed.status_code == 403


def test_credential_rate_limit_spans_its_subjects(acme, api_client, settings):  # noqa: ARG001
    settings.RATE_LIMITS = {**settings.RATE_LIMITS, "list_memory": (3, 60)}
    settings.RATE_LIMIT_CREDENTIAL_FACTOR = 2  # the bot may list 6 times a minute in all
    for name in ("u1", "u2", "u3"):
        _user(acme, name)
    bot = _user(acme, "bot")
    client = api_client(api_key_issue(user=bot, role=Role.TENANT_ADMIN)[1])
    statuses = [client.get("/v1/memories", **{SUBJECT: f"acme/u{1 + i % 3}"}).status_code for i in range(7)]
    assert statuses == [200] * 6 + [429]
    # Per subject: u1 was listed twice (the 7th was refused at the credential's limit).
    windows = {w.operation: w.count for w in RateWindow.objects.all()}
    assert windows[f"list_memory@key:{ApiKey.objects.get(user=bot).key_id}"] == 6  # the refused 7th: not counted
    assert sum(w.count for w in RateWindow.objects.filter(operation="list_memory")) == 6


# --- OIDC -----------------------------------------------------------------------------------
def test_oidc_tenant_and_roles_from_claims(oidc, settings, api_client, acme, unlimited):  # noqa: ARG001
    settings.OIDC_TENANT_CLAIM = "organization"
    settings.OIDC_TENANT_MAP = {"Acme Corporation": "acme"}
    tenant_create(name="globex")

    def token(sub: str, org: str | None, roles: list[str] | None = None, **extra) -> str:
        claims = {"sub": sub, "aud": "memsite", "azp": "support-app", **extra}
        if org is not None:
            claims["organization"] = org
        if roles is not None:
            claims["realm_access"] = {"roles": roles}  # Keycloak's shape
        return oidc.token(**claims)

    # A user of acme (mapped claim value) and one of globex, created on first sight.
    ann = api_client(token("kc-ann", "Acme Corporation", ["offline_access"], preferred_username="ann"))
    assert ann.post("/v1/memories", {"memory": "Ann likes tea"}, format="json").status_code == 201
    gus = api_client(token("kc-gus", "globex", preferred_username="gus"))
    assert gus.get("/v1/memories").status_code == 200
    User = get_user_model()
    assert user_tenant(User.objects.get(username="ann")) == "acme"
    assert user_tenant(User.objects.get(username="gus")) == "globex"

    # An ordinary OIDC user naming someone else: 403.
    assert ann.get("/v1/memories", **{SUBJECT: "globex/gus"}).status_code == 403
    # A tenant admin (realm role) of acme acts for ann, not for gus.
    admin = api_client(token("kc-admin", "acme", ["memsite-tenant-admin"], preferred_username="acme-admin"))
    listed = admin.get("/v1/memories", **{SUBJECT: "acme/ann"})
    assert listed.status_code == 200 and [m["memory"] for m in listed.json()["memories"]] == ["Ann likes tea"]
    cross = admin.get("/v1/memories", **{SUBJECT: "globex/gus"})
    missing = admin.get("/v1/memories", **{SUBJECT: "globex/nobody"})
    assert cross.status_code == missing.status_code == 404 and cross.json() == missing.json()
    # A platform role crosses tenants.
    platform = api_client(token("kc-ops", "acme", ["memsite-platform"], preferred_username="ops"))
    assert platform.get("/v1/memories", **{SUBJECT: "globex/gus"}).status_code == 200
    # Roles as a space-separated string claim, configurable path.
    settings.OIDC_ROLES_CLAIM = "resource_access.memsite.roles"
    nested = token("kc-admin", "acme", resource_access={"memsite": {"roles": "x memsite-tenant-admin"}})
    assert api_client(nested).get("/v1/memories", **{SUBJECT: "acme/ann"}).status_code == 200

    # An unknown tenant, no tenant claim, or a token naming another tenant than the user's: 401.
    assert api_client(token("kc-new", "initech")).get("/v1/memories").status_code == 401
    assert api_client(token("kc-new2", None)).get("/v1/memories").status_code == 401
    assert api_client(token("kc-ann", "globex")).get("/v1/memories").status_code == 401
    assert not User.objects.filter(username__startswith="oidc-").exists()


def test_oidc_fixed_tenant(oidc, settings, api_client, acme):  # noqa: ARG001
    settings.OIDC_TENANT = "acme"
    response = api_client(oidc.token(sub="s1", aud="memsite", preferred_username="fixed")).get("/v1/memories")
    assert response.status_code == 200
    assert user_tenant(get_user_model().objects.get(username="fixed")) == "acme"
