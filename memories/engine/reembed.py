"""Re-embedding the engine's table online (issue 17): the SQL side of `manage.py reembed`.

1. `engine_reembed_begin`: a shadow column `vector_next vector(<new dims>)` and a trigger
   that clears it whenever a row's `vector` changes (a text edited meanwhile must be
   embedded again). `EmbedderState` records the target.
2. `engine_reembed_fill`: rows whose `vector_next` is NULL, a batch at a time, embedded
   with the new embedder outside any transaction, then written only if the row's text is
   still the one embedded. Search keeps reading `vector` with the old embedder. Killed
   at any point, the next run continues with the rows still NULL.
3. `engine_reembed_switch`: one transaction that blocks writes (reads go on), embeds
   the few rows written since the last batch, swaps the columns and records the new
   embedder as active. Every process picks it up within `embedders.ACTIVE_TTL_S`."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, cast

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone
from psycopg import sql

from memories.engine.embedders import (
    EmbedderSpec,
    embedder_for,
    embedder_spec_active,
    embedder_spec_refresh,
)
from memories.engine.mem0_adapter import EngineError, _call
from memories.engine.payload import KEY_TEXT
from memories.engine.vector_schema import (
    hnsw_index_name,
    hnsw_index_statement,
    vector_table_dims,
    vector_text_stored,
)

logger = logging.getLogger(__name__)

SHADOW = "vector_next"
TRIGGER = "memsite_reembed_reset"
# The switch embeds at most this many late rows while writes wait; more -> fill again.
SWITCH_MAX_LATE_ROWS = 200


class ReembedError(RuntimeError):
    """A re-embedding cannot start or switch; the message says why (safe to show)."""


class ReembedBusy(ReembedError):
    """The switch found more late rows than it embeds while writes wait: writes came in
    faster than the last fill took them. Transient: filling again and switching may win."""


@dataclass(frozen=True)
class ReembedProgress:
    active: str
    target: str | None
    done: int
    total: int

    def as_dict(self) -> dict[str, Any]:
        return {"active": self.active, "target": self.target, "done": self.done, "total": self.total}


def _table() -> sql.Identifier:
    return sql.Identifier(settings.MEMORY_COLLECTION)


def _execute(statement: sql.Composable, params: list[Any] | None = None) -> Any:
    cursor = connection.cursor()
    cursor.execute(statement.as_string(cursor.connection), params or [])
    return cursor


def _shadow_dims() -> int | None:
    cursor = connection.cursor()
    cursor.execute(
        "SELECT atttypmod FROM pg_attribute WHERE attrelid = to_regclass(%s) AND attname = %s AND NOT attisdropped",
        [settings.MEMORY_COLLECTION, SHADOW],
    )
    row = cursor.fetchone()
    return int(row[0]) if row else None


def engine_reembed_progress() -> ReembedProgress:
    from memories.models import EmbedderState

    state = EmbedderState.objects.filter(pk=1).first()
    active = embedder_spec_active()
    if state is None or not state.target_name or _shadow_dims() is None:
        # Nothing under way: no counting (/healthz asks this; the table may be large).
        return ReembedProgress(active=active.label, target=None, done=0, total=0)
    total = cast(int, _execute(sql.SQL("SELECT count(*) FROM {}").format(_table())).fetchone()[0])
    done = _execute(sql.SQL("SELECT count(*) FROM {} WHERE {} IS NOT NULL").format(_table(), sql.Identifier(SHADOW)))
    target = EmbedderSpec(state.target_name, int(state.target_dims or 0))
    return ReembedProgress(active=active.label, target=target.label, done=int(done.fetchone()[0]), total=total)


def engine_reembed_begin(target: EmbedderSpec) -> bool:
    """Prepare (or resume) a re-embedding to `target`. Returns False when the table is
    already on `target` (nothing to do)."""
    from memories.models import EmbedderState

    with transaction.atomic():
        _execute(sql.SQL("LOCK TABLE {} IN SHARE ROW EXCLUSIVE MODE").format(_table()))
        active = embedder_spec_active()
        state, _ = EmbedderState.objects.select_for_update().get_or_create(
            pk=1, defaults={"name": active.name, "dims": active.dims}
        )
        current = EmbedderSpec(state.name, state.dims)
        if current == target:
            return False
        if state.target_name and (state.target_name, state.target_dims) != (target.name, target.dims):
            raise ReembedError(
                f"a re-embedding to {state.target_name}:{state.target_dims} is under way; finish it or --abort it first"
            )
        if _shadow_dims() not in (None, target.dims):
            _execute(sql.SQL("ALTER TABLE {} DROP COLUMN {}").format(_table(), sql.Identifier(SHADOW)))
        _execute(
            sql.SQL("ALTER TABLE {} ADD COLUMN IF NOT EXISTS {} vector({})").format(
                _table(), sql.Identifier(SHADOW), sql.Literal(target.dims)
            )
        )
        _execute(
            sql.SQL(
                "CREATE OR REPLACE FUNCTION {fn}() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
                "IF NEW.vector IS DISTINCT FROM OLD.vector THEN NEW.{col} := NULL; END IF; RETURN NEW; END $$"
            ).format(fn=sql.Identifier(TRIGGER), col=sql.Identifier(SHADOW))
        )
        _execute(sql.SQL("DROP TRIGGER IF EXISTS {} ON {}").format(sql.Identifier(TRIGGER), _table()))
        _execute(
            sql.SQL("CREATE TRIGGER {} BEFORE UPDATE ON {} FOR EACH ROW EXECUTE FUNCTION {}()").format(
                sql.Identifier(TRIGGER), _table(), sql.Identifier(TRIGGER)
            )
        )
        if not state.target_name:
            state.started_at = timezone.now()
        state.target_name, state.target_dims = target.name, target.dims
        state.save()
    return True


def _target() -> EmbedderSpec:
    from memories.models import EmbedderState

    state = EmbedderState.objects.filter(pk=1).first()
    if state is None or not state.target_name or _shadow_dims() is None:
        raise ReembedError("no re-embedding is under way")
    return EmbedderSpec(state.target_name, int(state.target_dims or 0))


def _pending(*, after: str | None, limit: int) -> list[tuple[str, str]]:
    statement = sql.SQL("SELECT id::text, payload->>{} FROM {} WHERE {} IS NULL {} ORDER BY id LIMIT %s").format(
        sql.Literal(KEY_TEXT),
        _table(),
        sql.Identifier(SHADOW),
        sql.SQL("AND id > %s::uuid") if after else sql.SQL(""),
    )
    rows = _execute(statement, [after, limit] if after else [limit]).fetchall()
    return [(str(r[0]), r[1] or "") for r in rows]


def _embed(target: EmbedderSpec, texts: list[str]) -> list[list[float]]:
    embedder = embedder_for(target)
    vectors = cast(list[list[float]], _call("embed", embedder.embed_batch, texts, "add"))
    if len(vectors) != len(texts) or any(len(v) != target.dims for v in vectors):
        raise EngineError(f"the new embedder did not return {len(texts)} vectors of {target.dims} dimensions")
    return vectors


def _write(rows: list[tuple[str, str]], vectors: list[list[float]]) -> int:
    # Only where the text is still the one embedded: an edit meanwhile left it NULL again.
    statement = sql.SQL("UPDATE {} SET {} = %s::vector WHERE id = %s::uuid AND payload->>{} = %s").format(
        _table(), sql.Identifier(SHADOW), sql.Literal(KEY_TEXT)
    )
    written = 0
    with transaction.atomic():
        for (memory_id, text), vector in zip(rows, vectors, strict=True):
            written += _execute(statement, [vector_text_stored(vector), memory_id, text]).rowcount
    return written


def engine_reembed_fill(*, batch: int, progress: Any = None, until_left: int = 0) -> int:
    """Embed pending rows with the target embedder until at most `until_left` are left
    (passes over the table in id order, repeated for rows written meanwhile). Returns
    how many rows were written."""
    target = _target()
    written = 0
    while True:
        after: str | None = None
        passed = 0
        while rows := _pending(after=after, limit=batch):
            written += _write(rows, _embed(target, [text for _, text in rows]))
            passed += len(rows)
            after = rows[-1][0]
            if progress is not None:
                progress(engine_reembed_progress())
        left = engine_reembed_progress()
        if passed == 0 or left.total - left.done <= until_left:
            return written


def engine_reembed_switch() -> ReembedProgress:
    """Make the filled column THE vector column and the target embedder active, in one
    transaction. Writes wait meanwhile (a few late rows are embedded here); searches go
    on until the column swap itself, which takes an instant."""
    from memories.models import EmbedderState

    target = _target()
    with transaction.atomic():
        _execute(sql.SQL("LOCK TABLE {} IN SHARE ROW EXCLUSIVE MODE").format(_table()))
        late = _pending(after=None, limit=SWITCH_MAX_LATE_ROWS + 1)
        if len(late) > SWITCH_MAX_LATE_ROWS:
            raise ReembedBusy(f"more than {SWITCH_MAX_LATE_ROWS} rows still need embedding; fill first")
        if late:
            _write(late, _embed(target, [text for _, text in late]))
        table, shadow = _table(), sql.Identifier(SHADOW)
        _execute(sql.SQL("DROP TRIGGER IF EXISTS {} ON {}").format(sql.Identifier(TRIGGER), table))
        _execute(sql.SQL("DROP FUNCTION IF EXISTS {}()").format(sql.Identifier(TRIGGER)))
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1 FROM pg_indexes WHERE indexname = %s", [hnsw_index_name()])
            had_hnsw_index = cursor.fetchone() is not None
        _execute(sql.SQL("ALTER TABLE {} DROP COLUMN vector").format(table))  # drops its HNSW index too
        _execute(sql.SQL("ALTER TABLE {} RENAME COLUMN {} TO vector").format(table, shadow))
        if had_hnsw_index:  # the large users' search plan (retrieval.vector_plan) needs it back
            _execute(hnsw_index_statement(normalised=target.normalised))
        # mem0's entity links are derived data (rebuilt as memories change): start afresh.
        entities = sql.Identifier(f"{settings.MEMORY_COLLECTION}_entities")
        _execute(sql.SQL("TRUNCATE {}").format(entities))
        _execute(
            sql.SQL("ALTER TABLE {} ALTER COLUMN vector TYPE vector({})").format(entities, sql.Literal(target.dims))
        )
        state = EmbedderState.objects.select_for_update().get(pk=1)
        state.name, state.dims = target.name, target.dims
        state.target_name, state.target_dims = "", None
        state.switched_at = timezone.now()
        state.save()
    embedder_spec_refresh()
    dims = vector_table_dims(connection.cursor(), settings.MEMORY_COLLECTION)
    logger.info("re-embedding switched to %s (%s dimensions)", target.label, dims)
    return engine_reembed_progress()


def engine_reembed_abort() -> None:
    """Drop the shadow column and forget the target; the active embedder stays."""
    from memories.models import EmbedderState

    with transaction.atomic():
        _execute(sql.SQL("DROP TRIGGER IF EXISTS {} ON {}").format(sql.Identifier(TRIGGER), _table()))
        _execute(sql.SQL("DROP FUNCTION IF EXISTS {}()").format(sql.Identifier(TRIGGER)))
        _execute(sql.SQL("ALTER TABLE {} DROP COLUMN IF EXISTS {}").format(_table(), sql.Identifier(SHADOW)))
        EmbedderState.objects.filter(pk=1).update(target_name="", target_dims=None)
