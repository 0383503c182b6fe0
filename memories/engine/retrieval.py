"""Hybrid retrieval over one user's memories: exact vector search plus BM25 over a
Postgres full-text index, fused by score (default) or by weighted reciprocal rank.

Vector search finds paraphrases; BM25 finds the exact tokens embeddings blur (names,
error codes, identifiers). Both run in Postgres on the engine's table; only the query
embedding comes from the engine.

Score fusion (SEARCH_FUSION=score) adds two similarities in [0, 1]-ish ranges:

    score = cosine + SEARCH_COVERAGE_WEIGHT * coverage * gate(cosine)

where coverage is the IDF-weighted share of the query's terms the memory contains
(sum of the matched terms' IDF / sum of every query term's IDF, terms absent from the
user's memories included). It is query-adaptive without a per-query switch: a query
made of an identifier or names the memory contains has coverage 1 and the exact match
wins; a paraphrase shares few of its terms with any memory (the terms it does not share
carry the most IDF), so coverage stays small everywhere and meaning decides; a memory
that shares one common word with the query gets little. Rank fusion, by contrast, gives
BM25's first hit a fixed bonus however weak its match, which is how a memory sharing a
word but not the meaning used to beat the paraphrase it should have lost to. The gate
finishes that job: coverage counts in proportion to the memory's cosine to the query
(none at or below SEARCH_COVERAGE_UNRELATED_COSINE, all from SEARCH_COVERAGE_RELATED_COSINE
up), so a word shared by an unrelated memory ("Friday deploys are banned at work.",
cosine 0.11 to "Where in the hospital do I work at the moment?") no longer outweighs
meaning.

Then, for unfiltered score-fusion searches, each of the best candidates gains a share of
its neighbours' scores (the memories stored just before and after it in the same
conversation): see "Neighbouring memories" below.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any, cast

from django.conf import settings
from django.db import DataError, close_old_connections, connection
from psycopg import sql

from core.metrics import engine_timed_function
from core.scope import MemoryScope
from memories.engine.embedders import embedder_spec_active, embedder_spec_refresh
from memories.engine.mem0_adapter import engine_embed_query
from memories.engine.payload import EngineMemory, engine_memory_from_row, engine_timestamp
from memories.engine.vector_schema import LIVE_OWNER, vector_text_query

logger = logging.getLogger(__name__)

BM25_K1 = 1.2
BM25_B = 0.75
MAX_QUERY_TERMS = 32


Filters = dict[str, Any] | None
# A filters key no payload key can be (metadata keys are letters, digits, "_.-"): the rows
# it holds are left out (`NOT payload @> ...`), e.g. {FILTER_EXCLUDED: {"tier": "stm"}}
# for every memory but the toolkit's short-term ones, those without a tier included.
FILTER_EXCLUDED = "$excluded"


def _table() -> sql.Identifier:
    return sql.Identifier(settings.MEMORY_COLLECTION)


def _owned_clause(
    filters: dict[str, Any] | None, *, owner: str, owner_index: bool = True
) -> tuple[sql.Composable, list[Any]]:
    """The user's live rows (not in the trash, not expired), optionally `payload @> filters`.
    Trash and expiry are read from the stored columns (vector_schema), not the payload.
    `owner_index=False` writes the owner test so no owner index can serve it (for the
    HNSW path, where the filter must run inside the index scan); otherwise the live-owner
    index (vector_schema.LIVE_OWNER) finds the user's live rows without visiting their
    trash. The owner's engine id (`owner`) is the clause's first parameter, which the
    caller passes."""
    shape, params = _owned_parts(filters, owner=owner, owner_index=owner_index)
    return _owned_sql(shape), params


# The owned clause's text: (owner index usable, a containment filter, an exclusion).
OwnedShape = tuple[bool, bool, bool]


def _owned_parts(filters: dict[str, Any] | None, *, owner: str, owner_index: bool) -> tuple[OwnedShape, list[Any]]:
    """`_owned_clause`'s shape (all its text depends on) and parameters."""
    params: list[Any] = [engine_timestamp(datetime.now(UTC))] + ([owner] if owner_index else [])
    wanted = dict(filters or {})
    excluded = wanted.pop(FILTER_EXCLUDED, None)
    if wanted:
        # The owner inside the containment too: the GIN index on the payload then finds
        # only this user's matching rows, not every user's (measured at 100k rows, 10 users).
        params.append(json.dumps({**wanted, "user_id": owner}))
    if excluded:
        params.append(json.dumps(excluded))
    return (owner_index, bool(wanted), bool(excluded)), params


def _owned_sql(shape: OwnedShape) -> sql.Composable:
    owner_index, wanted, excluded = shape
    owner_test = "payload->>'user_id' = %s" if owner_index else "(payload->>'user_id') || '' = %s"
    live_owner = f" AND {LIVE_OWNER} = %s" if owner_index else ""
    clause: sql.Composable = sql.SQL(
        owner_test + " AND NOT trashed AND (expires_at IS NULL OR expires_at > %s)" + live_owner
    )
    if wanted:
        clause = sql.SQL("{} AND payload @> %s::jsonb").format(clause)
    if excluded:
        clause = sql.SQL("{} AND NOT payload @> %s::jsonb").format(clause)
    return clause


def _distance_operator(normalised: bool | None = None) -> sql.SQL:
    # Our MiniLM vectors are unit length, so inner product ranks like cosine, for less work.
    normalised = embedder_spec_active().normalised if normalised is None else normalised
    return sql.SQL("<#>" if normalised else "<=>")


def _similarity(column: str = "vector", *, normalised: bool | None = None) -> sql.Composable:
    """Cosine similarity from the distance operator: -(inner product) or 1 - cosine distance.
    `normalised` defaults to the active embedder's."""
    normalised = embedder_spec_active().normalised if normalised is None else normalised
    prefix = "-" if normalised else "1 - "
    return sql.SQL(prefix + "({} {} %s::vector)").format(sql.SQL(column), _distance_operator(normalised))


# Statements every search renders, whose text depends only on their own variant (which
# statement, and e.g. the owned clause's shape or the number of query terms: `name`), the
# table's name, whether the active embedder's vectors are normalised (the distance
# operator) and the connection's encoding (which identifier quoting follows), rendered
# once per such key: building and rendering them with psycopg.sql cost about 0.4 ms of
# Python a search. The key is read where the statement used to be built, and the statement
# is built from the key's own values, so a re-embedding switch of table or embedder
# renders afresh and never runs a stale statement.
StatementKey = tuple[Any, str, bool, str]
_rendered_statements: dict[StatementKey, str] = {}
# A few hundred at most: BM25's differ by term count (up to MAX_QUERY_TERMS) and shape.
RENDERED_STATEMENTS_MAX = 512


