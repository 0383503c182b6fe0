"""Writes, including billed and audited reads (search, list, get): every call that
consumes a rate limit or leaves an audit row or usage event. Keyword-only; memory
operations take a MemoryScope first."""

from __future__ import annotations

import functools
import hashlib
import logging
import secrets
import uuid
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any, TypeGuard

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from audit.models import MemoryHistory
from audit.services import audit_failure, audit_record, audit_snapshot, audit_text, history_content_erase
from core.batched import rows_delete_in_batches
from core.choices import ALL_PERMISSIONS, Channel, Operation, Permission, Role
from core.errors import ErrorCode, ServiceError, backend_unavailable, not_found
from core.inputs import text_problem
from core.locks import LOCK_RETRY_AFTER_S, advisory_xact_lock
from core.scope import CallContext, MemoryScope
from core.snapshots import read_only_snapshot
from memories.call_record import call_succeeded, failures_audited
from memories.cursors import CursorError, cursor_decode, cursor_encode
from memories.engine import (
    DEFAULT_IMPORTANCE,
    ENRICHMENT_KEY,
    TIER_KEY,
    EmbeddedText,
    EngineError,
    EngineMemory,
    LlmUnavailable,
    MemoryAttrs,
    attrs_containment,
    engine_delete_row,
    engine_delete_user_rows,
    engine_embed_text,
    engine_embed_texts,
    engine_get,
    engine_ingest,
    engine_insert_imported,
    engine_insert_text,
    engine_lock_owned,
    engine_lock_owned_many,
    engine_memories_page,
    engine_memory_ids,
    engine_memory_owned,
    engine_metadata_merge,
    engine_new_memory_id,
    engine_purge_due,
    engine_purge_messages,
    engine_recalls_fold,
    engine_restore,
    engine_rows_from_request,
    engine_text_copies_locked,
    engine_timestamp,
    engine_trash,
    engine_trashed,
    engine_update_row,
    history_attribution,
    hybrid_search,
    llm_configured,
)
from memories.models import ApiKey, ContentHash, IngestIntent, JobWatermark, TenantMembership, TurnGuard
from memories.portability import (
    EXPORT_FORMATS,
    HISTORY_MAX_VERSIONS,
    ExportRecord,
    ImportItem,
    export_jsonl_header,
    export_jsonl_line,
    export_markdown_item,
    export_markdown_section,
    export_markdown_title,
    import_items_parse,
)
from memories.rate_limits import rate_limit_consume
from memories.schemas import (
    ENRICHED_BY_KEY,
    ENRICHMENT_ATTEMPTS_KEY,
    ENRICHMENT_ERROR_KEY,
    MEMORY_MAX_CHARS,
    METADATA_MAX_BYTES,
    METADATA_MAX_KEYS,
    RESERVED_SOURCE,
    SUMMARY_KEY,
    metadata_json_bytes,
    metadata_own,
    parse_instant,
)
from memories.selectors import (
    MemoryHistoryView,
    MemoryView,
    TrashedView,
    decayed_score,
    memory_get_owned,
    memory_histories,
    memory_ids_owned,
    memory_trash_list,
    memory_view,
)
from memories.sessions import derived_answers_forget, session_data_clear_all
from memories.text_hash import content_sha256
from memories.toolkit.enrichment import enrich_heuristic
from memories.turns.extraction import FACT_TAG, tags_made_durable

logger = logging.getLogger(__name__)
LAST_USED_RESOLUTION = timedelta(minutes=1)
# The IngestIntent.detail key an erasure or clear-all sets on the user's ingest calls in
# flight (`ingest_intents_supersede`); their completion then discards what mem0 stored.
SUPERSEDED_KEY = "superseded_by"
# The IngestIntent.detail key set when the call answered an error after mem0 stored its
# facts (`_ingest_answered_error`): its completion by the reconciler bills nothing.
ANSWERED_ERROR_KEY = "answered_error"
# What the toolkit's enrichment wrote about a memory's text (memories/toolkit/services.py):
# dropped when the text changes, so nothing describes the old one.
ENRICHMENT_RESULT_KEYS = (SUMMARY_KEY, ENRICHED_BY_KEY, ENRICHMENT_ATTEMPTS_KEY, ENRICHMENT_ERROR_KEY)
KEY_ID_BYTES = 6  # 12 hex chars: the public, unique lookup part
SECRET_BYTES = 32


def _secret_hash(secret: str) -> str:
    # Keys are 256-bit random, so a fast hash is enough (no password stretching needed).
    return hashlib.sha256(secret.encode()).hexdigest()


def api_key_issue(
    *,
    user,
    name: str = "",
    role: str = Role.USER,
    permissions: frozenset[str] = ALL_PERMISSIONS,
    expires_at: datetime | None = None,
    call: CallContext | None = None,
) -> tuple[ApiKey, str]:
    """Create a key for `user`. Returns the row and the plain key, which is not stored.
    Defaults keep the old behaviour: the user's own memories, read/write/delete, no expiry.

    Audited in the key's transaction (a delegated key, tenant_admin or platform, reaches
    other users' memories: who was given which powers must be on record): its id, name,
    role, permissions and expiry, never the secret. `call` says who issued it and how;
    without one it is recorded as an internal call of the key's own user."""
    if role not in Role.values:
        raise ServiceError(ErrorCode.INVALID_ARGUMENT, "role must be user, tenant_admin or platform.")
    if not permissions or not set(permissions) <= ALL_PERMISSIONS:
        raise ServiceError(ErrorCode.INVALID_ARGUMENT, "permissions are some of read, write, delete.")
    if expires_at is not None and expires_at <= timezone.now():
        raise ServiceError(ErrorCode.INVALID_ARGUMENT, "expires_at must be in the future.")
    key_id = secrets.token_hex(KEY_ID_BYTES)
    secret = secrets.token_urlsafe(SECRET_BYTES)
    with transaction.atomic():
        api_key = ApiKey.objects.create(
            user=user,
            name=name[:100],
            key_id=key_id,
            secret_hash=_secret_hash(secret),
            role=role,
            permissions=",".join(p for p in Permission.values if p in permissions),
            expires_at=expires_at,
        )
        audit_record(
            MemoryScope.for_user(user),
            call=call or CallContext(channel=Channel.INTERNAL),
            operation=Operation.API_KEY_ISSUE,
            detail={
                "key_id": api_key.key_id,
                "name": api_key.name,
                "role": api_key.role,
                "permissions": api_key.permissions.split(","),
                "expires_at": api_key.expires_at.isoformat() if api_key.expires_at else None,
            },
        )
    return api_key, f"{ApiKey.PREFIX}{key_id}_{secret}"


@functools.cache
def _api_key_lookup_sql() -> tuple[str, tuple[list[str], ...]]:
    """One statement for the key, its user and the user's tenant membership (what
    `select_related("user", "user__tenant_membership")` fetches), with the attribute names
    of each part. Built once per process from the models' metadata: the ORM compiled that
    three-table select on every call, 1.3 of its 1.8 ms (`bench/run mcp`, issue 18)."""
    quote = connection.ops.quote_name
    user_model = get_user_model()
    parts = (("k", ApiKey), ("u", user_model), ("m", TenantMembership))

    def quoted(field: Any) -> str:  # a concrete field always has its column
        return quote(field.column)

    def column(model: Any, name: str) -> str:
        return quoted(model._meta.get_field(name))

    columns = [f"{alias}.{quoted(f)}" for alias, model in parts for f in model._meta.concrete_fields]
    user_pk = quoted(user_model._meta.pk)
    # Identifiers come from the models' metadata, quoted; the key id is a parameter.
    sql = (
        f"SELECT {', '.join(columns)} FROM {quote(ApiKey._meta.db_table)} k"  # noqa: S608
        f" JOIN {quote(user_model._meta.db_table)} u ON u.{user_pk} = k.{column(ApiKey, 'user')}"
        f" LEFT JOIN {quote(TenantMembership._meta.db_table)} m ON m.{column(TenantMembership, 'user')} = u.{user_pk}"
        f" WHERE k.{column(ApiKey, 'key_id')} = %s AND k.{column(ApiKey, 'revoked_at')} IS NULL LIMIT 1"
    )
    return sql, tuple([f.attname for f in model._meta.concrete_fields] for _, model in parts)


def _api_key_unrevoked_get(key_id: str) -> ApiKey | None:
    """The unrevoked key `key_id` with its user and the user's tenant membership loaded
    (None for a user in the default tenant), as select_related would load them."""
    sql, (key_names, user_names, membership_names) = _api_key_lookup_sql()
    with connection.cursor() as cursor:
        cursor.execute(sql, [key_id])
        row = cursor.fetchone()
    if row is None:
        return None
    user_model = get_user_model()
    user_end = len(key_names) + len(user_names)
    api_key = ApiKey.from_db(connection.alias, key_names, row[: len(key_names)])
    user = user_model.from_db(connection.alias, user_names, row[len(key_names) : user_end])
    membership_row = row[user_end:]
    membership = (
        TenantMembership.from_db(connection.alias, membership_names, membership_row)
        if membership_row[0] is not None
        else None
    )
    ApiKey._meta.get_field("user").set_cached_value(api_key, user)
    user_model._meta.get_field("tenant_membership").set_cached_value(user, membership)
    return api_key


def api_key_authenticate(*, token: str) -> ApiKey | None:
    """The active key matching `token`, or None. Constant-time on the secret."""
    if not token.startswith(ApiKey.PREFIX):
        return None
    key_id, sep, secret = token[len(ApiKey.PREFIX) :].partition("_")
    if not sep or not key_id or not secret:
        return None
    api_key = _api_key_unrevoked_get(key_id)
    expected = api_key.secret_hash if api_key else _secret_hash("")
    if not secrets.compare_digest(expected, _secret_hash(secret)) or api_key is None:
        return None
    if not api_key.user.is_active or api_key.is_expired:
        return None
    now = timezone.now()
    if api_key.last_used_at is None or now - api_key.last_used_at > LAST_USED_RESOLUTION:
        # Once a minute is precise enough for "last used", and spares a write per call.
        ApiKey.objects.filter(pk=api_key.pk).update(last_used_at=now)
    return api_key


def api_key_revoke(*, user, key_id: str, call: CallContext | None = None) -> bool:
    """Revoke `user`'s active key `key_id`; False when there is none (another user's,
    unknown, revoked already). With `call` (the owner in the web UI) the revocation is
    audited in its transaction, as the issue is: the key's id and name, never the secret.
    Without one (the admin action, which writes its own staff row) nothing is audited here."""
    with transaction.atomic():
        api_key = ApiKey.objects.select_for_update().filter(user=user, key_id=key_id, revoked_at__isnull=True).first()
        if api_key is None:
            return False
        api_key.revoked_at = timezone.now()
        api_key.save(update_fields=["revoked_at"])
        if call is not None:
            audit_record(
                MemoryScope.for_user(user),
                call=call,
                operation=Operation.API_KEY_REVOKE,
                detail={"key_id": api_key.key_id, "name": api_key.name},
            )
    return True


# --- memories ---------------------------------------------------------------------------
def _system_metadata(scope: MemoryScope, *, source: str, pinned: bool, metadata: dict[str, Any] | None) -> dict:
    return {**(metadata or {}), "pinned": pinned, "source": source, "client_app": scope.client_app}


def _attrs(fields: dict[str, Any] | None, *, base: MemoryAttrs | None = None) -> MemoryAttrs:
    """The memory's fields after applying `fields` (validated by schemas.FieldsMixin) to
    `base` (the defaults for a new memory). `ttl_days` becomes `expires_at`."""
    attrs = base or MemoryAttrs()
    changes: dict[str, Any] = {}
    for name, value in (fields or {}).items():
        if name in ("source", "ttl_days"):
            continue
        if name == "tags":
            changes["tags"] = tuple(value or ())
        elif name == "expires_at":
            changes["expires_at"] = None if value is None else engine_timestamp(parse_instant(value, what=name))
        elif name == "memory_type":
            changes["memory_type"] = value or MemoryAttrs.memory_type
        elif name == "importance":
            changes["importance"] = MemoryAttrs.importance if value is None else float(value)
        else:
            changes[name] = value
    ttl_days = (fields or {}).get("ttl_days")
    if ttl_days:
        changes["expires_at"] = engine_timestamp(datetime.now(UTC) + timedelta(days=ttl_days))
    return replace(attrs, **changes)


def _live(item: EngineMemory | None, scope: MemoryScope) -> bool:
    return (
        item is not None
        and item.user_id == scope.engine_user_id
        and item.trash is None
        and not item.expired(datetime.now(UTC))
    )


def _llm_unavailable() -> ServiceError:
    return ServiceError(ErrorCode.LLM_UNAVAILABLE, "ingest needs an LLM and none is configured; use remember instead.")


@contextmanager
def _engine_errors() -> Iterator[None]:
    try:
        yield
    except LlmUnavailable:
        raise _llm_unavailable() from None
    except EngineError as exc:
        raise backend_unavailable() from exc


def _audit_attrs(attrs: MemoryAttrs) -> dict[str, Any]:
    data = attrs.as_payload()
    if data.get("why_stored") is not None:
        data["why_stored"] = audit_text(data["why_stored"])
    return {"fields": data}


@dataclass(frozen=True)
class RememberResult:
    id: str
    duplicate: bool
    # The memory as the store left it, read in its transaction, when the caller asked for
    # it (`with_memory`: seed 001's store answers it whole and never reads it again after
    # the commit, when a delete committed meanwhile would turn a billed store into a 404).
    # None otherwise: the other surfaces answer {id, duplicate}, and the read is a query
    # on every remember. Not in `as_dict`.
    memory: MemoryView | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "duplicate": self.duplicate}


def _remember_inserted(scope: MemoryScope, *, memory_id: str, with_memory: bool) -> RememberResult:
    """In the store's transaction, which inserted the memory: it is there."""
    if not with_memory:
        return RememberResult(id=memory_id, duplicate=False)
    item = engine_memory_owned(scope, memory_id=memory_id)
    if item is None:  # never: the row is this transaction's own
        raise backend_unavailable()
    return RememberResult(id=memory_id, duplicate=False, memory=memory_view(item))


