"""Issue 14: seed 003's twelve tools through the one dispatcher (in process), on real
Postgres and the real embedder: short/long-term memories, enrichment, ranking, the
semantic cache, decisions, web search, health, erasure and tenancy."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection
from django.test import override_settings
from django.utils import timezone

from audit.models import AuditEvent
from core.errors import ErrorCode, ServiceError
from memories.auth import Principal
from memories.models import ContentHash
from memories.operations import operation_execute
from memories.services import memory_recalls_fold, memory_remember, memory_search
from memories.toolkit.models import CacheEntry, Decision
from memories.toolkit.services import toolkit_candidates_enrich, toolkit_expired_purge
from tests.conftest import internal_call
from tests.fakes import FakeTavily

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]

HUMAN_LONG = "I always prefer dark mode interfaces in every editor I use"
AI_REPLY = "Noted, dark mode it is."


def run(user, name: str, arguments: dict | None = None) -> dict:
    principal = Principal(user=user, method="api_key", client_app="seed003-agent")
    return operation_execute(principal, name, arguments or {}, call=internal_call())


def fails(user, name: str, arguments: dict | None = None) -> ServiceError:
    with pytest.raises(ServiceError) as caught:
        run(user, name, arguments)
    return caught.value


def store(user, *messages: tuple[str, str], conversation_id: str = "c-1") -> dict:
    return run(
        user,
        "store_memory",
        {"conversation_id": conversation_id, "messages": [{"role": r, "content": c} for r, c in messages]},
    )


def shift_row(memory_id: str, *, hours: float) -> None:
    """Time travel for one engine row: its creation and expiry move `hours` into the past
    (as if the clock had moved forward)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT payload FROM memories WHERE id = %s", [memory_id])
        payload = cursor.fetchone()[0]
        payload = payload if isinstance(payload, dict) else __import__("json").loads(payload)
        for path in (["created_at"], ["updated_at"], ["attrs", "expires_at"]):
            node = payload
            for key in path[:-1]:
                node = node.get(key, {})
            if node.get(path[-1]):
                when = datetime.fromisoformat(node[path[-1]])
                when = when if when.tzinfo else when.replace(tzinfo=UTC)
                node[path[-1]] = (when - timedelta(hours=hours)).astimezone(UTC).isoformat(timespec="microseconds")
        cursor.execute(
            "UPDATE memories SET payload = %s::jsonb WHERE id = %s", [__import__("json").dumps(payload), memory_id]
        )


# --- store_memory / recall_memory ------------------------------------------------------------
def test_store_memory_makes_stm_per_message_and_ltm_candidates_for_long_human_messages(alice):
    stored = store(alice, ("human", HUMAN_LONG), ("ai", AI_REPLY), ("human", "ok thanks"))
    assert stored["count"] == 3 and len(stored["stm_ids"]) == 3
    health = run(alice, "memory_health")
    assert health["tier_stats"] == {"stm": 3, "ltm": 1}
    assert health["enrichment_stats"] == {"pending": 1, "completed": 0}
    assert health["total_memories"] == 4 and health["user_id"] == alice.username
    # The same text again makes no second long-term candidate (one dedupe rule).
    store(alice, ("human", HUMAN_LONG))
    assert run(alice, "memory_health")["tier_stats"] == {"stm": 4, "ltm": 1}
    row = AuditEvent.objects.filter(operation="store_memory").order_by("id").first()
    assert row.outcome == "ok" and row.detail["ltm_candidates"] == 1 and row.duration_ms is not None


def test_recall_shape_dedupes_stm_ltm_pairs_and_filters(alice):
    store(alice, ("human", HUMAN_LONG), ("ai", "The weather in Lisbon is sunny today"))
    found = run(alice, "recall_memory", {"query": "dark mode editor preference"})
    texts = [r["content"] for r in found["results"]]
    assert texts.count(HUMAN_LONG) == 1  # the STM/LTM pair counts once
    assert found["count"] == len(found["results"])
    top = found["results"][0]
    assert set(top) >= {"_id", "user_id", "tier", "content", "summary", "importance", "access_count", "created_at"}
    assert top["user_id"] == alice.username and isinstance(top["final_score"], float)
    only_stm = run(alice, "recall_memory", {"query": "dark mode", "tier": ["stm"]})["results"]
    assert only_stm and {r["tier"] for r in only_stm} == {"stm"}
    only_ltm = run(alice, "recall_memory", {"query": "dark mode", "tier": ["ltm"]})["results"]
    assert [r["content"] for r in only_ltm] == [HUMAN_LONG] and only_ltm[0]["enrichment_status"] == "pending"
    assert run(alice, "recall_memory", {"query": "dark mode", "limit": 1})["count"] == 1
    with override_settings(MAX_RESULTS_PER_QUERY=1):
        assert run(alice, "recall_memory", {"query": "dark mode", "limit": 10})["count"] == 1
    assert fails(alice, "recall_memory", {"query": "x", "user_id": "bob"}).code == ErrorCode.INVALID_ARGUMENT


