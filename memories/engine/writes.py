"""Verbatim writes to the engine's table through Django's connection, so they commit in
the caller's transaction together with the dedupe hash, usage event and audit row.

mem0 writes on its own connection pool and commits on its own: a crash between its
commit and ours left a memory without its records (issue 10, D1). For the verbatim
paths (remember, update, delete, clear all: no LLM) the engine writes the row itself,
with exactly the payload and history rows mem0 writes (`Memory._create_memory`,
`_update_memory`, `_delete_memory`), so mem0's own reads (ingest's dedup, `get`) keep
working. The slow part, the embedding, happens before the transaction
(`engine_embed_text`); every function below must run inside `transaction.atomic()`.

Entity links (mem0's `<collection>_entities`, derived data that mem0 itself maintains
best-effort and that is empty without spaCy) are refreshed after commit."""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, cast

from django.conf import settings
from django.db import connection, transaction
from psycopg import sql

from core.metrics import engine_timed_function
from core.scope import MemoryScope
from memories.engine.embedders import (
    EmbedderSpec,
    added_specs_take,
    embed_batch_with,
    embedder_for,
    embedder_spec_configured,
    embedder_spec_refresh,
)
from memories.engine.history_store import PostgresHistoryStore, history_versions_add
from memories.engine.mem0_adapter import EngineError, _call, get_memory
from memories.engine.payload import (
    KEY_ATTRS,
    KEY_CREATED_AT,
    KEY_RECALL,
    KEY_REQUEST_ID,
    KEY_TEXT,
    KEY_UPDATED_AT,
    KEY_USER_ID,
    LEGACY_LEMMAS_KEY,
    EngineMemory,
    MemoryAttrs,
    engine_memory_from_row,
)
from memories.engine.vector_schema import vector_text_stored

logger = logging.getLogger(__name__)

# mem0 refuses these in metadata (scope comes from the call, never from metadata).
_IDENTITY_KEYS = frozenset({"user_id", "agent_id", "run_id", "actor_id"})
_history = PostgresHistoryStore()


@dataclass(frozen=True)
class EmbeddedText:
    """A text with its vector, computed outside any transaction, and the embedder that
    made it (the write checks it is still the table's: `manage.py reembed` may have
    switched meanwhile)."""

    text: str
    vector: list[float]
    spec: EmbedderSpec


def engine_embed_text(text: str) -> EmbeddedText:
    """The slow half of a write (embedding): call it before opening the transaction."""
    get_memory()  # first: it turns mem0's telemetry off before mem0 is imported
    from memories.engine.embedders import embedder_spec_active

    spec = embedder_spec_active()
    vector = cast(list[float], _call("embed", embedder_for(spec).embed, text, "add"))
    return EmbeddedText(text=text, vector=list(vector), spec=spec)


def engine_embed_texts(texts: list[str]) -> list[EmbeddedText]:
    """`engine_embed_text` for many texts (an import): the embedder's batch call when it
    has one, so the model runs on batches instead of one sentence at a time."""
    if not texts:
        return []
    get_memory()
    from memories.engine.embedders import embedder_spec_active

    spec = embedder_spec_active()
    vectors = cast(list[list[float]], _call("embed", embed_batch_with, embedder_for(spec), texts, "add"))
    if len(vectors) != len(texts):
        raise EngineError("the embedder returned a different number of vectors than texts")
    return [
        EmbeddedText(text=text, vector=list(vector), spec=spec) for text, vector in zip(texts, vectors, strict=True)
    ]


def _require_transaction() -> None:
    if not connection.in_atomic_block:
        raise RuntimeError("engine writes must run inside the caller's transaction.atomic()")


def _table_write_lock() -> None:
    """The lock INSERT and UPDATE take anyway (writers do not block each other), taken
    before any row lock: `engine_reembed_switch` (SHARE ROW EXCLUSIVE) then either waits
    for this transaction or this one for the switch, never each for the other (a writer
    holding a row lock and waiting for the table lock while the switch, holding it,
    waits for the row would be a deadlock)."""
    with connection.cursor() as cursor:
        cursor.execute(sql.SQL("LOCK TABLE {} IN ROW EXCLUSIVE MODE").format(_table()).as_string(cursor.connection))


