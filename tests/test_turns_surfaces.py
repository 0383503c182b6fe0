"""Issue 13 on its surfaces: the official MCP SDK client over several turns of one
session at /engines/memory-lifecycle/mcp, `POST /v1/memory/prefetch`, and the Sessions
page, each with tenancy."""

from __future__ import annotations

import pytest

from memories.models import SessionEvent
from memories.turns.items import items_token_count
from tests.conftest import McpCaller

pytestmark = pytest.mark.django_db


def user_msg(text: str) -> dict:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def assistant_msg(text: str) -> dict:
    return {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}


def lifecycle(memsite_server: str, token: str) -> McpCaller:
    caller = McpCaller(memsite_server, token)
    caller.url = f"{memsite_server}/engines/memory-lifecycle/mcp"
    return caller


def test_sdk_client_runs_several_turns_of_one_session(memsite_server, memsite_server_process, alice_key, bob_key):
    mcp = lifecycle(memsite_server, alice_key)
    tools = mcp.run(lambda client: client.list_tools())
    assert {t.name for t in tools.tools} == {
        "memory_before_turn",
        "memory_after_turn",
        "memory_run_maintenance",
        "memory_list_dir_with_abstract",
        "memory_run_turn",
    }
    said = [
        "My favourite programming language is Haskell.",
        "What is the weather like on Mars?",
        "Remind me which programming language I like best?",
    ]
    fact_ids: list[str] = []
    for n, text in enumerate(said, start=1):
        before = mcp.ok(
            "memory_before_turn", {"session_id": "chat", "turn_id": f"t{n}", "current_input": [user_msg(text)]}
        )
        assert before["context_token_count"] == items_token_count(before["input_items"])
        assert before["input_items"][-1] == user_msg(text)
        if n == 3:
            assert fact_ids[0] in before["recall_fact_ids"]
            assert assistant_msg("Answer 2") in before["input_items"]  # the session's recent context
        after = mcp.ok(
            "memory_after_turn",
            {
                "session_id": "chat",
                "turn_id": f"t{n}",
                "input_items": [user_msg(text)],
                "output_items": [assistant_msg(f"Answer {n}")],
            },
        )
        assert after["ok"] and not after["duplicate"]
        fact_ids += after["fact_ids"]
    assert fact_ids  # turn 1's fact
    # A retry of turn 3 over MCP is a duplicate; the same turn id with other items is refused.
    retry = {
        "session_id": "chat",
        "turn_id": "t3",
        "input_items": [user_msg(said[2])],
        "output_items": [assistant_msg("Answer 3")],
    }
    assert mcp.ok("memory_after_turn", retry)["duplicate"]
    refused = mcp.error("memory_after_turn", {**retry, "output_items": [assistant_msg("Another answer")]})
    assert refused["code"] == "conflict" and refused["details"] == {"reason": "turn_id_reused"}
    assert "Another answer" not in refused["message"]
    assert mcp.ok("memory_run_maintenance", {"session_id": "chat"})["ok"]
    tree = mcp.ok("memory_list_dir_with_abstract", {"session_id": "chat"})["summaries"]
    assert any(e["path"] == "/memory/chat/meta" and e["has_overview"] for e in tree)
    assert mcp.error("memory_before_turn", {"session_id": "chat", "user_id": "bob", "current_input": []})["code"] == (
        "invalid_argument"
    )
    # Bob over the same endpoint: his own, empty session and no recall of alice's facts.
    bob = lifecycle(memsite_server, bob_key)
    seen = bob.ok("memory_before_turn", {"session_id": "chat", "current_input": [user_msg(said[2])]})
    assert seen["recall_fact_ids"] == [] and seen["input_items"] == [user_msg(said[2])]
    assert (
        bob.ok("memory_list_dir_with_abstract", {"session_id": "chat"})["summaries"][0]["path"] != "/memory/chat/meta"
    )
    # The seven-tool toolset does not list the lifecycle tools.
    seven = McpCaller(memsite_server, alice_key).run(lambda client: client.list_tools())
    assert not {t.name for t in seven.tools} & {"memory_before_turn", "memory_after_turn"}
    assert SessionEvent.objects.filter(session_id="chat").count() == 6
    # Turn content never reaches the server's log.
    log = memsite_server_process["log"].read_text(errors="replace")
    assert "memory_after_turn" in log
    assert not any(text in log for text in [*said, "Haskell", "Answer 2", "Another answer"])


def test_prefetch_route(api_client, alice_key, bob_key, alice, clean_vectors):
    from core.scope import CallContext
    from memories.auth import Principal
    from memories.operations import operation_execute

    operation_execute(
        Principal(user=alice, method="api_key"),
        "memory_after_turn",
        {"session_id": "s", "turn_id": "t", "input_items": [user_msg("My favourite editor is Helix.")]},
        call=CallContext(channel="mcp"),
    )
    client = api_client(alice_key)
    body = {"messages": [{"role": "user", "content": "Which editor do I like?"}], "limit": 3}
    response = client.post("/v1/memory/prefetch", body, format="json")
    assert response.status_code == 200, response.json()
    data = response.json()
    assert "- My favourite editor is Helix." in data["notes"]
    assert data["memories"][0]["content"] == "My favourite editor is Helix."
    assert data["memories"][0]["scope"]["user_id"] == "alice"
    query = client.post("/v1/memory/prefetch", {"query": "editor"}, format="json").json()
    assert query["memories"]
    # Tenancy: bob sees nothing of alice's; naming alice in scope is forbidden.
    bobs = api_client(bob_key).post("/v1/memory/prefetch", {"query": "Helix editor"}, format="json").json()
    assert bobs == {"notes": "", "memories": []}
    claimed = {"query": "editor", "scope": {"tenant_id": "default", "user_id": "alice"}}
    assert api_client(bob_key).post("/v1/memory/prefetch", claimed, format="json").status_code == 403
    # Bad input: coded errors.
    assert client.post("/v1/memory/prefetch", {}, format="json").json()["error"]["code"] == "invalid_argument"
    assert client.post("/v1/memory/prefetch", {"query": "x", "user_id": "1"}, format="json").status_code == 400
    assert api_client().post("/v1/memory/prefetch", {"query": "x"}, format="json").status_code == 401


def test_sessions_page_and_deleting_raw_events(client, alice, bob, clean_vectors):
    from core.scope import CallContext
    from memories.auth import Principal
    from memories.operations import operation_execute

    for who, text in ((alice, "I prefer tea over coffee."), (bob, "I prefer coffee over tea.")):
        operation_execute(
            Principal(user=who, method="api_key"),
            "memory_after_turn",
            {"session_id": f"{who.username}-s", "turn_id": "t", "input_items": [user_msg(text)]},
            call=CallContext(channel="mcp"),
        )
    assert client.get("/sessions/").status_code == 302  # login required
    client.force_login(alice)
    page = client.get("/sessions/").content.decode()
    assert "alice-s" in page and "I prefer tea over coffee." in page
    assert "bob-s" not in page and "coffee over tea" not in page
    # Alice "deleting" bob's session deletes nothing of his.
    client.post("/sessions/delete-events/", {"session_id": "bob-s"})
    assert SessionEvent.objects.filter(session_id="bob-s").count() == 1
    response = client.post("/sessions/delete-events/", {"session_id": "alice-s"})
    assert response.status_code == 302
    assert not SessionEvent.objects.filter(session_id="alice-s").exists()
    assert "I prefer tea over coffee." in client.get("/sessions/").content.decode()  # the fact stays
