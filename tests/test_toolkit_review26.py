"""Review 26 of seed 003's toolkit: results that match their output schema whatever the
user put in a memory's metadata, web results the MCP response can carry, enrichment and
recall pairing only of store_memory's own rows, the "Your data" export in one read,
cache_invalidate's Unicode case folding, the web UI's delete of an expired decision, and
store_decision's time read after its lock."""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta

import pytest
from django.test import override_settings
from django.urls import reverse
from django.utils import timezone

from audit.models import AuditEvent
from billing.models import UsageEvent
from core.errors import ErrorCode, ServiceError
from core.scope import MemoryScope
from memories.auth import Principal
from memories.operations import operation_execute
from memories.selectors import memory_get_owned
from memories.services import api_key_issue
from memories.toolkit import schemas as toolkit_schemas
from memories.toolkit import services as toolkit_services
from memories.toolkit.models import CacheEntry, Decision
from memories.toolkit.services import toolkit_candidates_enrich
from tests.conftest import elsewhere, internal_call
from tests.fakes import FakeTavily
from tests.test_mcp_asgi import Lifespan

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]

TOOLKIT_URL = "http://localhost/engines/memory-toolkit/mcp"
GREEN_TEA = "I like green tea with honey"


@pytest.fixture(autouse=True)
def unlimited(settings):
    settings.RATE_LIMITS = {op: (0, 60) for op in settings.RATE_LIMITS}


def run(user, name: str, arguments: dict | None = None) -> dict:
    principal = Principal(user=user, method="api_key", client_app="seed003-agent")
    return operation_execute(principal, name, arguments or {}, call=internal_call())


def store(user, *messages: tuple[str, str], conversation_id: str = "c-1") -> dict:
    arguments = {"conversation_id": conversation_id, "messages": [{"role": r, "content": c} for r, c in messages]}
    return run(user, "store_memory", arguments)


def mcp_toolkit_call(token: str, name: str, arguments: dict):
    """One tools/call through the official SDK client, in process (memsite.asgi over
    httpx's ASGI transport). The client checks structuredContent against the tool's
    output schema, and raises when it does not match or the response does not parse."""

    async def main():
        import httpx2
        from mcp import Client
        from mcp.client.streamable_http import streamable_http_client

        from memsite.asgi import build_application

        application = build_application()
        async with Lifespan(application):
            transport = httpx2.ASGITransport(app=application)
            headers = {"Authorization": f"Bearer {token}"}
            async with (
                httpx2.AsyncClient(
                    transport=transport, base_url="http://localhost", headers=headers, timeout=60
                ) as http,
                Client(streamable_http_client(TOOLKIT_URL, http_client=http)) as client,
            ):
                await client.list_tools()
                return await client.call_tool(name, arguments)

    return asyncio.run(main())


# --- 1: toolkit metadata keys the user set to other JSON types --------------------------------
FOREIGN_TYPES = {"conversation_id": 7, "summary": 3, "enrichment_status": False}


def test_recall_and_hybrid_search_report_non_string_toolkit_keys_as_absent(alice):
    run(alice, "remember", {"memory": GREEN_TEA, "metadata": FOREIGN_TYPES})
    recalled = run(alice, "recall_memory", {"query": "green tea"})
    toolkit_schemas.RecallMemoryOutput.model_validate(recalled)
    (memory,) = recalled["results"]
    assert (memory["summary"], memory["enrichment_status"], memory["conversation_id"]) == (None, None, None)
    searched = run(alice, "hybrid_search", {"query": "green tea"})
    toolkit_schemas.HybridSearchOutput.model_validate(searched)
    assert searched["results"][0]["summary"] is None


def test_recall_keeps_string_toolkit_keys(alice):
    run(alice, "remember", {"memory": GREEN_TEA, "metadata": {"conversation_id": "c-9", "summary": "Tea."}})
    (memory,) = run(alice, "recall_memory", {"query": "green tea"})["results"]
    assert (memory["summary"], memory["conversation_id"]) == ("Tea.", "c-9")