def test_short_term_memories_vanish_after_the_ttl(alice):
    stored = store(alice, ("human", HUMAN_LONG))
    stm_id = stored["stm_ids"][0]
    found = run(alice, "recall_memory", {"query": "dark mode", "tier": ["stm"]})["results"]
    assert [r["_id"] for r in found] == [stm_id]
    shift_row(stm_id, hours=23.9)  # just inside the 24 h TTL
    assert run(alice, "recall_memory", {"query": "dark mode", "tier": ["stm"]})["count"] == 1
    shift_row(stm_id, hours=0.2)  # now past it
    assert run(alice, "recall_memory", {"query": "dark mode", "tier": ["stm"]})["count"] == 0
    assert run(alice, "hybrid_search", {"query": "dark mode", "tier": ["stm"]})["count"] == 0
    # The long-term candidate stays; health counts only the live memory.
    assert [r["tier"] for r in run(alice, "recall_memory", {"query": "dark mode"})["results"]] == ["ltm"]
    assert run(alice, "memory_health")["tier_stats"] == {"stm": 0, "ltm": 1}


@override_settings(STM_TTL_HOURS=2)
def test_stm_ttl_is_a_setting(alice):
    stm_id = store(alice, ("ai", AI_REPLY))["stm_ids"][0]
    shift_row(stm_id, hours=2.1)
    assert run(alice, "recall_memory", {"query": "dark mode"})["count"] == 0


def test_enrichment_without_llm_completes_candidates(alice, bob):
    store(alice, ("human", "Please never schedule meetings before 10am, it is important to me"))
    store(bob, ("human", "The project deadline for the Atlas release is March 31"))
    assert toolkit_candidates_enrich() == 2
    alice_ltm = run(alice, "recall_memory", {"query": "meetings", "tier": ["ltm"]})["results"][0]
    assert alice_ltm["enrichment_status"] == "completed"
    assert alice_ltm["summary"].startswith("Please never schedule meetings")
    assert alice_ltm["importance"] > 0.5 and alice_ltm["memory_type"] == "feedback"
    assert "meetings" in alice_ltm["tags"]
    bob_ltm = run(bob, "recall_memory", {"query": "deadline", "tier": ["ltm"]})["results"][0]
    assert bob_ltm["memory_type"] == "project" and bob_ltm["enrichment_status"] == "completed"
    assert run(alice, "memory_health")["enrichment_stats"] == {"pending": 0, "completed": 1}
    assert toolkit_candidates_enrich() == 0  # nothing pending is left
    rows = AuditEvent.objects.filter(operation="enrich_memory")
    assert rows.count() == 2 and {r.subject_user_id for r in rows} == {alice.pk, bob.pk}


def test_ranking_weights_change_the_order(alice):
    relevant = memory_remember(
        _scope(alice),
        memory="My favourite colour is teal",
        fields={"importance": 0.05},
        call=internal_call(),
    ).id
    important = memory_remember(
        _scope(alice), memory="I drive a blue car to work", fields={"importance": 1.0}, call=internal_call()
    ).id
    query = {"query": "what is my favourite colour", "limit": 2}
    with override_settings(RECALL_WEIGHT_RECENCY=0, RECALL_WEIGHT_IMPORTANCE=0, RECALL_WEIGHT_RELEVANCE=1):
        by_relevance = [r["_id"] for r in run(alice, "recall_memory", query)["results"]]
    with override_settings(RECALL_WEIGHT_RECENCY=0, RECALL_WEIGHT_IMPORTANCE=1, RECALL_WEIGHT_RELEVANCE=0.1):
        by_importance = [r["_id"] for r in run(alice, "recall_memory", query)["results"]]
    assert by_relevance == [relevant, important]
    assert by_importance == [important, relevant]
    # Recency: the same text relevance, the newer one wins when recency weighs.
    shift_row(relevant, hours=24 * 30)
    with override_settings(RECALL_WEIGHT_RECENCY=1, RECALL_WEIGHT_IMPORTANCE=0, RECALL_WEIGHT_RELEVANCE=0.1):
        assert run(alice, "recall_memory", query)["results"][0]["_id"] == important


