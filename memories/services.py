"""Writes, including billed and audited reads (search, list, get): every call that
consumes a rate limit or leaves an audit row or usage event. Keyword-only; memory
operations take a MemoryScope first."""

from __future__ import annotations

import hashlib
import secrets
import unicodedata
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from audit.services import audit_failure, audit_record, audit_snapshot, audit_text
from core.choices import Operation
from core.errors import ErrorCode, ServiceError, backend_unavailable, not_found
from core.locks import advisory_xact_lock
from core.scope import CallContext, MemoryScope
from memories.call_record import call_succeeded
from memories.cursors import CursorError, cursor_decode, cursor_encode
from memories.engine import (
    EngineError,
    LlmUnavailable,
    engine_delete_row,
    engine_delete_user_rows,
    engine_embed_text,
    engine_ingest,
    engine_insert_text,
    engine_lock_owned,
    engine_memories_page,
    engine_rows_from_request,
    engine_update_row,
    history_attribution,
    hybrid_search,
    llm_configured,
)
from memories.models import ApiKey, ContentHash, IngestIntent
from memories.rate_limits import rate_limit_consume
from memories.selectors import MemoryView, decayed_score, memory_get_owned, memory_view

LAST_USED_RESOLUTION = timedelta(minutes=1)
KEY_ID_BYTES = 6  # 12 hex chars: the public, unique lookup part
SECRET_BYTES = 32


def _secret_hash(secret: str) -> str:
    # Keys are 256-bit random, so a fast hash is enough (no password stretching needed).
    return hashlib.sha256(secret.encode()).hexdigest()


def api_key_issue(*, user, name: str = "") -> tuple[ApiKey, str]:
    """Create a key for `user`. Returns the row and the plain key, which is not stored."""
    key_id = secrets.token_hex(KEY_ID_BYTES)
    secret = secrets.token_urlsafe(SECRET_BYTES)
    api_key = ApiKey.objects.create(user=user, name=name[:100], key_id=key_id, secret_hash=_secret_hash(secret))
    return api_key, f"{ApiKey.PREFIX}{key_id}_{secret}"


def api_key_authenticate(*, token: str) -> ApiKey | None:
    """The active key matching `token`, or None. Constant-time on the secret."""
    if not token.startswith(ApiKey.PREFIX):
        return None
    key_id, sep, secret = token[len(ApiKey.PREFIX) :].partition("_")
    if not sep or not key_id or not secret:
        return None
    api_key = ApiKey.objects.select_related("user").filter(key_id=key_id, revoked_at__isnull=True).first()
    expected = api_key.secret_hash if api_key else _secret_hash("")
    if not secrets.compare_digest(expected, _secret_hash(secret)) or api_key is None:
        return None
    if not api_key.user.is_active:
        return None
    now = timezone.now()
    if api_key.last_used_at is None or now - api_key.last_used_at > LAST_USED_RESOLUTION:
        # Once a minute is precise enough for "last used", and spares a write per call.
        ApiKey.objects.filter(pk=api_key.pk).update(last_used_at=now)
    return api_key


@transaction.atomic
def api_key_revoke(*, user, key_id: str) -> bool:
    updated = ApiKey.objects.filter(user=user, key_id=key_id, revoked_at__isnull=True).update(revoked_at=timezone.now())
    return updated == 1


# --- memories ---------------------------------------------------------------------------
def content_sha256(text: str) -> str:
    """Hash of the normalised text: Unicode NFKC, whitespace collapsed, case folded."""
    normalised = " ".join(unicodedata.normalize("NFKC", text).split()).casefold()
    return hashlib.sha256(normalised.encode()).hexdigest()


def _system_metadata(scope: MemoryScope, *, source: str, pinned: bool, metadata: dict[str, Any] | None) -> dict:
    return {**(metadata or {}), "pinned": pinned, "source": source, "client_app": scope.client_app}


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


@dataclass(frozen=True)
class RememberResult:
    id: str
    duplicate: bool

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "duplicate": self.duplicate}


def _text_lock_key(scope: MemoryScope, digest: str) -> str:
    # Every path that sets a memory's text takes this lock: one dedupe rule, no races.
    return f"text:{scope.engine_user_id}:{digest}"


