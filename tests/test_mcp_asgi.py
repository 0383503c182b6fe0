"""The MCP app in-process: memsite.asgi.application driven by the official SDK client over
httpx's ASGI transport, with the app's lifespan run in the same event loop. Fast checks
next to the live-server tests in test_mcp.py (same app, no uvicorn)."""

import asyncio
import json

import jsonschema
import pytest

from memories.services import api_key_issue

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]


class Lifespan:
    """Runs an ASGI app's lifespan protocol (startup on enter, shutdown on exit)."""

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


def _run(token: str | None, work):
    async def main():
        import httpx2
        from mcp import Client
        from mcp.client.streamable_http import streamable_http_client

        from memsite.asgi import build_application

        application = build_application()

        headers = {"Authorization": f"Bearer {token}"} if token else {}
        async with Lifespan(application):
            transport = httpx2.ASGITransport(app=application)
            async with httpx2.AsyncClient(
                transport=transport, base_url="http://localhost", headers=headers, timeout=60
            ) as http:
                if work is None:
                    return await http.post("/engines/memory/mcp", json={})
                async with Client(streamable_http_client("http://localhost/engines/memory/mcp", http_client=http)) as c:
                    return await work(c)

    return asyncio.run(main())


def test_tools_and_a_round_trip_in_process(alice):
    token = api_key_issue(user=alice, name="alice-agent")[1]

    async def work(client):
        tools = {tool.name: tool for tool in (await client.list_tools()).tools}
        remembered = await client.call_tool("remember", {"memory": "Alice keeps a sourdough starter"})
        found = await client.call_tool("search_memory", {"query": "sourdough"})
        missing = await client.call_tool("delete_memory", {"memory_id": "6f1c3a52-0c1e-4c55-9d1c-8f0f5b1d2e3a"})
        listed = await client.call_tool("list_memory")  # no arguments at all: they are optional
        return tools, remembered, found, missing, listed

    tools, remembered, found, missing, listed = _run(token, work)
    assert not listed.is_error and len(listed.structured_content["memories"]) == 1
    assert len(tools) == 7 and all(tool.output_schema for tool in tools.values())
    assert not remembered.is_error and remembered.structured_content["duplicate"] is False
    jsonschema.validate(remembered.structured_content, tools["remember"].output_schema)
    assert found.structured_content["results"][0]["id"] == remembered.structured_content["id"]
    jsonschema.validate(found.structured_content, tools["search_memory"].output_schema)
    assert missing.is_error and missing.structured_content is None
    assert json.loads(missing.content[0].text)["error"]["code"] == "not_found"


def test_no_token_is_401_in_process():
    response = _run(None, None)
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "unauthenticated"
    assert "resource_metadata=" in response.headers["www-authenticate"]


def test_a_statement_over_a_database_limit_is_a_coded_413_not_an_outage(alice, monkeypatch):
    """SQLSTATE class 54 (here a real one: to_tsvector over 1 MB) is the request's size:
    the tool answers payload_too_large, as REST and the proxy do, not "retry later"."""
    from memories import operations
    from tests.test_proxy_review20 import _program_limit_error

    error = _program_limit_error()

    def over_a_limit(*args, **kwargs):
        raise error

    monkeypatch.setattr(operations, "memory_search", over_a_limit)
    token = api_key_issue(user=alice, name="alice-agent")[1]

    async def work(client):
        return await client.call_tool("search_memory", {"query": "sourdough"})

    answered = _run(token, work)
    assert answered.is_error
    assert json.loads(answered.content[0].text)["error"]["code"] == "payload_too_large"