def _table_embedder_locked() -> EmbedderSpec:
    """The embedder of the table's vectors, fixed until the caller's transaction ends (no
    switch can happen under `_table_write_lock`). Read from the database, not from the
    per-process cache, which may lag a switch by ACTIVE_TTL_S."""
    with connection.cursor() as cursor:
        return _table_embedder_locked_on(cursor)


def _table_embedder_locked_on(cursor: Any) -> EmbedderSpec:
    """`_table_embedder_locked` in the transaction of `cursor` (Django's or mem0's pool's)."""
    from memories.models import EmbedderState

    # One round trip for both statements (no parameters: the simple query protocol takes
    # several, one result each): every write pays it.
    meta = EmbedderState._meta
    column = {field.name: str(field.column) for field in meta.concrete_fields}
    columns = [column["name"], column["dims"], column["id"]]
    statement = sql.SQL("LOCK TABLE {} IN ROW EXCLUSIVE MODE; SELECT {}, {} FROM {} WHERE {} = 1").format(
        _table(),
        sql.Identifier(columns[0]),
        sql.Identifier(columns[1]),
        sql.Identifier(meta.db_table),
        sql.Identifier(columns[2]),
    )
    cursor.execute(statement.as_string(cursor.connection))
    cursor.nextset()  # past the lock's result, to the state's row
    row = cursor.fetchone()
    return EmbedderSpec(row[0], int(row[1])) if row else embedder_spec_configured()


def mem0_inserts_checked(vector_store: Any) -> None:
    """mem0's own inserts (an ingest's facts, `engine_add_text`) made as ours are across a
    `manage.py reembed` switch: in one transaction on mem0's connection that takes the
    table's write lock and reads its embedder first, so vectors made by the embedder the
    table switched away from (`embedders.added_specs_take`) are made again with the
    table's. With equal dimensions they would be stored silently and compared across
    models ever after; with others the insert failed. The statement is mem0's own."""
    statement = sql.SQL("INSERT INTO {} (id, vector, payload) VALUES (%s, %s, %s)").format(_table())

    def insert(
        vectors: list[list[float]], payloads: list[dict[str, Any]] | None = None, ids: list[str] | None = None
    ) -> None:
        made_by = added_specs_take()
        vector_store._ensure_collection()  # as mem0's insert does (a no-op once the table is known)
        payloads = payloads if payloads is not None else [{} for _ in vectors]
        ids = ids if ids is not None else [str(uuid.uuid4()) for _ in vectors]
        with vector_store._get_cursor(commit=True) as cursor:
            current = _table_embedder_locked_on(cursor)
            if made_by - {current}:
                labels = ", ".join(sorted(spec.label for spec in made_by))
                logger.warning("an ingest raced the embedder switch (%s -> %s): embedding again", labels, current.label)
                vectors = _embedded_again([str(payload.get(KEY_TEXT, "")) for payload in payloads], current)
            rows = [(i, list(v), json.dumps(p)) for i, v, p in zip(ids, vectors, payloads, strict=True)]
            cursor.executemany(statement.as_string(cursor.connection), rows)

    vector_store.insert = insert


def _vector_for_table(embedded: EmbeddedText) -> list[float]:
    """`embedded`'s vector, or, when the table switched embedders after it was made (a
    write racing `manage.py reembed`), the text embedded again with the table's embedder.
    With equal dimensions the old vector would be stored silently and compared across
    models ever after. This embedding runs inside the transaction, only for the writes in
    flight across a switch (once each): retrying them all from the start instead would
    fail every caller's write at each switch."""
    current = _table_embedder_locked()
    if current == embedded.spec:
        return embedded.vector
    logger.warning("a write raced the embedder switch (%s -> %s): embedding again", embedded.spec.label, current.label)
    return _embedded_again([embedded.text], current)[0]