def _statement_key(name: Any, cursor: Any) -> StatementKey:
    return (name, settings.MEMORY_COLLECTION, embedder_spec_active().normalised, cursor.connection.info.encoding)


def _rendered_statement(name: Any, cursor: Any, build: Callable[[sql.Identifier, bool], sql.Composable]) -> str:
    """`build(table, normalised)` rendered for `cursor`'s connection, from the cache when
    the statement `name` was rendered for the same table, flag and encoding before.
    `build` may depend on nothing but its arguments and what `name` holds."""
    return _rendered_for(_statement_key(name, cursor), cursor, build)


def _rendered_for(key: StatementKey, cursor: Any, build: Callable[[sql.Identifier, bool], sql.Composable]) -> str:
    rendered = _rendered_statements.get(key)
    if rendered is None:
        rendered = build(sql.Identifier(key[1]), key[2]).as_string(cursor.connection)
        if len(_rendered_statements) >= RENDERED_STATEMENTS_MAX:  # bounded: render again on demand
            _rendered_statements.clear()
        _rendered_statements[key] = rendered
    return rendered


def _similarity_of(distance: float, *, negate: bool) -> float:
    # <#> gives the negated inner product; <=> the cosine distance.
    return -distance if negate else 1 - distance


EXACT = "exact"
HNSW = "hnsw"

_plan_lock = threading.Lock()
_user_rows_cache: dict[str, tuple[float, int]] = {}  # engine user id -> (expires at, rows)
_iterative_cache: list[tuple[float, bool]] = []  # [(expires at, server has iterative scans)]
# engine user id -> (expires at, n, avgdl, shortest tsvector length)
_corpus_stats_cache: dict[str, tuple[float, float, float, float]] = {}

# --- Per-user search statistics ------------------------------------------------------------
# A user's live row count (which plan) and, for a large user, their corpus statistics (BM25's
# normalisation) are cached per process for SEARCH_PLAN_CACHE_S. An agent that searches
# less often than that would otherwise pay for them on every search: an exact scan to learn
# the size, then a pass over all their rows for the statistics (at 30k memories, 54-57 ms p50
# against 21-23 ms; docs/benchmarks.md). So an expired entry is still served and refreshed on
# a background thread (one refresh per entry in flight). A size never seen by this process
# is counted on the spot (through an index, up to the threshold); a large user's first
# search computes BM25's statistics with the query while the cache is filled behind it.
# Inside a transaction (another connection would not see its rows) both are computed on the
# spot. Both only steer the plan and BM25's scale: values one refresh old rank the same as
# fresh ones for a corpus of thousands.
STATS_REFRESH_DELAY_S = 0.1
STATS_REFRESH_BACKLOG = 1000
_stats_refresh_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memsite-search-stats")
_stats_refreshing: set[tuple[str, str]] = set()  # (what, engine user id) queued or running


def _cached(expires_at: float) -> bool:
    return time.monotonic() < expires_at


def _refresh_later(what: str, scope: MemoryScope, refresh: Callable[[MemoryScope, Any], object]) -> bool:
    """Queue `refresh(scope, cursor)` on the statistics thread, unless one is already queued
    for the same entry. False (the caller refreshes now) inside a transaction, or when
    STATS_REFRESH_BACKLOG refreshes are already waiting: then searches pay as before
    rather than the queue growing without bound."""
    if connection.in_atomic_block:
        return False
    key = (what, scope.engine_user_id)
    with _plan_lock:
        if key in _stats_refreshing:
            return True
        if len(_stats_refreshing) >= STATS_REFRESH_BACKLOG:
            return False
        _stats_refreshing.add(key)
    _stats_refresh_executor.submit(_refresh_on_own_connection, key, scope, refresh, time.monotonic())
    return True


def _refresh_on_own_connection(
    key: tuple[str, str], scope: MemoryScope, refresh: Callable[[MemoryScope, Any], object], queued_at: float
) -> None:
    # Let the search that found the entry stale finish first: on a small machine the
    # refresh would take a core from it (measured at 10k rows: 26 ms p50 instead of 22). A
    # backlog runs without waiting.
    time.sleep(max(0.0, queued_at + STATS_REFRESH_DELAY_S - time.monotonic()))
    try:
        with _own_connection(), connection.cursor() as cursor:
            refresh(scope, cursor)
    except Exception as exc:  # noqa: BLE001 - the stale entry stays; the next search queues again
        logger.warning("search statistics refresh failed (%s); the previous values stay", type(exc).__name__)
    finally:
        with _plan_lock:
            _stats_refreshing.discard(key)


@contextmanager
def _own_connection() -> Iterator[None]:
    """A worker thread's own connection: from the pool, and back to it afterwards."""
    close_old_connections()
    try:
        yield
    finally:
        close_old_connections()


def _server_has_iterative_scans() -> bool:
    with _plan_lock:
        if _iterative_cache and _cached(_iterative_cache[0][0]):
            return _iterative_cache[0][1]
    # pgvector 0.8 added iterative index scans (memsite.dbinfo reports the same to /healthz).
    with connection.cursor() as cursor:
        cursor.execute("SELECT extversion FROM pg_extension WHERE extname = 'vector'")
        row = cursor.fetchone()
    version = tuple(int(part) for part in (row[0] if row else "0").split(".") if part.isdigit())
    supported = version >= (0, 8, 0)
    with _plan_lock:
        _iterative_cache[:] = [(time.monotonic() + settings.SEARCH_PLAN_CACHE_S, supported)]
    return supported


def _user_rows(scope: MemoryScope) -> int:
    """The user's live rows, exactly below SEARCH_INDEX_MIN_ROWS and that many above it
    (all the plan needs to know): cached, else counted through the live-owner index."""
    with _plan_lock:
        hit = _user_rows_cache.get(scope.engine_user_id)
    if hit and (_cached(hit[0]) or _refresh_later("rows", scope, _count_user_rows)):
        return hit[1]
    with connection.cursor() as cursor:
        return _count_user_rows(scope, cursor)