def erasure_lock_key(scope: MemoryScope) -> str:
    """The user's erasure lock: an erasure, clear-all, bulk forget, restore, purge, import
    or ingest completion holds it exclusively; every other writer of the user's rows holds
    it shared (`user_write_locks`)."""
    return f"clear_all:{scope.engine_user_id}"


def user_write_locks(scope: MemoryScope, *keys: str, timeout_s: float | None = None) -> None:
    """The first lock of every transaction that writes rows of the user: the erasure lock
    shared, then `keys` exclusively, in one round trip. Under READ COMMITTED an erasure's
    DELETE does not see rows a writer commits after its snapshot; holding the erasure lock
    shared makes such a writer wait until the erasure committed (and the erasure wait for
    writers already under way), while writers of one user still run side by side. First,
    before any row lock: the erasure takes its lock first and then waits for row locks.

    In the same round trip, once the locks are held: the account still exists, key-share
    locked until the transaction ends (its deletion waits for this writer; other writers
    and logins do not). A writer that waited for a staff erasure that also deleted the
    account would otherwise store rows no one could reach or erase."""
    table = connection.ops.quote_name(get_user_model()._meta.db_table)
    account = f"SELECT 1 FROM {table} WHERE id = %s FOR KEY SHARE"  # noqa: S608 - a model's table
    held = advisory_xact_lock(
        *keys, shared=[erasure_lock_key(scope)], timeout_s=timeout_s, then=(account, [scope.user_pk])
    )
    if held is None:
        raise ServiceError(ErrorCode.UNAUTHENTICATED, "This account no longer exists.")


def _text_lock_key(scope: MemoryScope, digest: str) -> str:
    # Every path that sets a memory's text takes this lock: one dedupe rule, no races.
    return f"text:{scope.engine_user_id}:{digest}"


def _hash_owner(scope: MemoryScope, *, digest: str) -> str | None:
    """The live memory holding this text's hash, row-locked; a hash whose memory went
    away behind its back is removed. Inside the transaction, under the text lock."""
    owner = _hash_owner_memory(scope, digest=digest)
    return owner.id if owner is not None else None


def _hash_owner_memory(scope: MemoryScope, *, digest: str) -> EngineMemory | None:
    """`_hash_owner`, as the memory itself (for a caller that adjusts the one it found)."""
    known = ContentHash.objects.filter(engine_user_id=scope.engine_user_id, sha256=digest).first()
    if known is None:
        return None
    current = engine_lock_owned(scope, memory_id=str(known.memory_id))
    if _holds_text(current, scope, digest=digest):
        return current
    known.delete()
    return None


def _holds_text(item: EngineMemory | None, scope: MemoryScope, *, digest: str) -> bool:
    """`item` (locked) is live and still holds the text `digest`. The hash row was read
    without a lock: an update that moved the memory to another text (and its hash with it)
    may have committed while we waited for the row, and the memory is no owner of this
    text any more (the hash row read is gone or going: deleting it again is harmless)."""
    return item is not None and _live(item, scope) and content_sha256(item.text) == digest


def _content_hash_claim(scope: MemoryScope, *, digest: str, memory_id: str) -> str | None:
    """Give `memory_id` the hash of its text `digest`: None once it holds it, else the id
    of the live memory that does. Writers of one text are kept apart by the text lock,
    but an import takes none (`_import_write`): its uncommitted hash makes this insert
    wait, then fail on the unique constraint when the import commits. The insert runs in
    a savepoint, so the caller's transaction goes on and answers as for a known text (a
    duplicate, or `conflict` for an update). In the caller's transaction, under the text
    lock."""
    for _attempt in range(2):
        if _content_hash_inserted(scope, digest=digest, memory_id=memory_id):
            return None
        owner = _hash_owner(scope, digest=digest)  # committed now; a stale one is removed: retry
        if owner is not None:
            return None if owner == memory_id else owner
    raise backend_unavailable()


def _content_hash_inserted(scope: MemoryScope, *, digest: str, memory_id: str) -> bool:
    """INSERT ... ON CONFLICT DO NOTHING: False when the text's hash row exists (no error,
    so no savepoint: this runs on every remember)."""
    meta = ContentHash._meta
    quote = connection.ops.quote_name
    column = {field.name: quote(str(field.column)) for field in meta.concrete_fields}
    columns = ", ".join(column[name] for name in ("engine_user_id", "sha256", "memory_id", "created_at"))
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {quote(meta.db_table)} ({columns}) VALUES (%s, %s, %s, now())"  # noqa: S608 - identifiers from the model
            " ON CONFLICT DO NOTHING RETURNING 1",
            [scope.engine_user_id, digest, memory_id],
        )
        return cursor.fetchone() is not None


def _text_insert_claimed(
    scope: MemoryScope, *, digest: str, embedded: EmbeddedText, metadata: dict[str, Any], attrs: MemoryAttrs | None
) -> str | None:
    """A new memory of the text `digest` (`engine_insert_text`'s arguments): its hash is
    claimed first under a new id (one INSERT ... ON CONFLICT DO NOTHING,
    `_content_hash_claim`), then the row is stored under that id. None when an import
    stored the text meanwhile: nothing is inserted, and the caller finds the text's memory
    with `_hash_owner_memory`, as for a text it knew. In the caller's transaction, under
    the text lock."""
    memory_id = str(uuid.uuid4())
    if _content_hash_claim(scope, digest=digest, memory_id=memory_id) is not None:
        return None
    return engine_insert_text(scope, embedded=embedded, metadata=metadata, attrs=attrs, memory_id=memory_id)


def _turn_fact_durable_attrs(attrs: MemoryAttrs) -> MemoryAttrs | None:
    """An expiring turn fact's fields made durable (long-term tier, no expiry), or None
    when `attrs` are not an expiring turn fact's. For a fact its owner keeps on purpose:
    remembered again, pinned, edited; retention (and the purge of expired rows) would
    otherwise delete it for good."""
    if FACT_TAG not in attrs.tags or attrs.expires_at is None:
        return None
    return replace(
        attrs,
        tags=tags_made_durable(attrs.tags),
        expires_at=None,
        importance=max(attrs.importance, DEFAULT_IMPORTANCE),
    )


def _turn_fact_owned(existing: EngineMemory, *, durable: bool, call: CallContext) -> EngineMemory | None:
    """A turn fact whose text its owner stores again (`remember`, a human message of the
    toolkit's `store_memory`) becomes theirs. An expiring one is made durable when
    `durable` (`_turn_fact_durable_attrs`), and returned as it is now; otherwise nothing
    changes but this call's history row, which says the fact is the owner's, so
    consolidation never trashes it (turns `_owner_kept`). None for that, and for any
    other memory (an owner's own expiring memory is their choice: left alone). No
    embedding: in the caller's transaction, with `existing` row-locked (`_hash_owner_memory`)."""
    if FACT_TAG not in existing.attrs.tags:
        return None
    durable_attrs = _turn_fact_durable_attrs(existing.attrs) if durable else None
    with _attributed(call):
        kept = engine_update_row(existing.id, embedded=None, metadata=None, attrs=durable_attrs or existing.attrs)
    return kept if durable_attrs is not None else None


def _turn_fact_owner_edited_attrs(
    current: MemoryAttrs, edited: MemoryAttrs, *, fields: Mapping[str, Any]
) -> MemoryAttrs | None:
    """`edited` (an update's fields for a memory whose fields were `current`) made durable
    when the memory is an expiring turn fact: its owner changed it (text, fields, metadata,
    or pinned it), so it is theirs, as consolidation counts it (turns `_owner_kept`). Reads
    hide an expired memory and retention deletes it for good, pinned or edited or not.
    None (the update's fields stand) for any other memory, or when the update sets the
    expiry itself (`expires_at`, `ttl_days`): the owner's own choice. An importance the
    update sets stays as set; the tags it sets lose their short tier as the fact's do."""
    if _turn_fact_durable_attrs(current) is None or {"expires_at", "ttl_days"} & set(fields):
        return None
    durable = replace(
        edited,
        tags=tags_made_durable(edited.tags),
        expires_at=None,
        importance=max(edited.importance, DEFAULT_IMPORTANCE),
    )
    return replace(durable, importance=edited.importance) if "importance" in fields else durable


def _hash_owner_rows(scope: MemoryScope, *, digests: list[str]) -> dict[str, EngineMemory]:
    """`_hash_owner_memory` for many texts in two statements (an import): digest -> live
    memory, row-locked; hashes whose memory went away behind their back are removed."""
    known = {
        row.sha256: row for row in ContentHash.objects.filter(engine_user_id=scope.engine_user_id, sha256__in=digests)
    }
    rows = engine_lock_owned_many(scope, memory_ids=[str(h.memory_id) for h in known.values()])
    owners: dict[str, EngineMemory] = {}
    stale: list[int] = []
    for digest, known_hash in known.items():
        row = rows.get(str(known_hash.memory_id))
        if row is not None and _holds_text(row, scope, digest=digest):
            owners[digest] = row
        else:
            stale.append(known_hash.pk)
    if stale:
        ContentHash.objects.filter(pk__in=stale).delete()
    return owners


def _duplicate_text(existing_id: str) -> ServiceError:
    return ServiceError(
        ErrorCode.CONFLICT,
        "Another of your memories already has this text; nothing was changed.",
        details={"existing_id": existing_id},
    )


def memory_remember(
    scope: MemoryScope,
    *,
    memory: str,
    pinned: bool = False,
    metadata: dict[str, Any] | None = None,
    fields: dict[str, Any] | None = None,
    call: CallContext,
    with_memory: bool = False,
) -> RememberResult:
    """Store one curated fact verbatim (no LLM) with its fields. The same text twice is
    stored once (the first memory's fields are kept; a `pinned` one asked for pins it).
    `with_memory`: also answer the memory whole, as this call's transaction leaves it
    (`RememberResult.memory`).

    A store narrowed to an `agent_id`/`session_id` (seed 001's scope, or the fields) keeps
    to them: the same text is one memory there, and a text the user has only outside
    them is stored again, inside them (`_remember_narrowed`), so the caller can see and
    forget what it is answered. An un-narrowed store answers any memory of the text.

    The memory row, its history row, its dedupe hash, the usage event and the audit row
    commit in one transaction (the embedding is computed before it): after a crash
    either all exist or none, and a retry finds the hash."""
    attrs = _attrs(fields)
    source = (fields or {}).get("source") or "remember"
    narrowing = _attrs_narrowing(attrs)
    rate_limit_consume(scope, operation=Operation.REMEMBER)
    text = memory.strip()
    digest = content_sha256(memory)
    # A known text needs no embedding; otherwise embed before the transaction.
    known = ContentHash.objects.filter(engine_user_id=scope.engine_user_id, sha256=digest).exists()
    embedded = None
    for _attempt in range(3):
        if embedded is None and not known:
            with _engine_errors():
                embedded = engine_embed_text(text)
        with _engine_errors(), transaction.atomic():
            user_write_locks(scope, _text_lock_key(scope, digest))
            existing = _hash_owner_memory(scope, digest=digest)
            if existing is not None and not _within(existing, narrowing):
                narrowed = _remember_narrowed(
                    scope,
                    text=text,
                    digest=digest,
                    narrowing=narrowing,
                    embedded=embedded,
                    metadata=_system_metadata(scope, source=source, pinned=pinned, metadata=metadata),
                    attrs=attrs,
                    call=call,
                )
                if narrowed is None:  # a new memory, and this attempt knew the text: embed it
                    known = False
                    continue
                if isinstance(narrowed, str):
                    _remembered(
                        scope, memory_id=narrowed, text=text, pinned=pinned, metadata=metadata, attrs=attrs, call=call
                    )
                    return _remember_inserted(scope, memory_id=narrowed, with_memory=with_memory)
                existing = narrowed
            elif existing is None and embedded is not None:
                with _attributed(call):
                    memory_id = _text_insert_claimed(
                        scope,
                        digest=digest,
                        embedded=embedded,
                        metadata=_system_metadata(scope, source=source, pinned=pinned, metadata=metadata),
                        attrs=attrs,
                    )
                if memory_id is not None:
                    _remembered(
                        scope, memory_id=memory_id, text=text, pinned=pinned, metadata=metadata, attrs=attrs, call=call
                    )
                    return _remember_inserted(scope, memory_id=memory_id, with_memory=with_memory)
                existing = _hash_owner_memory(scope, digest=digest)  # an import stored the text meanwhile
                if existing is not None and not _within(existing, narrowing):
                    continue  # outside the narrowing: the next attempt stores the text beside it
            if existing is not None:
                # Remembering a text an expiring turn fact holds keeps it (unless this
                # remember itself asks for an expiry): same transaction, same audit row.
                durable = _turn_fact_owned(existing, durable=attrs.expires_at is None, call=call)
                answered = durable or existing  # row-locked: as this transaction leaves it
                # A pin asked for is meant for the user's memory of this text, new or not
                # (answered `duplicate: true`, an unpinned one read as pinned). Never an
                # unpin: `pinned: false` is remember's default, not a request.
                pinning = pinned and not memory_view(answered).pinned
                if pinning:
                    with _attributed(call):
                        answered = engine_update_row(existing.id, embedded=None, metadata={"pinned": True})
                changed = durable is not None or pinning
                call_succeeded(
                    scope,
                    call=call,
                    operation=Operation.REMEMBER,
                    memory_ids=[existing.id],
                    before=_snapshot(existing) if changed else None,
                    after=_snapshot(answered) if changed else None,
                    detail={
                        "duplicate": True,
                        **({"made_durable": [durable.id]} if durable is not None else {}),
                        **({"pinned": True} if pinning else {}),
                    },
                )
                return RememberResult(
                    id=existing.id, duplicate=True, memory=memory_view(answered) if with_memory else None
                )
        known = False  # the hash went away between the check and the lock: embed and store
    raise backend_unavailable()


def _attrs_narrowing(attrs: MemoryAttrs) -> dict[str, str]:
    """The agent and session a new memory is stored in, as `_within` takes them."""
    return {key: value for key in ("agent_id", "session_id") if (value := getattr(attrs, key))}


