"""DDL for mem0's pgvector tables. Created by a migration, never by mem0 at run time:
two processes creating them at once race, and we want our own indexes."""

import functools
from typing import Any

import numpy
from django.conf import settings
from django.db import DatabaseError, transaction
from psycopg import sql


def vector_table_names() -> list[str]:
    return [settings.MEMORY_COLLECTION, f"{settings.MEMORY_COLLECTION}_entities"]


def _drop_index(schema_editor: Any, name: str) -> None:
    schema_editor.execute(sql.SQL("DROP INDEX IF EXISTS {}").format(sql.Identifier(name)).as_string())


def _fulltext_index_name() -> str:
    return f"{settings.MEMORY_COLLECTION}_fts_idx"


# The search's own test for a live row (retrieval._owned_clause), as the predicate of the
# indexes only search uses, so the planner can use them for it. See create_live_search_indexes.
LIVE_ROWS = sql.SQL(" WHERE NOT trashed")


def _create_fulltext_index(schema_editor: Any, *, live_only: bool = False) -> None:
    """The one-column GIN index on `fts` (where btree_gin is missing: see
    create_owner_fulltext_index)."""
    schema_editor.execute(
        sql.SQL("CREATE INDEX IF NOT EXISTS {} ON {} USING gin (fts){}")
        .format(
            sql.Identifier(_fulltext_index_name()),
            sql.Identifier(settings.MEMORY_COLLECTION),
            LIVE_ROWS if live_only else sql.SQL(""),
        )
        .as_string()
    )


def create_vector_tables(schema_editor: Any) -> None:
    schema_editor.execute("CREATE EXTENSION IF NOT EXISTS vector")
    for table in vector_table_names():
        statements = [
            sql.SQL("CREATE TABLE IF NOT EXISTS {} (id uuid PRIMARY KEY, vector vector({}), payload jsonb)").format(
                sql.Identifier(table), sql.Literal(settings.EMBEDDING_DIMS)
            ),
            # Every engine query filters on the owner: exact scan within one user.
            sql.SQL("CREATE INDEX IF NOT EXISTS {} ON {} ((payload->>'user_id'))").format(
                sql.Identifier(f"{table}_user_id_idx"), sql.Identifier(table)
            ),
            _lemmas_index_statement(table),
        ]
        for statement in statements:
            schema_editor.execute(statement.as_string())


def _lemmas_index_name(table: str) -> str:
    return f"{table}_text_lemmatized_idx"


def _lemmas_index_statement(table: str) -> sql.Composed:
    # mem0's own index, created with the tables (migration 0001) and dropped by 0022.
    return sql.SQL(
        "CREATE INDEX IF NOT EXISTS {} ON {} USING gin (to_tsvector('simple', payload->>'text_lemmatized'))"
    ).format(sql.Identifier(_lemmas_index_name(table)), sql.Identifier(table))


def drop_lemmas_index(schema_editor: Any) -> None:
    """mem0's index for its own keyword search (`Memory.search`), which the engine never
    calls: every write paid for it (retrieval.py searches the `fts` column instead)."""
    _drop_index(schema_editor, _lemmas_index_name(settings.MEMORY_COLLECTION))


def create_lemmas_index(schema_editor: Any) -> None:
    schema_editor.execute(_lemmas_index_statement(settings.MEMORY_COLLECTION).as_string())


def create_paging_index(schema_editor: Any) -> None:
    """Keyset paging of one user's memories in creation order (list_memory)."""
    table = settings.MEMORY_COLLECTION
    schema_editor.execute(
        sql.SQL("CREATE INDEX IF NOT EXISTS {} ON {} ((payload->>'user_id'), (payload->>'created_at'), id)")
        .format(sql.Identifier(f"{table}_user_created_idx"), sql.Identifier(table))
        .as_string()
    )


def _trash_order_index_name() -> str:
    return f"{settings.MEMORY_COLLECTION}_trash_order_idx"