def _scope(user):
    from core.scope import MemoryScope

    return MemoryScope.for_user(user)


def test_access_counts_are_folded_off_the_hot_path(alice):
    memory_id = memory_remember(_scope(alice), memory="My favourite colour is teal", call=internal_call()).id
    first = run(alice, "recall_memory", {"query": "favourite colour"})["results"][0]
    assert first["_id"] == memory_id and first["access_count"] == 0 and first["last_accessed"] is None
    run(alice, "recall_memory", {"query": "favourite colour"})
    assert memory_recalls_fold(settle_seconds=0) >= 2
    again = run(alice, "recall_memory", {"query": "favourite colour"})["results"][0]
    assert again["access_count"] == 2 and again["last_accessed"]


# --- delete_memory / hybrid_search -----------------------------------------------------------
def test_delete_memory_by_id_tags_and_dry_run(alice, bob):
    ids = store(alice, ("ai", AI_REPLY), ("ai", "Second reply here"))["stm_ids"]
    assert run(alice, "toolkit_delete_memory", {"memory_id": ids[0], "dry_run": True}) == {
        "deleted_count": 1,
        "dry_run": True,
    }
    assert run(alice, "toolkit_delete_memory", {"memory_id": ids[0]}) == {"deleted_count": 1, "dry_run": False}
    assert fails(alice, "toolkit_delete_memory", {"memory_id": ids[0]}).code == ErrorCode.NOT_FOUND
    assert fails(bob, "toolkit_delete_memory", {"memory_id": ids[1]}).code == ErrorCode.NOT_FOUND
    assert run(alice, "memory_health")["trash"] == 1
    remembered = memory_remember(_scope(alice), memory="Tagged fact", fields={"tags": ["x", "y"]}, call=internal_call())
    bulk = {"tags": ["x"], "time_range": {"start": "2000-01-01T00:00:00Z"}}
    assert fails(alice, "toolkit_delete_memory", bulk).code == ErrorCode.CONFIRMATION_REQUIRED
    assert run(alice, "toolkit_delete_memory", {**bulk, "dry_run": True}) == {"deleted_count": 1, "dry_run": True}
    assert run(alice, "toolkit_delete_memory", {**bulk, "confirm": True}) == {"deleted_count": 1, "dry_run": False}
    assert not ContentHash.objects.filter(memory_id=remembered.id).exists()


def test_hybrid_search_returns_rrf_scores_and_filters(alice, bob):
    store(alice, ("human", HUMAN_LONG), ("ai", "The weather in Lisbon is sunny today"))
    found = run(alice, "hybrid_search", {"query": "Lisbon weather"})
    assert found["count"] == len(found["results"]) >= 1
    top = found["results"][0]
    assert top["content"] == "The weather in Lisbon is sunny today" and top["tier"] == "stm"
    assert top["rrf_score"] == pytest.approx(2 / 61, abs=1e-5)  # first in both rankings of weight 1, k = 60
    text_only = run(alice, "hybrid_search", {"query": "Lisbon", "vector_weight": 0})["results"]
    assert [r["content"] for r in text_only] == ["The weather in Lisbon is sunny today"]
    assert run(alice, "hybrid_search", {"query": "Lisbon", "tier": ["ltm"], "vector_weight": 0})["count"] == 0
    assert run(bob, "hybrid_search", {"query": "Lisbon weather"})["count"] == 0
    bad = fails(alice, "hybrid_search", {"query": "x", "vector_weight": 0, "text_weight": 0})
    assert bad.code == ErrorCode.INVALID_ARGUMENT


# --- the semantic cache ----------------------------------------------------------------------
def test_cache_hit_miss_expiry_and_invalidation(alice, bob):
    cache_id = run(alice, "store_cache", {"query": "What is the project deadline?", "response": "March 31"})["cache_id"]
    hit = run(alice, "check_cache", {"query": "what is the project deadline"})
    assert hit["cache_hit"] is True and hit["response"] == "March 31" and hit["score"] >= 0.95
    assert hit["query"] == "What is the project deadline?"
    # A related but different question is below the default threshold, above a low one.
    assert run(alice, "check_cache", {"query": "When is the project kickoff meeting?"}) == {"cache_hit": False}
    low = run(alice, "check_cache", {"query": "When is the project kickoff meeting?", "similarity_threshold": 0.3})
    assert low["cache_hit"] is True
    assert run(bob, "check_cache", {"query": "What is the project deadline?"}) == {"cache_hit": False}
    # Expiry: hidden at once, deleted by the purge.
    CacheEntry.objects.filter(id=cache_id).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert run(alice, "check_cache", {"query": "What is the project deadline?"}) == {"cache_hit": False}
    assert toolkit_expired_purge()["cache"] == 1
    # Invalidation by pattern and all.
    for query in ("deadline of Atlas", "deadline of Zeus", "lunch plans"):
        run(alice, "store_cache", {"query": query, "response": "r"})
    run(bob, "store_cache", {"query": "deadline of Bob", "response": "r"})
    assert run(alice, "cache_invalidate", {"pattern": "DEADLINE"}) == {"user_id": alice.username, "deleted_count": 2}
    assert fails(alice, "cache_invalidate", {}).code == ErrorCode.INVALID_ARGUMENT
    assert run(alice, "cache_invalidate", {"invalidate_all": True})["deleted_count"] == 1
    assert CacheEntry.objects.filter(user=bob).count() == 1