def _embedded_again(texts: list[str], spec: EmbedderSpec) -> list[list[float]]:
    """`texts` embedded with `spec`'s embedder, the table's since a switch that writes in
    flight raced (the per-process cache of the active embedder is dropped too)."""
    embedder_spec_refresh()
    vectors = cast(list[list[float]], _call("embed", embed_batch_with, embedder_for(spec), texts, "add"))
    if len(vectors) != len(texts) or any(len(vector) != spec.dims for vector in vectors):
        raise EngineError(f"the embedder did not return vectors of {spec.dims} dimensions")
    return [list(vector) for vector in vectors]


def _table() -> sql.Identifier:
    return sql.Identifier(settings.MEMORY_COLLECTION)


def _now() -> str:
    return datetime.now(UTC).isoformat()


def _md5(text: str) -> str:
    return hashlib.md5(text.encode()).hexdigest()  # noqa: S324 - mem0's payload hash, not security


@engine_timed_function("add")  # memsite_engine_duration_seconds
def engine_insert_text(
    scope: MemoryScope,
    *,
    embedded: EmbeddedText,
    metadata: dict[str, Any] | None = None,
    attrs: MemoryAttrs | None = None,
    memory_id: str | None = None,
) -> str:
    """Store a verbatim memory (what `Memory.add(infer=False)` stores for one user
    message) with its fields in the caller's transaction. Returns the new memory id
    (`memory_id` when the caller chose it: it claimed the text's hash under it first)."""
    _require_transaction()
    vector = _vector_for_table(embedded)
    memory_id = memory_id or str(uuid.uuid4())
    created_at = _now()
    payload = {k: v for k, v in (metadata or {}).items() if k not in _IDENTITY_KEYS}
    payload.update(
        {
            KEY_USER_ID: scope.engine_user_id,
            "role": "user",
            KEY_TEXT: embedded.text,
            "hash": _md5(embedded.text),
            KEY_CREATED_AT: created_at,
            KEY_UPDATED_AT: created_at,
            KEY_ATTRS: (attrs or MemoryAttrs()).as_payload(),
        }
    )
    statement = sql.SQL("INSERT INTO {} (id, vector, payload) VALUES (%s, %s::vector, %s::jsonb)").format(_table())
    with connection.cursor() as cursor:
        cursor.execute(
            statement.as_string(cursor.connection),
            [memory_id, vector_text_stored(vector), json.dumps(payload)],
        )
    _history.add_history(
        memory_id, None, embedded.text, "ADD", created_at=created_at, updated_at=created_at, role="user"
    )
    return memory_id


def engine_lock_owned(scope: MemoryScope, *, memory_id: str) -> EngineMemory | None:
    """The scope's memory, row-locked until the caller's transaction ends; None when it
    is missing or someone else's (callers answer both alike)."""
    _require_transaction()
    _table_write_lock()
    statement = sql.SQL("SELECT id, payload FROM {} WHERE id = %s AND payload->>'user_id' = %s FOR UPDATE").format(
        _table()
    )
    with connection.cursor() as cursor:
        cursor.execute(statement.as_string(cursor.connection), [memory_id, scope.engine_user_id])
        row = cursor.fetchone()
    if row is None:
        return None
    payload = row[1] if isinstance(row[1], dict) else json.loads(row[1])
    return engine_memory_from_row(row[0], payload)


def engine_lock_owned_many(
    scope: MemoryScope, *, memory_ids: list[str], skip_locked: bool = False
) -> dict[str, EngineMemory]:
    """`engine_lock_owned` for many ids in one statement: the scope's rows among them,
    row-locked, by id (missing and other users' ids are simply absent). `skip_locked`:
    a row another transaction holds is left out instead of waited for (SKIP LOCKED), for
    a caller that can do without it (consolidation): it then waits for no row at all."""
    _require_transaction()
    if not memory_ids:
        return {}
    _table_write_lock()
    statement = sql.SQL(
        "SELECT id, payload FROM {} WHERE id = ANY(%s::uuid[]) AND payload->>'user_id' = %s ORDER BY id {}"
    ).format(_table(), sql.SQL("FOR UPDATE SKIP LOCKED" if skip_locked else "FOR UPDATE"))
    return _locked_rows(statement, [memory_ids, scope.engine_user_id])