def create_trash_order_index(schema_editor: Any) -> None:
    """A user's trash in its order, most recently trashed first (lifecycle.engine_trashed):
    the Trash page and GET /v1/trash seek a page's position in it instead of reading and
    sorting every trashed row of the user per page. Partial on `trashed`: live rows, most
    of the table, are neither in it nor written to it. Built CONCURRENTLY like the admin's
    indexes (create_admin_indexes), so memory writes go on while it reads the table."""
    name = _trash_order_index_name()
    if _index_invalid(schema_editor, name):
        _drop_index_concurrently(schema_editor, name)
    schema_editor.execute(
        sql.SQL(
            "CREATE INDEX CONCURRENTLY IF NOT EXISTS {} ON {}"
            " ((payload->>'user_id'), (payload->'trash'->>'at') DESC, id) WHERE trashed"
        )
        .format(sql.Identifier(name), sql.Identifier(settings.MEMORY_COLLECTION))
        .as_string()
    )


def drop_trash_order_index(schema_editor: Any) -> None:
    _drop_index_concurrently(schema_editor, _trash_order_index_name())


def create_fulltext_column(schema_editor: Any) -> None:
    """A stored tsvector of the memory text, for the lexical half of hybrid search."""
    table = sql.Identifier(settings.MEMORY_COLLECTION)
    schema_editor.execute(
        sql.SQL(
            "ALTER TABLE {} ADD COLUMN IF NOT EXISTS fts tsvector"
            " GENERATED ALWAYS AS (to_tsvector('english', coalesce(payload->>'data', ''))) STORED"
        )
        .format(table)
        .as_string()
    )
    _create_fulltext_index(schema_editor)


def owner_fulltext_index_name() -> str:
    return f"{settings.MEMORY_COLLECTION}_owner_fts_idx"


def create_owner_fulltext_index(schema_editor: Any) -> bool:
    """BM25 matches query terms among one user's rows only (retrieval._bm25_statement), but
    the one-column GIN index on `fts` returns every user's rows holding a term, which the
    owner test then throws away: the cost grows with the table, not the user. A two-column
    GIN index (owner, fts), through contrib's btree_gin, intersects the owner's posting list
    with the terms' inside the index. Measured at 100k rows, 10 users of 10k: the BM25
    statement 23 -> 15.5 ms. Every fts query names its owner, so it replaces the one-column
    index. Without btree_gin (a server that does not offer it), the one-column index stays:
    returns whether the two-column one was built."""
    connection = schema_editor.connection
    try:
        # A savepoint: a refused CREATE EXTENSION must not abort the migration's transaction.
        with transaction.atomic(using=connection.alias):
            schema_editor.execute("CREATE EXTENSION IF NOT EXISTS btree_gin")
    except DatabaseError:
        return False
    _create_owner_fulltext_index(schema_editor, live_only=False)
    _drop_index(schema_editor, _fulltext_index_name())
    return True


def _create_owner_fulltext_index(schema_editor: Any, *, live_only: bool) -> None:
    schema_editor.execute(
        sql.SQL("CREATE INDEX IF NOT EXISTS {} ON {} USING gin ((payload->>'user_id'), fts){}")
        .format(
            sql.Identifier(owner_fulltext_index_name()),
            sql.Identifier(settings.MEMORY_COLLECTION),
            LIVE_ROWS if live_only else sql.SQL(""),
        )
        .as_string()
    )


def drop_owner_fulltext_index(schema_editor: Any) -> None:
    """Back to the one-column fts index (the extension stays: other objects may use it)."""
    _create_fulltext_index(schema_editor)
    _drop_index(schema_editor, owner_fulltext_index_name())


def hnsw_opclass(*, normalised: bool | None = None) -> str:
    """The operator class matching retrieval's distance operator (inner product for unit
    length vectors, cosine otherwise): the planner only uses an index whose operator
    matches the ORDER BY."""
    if normalised is None:
        normalised = settings.EMBEDDER == "local"
    return "vector_ip_ops" if normalised else "vector_cosine_ops"


def hnsw_index_name() -> str:
    return f"{settings.MEMORY_COLLECTION}_vector_hnsw_idx"