@override_settings(CACHE_TTL_SECONDS=1)
def test_cache_ttl_is_a_setting(alice):
    run(alice, "store_cache", {"query": "q", "response": "r"})
    entry = CacheEntry.objects.get()
    assert timedelta(0) < entry.expires_at - entry.created_at <= timedelta(seconds=2)


# --- decisions -------------------------------------------------------------------------------
def test_decisions_upsert_ttl_and_tenancy(alice, bob):
    assert run(alice, "store_decision", {"key": "preferred_language", "value": "Python"}) == {
        "key": "preferred_language",
        "action": "created",
        "user_id": alice.username,
    }
    assert run(alice, "store_decision", {"key": "preferred_language", "value": "Rust"})["action"] == "updated"
    found = run(alice, "recall_decision", {"key": "preferred_language"})
    assert found["found"] is True and found["decision"]["value"] == "Rust"
    assert set(found["decision"]) >= {"key", "value", "user_id", "created_at", "updated_at"}
    assert found["decision"]["created_at"] <= found["decision"]["updated_at"]
    assert run(bob, "recall_decision", {"key": "preferred_language"}) == {"key": "preferred_language", "found": False}
    assert run(bob, "store_decision", {"key": "preferred_language", "value": "Go"})["action"] == "created"
    assert run(alice, "recall_decision", {"key": "preferred_language"})["decision"]["value"] == "Rust"
    run(alice, "store_decision", {"key": "tmp", "value": "v", "ttl_days": 1})
    Decision.objects.filter(key="tmp").update(expires_at=timezone.now() - timedelta(seconds=1))
    assert run(alice, "recall_decision", {"key": "tmp"}) == {"key": "tmp", "found": False}
    assert run(alice, "store_decision", {"key": "tmp", "value": "again"})["action"] == "created"
    assert fails(alice, "store_decision", {"key": "k", "value": "v", "ttl_days": 0}).code == ErrorCode.INVALID_ARGUMENT


# --- search_web ------------------------------------------------------------------------------
def test_search_web_without_a_key_is_the_seed_error(alice):
    error = fails(alice, "search_web", {"query": "django"})
    assert error.code == ErrorCode.WEB_SEARCH_UNAVAILABLE
    assert error.message == "Web search service unavailable: Tavily API key not configured"
    assert AuditEvent.objects.get(operation="search_web").error_code == "web_search_unavailable"


def test_search_web_through_a_fake_tavily(alice):
    fake = FakeTavily().start()
    try:
        with override_settings(TAVILY_API_KEY="tvly-secret", TAVILY_ENDPOINT=f"{fake.url}/search"):
            found = run(alice, "search_web", {"query": "django 6 release"})
        assert found["query"] == "django 6 release"
        assert found["results"][0] == {
            "title": "About django 6 release",
            "url": "https://example.com/a",
            "content": "Snippet A",
        }
        assert fake.requests[0]["headers"]["authorization"] == "Bearer tvly-secret"
        assert run(alice, "memory_health")["total_memories"] == 0  # never stored
    finally:
        fake.stop()
    broken = FakeTavily(status=500).start()
    try:
        with override_settings(TAVILY_API_KEY="tvly-secret", TAVILY_ENDPOINT=f"{broken.url}/search"):
            error = fails(alice, "search_web", {"query": "x"})
        assert error.code == ErrorCode.WEB_SEARCH_UNAVAILABLE and "tvly-secret" not in error.message
    finally:
        broken.stop()
    odd = FakeTavily(answer={"results": {"a": 1}}).start()  # an object where the list belongs: was a 500
    try:
        with override_settings(TAVILY_API_KEY="tvly-secret", TAVILY_ENDPOINT=f"{odd.url}/search"):
            error = fails(alice, "search_web", {"query": "x"})
        assert error.code == ErrorCode.WEB_SEARCH_UNAVAILABLE
    finally:
        odd.stop()