def _hash_owner(scope: MemoryScope, *, digest: str) -> str | None:
    """The live memory holding this text's hash, row-locked; a hash whose memory went
    away behind its back is removed. Inside the transaction, under the text lock."""
    known = ContentHash.objects.filter(engine_user_id=scope.engine_user_id, sha256=digest).first()
    if known is None:
        return None
    if engine_lock_owned(scope, memory_id=str(known.memory_id)) is not None:
        return str(known.memory_id)
    known.delete()
    return None


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
    call: CallContext,
) -> RememberResult:
    """Store one curated fact verbatim (no LLM). The same text twice is stored once.

    The memory row, its history row, its dedupe hash, the usage event and the audit row
    commit in one transaction (the embedding is computed before it): after a crash
    either all exist or none, and a retry finds the hash."""
    rate_limit_consume(scope, operation=Operation.REMEMBER)
    text = memory.strip()
    digest = content_sha256(memory)
    # A known text needs no embedding; otherwise embed before the transaction.
    known = ContentHash.objects.filter(engine_user_id=scope.engine_user_id, sha256=digest).exists()
    embedded = None
    for _attempt in range(2):
        if embedded is None and not known:
            with _engine_errors():
                embedded = engine_embed_text(text)
        with _engine_errors(), transaction.atomic():
            advisory_xact_lock(_text_lock_key(scope, digest))
            existing_id = _hash_owner(scope, digest=digest)
            if existing_id is not None:
                call_succeeded(
                    scope,
                    call=call,
                    operation=Operation.REMEMBER,
                    memory_ids=[existing_id],
                    detail={"duplicate": True},
                )
                return RememberResult(id=existing_id, duplicate=True)
            if embedded is not None:
                with _attributed(call):
                    memory_id = engine_insert_text(
                        scope,
                        embedded=embedded,
                        metadata=_system_metadata(scope, source="remember", pinned=pinned, metadata=metadata),
                    )
                ContentHash.objects.create(engine_user_id=scope.engine_user_id, sha256=digest, memory_id=memory_id)
                after = audit_snapshot(memory=text, pinned=pinned, metadata=metadata or {})
                call_succeeded(scope, call=call, operation=Operation.REMEMBER, memory_ids=[memory_id], after=after)
                return RememberResult(id=memory_id, duplicate=False)
        known = False  # the hash went away between the check and the lock: embed and store
    raise backend_unavailable()


def memory_ingest(
    scope: MemoryScope,
    *,
    messages: list[dict[str, str]],
    metadata: dict[str, Any] | None = None,
    call: CallContext,
) -> list[dict[str, Any]]:
    """mem0's extraction pipeline over a conversation turn (one LLM call).

    mem0 writes its rows on its own, so the call is bracketed by a durable intent:
    committed before the engine call, completed (hashes, audit row, usage event) in one
    transaction after it. A crash in between leaves the intent open, and
    `ingest_intents_reconcile` completes it later from the rows tagged with the request id."""
    if not llm_configured():
        raise _llm_unavailable()
    rate_limit_consume(scope, operation=Operation.INGEST)
    intent = IngestIntent.objects.create(
        request_id=call.request_id,
        engine_user_id=scope.engine_user_id,
        scope=_scope_record(scope),
        call=_call_record(call),
        detail={"messages": len(messages)},
    )
    try:
        with _engine_errors(), _attributed(call):
            added = engine_ingest(
                scope,
                messages=messages,
                metadata=_system_metadata(scope, source="ingest", pinned=False, metadata=metadata),
                request_id=call.request_id,
            )
    except ServiceError:
        # Nothing stored: the call failed (failures_audited writes its row), close it.
        # Rows stored before a late failure stay for the reconciler to complete.
        if not engine_rows_from_request(request_id=call.request_id):
            IngestIntent.objects.filter(pk=intent.pk).update(state=IngestIntent.State.UNDONE, closed_at=timezone.now())
        raise
    added_ids = [str(a.get("id")) for a in added if a.get("event") == "ADD"]
    return _ingest_complete(scope, intent=intent, call=call, added_ids=added_ids)