def hnsw_index_statement(*, normalised: bool | None = None, live_only: bool = True) -> sql.Composed:
    """The HNSW index over live rows (see create_live_search_indexes); `live_only=False`
    is the index as migration 0010 first built it, for migrating back."""
    return sql.SQL(
        "CREATE INDEX IF NOT EXISTS {} ON {} USING hnsw (vector {}) WITH (m = 16, ef_construction = 64){}"
    ).format(
        sql.Identifier(hnsw_index_name()),
        sql.Identifier(settings.MEMORY_COLLECTION),
        sql.SQL(hnsw_opclass(normalised=normalised)),
        LIVE_ROWS if live_only else sql.SQL(""),
    )


def create_hnsw_index(schema_editor: Any) -> None:
    """HNSW over every user's vectors, searched with a user filter and iterative scans
    (pgvector >= 0.8) for users large enough that an exact scan costs more."""
    schema_editor.execute(hnsw_index_statement(live_only=False).as_string())


def live_owner_index_name() -> str:
    return f"{settings.MEMORY_COLLECTION}_live_user_id_idx"


# The owner of a live row, NULL for a trashed one: the key of an owner index whose lookup
# finds only live rows (retrieval's exact scan states `LIVE_OWNER = owner`). An expression,
# not a partial index on `NOT trashed`: the planner may scan a partial index whole for its
# predicate alone, and chose that (a bitmap of every live row in the table, 110-176 ms)
# over the HNSW index for the large users' search, which states `NOT trashed` too.
LIVE_OWNER = "(CASE WHEN NOT trashed THEN payload->>'user_id' END)"

# Enough for pgvector to build the graph of a million 384-d rows in memory (it falls back
# to a far slower build on disk beyond it); Postgres allocates it only as the graph grows.
INDEX_BUILD_MEMORY = "1GB"


def _index_exists(schema_editor: Any, name: str) -> bool:
    with schema_editor.connection.cursor() as cursor:
        cursor.execute("SELECT to_regclass(%s) IS NOT NULL", [name])
        return bool(cursor.fetchone()[0])


def _rebuild_search_indexes(schema_editor: Any, *, live_only: bool) -> None:
    schema_editor.execute(f"SET LOCAL maintenance_work_mem = '{INDEX_BUILD_MEMORY}'")
    _drop_index(schema_editor, hnsw_index_name())
    schema_editor.execute(hnsw_index_statement(live_only=live_only).as_string())
    # (owner, fts) where btree_gin was available (migration 0017), fts alone otherwise.
    if _index_exists(schema_editor, owner_fulltext_index_name()):
        _drop_index(schema_editor, owner_fulltext_index_name())
        _create_owner_fulltext_index(schema_editor, live_only=live_only)
    else:
        _drop_index(schema_editor, _fulltext_index_name())
        _create_fulltext_index(schema_editor, live_only=live_only)


def create_live_search_indexes(schema_editor: Any) -> None:
    """Search's indexes hold live rows only. A trashed memory stays in the table for
    TRASH_RETENTION_DAYS, and while the HNSW graph and the full-text index held it, every
    search that met it stepped past it: a user who cleared 10,000 memories and imported
    them again five times (50,000 trashed copies) searched at p95 162 ms instead of 20 ms,
    and their exact scans (a smaller user's plan) read every trashed row too (228 ms). The
    HNSW and full-text indexes are rebuilt with the predicate `NOT trashed`, and an owner
    index keyed on LIVE_OWNER serves the exact scan. The trash's own queries (listing,
    restore, purge) find the user's rows through the paging index (owner, created_at, id)."""
    _rebuild_search_indexes(schema_editor, live_only=True)
    schema_editor.execute(
        sql.SQL("CREATE INDEX IF NOT EXISTS {} ON {} ({})")
        .format(
            sql.Identifier(live_owner_index_name()),
            sql.Identifier(settings.MEMORY_COLLECTION),
            sql.SQL(LIVE_OWNER),  # a constant of ours
        )
        .as_string()
    )