# --- wipe_user_data --------------------------------------------------------------------------
def test_wipe_user_data_needs_confirm_and_erases_only_the_caller(alice, bob):
    store(alice, ("human", HUMAN_LONG))
    run(alice, "store_decision", {"key": "k", "value": "v"})
    trashed = store(alice, ("ai", AI_REPLY))["stm_ids"][0]
    run(alice, "toolkit_delete_memory", {"memory_id": trashed})
    run(alice, "store_cache", {"query": "q", "response": "r"})  # after the delete, which drops cached answers
    store(bob, ("human", "Bob likes his coffee black and strong every morning"))
    run(bob, "store_cache", {"query": "q", "response": "r"})
    run(bob, "store_decision", {"key": "k", "value": "v"})
    error = fails(alice, "wipe_user_data", {})
    assert error.code == ErrorCode.CONFIRMATION_REQUIRED
    assert error.message == "wipe_user_data requires confirm=true. This will permanently delete ALL user data."
    from memories.engine.embedders import _vector_caches

    assert any(cache.vectors for cache in _vector_caches)  # alice's texts' vectors, among others
    wiped = run(alice, "wipe_user_data", {"confirm": True})
    assert not any(cache.vectors for cache in _vector_caches)  # this process keeps none of them
    assert wiped["user_id"] == alice.username
    assert wiped["memories_deleted"] == 3 and wiped["cache_deleted"] == 1 and wiped["decisions_deleted"] == 1
    health = run(alice, "memory_health")
    assert health["total_memories"] == 0 and health["trash"] == 0 and health["cache_entries"] == 0
    assert not ContentHash.objects.filter(engine_user_id=_scope(alice).engine_user_id).exists()
    bob_health = run(bob, "memory_health")
    assert bob_health["total_memories"] == 2 and bob_health["cache_entries"] == 1 and bob_health["decisions"] == 1
    # The audit trail keeps its rows: actor, time, operation, ids.
    rows = AuditEvent.objects.filter(subject_user_id=alice.pk)
    assert rows.filter(operation="store_memory").count() == 2
    assert rows.get(operation="wipe_user_data", outcome="ok").detail["memories"] == 3


# --- tenancy on all twelve -------------------------------------------------------------------
def test_tenancy_on_all_twelve(alice, bob):
    alice_ids = store(alice, ("human", HUMAN_LONG))["stm_ids"]
    run(alice, "store_cache", {"query": "secret question", "response": "alice's answer"})
    run(alice, "store_decision", {"key": "theme", "value": "dark"})
    toolkit_candidates_enrich()
    # bob sees none of it, through any tool, and cannot touch it.
    assert run(bob, "recall_memory", {"query": "dark mode"})["count"] == 0
    assert run(bob, "hybrid_search", {"query": "dark mode"})["count"] == 0
    assert run(bob, "check_cache", {"query": "secret question", "similarity_threshold": 0.0}) == {"cache_hit": False}
    assert run(bob, "recall_decision", {"key": "theme"})["found"] is False
    assert run(bob, "memory_health")["total_memories"] == 0
    assert fails(bob, "toolkit_delete_memory", {"memory_id": alice_ids[0]}).code == ErrorCode.NOT_FOUND
    assert fails(bob, "toolkit_delete_memory", {"memory_id": alice_ids[0], "dry_run": True}).code == ErrorCode.NOT_FOUND
    assert run(bob, "toolkit_delete_memory", {"tags": ["dark"], "confirm": True})["deleted_count"] == 0
    assert run(bob, "cache_invalidate", {"invalidate_all": True})["deleted_count"] == 0
    assert run(bob, "store_decision", {"key": "theme", "value": "light"})["action"] == "created"
    store(bob, ("ai", "bob's own"))
    assert run(bob, "wipe_user_data", {"confirm": True})["memories_deleted"] == 1
    fails(bob, "search_web", {"query": "x"})
    for name in ("store_memory", "recall_memory", "hybrid_search", "check_cache", "store_cache", "wipe_user_data"):
        assert fails(bob, name, {"user_id": alice.username}).code == ErrorCode.INVALID_ARGUMENT, name
    # alice's data is intact.
    health = run(alice, "memory_health")
    assert health["total_memories"] == 2 and health["cache_entries"] == 1 and health["decisions"] == 1
    assert run(alice, "recall_decision", {"key": "theme"})["decision"]["value"] == "dark"
    assert run(alice, "check_cache", {"query": "secret question"})["response"] == "alice's answer"


