"""The MCP endpoint, driven by the official `mcp` SDK client in both protocol modes."""

import json
import urllib.request

import pytest

from tests.engine_helpers import memory_gone

pytestmark = pytest.mark.slow

EXPECTED_ANNOTATIONS = {
    "search_memory": (True, False),
    "list_memory": (True, False),
    "remember": (False, False),
    "ingest": (False, False),
    "update_memory": (False, True),
    "delete_memory": (False, True),
    "clear_all_memory": (False, True),
}


@pytest.mark.parametrize("mode", ["legacy", "auto"])
def test_tools_list_has_seven_tools_with_schemas_and_annotations(mcp_as, alice_key, mode):
    async def work(client):
        return await client.list_tools(), client.session.protocol_version

    tools, version = mcp_as(alice_key, mode).run(work)
    assert version == ("2025-11-25" if mode == "legacy" else "2026-07-28")
    by_name = {tool.name: tool for tool in tools.tools}
    assert set(by_name) == set(EXPECTED_ANNOTATIONS)
    for name, (read_only, destructive) in EXPECTED_ANNOTATIONS.items():
        tool = by_name[name]
        assert tool.description
        assert tool.input_schema["type"] == "object"
        assert tool.input_schema["additionalProperties"] is False
        assert tool.annotations.read_only_hint is read_only, name
        assert tool.annotations.destructive_hint is destructive, name
        assert tool.annotations.open_world_hint is False, name
    assert by_name["remember"].input_schema["properties"]["memory"]["maxLength"] == 8000


@pytest.mark.parametrize("mode", ["legacy", "auto"])
def test_smoke_flow(mcp_as, alice_key, mode):
    mcp = mcp_as(alice_key, mode)
    remembered = mcp.ok("remember", {"memory": "My sister Ana lives in Lisbon", "metadata": {"topic": "family"}})
    memory_id = remembered["id"]
    assert remembered["duplicate"] is False

    found = mcp.ok("search_memory", {"query": "Where does Ana live?", "top_k": 3})["results"]
    assert found[0]["id"] == memory_id
    assert found[0]["memory"] == "My sister Ana lives in Lisbon"

    updated = mcp.ok("update_memory", {"memory_id": memory_id, "memory": "My sister Ana lives in Porto"})
    assert updated["memory"]["memory"] == "My sister Ana lives in Porto"
    assert updated["memory"]["metadata"] == {"topic": "family"}

    assert mcp.ok("delete_memory", {"memory_id": memory_id}) == {"id": memory_id, "deleted": True}
    assert mcp.ok("search_memory", {"query": "Where does Ana live?"})["results"] == []
    assert memory_gone(memory_id)


def test_results_carry_the_same_json_as_text(mcp_as, alice_key):
    result = mcp_as(alice_key).call("remember", {"memory": "I play the cello"})
    assert json.loads(result.content[0].text) == result.structured_content


def test_unknown_tool_is_a_protocol_error(mcp_as, alice_key):
    from mcp.shared.exceptions import MCPError

    with pytest.raises(MCPError, match="Unknown tool"):
        mcp_as(alice_key).call("drop_database", {})


def _post_initialize(url: str, headers: dict) -> tuple[int, object, dict]:
    body = json.dumps(
        {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "initialize",
            "params": {
                "protocolVersion": "2025-11-25",
                "capabilities": {},
                "clientInfo": {"name": "t", "version": "1"},
            },
        }
    ).encode()
    request = urllib.request.Request(
        f"{url}/engines/memory/mcp",
        data=body,
        headers={"Content-Type": "application/json", "Accept": "application/json, text/event-stream", **headers},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310 - loopback
            return response.status, response.headers, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            return exc.code, exc.headers, json.loads(raw or b"{}")
        except ValueError:
            return exc.code, exc.headers, {"raw": raw.decode(errors="replace")}


@pytest.mark.parametrize("authorization", [None, "Bearer ", "Bearer msk_nope_nope", "Basic YWxpY2U6cHc=", "msk_x"])
def test_no_valid_token_no_entry(memsite_server, authorization):
    headers = {"Authorization": authorization} if authorization else {}
    status, response_headers, body = _post_initialize(memsite_server, headers)
    assert status == 401
    challenge = response_headers["WWW-Authenticate"]
    assert challenge.startswith('Bearer resource_metadata="http://127.0.0.1:')
    assert "/.well-known/oauth-protected-resource" in challenge
    assert body["error"]["code"] == "unauthenticated"


def test_revoked_key_stops_working(mcp_as, memsite_server, alice, alice_key):
    from memories.models import ApiKey
    from memories.services import api_key_revoke

    assert _post_initialize(memsite_server, {"Authorization": f"Bearer {alice_key}"})[0] == 200
    api_key_revoke(user=alice, key_id=ApiKey.objects.get(user=alice).key_id)
    assert _post_initialize(memsite_server, {"Authorization": f"Bearer {alice_key}"})[0] == 401


def test_unknown_host_header_is_refused(memsite_server, alice_key):
    status, _, _ = _post_initialize(memsite_server, {"Authorization": f"Bearer {alice_key}", "Host": "evil.example"})
    assert status == 421


def test_protected_resource_metadata(memsite_server):
    with urllib.request.urlopen(f"{memsite_server}/.well-known/oauth-protected-resource", timeout=10) as response:  # noqa: S310
        body = json.loads(response.read())
    assert body["resource"] == f"{memsite_server}/engines/memory/mcp"
    assert body["bearer_methods_supported"] == ["header"]
