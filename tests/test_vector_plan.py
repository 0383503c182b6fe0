"""The search plan that scales with the user's size: an exact scan for small users, the
HNSW index with pgvector 0.8 iterative scans for large ones, whose vector recall against
the exact scan on the same queries is >= 0.98, with other users' rows in the same index."""

from __future__ import annotations

import json
import uuid

import numpy as np
import pytest
from django.conf import settings
from django.db import connection

from core.scope import MemoryScope
from memories.engine import retrieval
from memories.engine.retrieval import EXACT, HNSW, lexical_scores, vector_plan, vector_plan_reset, vector_scores
from memories.engine.vector_schema import hnsw_index_name
from memsite.dbinfo import database_info

ROWS_PER_USER = 1500
QUERIES = 25


def _clustered(rng: np.random.Generator, n: int, centers: np.ndarray) -> np.ndarray:
    """Unit vectors around topic centres, like sentence embeddings (not uniform noise)."""
    picks = centers[rng.integers(0, len(centers), n)]
    points = picks + rng.normal(0, 0.08, (n, centers.shape[1]))
    return points / np.linalg.norm(points, axis=1, keepdims=True)


def _insert(scope, vectors: np.ndarray) -> list[str]:
    ids = [str(uuid.uuid4()) for _ in vectors]
    rows = [
        (
            memory_id,
            "[" + ",".join(f"{x:.6f}" for x in vector) + "]",
            json.dumps({"user_id": scope.engine_user_id, "data": f"synthetic {i}"}),
        )
        for i, (memory_id, vector) in enumerate(zip(ids, vectors, strict=True))
    ]
    with connection.cursor() as cursor:
        cursor.executemany(
            f'INSERT INTO "{settings.MEMORY_COLLECTION}" (id, vector, payload) VALUES (%s, %s::vector, %s::jsonb)',  # noqa: S608
            rows,
        )
    return ids


def _explain_search(scope, query: list[float], *, plan: str, limit: int) -> str:
    """EXPLAIN of the vector statement `vector_scores` runs, with the settings it runs it
    under (the HNSW path sends its planner settings and the search as one simple query)."""
    statements: list[tuple[str, object]] = []

    def record(execute, sql, params, many, context):
        if not sql.startswith(("SAVEPOINT", "RELEASE", "ROLLBACK")):
            statements.append((sql, params))
        return execute(sql, params, many, context)

    with connection.execute_wrapper(record):
        vector_scores(scope, query, limit=limit, plan=plan)
    from django.db import transaction

    with transaction.atomic(), connection.cursor() as cursor:
        for sql, params in statements[:-1]:
            cursor.execute(sql, params)
        sql, params = statements[-1]
        settings_part, search = sql.rsplit("; ", 1) if "; " in sql else ("", sql)
        cursor.execute(f"{settings_part}; EXPLAIN {search}" if settings_part else f"EXPLAIN {search}", params)
        if settings_part:
            cursor.nextset()
        explained = " ".join(row[0] for row in cursor.fetchall())
        transaction.set_rollback(True)
    return explained


@pytest.fixture
def large_users(alice_scope, bob_scope, clean_vectors):  # noqa: ARG001
    if not database_info().iterative_index_scans:
        pytest.skip("the server's pgvector has no iterative index scans (< 0.8): exact scans only")
    rng = np.random.default_rng(19)
    centers = rng.normal(0, 1, (40, settings.EMBEDDING_DIMS))
    centers /= np.linalg.norm(centers, axis=1, keepdims=True)
    alice_ids = _insert(alice_scope, _clustered(rng, ROWS_PER_USER, centers))
    bob_ids = _insert(bob_scope, _clustered(rng, ROWS_PER_USER, centers))
    queries = _clustered(rng, QUERIES, centers)
    # Rows of earlier tests (rolled back or deleted, never vacuumed) stay in the HNSW graph
    # as dead entries and cost the measured recall ~1-3 points at random: rebuild the index
    # as autovacuum would leave it in service. Then analyse the table: the plans explained
    # are those of these rows, not of whatever statistics earlier tests left (a table once
    # vacuumed empty is planned as one row). Both lock out autovacuum until the test's
    # transaction ends, so its statistics cannot change under the test either.
    with connection.cursor() as cursor:
        cursor.execute(f'REINDEX INDEX "{hnsw_index_name()}"')
        cursor.execute(f'ANALYZE "{settings.MEMORY_COLLECTION}"')

    vector_plan_reset()
    yield {"alice": set(alice_ids), "bob": set(bob_ids), "queries": [q.tolist() for q in queries]}
    vector_plan_reset()