def _remembered(
    scope: MemoryScope,
    *,
    memory_id: str,
    text: str,
    pinned: bool,
    metadata: dict[str, Any] | None,
    attrs: MemoryAttrs,
    call: CallContext,
) -> None:
    """The audit row and usage event of a `remember` that stored a new memory."""
    snapshot = audit_snapshot(memory=text, pinned=pinned, metadata=metadata or {})
    after = {**snapshot, **_audit_attrs(attrs)}
    call_succeeded(scope, call=call, operation=Operation.REMEMBER, memory_ids=[memory_id], after=after)


def _remember_narrowed(
    scope: MemoryScope,
    *,
    text: str,
    digest: str,
    narrowing: Mapping[str, str],
    embedded: EmbeddedText | None,
    metadata: dict[str, Any],
    attrs: MemoryAttrs,
    call: CallContext,
) -> EngineMemory | str | None:
    """A narrowed `remember` of a text whose hash a memory outside the narrowing holds
    (another agent's or session's, or one stored without any): answering that one would
    hand the caller an id its own narrowing cannot list, update or forget. A live copy
    of the text inside the narrowing is the memory (returned, row-locked: a duplicate);
    else, given the embedding, a new memory is stored there beside the holder without a
    hash (as a restored older copy lives), and its id returned; else None (embed, retry).
    The hash stays with its holder: un-narrowed stores keep answering it. In the caller's
    transaction, under the text lock (every writer of the text takes it but an import,
    which never stores a text the user has)."""
    copy = _text_copy_within(scope, text=text, digest=digest, narrowing=narrowing)
    if copy is not None:
        return copy
    if embedded is None:
        return None
    with _attributed(call):
        return engine_insert_text(scope, embedded=embedded, metadata=metadata, attrs=attrs)


def _text_copy_within(
    scope: MemoryScope, *, text: str, digest: str, narrowing: Mapping[str, str], excluding: Collection[str] = ()
) -> EngineMemory | None:
    """The live memory of the text `digest` inside the narrowing (row-locked) that a
    narrowed store answers when the text's hash holder is outside it, or None: a long-term
    one without expiry first, then the oldest. `excluding`: rows not yet answered (an
    ingest's facts are among the copies). In the caller's transaction, under the text lock."""
    copies = engine_text_copies_locked(scope, text=text).values()
    inside = [
        item
        for item in copies
        if item.id not in excluding
        and _live(item, scope)
        and item.metadata.get(TIER_KEY) != "stm"  # a toolkit short-term copy is never the memory
        and _within(item, narrowing)
        and content_sha256(item.text) == digest
    ]
    if not inside:
        return None
    return min(inside, key=lambda item: (not _holds_hash_first(item), item.created_at or "", item.id))


def memory_ingest(
    scope: MemoryScope,
    *,
    messages: list[dict[str, str]],
    metadata: dict[str, Any] | None = None,
    fields: dict[str, Any] | None = None,
    call: CallContext,
    billed: bool = True,
    source_present: Callable[[], bool] | None = None,
    with_stored: bool = False,
) -> list[dict[str, Any]]:
    """mem0's extraction pipeline over a conversation turn (one LLM call). Answers
    {id, memory, event} per fact; `with_stored`: also `stored`, the memory whole
    (`_ingest_results_stored`).

    mem0 writes its rows on its own, so the call is bracketed by a durable intent:
    committed before the engine call, completed (hashes, audit row, usage event) in one
    transaction after it. A crash in between leaves the intent open, and
    `ingest_intents_reconcile` completes it later from the rows tagged with the request id.
    An erasure (or clear-all) that commits while the call is in flight marks its intent;
    the completion then discards what mem0 stored and answers no memories.

    `billed=False`: background work for a call that was billed and rate limited on its own
    (the chat proxy's extraction after an answered chat completion): audited, but no usage
    event and no INGEST rate limit. Kept on the intent, so the reconciler does the same.

    `source_present`: for messages kept somewhere an erasure deletes (the chat proxy's
    turn), checked as the intent is recorded; False (erased since) answers no memories
    and calls nothing."""
    if not llm_configured():
        raise _llm_unavailable()
    if billed:
        rate_limit_consume(scope, operation=Operation.INGEST)
    with transaction.atomic():
        # Under the lock an erasure holds: the intent exists before an erasure (which then
        # marks it) or is recorded after it committed, and then `source_present` sees it.
        advisory_xact_lock(erasure_lock_key(scope))
        if source_present is not None and not source_present():
            return []
        intent = IngestIntent.objects.create(
            request_id=call.request_id,
            engine_user_id=scope.engine_user_id,
            scope=_scope_record(scope),
            call=_call_record(call),
            detail={"messages": len(messages), **({} if billed else {"billed": False})},
        )
    try:
        with _engine_errors(), _attributed(call):
            added = engine_ingest(
                scope,
                messages=messages,
                metadata=_system_metadata(
                    scope, source=(fields or {}).get("source") or "ingest", pinned=False, metadata=metadata
                ),
                attrs=_attrs(fields),
                request_id=call.request_id,
            )
    except ServiceError:
        # Nothing stored: the call failed (failures_audited writes its row), close it.
        # Rows stored before a late failure stay for the reconciler to complete.
        if not engine_rows_from_request(request_id=call.request_id):
            _ingest_undone(scope, intent=intent, call=call)
        raise
    added_ids = [str(a.get("id")) for a in added if a.get("event") == "ADD"]
    try:
        return _ingest_complete(scope, intent=intent, call=call, added_ids=added_ids, with_stored=with_stored)
    except Exception:  # the call answers an error (any kind): it must not be billed later
        _ingest_answered_error(intent)
        raise


def _ingest_answered_error(intent: IngestIntent) -> None:
    """The completion failed (a lock timeout, the database) after mem0 stored the facts:
    the call answers an error, and the intent stays open for the reconciler, which keeps
    the facts (a retry of the call then finds them: the dedupe rule answers them as NONE,
    no second copy) with an audit row, but bills nothing: the client was told it failed.
    Only the intent's row lock (not the user's erasure lock, which may be what timed out);
    best effort: when this fails too, the reconciler bills the call as a crash."""
    try:
        with transaction.atomic():
            current = IngestIntent.objects.select_for_update().filter(pk=intent.pk, state=IngestIntent.State.OPEN)
            for row in current:
                row.detail = {**row.detail, ANSWERED_ERROR_KEY: True}
                row.save(update_fields=["detail"])
    except Exception as exc:  # never hide the call's own error
        logger.warning("ingest: could not mark the failed call's intent (%s)", type(exc).__name__)


def _ingest_complete(
    scope: MemoryScope, *, intent: IngestIntent, call: CallContext, added_ids: list[str], with_stored: bool = False
) -> list[dict[str, Any]]:
    """One transaction: the dedupe rule over what mem0 added (a fact whose text another
    memory already has is removed again, and answered with that memory's id and event
    NONE), hashes for the new ones, the audit row, the usage event, the intent closed.
    An ingest narrowed to an `agent_id`/`session_id` keeps to them as a narrowed
    `remember` does: when the text's holder is outside them, a copy inside them is the
    memory (NONE), else the fact stays as a new memory there without a hash (ADD).
    A fact longer than MEMORY_MAX_CHARS (the LLM wrote it; no client could) is removed
    again and counted in the audit row's `too_long`, one holding a character no text may
    hold (`text_problem`: a control character) in `unstorable`: every memory must fit
    what `remember` and the import take, or the user's export would not import.
    An intent an erasure or clear-all superseded is discarded instead (`_ingest_discard`)."""
    results: list[dict[str, Any]] = []
    with _engine_errors(), transaction.atomic():
        # The erasure's lock before the intent's row lock, in the erasure's order: it
        # cannot commit between this check and the writes below.
        advisory_xact_lock(erasure_lock_key(scope))
        current = IngestIntent.objects.select_for_update().get(pk=intent.pk)
        if current.state != IngestIntent.State.OPEN:
            recorded = _ingest_results_recorded(scope, recorded=list(current.results))
            return _ingest_results_stored(scope, recorded) if with_stored else recorded
        if SUPERSEDED_KEY in current.detail:
            return _ingest_discard(scope, intent=current, call=call, added_ids=added_ids)
        added = [m for m in (engine_lock_owned(scope, memory_id=i) for i in added_ids) if m is not None]
        too_long = [m for m in added if len(m.text) > MEMORY_MAX_CHARS]
        unstorable = [m for m in added if len(m.text) <= MEMORY_MAX_CHARS and text_problem(m.text)]
        for item in (*too_long, *unstorable):
            with _attributed(call):
                engine_delete_row(item.id)
        removed = {m.id for m in (*too_long, *unstorable)}
        added = [m for m in added if m.id not in removed]
        advisory_xact_lock(*(_text_lock_key(scope, content_sha256(m.text)) for m in added))
        for index, item in enumerate(added):
            digest = content_sha256(item.text)
            holder = _hash_owner_memory(scope, digest=digest)
            if holder is None and _content_hash_claim(scope, digest=digest, memory_id=item.id) is not None:
                holder = _hash_owner_memory(scope, digest=digest)  # an import stored the text meanwhile
            if holder is None or holder.id == item.id:
                results.append({"id": item.id, "memory": item.text, "event": "ADD"})
                continue
            narrowing = _attrs_narrowing(item.attrs)  # the call's agent_id/session_id, on mem0's row
            if not _within(holder, narrowing):
                # As a narrowed `remember` (`_remember_narrowed`): the holder is outside the
                # call's narrowing, which could neither list nor forget it. A copy inside is
                # the memory; else the fact stays there, beside the holder, without a hash.
                # Not this fact, nor a later one of the call: the first of the text is the memory.
                pending = {later.id for later in added[index:]}
                copy = _text_copy_within(scope, text=item.text, digest=digest, narrowing=narrowing, excluding=pending)
                if copy is None:
                    results.append({"id": item.id, "memory": item.text, "event": "ADD"})
                    continue
                holder = copy
            with _attributed(call):
                engine_delete_row(item.id)
            results.append({"id": holder.id, "memory": item.text, "event": "NONE"})
        after = [{**r, "memory": audit_text(r["memory"])} for r in results]
        ids = [r["id"] for r in results]
        detail = {
            **current.detail,
            **({"too_long": len(too_long)} if too_long else {}),
            **({"unstorable": len(unstorable)} if unstorable else {}),
        }
        if too_long:
            logger.warning("ingest: removed %d extracted facts over %d characters", len(too_long), MEMORY_MAX_CHARS)
        if unstorable:
            logger.warning("ingest: removed %d extracted facts with characters no text may hold", len(unstorable))
        # A call that answered an error (`_ingest_answered_error`) is completed by the
        # reconciler without a usage event: the client was told it failed.
        if current.detail.get("billed", True) and not current.detail.get(ANSWERED_ERROR_KEY):
            call_succeeded(scope, call=call, operation=Operation.INGEST, memory_ids=ids, after=after, detail=detail)
        else:  # memory_ingest's `billed=False`: the audit row only
            audit_record(scope, call=call, operation=Operation.INGEST, memory_ids=ids, after=after, detail=detail)
        current.state = IngestIntent.State.DONE
        # Ids and events only: a closed intent outlives the call, and the texts are the
        # user's content (the memories and the sealed audit row hold them).
        current.results = [{"id": r["id"], "event": r["event"]} for r in results]
        current.closed_at = timezone.now()
        current.save(update_fields=["state", "results", "closed_at"])
        return _ingest_results_stored(scope, results) if with_stored else results