def _count_user_rows(scope: MemoryScope, cursor: Any) -> int:
    # Counting stops at the threshold: 2 ms for a user of any size (a whole 10k user: 4 ms).
    # Rows past their expiry that the sweeper has not trashed yet are counted: a plan hint.
    cursor.execute(
        sql.SQL("SELECT count(*) FROM (SELECT 1 FROM {} WHERE {} = %s LIMIT %s) AS live")
        .format(_table(), sql.SQL(LIVE_OWNER))
        .as_string(cursor.connection),
        [scope.engine_user_id, settings.SEARCH_INDEX_MIN_ROWS],
    )
    rows = int(cursor.fetchone()[0])
    _remember_user_rows(scope, rows)
    return rows


def _remember_user_rows(scope: MemoryScope, rows: int) -> None:
    with _plan_lock:
        if len(_user_rows_cache) > 10_000:  # bounded: forget everyone, recount on demand
            _user_rows_cache.clear()
        _user_rows_cache[scope.engine_user_id] = (time.monotonic() + settings.SEARCH_PLAN_CACHE_S, rows)


def vector_plan_reset() -> None:
    """Forget cached row counts, corpus statistics and server capabilities (tests, after
    bulk loads)."""
    with _plan_lock:
        _user_rows_cache.clear()
        _iterative_cache.clear()
        _corpus_stats_cache.clear()
        _term_sample_cache.clear()


def vector_plan(scope: MemoryScope) -> str:
    """EXACT while a scan of the user's rows is cheap, HNSW with iterative scans from
    SEARCH_INDEX_MIN_ROWS rows on, when the server supports them (pgvector >= 0.8). The row
    count comes free with every unfiltered exact scan; otherwise it is counted (see
    `_user_rows`), so a large user is never scanned exactly to learn their size."""
    threshold = settings.SEARCH_INDEX_MIN_ROWS
    if threshold <= 0 or _user_rows(scope) < threshold or not _server_has_iterative_scans():
        return EXACT
    return HNSW


def vector_scores(
    scope: MemoryScope, vector: list[float], *, limit: int, filters: Filters = None, plan: str | None = None
) -> list[tuple[str, float]]:
    """The user's `limit` nearest memories with their cosine similarity, nearest first.
    `plan` (default: chosen by the user's size) is EXACT or HNSW."""
    plan = plan or vector_plan(scope)
    shape, params = _owned_parts(filters, owner=scope.engine_user_id, owner_index=plan == EXACT)

    def statement(table: sql.Identifier, normalised: bool) -> sql.Composable:
        if plan == EXACT:
            # The OFFSET 0 fence keeps the planner off the HNSW index (it cannot serve an
            # ordering of the subquery's output): an exact scan of the user's rows (found
            # through the owner index), each distance computed once. count(*) OVER () is the
            # user's row count, for the next plan choice, at no extra scan.
            return sql.SQL(
                "SELECT id, distance, count(*) OVER () FROM"
                " (SELECT id, vector {} %s::vector AS distance FROM {} WHERE {} OFFSET 0) AS scanned"
                " ORDER BY distance LIMIT %s"
            ).format(_distance_operator(normalised), table, _owned_sql(shape))
        # The owner test is written so the owner index cannot serve it ("|| ''"): the filter
        # then runs inside the HNSW scan, which iterates (relaxed order, re-sorted below)
        # until it has `limit` of the user's live rows.
        return sql.SQL(
            "SELECT id, vector {} %s::vector AS distance FROM {} WHERE {} ORDER BY distance LIMIT %s"
        ).format(_distance_operator(normalised), table, _owned_sql(shape))

    if plan == EXACT:
        literal = vector_text_query(vector)
        with connection.cursor() as cursor:
            key = _statement_key(("vector", plan, shape), cursor)
            negate = key[2]  # how the distances read, from the statement's own key
            query = _rendered_for(key, cursor, statement)
            cursor.execute(query, [literal, scope.engine_user_id, *params, limit])
            rows = cursor.fetchall()
        if not filters:
            _remember_user_rows(scope, int(rows[0][2]) if rows else 0)
    else:
        # Unfiltered, sequential and bitmap scans are turned off: the plan is already chosen
        # (the user is large), and without it the planner prefers a sequential scan + sort
        # whenever the user holds much of the table (measured: 50 ms instead of 2-3 ms at
        # 10k rows), or a bitmap of every live row through the full-text index, which holds
        # live rows only (196 ms at 100k live rows, for 400 candidates).
        # With a field filter the planner keeps its choice: the index scan would have to
        # iterate past every row the filter rejects (measured: filtered p95 1.4x unfiltered).
        # Settings and search go in one round trip: the statements of one simple query run
        # as one implicit transaction, so the local settings hold for the search and end with
        # it. That saves a BEGIN, a COMMIT and a round trip (an A/B: about 2 % of an MCP search
        # at 10k memories). Inside a caller's transaction (tests; services search outside
        # transactions) they last until it ends, as they did under the savepoint before.
        settings_statement = (
            "SELECT set_config('hnsw.iterative_scan', 'relaxed_order', true),"
            " set_config('hnsw.ef_search', %s, true), set_config('enable_seqscan', %s, true),"
            " set_config('enable_bitmapscan', %s, true); "
        )
        with connection.cursor() as cursor:
            key = _statement_key(("vector", plan, shape), cursor)
            negate = key[2]
            query = _rendered_for(key, cursor, statement)
            cursor.execute(
                settings_statement + query,
                [
                    str(max(settings.SEARCH_HNSW_EF_SEARCH, limit)),
                    *(["on" if filters else "off"] * 2),
                    vector_text_query(vector),
                    scope.engine_user_id,
                    *params,
                    limit,
                ],
            )
            cursor.nextset()  # past the settings' row, to the search's
            rows = sorted(cursor.fetchall(), key=lambda row: (float(row[1]), str(row[0])))
    return [(str(row[0]), _similarity_of(float(row[1]), negate=negate)) for row in rows]


def vector_ranking(scope: MemoryScope, vector: list[float], *, limit: int, filters: Filters = None) -> list[str]:
    return [memory_id for memory_id, _ in vector_scores(scope, vector, limit=limit, filters=filters)]