def drop_owner_index(schema_editor: Any) -> None:
    """The one-column owner index goes: the paging index (owner, created_at, id) serves every
    owner lookup as well, and while both existed the planner could pick the wrong one. For a
    user the table's statistics do not know yet (new, or grown since the last ANALYZE) it
    estimates one row, and the neighbour probes (retrieval._neighbours: the row just before
    and after a memory in creation order) then read every row of the user through the owner
    index and sorted them, instead of one row from the paging index: 600 ms a search at
    10,000 memories, until autovacuum analysed the table."""
    _drop_index(schema_editor, f"{settings.MEMORY_COLLECTION}_user_id_idx")


def create_owner_index(schema_editor: Any) -> None:
    table = settings.MEMORY_COLLECTION
    schema_editor.execute(
        sql.SQL("CREATE INDEX IF NOT EXISTS {} ON {} ((payload->>'user_id'))")
        .format(sql.Identifier(f"{table}_user_id_idx"), sql.Identifier(table))
        .as_string()
    )


def drop_live_search_indexes(schema_editor: Any) -> None:
    _drop_index(schema_editor, live_owner_index_name())
    _rebuild_search_indexes(schema_editor, live_only=False)


def drop_hnsw_index(schema_editor: Any) -> None:
    _drop_index(schema_editor, hnsw_index_name())


# A row (vector 1.5 kB at 384 dims, payload ~0.5 kB, tsvector) is a little over the default
# 2 kB TOAST threshold, so Postgres moved every vector out of line: each distance computed
# fetched it from the TOAST table (3 buffer reads per row; an exact scan of 1,000 rows
# touched 3,000 pages for 85). Up to this size rows stay inline.
TOAST_TUPLE_TARGET = 4096


def keep_vectors_inline(schema_editor: Any, *, rewrite: bool = True) -> None:
    """Raise the table's TOAST threshold; `rewrite` moves existing out-of-line vectors back
    in (VACUUM FULL: a rewrite under an exclusive lock, skipped when nothing is out of line)."""
    table = sql.Identifier(settings.MEMORY_COLLECTION)
    schema_editor.execute(
        sql.SQL("ALTER TABLE {} SET (toast_tuple_target = {})")
        .format(table, sql.Literal(TOAST_TUPLE_TARGET))
        .as_string()
    )
    if not rewrite:
        return
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_relation_size(reltoastrelid) FROM pg_class WHERE oid = %s::regclass",
            [settings.MEMORY_COLLECTION],
        )
        row = cursor.fetchone()
    if row and row[0]:
        schema_editor.execute(sql.SQL("VACUUM FULL {}").format(table).as_string())


# Deleted and updated memories leave dead rows in the HNSW graph until VACUUM removes them,
# and an index scan spends its candidate budget (ef_search) on them: at 110k rows with 10k
# just deleted, vector recall against an exact scan fell from 0.9986 to 0.9788 until a
# VACUUM. Postgres' autovacuum waits by default until 20 % of a table is dead (200,000 rows
# of a million-row table); this table is vacuumed from 2 %.
AUTOVACUUM_VACUUM_SCALE_FACTOR = 0.02


def _set_table_option(schema_editor: Any, option: str, value: float | None) -> None:
    """ALTER TABLE SET (option = value) on the engine's table, or RESET (option) for None."""
    table = sql.Identifier(settings.MEMORY_COLLECTION)
    statement = (
        sql.SQL("ALTER TABLE {} RESET ({})").format(table, sql.SQL(option))
        if value is None
        else sql.SQL("ALTER TABLE {} SET ({} = {})").format(table, sql.SQL(option), sql.Literal(value))
    )
    schema_editor.execute(statement.as_string())  # `option`: constants of ours, no input


def vacuum_sooner(schema_editor: Any) -> None:
    _set_table_option(schema_editor, "autovacuum_vacuum_scale_factor", AUTOVACUUM_VACUUM_SCALE_FACTOR)


def vacuum_at_default(schema_editor: Any) -> None:
    _set_table_option(schema_editor, "autovacuum_vacuum_scale_factor", None)