def _ingest_results_stored(scope: MemoryScope, results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`results` each with `stored`: its memory as the call leaves it (`MemoryView.as_dict`;
    None for one deleted since), read in `_ingest_complete`'s transaction, which holds the
    rows locked, for a caller answering the memories whole (seed 001's store). No part of
    the audit row or the intent."""
    rows = engine_lock_owned_many(scope, memory_ids=[str(r["id"]) for r in results])
    return [
        {**r, "stored": memory_view(rows[str(r["id"])]).as_dict() if str(r["id"]) in rows else None} for r in results
    ]


def _ingest_discard(
    scope: MemoryScope, *, intent: IngestIntent, call: CallContext, added_ids: list[str]
) -> list[dict[str, Any]]:
    """The completion of a call the user's erasure (or clear-all) superseded, in
    `_ingest_complete`'s transaction: what mem0 stored goes as the erasure took the rest
    (`_ingest_leftovers_remove`), no hash is kept, and the call answers no memories (a
    success: an error would make clients and the chat proxy retry a conversation the user
    asked to forget). Its audit row (and usage event: the LLM work was done) names the
    ids and the erasure, no text."""
    mark = intent.detail[SUPERSEDED_KEY]
    discarded = _ingest_leftovers_remove(scope, intent=intent, call=call, added_ids=added_ids)
    detail = {**intent.detail, "discarded": len(discarded), "trashed": not mark["erased"] and _trash_enabled()}
    if intent.detail.get("billed", True) and not intent.detail.get(ANSWERED_ERROR_KEY):
        call_succeeded(scope, call=call, operation=Operation.INGEST, memory_ids=discarded, detail=detail)
    else:
        audit_record(scope, call=call, operation=Operation.INGEST, memory_ids=discarded, detail=detail)
    intent.state = IngestIntent.State.DONE
    intent.results = []  # a later answer from the intent (the call after the reconciler) is empty too
    intent.closed_at = timezone.now()
    intent.save(update_fields=["state", "results", "closed_at"])
    return []


def _ingest_leftovers_remove(
    scope: MemoryScope, *, intent: IngestIntent, call: CallContext, added_ids: list[str]
) -> list[str]:
    """What a superseded ingest stored, removed in the caller's transaction under the
    user's clear_all lock; returns the ids. The rows are those mem0 answered and those
    tagged with the request id (written after the erasure, or by a call that crashed
    before answering); the erasure itself took the ones that already existed.
    - An erasure: the rows are deleted for good and every history text of the call is
      blanked (also versions mem0 wrote after the erasure had deleted their row, which
      then have no owner: found by the request id), keeping the events.
    - A clear-all with the trash on: the rows join the trash under the clear-all's request
      id, so undoing the clear-all restores them with the rest.
    Either way mem0's raw messages go, as the erasure or clear-all purged them: mem0 saves
    the call's messages last, after the erasure (they have no request id, so the user's
    later messages go too; they only feed the next extraction)."""
    mark = intent.detail[SUPERSEDED_KEY]
    tagged = [row.id for row in engine_rows_from_request(request_id=intent.request_id)]
    candidates = list(dict.fromkeys([*added_ids, *tagged]))
    owned = list(engine_lock_owned_many(scope, memory_ids=candidates))
    if not mark["erased"] and _trash_enabled():
        if owned:
            with _attributed(call):
                engine_trash(
                    scope,
                    memory_ids=owned,
                    at=datetime.now(UTC),
                    request_id=mark["request_id"],
                    operation=Operation.CLEAR_ALL_MEMORY,
                )
    else:
        with _attributed(call):
            for memory_id in owned:
                engine_delete_row(memory_id, keep_text=False)
        written = MemoryHistory.objects.filter(request_id=intent.request_id).values_list("memory_id", flat=True)
        history_content_erase(engine_user_id=scope.engine_user_id, memory_ids=list({*candidates, *written}))
    engine_purge_messages(scope)
    return candidates


def _ingest_undone(scope: MemoryScope, *, intent: IngestIntent, call: CallContext, audited: bool = False) -> bool:
    """Close an intent whose call stored nothing (it failed, or the reconciler found no
    rows); `audited`: with the failure audit row the call itself could not write. One
    superseded by an erasure also loses what mem0 kept of it (raw messages, history
    texts). False when someone else closed it first."""
    with _engine_errors(), transaction.atomic():
        advisory_xact_lock(erasure_lock_key(scope))
        current = IngestIntent.objects.select_for_update().get(pk=intent.pk)
        if current.state != IngestIntent.State.OPEN:
            return False
        superseded = SUPERSEDED_KEY in current.detail
        if superseded:
            _ingest_leftovers_remove(scope, intent=current, call=call, added_ids=[])
        if audited:
            message = "interrupted before anything was stored"
            if superseded:
                message = "interrupted; the user erased or cleared their data meanwhile and nothing of it is kept"
            audit_failure(
                scope,
                call=call,
                operation=Operation.INGEST,
                error=ServiceError(ErrorCode.BACKEND_UNAVAILABLE, message),
            )
        current.state = IngestIntent.State.UNDONE
        current.closed_at = timezone.now()
        current.save(update_fields=["state", "closed_at"])
    return True


def ingest_intents_supersede(scope: MemoryScope, *, call: CallContext, erased: bool) -> int:
    """In the transaction of an erasure (`erased`) or a clear-all, under the user's
    clear_all lock: mark the user's ingest calls still in flight, so that their
    completion (the call, or the reconciler) discards what mem0 stores for them: deleted
    for good after an erasure, trashed with the clear-all otherwise. An erasure's mark
    wins over a clear-all's. The intents keep no content; the mark holds the superseding
    call's request id and time. Returns how many were marked."""
    mark = {"request_id": call.request_id, "at": timezone.now().isoformat(), "erased": erased}
    marked = 0
    in_flight = IngestIntent.objects.select_for_update().filter(
        engine_user_id=scope.engine_user_id, state=IngestIntent.State.OPEN
    )
    for intent in in_flight.order_by("pk"):
        if not erased and SUPERSEDED_KEY in intent.detail:
            continue
        intent.detail = {**intent.detail, SUPERSEDED_KEY: mark}
        intent.save(update_fields=["detail"])
        marked += 1
    return marked


def _ingest_intents_unsupersede(scope: MemoryScope, *, request_id: str) -> int:
    """The undo of a clear-all (its request id), under the user's erasure lock: the ingest
    calls it marked while they were in flight are no longer superseded, so they store
    their facts as if the clear-all had not happened (else they would land in the trash
    after the undo). An erasure's mark is never lifted. Returns how many."""
    lifted = 0
    in_flight = IngestIntent.objects.select_for_update().filter(
        engine_user_id=scope.engine_user_id, state=IngestIntent.State.OPEN
    )
    for intent in in_flight.order_by("pk"):
        mark = intent.detail.get(SUPERSEDED_KEY)
        if not mark or mark.get("erased") or mark.get("request_id") != request_id:
            continue
        intent.detail = {key: value for key, value in intent.detail.items() if key != SUPERSEDED_KEY}
        intent.save(update_fields=["detail"])
        lifted += 1
    return lifted


def _ingest_results_recorded(scope: MemoryScope, *, recorded: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The answer of an ingest completed by someone else (the reconciler, after a stall):
    the intent keeps ids and events only, so the texts are read from the memories as
    they are now (None for one deleted since). In `_ingest_complete`'s transaction."""
    rows = engine_lock_owned_many(scope, memory_ids=[str(r["id"]) for r in recorded])
    return [
        {"id": r["id"], "memory": rows[str(r["id"])].text if str(r["id"]) in rows else None, "event": r.get("event")}
        for r in recorded
    ]


def _scope_record(scope: MemoryScope) -> dict[str, Any]:
    return {"tenant": scope.tenant, "user_pk": scope.user_pk, "client_app": scope.client_app}


def _call_record(call: CallContext) -> dict[str, Any]:
    return {
        "channel": call.channel,
        "ip": call.ip,
        "user_agent": call.user_agent,
        "actor_username": call.actor_username,
        "actor_auth": call.actor_auth,
        "turn_id": call.turn_id,
        "actor_user_id": call.actor_user_id,
        "actor_role": call.actor_role,
        "subject": call.subject,
    }


def ingest_intents_reconcile(*, older_than_s: float | None = None) -> dict[str, int]:
    """Close the ingest intents a crash left open (older than the lease, so calls still
    running are left alone): rows tagged with the request id exist -> complete the call
    (hashes, audit row, usage event, as if it had returned; no usage event when the call
    answered an error, `ANSWERED_ERROR_KEY`; discarded when an erasure or clear-all
    superseded it); none -> close it as undone with a failure audit row (no
    usage event: nothing was stored)."""
    lease = settings.INGEST_INTENT_LEASE_S if older_than_s is None else older_than_s
    cutoff = timezone.now() - timedelta(seconds=lease)
    counts = {"completed": 0, "undone": 0, "skipped": 0, "failed": 0}
    for intent in IngestIntent.objects.filter(state=IngestIntent.State.OPEN, created_at__lt=cutoff).order_by("pk"):
        try:
            counts[_ingest_intent_reconcile(intent)] += 1
        except Exception as exc:  # noqa: BLE001 - one intent (a user's busy lock) must not hold up the others
            counts["failed"] += 1
            # The kind only: an exception's text may quote a row (memory content). It stays
            # open, and the next run (every minute) takes it again.
            logger.warning(
                "ingest reconcile: intent %s failed (%s); the next run retries",
                intent.pk,
                exc.code.value if isinstance(exc, ServiceError) else type(exc).__name__,
            )
    return {key: count for key, count in counts.items() if count or key in ("completed", "undone")}


# Closed intents deleted per statement by `ingest_intents_prune`: short transactions.
INGEST_INTENT_PRUNE_BATCH = 5000


def ingest_intents_prune(*, now: datetime | None = None) -> int:
    """Delete the intents of every user closed more than INGEST_INTENT_RETENTION_DAYS ago;
    returns how many. A closed intent is read only while its call can still come back to
    it: the call itself after the reconciler closed it (within the lease), and the chat
    proxy's next look at a turn whose attempt finished (`_attempt_states`, within the
    sweep's retry delay); the audit row and the usage event are the lasting record. Open
    ones (calls in flight or left by a crash) are never pruned: the reconciler owes them
    their completion. In batches, oldest first from the index, so no statement holds many
    row locks or runs long."""
    cutoff = (now or timezone.now()) - timedelta(days=settings.INGEST_INTENT_RETENTION_DAYS)
    closed = IngestIntent.objects.exclude(state=IngestIntent.State.OPEN).filter(closed_at__lt=cutoff)
    return rows_delete_in_batches(closed, order_by="closed_at", batch_size=INGEST_INTENT_PRUNE_BATCH)


def _ingest_intent_reconcile(intent: IngestIntent) -> str:
    """Close one intent left open; which way it went ("completed", "undone", or "skipped"
    when another closer got there first)."""
    scope = MemoryScope(**intent.scope)
    call = CallContext(request_id=intent.request_id, **intent.call)
    rows = engine_rows_from_request(request_id=intent.request_id)
    if rows:
        _ingest_complete(scope, intent=intent, call=call, added_ids=[r.id for r in rows])
        return "completed"
    return "undone" if _ingest_undone(scope, intent=intent, call=call, audited=True) else "skipped"


def memory_update(
    scope: MemoryScope,
    *,
    memory_id: str,
    memory: str | None = None,
    pinned: bool | None = None,
    metadata: dict[str, Any] | None = None,
    fields: dict[str, Any] | None = None,
    within: Mapping[str, str] | None = None,
    call: CallContext,
) -> MemoryView:
    """Change text, pin state, metadata or fields of one of the scope's memories.
    Metadata is merged, never wiped. Serialised per memory with concurrent updates and
    deletes. `within` (seed 001's agent_id/session_id) narrows: a memory outside it is
    `not_found`, judged on the locked row.

    New text that another of the user's memories already has answers `conflict` (with
    its id) and changes nothing. Narrowed by `within`, only a memory inside it is named:
    when the text's hash holder is outside, a live copy inside is the conflict, else the
    memory takes the text beside the holder without a hash (as a narrowed `remember`
    stores its copy). Fields that move the memory to another agent or session make the
    update a store there too: the text's memory there is the conflict (`_move_conflict`).
    The row, its history, the hash, the usage event and the audit row commit together."""
    rate_limit_consume(scope, operation=Operation.UPDATE_MEMORY)
    changes = dict(metadata or {})
    if pinned is not None:
        changes["pinned"] = pinned
    source = (fields or {}).get("source")
    if source:
        changes["source"] = source
    read = memory_get_owned(scope, memory_id=memory_id)
    if not _within(read, within):  # not_found before any embedding
        raise not_found()
    text = memory.strip() if memory is not None else None
    digest = content_sha256(memory) if memory is not None else None
    embedded = None
    if text is not None:
        with _engine_errors():
            embedded = engine_embed_text(text)
    # A move keeps its text's lock too (a new text's is taken anyway): named from the read
    # above, checked on the locked row, and again when another update changed it meanwhile.
    moved_digest = _move_text_digest(read, fields) if digest is None else None
    for _attempt in range(3):
        with _engine_errors(), transaction.atomic():
            lock_digest = digest or moved_digest
            keys = [f"memory:{memory_id}"] + ([_text_lock_key(scope, lock_digest)] if lock_digest else [])
            # Every update, not only new text: its history row and hash are the user's rows too.
            user_write_locks(scope, *keys)
            current = engine_lock_owned(scope, memory_id=memory_id)
            if current is None or not _live(current, scope) or not _within(current, within):
                raise not_found()
            if digest is None and _move_text_digest(current, fields) not in (None, moved_digest):
                moved_digest = _move_text_digest(current, fields)
                continue  # its text or agent changed since the read: again, under the right lock
            if source == STORE_MEMORY_SOURCE and not _toolkit_row(current):
                reserved = f"source: {STORE_MEMORY_SOURCE!r} is reserved for the toolkit's store_memory"
                raise ServiceError(ErrorCode.INVALID_ARGUMENT, reserved)
            attrs = _attrs(fields, base=current.attrs) if fields else None
            if metadata:
                _metadata_merge_check(current, metadata=metadata)
            existing_id = None
            text_changed = digest is not None and content_sha256(current.text) != digest
            # The owner's edit, not only a pin, keeps an expiring turn fact (a resent text or an
            # unpin changes nothing of it, so neither makes it durable).
            edited = text_changed or bool(metadata or source) or pinned is True
            if edited or (attrs is not None and attrs != current.attrs):
                attrs = (
                    _turn_fact_owner_edited_attrs(current.attrs, attrs or current.attrs, fields=fields or {}) or attrs
                )
            if digest is not None and text is not None:
                holder = _hash_owner_memory(scope, digest=digest)
                existing_id = holder.id if holder is not None else None
                # Only a new text can collide: a memory living beside the hash's holder without
                # one (a restored older copy, a store_memory short-term row) may resend its own.
                if text_changed and holder is not None and holder.id != memory_id:
                    if _within(holder, within):
                        raise _duplicate_text(holder.id)
                    # As a narrowed `remember`: a conflict naming a memory outside the caller's
                    # narrowing would hand it an id it can neither list nor forget. A copy of the
                    # text inside is the conflict; else the memory takes the text beside the
                    # holder without a hash (the holder keeps it: `existing_id` is set, so no
                    # claim below).
                    copy = _text_copy_within(
                        scope, text=text, digest=digest, narrowing=within or {}, excluding=(memory_id,)
                    )
                    if copy is not None:
                        raise _duplicate_text(copy.id)
            destination = _moved_to(current.attrs, fields)
            if destination is not None and current.metadata.get(TIER_KEY) != "stm":
                # A move is a store into its destination (`_remember_narrowed`): no second
                # live copy of the text there. A toolkit short-term row lives beside its text.
                moved_text = text if text is not None else current.text
                found = _move_conflict(
                    scope,
                    memory_id=memory_id,
                    text=moved_text,
                    digest=digest or content_sha256(moved_text),
                    destination=destination,
                )
                if found is not None:
                    raise _duplicate_text(found)
            if text_changed and SUMMARY_KEY in current.metadata and _toolkit_row(current):
                # The enrichment's summary describes the old text (recall returns it): it goes,
                # and the candidate is pending again, so the sweep enriches the new text. Only
                # on store_memory's rows: on another memory `summary` is the owner's own key
                # (and enrichment never takes it up again).
                engine_metadata_merge(
                    memory_id=memory_id, metadata={ENRICHMENT_KEY: "pending"}, drop=ENRICHMENT_RESULT_KEYS
                )
            with _attributed(call):
                updated = engine_update_row(memory_id, embedded=embedded, metadata=changes or None, attrs=attrs)
            if digest is not None:
                dropped, _ = ContentHash.objects.filter(memory_id=memory_id).exclude(sha256=digest).delete()
                if dropped and text_changed:
                    # The old text's hash goes to another live copy of it, if any (as a delete's
                    # does). Not under that text's lock: a remember of it waits on this row's
                    # hash, and then finds the heir (or none) in one committed state.
                    _hash_hand_over(scope, digest=content_sha256(current.text), text=current.text)
                if existing_id is None:
                    # An import may have stored the text meanwhile: then nothing changes, as above.
                    taken_by = _content_hash_claim(scope, digest=digest, memory_id=memory_id)
                    if taken_by is not None:
                        raise _duplicate_text(taken_by)
            call_succeeded(
                scope,
                call=call,
                operation=Operation.UPDATE_MEMORY,
                memory_ids=[memory_id],
                before=_snapshot(current),
                after=_snapshot(updated),
                # The old text is forgotten: answers worked out from it go.
                detail=_derived_answers_forgotten(scope) if text_changed else None,
            )
        return memory_view(updated)
    # A race that outlasted the re-reads, not a conflict of the caller's: retryable.
    raise ServiceError(
        ErrorCode.RESOURCE_BUSY,
        "The memory kept changing while this update waited for it; retry.",
        retry_after_s=LOCK_RETRY_AFTER_S,
    )


def _moved_to(current: MemoryAttrs, fields: Mapping[str, Any] | None) -> dict[str, str] | None:
    """The agent and session (as `_attrs_narrowing` has them) an update's `fields` move a
    memory with `current` fields to, or None when it stays where it is (naming the agent
    and session it is in moves nothing)."""
    given = {key: value for key, value in (fields or {}).items() if key in ("agent_id", "session_id")}
    if not given:
        return None
    after = _attrs_narrowing(_attrs(given, base=current))
    return after if after != _attrs_narrowing(current) else None


def _move_text_digest(item: EngineMemory, fields: Mapping[str, Any] | None) -> str | None:
    """The hash of `item`'s text when `fields` move it: the text lock a move takes."""
    return content_sha256(item.text) if _moved_to(item.attrs, fields) is not None else None


def _move_conflict(
    scope: MemoryScope, *, memory_id: str, text: str, digest: str, destination: Mapping[str, str]
) -> str | None:
    """The memory an update moving `memory_id` (with the text `digest`) to `destination`
    conflicts with, as a store narrowed there would answer it: the hash's holder when it
    is there, else a live copy there (`_text_copy_within`). Out of every agent and session
    (`destination` empty) only the holder: the user's one memory of the text, while the
    copies in agents and sessions stay theirs. In the caller's transaction, under the text
    lock."""
    holder = _hash_owner_memory(scope, digest=digest)
    if holder is not None and holder.id != memory_id and _within(holder, destination):
        return holder.id
    if not destination:
        return None
    copy = _text_copy_within(scope, text=text, digest=digest, narrowing=destination, excluding=(memory_id,))
    return copy.id if copy is not None else None


def _within(item: EngineMemory, within: Mapping[str, str] | None) -> bool:
    """Whether the memory is of the agent and session a call names (seed 001's scope): a
    call about a memory outside them answers as for a missing id."""
    return all(getattr(item.attrs, key) == value for key, value in (within or {}).items())


def _derived_answers_forgotten(scope: MemoryScope) -> dict[str, int]:
    """In the transaction of a delete or a text change: what other apps worked out from the
    user's memories goes (memories.sessions.derived_answers_forget: the toolkit's cached
    answers), so no cache hit hands the forgotten fact back. For the audit row's detail: the
    count, when there was any."""
    dropped = derived_answers_forget(scope)
    return {"derived_answers_deleted": dropped} if dropped else {}


def _metadata_merge_check(current: EngineMemory, *, metadata: dict[str, Any]) -> None:
    """The owner's own metadata, merged, stays within `remember`'s limits (each update is
    checked alone at the edge): an export holding more could not be imported. Own as the
    import of a memsite file counts it (`schemas.metadata_own`): the enrichment's keys and
    an imported mem0 memory's speaker keys are on top, so such a memory takes as many keys
    of the owner's as any other. An update that does not make a memory that is already
    over them (stored before this check) larger goes through. Counts only in the
    message, never keys or values."""
    before = metadata_own(memory_view(current).metadata)
    merged = metadata_own({**before, **metadata})
    keys, size = len(merged), metadata_json_bytes(merged)
    if keys > METADATA_MAX_KEYS and keys > len(before):
        raise ServiceError(
            ErrorCode.PAYLOAD_TOO_LARGE,
            f"metadata would have {keys} keys of your own after this update (the memory has {len(before)}); "
            f"a memory holds at most {METADATA_MAX_KEYS}. Nothing was changed.",
        )
    if size > METADATA_MAX_BYTES and size > metadata_json_bytes(before):
        raise ServiceError(
            ErrorCode.PAYLOAD_TOO_LARGE,
            f"metadata would take {size} bytes as JSON after this update; "
            f"a memory holds at most {METADATA_MAX_BYTES}. Nothing was changed.",
        )


def _snapshot(item) -> dict[str, Any]:
    view = memory_view(item)
    return {
        **audit_snapshot(memory=view.memory, pinned=view.pinned, metadata=view.metadata),
        **_audit_attrs(item.attrs),
    }


@contextmanager
def _attributed(call: CallContext) -> Iterator[None]:
    with history_attribution(request_id=call.request_id, changed_by=call.changed_by):
        yield


def _trash_enabled() -> bool:
    return settings.TRASH_RETENTION_DAYS > 0


def _trash_or_delete(
    scope: MemoryScope, *, memory_ids: list[str] | None, call: CallContext, operation: str
) -> list[str]:
    """Inside the caller's transaction: move the memories (all of the scope's when None)
    to the trash, or delete them for good when the trash is off. Returns the ids."""
    with _attributed(call):
        if _trash_enabled():
            return engine_trash(
                scope, memory_ids=memory_ids, at=datetime.now(UTC), request_id=call.request_id, operation=operation
            )
        # Deleted for good, as a purge: the history keeps the events, not the texts.
        if memory_ids is None:
            deleted = engine_delete_user_rows(scope, keep_text=False)
        else:
            deleted = [memory_id for memory_id in memory_ids if engine_delete_row(memory_id, keep_text=False)]
    history_content_erase(engine_user_id=scope.engine_user_id, memory_ids=deleted)
    return deleted


def _delete_target(
    scope: MemoryScope, *, memory_id: str, within: Mapping[str, str] | None
) -> tuple[EngineMemory, list[EngineMemory]]:
    """A delete's (or its dry run's) rate-limited first read: the memory, not_found when it
    is not the scope's or lies outside `within`, and the other row of its message."""
    rate_limit_consume(scope, operation=Operation.DELETE_MEMORY)
    item = memory_get_owned(scope, memory_id=memory_id)
    if not _within(item, within):
        raise not_found()
    with _engine_errors():
        twins = _message_twins(scope, item)
    return item, twins


def memory_delete_dry_run(
    scope: MemoryScope, *, memory_id: str, within: Mapping[str, str] | None = None, call: CallContext
) -> list[str]:
    """What memory_delete would move to the trash (the memory, then the other row of its
    toolkit store_memory message), changing nothing: a billed, audited read that answers
    `not_found` exactly as the delete would (another user's id, outside `within`)."""
    _item, twins = _delete_target(scope, memory_id=memory_id, within=within)
    ids = [memory_id, *(twin.id for twin in twins)]
    with transaction.atomic():
        call_succeeded(
            scope,
            call=call,
            operation=Operation.DELETE_MEMORY,
            memory_ids=ids,
            detail={"dry_run": True, "linked": ids[1:]},
        )
    return ids


def memory_delete(
    scope: MemoryScope,
    *,
    memory_id: str,
    forget: bool = False,
    within: Mapping[str, str] | None = None,
    call: CallContext,
) -> list[str]:
    """Move one memory to the trash (restorable for TRASH_RETENTION_DAYS; 0 deletes it at
    once), with the other row of its toolkit store_memory message (`_message_twins`):
    recall shows the pair as one memory, so deleting either (on any surface) deletes both,
    under this call's request id (restoring by it brings both back). `forget` records a
    user-initiated forget (seed 001's /forget). The row changes, their history, the
    hashes, mem0's raw messages, the usage event and the audit row (naming every id)
    commit in one transaction. Returns the ids, the one asked for first. `within` (seed
    001's agent_id/session_id) narrows: a memory outside it is `not_found`, judged on the
    locked row."""
    item, twins = _delete_target(scope, memory_id=memory_id, within=within)
    # The text locks for the hashes a trashed row may hand over (read before the locks,
    # checked again after them).
    digests = {content_sha256(row.text) for row in (item, *twins)}
    detail: dict[str, Any] = {"forget": True} if forget else {}
    with _engine_errors(), transaction.atomic():
        # Their history rows are the user's too.
        user_write_locks(
            scope,
            *(f"memory:{row.id}" for row in (item, *twins)),
            *(_text_lock_key(scope, digest) for digest in digests),
        )
        locked = engine_lock_owned_many(scope, memory_ids=[memory_id, *(twin.id for twin in twins)])
        current = locked.get(memory_id)
        if current is None or not _live(current, scope) or not _within(current, within):
            raise not_found()
        # Again under the locks: a restore (which holds the erasure lock we now share) may
        # have brought a twin back after the read above.
        twin_ids = _twin_ids(scope, current)
        locked |= engine_lock_owned_many(scope, memory_ids=[i for i in twin_ids if i not in locked])
        twins = [locked[i] for i in twin_ids if _pairs(scope, current, locked.get(i))]
        wanted = [memory_id, *(twin.id for twin in twins)]
        trashed = set(_trash_or_delete(scope, memory_ids=wanted, call=call, operation=Operation.DELETE_MEMORY))
        if memory_id not in trashed:
            raise not_found()
        ids = [i for i in wanted if i in trashed]
        # In the trash a memory is not counted for dedupe: its hash goes to a live copy, if any.
        for row in (current, *twins):
            if row.id not in trashed:
                continue
            dropped, _ = ContentHash.objects.filter(memory_id=row.id).delete()
            if dropped and content_sha256(row.text) in digests:  # else its text changed before the lock
                _hash_hand_over(scope, digest=content_sha256(row.text), text=row.text)
        # mem0's raw messages feed the next extraction (it would bring the fact back); the
        # facts are extracted, not verbatim, so all of the user's go, as clear-all's do.
        engine_purge_messages(scope)
        detail |= _derived_answers_forgotten(scope)
        call_succeeded(
            scope,
            call=call,
            operation=Operation.DELETE_MEMORY,
            memory_ids=ids,
            before=_snapshot(current),
            detail={**detail, "trashed": _trash_enabled(), "linked": ids[1:]},
        )
    return ids


# --- the two rows of a toolkit store_memory message --------------------------------------------
# store_memory's rows (memories/toolkit/services.py): the short-term row of each message
# and, for a human message, its long-term candidate linked to it by `stm_id`.
STORE_MEMORY_SOURCE = RESERVED_SOURCE  # set by no client but on its own rows (schemas.FieldsMixin, memory_update)
STM_LINK_KEY = "stm_id"
# store_memory's long-term candidates, pending the toolkit's enrichment. `tier` and
# `enrichment_status` are metadata any surface may set, and a memory the user remembered
# with them must keep its own tags, type and importance: only rows store_memory wrote
# (`source`, as `_pairs` checks) are taken.
CANDIDATE_CONTAINMENT = {"source": STORE_MEMORY_SOURCE, TIER_KEY: "ltm", ENRICHMENT_KEY: "pending"}


def _toolkit_row(item: EngineMemory) -> bool:
    """A row the toolkit's store_memory made (no client may set its `source`)."""
    return item.metadata.get("source") == STORE_MEMORY_SOURCE


def _twin_ids(scope: MemoryScope, item: EngineMemory) -> list[str]:
    """Ids that may hold the other row of the message `item` was stored from: a short-term
    row's long-term candidate (linked to it by `stm_id`), or a candidate's short-term row.
    store_memory returns only the short-term id and recall shows either row of a pair as
    the one memory, so deleting either must delete both. `_pairs` decides."""
    if not _toolkit_row(item):
        return []
    tier = item.metadata.get(TIER_KEY)
    if tier == "stm":
        return engine_memory_ids(
            scope, containment={"source": STORE_MEMORY_SOURCE, TIER_KEY: "ltm", STM_LINK_KEY: item.id}
        )
    linked = item.metadata.get(STM_LINK_KEY)
    return [linked] if tier == "ltm" and _is_uuid(linked) and linked != item.id else []


def _pairs(scope: MemoryScope, item: EngineMemory, other: EngineMemory | None) -> bool:
    """`other` is the live other row of `item`'s message. Only rows store_memory made pair:
    `source` is set by it alone, while `tier` and `stm_id` are metadata any surface may set."""
    if other is None or not _live(other, scope) or not _toolkit_row(other):
        return False
    tiers = (item.metadata.get(TIER_KEY), other.metadata.get(TIER_KEY))
    if tiers == ("stm", "ltm"):
        return other.metadata.get(STM_LINK_KEY) == item.id
    return tiers == ("ltm", "stm") and item.metadata.get(STM_LINK_KEY) == other.id


def _message_twins(scope: MemoryScope, item: EngineMemory) -> list[EngineMemory]:
    """The live other rows of `item`'s message, read without locks (before the transaction)."""
    twins = []
    for twin_id in _twin_ids(scope, item):
        try:
            twin = memory_get_owned(scope, memory_id=twin_id)
        except ServiceError as error:
            if error.code == ErrorCode.NOT_FOUND:  # expired or deleted on its own: the one row alone
                continue
            raise
        if _pairs(scope, item, twin):
            twins.append(twin)
    return twins


def _is_uuid(value: Any) -> TypeGuard[str]:
    if not isinstance(value, str):
        return False
    try:
        uuid.UUID(value)
    except ValueError:
        return False
    return True


def _holds_hash_first(item: EngineMemory) -> bool:
    # As the importer's rule (ImportItem.holds_hash_first) for rows of the engine.
    return item.metadata.get(TIER_KEY) != "stm" and item.attrs.expires_at is None


def _hash_hand_over(scope: MemoryScope, *, digest: str, text: str) -> str | None:
    """After the memory holding `digest` left (it is in the trash or gone): another live
    memory of the user with the same text gets the hash, so remembering the text again
    finds it (one lived beside it without a hash: restored next to a newer copy). A
    toolkit short-term copy never holds one, as in live data; a long-term one without
    expiry is preferred, then the oldest. In the caller's transaction, under the text lock."""
    copies = engine_text_copies_locked(scope, text=text).values()
    eligible = [
        item
        for item in copies
        if _live(item, scope) and item.metadata.get(TIER_KEY) != "stm" and content_sha256(item.text) == digest
    ]
    if not eligible:
        return None
    heir = min(eligible, key=lambda item: (not _holds_hash_first(item), item.created_at or "", item.id))
    # An import that stored the text meanwhile keeps the hash; the heir lives beside it.
    return _content_hash_claim(scope, digest=digest, memory_id=heir.id) or heir.id


def memory_clear_all(scope: MemoryScope, *, confirm: bool, call: CallContext) -> int:
    """Move every memory of the scope's user to the trash (or delete them when the trash
    is off), drop their dedupe hashes and purge mem0's raw messages (so a later ingest
    cannot bring cleared facts back), in one transaction with the usage event and audit
    row. Ingest calls in flight are marked: what they store follows into the trash under
    this call's request id when they complete. Turns in flight (memory_after_turn) store
    nothing. Returns the count."""
    if confirm is not True:
        raise ServiceError(
            ErrorCode.CONFIRMATION_REQUIRED, "clear_all_memory deletes all your memories; call it with confirm: true."
        )
    rate_limit_consume(scope, operation=Operation.CLEAR_ALL_MEMORY)
    with _engine_errors(), transaction.atomic():
        advisory_xact_lock(erasure_lock_key(scope))
        memory_ids = _trash_or_delete(scope, memory_ids=None, call=call, operation=Operation.CLEAR_ALL_MEMORY)
        engine_purge_messages(scope)
        ContentHash.objects.filter(engine_user_id=scope.engine_user_id).delete()
        ingest_intents_supersede(scope, call=call, erased=False)  # their facts join this clear-all's trash
        # Turns still being processed (memory_after_turn past its claim, in its extraction):
        # their guard goes, so they store nothing after this clear (`conflict`). Done turns
        # keep theirs: a retry of one still answers as a duplicate.
        TurnGuard.objects.filter(engine_user_id=scope.engine_user_id, state=TurnGuard.State.PROCESSING).delete()
        session_data_clear_all(scope)  # what other apps keep that could re-teach it (chat turns and logs, cache)
        call_succeeded(
            scope,
            call=call,
            operation=Operation.CLEAR_ALL_MEMORY,
            memory_ids=memory_ids,
            detail={"deleted": len(memory_ids), "trashed": _trash_enabled()},
        )
    return len(memory_ids)


@dataclass(frozen=True)
class ForgetResult:
    deleted_count: int
    dry_run: bool

    def as_dict(self) -> dict[str, Any]:
        return {"deleted_count": self.deleted_count, "dry_run": self.dry_run}


def _bulk_twin_ids(scope: MemoryScope, rows: list[EngineMemory]) -> list[str]:
    """The live other rows of the store_memory messages among `rows` (see memory_delete)."""
    candidates = {twin_id: row for row in rows for twin_id in _twin_ids(scope, row)}
    others = engine_lock_owned_many(scope, memory_ids=list(candidates)) if candidates else {}
    return [twin_id for twin_id, row in candidates.items() if _pairs(scope, row, others.get(twin_id))]


def memory_forget_bulk(
    scope: MemoryScope,
    *,
    tags: list[str] | None = None,
    time_range: tuple[str | None, str | None] | None = None,
    memory_type: str | None = None,
    confirm: bool = False,
    dry_run: bool = False,
    call: CallContext,
) -> ForgetResult:
    """Bulk forget (seed 003): the scope's live memories with all of `tags`, created in
    `time_range` [start, end) and/or of `memory_type` go to the trash. `confirm: true`
    is required unless `dry_run`, which only counts."""
    if not dry_run and confirm is not True:
        raise ServiceError(
            ErrorCode.CONFIRMATION_REQUIRED,
            "bulk delete needs confirm: true (use dry_run: true to count what would be deleted).",
        )
    if not tags and time_range is None and memory_type is None:
        raise ServiceError(ErrorCode.INVALID_ARGUMENT, "give at least one of tags, time_range, memory_type")
    rate_limit_consume(scope, operation=Operation.DELETE_MEMORY)
    start, end = time_range or (None, None)
    containment = attrs_containment(memory_type=memory_type, tags=tags)
    created_from = engine_timestamp(parse_instant(start, what="start")) if start else None
    created_before = engine_timestamp(parse_instant(end, what="end")) if end else None
    criteria = {"tags": tags or [], "time_range": {"start": start, "end": end}, "memory_type": memory_type}
    with _engine_errors(), transaction.atomic():
        advisory_xact_lock(erasure_lock_key(scope))
        memory_ids = engine_memory_ids(
            scope, containment=containment, created_from=created_from, created_before=created_before
        )
        matched: dict[str, EngineMemory] = {}
        if memory_ids:
            # As memory_delete: the other row of a store_memory message goes too (recall
            # shows the pair as one memory), so a dry run counts it as the forget will.
            matched = engine_lock_owned_many(scope, memory_ids=memory_ids)
            memory_ids = list(dict.fromkeys([*memory_ids, *_bulk_twin_ids(scope, list(matched.values()))]))
        if dry_run:
            call_succeeded(
                scope,
                call=call,
                operation=Operation.DELETE_MEMORY,
                detail={"bulk": criteria, "dry_run": True, "count": len(memory_ids)},
            )
            return ForgetResult(deleted_count=len(memory_ids), dry_run=True)
        forgotten: dict[str, int] = {}
        held: dict[str, str] = {}
        texts: dict[str, str] = {}
        if memory_ids:
            # As memory_delete: a hash goes to a live copy of its text.
            hashes = ContentHash.objects.filter(engine_user_id=scope.engine_user_id, memory_id__in=memory_ids)
            held = {str(memory_id): digest for memory_id, digest in hashes.values_list("memory_id", "sha256")}
            locked = {**matched, **engine_lock_owned_many(scope, memory_ids=[i for i in held if i not in matched])}
            texts = {memory_id: locked[memory_id].text for memory_id in held if memory_id in locked}
            memory_ids = _trash_or_delete(scope, memory_ids=memory_ids, call=call, operation=Operation.DELETE_MEMORY)
            engine_purge_messages(scope)  # as memory_delete: the next extraction must not bring them back
            forgotten = _derived_answers_forgotten(scope)
        ContentHash.objects.filter(engine_user_id=scope.engine_user_id, memory_id__in=memory_ids).delete()
        for memory_id in memory_ids:  # under the erasure lock: no write of the user runs meanwhile
            digest, text = held.get(memory_id), texts.get(memory_id)
            if digest is not None and text is not None and content_sha256(text) == digest:
                _hash_hand_over(scope, digest=digest, text=text)
        call_succeeded(
            scope,
            call=call,
            operation=Operation.DELETE_MEMORY,
            memory_ids=memory_ids,
            detail={
                "bulk": criteria,
                "dry_run": False,
                "count": len(memory_ids),
                "trashed": _trash_enabled(),
                **forgotten,
            },
        )
    return ForgetResult(deleted_count=len(memory_ids), dry_run=False)


# --- the trash: restore, delete forever, the purge job ------------------------------------
def memory_restore(
    scope: MemoryScope, *, memory_id: str | None = None, request_id: str | None = None, call: CallContext
) -> list[str]:
    """Take memories out of the trash with the same ids and history: one by id, or all
    that one call deleted (its request id). A restored memory gets its dedupe hash back
    unless the same text was remembered again meanwhile (then the newer memory keeps
    it and the restored one lives on beside it, unless the newer one expires and the
    restored one does not: then it moves). Hashes go to the memories that hold
    one in live data: never a toolkit short-term copy, and of equal texts restored
    together the long-term one without expiry (`_restored_hashes`).

    A memory whose expiry passed while it was in the trash stays there (the purge
    deletes it): restored it would be invisible. By id that answers `not_found` saying
    so; by request id the others are restored and the audit row counts the expired."""
    rate_limit_consume(scope, operation=Operation.RESTORE_MEMORY)
    now = datetime.now(UTC)
    memory_ids = [memory_id] if memory_id else None
    by_id = memory_ids is not None
    with _engine_errors(), transaction.atomic():
        advisory_xact_lock(erasure_lock_key(scope))
        with _attributed(call):
            restored = engine_restore(
                scope, memory_ids=memory_ids, request_id=None if by_id else request_id, unexpired_at=now
            )
        expired = 0
        if not by_id and request_id:
            # What the call trashed and is still there: the expired ones (this holds the
            # user's erasure lock, so nothing else moves their trash meanwhile).
            expired = sum(
                1 for item in engine_trashed(scope, request_id=request_id, limit=1_000_000) if item.expired(now)
            )
        if not restored:
            if by_id:
                expired = sum(1 for item in engine_trashed(scope, memory_ids=memory_ids) if item.expired(now))
            if expired:
                raise _expired_in_trash(several=not by_id)
            raise not_found(denied=memory_id is not None and _foreign_id(scope, memory_id=memory_id))
        _restored_hashes(scope, restored=restored)
        ids = [item.id for item in restored]
        if request_id and not by_id:
            # Undoing a clear-all: the ingest calls it caught in flight keep what they store.
            _ingest_intents_unsupersede(scope, request_id=request_id)
        call_succeeded(
            scope,
            call=call,
            operation=Operation.RESTORE_MEMORY,
            memory_ids=ids,
            detail={"restored": len(ids), "request_id": request_id or "", **({"expired": expired} if expired else {})},
        )
    return ids


def _foreign_id(scope: MemoryScope, *, memory_id: str) -> bool:
    """`memory_id` is another user's memory (live or in their trash): answered `not_found`
    like a missing one, but audited as denied (as `memory_get_owned` does)."""
    item = engine_get(memory_id)
    return item is not None and item.user_id != scope.engine_user_id


def _expired_in_trash(*, several: bool) -> ServiceError:
    # Only for the scope's own trash: another user's id never gets here (engine_trashed
    # is the scope's), so it still answers like a missing one.
    what = "Everything that call deleted" if several else "That memory"
    return ServiceError(
        ErrorCode.NOT_FOUND, f"{what} expired while in the trash and can no longer be restored; nothing was restored."
    )


# Digests looked up per statement when restoring (a clear-all's undo may bring back
# every memory of the user).
RESTORE_HASH_BATCH = 1000


def _restored_hashes(scope: MemoryScope, *, restored: list[EngineMemory]) -> None:
    """Dedupe hashes for restored memories, in the restore's transaction under the user's
    erasure lock. Per text, the restored memory that holds one in live data gets it
    (`_holds_hash_first` first, in restore order otherwise; a short-term copy never),
    unless a live memory holds it already; a hash whose memory went away (expired) is
    taken over. A live holder with an expiry hands it to a restored one without: when
    the holder expires, the purge drops its hash, and the copy left would hold none."""
    holders: dict[str, EngineMemory] = {}
    for item in sorted(restored, key=lambda item: not _holds_hash_first(item)):  # stable
        if item.metadata.get(TIER_KEY) != "stm":
            holders.setdefault(content_sha256(item.text), item)
    digests = list(holders)
    owned: dict[str, EngineMemory] = {}
    for start in range(0, len(digests), RESTORE_HASH_BATCH):
        owned |= _hash_owner_rows(scope, digests=digests[start : start + RESTORE_HASH_BATCH])
    ContentHash.objects.bulk_create(
        [
            ContentHash(engine_user_id=scope.engine_user_id, sha256=digest, memory_id=item.id)
            for digest, item in holders.items()
            if digest not in owned
        ],
        ignore_conflicts=True,
    )
    for digest, owner in owned.items():
        heir = holders[digest]
        if not _holds_hash_first(owner) and _holds_hash_first(heir):
            ContentHash.objects.filter(engine_user_id=scope.engine_user_id, sha256=digest).update(memory_id=heir.id)


@dataclass(frozen=True)
class TrashPage:
    items: list[TrashedView]
    next_cursor: str | None


def memory_trash_read(
    scope: MemoryScope, *, cursor: str | None = None, page_size: int = 200, call: CallContext
) -> TrashPage:
    """One page of the scope's trash for an API caller (GET /v1/trash), most recently
    deleted first; `next_cursor` goes on from the last item shown, so a memory restored
    or purged meanwhile shifts nothing. Deleted memories are still the subject's content
    and a credential may read them on someone's behalf, so each page is rate limited,
    billed and audited as a list call, with the ids it showed. (The web UI's own Trash
    page reads `memory_trash_list` directly, like the history view.)"""
    rate_limit_consume(scope, operation=Operation.LIST_MEMORY)
    after = _decode_cursor(cursor) if cursor else None
    trashed = memory_trash_list(scope, after=after, limit=page_size + 1)
    shown = trashed[:page_size]
    next_cursor = None
    if len(trashed) > page_size:
        next_cursor = cursor_encode(shown[-1].trashed_at, shown[-1].memory.id)
    with transaction.atomic():
        call_succeeded(
            scope,
            call=call,
            operation=Operation.LIST_MEMORY,
            memory_ids=[item.memory.id for item in shown],
            detail={"trash": True, "page_size": page_size, "paged": bool(cursor), "results": len(shown)},
        )
    return TrashPage(items=shown, next_cursor=next_cursor)


def memory_purge(scope: MemoryScope, *, memory_id: str | None = None, call: CallContext) -> int:
    """Delete for good: one memory in the scope's trash, or (no id) the whole trash.
    Returns how many this call deleted: the trash is read without row locks, and a row
    the purge job deleted meanwhile is neither counted nor named in the audit row (the
    job's row names it). mem0's raw messages of the user go too, as clear-all's do: they
    feed the next extraction, which would bring the deleted facts back."""
    rate_limit_consume(scope, operation=Operation.PURGE_MEMORY)
    with _engine_errors(), transaction.atomic():
        advisory_xact_lock(erasure_lock_key(scope))
        trashed = engine_trashed(scope, memory_ids=[memory_id] if memory_id else None, limit=1_000_000)
        if memory_id and not trashed:
            raise not_found(denied=_foreign_id(scope, memory_id=memory_id))
        with _attributed(call):
            ids = [item.id for item in trashed if engine_delete_row(item.id, keep_text=False)]
        if memory_id and not ids:
            raise not_found()  # the purge job deleted it meanwhile
        # For good means the texts go from the history too; its events (what, when, who) stay.
        history_content_erase(engine_user_id=scope.engine_user_id, memory_ids=ids)
        if ids:
            engine_purge_messages(scope)
        call_succeeded(scope, call=call, operation=Operation.PURGE_MEMORY, memory_ids=ids, detail={"purged": len(ids)})
    return len(ids)


def memory_purge_due(*, now: datetime | None = None, batch: int = 500) -> int:
    """The periodic purge: trash older than TRASH_RETENTION_DAYS and expired memories are
    deleted for good, with one audit row per user and batch. Returns how many."""
    now = now or datetime.now(UTC)
    trashed_before = now - timedelta(days=settings.TRASH_RETENTION_DAYS)
    call = CallContext(channel=Channel.INTERNAL, actor_username="system:purge")
    total = 0
    while True:
        # One transaction per batch: the rows are selected FOR UPDATE, so a restore racing
        # the purge either wins (the row is skipped) or waits and finds nothing.
        with _engine_errors(), transaction.atomic(), _attributed(call):
            due = engine_purge_due(trashed_before=trashed_before, expired_at=now, limit=batch)
            if not due:
                return total
            by_owner: dict[str, list[str]] = {}
            for memory_id, owner in due:
                by_owner.setdefault(owner, []).append(memory_id)
            for owner, ids in by_owner.items():
                for memory_id in ids:
                    engine_delete_row(memory_id, keep_text=False)
                # As memory_purge: the texts leave the history, its events stay.
                history_content_erase(engine_user_id=owner, memory_ids=ids)
                ContentHash.objects.filter(memory_id__in=ids).delete()
                audit_record(
                    MemoryScope.from_engine_user_id(owner),
                    call=call,
                    operation=Operation.PURGE_DUE,
                    memory_ids=ids,
                    detail={"purged": len(ids)},
                )
        total += len(due)


RECALLS_WATERMARK = "recalls"
# The calls whose audit rows count as accesses (`memory_recalls_fold`): those handing the
# client memories it asked to recall, their ids on the row. Issue 14: seed 003's
# recall_memory. Seed 001's prefetch and seed 002's before_turn (and run_turn, which is
# before_turn) too: the notes they inject are a recall (their turn event is
# memory_recall), and their rows list exactly the memories injected (before_turn's: those
# that fit the budget).
# Every call whose successful audit row lists the memories it returned or injected into a
# prompt: the searches (seed 003's hybrid_search too), the prefetch and turn recalls, and
# the chat proxy's injection (a chat completion's row lists only the memories injected).
RECALL_OPERATIONS = (
    Operation.SEARCH_MEMORY,
    Operation.RECALL_MEMORY,
    Operation.HYBRID_SEARCH,
    Operation.MEMORY_PREFETCH,
    Operation.MEMORY_BEFORE_TURN,
    Operation.MEMORY_RUN_TURN,
    Operation.CHAT_COMPLETION,
)


def memory_recalls_fold(*, batch: int = 5000, settle_seconds: int | None = None) -> int:
    """last_recalled_at / access_count without a write on a recall's path: every recall
    (RECALL_OPERATIONS) already leaves an audit row listing the ids it returned; this job
    adds the rows past a watermark to the counters, in one transaction with the watermark
    (lossless, each row counted once). Rows younger than RECALLS_SETTLE_SECONDS wait for the next run,
    so a search transaction still committing is not skipped."""
    from audit.models import AuditEvent

    settle = settings.RECALLS_SETTLE_SECONDS if settle_seconds is None else settle_seconds
    folded = 0
    while True:
        with transaction.atomic():
            mark, _ = JobWatermark.objects.select_for_update().get_or_create(name=RECALLS_WATERMARK)
            following = (
                AuditEvent.objects.filter(
                    id__gt=mark.position,
                    operation__in=RECALL_OPERATIONS,
                )
                .order_by("id")
                .values_list("id", "occurred_at", "memory_ids", "outcome")[:batch]
            )
            # Up to the first row not settled yet, in id order: the watermark moves by id,
            # and a row chosen by time alone could leave a later-stamped lower id behind.
            cutoff = datetime.now(UTC) - timedelta(seconds=settle)
            rows = []
            for row in following:
                if row[1] >= cutoff:
                    break
                rows.append(row)
            if not rows:
                return folded
            recalls: dict[str, tuple[int, str]] = {}
            for _, occurred_at, memory_ids, outcome in rows:
                if outcome != AuditEvent.Outcome.OK:
                    continue
                stamp = engine_timestamp(occurred_at)
                for memory_id in memory_ids or []:
                    count, last = recalls.get(memory_id, (0, stamp))
                    recalls[memory_id] = (count + 1, max(last, stamp))
            engine_recalls_fold(recalls)
            mark.position = rows[-1][0]
            mark.save(update_fields=["position", "updated_at"])
            folded += len(rows)


# --- billed and audited reads ---------------------------------------------------------------
def _containment(filters: dict[str, Any] | None, field_filters: dict[str, Any] | None) -> dict[str, Any]:
    return {**(filters or {}), **attrs_containment(**(field_filters or {}))}


def memory_search(
    scope: MemoryScope,
    *,
    query: str,
    top_k: int,
    filters: dict[str, Any] | None = None,
    field_filters: dict[str, Any] | None = None,
    call: CallContext,
) -> list[MemoryView]:
    """The best `top_k` live memories for `query` (narrowed by metadata filters and
    field filters: memory_type, tags, agent_id, session_id): hybrid retrieval, then age
    decay. Recall counters are not touched here (memory_recalls_fold)."""
    rate_limit_consume(scope, operation=Operation.SEARCH_MEMORY)
    field_filters = {k: v for k, v in (field_filters or {}).items() if v is not None}
    try:
        candidates = hybrid_search(
            scope,
            query=query,
            limit=min(100, top_k * settings.SEARCH_CANDIDATE_FACTOR),
            filters=_containment(filters, field_filters) or None,
        )
    except EngineError as exc:
        raise backend_unavailable() from exc
    now = datetime.now(UTC)
    ranked = sorted(((decayed_score(c, now=now), c) for c in candidates), key=lambda pair: pair[0], reverse=True)
    results = [memory_view(item, score=round(score, 6)) for score, item in ranked[:top_k]]
    with transaction.atomic():
        call_succeeded(
            scope,
            call=call,
            operation=Operation.SEARCH_MEMORY,
            memory_ids=[r.id for r in results],
            detail={
                "query": audit_text(query),
                "top_k": top_k,
                "filters": {**(filters or {}), **field_filters},
                "results": len(results),
            },
        )
    return results


def _decode_cursor(cursor: str) -> tuple[str, str]:
    try:
        return cursor_decode(cursor)
    except CursorError as exc:
        raise ServiceError(ErrorCode.INVALID_ARGUMENT, str(exc)) from None


@dataclass(frozen=True)
class MemoryPage:
    memories: list[MemoryView]
    next_cursor: str | None


def memory_list(
    scope: MemoryScope,
    *,
    cursor: str | None = None,
    page_size: int = 50,
    filters: dict[str, Any] | None = None,
    created_from: str | None = None,
    created_before: str | None = None,
    field_filters: dict[str, Any] | None = None,
    call: CallContext,
) -> MemoryPage:
    """One page in creation order (oldest first, id breaking ties): each memory
    appears exactly once across pages, even while new ones are added."""
    rate_limit_consume(scope, operation=Operation.LIST_MEMORY)
    after = _decode_cursor(cursor) if cursor else None
    field_filters = {k: v for k, v in (field_filters or {}).items() if v is not None}
    page = engine_memories_page(
        scope,
        after=after,
        limit=page_size + 1,
        filters=filters,
        created_from=created_from,
        created_before=created_before,
        containment=attrs_containment(**field_filters) or None,
    )
    views = [memory_view(item) for item in page[:page_size]]
    next_cursor = None
    if len(page) > page_size:
        last = page[page_size - 1]
        next_cursor = cursor_encode(last.created_at or "", last.id)
    with transaction.atomic():
        call_succeeded(
            scope,
            call=call,
            operation=Operation.LIST_MEMORY,
            memory_ids=[v.id for v in views],
            detail={
                "page_size": page_size,
                "paged": bool(cursor),
                "filters": {**(filters or {}), **field_filters},
                "results": len(views),
            },
        )
    return MemoryPage(memories=views, next_cursor=next_cursor)


def memory_get(scope: MemoryScope, *, memory_id: str, call: CallContext) -> MemoryView:
    """One memory with its content, for people (the web UI): audited, not billed (it is
    not one of the agent tools)."""
    view = memory_view(memory_get_owned(scope, memory_id=memory_id))
    audit_record(scope, call=call, operation=Operation.GET_MEMORY, memory_ids=[view.id])
    return view


# --- export and import (issue 17) -----------------------------------------------------------
EXPORT_PAGE_SIZE = 500
Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class MemoryExport:
    content: str
    format: str
    count: int

    def as_dict(self) -> dict[str, Any]:
        return {"content": self.content, "format": self.format, "count": self.count}


def memory_export(
    scope: MemoryScope, *, file_format: str, call: CallContext, progress: Progress | None = None
) -> MemoryExport:
    """memory_export_stream's file built whole, for callers that need it as one value
    (tests, the portability bench). The API and the web UI stream it."""
    counted = 0

    def count(done: int, total: int) -> None:
        nonlocal counted
        counted = done
        if progress:
            progress(done, total)

    content = "".join(memory_export_stream(scope, file_format=file_format, call=call, progress=count))
    return MemoryExport(content=content, format=file_format, count=counted)


def _export_records(
    scope: MemoryScope, views: list[MemoryView], *, owned_ids: set[str] | None = None
) -> list[ExportRecord]:
    # The newest versions the import takes, so a memory changed more often still comes
    # back; each record says how many older ones it leaves out.
    histories = memory_histories(
        scope, memory_ids=[v.id for v in views], newest=HISTORY_MAX_VERSIONS, owned_ids=owned_ids
    )
    no_history = MemoryHistoryView(versions=[])
    return [
        ExportRecord(
            id=v.id,
            text=v.memory,
            pinned=v.pinned,
            metadata=v.metadata,
            source=v.source,
            client_app=v.client_app,
            created_at=v.created_at,
            updated_at=v.updated_at,
            memory_type=v.memory_type,
            tags=v.tags,
            importance=v.importance,
            agent_id=v.agent_id,
            session_id=v.session_id,
            expires_at=v.expires_at,
            why_stored=v.why_stored,
            last_recalled_at=v.last_recalled_at,
            access_count=v.access_count,
            history=histories.get(v.id, no_history).versions,
            history_omitted=histories.get(v.id, no_history).omitted,
        )
        for v in views
    ]


def memory_export_stream(
    scope: MemoryScope, *, file_format: str, call: CallContext, progress: Progress | None = None
) -> Iterator[str]:
    """All of the scope's live memories with every field and their history, lossless JSONL
    or Markdown to read, as lines to stream (REST's export, the web UI's download,
    `manage.py export_memories`): read EXPORT_PAGE_SIZE memories at a time, never built
    whole in memory. The trash is not exported. One call: rate limited, billed and audited
    with the ids of the scope's live memories before the first line (a refusal is audited
    too). The file is then read in one snapshot
    (REPEATABLE READ, read only, from the first line to the last), so its header's count,
    its pages and Markdown's two passes (pinned memories first) all see the same memories
    and it imports whole whatever is written meanwhile: those of the audited memories
    still live when the snapshot starts (a memory stored after the audit row is left
    out; one expiring during the download is written, its expiry with it).
    `progress(done, total)` follows the memories written."""
    with failures_audited(scope, call=call, operation=Operation.EXPORT_MEMORIES):
        if file_format not in EXPORT_FORMATS:
            raise ServiceError(ErrorCode.INVALID_ARGUMENT, f"format must be one of {', '.join(EXPORT_FORMATS)}")
        rate_limit_consume(scope, operation=Operation.EXPORT_MEMORIES)
        try:
            ids = memory_ids_owned(scope)
        except EngineError as exc:
            raise backend_unavailable() from exc
        with transaction.atomic():
            call_succeeded(
                scope,
                call=call,
                operation=Operation.EXPORT_MEMORIES,
                memory_ids=ids,
                detail={"format": file_format, "memories": len(ids)},
            )
    exported_at = datetime.now(UTC).isoformat()
    audited = set(ids)

    written = 0

    def records(live: set[str], as_of: str, pinned: bool | None) -> Iterator[ExportRecord]:
        nonlocal written
        after: tuple[str, str] | None = None
        while True:
            page = engine_memories_page(scope, after=after, limit=EXPORT_PAGE_SIZE, as_of=as_of)
            views = [memory_view(item) for item in page if item.id in live]
            for record in _export_records(
                scope, [v for v in views if pinned is None or v.pinned is pinned], owned_ids=live
            ):
                yield record
                written += 1
                if progress:
                    progress(written, len(live))
            if len(page) < EXPORT_PAGE_SIZE:
                return
            after = (page[-1].created_at or "", page[-1].id)

    def file_lines(live: set[str], as_of: str) -> Iterator[str]:
        if file_format == "jsonl":
            yield export_jsonl_header(count=len(live), exported_at=exported_at)
            yield from (export_jsonl_line(record) for record in records(live, as_of, None))
            return
        username = call.actor_username or "you"
        yield export_markdown_title(count=len(live), exported_at=exported_at, username=username)
        for pinned in (True, False):
            group = records(live, as_of, pinned)
            first = next(group, None)
            if first is not None:
                yield export_markdown_section(pinned)
                yield export_markdown_item(first)
                yield from (export_markdown_item(record) for record in group)

    def lines() -> Iterator[str]:
        try:
            with read_only_snapshot():
                # One instant for the whole file, as one snapshot: a memory expiring while
                # a slow client downloads is counted in the header and so must be written.
                as_of = engine_timestamp(datetime.now(UTC))
                yield from file_lines(audited & set(memory_ids_owned(scope, as_of=as_of)), as_of)
        except EngineError as exc:  # the file is cut short: its header's count says so
            raise backend_unavailable() from exc

    return lines()


@dataclass(frozen=True)
class ImportResult:
    imported: int
    duplicates: int
    expired: int
    ids: list[str]

    def as_dict(self) -> dict[str, Any]:
        return {"imported": self.imported, "duplicates": self.duplicates, "expired": self.expired, "ids": self.ids}


def memory_import_file(
    scope: MemoryScope, *, data: bytes, source: str, call: CallContext, progress: Progress | None = None
) -> ImportResult:
    """Parse and validate the whole file first (a malformed or truncated one is refused
    whole, nothing written), then import it."""
    items = import_items_parse(
        data=data, source=source, max_bytes=settings.IMPORT_MAX_BYTES, max_memories=settings.IMPORT_MAX_MEMORIES
    )
    return memory_import(scope, items=items, source=source, call=call, progress=progress)


class _HashGone(Exception):
    """A text known before the transaction lost its memory meanwhile: embed it, retry."""


def _import_attrs(item: ImportItem) -> MemoryAttrs:
    fields = item.fields
    return MemoryAttrs(
        memory_type=fields.get("memory_type") or MemoryAttrs.memory_type,
        tags=tuple(fields.get("tags") or ()),
        importance=MemoryAttrs.importance if fields.get("importance") is None else float(fields["importance"]),
        agent_id=fields.get("agent_id"),
        session_id=fields.get("session_id"),
        expires_at=fields.get("expires_at"),
        why_stored=fields.get("why_stored"),
    )


# Texts embedded per model call during an import (the ONNX model runs batches much faster
# than single sentences; 64 keeps each call's memory small).
IMPORT_EMBED_BATCH = 64


def memory_import(
    scope: MemoryScope,
    *,
    items: list[ImportItem],
    source: str,
    call: CallContext,
    progress: Progress | None = None,
) -> ImportResult:
    """Write validated items into the scope's memories with every field, keeping their
    times, recall counters and history versions.

    All or nothing: the texts are embedded first (outside any transaction; progress is
    reported there), then every memory, history row and dedupe hash, the audit row and
    the usage event commit in ONE transaction. Idempotent: a text the user already has
    (the dedupe rule of `remember`), or one appearing twice in the file, is skipped, so
    importing a file twice adds nothing. Equal texts of different kinds (a toolkit
    short-term copy beside its long-term memory: `ImportItem.kind`) all come in, as they
    lived side by side where they were exported; the long-term one holds the hash. Of a
    text the user has, the file's memories narrowed to an agent or session come in as a
    narrowed `remember` keeps them (`_import_copies`). Memories whose expiry has passed
    are skipped."""
    if len(items) > settings.IMPORT_MAX_MEMORIES:
        raise ServiceError(ErrorCode.PAYLOAD_TOO_LARGE, f"at most {settings.IMPORT_MAX_MEMORIES} memories per import")
    rate_limit_consume(scope, operation=Operation.IMPORT_MEMORIES)
    items = [_import_settled(item) for item in items]
    now = engine_timestamp(datetime.now(UTC))
    live = [item for item in items if not (item.fields.get("expires_at") and item.fields["expires_at"] <= now)]
    expired = len(items) - len(live)
    wanted = _import_groups(live)
    known = set(
        ContentHash.objects.filter(engine_user_id=scope.engine_user_id, sha256__in=list(wanted)).values_list(
            "sha256", flat=True
        )
    )
    embedded: dict[str, EmbeddedText] = {}
    for _attempt in range(2):
        copies = _import_copy_texts(scope, wanted=wanted, known=known)
        # Keyed by the exact text: equal texts of a group may differ in case or spacing.
        todo = list(
            dict.fromkeys(
                item.text
                for digest, group in wanted.items()
                for item in group
                if (digest not in known or item.text in copies) and item.text not in embedded
            )
        )
        with _engine_errors():
            for start in range(0, len(todo), IMPORT_EMBED_BATCH):
                batch = todo[start : start + IMPORT_EMBED_BATCH]
                for text, vector_text in zip(batch, engine_embed_texts(batch), strict=True):
                    embedded[text] = vector_text
                if progress:
                    progress(start + len(batch), len(todo))
            if progress and not todo:  # every text known already: the write still says it starts
                progress(0, 0)
        try:
            created = _import_write(
                scope,
                wanted=wanted,
                embedded=embedded,
                call=call,
                keep_client_app=source == "memsite",
                counts={"source": source, "memories": len(items), "expired": expired},
            )
        except _HashGone:
            known = set()
            continue
        duplicates = len(items) - expired - len(created)
        return ImportResult(imported=len(created), duplicates=duplicates, expired=expired, ids=created)
    raise backend_unavailable()


def _import_settled(item: ImportItem) -> ImportItem:
    """An imported store_memory candidate still pending its enrichment, enriched by the
    heuristics as it comes in (what the sweep writes without an LLM). An import makes no
    pending candidate: the sweep would spend an LLM call on each, up to IMPORT_MAX_MEMORIES
    for one billed call, and a file's old `created_at` would put them ahead of every user's
    own candidates, which the sweep takes oldest first. Everything else, settled candidates
    (`completed`, `failed`) too, comes in as it was exported."""
    row = {**item.metadata, "source": item.source}
    if any(row.get(key) != value for key, value in CANDIDATE_CONTAINMENT.items()):
        return item
    result = enrich_heuristic(item.text)
    fields = {**item.fields, "memory_type": result.memory_type, "tags": result.tags, "importance": result.importance}
    return replace(item, metadata={**item.metadata, **result.metadata()}, fields=fields)


def _import_groups(items: list[ImportItem]) -> dict[str, list[ImportItem]]:
    """The file's memories by text hash (the dedupe rule of `remember`): per text, one
    item of each kind (the first wins; the others are the same memory twice), the one
    to hold the hash first."""
    groups: dict[str, dict[tuple[str, str, str, str, str], ImportItem]] = {}
    for item in items:
        groups.setdefault(content_sha256(item.text), {}).setdefault(item.kind, item)
    return {
        digest: sorted(kinds.values(), key=lambda item: not item.holds_hash_first)  # stable: file order otherwise
        for digest, kinds in groups.items()
    }


def _imported_stm_ids(writing: dict[str, list[ImportItem]], new_ids: dict[int, str]) -> dict[str, str]:
    """Exported id -> new id of the store_memory short-term rows this import writes (an id
    the file gives twice names no one row: left out)."""
    found: dict[str, str | None] = {}
    for group in writing.values():
        for item in group:
            if item.exported_id and item.source == STORE_MEMORY_SOURCE and item.metadata.get(TIER_KEY) == "stm":
                found[item.exported_id] = None if item.exported_id in found else new_ids[id(item)]
    return {old: new for old, new in found.items() if new}


def _stm_link_imported(item: ImportItem, stm_ids: dict[str, str]) -> dict[str, Any]:
    """The metadata of an imported memory, a store_memory candidate's `stm_id` pointing at
    its short-term row's new id, so deleting either still deletes both (`_pairs`). When
    that row is not written by this import (not in the file, expired, a duplicate), the
    link is dropped: the old id names a row of the exporting data, at best nothing here,
    at worst a row of the exporting user in this same database. Other memories' metadata
    is the user's own and kept as it is, an `stm_id` in it too."""
    metadata = item.metadata
    if item.source != STORE_MEMORY_SOURCE or metadata.get(TIER_KEY) != "ltm" or STM_LINK_KEY not in metadata:
        return metadata
    linked = metadata[STM_LINK_KEY]
    kept = {key: value for key, value in metadata.items() if key != STM_LINK_KEY}
    if isinstance(linked, str) and linked in stm_ids:
        kept[STM_LINK_KEY] = stm_ids[linked]
    return kept


def _import_narrowing(item: ImportItem) -> dict[str, str]:
    """The agent and session an imported memory is stored in, as `_within` takes them."""
    return {key: value for key in ("agent_id", "session_id") if (value := item.fields.get(key))}


def _import_copies(
    scope: MemoryScope, *, digest: str, group: list[ImportItem], holder: EngineMemory
) -> list[ImportItem]:
    """Of a file's memories of a text whose hash the user's `holder` has, those a narrowed
    `remember` would store beside it (`_remember_narrowed`): narrowed to an agent or
    session the holder is outside, where the user has no live long-term copy of the text
    (a short-term one keeps out only the file's short-term ones). None holds the hash, so
    importing the file again finds them as copies and adds nothing. In the import's
    transaction; copies are read row-locked, as `_text_copy_within` reads them."""
    narrowed = [item for item in group if (within := _import_narrowing(item)) and not _within(holder, within)]
    if not narrowed:
        return []
    rows = [
        row
        for row in engine_text_copies_locked(scope, text=narrowed[0].text).values()
        if _live(row, scope) and content_sha256(row.text) == digest
    ]
    kept = []
    for item in narrowed:
        inside = [row for row in rows if _within(row, _import_narrowing(item))]
        short_term = item.metadata.get(TIER_KEY) == "stm"
        if not any(row.metadata.get(TIER_KEY) != "stm" for row in inside) and not (short_term and inside):
            kept.append(item)
    return kept


def _import_copy_texts(scope: MemoryScope, *, wanted: dict[str, list[ImportItem]], known: set[str]) -> set[str]:
    """The texts of `_import_copies` for the texts the user has (`known`), to embed before
    the import's transaction, read in a short one of their own: the import reads them
    again, and embeds and retries when the answer changed meanwhile (`_HashGone`)."""
    narrowed = [digest for digest in known if any(_import_narrowing(item) for item in wanted[digest])]
    if not narrowed:
        return set()
    with _engine_errors(), transaction.atomic():
        user_write_locks(scope)
        owned = _hash_owner_rows(scope, digests=narrowed)
        return {
            item.text
            for digest, holder in owned.items()
            for item in _import_copies(scope, digest=digest, group=wanted[digest], holder=holder)
        }


def _import_write(
    scope: MemoryScope,
    *,
    wanted: dict[str, list[ImportItem]],
    embedded: dict[str, EmbeddedText],
    call: CallContext,
    keep_client_app: bool,
    counts: dict[str, Any],
) -> list[str]:
    """Insert each wanted group whose text the user does not have yet: its first item
    holds the dedupe hash, the others (other kinds of the same text) live beside it
    without one, as in the exporting user's data. A text the user already has skips its
    group but for the memories a narrowed `remember` would store beside the user's
    (`_import_copies`, without a hash), so importing the same file again adds nothing.

    `keep_client_app`: a memsite file says which app stored each memory, and a null
    there means none did, so it is kept as it was exported (a round trip changes
    nothing); other products' files name no memsite client, so the importing one is
    recorded where they name no app."""
    created: list[str] = []
    try:
        with _engine_errors(), transaction.atomic(), _attributed(call):
            # The user's erasure lock, shared like every writer's: an erasure or clear-all
            # waits for the import (or it for them), but the user's other writes go on
            # during a long import. No lock per text (thousands of advisory locks would
            # overflow the lock table): a racing `remember` or import of the same text meets
            # the hash's unique constraint, and the whole import answers `resource_busy` (retry).
            user_write_locks(scope)
            owned = _hash_owner_rows(scope, digests=list(wanted))
            writing = {digest: group for digest, group in wanted.items() if digest not in owned}
            for digest, holder in owned.items():
                if copies := _import_copies(scope, digest=digest, group=wanted[digest], holder=holder):
                    writing[digest] = copies
            if any(item.text not in embedded for group in writing.values() for item in group):
                raise _HashGone()
            new_ids = {id(item): engine_new_memory_id() for group in writing.values() for item in group}
            stm_ids = _imported_stm_ids(writing, new_ids)
            for digest, group in writing.items():
                for position, item in enumerate(group):
                    memory_id = engine_insert_imported(
                        scope,
                        memory_id=new_ids[id(item)],
                        embedded=embedded[item.text],
                        metadata={
                            **_stm_link_imported(item, stm_ids),
                            "pinned": item.pinned,
                            "source": item.source,
                            "client_app": item.client_app if keep_client_app else item.client_app or scope.client_app,
                        },
                        attrs=_import_attrs(item),
                        created_at=item.created_at,
                        updated_at=item.updated_at,
                        recall=(item.access_count, item.last_recalled_at),
                        versions=item.versions,
                    )
                    if position == 0 and digest not in owned:
                        ContentHash.objects.create(
                            engine_user_id=scope.engine_user_id, sha256=digest, memory_id=memory_id
                        )
                    created.append(memory_id)
            call_succeeded(
                scope,
                call=call,
                operation=Operation.IMPORT_MEMORIES,
                memory_ids=created,
                detail={
                    **counts,
                    "imported": len(created),
                    "duplicates": counts["memories"] - counts["expired"] - len(created),
                },
            )
    except IntegrityError:
        # A concurrent store of one of the file's texts: the whole import rolled back, and a
        # retry finds that text stored (a duplicate, skipped). Retryable, not a conflict.
        raise ServiceError(
            ErrorCode.RESOURCE_BUSY,
            "The same text was stored meanwhile; nothing was imported. Retry the import.",
            retry_after_s=LOCK_RETRY_AFTER_S,
        ) from None
    return created