def _bm25_score_columns(matched_idf: str, total_idf: str) -> str:
    """A visited row's BM25 (each matched term's IDF, times the length factor) and its
    coverage (the matched share of the query's IDF), over the `owned` and `s` relations."""
    return (
        f"({matched_idf}) * {BM25_K1 + 1} / (1 + {BM25_K1} * (1 - {BM25_B} + {BM25_B} * dl / s.avgdl)) AS score,"
        f" ({matched_idf}) / nullif({total_idf}, 0) AS coverage"
    )


def _bm25_final_select(*, with_similarity: bool) -> str:
    """The `top` rows as (id, bm25, coverage, cosine to the query vector or NULL), best first."""
    select = (
        "SELECT top.id, top.score, top.coverage, {similarity} FROM top JOIN {table} AS t ON t.id = top.id"
        if with_similarity
        else "SELECT id, score, coverage, NULL::float FROM top"
    )
    return f"{select} ORDER BY 2 DESC, 1"


def _bm25_statement(terms: int, *, with_similarity: bool = False, filtered: bool = False) -> str:
    """BM25 in one pass over the user's rows: each row is matched against each query
    term once; corpus size, mean length and document frequencies come from the same
    rows. Memories are short, so a term's frequency in one is taken as 1. Each result
    also carries its coverage (IDF-weighted share of the query terms it contains) and,
    when a query vector is given, its cosine similarity (for score fusion).

    `filtered` (a field filter in `owned`): the rows are found once, through the payload
    index, and both the statistics and the matching read them from there; unfiltered,
    the statistics read the owner index and the matching the full-text index (below).
    Parameters: the owner clause's, the terms (matching), [the owner clause's again,
    unfiltered only], the terms (any term), the limit."""
    # Only placeholders and constants are interpolated; values travel as parameters.
    matches = ", ".join(f"(fts @@ %s::tsquery)::int AS m{i}" for i in range(terms))
    dfs = ", ".join(f"sum(m{i}) AS df{i}" for i in range(terms))
    idfs = ", ".join(f"ln(1 + (s0.n - s0.df{i} + 0.5) / (s0.df{i} + 0.5)) AS idf{i}" for i in range(terms))
    matched_idf = " + ".join(f"s.idf{i} * m{i}" for i in range(terms))
    total_idf = " + ".join(f"s.idf{i}" for i in range(terms))
    any_match = " + ".join(f"m{i}" for i in range(terms))
    any_term = " || ".join("%s::tsquery" for _ in range(terms))
    # The corpus size and mean length come from one light pass over the user's rows; the
    # per-term matching only touches rows holding some query term (found through the GIN
    # index on fts), and a term's document frequency is counted among those, which is
    # the same number. Scores are exactly those of a full pass, at a third of its cost.
    # A filtered search's rows come from the payload index, whose lookup (1.5 ms for a
    # 10k-memory user's 600 matching rows) both would pay: they share one instead.
    base = "WITH base AS MATERIALIZED (SELECT id, fts FROM {table} WHERE {owned})," if filtered else "WITH"
    rows = "base" if filtered else "{table} WHERE {owned}"
    stats = (
        f"{base} stats AS MATERIALIZED (SELECT count(*)::float AS n,"  # noqa: S608 - constants only
        f" greatest(avg(length(fts)), 1)::float AS avgdl FROM {rows}),"
    )
    source = "base WHERE" if filtered else "{table} WHERE {owned} AND"
    # Only placeholders and constants are interpolated.
    body = (
        f" owned AS MATERIALIZED (SELECT id, length(fts) AS dl, {matches} FROM {source}"  # noqa: S608
        f" fts @@ ({any_term})),"
        f" s0 AS MATERIALIZED (SELECT greatest(stats.n, count(*)) AS n, stats.avgdl, {dfs}"
        " FROM owned, stats GROUP BY stats.n, stats.avgdl),"
        f" s AS MATERIALIZED (SELECT n, avgdl, {idfs} FROM s0),"
        f" top AS (SELECT id, {_bm25_score_columns(matched_idf, total_idf)}"
        f" FROM owned, s WHERE {any_match} > 0 ORDER BY score DESC, id LIMIT %s)"
        f" {_bm25_final_select(with_similarity=with_similarity)}"
    )
    return stats + body


def _corpus_stats(scope: MemoryScope, cursor: Any) -> tuple[float, float, float] | None:
    """(row count, mean tsvector length, shortest non-empty tsvector length) of a large
    user's live rows, cached per process (see "Per-user search statistics"). None for a user
    on the exact plan (their pass is cheap and exact), and for a large user this process has
    not seen yet, while their statistics are computed in the background: that first search
    computes them with the query, in the one pass a small user's search makes."""
    with _plan_lock:
        size_known = scope.engine_user_id in _user_rows_cache
    # Counting a size is the vector side's: a user it has not counted yet is searched here
    # in that one pass too, rather than after a count of its own (+8 ms p50 at 30k rows).
    if not size_known or vector_plan(scope) != HNSW:
        return None
    with _plan_lock:
        hit = _corpus_stats_cache.get(scope.engine_user_id)
    if hit and _cached(hit[0]):
        return hit[1], hit[2], hit[3]
    if _refresh_later("corpus", scope, _count_corpus_stats):
        return (hit[1], hit[2], hit[3]) if hit else None
    return _count_corpus_stats(scope, cursor)


def _count_corpus_stats(scope: MemoryScope, cursor: Any) -> tuple[float, float, float]:
    # One pass over the user's live rows: 8 ms at 10k rows with the pages cached, 30 ms without.
    owned, params = _owned_clause(None, owner=scope.engine_user_id)
    cursor.execute(
        sql.SQL(
            "SELECT count(*)::float, greatest(avg(length(fts)), 1)::float,"
            " coalesce(min(nullif(length(fts), 0)), 1)::float FROM {} WHERE {}"
        )
        .format(_table(), owned)
        .as_string(cursor.connection),
        [scope.engine_user_id, *params],
    )
    n, avgdl, shortest = cursor.fetchone()
    with _plan_lock:
        if len(_corpus_stats_cache) > 10_000:  # bounded, like the row counts
            _corpus_stats_cache.clear()
        expires_at = time.monotonic() + settings.SEARCH_PLAN_CACHE_S
        _corpus_stats_cache[scope.engine_user_id] = (expires_at, n, avgdl, shortest)
    return n, avgdl, shortest


LEXICAL_SAMPLE_ROWS = 2000


