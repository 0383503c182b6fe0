"""The house rules as tests: selectors write nothing, the query count of the hot
operations is pinned, and every MCP tool declares an outputSchema its results fit."""

import jsonschema
import pytest
from django.db import InternalError, connection, transaction

from core.choices import Channel
from core.scope import CallContext
from memories import selectors
from memories.auth import Principal
from memories.interfaces.mcp.registry import TOOLSETS
from memories.operations import OPERATIONS, operation_execute
from memories.services import api_key_issue, memory_remember
from tests.conftest import internal_call

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]


def _read_only():
    """A transaction in which any write fails (Postgres: SET TRANSACTION READ ONLY)."""
    atomic = transaction.atomic()
    atomic.__enter__()
    with connection.cursor() as cursor:
        cursor.execute("SET TRANSACTION READ ONLY")
    return atomic


def test_every_selector_runs_in_a_read_only_transaction(alice_scope, bob_scope):
    memory_id = memory_remember(alice_scope, memory="Alice grows tomatoes", call=internal_call()).id
    memory_remember(bob_scope, memory="Bob sails", call=internal_call())
    calls = {
        "memory_get_owned": lambda: selectors.memory_get_owned(alice_scope, memory_id=memory_id),
        "memory_versions": lambda: selectors.memory_versions(alice_scope, memory_id=memory_id),
        "memory_histories": lambda: selectors.memory_histories(alice_scope, memory_ids=[memory_id]),
        "memory_client_apps": lambda: selectors.memory_client_apps(alice_scope),
        "memory_count": lambda: selectors.memory_count(alice_scope),
        "memory_ids_owned": lambda: selectors.memory_ids_owned(alice_scope),
        "usage_by_day": lambda: selectors.usage_by_day(alice_scope, days=30),
        "memory_trash_list": lambda: selectors.memory_trash_list(alice_scope),
        "memory_trash_page": lambda: selectors.memory_trash_page(alice_scope),
        "memory_trash_count": lambda: selectors.memory_trash_count(alice_scope),
        "memory_activity": lambda: selectors.memory_activity(alice_scope),
        "memory_activity_count": lambda: selectors.memory_activity_count(alice_scope, by_services=True),
    }
    public = {
        name
        for name, value in vars(selectors).items()
        if callable(value) and getattr(value, "__module__", "") == selectors.__name__ and name.startswith("memory_")
    }
    assert public - {"memory_view"} <= set(calls) | {"memory_view"}, "a new selector needs a read-only check here"
    results = {}
    atomic = _read_only()
    try:
        for name, run in calls.items():
            results[name] = run()
    finally:
        atomic.__exit__(None, None, None)
    assert results["memory_get_owned"].id == memory_id
    assert [v["event"] for v in results["memory_versions"]] == ["ADD"]
    assert results["memory_count"] == 1 and results["memory_ids_owned"] == [memory_id]
    assert sum(row["calls"] for row in results["usage_by_day"]) == 1


def test_a_write_in_the_read_only_transaction_fails(alice_scope):
    """The check above is real: a service (which writes) fails inside the same guard."""
    from memories.rate_limits import rate_limit_consume

    atomic = _read_only()
    try:
        with pytest.raises(InternalError, match="read-only"):
            rate_limit_consume(alice_scope, operation="remember")
    finally:
        atomic.__exit__(InternalError, InternalError(), None)


def _principal(user) -> Principal:
    return Principal(user=user, method="api_key", client_app="alice-agent")


def _call() -> CallContext:
    return CallContext(channel=Channel.MCP)


# Queries on Django's connection per call through the dispatcher (mem0's own pool is not
# counted). A change here is a deliberate decision: update the pin and say why.
# remember: 13 again since only seed 001's store reads the memory it stored back in its
# transaction (`operation_run(with_extras=True)`; 14 while every surface did); 13 since its write checks, in
# one round trip with the table's lock, that the embedder which made its vector is still
# the table's (a write racing `manage.py reembed`);
# 12 since its advisory lock takes one round trip, not three (core.locks); it was
# 14 since its audit snapshot is sealed with the user's data key (one lookup);
# search_memory: 10 (11 with neighbours) since the query in its audit detail is sealed the same way; 8 on this
# thread's connection since the BM25 side's two statements (tokenise, score) run on the
# lexical worker's connection (SEARCH_LEXICAL_CONCURRENT; 10 here without it); one more
# each since the best candidates read their neighbours (retrieval._with_neighbour_context);
# one less each since that statement also reads the rows the search returns (no `_load`).
QUERIES = {"remember": 13, "search_memory": 8, "search_memory_sequential": 10, "list_memory": 6}


@pytest.fixture
def steady_caches(monkeypatch):
    """The counts are of the steady state: the embedder record (re-read every second) and
    the plan caches must not expire or carry over from another test mid-measurement."""
    from memories.engine import embedders
    from memories.engine.retrieval import vector_plan_reset

    monkeypatch.setattr(embedders, "ACTIVE_TTL_S", 3600.0)
    vector_plan_reset()
    yield
    vector_plan_reset()