def _ingest_complete(
    scope: MemoryScope, *, intent: IngestIntent, call: CallContext, added_ids: list[str]
) -> list[dict[str, Any]]:
    """One transaction: the dedupe rule over what mem0 added (a fact whose text another
    memory already has is removed again, and answered with that memory's id and event
    NONE), hashes for the new ones, the audit row, the usage event, the intent closed."""
    results: list[dict[str, Any]] = []
    with _engine_errors(), transaction.atomic():
        current = IngestIntent.objects.select_for_update().get(pk=intent.pk)
        if current.state != IngestIntent.State.OPEN:
            return list(current.results)
        added = [m for m in (engine_lock_owned(scope, memory_id=i) for i in added_ids) if m is not None]
        advisory_xact_lock(*(_text_lock_key(scope, content_sha256(m.text)) for m in added))
        for item in added:
            digest = content_sha256(item.text)
            existing_id = _hash_owner(scope, digest=digest)
            if existing_id is not None and existing_id != item.id:
                with _attributed(call):
                    engine_delete_row(item.id)
                results.append({"id": existing_id, "memory": item.text, "event": "NONE"})
                continue
            if existing_id is None:
                ContentHash.objects.create(engine_user_id=scope.engine_user_id, sha256=digest, memory_id=item.id)
            results.append({"id": item.id, "memory": item.text, "event": "ADD"})
        after = [{**r, "memory": audit_text(r["memory"])} for r in results]
        call_succeeded(
            scope,
            call=call,
            operation=Operation.INGEST,
            memory_ids=[r["id"] for r in results],
            after=after,
            detail=dict(current.detail),
        )
        current.state = IngestIntent.State.DONE
        current.results = results
        current.closed_at = timezone.now()
        current.save(update_fields=["state", "results", "closed_at"])
    return results


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
    }


def ingest_intents_reconcile(*, older_than_s: float | None = None) -> dict[str, int]:
    """Close the ingest intents a crash left open (older than the lease, so calls still
    running are left alone): rows tagged with the request id exist -> complete the call
    (hashes, audit row, usage event, as if it had returned); none -> close it as undone
    with a failure audit row (no usage event: nothing was stored)."""
    lease = settings.INGEST_INTENT_LEASE_S if older_than_s is None else older_than_s
    cutoff = timezone.now() - timedelta(seconds=lease)
    counts = {"completed": 0, "undone": 0}
    for intent in IngestIntent.objects.filter(state=IngestIntent.State.OPEN, created_at__lt=cutoff).order_by("pk"):
        scope = MemoryScope(**intent.scope)
        call = CallContext(request_id=intent.request_id, **intent.call)
        rows = engine_rows_from_request(request_id=intent.request_id)
        if rows:
            _ingest_complete(scope, intent=intent, call=call, added_ids=[r.id for r in rows])
            counts["completed"] += 1
            continue
        with transaction.atomic():
            current = IngestIntent.objects.select_for_update().get(pk=intent.pk)
            if current.state != IngestIntent.State.OPEN:
                continue
            audit_failure(
                scope,
                call=call,
                operation=Operation.INGEST,
                error=ServiceError(ErrorCode.BACKEND_UNAVAILABLE, "interrupted before anything was stored"),
            )
            current.state = IngestIntent.State.UNDONE
            current.closed_at = timezone.now()
            current.save(update_fields=["state", "closed_at"])
        counts["undone"] += 1
    return counts


def memory_update(
    scope: MemoryScope,
    *,
    memory_id: str,
    memory: str | None = None,
    pinned: bool | None = None,
    metadata: dict[str, Any] | None = None,
    call: CallContext,
) -> MemoryView:
    """Change text, pin state or metadata of one of the scope's memories. Metadata is
    merged, never wiped. Serialised per memory with concurrent updates and deletes.

    New text that another of the user's memories already has answers `conflict` (with
    its id) and changes nothing. The row, its history, the hash, the usage event and
    the audit row commit together."""
    rate_limit_consume(scope, operation=Operation.UPDATE_MEMORY)
    changes = dict(metadata or {})
    if pinned is not None:
        changes["pinned"] = pinned
    memory_get_owned(scope, memory_id=memory_id)  # not_found before any embedding work
    text = memory.strip() if memory is not None else None
    digest = content_sha256(memory) if memory is not None else None
    embedded = None
    if text is not None:
        with _engine_errors():
            embedded = engine_embed_text(text)
    with _engine_errors(), transaction.atomic():
        keys = [f"memory:{memory_id}"] + ([_text_lock_key(scope, digest)] if digest else [])
        advisory_xact_lock(*keys)
        current = engine_lock_owned(scope, memory_id=memory_id)
        if current is None:
            raise not_found()
        if digest is not None:
            existing_id = _hash_owner(scope, digest=digest)
            if existing_id is not None and existing_id != memory_id:
                raise _duplicate_text(existing_id)
        with _attributed(call):
            updated = engine_update_row(memory_id, embedded=embedded, metadata=changes or None)
        if digest is not None:
            _rehash(scope, memory_id=memory_id, digest=digest)
        call_succeeded(
            scope,
            call=call,
            operation=Operation.UPDATE_MEMORY,
            memory_ids=[memory_id],
            before=_snapshot(current),
            after=_snapshot(updated),
        )
    return memory_view(updated)