# (engine user id, term) -> (expires at, rows holding the term, rows sampled). An agent's
# queries about one person keep coming back to the same words (names, places, topics), and
# sampling them is half of a large user's BM25 time (3.2 of 6.4 ms at 10k rows). Counts
# SEARCH_PLAN_CACHE_S old, like the corpus statistics, only move BM25's scale a little.
TERM_SAMPLES_CACHED = 50_000
_term_sample_cache: OrderedDict[tuple[str, str], tuple[float, int, int]] = OrderedDict()


def _sampled_document_frequencies(scope: MemoryScope, cursor: Any, terms: list[str], *, n: float) -> list[float]:
    """Each query term's document frequency among the user's live rows, estimated from
    LEXICAL_SAMPLE_ROWS of them (exact for a user with no more rows than that). Counting
    a common term exactly means visiting every row that holds it: at 100k memories that
    was most of the BM25 statement's 115 ms. A term sampled in the last
    SEARCH_PLAN_CACHE_S is not sampled again."""
    user = scope.engine_user_id
    with _plan_lock:
        samples = {term: _term_sample_cache.get((user, term)) for term in terms}
    missing = list(dict.fromkeys(term for term, hit in samples.items() if hit is None or not _cached(hit[0])))
    if missing:
        owned, params = _owned_clause(None, owner=user)
        counts = ", ".join("count(*) FILTER (WHERE fts @@ %s::tsquery)" for _ in missing)
        statement = sql.SQL(
            f"SELECT count(*), {counts} FROM (SELECT fts FROM {{}} WHERE {{}} LIMIT %s) AS sample"  # noqa: S608
        ).format(_table(), owned)
        cursor.execute(statement.as_string(cursor.connection), [*missing, user, *params, LEXICAL_SAMPLE_ROWS])
        sampled, *hits = cursor.fetchone()
        expires_at = time.monotonic() + settings.SEARCH_PLAN_CACHE_S
        with _plan_lock:
            for term, held in zip(missing, hits, strict=True):
                samples[term] = _term_sample_cache[(user, term)] = (expires_at, int(held), int(sampled))
                _term_sample_cache.move_to_end((user, term))
            while len(_term_sample_cache) > TERM_SAMPLES_CACHED:
                _term_sample_cache.popitem(last=False)
    frequencies = []
    for term in terms:
        _, held, sampled = cast(tuple[float, int, int], samples[term])
        # The whole corpus was sampled: exact.
        frequencies.append(float(held) if sampled < LEXICAL_SAMPLE_ROWS else held * n / sampled)
    return frequencies


def _bm25_given_idf_statement(terms: int, visited: int, *, conjunctive: bool, with_similarity: bool) -> str:
    """BM25 and coverage of the user's rows holding all (`conjunctive`) or any of the first
    `visited` query terms (the caller orders them), with the corpus statistics and every
    term's IDF given as parameters: only those rows are visited."""
    idfs = ", ".join(f"%s::float AS idf{i}" for i in range(terms))
    matches = ", ".join(f"(fts @@ %s::tsquery)::int AS m{i}" for i in range(terms))
    matched_idf = " + ".join(f"s.idf{i} * m{i}" for i in range(terms))
    visit = (" && " if conjunctive else " || ").join("%s::tsquery" for _ in range(visited))
    # Only placeholders and constants are interpolated; values travel as parameters.
    return (
        f"WITH s AS MATERIALIZED (SELECT %s::float AS avgdl, %s::float AS total, {idfs}),"  # noqa: S608
        f" owned AS MATERIALIZED (SELECT id, length(fts) AS dl, {matches} FROM {{table}}"
        f" WHERE {{owned}} AND fts @@ ({visit})),"
        f" top AS (SELECT id, {_bm25_score_columns(matched_idf, 's.total')}"
        f" FROM owned, s ORDER BY score DESC, id LIMIT %s)"
        f" {_bm25_final_select(with_similarity=with_similarity)}"
    )


def _best_unvisited_score(idfs: list[float], *, length_factor: Callable[[int], float], most_terms: int) -> float:
    """The highest BM25 a row can have when it holds at most `most_terms` of the terms whose
    IDFs are `idfs`: k terms give at most the k largest IDFs, and a row holding k terms has
    at least k lexemes, and at least the corpus's shortest length (length_factor(k))."""
    ranked = sorted(idfs, reverse=True)
    best, total = 0.0, 0.0
    for k, idf in enumerate(ranked[:most_terms], start=1):
        total += idf
        best = max(best, total * length_factor(k))
    return best


def _large_user_lexical_scores(
    scope: MemoryScope,
    cursor: Any,
    lexemes: list[str],
    *,
    stats: tuple[float, float, float],
    limit: int,
    vector: list[float] | None,
) -> list[tuple[str, float, float, float | None]]:
    """BM25's top `limit` for a user on the HNSW plan, visiting as few rows as proves the
    same top `limit` (max-score pruning). Visits, in turn, until one is conclusive:
    1. the rows holding every query term; a row lacking one scores at most the best of
       the other terms' IDF sums (times the length factor a row holding them can have);
    2. the rows holding one of the rarest terms (enough of them for about twice `limit`
       rows); a row holding none of them matches only the others;
    3. every row holding any term, as for a small user.
    A visit is conclusive when it found `limit` rows and the last of them scores above
    what any unvisited row can. The term frequencies are estimated from a sample
    (`_sampled_document_frequencies`); the shortest row length is the cached one."""
    n, avgdl, shortest = stats
    terms = [_tsquery(lexeme) for lexeme in lexemes]
    dfs = _sampled_document_frequencies(scope, cursor, terms, n=n)
    idfs = [math.log(1 + (n - df + 0.5) / (df + 0.5)) for df in dfs]
    rarest_first = sorted(range(len(terms)), key=lambda i: (dfs[i], i))

    def length_factor(lexemes_held: int) -> float:
        dl = max(lexemes_held, shortest)
        return (BM25_K1 + 1) / (1 + BM25_K1 * (1 - BM25_B + BM25_B * dl / avgdl))

    prefix: list[int] = []
    expected_rows = 0.0
    for i in rarest_first:
        prefix.append(i)
        expected_rows += dfs[i]
        if expected_rows >= 2 * limit:
            break
    attempts: list[tuple[list[int], bool, float]] = []  # (terms visited, conjunctive, best unvisited)
    if len(terms) > 1:
        attempts.append(
            (rarest_first, True, _best_unvisited_score(idfs, length_factor=length_factor, most_terms=len(terms) - 1))
        )
    if len(prefix) < len(terms):
        others = [idfs[i] for i in range(len(terms)) if i not in prefix]
        attempts.append(
            (prefix, False, _best_unvisited_score(others, length_factor=length_factor, most_terms=len(others)))
        )
    attempts.append((rarest_first, False, 0.0))
    owned, owned_params = _owned_clause(None, owner=scope.engine_user_id)
    extra = {"similarity": _similarity("t.vector")} if vector is not None else {}
    rows: list[Any] = []
    for visited, conjunctive, best_unvisited in attempts:
        statement = sql.SQL(
            _bm25_given_idf_statement(
                len(terms), len(visited), conjunctive=conjunctive, with_similarity=vector is not None
            )
        ).format(table=_table(), owned=owned, **extra)
        params = [avgdl, sum(idfs), *idfs, *terms, scope.engine_user_id, *owned_params]
        params += [*(terms[i] for i in visited), limit]
        if vector is not None:
            params.append(vector_text_query(vector))
        cursor.execute(statement.as_string(cursor.connection), params)
        rows = cursor.fetchall()
        if len(rows) >= limit and float(rows[-1][1]) > best_unvisited:
            break
    return [
        (str(row[0]), float(row[1]), float(row[2] or 0.0), None if row[3] is None else float(row[3])) for row in rows
    ]


