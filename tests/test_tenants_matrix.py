"""Issue 12, acceptance 1: the probe matrix. 3 tenants x users x roles x every MCP tool,
REST route and /v1/memory operation, without a subject, naming itself, a user of its own
tenant, a user of another tenant and a user that does not exist. Counts: 0 cross-tenant
reads or writes, 0 escalations, every allowed delegated call succeeds."""

from __future__ import annotations

import uuid
from collections import Counter
from dataclasses import dataclass, field

import pytest

from core.choices import Role
from core.scope import MemoryScope
from memories import engine
from memories.models import EngineMemoryRow
from memories.services import api_key_issue, memory_remember
from memories.tenancy import NO_SUBJECT_MESSAGE, tenant_create, tenant_user_create
from tests.conftest import internal_call
from tests.test_tenants import mcp_headers, mcp_sessions, outcome_of

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]

TENANTS = ("default", "acme", "globex")
SUBJECT = "HTTP_X_MEMORY_SUBJECT"


@dataclass
class Actor:
    tenant: str
    username: str
    role: str
    key: str = ""

    @property
    def name(self) -> str:
        return f"{self.tenant}/{self.username}"


@dataclass
class Tally:
    calls: int = 0
    allowed_delegated: int = 0
    allowed_delegated_ok: int = 0
    escalations: list[str] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)
    leaks: list[str] = field(default_factory=list)
    outcomes: Counter = field(default_factory=Counter)


@pytest.fixture
def world(settings, fake_llm):
    """Tenants, two users each with a user key, a tenant_admin service account per tenant,
    one platform account; a marker memory per account; unlimited rates; ingest's LLM fake."""
    settings.RATE_LIMITS = {op: (0, 60) for op in settings.RATE_LIMITS}
    settings.LLM_BASE_URL, settings.LLM_MODEL, settings.LLM_API_KEY = f"{fake_llm.url}/v1", "fake", "fake"
    engine.engine_close()
    actors: list[Actor] = []
    for tenant in TENANTS:
        if tenant != "default":
            tenant_create(name=tenant)
        actors += [Actor(tenant, f"{tenant}-ann", Role.USER), Actor(tenant, f"{tenant}-bob", Role.USER)]
        actors.append(Actor(tenant, f"{tenant}-admin", Role.TENANT_ADMIN))
    actors.append(Actor("default", "ops", Role.PLATFORM))
    owners: dict[str, str] = {}  # partition -> "tenant/username"
    for actor in actors:
        user = tenant_user_create(tenant=actor.tenant, username=actor.username)
        actor.key = api_key_issue(user=user, name=f"{actor.username}-key", role=actor.role)[1]
        scope = MemoryScope.for_user(user)
        owners[scope.engine_user_id] = actor.name
        memory_remember(scope, memory=f"marker of {actor.name}", call=internal_call())
    yield actors, owners
    engine.engine_close()


def _subjects(actor: Actor, actors: list[Actor]) -> dict[str, str | None]:
    index = TENANTS.index(actor.tenant)
    other_tenant = TENANTS[(index + 1) % len(TENANTS)]
    same = next(a for a in actors if a.tenant == actor.tenant and a.role == Role.USER and a.username != actor.username)
    return {
        "none": None,
        "self": actor.name,
        "same-tenant": same.name,
        "other-tenant": f"{other_tenant}/{other_tenant}-ann",
        "nonexistent": f"{actor.tenant}/ghost",
    }


def _expected(actor: Actor, kind: str) -> str:
    """'ok' (runs as the named subject), 'forbidden' or 'not_found'."""
    if kind in ("none", "self"):
        return "ok"
    if actor.role == Role.USER:
        return "forbidden"
    if kind == "nonexistent" or (kind == "other-tenant" and actor.role == Role.TENANT_ADMIN):
        return "not_found"
    return "ok"


def _texts(data) -> list[str]:
    """Every memory text in a result (any shape)."""
    found: list[str] = []
    if isinstance(data, dict):
        for key, value in data.items():
            if key in ("memory", "content") and isinstance(value, str):
                found.append(value)
            else:
                found += _texts(value)
    elif isinstance(data, list):
        for item in data:
            found += _texts(item)
    return found


