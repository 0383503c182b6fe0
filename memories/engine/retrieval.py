"""Hybrid retrieval over one user's memories: exact vector search plus BM25 over a
Postgres full-text index, fused by weighted reciprocal rank.

Vector search finds paraphrases; BM25 finds the exact tokens embeddings blur (names,
error codes, identifiers). Both run in Postgres on the engine's table; only the query
embedding comes from the engine.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from django.conf import settings
from django.db import connection
from psycopg import sql

from core.metrics import engine_timed_function
from core.scope import MemoryScope
from memories.engine.mem0_adapter import engine_embed_query
from memories.engine.payload import EngineMemory, engine_memory_from_row

BM25_K1 = 1.2
BM25_B = 0.75
MAX_QUERY_TERMS = 32


def _table() -> sql.Identifier:
    return sql.Identifier(settings.MEMORY_COLLECTION)


def _owned_clause(filters: dict[str, Any] | None) -> tuple[sql.Composable, list[Any]]:
    clause: sql.Composable = sql.SQL("payload->>'user_id' = %s")
    params: list[Any] = []
    if filters:
        clause = sql.SQL("{} AND payload @> %s::jsonb").format(clause)
        params.append(json.dumps(filters))
    return clause, params


def vector_ranking(
    scope: MemoryScope, vector: list[float], *, limit: int, filters: dict[str, Any] | None = None
) -> list[str]:
    owned, params = _owned_clause(filters)
    # Our MiniLM vectors are unit length, so inner product ranks like cosine, for less work.
    operator = sql.SQL("<#>" if settings.EMBEDDER == "local" else "<=>")
    query = sql.SQL("SELECT id FROM {} WHERE {} ORDER BY vector {} %s::vector LIMIT %s").format(
        _table(), owned, operator
    )
    literal = "[" + ",".join(f"{x:.7g}" for x in vector) + "]"
    with connection.cursor() as cursor:
        cursor.execute(query.as_string(cursor.connection), [scope.engine_user_id, *params, literal, limit])
        return [str(row[0]) for row in cursor.fetchall()]


def _bm25_statement(terms: int) -> str:
    """BM25 in one pass over the user's rows: each row is matched against each query
    term once; corpus size, mean length and document frequencies come from the same
    rows. Memories are short, so a term's frequency in one is taken as 1."""
    # Only placeholders and constants are interpolated; values travel as parameters.
    matches = ", ".join(f"(fts @@ %s::tsquery)::int AS m{i}" for i in range(terms))
    dfs = ", ".join(f"sum(m{i}) AS df{i}" for i in range(terms))
    idf = " + ".join(f"ln(1 + (s.n - s.df{i} + 0.5) / (s.df{i} + 0.5)) * m{i}" for i in range(terms))
    any_match = " + ".join(f"m{i}" for i in range(terms))
    return (
        f"WITH owned AS MATERIALIZED (SELECT id, length(fts) AS dl, {matches} FROM {{table}} WHERE {{owned}}),"  # noqa: S608
        f" s AS MATERIALIZED (SELECT count(*)::float AS n, greatest(avg(dl), 1)::float AS avgdl, {dfs} FROM owned)"
        f" SELECT id, ({idf}) * {BM25_K1 + 1} / (1 + {BM25_K1} * (1 - {BM25_B} + {BM25_B} * dl / s.avgdl)) AS score"
        f" FROM owned, s WHERE {any_match} > 0 ORDER BY score DESC, id LIMIT %s"
    )


def _tsquery(lexeme: str) -> str:
    return "'" + lexeme.replace("\\", "\\\\").replace("'", "''") + "'"


def lexical_ranking(scope: MemoryScope, query: str, *, limit: int, filters: dict[str, Any] | None = None) -> list[str]:
    owned, owned_params = _owned_clause(filters)
    with connection.cursor() as cursor:
        cursor.execute("SELECT tsvector_to_array(to_tsvector('english', %s))", [query])
        lexemes = (cursor.fetchone()[0] or [])[:MAX_QUERY_TERMS]
        if not lexemes:
            return []
        statement = sql.SQL(_bm25_statement(len(lexemes))).format(table=_table(), owned=owned)
        params = [*(_tsquery(lexeme) for lexeme in lexemes), scope.engine_user_id, *owned_params, limit]
        cursor.execute(statement.as_string(cursor.connection), params)
        return [str(row[0]) for row in cursor.fetchall()]


def fuse(rankings: list[tuple[list[str], float]], *, k: int) -> list[tuple[str, float]]:
    """Weighted reciprocal rank fusion: sum of weight / (k + rank) over the rankings."""
    scores: dict[str, float] = {}
    for ids, weight in rankings:
        for rank, memory_id in enumerate(ids, start=1):
            scores[memory_id] = scores.get(memory_id, 0.0) + weight / (k + rank)
    return sorted(scores.items(), key=lambda pair: (-pair[1], pair[0]))


def _load(ids: list[str]) -> dict[str, EngineMemory]:
    if not ids:
        return {}
    query = sql.SQL("SELECT id, payload FROM {} WHERE id = ANY(%s::uuid[])").format(_table())
    with connection.cursor() as cursor:
        cursor.execute(query.as_string(cursor.connection), [ids])
        rows = cursor.fetchall()
    loaded = {}
    for memory_id, payload in rows:
        payload = payload if isinstance(payload, dict) else json.loads(payload)
        loaded[str(memory_id)] = engine_memory_from_row(memory_id, payload)
    return loaded


@engine_timed_function("hybrid_search")  # memsite_engine_duration_seconds
def hybrid_search(
    scope: MemoryScope, *, query: str, limit: int, filters: dict[str, Any] | None = None
) -> list[EngineMemory]:
    """The best `limit` memories for `query`, each with its fused score."""
    candidates = max(limit, settings.SEARCH_CANDIDATES)
    rankings = []
    if settings.SEARCH_VECTOR_WEIGHT > 0:
        vector = engine_embed_query(query)
        rankings.append(
            (vector_ranking(scope, vector, limit=candidates, filters=filters), settings.SEARCH_VECTOR_WEIGHT)
        )
    if settings.SEARCH_LEXICAL_WEIGHT > 0:
        rankings.append(
            (lexical_ranking(scope, query, limit=candidates, filters=filters), settings.SEARCH_LEXICAL_WEIGHT)
        )
    fused = fuse(rankings, k=settings.SEARCH_RRF_K)[:limit]
    loaded = _load([memory_id for memory_id, _ in fused])
    return [replace(loaded[memory_id], score=score) for memory_id, score in fused if memory_id in loaded]