def _tsquery(lexeme: str) -> str:
    return "'" + lexeme.replace("\\", "\\\\").replace("'", "''") + "'"


def lexical_scores(
    scope: MemoryScope,
    query: str,
    *,
    limit: int,
    filters: Filters = None,
    vector: list[float] | None = None,
) -> list[tuple[str, float, float, float | None]]:
    """The user's `limit` best BM25 matches, best first, as (id, bm25, coverage,
    cosine similarity to `vector` or None)."""
    shape, owned_params = _owned_parts(filters, owner=scope.engine_user_id, owner_index=True)
    with connection.cursor() as cursor:
        cursor.execute("SELECT tsvector_to_array(to_tsvector('english', %s))", [query])
        lexemes = (cursor.fetchone()[0] or [])[:MAX_QUERY_TERMS]
        if not lexemes:
            return []
        # A large user's corpus statistics come from a cache (a pass over all their rows
        # per query cost more than the matching itself) and their term frequencies from a
        # sample; a small user's, a filtered search's and a large user's first search's are
        # computed with the query, exactly.
        stats = None if filters else _corpus_stats(scope, cursor)
        if stats is not None:
            return _large_user_lexical_scores(scope, cursor, lexemes, stats=stats, limit=limit, vector=vector)
        with_similarity, filtered = vector is not None, bool(filters)

        def build(table: sql.Identifier, normalised: bool) -> sql.Composable:
            extra = {"similarity": _similarity("t.vector", normalised=normalised)} if with_similarity else {}
            return sql.SQL(_bm25_statement(len(lexemes), with_similarity=with_similarity, filtered=filtered)).format(
                table=table, owned=_owned_sql(shape), **extra
            )

        statement = _rendered_statement(("bm25", len(lexemes), with_similarity, filtered, shape), cursor, build)
        terms = [_tsquery(lexeme) for lexeme in lexemes]
        owner = [scope.engine_user_id, *owned_params]
        params = [*owner, *terms, *terms, limit] if filters else [*owner, *terms, *owner, *terms, limit]
        if vector is not None:
            params.append(vector_text_query(vector))
        cursor.execute(statement, params)
        return [
            (str(row[0]), float(row[1]), float(row[2] or 0.0), None if row[3] is None else float(row[3]))
            for row in cursor.fetchall()
        ]


def lexical_ranking(scope: MemoryScope, query: str, *, limit: int, filters: Filters = None) -> list[str]:
    return [row[0] for row in lexical_scores(scope, query, limit=limit, filters=filters)]


def fuse(rankings: list[tuple[list[str], float]], *, k: int) -> list[tuple[str, float]]:
    """Weighted reciprocal rank fusion: sum of weight / (k + rank) over the rankings."""
    scores: dict[str, float] = {}
    for ids, weight in rankings:
        for rank, memory_id in enumerate(ids, start=1):
            scores[memory_id] = scores.get(memory_id, 0.0) + weight / (k + rank)
    return sorted(scores.items(), key=lambda pair: (-pair[1], pair[0]))


def _load(ids: list[str], *, documents: dict[str, str] | None = None) -> dict[str, EngineMemory]:
    """The memories `ids`; those in `documents` (id -> payload as JSON text, already read
    by this search's neighbour statement) without another round trip."""
    documents = documents or {}
    loaded = {i: engine_memory_from_row(i, json.loads(documents[i])) for i in ids if i in documents}
    missing = [i for i in ids if i not in loaded]
    if not missing:
        return loaded
    query = sql.SQL("SELECT id, payload FROM {} WHERE id = ANY(%s::uuid[])").format(_table())
    with connection.cursor() as cursor:
        cursor.execute(query.as_string(cursor.connection), [missing])
        rows = cursor.fetchall()
    for memory_id, payload in rows:
        payload = payload if isinstance(payload, dict) else json.loads(payload)
        loaded[str(memory_id)] = engine_memory_from_row(memory_id, payload)
    return loaded


def coverage_gate(similarity: float | None, *, unrelated: float, related: float) -> float:
    """How much of a memory's lexical coverage counts, by its cosine to the query: none at
    or below `unrelated`, all from `related` up, linearly between. A memory that shares the
    query's words but not its meaning sits near cosine 0 with MiniLM and gains little or
    nothing from the shared word. Without a cosine (a search with the vector side off)
    coverage counts in full."""
    if similarity is None:
        return 1.0
    if related <= unrelated:
        return 1.0 if similarity > unrelated else 0.0
    return min(1.0, max(0.0, (similarity - unrelated) / (related - unrelated)))