def test_recall_over_mcp_passes_the_clients_output_schema_check(alice):
    token = api_key_issue(user=alice, name="agent")[1]
    run(alice, "remember", {"memory": GREEN_TEA, "metadata": FOREIGN_TYPES})
    result = mcp_toolkit_call(token, "recall_memory", {"query": "green tea"})
    assert not result.is_error
    assert result.structured_content["results"][0]["conversation_id"] is None
    assert UsageEvent.objects.filter(operation="recall_memory").count() == 1


# --- 2: web results with lone surrogates -------------------------------------------------------
CUT_EMOJI = {"title": "Emoji \ud83d", "url": "https://e.x/\udc00", "content": "bell\x07 and NUL\x00 here"}


def _with_provider_answer(answer: dict, work):
    fake = FakeTavily(answer=answer).start()
    try:
        with override_settings(TAVILY_API_KEY="tvly-secret", TAVILY_ENDPOINT=f"{fake.url}/search"):
            return work()
    finally:
        fake.stop()


def test_search_web_cleans_what_the_provider_answers(alice):
    found = _with_provider_answer({"results": [CUT_EMOJI]}, lambda: run(alice, "search_web", {"query": "emoji"}))
    assert found["results"] == [{"title": "Emoji \ufffd", "url": "https://e.x/\ufffd", "content": "bell  and NUL here"}]
    json.dumps(found, ensure_ascii=False).encode("utf-8")  # raised UnicodeEncodeError


def test_search_web_over_mcp_answers_a_result_the_client_can_read(alice):
    token = api_key_issue(user=alice, name="agent")[1]
    result = _with_provider_answer(
        {"results": [CUT_EMOJI]}, lambda: mcp_toolkit_call(token, "search_web", {"query": "emoji"})
    )
    assert not result.is_error
    assert result.structured_content["results"][0]["title"] == "Emoji \ufffd"
    assert UsageEvent.objects.filter(operation="search_web").count() == 1


# --- 3: enrichment takes only store_memory's candidates -----------------------------------------
DEPLOY = "Deploy the billing service only on Fridays please"
DARK_MODE = "I always prefer dark mode interfaces in every editor I use"


def test_enrichment_leaves_a_remembered_memory_with_candidate_metadata_alone(alice):
    mine = run(
        alice,
        "remember",
        {
            "memory": DEPLOY,
            "tags": ["mine"],
            "importance": 0.9,
            "memory_type": "reference",
            "metadata": {"tier": "ltm", "enrichment_status": "pending"},
        },
    )
    store(alice, ("human", DARK_MODE))
    assert toolkit_candidates_enrich() == 1  # store_memory's candidate only
    item = memory_get_owned(MemoryScope.for_user(alice), memory_id=mine["id"])
    assert (item.attrs.tags, item.attrs.importance, item.attrs.memory_type) == (("mine",), 0.9, "reference")
    assert item.metadata["enrichment_status"] == "pending" and "summary" not in item.metadata
    assert toolkit_candidates_enrich(memory_ids=[mine["id"]]) == 0


# --- 4: recall pairs only store_memory's two rows of a message ----------------------------------
@pytest.mark.parametrize("links", [("a", "a"), (1, "1")])
def test_recall_keeps_unrelated_memories_that_share_an_stm_id(alice, links):
    run(alice, "remember", {"memory": GREEN_TEA, "metadata": {"stm_id": links[0]}})
    run(alice, "remember", {"memory": "My cat is called Miso", "metadata": {"stm_id": links[1]}})
    assert run(alice, "recall_memory", {"query": "tea cat"})["count"] == 2


def test_recall_still_shows_a_store_memory_message_once(alice):
    store(alice, ("human", DARK_MODE))
    (memory,) = run(alice, "recall_memory", {"query": "dark mode editor"})["results"]
    assert memory["content"] == DARK_MODE
    assert len(run(alice, "hybrid_search", {"query": "dark mode editor"})["results"]) == 2  # both rows


# --- 5: the "Your data" export reads each list in one statement ---------------------------------
def _written_before_the_list_is_read(monkeypatch, name: str, write) -> None:
    """Another request's write lands after the export asked for the list and before the
    database answered (a list is a lazy query)."""
    selector = getattr(toolkit_services, name)

    def read_then_written_meanwhile(scope, **kwargs):
        rows = selector(scope, **kwargs)
        elsewhere(write)
        return rows

    monkeypatch.setattr(toolkit_services, name, read_then_written_meanwhile)


