"""Review 19, the MCP surface: tool errors without structuredContent (TypeScript clients
check it against the outputSchema even on errors), each toolset its own OAuth protected
resource, JSON-RPC ids the SDK would drop, JSON refusals with transport security before
authentication, Django's ALLOWED_HOSTS wildcards, and the MCP toolsets' own threads.
In-process: memsite.asgi.build_application over httpx's ASGI transport."""

from __future__ import annotations

import asyncio
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from billing.models import UsageEvent
from core.choices import Channel
from core.scope import CallContext
from memories.interfaces.mcp.registry import TOOLSETS
from memories.models import EngineMemoryRow
from memories.services import api_key_issue
from tests.test_mcp_asgi import Lifespan

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]

BASE = "http://localhost"
MEMORY = "/engines/memory/mcp"
TOOLKIT = "/engines/memory-toolkit/mcp"
LIFECYCLE = "/engines/memory-lifecycle/mcp"
HEADERS = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
LEGACY = {"MCP-Protocol-Version": "2025-11-25"}
MODERN = {"MCP-Protocol-Version": "2026-07-28"}


def _serve(work, base_url: str = BASE):
    """Run `work(http)` against a fresh application (its lifespan in this event loop)."""

    async def main():
        import httpx2

        from memsite.asgi import build_application

        application = build_application()
        async with Lifespan(application):
            transport = httpx2.ASGITransport(app=application)
            async with httpx2.AsyncClient(transport=transport, base_url=base_url, timeout=60) as http:
                return await work(http)

    return asyncio.run(main())


def _call(name: str, arguments, request_id=1) -> dict:
    return {
        "jsonrpc": "2.0",
        "id": request_id,
        "method": "tools/call",
        "params": {"name": name, "arguments": arguments},
    }


def _post(http, path: str, body, headers: dict):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return http.post(path, content=content, headers={**HEADERS, **headers})


def _auth(token: str) -> dict:
    return {"Authorization": f"Bearer {token}", **LEGACY}


def _assert_refusal(response, status: int, code: str, request_id: str | int | None = None) -> dict:
    """The one shape of a refusal before dispatch: a JSON-RPC error, its id the request's own
    when the gate read a valid one (else null), our code in data."""
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert body["jsonrpc"] == "2.0" and body["id"] == request_id, body
    assert body["error"]["code"] == -32600 and body["error"]["data"]["code"] == code, body
    assert body["error"]["message"] == body["error"]["data"]["message"]
    assert "input_value" not in response.text and "pydantic" not in response.text
    return body["error"]


# --- 1: tool errors ---------------------------------------------------------------------------
ERROR_CALLS = [
    (MEMORY, "remember", {"memory": ""}, "invalid_argument"),
    (MEMORY, "search_memory", {"query": "x", "top_k": "5"}, "invalid_argument"),
    (MEMORY, "update_memory", {"memory_id": "6f1c3a52-0c1e-4c55-9d1c-8f0f5b1d2e3a", "memory": "y"}, "not_found"),
    (MEMORY, "clear_all_memory", {}, None),
    (TOOLKIT, "store_memory", {"content": 5}, "invalid_argument"),
    (LIFECYCLE, "memory_after_turn", {"session_id": "s1"}, "invalid_argument"),
]


def test_tool_errors_have_no_structured_content_and_keep_the_code_in_the_text(alice):
    token = api_key_issue(user=alice, name="agent")[1]

    async def work(http):
        answers = []
        for path, tool, arguments, _ in ERROR_CALLS:
            answers.append(await _post(http, path, _call(tool, arguments), _auth(token)))
        answers.append(await _post(http, MEMORY, _call("remember", {"memory": "Alice rows at dawn"}), _auth(token)))
        return answers

    *errors, ok = _serve(work)
    for (path, tool, _, code), response in zip(ERROR_CALLS, errors, strict=True):
        assert response.status_code == 200, (tool, response.text)
        result = response.json()["result"]
        assert result["isError"] is True, (tool, result)
        assert "structuredContent" not in result, (tool, result)
        error = json.loads(result["content"][0]["text"])
        if path == TOOLKIT:  # seed 003's flat shape
            assert isinstance(error["error"], str) and error["code"] == code, error
        else:
            assert error["error"]["code"] == (code or error["error"]["code"]) and error["error"]["message"], error
    # A success keeps both (the structured result fits the outputSchema).
    result = ok.json()["result"]
    assert result["isError"] is False and json.loads(result["content"][0]["text"]) == result["structuredContent"]


def test_the_sdk_client_reads_tool_errors_from_the_text(mcp_as, alice_key):
    error = mcp_as(alice_key).error("remember", {"memory": ""})
    assert error["code"] == "invalid_argument"