def test_plan_follows_the_users_size(large_users, alice_scope, django_user_model, settings):
    charlie_scope = MemoryScope.for_user(
        django_user_model.objects.create_user("charlie", "charlie@example.com", "pw-c-1")
    )
    settings.SEARCH_INDEX_MIN_ROWS = ROWS_PER_USER
    # A size not known yet is counted through the live-owner index, up to the threshold:
    # a large user is never scanned exactly just to learn it.
    assert vector_plan(alice_scope) == HNSW
    assert retrieval._user_rows_cache[alice_scope.engine_user_id][1] == ROWS_PER_USER
    assert vector_plan(charlie_scope) == EXACT  # no rows
    with connection.cursor() as cursor:  # one of alice's rows to the trash: no longer counted
        cursor.execute(
            f'UPDATE "{settings.MEMORY_COLLECTION}" SET payload = payload || %s::jsonb WHERE id = %s',  # noqa: S608
            ['{"trash": {}}', next(iter(large_users["alice"]))],
        )
    vector_plan_reset()
    assert vector_plan(alice_scope) == EXACT
    vector_scores(alice_scope, large_users["queries"][0], limit=5)  # the exact scan counts every row
    assert retrieval._user_rows_cache[alice_scope.engine_user_id][1] == ROWS_PER_USER - 1
    settings.SEARCH_INDEX_MIN_ROWS = 0  # off
    assert vector_plan(alice_scope) == EXACT


@pytest.mark.django_db(transaction=True)
def test_expired_statistics_are_served_and_refreshed_in_the_background(alice_scope, settings, clean_vectors):  # noqa: ARG001
    """An agent searching less often than SEARCH_PLAN_CACHE_S gets the previous row count
    and corpus statistics at once; a background thread refreshes them. Inside a transaction
    they are refreshed on the spot (another connection would not see its rows)."""
    if not database_info().iterative_index_scans:
        pytest.skip("the server's pgvector has no iterative index scans (< 0.8): exact scans only")
    from django.db import transaction

    def background_done() -> None:  # the one statistics thread runs its queue in order
        retrieval._stats_refresh_executor.submit(lambda: None).result(timeout=30)

    def corpus_rows() -> float | None:
        with connection.cursor() as cursor:
            stats = retrieval._corpus_stats(alice_scope, cursor)
        return None if stats is None else stats[0]

    rng = np.random.default_rng(5)
    settings.SEARCH_INDEX_MIN_ROWS = 3
    settings.SEARCH_PLAN_CACHE_S = 0.0  # every entry is expired as soon as it is stored
    vector_plan_reset()
    try:
        _insert(alice_scope, _clustered(rng, 2, np.eye(settings.EMBEDDING_DIMS)[:2]))
        assert vector_plan(alice_scope) == EXACT  # counted now: 2 rows
        _insert(alice_scope, _clustered(rng, 2, np.eye(settings.EMBEDDING_DIMS)[:2]))
        assert vector_plan(alice_scope) == EXACT  # the expired count, while it is refreshed
        background_done()
        assert vector_plan(alice_scope) == HNSW  # the refreshed one: 4 rows (3 counted)
        assert corpus_rows() is None  # never computed: this search computes its own...
        background_done()
        assert corpus_rows() == 4  # ...while the cache is filled behind it
        _insert(alice_scope, _clustered(rng, 1, np.eye(settings.EMBEDDING_DIMS)[:2]))
        assert corpus_rows() == 4
        background_done()
        assert corpus_rows() == 5
        _insert(alice_scope, _clustered(rng, 1, np.eye(settings.EMBEDDING_DIMS)[:2]))
        with transaction.atomic():
            assert corpus_rows() == 6
        background_done()
    finally:
        vector_plan_reset()