def test_export_keeps_every_row_when_another_request_writes_meanwhile(alice, bob, monkeypatch):
    run(alice, "store_decision", {"key": "b-theme", "value": "dark"})
    run(alice, "store_cache", {"query": "older question", "response": "older answer"})
    run(bob, "store_decision", {"key": "bobs", "value": "private"})
    _written_before_the_list_is_read(
        monkeypatch, "decision_list", lambda: run(alice, "store_decision", {"key": "a-lang", "value": "python"})
    )
    _written_before_the_list_is_read(
        monkeypatch, "cache_entry_list", lambda: run(alice, "store_cache", {"query": "newer", "response": "newer"})
    )
    document = json.loads(
        "".join(toolkit_services.toolkit_data_export(MemoryScope.for_user(alice), call=internal_call()))
    )
    assert [d["key"] for d in document["decisions"]] == ["a-lang", "b-theme"]
    assert [c["query"] for c in document["cached_answers"]] == ["newer", "older question"]
    row = AuditEvent.objects.get(operation="export_decisions_and_cache")
    assert row.detail["decisions"] == 2 and row.detail["cached_answers"] == 2


# --- 6: cache_invalidate folds case beyond ASCII ------------------------------------------------
@pytest.mark.parametrize(
    ("query", "pattern"),
    [
        ("Conseils pour l'ÉCOLE de Zürich", "école"),
        ("Conseils pour l'école de Zürich", "ZÜRICH"),
        ("Wo ist die Hauptstraße?", "HAUPTSTRASSE"),
        ("Cafe\u0301 near ΟΔΟΣ", "CAFÉ NEAR οδος"),  # decomposed é; final sigma
    ],
)
def test_cache_invalidate_pattern_ignores_case_in_every_script(alice, bob, query, pattern):
    run(alice, "store_cache", {"query": query, "response": "r"})
    run(alice, "store_cache", {"query": "something else entirely", "response": "r"})
    run(bob, "store_cache", {"query": query, "response": "bob's"})
    assert run(alice, "cache_invalidate", {"pattern": pattern})["deleted_count"] == 1
    assert CacheEntry.objects.filter(user=alice).values_list("query", flat=True).get() == "something else entirely"
    assert CacheEntry.objects.filter(user=bob).count() == 1


def test_cache_invalidate_pattern_does_not_match_a_letter_without_its_accent(alice):
    run(alice, "store_cache", {"query": "Cafe\u0301 latte prices", "response": "r"})  # decomposed é
    run(alice, "store_cache", {"query": "Café au lait", "response": "r"})
    assert run(alice, "cache_invalidate", {"pattern": "cafe"})["deleted_count"] == 0
    assert run(alice, "cache_invalidate", {"pattern": "CAFÉ"})["deleted_count"] == 2


def test_a_users_cache_is_capped_so_invalidate_scans_a_bounded_set_and_bobs_entries_stay(alice, bob, settings):
    """store_cache's rate limit was all that bounded a user's cache (off or raised, it grew
    without end), and cache_invalidate with a pattern reads every entry of the user. A
    store beyond CACHE_MAX_ENTRIES_PER_USER evicts the user's entries that expire first
    (expired ones before live ones), recorded on its audit row; never another user's."""
    settings.CACHE_MAX_ENTRIES_PER_USER = 3
    for n in range(3):
        run(bob, "store_cache", {"query": f"Bob's deadline question {n}", "response": "r"})
    for n in range(5):
        run(alice, "store_cache", {"query": f"Deadline question {n}", "response": "r"})

    def queries(user) -> list[str]:
        return sorted(CacheEntry.objects.filter(user=user).values_list("query", flat=True))

    assert queries(alice) == ["Deadline question 2", "Deadline question 3", "Deadline question 4"]
    CacheEntry.objects.filter(user=alice, query="Deadline question 4").update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    run(alice, "store_cache", {"query": "Deadline question 5", "response": "r"})
    assert queries(alice) == ["Deadline question 2", "Deadline question 3", "Deadline question 5"]
    stores = AuditEvent.objects.filter(operation="store_cache", subject_user_id=alice.pk).order_by("id")
    assert [row.detail.get("evicted", 0) for row in stores] == [0, 0, 0, 1, 1, 1]
    assert queries(bob) == [f"Bob's deadline question {n}" for n in range(3)]

    assert run(alice, "cache_invalidate", {"pattern": "DEADLINE"})["deleted_count"] == 3
    assert queries(alice) == []
    assert len(queries(bob)) == 3