def fuse_scores(
    vector: list[tuple[str, float]],
    lexical: list[tuple[str, float, float, float | None]],
    *,
    coverage_weight: float,
    gate: tuple[float, float] | None = None,
) -> list[tuple[str, float]]:
    """Score fusion: cosine similarity + coverage_weight x coverage x `coverage_gate`, best
    first; `gate` is (unrelated, related) cosines, and None lets all coverage count.
    A memory only the vector side found has coverage 0 (it contains none of the query's
    terms among the lexical candidates); one only the lexical side found brings its own
    cosine."""
    scores = dict(vector)
    for memory_id, _bm25, coverage, similarity in lexical:
        cosine = scores.get(memory_id, similarity)
        weight = coverage_weight
        if gate is not None:
            weight *= coverage_gate(cosine, unrelated=gate[0], related=gate[1])
        scores[memory_id] = (cosine if cosine is not None else 0.0) + weight * coverage
    return sorted(scores.items(), key=lambda pair: (-pair[1], pair[0]))


def _coverage_gate_setting() -> tuple[float, float]:
    return (settings.SEARCH_COVERAGE_UNRELATED_COSINE, settings.SEARCH_COVERAGE_RELATED_COSINE)


# The BM25 side needs no query vector, so it can run on its own pooled connection while the
# request's thread embeds the query and runs the vector statement: the embedder and the BM25
# statement's backend then use the two cores at once, and the lexical side leaves the
# critical path. Two workers: more would only queue on the same cores.
_lexical_executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="memsite-lexical")


def _lexical_concurrent() -> bool:
    # Inside a transaction the other connection could not see its uncommitted rows.
    return settings.SEARCH_LEXICAL_CONCURRENT and not connection.in_atomic_block


def _lexical_on_own_connection(
    scope: MemoryScope, query: str, *, limit: int, filters: Filters, vector: Future[list[float]]
) -> list[tuple[str, float, float, float | None]]:
    """The BM25 side, then (once the request's thread has embedded the query) its
    candidates' cosine similarities, both on this worker's own connection: the lookup runs
    while the request's thread runs the vector statement, instead of after it. It covers
    the candidates the vector side finds too (it cannot wait for that side's answer
    without going back onto the critical path); `fuse_scores` keeps the vector side's."""
    with _own_connection():
        lexical_side = lexical_scores(scope, query, limit=limit, filters=filters)
        similarities = _similarities([row[0] for row in lexical_side], vector.result())
    return [(i, bm25, coverage, similarities.get(i)) for i, bm25, coverage, _ in lexical_side]


def _score_sides_concurrently(
    scope: MemoryScope, query: str, *, limit: int, lexical_limit: int, filters: Filters
) -> tuple[list[tuple[str, float]], list[tuple[str, float, float, float | None]], list[float]]:
    """Both sides of score fusion, the BM25 side on a worker thread, and the query vector.
    The memories BM25 found get their cosine similarity from one lookup by id on that
    worker: the same values the sequential path computes inside the BM25 statement."""
    vector: Future[list[float]] = Future()
    lexical_future = _lexical_executor.submit(
        _lexical_on_own_connection, scope, query, limit=lexical_limit, filters=filters, vector=vector
    )
    try:
        embedded = engine_embed_query(query)
        vector.set_result(embedded)
        vector_side = vector_scores(scope, embedded, limit=limit, filters=filters)
    finally:
        vector.cancel()  # the embedding failed: the worker stops waiting for it (no-op once set)
        wait([lexical_future])  # never leave it running past this call, even on an error
    return vector_side, lexical_future.result(), embedded


def _similarities(ids: list[str], vector: list[float]) -> dict[str, float]:
    """Cosine similarity of `vector` to each of the memories `ids` (by primary key)."""
    if not ids:
        return {}
    with connection.cursor() as cursor:
        query = _rendered_statement("similarities", cursor, _similarities_statement)
        cursor.execute(query, [vector_text_query(vector), ids])
        return {str(memory_id): float(similarity) for memory_id, similarity in cursor.fetchall()}


def _similarities_statement(table: sql.Identifier, normalised: bool) -> sql.Composable:
    return sql.SQL("SELECT id, {} FROM {} WHERE id = ANY(%s::uuid[])").format(_similarity(normalised=normalised), table)


# --- Neighbouring memories ---------------------------------------------------------------
# A conversation is remembered one memory after another, and a memory often means little
# without the one before or after it ("Yes, twice a week" answers the turn before; "His
# name is Max" needs "I adopted a dog"). A question then matches the context best and the
# memory that holds the answer only partly. So each of the best candidates gains
# SEARCH_NEIGHBOUR_WEIGHT x the better score of its two neighbours: the user's live
# memories stored just before and just after it, by the same agent in the same session (or
# both without), at most SEARCH_NEIGHBOUR_WINDOW_S apart. A neighbour that is itself a
# candidate brings its fused score, any other its cosine similarity. Measured on LoCoMo
# (docs/benchmarks.md): +2.9 points of recall@5, and none lost on the paraphrase set, where
# one person's unrelated facts are stored one after another.


def _neighbours(
    scope: MemoryScope, ids: list[str], vector: list[float]
) -> tuple[dict[str, list[tuple[str, float]]], dict[str, str]]:
    """For each memory of `ids`: its neighbours (id, cosine similarity to `vector`) that
    pass the liveness, session, agent and time tests above. One statement, two probes of
    the (owner, created_at, id) index per id, each reading one row: the row next to it,
    live or not. Testing liveness in the probe would walk past every trashed row (a user
    who cleared 15,000 memories: 10 ms a probe); a trashed or expired row in between
    only means no neighbour on that side.

    Also each of `ids`' payload as JSON text (parsed only for the memories the search
    returns): the search's final top k is among these rows, so `_load` needs no round trip
    of its own. A memory with no row next to it on either side (a user's only memory)
    comes back in one row without a neighbour."""
    one_side = [vector_text_query(vector), engine_timestamp(datetime.now(UTC)), scope.engine_user_id]
    with connection.cursor() as cursor:
        query = _rendered_statement("neighbours", cursor, _neighbours_statement)
        cursor.execute(query, [ids, *one_side, *one_side])
        rows = cursor.fetchall()
    window = settings.SEARCH_NEIGHBOUR_WINDOW_S
    found: dict[str, list[tuple[str, float]]] = {}
    documents: dict[str, str] = {}
    for memory_id, at, session, agent, other_id, similarity, other_at, other_session, other_agent, live, doc in rows:
        documents[str(memory_id)] = doc
        if other_id is None or not live or (session, agent) != (other_session, other_agent):
            continue
        apart = abs((datetime.fromisoformat(at) - datetime.fromisoformat(other_at)).total_seconds())
        if apart <= window:
            found.setdefault(str(memory_id), []).append((str(other_id), float(similarity)))
    return found, documents


