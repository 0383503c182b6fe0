"""Issue 14, acceptance 1: an MCP client written from seed 003's API reference (minus
`user_id`) exercises all twelve tools against the live server at
/engines/memory-toolkit/mcp. The official SDK client validates every structured result
against the tool's output schema."""

from __future__ import annotations

import json

import pytest

from audit.models import AuditEvent

pytestmark = pytest.mark.slow

SEED_TOOLS = {
    "store_memory",
    "recall_memory",
    "delete_memory",
    "check_cache",
    "store_cache",
    "hybrid_search",
    "search_web",
    "memory_health",
    "wipe_user_data",
    "cache_invalidate",
    "store_decision",
    "recall_decision",
}


@pytest.fixture
def toolkit_as(mcp_as):
    def make(token):
        caller = mcp_as(token)
        caller.url = caller.url.replace("/engines/memory/mcp", "/engines/memory-toolkit/mcp")
        return caller

    return make


def _seed_error(caller, name: str, arguments: dict) -> dict:
    """Seed 003's error results: `error` is a string (we add a stable `code`)."""
    result = caller.call(name, arguments)
    assert result.is_error, result.structured_content
    assert result.structured_content is None  # the error is in the text only
    content = json.loads(result.content[0].text)
    assert isinstance(content["error"], str)
    return content


def test_seed_003_client_exercises_all_twelve_tools(toolkit_as, alice_key, bob_key, alice):
    mcp = toolkit_as(alice_key)

    tools = mcp.run(lambda client: client.list_tools()).tools
    assert {tool.name for tool in tools} == SEED_TOOLS
    for tool in tools:
        assert "user_id" not in tool.input_schema.get("properties", {}), tool.name
        assert tool.input_schema["additionalProperties"] is False

    stored = mcp.ok(
        "store_memory",
        {
            "conversation_id": "conv-1",
            "messages": [
                {"role": "human", "content": "The user prefers dark mode interfaces in every app."},
                {"role": "ai", "content": "Got it."},
            ],
        },
    )
    assert stored["count"] == 2 and len(stored["stm_ids"]) == 2

    recalled = mcp.ok("recall_memory", {"query": "dark mode", "limit": 5})
    assert recalled["count"] == len(recalled["results"]) >= 1
    first = recalled["results"][0]
    for key in ("_id", "user_id", "tier", "content", "summary", "importance", "access_count", "created_at"):
        assert key in first, key
    assert "final_score" in first and "embedding" not in first

    searched = mcp.ok("hybrid_search", {"query": "dark mode", "tier": ["stm", "ltm"], "limit": 5})
    assert searched["count"] >= 1 and "rrf_score" in searched["results"][0]

    cache_id = mcp.ok("store_cache", {"query": "What is the project deadline?", "response": "March 31, 2025."})
    assert isinstance(cache_id["cache_id"], str)
    hit = mcp.ok("check_cache", {"query": "What is the project deadline?"})
    assert hit["cache_hit"] is True and hit["response"] == "March 31, 2025." and hit["score"] >= 0.95
    assert mcp.ok("check_cache", {"query": "Favourite pizza topping?", "similarity_threshold": 0.99}) == {
        "cache_hit": False
    }
    assert mcp.ok("cache_invalidate", {"pattern": "deadline"}) == {"user_id": alice.username, "deleted_count": 1}
    assert mcp.ok("cache_invalidate", {"invalidate_all": True})["deleted_count"] == 0

    assert mcp.ok("store_decision", {"key": "preferred_language", "value": "Python"}) == {
        "key": "preferred_language",
        "action": "created",
        "user_id": alice.username,
    }
    assert mcp.ok("store_decision", {"key": "preferred_language", "value": "Go", "ttl_days": 30})["action"] == "updated"
    decision = mcp.ok("recall_decision", {"key": "preferred_language"})
    assert decision["found"] is True and decision["decision"]["value"] == "Go"
    assert mcp.ok("recall_decision", {"key": "nothing"}) == {"key": "nothing", "found": False}

    health = mcp.ok("memory_health", {})
    assert health["user_id"] == alice.username and health["total_memories"] >= 2
    assert set(health["tier_stats"]) >= {"stm", "ltm"} and set(health["enrichment_stats"]) >= {"pending", "completed"}

    assert mcp.ok("delete_memory", {"memory_id": stored["stm_ids"][1], "dry_run": True}) == {
        "deleted_count": 1,
        "dry_run": True,
    }
    assert mcp.ok("delete_memory", {"memory_id": stored["stm_ids"][1]}) == {"deleted_count": 1, "dry_run": False}
    bulk = _seed_error(mcp, "delete_memory", {"time_range": {"start": "2000-01-01T00:00:00Z"}})
    assert bulk["code"] == "confirmation_required"

    web = _seed_error(mcp, "search_web", {"query": "memsite"})
    assert web["error"] == "Web search service unavailable: Tavily API key not configured"

    # Bob, through the same endpoint, sees and touches none of it.
    bob = toolkit_as(bob_key)
    assert bob.ok("recall_memory", {"query": "dark mode"})["count"] == 0
    assert bob.ok("recall_decision", {"key": "preferred_language"})["found"] is False
    assert _seed_error(bob, "delete_memory", {"memory_id": stored["stm_ids"][0]})["code"] == "not_found"
    assert _seed_error(bob, "recall_memory", {"query": "x", "user_id": alice.username})["code"] == "invalid_argument"

    refused = _seed_error(mcp, "wipe_user_data", {})
    assert refused["error"] == "wipe_user_data requires confirm=true. This will permanently delete ALL user data."
    wiped = mcp.ok("wipe_user_data", {"confirm": True})
    assert wiped["user_id"] == alice.username and wiped["memories_deleted"] >= 2
    assert set(wiped) >= {"user_id", "memories_deleted", "cache_deleted", "audit_deleted"}
    assert mcp.ok("memory_health", {})["total_memories"] == 0

    # Every call left its audit row with a duration, like the seven tools.
    rows = AuditEvent.objects.filter(actor_username=alice.username, channel="mcp")
    assert {"store_memory", "recall_memory", "check_cache", "wipe_user_data", "search_web"} <= set(
        rows.values_list("operation", flat=True)
    )
    assert not rows.filter(duration_ms__isnull=True).exists()