def test_index_path_recall_against_exact_and_tenancy(large_users, alice_scope, bob_scope):
    assert hnsw_index_name() in _explain_search(alice_scope, large_users["queries"][0], plan=HNSW, limit=10)
    recalls = []
    for limit in (10, settings.SEARCH_CANDIDATES):
        for query in large_users["queries"]:
            exact = vector_scores(alice_scope, query, limit=limit, plan=EXACT)
            indexed = vector_scores(alice_scope, query, limit=limit, plan=HNSW)
            assert {memory_id for memory_id, _ in indexed} <= large_users["alice"]  # never bob's
            assert len(indexed) == limit  # the filter lost no rows
            recalls.append(len({m for m, _ in exact} & {m for m, _ in indexed}) / limit)
            scores = [score for _, score in indexed]
            assert scores == sorted(scores, reverse=True)
        assert {m for m, _ in vector_scores(bob_scope, large_users["queries"][0], limit=10, plan=HNSW)} <= large_users[
            "bob"
        ]
    assert sum(recalls) / len(recalls) >= 0.98, sum(recalls) / len(recalls)


def test_exact_path_never_uses_the_vector_index(alice_scope):
    """Small users are scanned exactly even when the planner would like the HNSW index."""
    zero = "[" + ",".join("0" for _ in range(settings.EMBEDDING_DIMS)) + "]"
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")
        cursor.execute(
            "EXPLAIN SELECT id, distance, count(*) OVER () FROM (SELECT id, vector <#> %s::vector AS distance"
            f" FROM \"{settings.MEMORY_COLLECTION}\" WHERE payload->>'user_id' = %s OFFSET 0) AS scanned"  # noqa: S608
            " ORDER BY distance LIMIT 10",
            [zero, alice_scope.engine_user_id],
        )
        assert "hnsw" not in " ".join(row[0] for row in cursor.fetchall())


def test_index_path_skips_trashed_and_expired_rows(large_users, alice_scope):
    """Issue 11's trash and expiry hold on the HNSW path too: the nearest rows, once trashed
    or expired, are not found, and the scan still fills the limit with live rows."""
    query = large_users["queries"][0]
    nearest = [memory_id for memory_id, _ in vector_scores(alice_scope, query, limit=10, plan=HNSW)]
    trashed, expired = nearest[:3], nearest[3:6]
    with connection.cursor() as cursor:
        cursor.execute(
            f'UPDATE "{settings.MEMORY_COLLECTION}" SET payload = payload || \'{{"trash": {{}}}}\'::jsonb'  # noqa: S608
            " WHERE id = ANY(%s::uuid[])",
            [trashed],
        )
        cursor.execute(
            f"UPDATE \"{settings.MEMORY_COLLECTION}\" SET payload = jsonb_set(payload, '{{attrs}}',"  # noqa: S608
            ' \'{"expires_at": "2000-01-01T00:00:00+00:00"}\'::jsonb) WHERE id = ANY(%s::uuid[])',
            [expired],
        )
    for plan in (HNSW, EXACT):
        found = [memory_id for memory_id, _ in vector_scores(alice_scope, query, limit=10, plan=plan)]
        assert len(found) == 10
        assert not set(found) & set(trashed + expired)
        assert set(nearest[6:]) <= set(found)
    # Restored from the trash, the rows are back in the indexes that hold live rows only.
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE \"{settings.MEMORY_COLLECTION}\" SET payload = payload - 'trash' WHERE id = ANY(%s::uuid[])",  # noqa: S608
            [trashed],
        )
    for plan in (HNSW, EXACT):
        found = [memory_id for memory_id, _ in vector_scores(alice_scope, query, limit=10, plan=plan)]
        assert set(trashed) <= set(found)