@pytest.mark.usefixtures("steady_caches")
def test_query_count_of_remember(alice, django_assert_num_queries):
    operation_execute(_principal(alice), "remember", {"memory": "warm-up"}, call=_call())
    with django_assert_num_queries(QUERIES["remember"]):
        operation_execute(_principal(alice), "remember", {"memory": "Alice likes figs"}, call=_call())


@pytest.mark.usefixtures("steady_caches")
def test_query_count_of_search_memory(alice, django_assert_num_queries):
    operation_execute(_principal(alice), "remember", {"memory": "Alice likes figs"}, call=_call())
    operation_execute(_principal(alice), "search_memory", {"query": "dates"}, call=_call())  # learns alice's size
    with django_assert_num_queries(QUERIES["search_memory"]):
        found = operation_execute(_principal(alice), "search_memory", {"query": "figs"}, call=_call())
    assert len(found["results"]) == 1


@pytest.mark.usefixtures("steady_caches")
def test_query_count_of_search_memory_with_bm25_on_this_thread(alice, django_assert_num_queries, settings):
    settings.SEARCH_LEXICAL_CONCURRENT = False
    operation_execute(_principal(alice), "remember", {"memory": "Alice likes figs"}, call=_call())
    operation_execute(_principal(alice), "search_memory", {"query": "dates"}, call=_call())  # learns alice's size
    with django_assert_num_queries(QUERIES["search_memory_sequential"]):
        found = operation_execute(_principal(alice), "search_memory", {"query": "figs"}, call=_call())
    assert len(found["results"]) == 1


@pytest.mark.usefixtures("steady_caches")
def test_query_count_of_list_memory(alice, django_assert_num_queries):
    operation_execute(_principal(alice), "remember", {"memory": "Alice likes figs"}, call=_call())
    with django_assert_num_queries(QUERIES["list_memory"]):
        page = operation_execute(_principal(alice), "list_memory", {"page_size": 10}, call=_call())
    assert len(page["memories"]) == 1


def test_every_tool_of_every_toolset_declares_an_output_schema():
    assert TOOLSETS, "no toolset registered"
    for toolset in TOOLSETS:
        assert toolset.instructions and toolset.path == f"/engines/{toolset.id}/mcp"
        for tool in toolset.tools:
            assert tool.output_schema and tool.output_schema["type"] == "object", (toolset.id, tool.name)
            jsonschema.Draft202012Validator.check_schema(tool.output_schema)


def test_successful_results_validate_against_the_output_schema(alice):
    """Each of the seven operations, through the dispatcher, against its tool's schema."""
    # Keyed by operation name: a tool name may repeat across toolsets (seed 003's delete_memory).
    principal = _principal(alice)
    schemas = {name: t.output_schema for ts in TOOLSETS for name, t in zip(ts.operations, ts.tools, strict=True)}

    def ok(name, arguments):
        data = operation_execute(principal, name, arguments, call=_call())
        jsonschema.validate(data, schemas[name])
        return data

    memory_id = ok("remember", {"memory": "Alice paints", "pinned": True, "metadata": {"topic": "art"}})["id"]
    ok("remember", {"memory": "Alice paints"})  # duplicate
    ok("search_memory", {"query": "paint"})
    ok("list_memory", {"page_size": 1})
    ok("update_memory", {"memory_id": memory_id, "memory": "Alice paints in oil"})
    ok("delete_memory", {"memory_id": memory_id})
    ok("clear_all_memory", {"confirm": True})
    assert set(schemas) == {name for ts in TOOLSETS for name in ts.operations}
    assert all(name in OPERATIONS for name in schemas)


def _public_functions(module) -> set[str]:
    return {
        name
        for name, value in vars(module).items()
        if callable(value) and getattr(value, "__module__", "") == module.__name__ and not name.startswith("_")
    }