@pytest.mark.slow
def test_enrichment_runs_in_a_real_worker_after_commit(celery_worker_process, alice):
    from memsite.celery import app
    from tests.conftest import wait_for

    app.control.purge()  # earlier tests' queued deliveries would delay ours
    store(alice, ("human", "Please never schedule meetings before 10am, it is important to me"))

    def completed() -> bool:
        return run(alice, "memory_health")["enrichment_stats"] == {"pending": 0, "completed": 1}

    wait_for(completed, timeout=90, what=lambda: f"the worker to enrich; log:\n{celery_worker_process.log()}")
    ltm = run(alice, "recall_memory", {"query": "meetings", "tier": ["ltm"]})["results"][0]
    assert ltm["memory_type"] == "feedback" and ltm["summary"]


# --- web UI and admin ------------------------------------------------------------------------
def test_web_decisions_are_visible_and_deletable_only_by_their_owner(client, alice, bob):
    run(alice, "store_decision", {"key": "theme", "value": "solarized-dark"})
    run(bob, "store_decision", {"key": "theme", "value": "bob-light"})
    client.force_login(alice)
    page = client.get("/decisions/")
    assert b"solarized-dark" in page.content and b"bob-light" not in page.content
    response = client.post("/decisions/delete/", {"key": "theme"}, follow=True)
    assert b"Deleted the decision theme" in response.content
    assert run(alice, "recall_decision", {"key": "theme"})["found"] is False
    assert run(bob, "recall_decision", {"key": "theme"})["decision"]["value"] == "bob-light"
    assert b"No such decision" in client.post("/decisions/delete/", {"key": "theme"}, follow=True).content
    assert AuditEvent.objects.filter(operation="delete_decision", subject_user_id=alice.pk, channel="ui").count() == 2


def test_web_erase_all_needs_the_typed_phrase(client, alice, bob):
    store(alice, ("human", HUMAN_LONG))
    store(bob, ("human", "Bob likes his coffee black and strong every morning"))
    client.force_login(alice)
    response = client.post("/erase/", {"confirmation": "yes"}, follow=True)
    assert b"to confirm" in response.content and run(alice, "memory_health")["total_memories"] == 2
    response = client.post("/erase/", {"confirmation": "Erase all my data"}, follow=True)
    assert b"Erased 2 memories" in response.content
    assert run(alice, "memory_health")["total_memories"] == 0 and run(bob, "memory_health")["total_memories"] == 2
    assert AuditEvent.objects.get(operation="wipe_user_data", outcome="ok").channel == "ui"


def test_admin_erasure_action_is_audited_as_staff(client, django_user_model, alice, bob):
    store(alice, ("human", HUMAN_LONG))
    run(alice, "store_decision", {"key": "k", "value": "v"})
    store(bob, ("ai", AI_REPLY))
    staff = django_user_model.objects.create_superuser("sam", "sam@example.com", "sam-password-1")
    client.force_login(staff)
    listing = client.get("/admin/toolkit/erasuresubject/")
    assert listing.status_code == 200 and b"alice" in listing.content
    response = client.post("/admin/toolkit/erasuresubject/", {"action": "erase", "_selected_action": [alice.pk]})
    assert response.status_code == 302
    assert run(alice, "memory_health")["total_memories"] == 0
    assert run(bob, "memory_health")["total_memories"] == 1
    row = AuditEvent.objects.get(operation="admin_wipe_user_data")
    assert row.staff_username == "sam" and row.subject_user_id == alice.pk and row.channel == "admin"
    assert row.detail["memories"] == 2 and row.detail["decisions"] == 1


def test_admin_erasure_of_several_users_names_who_was_erased_and_who_was_not(
    client, django_user_model, alice, bob, monkeypatch
):
    from core.errors import ErrorCode, ServiceError
    from memories.toolkit import admin as toolkit_admin

    store(alice, ("human", HUMAN_LONG))
    store(bob, ("ai", AI_REPLY))
    alices = run(alice, "memory_health")["total_memories"]
    wipe = toolkit_admin.toolkit_user_data_wipe

    def failing_for_alice(scope, **kwargs):
        if scope.user_pk == alice.pk:
            raise ServiceError(ErrorCode.BACKEND_UNAVAILABLE, "The memory service failed; retry later.")
        return wipe(scope, **kwargs)

    monkeypatch.setattr(toolkit_admin, "toolkit_user_data_wipe", failing_for_alice)
    staff = django_user_model.objects.create_superuser("sam", "sam@example.com", "sam-password-1")
    client.force_login(staff)
    response = client.post(
        "/admin/toolkit/erasuresubject/", {"action": "erase", "_selected_action": [alice.pk, bob.pk]}, follow=True
    )
    assert response.status_code == 200
    shown = [str(m) for m in response.context["messages"]]
    assert any("Erased all data of 1 user(s): bob." in m for m in shown), shown
    assert any("Could not erase 1 user(s): alice." in m for m in shown), shown
    assert run(bob, "memory_health")["total_memories"] == 0
    assert run(alice, "memory_health")["total_memories"] == alices > 0
    rows = AuditEvent.objects.filter(operation="admin_wipe_user_data")
    assert sorted((r.subject_user_id, r.outcome) for r in rows) == sorted([(alice.pk, "error"), (bob.pk, "ok")])