# Postgres estimates a value missing from the table's statistics at one row when every
# known value is among the most common, as the owners of a table with few users all are: a
# new user's searches are then planned as for one row (BM25 took the paging index and read
# every row of the user: 12 ms instead of 3.9 ms at 10,000 memories) until autovacuum
# analyses the table, which by default waits for 10 % of its rows to change. From 2 %, a
# new user is known long before they reach the large users' plan (5,000 memories).
AUTOVACUUM_ANALYZE_SCALE_FACTOR = 0.02


def analyze_sooner(schema_editor: Any) -> None:
    _set_table_option(schema_editor, "autovacuum_analyze_scale_factor", AUTOVACUUM_ANALYZE_SCALE_FACTOR)


def analyze_at_default(schema_editor: Any) -> None:
    _set_table_option(schema_editor, "autovacuum_analyze_scale_factor", None)


def create_payload_index(schema_editor: Any) -> None:
    """Field filters (`payload @> {...}`: memory type, tags, agent, session, metadata) found
    through a GIN index instead of a scan of every row: a filtered search then sorts only
    the matching rows by distance, exactly (measured at 12k rows, 1 in 20 matching: 15 ms
    sequential scan -> 1.6 ms)."""
    schema_editor.execute(
        sql.SQL("CREATE INDEX IF NOT EXISTS {} ON {} USING gin (payload jsonb_path_ops)")
        .format(
            sql.Identifier(f"{settings.MEMORY_COLLECTION}_payload_path_idx"), sql.Identifier(settings.MEMORY_COLLECTION)
        )
        .as_string()
    )


def drop_payload_index(schema_editor: Any) -> None:
    _drop_index(schema_editor, f"{settings.MEMORY_COLLECTION}_payload_path_idx")


def reset_toast_target(schema_editor: Any) -> None:
    table = sql.Identifier(settings.MEMORY_COLLECTION)
    schema_editor.execute(sql.SQL("ALTER TABLE {} RESET (toast_tuple_target)").format(table).as_string())


def create_lifecycle_columns(schema_editor: Any) -> None:
    """Trash and expiry as plain stored columns (issue 11): search checks them for every
    row of the user it scans, and reading two columns costs far less than parsing each
    row's jsonb payload (measured: the payload test doubled the vector scan at 10k)."""
    table = sql.Identifier(settings.MEMORY_COLLECTION)
    for column, expression in (
        ("trashed", "(payload ? 'trash')"),
        ("expires_at", "(payload->'attrs'->>'expires_at')"),
    ):
        schema_editor.execute(
            sql.SQL("ALTER TABLE {} ADD COLUMN IF NOT EXISTS {} {} GENERATED ALWAYS AS {} STORED")
            .format(
                table,
                sql.Identifier(column),
                sql.SQL("boolean" if column == "trashed" else "text"),
                sql.SQL(expression),  # constants of ours, no input
            )
            .as_string()
        )


def drop_lifecycle_columns(schema_editor: Any) -> None:
    table = sql.Identifier(settings.MEMORY_COLLECTION)
    for column in ("trashed", "expires_at"):
        schema_editor.execute(
            sql.SQL("ALTER TABLE {} DROP COLUMN IF EXISTS {}").format(table, sql.Identifier(column)).as_string()
        )


def drop_fulltext_column(schema_editor: Any) -> None:
    table = sql.Identifier(settings.MEMORY_COLLECTION)
    schema_editor.execute(sql.SQL("ALTER TABLE {} DROP COLUMN IF EXISTS fts").format(table).as_string())


# --- the forensic admin's indexes (migration 0027) ----------------------------------------
def admin_created_index_name() -> str:
    return f"{settings.MEMORY_COLLECTION}_created_idx"


def trash_fulltext_index_name() -> str:
    return f"{settings.MEMORY_COLLECTION}_trash_fts_idx"


# The live rows' full-text index (LIVE_ROWS) and this one together cover every row.
TRASHED_ROWS = sql.SQL(" WHERE trashed")