def engine_text_copies_locked(scope: MemoryScope, *, text: str) -> dict[str, EngineMemory]:
    """The scope's rows out of the trash whose text may equal `text` up to case and
    spacing, row-locked, by id: every word of it, through the owner's full-text index, or
    the exact text, through the payload index, for a text of stop words only. The caller
    compares the normalised texts."""
    _require_transaction()
    _table_write_lock()
    statement = sql.SQL(
        "SELECT id, payload FROM {} WHERE NOT trashed AND ((payload->>'user_id' = %s"
        " AND fts @@ plainto_tsquery('english', %s)) OR payload @> %s::jsonb) ORDER BY id FOR UPDATE"
    ).format(_table())
    exact = json.dumps({KEY_USER_ID: scope.engine_user_id, KEY_TEXT: text})
    return _locked_rows(statement, [scope.engine_user_id, text, exact])


def _locked_rows(statement: sql.Composable, params: list[Any]) -> dict[str, EngineMemory]:
    with connection.cursor() as cursor:
        cursor.execute(statement.as_string(cursor.connection), params)
        rows = cursor.fetchall()
    return {
        str(row_id): engine_memory_from_row(row_id, payload if isinstance(payload, dict) else json.loads(payload))
        for row_id, payload in rows
    }


def _payload_of(memory_id: str) -> dict[str, Any] | None:
    statement = sql.SQL("SELECT payload FROM {} WHERE id = %s").format(_table())
    with connection.cursor() as cursor:
        cursor.execute(statement.as_string(cursor.connection), [memory_id])
        row = cursor.fetchone()
    if row is None:
        return None
    return cast(dict[str, Any], row[0] if isinstance(row[0], dict) else json.loads(row[0]))


@engine_timed_function("update")  # memsite_engine_duration_seconds
def engine_update_row(
    memory_id: str,
    *,
    embedded: EmbeddedText | None,
    metadata: dict[str, Any] | None,
    attrs: MemoryAttrs | None = None,
) -> EngineMemory:
    """Change a memory's text (with its new vector), merge metadata and/or replace its
    fields, as mem0's `update()` does, in the caller's transaction. The row must be
    locked (`engine_lock_owned`). Other changes keep the vector: the text is the same."""
    _require_transaction()
    existing = _payload_of(memory_id)
    if existing is None:
        raise EngineError("memory engine update: no such row")
    previous = existing.get(KEY_TEXT)
    payload = dict(existing)
    if metadata:
        payload.update({k: v for k, v in metadata.items() if k not in _IDENTITY_KEYS or v == existing.get(k)})
    text = embedded.text if embedded is not None else previous
    if not isinstance(text, str):
        raise EngineError("memory engine update: the row has no text")
    payload[KEY_TEXT] = text
    payload["hash"] = _md5(text)
    payload.pop(LEGACY_LEMMAS_KEY, None)  # an older row's copy, which nothing reads
    if attrs is not None:
        payload[KEY_ATTRS] = attrs.as_payload()
    payload[KEY_CREATED_AT] = existing.get(KEY_CREATED_AT)
    payload[KEY_UPDATED_AT] = _now()
    with connection.cursor() as cursor:
        if embedded is not None:
            statement = sql.SQL("UPDATE {} SET vector = %s::vector, payload = %s::jsonb WHERE id = %s").format(_table())
            params = [vector_text_stored(_vector_for_table(embedded)), json.dumps(payload), memory_id]
        else:
            statement = sql.SQL("UPDATE {} SET payload = %s::jsonb WHERE id = %s").format(_table())
            params = [json.dumps(payload), memory_id]
        cursor.execute(statement.as_string(cursor.connection), params)
    _history.add_history(
        memory_id,
        previous,
        text,
        "UPDATE",
        created_at=payload[KEY_CREATED_AT],
        updated_at=payload[KEY_UPDATED_AT],
        actor_id=payload.get("actor_id"),
        role=payload.get("role"),
    )
    if embedded is not None and text != previous:
        _after_commit_relink(memory_id, text=text, user_id=str(payload.get(KEY_USER_ID, "")))
    return engine_memory_from_row(memory_id, payload)