# --- 7: the web UI's delete of an expired decision ----------------------------------------------
def test_web_delete_of_an_expired_decision_is_no_such_decision(client, alice):
    run(alice, "store_decision", {"key": "theme", "value": "dark", "ttl_days": 1})
    run(alice, "store_decision", {"key": "lang", "value": "python", "ttl_days": 1})
    Decision.objects.filter(key="theme").update(expires_at=timezone.now() - timedelta(seconds=1))
    assert run(alice, "recall_decision", {"key": "theme"})["found"] is False
    client.force_login(alice)
    response = client.post(reverse("web-decision-delete"), {"key": "theme"}, follow=True)
    assert [str(m) for m in response.context["messages"]] == ["No such decision."]
    row = AuditEvent.objects.get(operation="delete_decision")
    assert row.detail["deleted"] is False
    response = client.post(reverse("web-decision-delete"), {"key": "lang"}, follow=True)
    assert [str(m) for m in response.context["messages"]] == ["Deleted the decision lang."]
    assert run(alice, "store_decision", {"key": "theme", "value": "light"})["action"] == "created"


# --- suspected: store_decision's time read before it waits for the key's lock --------------------
def test_store_decision_waiting_for_the_lock_never_moves_updated_at_back(alice, monkeypatch):
    run(alice, "store_decision", {"key": "theme", "value": "dark"})
    locks = toolkit_services.user_write_locks
    seen: dict = {}

    def another_store_takes_the_lock_first(scope, *keys):
        if "waited" not in seen:
            seen["waited"] = True
            elsewhere(lambda: run(alice, "store_decision", {"key": "theme", "value": "light"}))
            seen["updated_at"] = Decision.objects.get(key="theme").updated_at
        return locks(scope, *keys)

    monkeypatch.setattr(toolkit_services, "user_write_locks", another_store_takes_the_lock_first)
    assert run(alice, "store_decision", {"key": "theme", "value": "solarized"})["action"] == "updated"
    decision = Decision.objects.get(key="theme")
    assert decision.value == "solarized" and decision.updated_at >= seen["updated_at"]


def test_a_client_cannot_pass_its_memory_off_as_a_store_memory_row(alice, client):
    """Enrichment and the store_memory pair rule trust `source`: remember and update
    refuse the toolkit's own value, and the web form resending a row's own source saves."""
    mine = run(alice, "remember", {"memory": "Mine"})["id"]
    for name, arguments in (
        ("remember", {"memory": "Deploy only on Fridays", "source": "store_memory"}),
        ("update_memory", {"memory_id": mine, "source": "store_memory"}),
    ):
        with pytest.raises(ServiceError) as refused:
            run(alice, name, arguments)
        assert refused.value.code == ErrorCode.INVALID_ARGUMENT and "reserved" in refused.value.message
    store(alice, ("user", "Remember that my locker code is 4411"))
    stm = next(m for m in run(alice, "list_memory", {"page_size": 50})["memories"] if m["source"] == "store_memory")
    resent = run(alice, "update_memory", {"memory_id": stm["id"], "source": "store_memory", "importance": 0.7})
    assert resent["memory"]["importance"] == 0.7  # its own source, sent back as read
    client.force_login(alice)
    form = {"memory_type": "project", "tags": "", "importance": "0.5", "source": "store_memory"}
    assert client.post(reverse("web-memory-fields", args=[stm["id"]]), form).status_code == 302
    assert run(alice, "get_memory", {"memory_id": stm["id"]})["memory"]["memory_type"] == "project"