def test_search_indexes_hold_live_rows_and_each_plan_keeps_its_index(large_users, alice_scope):
    """The HNSW and full-text indexes are partial on `NOT trashed` (migration 0019), so a
    user's trash costs their searches nothing. A partial index can be scanned whole for its
    predicate alone, which the planner preferred to the HNSW index for many candidates (a
    bitmap of every live row): the HNSW path must keep the HNSW index at any limit, and the
    exact path must find the user's live rows through the live-owner index."""
    from memories.engine.vector_schema import live_owner_index_name, owner_fulltext_index_name

    table = settings.MEMORY_COLLECTION
    with connection.cursor() as cursor:
        cursor.execute("SELECT indexname, indexdef FROM pg_indexes WHERE tablename = %s", [table])
        definitions = dict(cursor.fetchall())
    for name in (hnsw_index_name(), owner_fulltext_index_name()):
        assert definitions[name].endswith("WHERE (NOT trashed)"), definitions[name]
    # Alice clears her memories and imports them again: twice as many rows, half in the trash.
    with connection.cursor() as cursor:
        cursor.execute(
            f'INSERT INTO "{table}" (id, vector, payload) SELECT gen_random_uuid(), vector,'  # noqa: S608
            f" payload || '{{\"trash\": {{}}}}'::jsonb FROM \"{table}\" WHERE payload->>'user_id' = %s",
            [alice_scope.engine_user_id],
        )
        cursor.execute(f'ANALYZE "{table}"')
    query = large_users["queries"][1]
    for limit in (10, settings.SEARCH_CANDIDATES, 4 * settings.SEARCH_CANDIDATES):
        assert hnsw_index_name() in _explain_search(alice_scope, query, plan=HNSW, limit=limit)
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")  # a table this small is cheaper to read whole
        assert live_owner_index_name() in _explain_search(alice_scope, query, plan=EXACT, limit=10)
    found = vector_scores(alice_scope, query, limit=10, plan=HNSW)
    assert {memory_id for memory_id, _ in found} <= large_users["alice"]  # the originals, not the trashed copies
    assert len(found) == 10


@pytest.mark.django_db(transaction=True)
def test_the_live_search_indexes_migrate_both_ways(alice_scope, clean_vectors):  # noqa: ARG001
    from memories.engine.vector_schema import (
        create_live_search_indexes,
        drop_live_search_indexes,
        live_owner_index_name,
    )

    table = settings.MEMORY_COLLECTION
    ids = _insert(alice_scope, np.eye(4, settings.EMBEDDING_DIMS))

    def definitions() -> dict[str, str]:
        with connection.cursor() as cursor:
            cursor.execute("SELECT indexname, indexdef FROM pg_indexes WHERE tablename = %s", [table])
            return dict(cursor.fetchall())

    with connection.schema_editor() as editor:
        drop_live_search_indexes(editor)
    assert live_owner_index_name() not in definitions()
    assert "WHERE" not in definitions()[hnsw_index_name()]
    with connection.schema_editor() as editor:
        create_live_search_indexes(editor)
    assert "WHERE (NOT trashed)" in definitions()[hnsw_index_name()]
    assert live_owner_index_name() in definitions()
    assert {m for m, _ in vector_scores(alice_scope, [1.0] * settings.EMBEDDING_DIMS, limit=10, plan=EXACT)} == set(ids)