def test_the_other_apps_selectors_run_in_a_read_only_transaction(alice, alice_scope, settings):
    """The same rule for every selector module beside memories.selectors: the turn
    lifecycle, the toolkit, the session log's reads, OAuth and the chat proxy."""
    from memories import sessions
    from memories.toolkit import selectors as toolkit_selectors
    from memories.turns import selectors as turns_selectors
    from oauth import selectors as oauth_selectors
    from proxy import selectors as proxy_selectors

    settings.CHAT_UPSTREAM_BASE_URL = "http://127.0.0.1:9/v1"
    memory_remember(alice_scope, memory="Alice grows tomatoes in her garden", call=internal_call())
    sessions.session_events_append(
        alice_scope, session_id="s1", items=[{"type": "message", "role": "user", "content": "hi"}]
    )
    alice_key_row, _ = api_key_issue(user=alice)
    calls = {
        turns_selectors: {
            "sessions_of_user": lambda: turns_selectors.sessions_of_user(alice_scope),
            "facts_by_tier": lambda: turns_selectors.facts_by_tier(alice_scope),
            "session_count": lambda: turns_selectors.session_count(alice_scope),
            "session_exists": lambda: turns_selectors.session_exists(alice_scope, project="", session_id="s1"),
            "session_items": lambda: turns_selectors.session_items(alice_scope, project="", session_id="s1"),
            "session_item_count": lambda: turns_selectors.session_item_count(alice_scope, project="", session_id="s1"),
            "session_archive_count": lambda: turns_selectors.session_archive_count(
                alice_scope, project="", session_id="s1"
            ),
            "session_archives": lambda: turns_selectors.session_archives(alice_scope, project="", session_id="s1"),
            "fact_counts_by_tier": lambda: turns_selectors.fact_counts_by_tier(alice_scope),
            "memory_tree": lambda: turns_selectors.memory_tree(
                alice_scope, project="", session_id="", path="/memory", depth=2, limit=50
            ),
        },
        toolkit_selectors: {
            "decision_list": lambda: list(toolkit_selectors.decision_list(alice_scope)),
            "decision_page": lambda: toolkit_selectors.decision_page(alice_scope),
            "decision_count": lambda: toolkit_selectors.decision_count(alice_scope),
            "cache_entry_list": lambda: list(toolkit_selectors.cache_entry_list(alice_scope)),
            "cache_entry_page": lambda: toolkit_selectors.cache_entry_page(alice_scope),
            "cache_entry_count": lambda: toolkit_selectors.cache_entry_count(alice_scope),
        },
        sessions: {
            "session_events_recent": lambda: sessions.session_events_recent(alice_scope, session_id="s1", limit=5),
            "sessions_replayed": lambda: sessions.sessions_replayed(alice_scope),
            "session_item_hashes_recent": lambda: sessions.session_item_hashes_recent(
                alice_scope, session_id="s1", limit=5
            ),
        },
        oauth_selectors: {
            "oauth_grants_connected": lambda: oauth_selectors.oauth_grants_connected(user=alice),
            "oauth_authorization_request_pending": lambda: oauth_selectors.oauth_authorization_request_pending(
                request_key="missing"
            ),
        },
        proxy_selectors: {
            "chat_memories_find": lambda: proxy_selectors.chat_memories_find(alice_scope, query="garden", limit=5),
            "token_config_effective": lambda: proxy_selectors.token_config_effective(api_key=None),
            "token_configs_of_live_keys": lambda: proxy_selectors.token_configs_of_live_keys(after_id=0, limit=5),
            "token_config_of_key": lambda: proxy_selectors.token_config_of_key(api_key=alice_key_row),
            "token_admin_key": lambda: proxy_selectors.token_admin_key(key_id=alice_key_row.key_id, retired_too=True),
            "token_owner_key": lambda: proxy_selectors.token_owner_key(alice, key_id=alice_key_row.key_id),
        },
    }
    # Helpers that are pure functions of their arguments (no database) need no guard.
    pure = {"session_item_hash", "token_config_view"}
    # The session log module holds its services beside its reads.
    writers = {
        "session_events_append",
        "session_data_erase",
        "erasure_register",
        "erasure_account_deleted",
        "erasure_account_deleted_register",
        "session_logs_delete",
        "session_data_clear_all",
        "session_logs_export",
        "clear_all_register",
        "derived_answers_forget",
        "derived_answers_register",
    }
    results = {}
    for module, table in calls.items():
        missing = _public_functions(module) - set(table) - pure - writers
        missing = {name for name in missing if not isinstance(vars(module)[name], type)}
        assert not missing, f"{module.__name__}: a new selector needs a read-only check here: {sorted(missing)}"
        atomic = _read_only()
        try:
            for name, run in table.items():
                results[name] = run()
        finally:
            atomic.__exit__(None, None, None)
    assert results["session_events_recent"][-1]["content"] == "hi"
    assert [m.memory for m in results["chat_memories_find"]] == ["Alice grows tomatoes in her garden"]
    assert results["oauth_authorization_request_pending"] is None


def test_no_module_outside_the_engine_spells_the_payload_layout():
    """Issue 18: only memories/engine/ knows how mem0 lays out a row (the payload column and
    its keys); everything else goes through the engine's helpers."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    spelled = re.compile(r"payload__|payload\s*->|[\"']payload[\"']|\[[\"'](?:user_id|data|created_at|hash)[\"']\]")
    offenders = []
    for package in ("core", "memories", "audit", "billing", "memsite", "oauth", "proxy"):
        for path in (root / package).rglob("*.py"):
            relative = path.relative_to(root).as_posix()
            if relative.startswith("memories/engine/") or "/migrations/" in relative:
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if "payload" in line and spelled.search(line):
                    offenders.append(f"{relative}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