# --- erasure: crypto-shredding (acceptance 4) ------------------------------------------------
def _database_text() -> str:
    """Every text and JSON value of every table in the database, as one string."""
    chunks = []
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT table_name, column_name FROM information_schema.columns WHERE table_schema = 'public' "
            "AND data_type IN ('text', 'character varying', 'jsonb', 'json', 'bytea')"
        )
        columns = cursor.fetchall()
        for table, column in columns:
            cursor.execute(f'SELECT "{column}"::text FROM "{table}" WHERE "{column}" IS NOT NULL')  # noqa: S608
            chunks += [row[0] for row in cursor.fetchall()]
    return "\n".join(chunks)


def test_wipe_crypto_shreds_audit_content_and_erases_history_sessions_and_chat_turns(alice, bob, settings, tmp_path):
    """After wipe_user_data nothing of alice's content can be read from the database, the
    admin, or an audit export made before the wipe; her audit rows stay (actor, time,
    operation, ids); bob's content still opens."""
    import gzip

    from django.core.files.storage import FileSystemStorage
    from django.test import Client

    from audit.crypto import ContentUnreadable, content_open
    from audit.export import audit_export
    from memories.models import SessionArchive, SessionEvent, SessionState, TurnGuard
    from memories.sessions import session_events_append
    from memories.turns import services as turns
    from proxy.models import ProxyTurn

    secret, other = "Alice's locker code is zebra-4471", "Bob's locker code is yak-9012"
    alice_scope, bob_scope = _scope(alice), _scope(bob)
    memory_id = memory_remember(alice_scope, memory=secret, call=internal_call()).id
    run(alice, "update_memory", {"memory_id": memory_id, "memory": secret + " (new zebra)"})
    store(alice, ("human", f"Please remember this: {secret}, in the gym."))
    session_events_append(alice_scope, session_id="s1", items=[{"type": "message", "role": "user", "content": secret}])
    turns.turn_after(
        alice_scope,
        project="",
        session_id="s2",
        turn_id="t1",
        input_items=[{"type": "message", "role": "user", "content": f"I use the zebra locker. {secret}."}],
        output_items=[{"type": "message", "role": "assistant", "content": "Noted."}],
        call=internal_call(),
    )
    ProxyTurn.objects.create(
        request_id="r1", user=alice, tenant="default", session_id="s", messages=[{"role": "user", "content": secret}]
    )
    memory_remember(bob_scope, memory=other, call=internal_call())
    # What alice asks is hers too: queries, patterns, filter values and decision keys of
    # every read and cache call land (sealed) in the audit detail.
    memory_search(alice_scope, query="zebra-q1 locker?", top_k=3, filters={"where": "zebra-f1"}, call=internal_call())
    run(alice, "recall_memory", {"query": "zebra-q2"})
    run(alice, "hybrid_search", {"query": "zebra-q3"})
    run(alice, "store_cache", {"query": "zebra-q4", "response": "zebra-r4"})
    run(alice, "check_cache", {"query": "zebra-q5"})
    run(alice, "cache_invalidate", {"pattern": "zebra-p6"})
    run(alice, "store_decision", {"key": "zebra-k7", "value": "zebra-v7"})
    run(alice, "recall_decision", {"key": "zebra-k7"})
    assert "zebra-4471" in _database_text()  # the scan below is real
    audit_text = json.dumps(list(AuditEvent.objects.values("detail", "before", "after")))
    # Each secret and query holds a "-", which base64 ciphertext never does, so these
    # cannot match by chance inside a sealed envelope.
    assert "zebra-" not in audit_text and "yak-" not in audit_text  # sealed from the start
    searched = AuditEvent.objects.get(subject_user_id=alice.pk, operation="search_memory")
    assert content_open(searched.detail["content"]) == {"query": "zebra-q1 locker?", "filters": {"where": "zebra-f1"}}
    assert searched.detail["top_k"] == 3 and searched.detail["results"] >= 0  # the rest stays readable

    settings.AUDIT_EXPORT_LAG_S = 0
    storage = FileSystemStorage(location=str(tmp_path))
    audit_export(storage=storage)
    exported = [
        json.loads(line)
        for path in tmp_path.rglob("*.gz")
        for line in gzip.decompress(path.read_bytes()).decode().splitlines()
    ]
    assert "zebra-4471" not in json.dumps(exported) and "yak-9012" not in json.dumps(exported)
    alice_sealed = [r for r in exported if r["subject_user_id"] == alice.pk and r["after"] is not None]
    assert alice_sealed and content_open(alice_sealed[0]["after"])  # opens before the wipe

    wiped = run(alice, "wipe_user_data", {"confirm": True})
    assert wiped["audit_deleted"] >= 3

    assert "zebra-" not in _database_text()
    with pytest.raises(ContentUnreadable):
        content_open(alice_sealed[0]["after"])
    for model in (SessionEvent, SessionState, SessionArchive, TurnGuard):
        assert not model.objects.filter(engine_user_id=alice_scope.engine_user_id).exists(), model
    assert not ProxyTurn.objects.filter(user=alice).exists()
    # The audit rows stay, with actor, time, operation and ids; their content is gone.
    rows = AuditEvent.objects.filter(subject_user_id=alice.pk)
    kept = rows.get(operation="update_memory")
    assert kept.actor_username == alice.username and kept.occurred_at and kept.memory_ids == [memory_id]
    # The admin shows "erased", and bob's content still opens.
    staff = type(alice).objects.create_superuser("auditor", "auditor@example.com", "pw-auditor-1")
    browser = Client()
    browser.force_login(staff)
    page = browser.get(f"/admin/audit/auditevent/{kept.pk}/change/")
    assert page.status_code == 200 and b"erased" in page.content and b"zebra-" not in page.content
    searched_page = browser.get(f"/admin/audit/auditevent/{searched.pk}/change/").content
    assert b"erased" in searched_page and b"zebra-" not in searched_page and b"top_k" in searched_page
    bob_row = AuditEvent.objects.get(subject_user_id=bob.pk, operation="remember")
    assert content_open(bob_row.after)["memory"] == other
    assert b"yak-9012" in browser.get(f"/admin/audit/auditevent/{bob_row.pk}/change/").content