def _admin_index_statements() -> dict[str, sql.Composed]:
    table = sql.Identifier(settings.MEMORY_COLLECTION)
    return {
        # The unfiltered memories page, newest first (payload.engine_rows_newest_first):
        # 100 entries read backwards instead of a sort of every row of every user. Keyed
        # on the jsonb value, whose order is its text's, not on the text the engine's own
        # queries compare: with an index of the text, the planner took it for a large
        # user's neighbour probes (the rows just before and after a memory, which the
        # paging index finds at once) and walked every user's rows testing the owner.
        admin_created_index_name(): sql.SQL("ON {} ((payload->'created_at'), id)").format(table),
        # The word search over trashed rows: search's own full-text index holds live rows
        # only (create_live_search_indexes), and staff look for trashed memories too. It
        # holds only the trash (kept TRASH_RETENTION_DAYS): a new memory adds nothing to it.
        trash_fulltext_index_name(): sql.SQL("ON {} USING gin (fts){}").format(table, TRASHED_ROWS),
    }


def create_admin_indexes(schema_editor: Any) -> None:
    """Built CONCURRENTLY (the migration is not atomic): a plain CREATE INDEX would block
    every memory write while it reads the whole table. A build that failed halfway leaves
    an invalid index of that name, which IF NOT EXISTS would keep: it is dropped first."""
    for name, definition in _admin_index_statements().items():
        if _index_invalid(schema_editor, name):
            _drop_index_concurrently(schema_editor, name)
        schema_editor.execute(
            sql.SQL("CREATE INDEX CONCURRENTLY IF NOT EXISTS {} {}")
            .format(sql.Identifier(name), definition)
            .as_string()
        )


def drop_admin_indexes(schema_editor: Any) -> None:
    for name in _admin_index_statements():
        _drop_index_concurrently(schema_editor, name)


def _index_invalid(schema_editor: Any, name: str) -> bool:
    with schema_editor.connection.cursor() as cursor:
        cursor.execute("SELECT NOT indisvalid FROM pg_index WHERE indexrelid = to_regclass(%s)", [name])
        row = cursor.fetchone()
    return bool(row and row[0])


def _drop_index_concurrently(schema_editor: Any, name: str) -> None:
    schema_editor.execute(sql.SQL("DROP INDEX CONCURRENTLY IF EXISTS {}").format(sql.Identifier(name)).as_string())


def drop_paging_index(schema_editor: Any) -> None:
    _drop_index(schema_editor, f"{settings.MEMORY_COLLECTION}_user_created_idx")


def drop_vector_tables(schema_editor: Any) -> None:
    for table in vector_table_names():
        schema_editor.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(table)).as_string())


def vector_table_dims(cursor: Any, table: str) -> int | None:
    cursor.execute(
        "SELECT atttypmod FROM pg_attribute WHERE attrelid = to_regclass(%s) AND attname = 'vector'",
        [table],
    )
    row = cursor.fetchone()
    return int(row[0]) if row else None


# --- vectors as pgvector's text -----------------------------------------------------------
def vector_text_stored(vector: list[float]) -> str:
    """A vector to store (written rows, re-embedding), exactly: Postgres rounds each float
    to float4 as it does for the float8[] mem0 sends. When every float is a float4 already
    (the local embedder's always are), 9 significant digits bring back that same float4, in
    one %-format over the tuple (a third of 384 reprs, ~0.4 ms per write); any other float
    keeps repr's every digit."""
    values = numpy.asarray(vector, dtype=numpy.float64)
    if (values.astype(numpy.float32) == values).all():
        return "[" + _floats_format(len(vector), 9) % tuple(vector) + "]"
    return "[" + ",".join(repr(float(x)) for x in vector) + "]"


def vector_text_query(vector: list[float]) -> str:
    """A query vector (compared, never stored): 7 significant digits, float4's precision,
    in one %-format over the tuple."""
    return "[" + _floats_format(len(vector), 7) % tuple(vector) + "]"


@functools.cache
def _floats_format(dims: int, digits: int) -> str:
    return ",".join([f"%.{digits}g"] * dims)