def test_a_large_users_bm25_statistics_are_cached_with_the_same_scores(large_users, alice_scope, settings):
    """On the HNSW plan, BM25's corpus size and mean length come from a per-process cache
    instead of a pass over every row of the user per query; scores are those of the exact
    pass while the corpus is unchanged, and rows added meanwhile are still found."""
    from django.test.utils import CaptureQueriesContext

    settings.SEARCH_INDEX_MIN_ROWS = 0  # exact plan: statistics computed with the query
    computed = lexical_scores(alice_scope, "synthetic 7", limit=10)
    settings.SEARCH_INDEX_MIN_ROWS = ROWS_PER_USER
    vector_scores(alice_scope, large_users["queries"][0], limit=5)  # learns alice's size
    assert vector_plan(alice_scope) == HNSW
    with CaptureQueriesContext(connection) as first:
        cached = lexical_scores(alice_scope, "synthetic 7", limit=10)
    with CaptureQueriesContext(connection) as second:
        again = lexical_scores(alice_scope, "synthetic 7", limit=10)
    # No statistics pass, and no term sample (test_a_large_users_term_samples_are_taken_once_per_term).
    assert len(second.captured_queries) == len(first.captured_queries) - 2
    assert [row[0] for row in cached] == [row[0] for row in again] == [row[0] for row in computed]
    for ours, exact in zip(again, computed, strict=True):
        assert ours[1] == pytest.approx(exact[1], rel=1e-9) and ours[2] == pytest.approx(exact[2], rel=1e-9)
    added = _insert(alice_scope, np.array(large_users["queries"][:2]))  # "synthetic 0/1", after caching
    found = {row[0] for row in lexical_scores(alice_scope, "synthetic 1", limit=ROWS_PER_USER + 5)}
    assert added[1] in found and found <= large_users["alice"] | set(added)


def test_a_large_users_term_samples_are_taken_once_per_term(large_users, alice_scope, settings):
    """The sample that estimates a query term's document frequency is taken once per
    SEARCH_PLAN_CACHE_S and term: the same query again skips it with the same scores, a
    query with one new term samples only that term, and an expired term is sampled again."""
    from django.test.utils import CaptureQueriesContext

    settings.SEARCH_INDEX_MIN_ROWS = ROWS_PER_USER
    vector_scores(alice_scope, large_users["queries"][0], limit=5)  # learns alice's size
    assert vector_plan(alice_scope) == HNSW

    def search(query: str) -> tuple[list, list[int]]:
        with CaptureQueriesContext(connection) as captured:
            rows = lexical_scores(alice_scope, query, limit=10)
        sampled = [q["sql"].count("FILTER") for q in captured.captured_queries if "AS sample" in q["sql"]]
        return rows, sampled

    first, sampled = search("synthetic 7")
    assert sampled == [2]
    again, sampled = search("synthetic 7")
    assert sampled == [] and again == first
    settings.SEARCH_PLAN_CACHE_S = 0  # what is sampled from here on is stored expired
    _, sampled = search("synthetic 8")
    assert sampled == [1]  # "synthet" is known
    _, sampled = search("synthetic 8")
    assert sampled == [1]


SUBJECTS = ("my sister", "our landlord", "the dentist", "grandma")
OBJECTS = ("the car insurance", "the piano lessons", "a table at the Thai place", "the flight to Lisbon", "the vet")


def _insert_texts(scope, texts: list[str], rng: np.random.Generator) -> list[str]:
    ids = _insert(scope, _clustered(rng, len(texts), np.eye(settings.EMBEDDING_DIMS)[:8]))
    with connection.cursor() as cursor:
        cursor.executemany(
            f"UPDATE \"{settings.MEMORY_COLLECTION}\" SET payload = jsonb_set(payload, '{{data}}', to_jsonb(%s::text))"  # noqa: S608
            " WHERE id = %s",
            list(zip(texts, ids, strict=True)),
        )
    return ids


