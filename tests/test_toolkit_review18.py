"""Review 18 of seed 003's toolkit: a broker down after store_memory commits, the semantic
cache across an embedder switch, `user_id` when a service account acts for a subject,
the conversation id in erased audit rows, the `ltm` tier of memories made elsewhere,
cache_invalidate's count, and an LLM's malformed tags."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from datetime import timedelta

import pytest
from django.utils import timezone
from kombu.exceptions import OperationalError

from audit.crypto import ContentUnreadable, content_open
from audit.models import AuditEvent
from billing.models import UsageEvent
from core.choices import Role
from core.scope import MemoryScope
from memories.auth import Principal, principal_of_api_key
from memories.operations import operation_execute
from memories.reembed import embedder_reembed, embedder_target
from memories.services import api_key_issue, memory_remember
from memories.tenancy import tenant_create, tenant_user_create
from memories.toolkit import enrichment, tasks
from memories.toolkit.models import CacheEntry
from memories.toolkit.services import toolkit_candidates_enrich
from tests.conftest import internal_call

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]

DARK_MODE = "I always prefer dark mode interfaces in every editor I use"
# Not test_reembed's 64: each process keeps one embedder per spec, and that one would
# still point at the other test's (stopped) fake server.
NEW_DIMS = 48


@pytest.fixture(autouse=True)
def unlimited(settings):
    settings.RATE_LIMITS = {op: (0, 60) for op in settings.RATE_LIMITS}


def run(user, name: str, arguments: dict | None = None, *, principal: Principal | None = None, subject: str = ""):
    principal = principal or Principal(user=user, method="api_key", client_app="seed003-agent")
    return operation_execute(principal, name, arguments or {}, call=replace(internal_call(), subject=subject))


def store(user, *messages: tuple[str, str], conversation_id: str = "c-1") -> dict:
    arguments = {"conversation_id": conversation_id, "messages": [{"role": r, "content": c} for r, c in messages]}
    return run(user, "store_memory", arguments)


# --- F1: a broker down at commit does not fail a stored, billed call --------------------------
def test_store_memory_succeeds_when_the_enrichment_task_cannot_be_queued(alice, monkeypatch, caplog):
    def broker_down(*args, **kwargs):
        raise OperationalError("cannot reach amqp://guest:hunter2@broker:5672//")

    monkeypatch.setattr(tasks.enrich_memories, "delay", broker_down)
    with caplog.at_level(logging.WARNING):
        stored = store(alice, ("human", DARK_MODE))
    assert stored["count"] == 1
    rows = AuditEvent.objects.filter(operation="store_memory")
    assert [row.outcome for row in rows] == ["ok"]
    assert UsageEvent.objects.filter(operation="store_memory").count() == 1
    assert "OperationalError" in caplog.text and "hunter2" not in caplog.text
    # The candidate stayed pending; the sweep enriches it.
    assert run(alice, "memory_health")["enrichment_stats"]["pending"] == 1
    assert toolkit_candidates_enrich() == 1
    assert run(alice, "memory_health")["enrichment_stats"] == {"pending": 0, "completed": 1}


# --- F2: the cache across an embedder switch ----------------------------------------------------
def test_check_cache_after_an_embedder_switch_is_a_miss_then_hits_again(alice, fake_gemini):  # noqa: ARG001
    query = "What is the project deadline?"
    run(alice, "store_cache", {"query": query, "response": "March 31"})
    assert CacheEntry.objects.get().embedder == "local:384"
    assert run(alice, "check_cache", {"query": query})["cache_hit"] is True

    embedder_reembed(target=embedder_target(name="gemini", dims=NEW_DIMS))
    from memories.engine.embedders import embedder_spec_refresh

    embedder_spec_refresh()  # this process notices the switch at once
    assert run(alice, "check_cache", {"query": query}) == {"cache_hit": False}  # no dimension error
    assert AuditEvent.objects.filter(operation="check_cache").latest("id").outcome == "ok"

    run(alice, "store_cache", {"query": query, "response": "March 31 (again)"})
    hit = run(alice, "check_cache", {"query": query})
    assert hit["cache_hit"] is True and hit["response"] == "March 31 (again)"
    assert sorted(CacheEntry.objects.values_list("embedder", flat=True)) == [f"gemini:{NEW_DIMS}", "local:384"]


def test_cache_rows_of_an_unknown_embedder_are_never_hits(alice):
    query = "Which editor theme do I like?"
    run(alice, "store_cache", {"query": query, "response": "dark"})
    CacheEntry.objects.update(embedder="")  # as the migration leaves rows made before it
    assert run(alice, "check_cache", {"query": query}) == {"cache_hit": False}


# --- F3: user_id names the subject a service account acts for ---------------------------------
def test_user_id_in_results_is_the_subject_not_the_service_account():
    tenant_create(name="acme", display_name="Acme Corp")
    ann = tenant_user_create(tenant="acme", username="ann")
    bot = tenant_user_create(tenant="acme", username="support-bot")
    key = api_key_issue(user=bot, name="support-bot", role=Role.TENANT_ADMIN)[0]
    principal = principal_of_api_key(key)

    def as_ann(name: str, arguments: dict | None = None) -> dict:
        return run(None, name, arguments, principal=principal, subject="acme/ann")

    as_ann("store_memory", {"conversation_id": "c-1", "messages": [{"role": "human", "content": DARK_MODE}]})
    assert as_ann("memory_health")["user_id"] == "ann"
    assert {r["user_id"] for r in as_ann("recall_memory", {"query": "dark mode"})["results"]} == {"ann"}
    assert {r["user_id"] for r in as_ann("hybrid_search", {"query": "dark mode"})["results"]} == {"ann"}
    assert as_ann("store_decision", {"key": "theme", "value": "dark"})["user_id"] == "ann"
    assert as_ann("recall_decision", {"key": "theme"})["decision"]["user_id"] == "ann"
    assert as_ann("cache_invalidate", {"invalidate_all": True})["user_id"] == "ann"
    # The bot's own calls are labelled with its own name.
    assert run(None, "memory_health", principal=principal)["user_id"] == "support-bot"
    wiped = as_ann("wipe_user_data", {"confirm": True})
    assert wiped["user_id"] == "ann" and wiped["memories_deleted"] == 2
    assert run(ann, "memory_health")["user_id"] == "ann"


# --- F4: the conversation id is shredded with the rest of the audit content --------------------
def test_wipe_makes_the_conversation_id_in_audit_details_unreadable(alice):
    conversation = "call-with-dr-jane-doe-re-diagnosis"
    store(alice, ("human", DARK_MODE), conversation_id=conversation)
    row = AuditEvent.objects.get(operation="store_memory")
    assert conversation not in json.dumps(row.detail)  # sealed, not plain
    assert content_open(row.detail["content"])["conversation_id"] == conversation
    assert row.detail["stm"] == 1 and row.detail["ltm_candidates"] == 1  # counts stay plain
    run(alice, "wipe_user_data", {"confirm": True})
    row = AuditEvent.objects.get(operation="store_memory")
    assert conversation not in json.dumps(row.detail)
    with pytest.raises(ContentUnreadable):
        content_open(row.detail["content"])


# --- F5: a memory without a tier is long-term, for the filter and for health ------------------
def test_memories_made_elsewhere_are_long_term_for_the_tier_filter_and_health(alice):
    scope = MemoryScope.for_user(alice)
    text = "Alice's favourite editor colour scheme is solarized"
    remembered = memory_remember(scope, memory=text, call=internal_call())
    # Many short-term rows on the same topic, more than one search round would look at.
    for n in range(14):
        store(alice, ("ai", f"Editor colour scheme note {n}: solarized editor colour scheme"))

    found = run(alice, "recall_memory", {"query": "editor colour scheme solarized", "tier": ["ltm"], "limit": 1})
    assert [(r["_id"], r["tier"]) for r in found["results"]] == [(remembered.id, "ltm")]
    hybrid = run(alice, "hybrid_search", {"query": "editor colour scheme solarized", "tier": ["ltm"], "limit": 1})
    assert [(r["_id"], r["tier"]) for r in hybrid["results"]] == [(remembered.id, "ltm")]
    only_stm = run(alice, "recall_memory", {"query": "solarized", "tier": ["stm"], "limit": 50})["results"]
    assert len(only_stm) == 14 and {r["tier"] for r in only_stm} == {"stm"}
    both = run(alice, "recall_memory", {"query": "solarized", "limit": 50})["results"]
    assert remembered.id in {r["_id"] for r in both}
    assert run(alice, "memory_health")["tier_stats"] == {"stm": 14, "ltm": 1}


# --- F6: cache_invalidate counts only live entries ---------------------------------------------
def test_cache_invalidate_counts_only_live_entries(alice):
    run(alice, "store_cache", {"query": "weather in Lisbon", "response": "sunny"})
    run(alice, "store_cache", {"query": "weather in Porto", "response": "rain"})
    CacheEntry.objects.filter(query__contains="Porto").update(expires_at=timezone.now() - timedelta(seconds=1))
    assert run(alice, "cache_invalidate", {"pattern": "weather"})["deleted_count"] == 1
    assert not CacheEntry.objects.exists()  # the expired one went too, uncounted
    assert AuditEvent.objects.get(operation="cache_invalidate").detail["deleted"] == 1


# --- F7: an LLM's malformed tags ----------------------------------------------------------------
def test_llm_tags_that_are_not_a_list_fall_back_to_the_heuristic_ones(alice, llm):
    llm.queue_answer({"summary": "Prefers dark mode", "importance": 0.8, "tags": "dark mode", "memory_type": "user"})
    store(alice, ("human", DARK_MODE))
    assert toolkit_candidates_enrich() == 1
    (ltm,) = run(alice, "recall_memory", {"query": "dark mode", "tier": ["ltm"]})["results"]
    assert ltm["summary"] == "Prefers dark mode"  # the rest of the answer is used
    assert ltm["tags"] == enrichment.enrich_heuristic(DARK_MODE).tags
    assert "d" not in ltm["tags"]


def test_llm_tags_keep_non_empty_strings_once(llm):
    tags = ["UI", "ui", "", "  ", 5, None, " Dark Mode "]
    llm.queue_answer({"summary": "s", "importance": 0.5, "tags": tags, "memory_type": "user"})
    assert enrichment.enrich_text(DARK_MODE).tags == ["ui", "dark mode"]


def test_heuristic_tags_are_never_longer_than_a_tag_may_be():
    """A long run of letters (a kebab-case slug, a hash) is no tag: every stored tag must
    import again (memories.schemas.TAG_MAX_CHARS), or the user's export is refused whole."""
    slug = "a-" * 40 + "slug"
    tags = enrichment.enrich_heuristic(f"Deploying {slug} with {slug} and kubernetes tonight").tags
    assert slug not in tags and "kubernetes" in tags
    assert all(len(tag) <= 64 for tag in tags)