class Probe:
    def __init__(self, actor: Actor, kind: str, subject: str | None, tally: Tally):
        self.actor, self.kind, self.subject, self.tally = actor, kind, subject, tally
        self.expected = _expected(actor, kind)
        self.target = subject or actor.name
        self.delegated = self.target != actor.name

    def text(self, surface: str) -> str:
        return f"probe by {self.actor.name} for {self.target} via {surface}"

    def record(self, label: str, code: str, data, *, ok_code: str = "ok", message: str = "") -> bool:
        """One call's outcome against the rule. Returns whether it ran as allowed."""
        tally = self.tally
        tally.calls += 1
        tally.outcomes[(self.expected, code)] += 1
        where = f"{self.actor.name} [{self.actor.role}] subject={self.kind}: {label} -> {code}"
        if self.expected == "ok":
            if self.delegated:
                tally.allowed_delegated += 1
                tally.allowed_delegated_ok += code == ok_code
            if code != ok_code:
                tally.wrong.append(where)
            for text in _texts(data):
                if not (text.startswith(f"marker of {self.target}") or f" for {self.target} via" in text):
                    tally.leaks.append(f"{where}: saw {text!r}")
            return code == ok_code
        if code not in ("forbidden", "not_found") or (self.expected == "forbidden") != (code == "forbidden"):
            (tally.escalations if code in ("ok", ok_code) else tally.wrong).append(where)
        if code == "not_found" and self.expected == "not_found" and message != NO_SUBJECT_MESSAGE:
            tally.wrong.append(f"{where}: not the nonexistent-user answer {message!r}")
        return False

    # --- MCP ---------------------------------------------------------------------------
    def mcp_work(self):
        async def work(client):
            results = []

            async def call(name, arguments, ok_code="ok"):
                code, data = outcome_of(await client.call_tool(name, arguments))
                results.append((f"mcp {name}", code, data, ok_code))
                return code, data

            await call("search_memory", {"query": "marker", "top_k": 50})
            await call("list_memory", {"page_size": 200})
            code, data = await call("remember", {"memory": self.text("mcp")})
            memory_id = data["id"] if code == "ok" else str(uuid.uuid4())
            await call("update_memory", {"memory_id": memory_id, "memory": self.text("mcp (edited)")})
            await call("ingest", {"messages": [{"role": "user", "content": "hello"}]})
            await call("delete_memory", {"tags": ["none-such"], "dry_run": True})
            await call("delete_memory", {"memory_id": memory_id})
            await call("clear_all_memory", {"confirm": False}, ok_code="confirmation_required")
            return results

        return work

    def mcp_check(self, results) -> None:
        for label, code, data, ok_code in results:
            message = data.get("message", "") if code != "ok" else ""
            self.record(label, code, data, ok_code=ok_code, message=message)

    # --- REST ----------------------------------------------------------------------------
    def rest(self, client) -> None:
        extra = {SUBJECT: self.subject} if self.subject else {}

        def call(label, method, path, body=None, ok_status=200, ok_code="ok"):
            kwargs = {"format": "json"} if body is not None else {}
            response = (
                getattr(client, method)(path, body, **kwargs, **extra)
                if body is not None
                else getattr(client, method)(path, **extra)
            )
            data = response.json()
            if response.status_code == ok_status:
                code = ok_code
            else:
                code = data.get("error", {}).get("code", str(response.status_code))
            message = data.get("error", {}).get("message", "") if "error" in data else ""
            self.record(f"rest {label}", code, data, ok_code=ok_code, message=message)
            return code, data

        call("list", "get", "/v1/memories")
        call("search", "post", "/v1/memories/search", {"query": "marker", "top_k": 50})
        code, data = call("remember", "post", "/v1/memories", {"memory": self.text("rest")}, ok_status=201)
        memory_id = data["id"] if code == "ok" else str(uuid.uuid4())
        call("update", "patch", f"/v1/memories/{memory_id}", {"memory": self.text("rest (edited)")})
        call("ingest", "post", "/v1/memories/ingest", {"messages": [{"role": "user", "content": "hi"}]})
        call("forget", "post", "/v1/memories/forget", {"tags": ["none-such"], "dry_run": True})
        call("delete", "delete", f"/v1/memories/{memory_id}")
        call("trash", "get", "/v1/trash")
        call("restore", "post", "/v1/trash/restore", {"memory_id": memory_id})
        call("delete again", "delete", f"/v1/memories/{memory_id}")
        call("purge", "post", "/v1/trash/purge", {"memory_id": memory_id})
        call("clear", "post", "/v1/memories/clear", {"confirm": False}, ok_status=400, ok_code="confirmation_required")

    # --- /v1/memory: the subject as seed 001's scope, never a header ------------------------
    def seed001(self, client) -> None:
        scope = {}
        if self.subject:
            tenant, _, username = self.subject.partition("/")
            scope = {"tenant_id": tenant, "user_id": username}
        query = "&".join(f"{k}={v}" for k, v in scope.items())

        def call(label, method, path, body=None, ok_status=200):
            response = (
                getattr(client, method)(path, body, format="json")
                if body is not None
                else getattr(client, method)(path)
            )
            data = response.json()
            code = "ok" if response.status_code == ok_status else data.get("error", {}).get("code", "?")
            message = data.get("error", {}).get("message", "") if "error" in data else ""
            self.record(f"v1/memory {label}", code, data, message=message)
            return code, data

        code, data = call("store", "post", "/v1/memory", {"content": self.text("v1"), "scope": scope}, ok_status=201)
        memory_id = data["memory"]["id"] if code == "ok" else str(uuid.uuid4())
        if code == "ok":
            assert data["memory"]["scope"]["user_id"] == self.target.partition("/")[2]
        call("list", "get", f"/v1/memory?{query}")
        call("search", "post", "/v1/memory/search", {"query": "marker", "scope": scope, "limit": 50})
        call("update", "put", f"/v1/memory/{memory_id}", {"content": self.text("v1 (edited)"), "scope": scope})
        call("forget", "post", f"/v1/memory/{memory_id}/forget?{query}")
        code, data = call(
            "store 2", "post", "/v1/memory", {"content": self.text("v1 #2"), "scope": scope}, ok_status=201
        )
        second = data["memory"]["id"] if code == "ok" else str(uuid.uuid4())
        call("delete", "delete", f"/v1/memory/{second}?{query}")