def test_a_large_users_bm25_visits_only_the_rows_that_can_rank(
    alice_scope, bob_scope, clean_vectors, settings, monkeypatch
):  # noqa: ARG001
    """On the HNSW plan, BM25 first visits only the rows holding every query term (or one
    of its rarest terms) and widens only when the rows left out could still rank: the
    top results and their scores are those of the full pass of a small user, and another
    user's rows never show."""
    from django.test.utils import CaptureQueriesContext

    if not database_info().iterative_index_scans:
        pytest.skip("the server's pgvector has no iterative index scans (< 0.8): exact scans only")
    rng = np.random.default_rng(7)
    texts = [
        f"{SUBJECTS[i % 4].capitalize()} asked about {OBJECTS[(i // 4) % 5]} in week {i % 9} (#{i})"
        for i in range(1200)
    ]
    alice = set(_insert_texts(alice_scope, texts, rng))
    _insert_texts(bob_scope, texts, rng)
    queries = [
        "what did my sister do about the car insurance?",  # all terms in 60 rows: the first visit decides
        "the Thai place table for grandma",
        "grandma piano 17",  # "17" is in one row: every row holding a term is visited
        "landlord week 3 vet",
        "lessons",
    ]
    for query in queries:
        settings.SEARCH_INDEX_MIN_ROWS = 0  # exact plan: every matching row visited, statistics exact
        vector_plan_reset()
        full = lexical_scores(alice_scope, query, limit=10)
        settings.SEARCH_INDEX_MIN_ROWS = 1000
        vector_scores(alice_scope, [1.0] + [0.0] * (settings.EMBEDDING_DIMS - 1), limit=1)  # learns alice's size
        assert vector_plan(alice_scope) == HNSW
        with CaptureQueriesContext(connection) as captured:
            pruned = lexical_scores(alice_scope, query, limit=10)
        assert [row[0] for row in pruned] == [row[0] for row in full], query
        assert {row[0] for row in pruned} <= alice
        for ours, exact in zip(pruned, full, strict=True):
            assert ours[1] == pytest.approx(exact[1], rel=1e-9) and ours[2] == pytest.approx(exact[2], rel=1e-9)
        visits = [q["sql"] for q in captured.captured_queries if "AS idf0" in q["sql"]]
        if query == queries[0]:
            assert len(visits) == 1 and " && " in visits[0]  # rows holding every term, and no others

    # A user with more rows than the sample: term frequencies are estimates, so scores move a
    # little, but the rows holding every term still come first, in the same order.
    monkeypatch.setattr(retrieval, "LEXICAL_SAMPLE_ROWS", 300)
    estimated = lexical_scores(alice_scope, queries[0], limit=10)
    settings.SEARCH_INDEX_MIN_ROWS = 0
    vector_plan_reset()
    exact = lexical_scores(alice_scope, queries[0], limit=10)
    assert [row[0] for row in estimated] == [row[0] for row in exact]
    assert all(row[2] == pytest.approx(1.0) for row in estimated)


def test_the_engine_table_is_vacuumed_and_analysed_from_two_percent_changed_rows(db):  # noqa: ARG001
    """Dead rows in the HNSW graph cost recall until vacuumed: autovacuum starts at 2 % of
    the table dead instead of Postgres' 20 %. A user the statistics do not know is planned
    as one row until the table is analysed: from 2 % changed rows instead of 10 %."""
    from memories.engine.vector_schema import AUTOVACUUM_ANALYZE_SCALE_FACTOR, AUTOVACUUM_VACUUM_SCALE_FACTOR

    with connection.cursor() as cursor:
        cursor.execute("SELECT reloptions FROM pg_class WHERE oid = %s::regclass", [settings.MEMORY_COLLECTION])
        options = cursor.fetchone()[0] or []
    assert f"autovacuum_vacuum_scale_factor={AUTOVACUUM_VACUUM_SCALE_FACTOR}" in options
    assert f"autovacuum_analyze_scale_factor={AUTOVACUUM_ANALYZE_SCALE_FACTOR}" in options