# --- 2: each toolset is its own protected resource --------------------------------------------
def test_each_toolsets_401_points_at_its_own_resource_metadata():
    paths = [toolset.path for toolset in TOOLSETS]
    assert {MEMORY, TOOLKIT} <= set(paths)

    async def work(http):
        rows = []
        for path in paths:
            challenge = (await _post(http, path, {"jsonrpc": "2.0", "id": 1, "method": "ping"}, LEGACY)).headers[
                "www-authenticate"
            ]
            metadata_url = challenge.split('resource_metadata="')[1].split('"')[0]
            metadata = await http.get(metadata_url)
            rows.append((path, metadata_url, metadata.status_code, metadata.json()))
        root = (await http.get("/.well-known/oauth-protected-resource")).json()
        return rows, root

    rows, root = _serve(work)
    for path, metadata_url, status, metadata in rows:
        assert metadata_url == f"{BASE}/.well-known/oauth-protected-resource{path}"
        assert status == 200 and metadata["resource"] == f"{BASE}{path}", metadata
        assert metadata["authorization_servers"] == [BASE] and metadata["scopes_supported"] == [
            "read",
            "write",
            "delete",
        ]
    assert root["resource"] == f"{BASE}{MEMORY}" and root["resource_name"] == "memsite memory"


def _oauth_token(user, resource: str) -> str:
    """An access token through the authorization server's own services (register,
    authorize, consent, code exchange), bound to `resource`."""
    from oauth.models import OAuthClient
    from oauth.services import (
        oauth_authorization_begin,
        oauth_client_register,
        oauth_code_exchange,
        oauth_consent_decide,
    )
    from tests.oauth_helpers import pkce, query_of

    redirect = "http://127.0.0.1:3118/callback"
    metadata = {
        "client_id": "toolkit-test-client",  # the SDK's registration handler mints one
        "client_name": "Toolkit client",
        "redirect_uris": [redirect],
        "token_endpoint_auth_method": "none",
    }
    client_id = oauth_client_register(metadata=metadata, client_secret=None).client_id
    key = oauth_authorization_begin(
        client=OAuthClient.objects.get(client_id=client_id),
        redirect_uri=redirect,
        redirect_uri_explicit=True,
        state="st",
        scopes=["read", "write", "delete"],
        code_challenge=pkce()[1],
        resource=resource,
    )
    answer = oauth_consent_decide(
        request_key=key,
        user=user,
        granted=["read", "write", "delete"],
        issuer=BASE,
        call=CallContext(channel=Channel.UI),
    )
    return oauth_code_exchange(client_id=client_id, code=query_of(answer)["code"]).access_token


def test_an_oauth_token_for_the_toolkit_works_there_and_only_there(alice):
    token = _oauth_token(alice, f"{BASE}{TOOLKIT}")

    async def work(http):
        toolkit = await _post(http, TOOLKIT, _call("memory_health", {}), _auth(token))
        memory = await _post(http, MEMORY, _call("list_memory", {}), _auth(token))
        return toolkit, memory

    toolkit, memory = _serve(work)
    assert toolkit.status_code == 200 and toolkit.json()["result"]["isError"] is False, toolkit.text
    assert memory.status_code == 401
    assert (
        f'resource_metadata="{BASE}/.well-known/oauth-protected-resource{MEMORY}"' in memory.headers["www-authenticate"]
    )


# --- 3: ids the legacy SDK path would take for a notification ---------------------------------
@pytest.mark.parametrize("request_id", [None, 1.5, {"a": 1}, True, [1]])
@pytest.mark.parametrize("era", ["legacy", "modern"])
def test_a_tools_call_with_a_bad_id_is_refused_not_dropped(alice, request_id, era):
    token = api_key_issue(user=alice, name="agent")[1]
    headers = {"Authorization": f"Bearer {token}", **(LEGACY if era == "legacy" else MODERN)}

    async def work(http):
        return await _post(http, MEMORY, _call("remember", {"memory": "Alice owns a kayak"}, request_id), headers)

    response = _serve(work)
    assert (
        _assert_refusal(response, 400, "invalid_argument")["message"] == "A JSON-RPC id must be a string or an integer."
    )
    assert not EngineMemoryRow.objects.exists() and not UsageEvent.objects.exists()