def test_older_plaintext_audit_snapshots_are_sealed_by_the_migration(alice):
    """Audit rows written before crypto-shredding hold plain snapshots; migrating seals
    them with their subject's key, so erasing the subject makes them unreadable too."""
    from django.db.migrations.executor import MigrationExecutor

    from audit.crypto import ContentUnreadable, content_open, is_sealed

    executor = MigrationExecutor(connection)
    executor.migrate([("audit", "0009_subject_keys")])
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO audit_auditevent (occurred_at, request_id, channel, operation, outcome, error_code,"
            " actor_username, actor_auth, actor_client_app, actor_role, staff_username, tenant, subject_user_id,"
            " memory_ids, after, detail, user_agent, turn_id, turn_event) VALUES (now(), 'old-1', 'mcp', 'remember',"
            " 'ok', '', %s, 'api_key', '', 'user', '', 'default', %s, '[]', %s, %s, '', '', '') RETURNING id",
            [
                alice.username,
                alice.pk,
                '{"memory": "an old plaintext snapshot: walrus-77"}',
                '{"query": "old walrus-88 query", "top_k": 5}',
            ],
        )
        row_id = cursor.fetchone()[0]
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(executor.loader.graph.leaf_nodes())

    row = AuditEvent.objects.get(pk=row_id)
    assert is_sealed(row.after) and content_open(row.after) == {"memory": "an old plaintext snapshot: walrus-77"}
    assert row.detail["top_k"] == 5 and content_open(row.detail["content"]) == {"query": "old walrus-88 query"}
    assert "walrus" not in str(row.detail)
    run(alice, "wipe_user_data", {"confirm": True})
    with pytest.raises(ContentUnreadable):
        content_open(AuditEvent.objects.get(pk=row_id).after)
    with pytest.raises(ContentUnreadable):
        content_open(AuditEvent.objects.get(pk=row_id).detail["content"])
    # The append-only trigger is back in force.
    with pytest.raises(Exception, match="append-only"), connection.cursor() as cursor:
        cursor.execute("UPDATE audit_auditevent SET detail = '{}' WHERE id = %s", [row_id])