@pytest.mark.django_db(transaction=True)
def test_vectors_stay_inline_and_the_migration_moves_old_ones_back(alice_scope, clean_vectors):  # noqa: ARG001
    """Exact scans read each row's vector in place: the table keeps rows up to 4 kB inline,
    and the migration rewrites vectors an older table had moved to TOAST storage."""
    from memories.engine.vector_schema import keep_vectors_inline, reset_toast_target

    def toasted() -> int:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT pg_relation_size(reltoastrelid) FROM pg_class WHERE oid = %s::regclass",
                [settings.MEMORY_COLLECTION],
            )
            return cursor.fetchone()[0]

    def insert_rows() -> None:  # incompressible payloads (~0.6 kB) like real ones push rows past 2 kB
        rng = np.random.default_rng(3)
        ids = _insert(alice_scope, _clustered(rng, 20, np.eye(settings.EMBEDDING_DIMS)[:4]))
        with connection.cursor() as cursor:
            cursor.execute(
                f'UPDATE "{settings.MEMORY_COLLECTION}" SET payload = payload || jsonb_build_object('  # noqa: S608
                "'hash', md5(id::text), 'metadata', jsonb_build_object('note',"
                " (SELECT string_agg(md5(random()::text || g), '') FROM generate_series(1, 16) AS g)))"
                " WHERE id = ANY(%s::uuid[])",
                [ids],
            )

    insert_rows()
    assert toasted() == 0
    with connection.schema_editor(atomic=False) as editor:
        reset_toast_target(editor)
    insert_rows()
    assert toasted() > 0  # the default threshold moved these vectors out of line
    with connection.schema_editor(atomic=False) as editor:
        keep_vectors_inline(editor)
    assert toasted() == 0
    assert len(vector_scores(alice_scope, [1.0] + [0.0] * (settings.EMBEDDING_DIMS - 1), limit=5, plan=EXACT)) == 5


def test_bm25_term_lookups_go_through_the_owner_fulltext_index(alice_scope):
    """The (owner, fts) GIN index serves the owner test and the term match together
    (migration 0017), and it replaced the one-column fts index. On this near-empty table the
    planner prefers the owner's btree indexes, so they are dropped inside a transaction that
    is rolled back: the plan then shows what the GIN index can do on its own."""
    from django.db import transaction

    from memories.engine.vector_schema import owner_fulltext_index_name

    table = settings.MEMORY_COLLECTION
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SELECT indexname FROM pg_indexes WHERE tablename = %s", [table])
        indexes = {row[0] for row in cursor.fetchall()}
        assert owner_fulltext_index_name() in indexes
        assert f"{table}_fts_idx" not in indexes
        cursor.execute(f'DROP INDEX "{table}_user_created_idx", "{table}_live_user_id_idx"')
        cursor.execute("SET LOCAL enable_seqscan = off")
        cursor.execute(  # the index holds live rows only (migration 0019), as search states
            f"EXPLAIN SELECT id FROM \"{table}\" WHERE payload->>'user_id' = %s AND NOT trashed"  # noqa: S608
            " AND fts @@ to_tsquery('english', 'sourdough')",
            [alice_scope.engine_user_id],
        )
        plan = " ".join(row[0] for row in cursor.fetchall())
        transaction.set_rollback(True)
    index_cond = plan.split(owner_fulltext_index_name(), 1)[-1]
    assert owner_fulltext_index_name() in plan and "user_id" in index_cond and "sourdough" in index_cond, plan


def test_field_filters_carry_the_owner_into_the_payload_index():
    """A filtered search's containment test names the owner, so the payload GIN index finds
    only the user's matching rows; a filter naming another user cannot replace the owner."""
    from memories.engine.retrieval import _owned_clause

    _, params = _owned_clause({"attrs": {"memory_type": "project"}, "user_id": "default:2"}, owner="default:1")
    assert json.loads(params[-1]) == {"attrs": {"memory_type": "project"}, "user_id": "default:1"}
    _, params = _owned_clause(None, owner="default:1")
    assert len(params) == 2 and "user_id" not in str(params[0])  # the time and the live owner; no containment