def _deleted_history(memory_id: str, payload: dict[str, Any], *, now: str, keep_text: bool = True) -> dict[str, Any]:
    return {
        "memory_id": memory_id,
        # A deletion for good (keep_text=False) records that it happened, not the text.
        "old_memory": payload.get(KEY_TEXT, "") if keep_text else None,
        "new_memory": None,
        "event": "DELETE",
        "created_at": payload.get(KEY_CREATED_AT),
        "updated_at": now,
        "is_deleted": 1,
        "actor_id": payload.get("actor_id"),
        "role": payload.get("role"),
    }


@engine_timed_function("delete")  # memsite_engine_duration_seconds
def engine_delete_row(memory_id: str, *, keep_text: bool = True) -> bool:
    """Delete one memory (and write its DELETE history row) in the caller's transaction.
    `keep_text=False` (a purge: the content goes for good) writes the DELETE row without
    the memory's text; the caller blanks the earlier versions (`history_content_erase`)."""
    _require_transaction()
    statement = sql.SQL("DELETE FROM {} WHERE id = %s RETURNING payload").format(_table())
    with connection.cursor() as cursor:
        cursor.execute(statement.as_string(cursor.connection), [memory_id])
        row = cursor.fetchone()
    if row is None:
        return False
    payload = row[0] if isinstance(row[0], dict) else json.loads(row[0])
    _history.batch_add_history([_deleted_history(memory_id, payload, now=_now(), keep_text=keep_text)])
    _after_commit_unlink([memory_id], user_id=str(payload.get(KEY_USER_ID, "")))
    return True


@engine_timed_function("delete_all")  # memsite_engine_duration_seconds
def engine_delete_user_rows(scope: MemoryScope, *, keep_text: bool = True) -> list[str]:
    """Delete every memory of the user (a DELETE history row each, without the text when
    not `keep_text`, as engine_delete_row) and mem0's raw messages for them, in the
    caller's transaction. Returns the deleted ids."""
    _require_transaction()
    statement = sql.SQL("DELETE FROM {} WHERE payload->>'user_id' = %s RETURNING id, payload").format(_table())
    with connection.cursor() as cursor:
        cursor.execute(statement.as_string(cursor.connection), [scope.engine_user_id])
        rows = cursor.fetchall()
    now = _now()
    deleted = []
    records = []
    for memory_id, payload in rows:
        payload = payload if isinstance(payload, dict) else json.loads(payload)
        deleted.append(str(memory_id))
        records.append(_deleted_history(str(memory_id), payload, now=now, keep_text=keep_text))
    if records:
        _history.batch_add_history(records)
    _history.purge_messages(user_id=scope.engine_user_id)
    # The user's whole entity partition goes too, after commit (derived data).
    transaction.on_commit(lambda: _entities_purge(scope.engine_user_id))
    return deleted


def engine_purge_messages(scope: MemoryScope) -> int:
    """Remove mem0's raw messages of the user (they feed the next ingest's extraction),
    in the caller's transaction."""
    _require_transaction()
    return int(_history.purge_messages(user_id=scope.engine_user_id))


def engine_rows_from_request(*, request_id: str) -> list[EngineMemory]:
    """Rows mem0 wrote for the call `request_id` (tagged by `engine_ingest`)."""
    statement = sql.SQL("SELECT id, payload FROM {} WHERE payload->>%s = %s").format(_table())
    with connection.cursor() as cursor:
        cursor.execute(statement.as_string(cursor.connection), [KEY_REQUEST_ID, request_id])
        rows = cursor.fetchall()
    return [engine_memory_from_row(r[0], r[1] if isinstance(r[1], dict) else json.loads(r[1])) for r in rows]