# --- 4: refusals in JSON; transport security before authentication ----------------------------
def test_refusals_before_dispatch_are_json_rpc_errors(alice):
    token = api_key_issue(user=alice, name="agent")[1]
    auth = _auth(token)
    listing = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}

    async def work(http):
        return {
            "foreign origin, no token": await _post(
                http, MEMORY, listing, {**LEGACY, "Origin": "https://evil.example"}
            ),
            "foreign origin, bad token": await _post(
                http, TOOLKIT, listing, {**LEGACY, "Origin": "https://evil.example", "Authorization": "Bearer x"}
            ),
            "origin null": await _post(http, MEMORY, listing, {**auth, "Origin": "null"}),
            "unknown host, no token": await _post(http, MEMORY, listing, {**LEGACY, "Host": "evil.example"}),
            "text/plain": await _post(http, MEMORY, listing, {**auth, "Content-Type": "text/plain"}),
            "json-patch": await _post(http, MEMORY, listing, {**auth, "Content-Type": "application/json-patch+json"}),
            "accept html legacy": await _post(http, MEMORY, listing, {**auth, "Accept": "text/html"}),
            "accept html modern": await _post(http, MEMORY, listing, {**auth, **MODERN, "Accept": "text/html"}),
            "too large": await _post(http, MEMORY, _call("remember", {"memory": "a" * 300_000}), auth),
            "batch": await _post(http, MEMORY, [listing, listing], auth),
            "string": await _post(http, MEMORY, b'"hello"', auth),
            "jsonrpc 1.0": await _post(http, MEMORY, {**listing, "jsonrpc": "1.0"}, auth),
            "no jsonrpc": await _post(http, MEMORY, {"id": 1, "method": "tools/list"}, auth),
            "method number": await _post(http, MEMORY, {**listing, "method": 5}, auth),
            "params list": await _post(http, MEMORY, {**listing, "params": ["remember"]}, auth),
            "GET": await http.get(MEMORY, headers=auth),
        }

    answers = _serve(work)
    expected = {
        "foreign origin, no token": (403, "forbidden"),
        "foreign origin, bad token": (403, "forbidden"),
        "origin null": (403, "forbidden"),
        "unknown host, no token": (421, "forbidden"),
        "text/plain": (415, "invalid_argument"),
        "json-patch": (415, "invalid_argument"),
        "accept html legacy": (406, "invalid_argument"),
        "accept html modern": (406, "invalid_argument"),
        "too large": (413, "payload_too_large"),
        "batch": (400, "invalid_argument"),
        "string": (400, "invalid_argument"),
        "GET": (405, "invalid_argument"),
    }
    for label, (status, code) in expected.items():
        _assert_refusal(answers[label], status, code)
    # A message the gate read and refused answers with its own id.
    for label in ("jsonrpc 1.0", "no jsonrpc", "method number", "params list"):
        _assert_refusal(answers[label], 400, "invalid_argument", request_id=1)
    assert answers["GET"].headers["allow"] == "POST"
    assert not EngineMemoryRow.objects.exists()


# --- 5: ALLOWED_HOSTS and CSRF_TRUSTED_ORIGINS as Django reads them ---------------------------
def _list_tools_from(alice, base_url: str, origins: list[str | None]) -> list[int]:
    token = api_key_issue(user=alice, name="agent")[1]
    listing = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}

    async def work(http):
        statuses = []
        for origin in origins:
            headers = {**_auth(token), **({"Origin": origin} if origin else {})}
            statuses.append((await _post(http, MEMORY, listing, headers)).status_code)
        statuses.append((await http.get("/v1/memories", headers={"Authorization": f"Bearer {token}"})).status_code)
        return statuses

    return _serve(work, base_url=base_url)


def test_a_subdomain_wildcard_in_allowed_hosts_serves_mcp_like_rest(settings, alice):
    settings.ALLOWED_HOSTS = [".example.com"]
    origins = [None, "https://memory.example.com", "https://app.example.com:8443", "https://evil.test", "null"]
    assert _list_tools_from(alice, "http://memory.example.com", origins) == [200, 200, 200, 403, 403, 200]
    settings.ALLOWED_HOSTS = ["memory.example.com"]
    assert _list_tools_from(alice, "http://other.example.com", [None]) == [421, 421]  # REST answers as MCP


def test_a_star_allows_any_host_but_origins_still_come_from_csrf_trusted_origins(settings, alice):
    settings.ALLOWED_HOSTS = ["*"]
    settings.CSRF_TRUSTED_ORIGINS = ["https://app.example.org", "https://*.trusted.example"]
    origins = [None, "https://app.example.org", "https://ui.trusted.example", "https://evil.test", "http://anything"]
    assert _list_tools_from(alice, "http://any.host.example", origins) == [200, 200, 200, 403, 403, 200]


# --- 6: the MCP toolsets' own threads ----------------------------------------------------------
def test_tool_calls_run_on_their_own_threads_not_the_loops_default_executor(alice, monkeypatch):
    """A stalled default executor (hung OAuth or proxy calls share it) must not stall MCP."""
    from memories.interfaces.mcp import toolset as toolset_module

    token = api_key_issue(user=alice, name="agent")[1]
    seen: list[tuple[str, str | None]] = []
    execute = toolset_module.operation_execute

    def recording(principal, name, arguments, *, call):
        from core.request_ids import _current

        bound = _current.get()  # the request's context reached the thread
        seen.append((threading.current_thread().name, bound.request_id if bound else None))
        return execute(principal, name, arguments, call=call)

    monkeypatch.setattr(toolset_module, "operation_execute", recording)
    release = threading.Event()

    async def work(http):
        loop = asyncio.get_running_loop()
        stalled = ThreadPoolExecutor(max_workers=1)
        loop.set_default_executor(stalled)
        hung = loop.run_in_executor(None, release.wait)
        try:
            body = _call("remember", {"memory": "Alice keeps bees"})
            return await asyncio.wait_for(_post(http, MEMORY, body, _auth(token)), timeout=20)
        finally:
            release.set()
            await hung

    try:
        response = _serve(work)
    finally:
        release.set()
    assert response.status_code == 200 and response.json()["result"]["isError"] is False, response.text
    [(thread, request_id)] = seen
    assert thread.startswith("mcp") and request_id == response.headers["x-request-id"], seen