def _neighbours_statement(table: sql.Identifier, normalised: bool) -> sql.Composable:
    columns = sql.SQL(
        "payload->>'created_at' AS at, payload->'attrs'->>'session_id' AS session,"
        " payload->'attrs'->>'agent_id' AS agent"
    )

    def nearest(before: bool) -> sql.Composable:
        return sql.SQL(
            "(SELECT id, {similarity} AS similarity, {columns},"
            " NOT trashed AND (expires_at IS NULL OR expires_at > %s) AS live FROM {table}"
            " WHERE payload->>'user_id' = %s AND (payload->>'created_at', id) {op} (c.at, c.id)"
            " ORDER BY payload->>'created_at' {order}, id {order} LIMIT 1)"
        ).format(
            similarity=_similarity(normalised=normalised),
            columns=columns,
            table=table,
            op=sql.SQL("<" if before else ">"),
            order=sql.SQL("DESC" if before else "ASC"),
        )

    return sql.SQL(
        "SELECT c.id, c.at, c.session, c.agent, n.id, n.similarity, n.at, n.session, n.agent, n.live"
        ", c.document FROM (SELECT id, {columns}, payload::text AS document FROM {table}"
        " WHERE id = ANY(%s::uuid[])) AS c"
        " LEFT JOIN LATERAL ({before} UNION ALL {after}) AS n ON true"
    ).format(columns=columns, table=table, before=nearest(True), after=nearest(False))


def _with_neighbour_context(
    scope: MemoryScope, fused: list[tuple[str, float]], *, vector: list[float], limit: int, filters: Filters
) -> tuple[list[tuple[str, float]], dict[str, str]]:
    """`fused` (best first) with its best SEARCH_NEIGHBOUR_CANDIDATES (at least `limit`)
    re-scored by their neighbours, best first again; and the payloads the neighbour
    statement read (`_neighbours`). Unfiltered searches only: a filtered one asks for
    memories by their fields, not by their conversation."""
    weight = settings.SEARCH_NEIGHBOUR_WEIGHT
    if weight <= 0 or filters or not fused:
        return fused, {}
    top = fused[: max(limit, settings.SEARCH_NEIGHBOUR_CANDIDATES)]
    scores = dict(fused)
    neighbours, documents = _neighbours(scope, [memory_id for memory_id, _ in top], vector)
    rescored = dict(fused)
    for memory_id, own in top:
        context = [scores.get(other_id, similarity) for other_id, similarity in neighbours.get(memory_id, [])]
        rescored[memory_id] = own + weight * max([0.0, *context])
    return sorted(rescored.items(), key=lambda pair: (-pair[1], pair[0])), documents


@engine_timed_function("hybrid_search")  # memsite_engine_duration_seconds
def hybrid_search(
    scope: MemoryScope,
    *,
    query: str,
    limit: int,
    filters: Filters = None,
    fusion: str | None = None,
    vector_weight: float | None = None,
    lexical_weight: float | None = None,
    rrf_k: int | None = None,
) -> list[EngineMemory]:
    """The best `limit` memories for `query`, each with its fused score. `fusion` and the
    weights default to the SEARCH_* settings (seed 003's hybrid_search passes its own).
    A search that raced a re-embedding switch (query vector of the old size) is retried once."""

    def search() -> list[EngineMemory]:
        return _hybrid_search(
            scope,
            query=query,
            limit=limit,
            filters=filters,
            fusion=fusion,
            vector_weight=vector_weight,
            lexical_weight=lexical_weight,
            rrf_k=rrf_k,
        )

    try:
        return search()
    except DataError as exc:
        if "dimensions" not in str(exc) or connection.in_atomic_block:
            raise
        embedder_spec_refresh()
        return search()


def _hybrid_search(
    scope: MemoryScope,
    *,
    query: str,
    limit: int,
    filters: Filters,
    fusion: str | None,
    vector_weight: float | None,
    lexical_weight: float | None,
    rrf_k: int | None,
) -> list[EngineMemory]:
    candidates = max(limit, settings.SEARCH_CANDIDATES)
    lexical_candidates = max(limit, settings.SEARCH_LEXICAL_CANDIDATES)
    vector_weight = settings.SEARCH_VECTOR_WEIGHT if vector_weight is None else vector_weight
    lexical_weight = settings.SEARCH_LEXICAL_WEIGHT if lexical_weight is None else lexical_weight
    use_vector = vector_weight > 0
    use_lexical = lexical_weight > 0
    score_fusion = (fusion or settings.SEARCH_FUSION) == "score"
    documents: dict[str, str] = {}
    if score_fusion and use_vector and use_lexical and _lexical_concurrent():
        vector_side, lexical_side, embedded = _score_sides_concurrently(
            scope, query, limit=candidates, lexical_limit=lexical_candidates, filters=filters
        )
        fused = fuse_scores(
            vector_side, lexical_side, coverage_weight=settings.SEARCH_COVERAGE_WEIGHT, gate=_coverage_gate_setting()
        )
        fused, documents = _with_neighbour_context(scope, fused, vector=embedded, limit=limit, filters=filters)
        fused = fused[:limit]
    elif score_fusion:
        query_vector = engine_embed_query(query) if use_vector else None
        fused = fuse_scores(
            vector_scores(scope, query_vector, limit=candidates, filters=filters) if query_vector is not None else [],
            lexical_scores(scope, query, limit=lexical_candidates, filters=filters, vector=query_vector)
            if use_lexical
            else [],
            coverage_weight=settings.SEARCH_COVERAGE_WEIGHT,
            gate=_coverage_gate_setting(),
        )
        if query_vector is not None:
            fused, documents = _with_neighbour_context(scope, fused, vector=query_vector, limit=limit, filters=filters)
        fused = fused[:limit]
    else:
        vector = engine_embed_query(query) if use_vector else None
        rankings = []
        if vector is not None:
            rankings.append((vector_ranking(scope, vector, limit=candidates, filters=filters), vector_weight))
        if use_lexical:
            rankings.append((lexical_ranking(scope, query, limit=candidates, filters=filters), lexical_weight))
        fused = fuse(rankings, k=rrf_k or settings.SEARCH_RRF_K)[:limit]
    loaded = _load([memory_id for memory_id, _ in fused], documents=documents)
    return [replace(loaded[memory_id], score=score) for memory_id, score in fused if memory_id in loaded]
