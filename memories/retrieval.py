"""Hybrid retrieval over one user's memories: exact vector search plus BM25 over a
Postgres full-text index, fused by weighted reciprocal rank.

Vector search finds paraphrases; BM25 finds the exact tokens embeddings blur (names,
error codes, identifiers). Both run in Postgres on the engine's table; only the query
embedding comes from the engine.
"""

from __future__ import annotations

import json
from typing import Any

from django.conf import settings
from django.db import connection
from psycopg import sql

from memories.engine import EngineMemory, engine_embed_query
from memories.scope import MemoryScope

BM25_K1 = 1.2
BM25_B = 0.75

_CORE = {"data", "hash", "created_at", "updated_at", "user_id", "text_lemmatized", "role", "actor_id"}


def _table() -> sql.Identifier:
    return sql.Identifier(settings.MEMORY_COLLECTION)


def _owned_clause(filters: dict[str, Any] | None) -> tuple[sql.Composable, list[Any]]:
    clause = sql.SQL("payload->>'user_id' = %s")
    params: list[Any] = []
    if filters:
        clause = sql.SQL("{} AND payload @> %s::jsonb").format(clause)
        params.append(json.dumps(filters))
    return clause, params


def vector_ranking(scope: MemoryScope, vector: list[float], *, limit: int, filters=None) -> list[str]:
    owned, params = _owned_clause(filters)
    query = sql.SQL("SELECT id FROM {} WHERE {} ORDER BY vector <=> %s::vector LIMIT %s").format(_table(), owned)
    literal = "[" + ",".join(f"{x:.7g}" for x in vector) + "]"
    with connection.cursor() as cursor:
        cursor.execute(query.as_string(cursor.connection), [scope.engine_user_id, *params, literal, limit])
        return [str(row[0]) for row in cursor.fetchall()]


_BM25 = """
WITH owned AS MATERIALIZED (SELECT id, fts FROM {table} WHERE {owned}),
stats AS MATERIALIZED (SELECT count(*)::float AS n, greatest(avg(length(fts)), 1)::float AS avgdl FROM owned),
terms AS MATERIALIZED (
    SELECT t AS lexeme, (SELECT count(*) FROM owned WHERE fts @@ quote_literal(t)::tsquery)::float AS df
    FROM unnest(%s::text[]) AS t
),
matched AS (SELECT id, fts, length(fts)::float AS dl FROM owned WHERE fts @@ %s::tsquery)
SELECT m.id,
       sum(ln(1 + (s.n - t.df + 0.5) / (t.df + 0.5))
           * (cardinality(u.positions) * ({k1} + 1))
           / (cardinality(u.positions) + {k1} * (1 - {b} + {b} * m.dl / s.avgdl))) AS score
FROM matched m CROSS JOIN stats s
CROSS JOIN LATERAL unnest(m.fts) AS u
JOIN terms t ON t.lexeme = u.lexeme
GROUP BY m.id
ORDER BY score DESC, m.id
LIMIT %s
"""


def lexical_ranking(scope: MemoryScope, query: str, *, limit: int, filters=None) -> list[str]:
    owned, params = _owned_clause(filters)
    with connection.cursor() as cursor:
        cursor.execute("SELECT tsvector_to_array(to_tsvector('english', %s))", [query])
        lexemes = cursor.fetchone()[0] or []
        if not lexemes:
            return []
        any_term = " | ".join("'" + lexeme.replace("'", "''").replace("\\", "\\\\") + "'" for lexeme in lexemes)
        statement = sql.SQL(_BM25.format(table="{table}", owned="{owned}", k1=BM25_K1, b=BM25_B)).format(
            table=_table(), owned=owned
        )
        cursor.execute(
            statement.as_string(cursor.connection), [scope.engine_user_id, *params, lexemes, any_term, limit]
        )
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
        loaded[str(memory_id)] = EngineMemory(
            id=str(memory_id),
            text=payload.get("data", ""),
            user_id=payload.get("user_id", ""),
            metadata={k: v for k, v in payload.items() if k not in _CORE},
            created_at=payload.get("created_at"),
            updated_at=payload.get("updated_at"),
        )
    return loaded


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
    return [
        EngineMemory(**{**loaded[memory_id].__dict__, "score": score})
        for memory_id, score in fused
        if memory_id in loaded
    ]