def rows_misplaced(owners: dict[str, str]) -> list[str]:
    """Engine rows not in the partition of the user their text names (a marker memory or a
    probe's "... for <tenant>/<user> via ..." text)."""
    misplaced = []
    for row in EngineMemoryRow.objects.all():
        memory = engine.engine_memory_of(row)
        owner = owners.get(memory.user_id, "?")
        if not (memory.text.startswith(f"marker of {owner}") or f" for {owner} via" in memory.text):
            misplaced.append(f"{memory.text!r} in {owner}'s partition")
    return misplaced


def matrix_summary(probes: list, tally: Tally, misplaced: list[str]) -> dict[str, int]:
    return {
        "probes": len(probes),
        "calls": tally.calls,
        "cross_tenant_or_cross_user": len(tally.leaks) + len(misplaced),
        "escalations": len(tally.escalations),
        "allowed_delegated": tally.allowed_delegated,
        "allowed_delegated_ok": tally.allowed_delegated_ok,
        "denied_forbidden": tally.outcomes[("forbidden", "forbidden")],
        "denied_not_found": tally.outcomes[("not_found", "not_found")],
    }


@pytest.mark.slow
def test_probe_matrix(world, api_client):
    actors, owners = world
    tally = Tally()
    probes = [Probe(a, kind, subject, tally) for a in actors for kind, subject in _subjects(a, actors).items()]

    sessions = [(mcp_headers(p.actor.key, p.subject), p.mcp_work()) for p in probes]
    for probe, results in zip(probes, mcp_sessions(sessions), strict=True):
        probe.mcp_check(results)
    for probe in probes:
        probe.rest(api_client(probe.actor.key))
        probe.seed001(api_client(probe.actor.key))

    misplaced = rows_misplaced(owners)
    summary = matrix_summary(probes, tally, misplaced)
    print("probe matrix:", summary)  # noqa: T201 - the counts, for the record
    assert tally.leaks == [] and misplaced == []
    assert tally.escalations == []
    assert tally.wrong == []
    assert summary["allowed_delegated"] == summary["allowed_delegated_ok"] > 0
    # 10 actors x 5 subjects; 8 MCP + 12 REST + 7 /v1/memory calls each.
    assert len(probes) == 50 and tally.calls == 50 * 27
    # Delegations allowed: 3 tenant admins x 1 (same tenant) + platform x 2 (same, other tenant).
    assert tally.allowed_delegated == 5 * 27
    assert summary["denied_forbidden"] == 6 * 3 * 27  # 6 users x 3 foreign subjects
    assert summary["denied_not_found"] == (3 * 2 + 1) * 27  # admins: other tenant + ghost; platform: ghost