def _snapshot(item) -> dict[str, Any]:
    view = memory_view(item)
    return audit_snapshot(memory=view.memory, pinned=view.pinned, metadata=view.metadata)


@contextmanager
def _attributed(call: CallContext) -> Iterator[None]:
    with history_attribution(request_id=call.request_id, changed_by=call.changed_by):
        yield


def _rehash(scope: MemoryScope, *, memory_id: str, digest: str) -> None:
    ContentHash.objects.filter(memory_id=memory_id).exclude(sha256=digest).delete()
    ContentHash.objects.get_or_create(
        engine_user_id=scope.engine_user_id, sha256=digest, defaults={"memory_id": memory_id}
    )


def memory_delete(scope: MemoryScope, *, memory_id: str, call: CallContext) -> None:
    """Delete one of the scope's memories: row, history, hash, usage event and audit row
    in one transaction."""
    rate_limit_consume(scope, operation=Operation.DELETE_MEMORY)
    memory_get_owned(scope, memory_id=memory_id)
    with _engine_errors(), transaction.atomic():
        advisory_xact_lock(f"memory:{memory_id}")
        current = engine_lock_owned(scope, memory_id=memory_id)
        if current is None:
            raise not_found()
        with _attributed(call):
            engine_delete_row(memory_id)
        ContentHash.objects.filter(memory_id=memory_id).delete()
        call_succeeded(
            scope, call=call, operation=Operation.DELETE_MEMORY, memory_ids=[memory_id], before=_snapshot(current)
        )


def memory_clear_all(scope: MemoryScope, *, confirm: bool, call: CallContext) -> int:
    """Delete every memory of the scope's user, their dedupe hashes and mem0's raw
    messages (so a later ingest cannot bring cleared facts back), in one transaction
    with the usage event and audit row. Returns the count."""
    if confirm is not True:
        raise ServiceError(
            ErrorCode.CONFIRMATION_REQUIRED, "clear_all_memory deletes all your memories; call it with confirm: true."
        )
    rate_limit_consume(scope, operation=Operation.CLEAR_ALL_MEMORY)
    with _engine_errors(), transaction.atomic():
        advisory_xact_lock(f"clear_all:{scope.engine_user_id}")
        with _attributed(call):
            memory_ids = engine_delete_user_rows(scope)
        ContentHash.objects.filter(engine_user_id=scope.engine_user_id).delete()
        call_succeeded(
            scope,
            call=call,
            operation=Operation.CLEAR_ALL_MEMORY,
            memory_ids=memory_ids,
            detail={"deleted": len(memory_ids)},
        )
    return len(memory_ids)


# --- billed and audited reads ---------------------------------------------------------------
def memory_search(
    scope: MemoryScope, *, query: str, top_k: int, filters: dict[str, Any] | None = None, call: CallContext
) -> list[MemoryView]:
    """The best `top_k` memories for `query`: hybrid retrieval (engine), then age decay."""
    rate_limit_consume(scope, operation=Operation.SEARCH_MEMORY)
    try:
        candidates = hybrid_search(
            scope, query=query, limit=min(100, top_k * settings.SEARCH_CANDIDATE_FACTOR), filters=filters
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
            detail={"query": audit_text(query), "top_k": top_k, "filters": filters or {}, "results": len(results)},
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
    call: CallContext,
) -> MemoryPage:
    """One page in creation order (oldest first, id breaking ties): each memory
    appears exactly once across pages, even while new ones are added."""
    rate_limit_consume(scope, operation=Operation.LIST_MEMORY)
    after = _decode_cursor(cursor) if cursor else None
    page = engine_memories_page(
        scope,
        after=after,
        limit=page_size + 1,
        filters=filters,
        created_from=created_from,
        created_before=created_before,
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
            detail={"page_size": page_size, "paged": bool(cursor), "filters": filters or {}, "results": len(views)},
        )
    return MemoryPage(memories=views, next_cursor=next_cursor)


def memory_get(scope: MemoryScope, *, memory_id: str, call: CallContext) -> MemoryView:
    """One memory with its content, for people (the web UI): audited, not billed (it is
    not one of the agent tools)."""
    view = memory_view(memory_get_owned(scope, memory_id=memory_id))
    audit_record(scope, call=call, operation=Operation.GET_MEMORY, memory_ids=[view.id])
    return view