# --- entity links: derived, best effort, after commit (as mem0 treats them) -------------------
def _after_commit_relink(memory_id: str, *, text: str, user_id: str) -> None:
    def relink() -> None:
        try:
            memory = get_memory()
            memory._remove_memory_from_entity_store(memory_id, {"user_id": user_id})
            memory._link_entities_for_memory(memory_id, text, {"user_id": user_id})
        except Exception as exc:  # mem0 swallows these too; the memory itself is committed
            logger.warning("entity links not refreshed: %s", type(exc).__name__)

    transaction.on_commit(relink)


def _after_commit_unlink(memory_ids: list[str], *, user_id: str) -> None:
    def unlink() -> None:
        try:
            memory = get_memory()
            for memory_id in memory_ids:
                memory._remove_memory_from_entity_store(memory_id, {"user_id": user_id})
        except Exception as exc:
            logger.warning("entity links not removed: %s", type(exc).__name__)

    transaction.on_commit(unlink)


def _entities_purge(user_id: str) -> None:
    table = sql.Identifier(f"{settings.MEMORY_COLLECTION}_entities")
    try:
        with connection.cursor() as cursor:
            statement = sql.SQL("DELETE FROM {} WHERE payload->>'user_id' = %s").format(table)
            cursor.execute(statement.as_string(cursor.connection), [user_id])
    except Exception as exc:
        logger.warning("entity rows not purged: %s", type(exc).__name__)


# --- import (issue 17) --------------------------------------------------------------------
def engine_new_memory_id() -> str:
    """An id for a memory not written yet (an import links a file's memories first)."""
    return str(uuid.uuid4())


@engine_timed_function("add")  # memsite_engine_duration_seconds
def engine_insert_imported(
    scope: MemoryScope,
    *,
    embedded: EmbeddedText,
    metadata: dict[str, Any] | None,
    attrs: MemoryAttrs,
    created_at: str | None,
    updated_at: str | None,
    recall: tuple[int, str | None] = (0, None),
    versions: list[dict[str, Any]] | None = None,
    memory_id: str | None = None,
) -> str:
    """Store an imported memory as `engine_insert_text` does, but keeping its creation and
    update times, its recall counters and its history versions (written instead of a
    fresh ADD row; none given -> one ADD at its creation time). Caller's transaction.
    `memory_id`: a new id from `engine_new_memory_id`, when the caller needs the ids of a
    file's memories before writing them (links between them); a fresh one otherwise."""
    _require_transaction()
    vector = _vector_for_table(embedded)
    memory_id = memory_id or engine_new_memory_id()
    created = created_at or _now()
    payload = {k: v for k, v in (metadata or {}).items() if k not in _IDENTITY_KEYS}
    payload.update(
        {
            KEY_USER_ID: scope.engine_user_id,
            "role": "user",
            KEY_TEXT: embedded.text,
            "hash": _md5(embedded.text),
            KEY_CREATED_AT: created,
            KEY_UPDATED_AT: updated_at or created,
            KEY_ATTRS: attrs.as_payload(),
        }
    )
    count, last = recall
    if count or last:
        payload[KEY_RECALL] = {"count": count, "at": last}
    statement = sql.SQL("INSERT INTO {} (id, vector, payload) VALUES (%s, %s::vector, %s::jsonb)").format(_table())
    with connection.cursor() as cursor:
        cursor.execute(
            statement.as_string(cursor.connection),
            [memory_id, vector_text_stored(vector), json.dumps(payload)],
        )
    if versions:
        history_versions_add(memory_id, versions)
    else:
        _history.add_history(memory_id, None, embedded.text, "ADD", created_at=created, updated_at=created, role="user")
    return memory_id
