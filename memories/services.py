"""Writes, including billed and audited reads (search, list, get): every call that
consumes a rate limit or leaves an audit row or usage event. Keyword-only; memory
operations take a MemoryScope first."""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import secrets
import unicodedata
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from audit.services import audit_record, audit_snapshot, audit_text
from core.choices import Operation
from core.errors import ErrorCode, ServiceError, backend_unavailable, not_found
from core.locks import advisory_lock
from core.scope import CallContext, MemoryScope
from memories.call_record import call_succeeded
from memories.engine import (
    EngineError,
    LlmUnavailable,
    engine_add_text,
    engine_delete,
    engine_get,
    engine_import_text,
    engine_ingest,
    engine_memories_page,
    engine_purge_user,
    engine_update,
    history_attribution,
    hybrid_search,
    llm_configured,
)
from memories.models import ApiKey, ContentHash
from memories.portability import (
    EXPORT_FORMATS,
    ExportRecord,
    ImportItem,
    export_jsonl,
    export_markdown,
    import_items_parse,
)
from memories.rate_limits import rate_limit_consume
from memories.selectors import (
    MemoryView,
    decayed_score,
    memory_get_owned,
    memory_histories,
    memory_ids_owned,
    memory_view,
)

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


def memory_remember(
    scope: MemoryScope,
    *,
    memory: str,
    pinned: bool = False,
    metadata: dict[str, Any] | None = None,
    call: CallContext,
) -> RememberResult:
    """Store one curated fact verbatim (no LLM). The same text twice is stored once."""
    rate_limit_consume(scope, operation=Operation.REMEMBER)
    digest = content_sha256(memory)
    with advisory_lock(f"remember:{scope.engine_user_id}:{digest}"), _engine_errors():
        known = ContentHash.objects.filter(engine_user_id=scope.engine_user_id, sha256=digest).first()
        if known is not None:
            existing = engine_get(str(known.memory_id))
            if existing is not None and existing.user_id == scope.engine_user_id:
                with transaction.atomic():
                    call_succeeded(
                        scope,
                        call=call,
                        operation=Operation.REMEMBER,
                        memory_ids=[existing.id],
                        detail={"duplicate": True},
                    )
                return RememberResult(id=existing.id, duplicate=True)
            known.delete()  # the memory went away behind the hash's back
        with _attributed(call):
            memory_id = engine_add_text(
                scope,
                text=memory.strip(),
                metadata=_system_metadata(scope, source="remember", pinned=pinned, metadata=metadata),
            )
        with transaction.atomic():
            ContentHash.objects.create(engine_user_id=scope.engine_user_id, sha256=digest, memory_id=memory_id)
            after = audit_snapshot(memory=memory.strip(), pinned=pinned, metadata=metadata or {})
            call_succeeded(scope, call=call, operation=Operation.REMEMBER, memory_ids=[memory_id], after=after)
    return RememberResult(id=memory_id, duplicate=False)


def memory_ingest(
    scope: MemoryScope,
    *,
    messages: list[dict[str, str]],
    metadata: dict[str, Any] | None = None,
    call: CallContext,
) -> list[dict[str, Any]]:
    """mem0's extraction pipeline over a conversation turn (one LLM call)."""
    if not llm_configured():
        raise _llm_unavailable()
    rate_limit_consume(scope, operation=Operation.INGEST)
    with _engine_errors(), _attributed(call):
        added = engine_ingest(
            scope,
            messages=messages,
            metadata=_system_metadata(scope, source="ingest", pinned=False, metadata=metadata),
        )
    results = [{"id": str(a.get("id")), "memory": a.get("memory"), "event": a.get("event")} for a in added]
    with transaction.atomic():
        after = [{**r, "memory": audit_text(r["memory"])} for r in results]
        call_succeeded(
            scope,
            call=call,
            operation=Operation.INGEST,
            memory_ids=[str(r["id"]) for r in results],
            after=after,
            detail={"messages": len(messages)},
        )
    return results


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
    merged, never wiped. Serialised per memory with concurrent updates and deletes."""
    rate_limit_consume(scope, operation=Operation.UPDATE_MEMORY)
    changes = dict(metadata or {})
    if pinned is not None:
        changes["pinned"] = pinned
    with advisory_lock(f"memory:{memory_id}"):
        current = memory_get_owned(scope, memory_id=memory_id)
        with _engine_errors(), _attributed(call):
            engine_update(memory_id, text=memory.strip() if memory is not None else None, metadata=changes or None)
            updated = engine_get(memory_id)
        if updated is None:
            raise not_found()
        with transaction.atomic():
            if memory is not None:
                _rehash(scope, memory_id=memory_id, text=memory)
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


def _rehash(scope: MemoryScope, *, memory_id: str, text: str) -> None:
    ContentHash.objects.filter(memory_id=memory_id).delete()
    ContentHash.objects.bulk_create(
        [ContentHash(engine_user_id=scope.engine_user_id, sha256=content_sha256(text), memory_id=memory_id)],
        ignore_conflicts=True,
    )


def memory_delete(scope: MemoryScope, *, memory_id: str, call: CallContext) -> None:
    rate_limit_consume(scope, operation=Operation.DELETE_MEMORY)
    with advisory_lock(f"memory:{memory_id}"):
        current = memory_get_owned(scope, memory_id=memory_id)
        with _engine_errors(), _attributed(call):
            engine_delete(memory_id)
        with transaction.atomic():
            ContentHash.objects.filter(memory_id=memory_id).delete()
            call_succeeded(
                scope, call=call, operation=Operation.DELETE_MEMORY, memory_ids=[memory_id], before=_snapshot(current)
            )


def memory_clear_all(scope: MemoryScope, *, confirm: bool, call: CallContext) -> int:
    """Delete every memory of the scope's user, their dedupe hashes and mem0's raw
    messages (so a later ingest cannot bring cleared facts back). Returns the count."""
    if confirm is not True:
        raise ServiceError(
            ErrorCode.CONFIRMATION_REQUIRED, "clear_all_memory deletes all your memories; call it with confirm: true."
        )
    rate_limit_consume(scope, operation=Operation.CLEAR_ALL_MEMORY)
    with advisory_lock(f"clear_all:{scope.engine_user_id}"):
        memory_ids = memory_ids_owned(scope)
        with _engine_errors(), _attributed(call):
            engine_purge_user(scope)
        with transaction.atomic():
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


def _encode_cursor(created_at: str, memory_id: str) -> str:
    raw = json.dumps([created_at, memory_id], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_cursor(cursor: str) -> tuple[str, str]:
    try:
        padded = cursor + "=" * (-len(cursor) % 4)
        created_at, memory_id = json.loads(base64.urlsafe_b64decode(padded.encode()))
        if not isinstance(created_at, str) or not isinstance(memory_id, str):
            raise ValueError
        return created_at, memory_id
    except (ValueError, TypeError, binascii.Error, json.JSONDecodeError):
        raise ServiceError(ErrorCode.INVALID_ARGUMENT, "cursor is not one this server issued") from None


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
        next_cursor = _encode_cursor(last.created_at or "", last.id)
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


# --- export and import --------------------------------------------------------------------
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
    """All of the scope's memories with their history: lossless JSONL, or Markdown to read.
    One billed, audited call."""
    if file_format not in EXPORT_FORMATS:
        raise ServiceError(ErrorCode.INVALID_ARGUMENT, f"format must be one of {', '.join(EXPORT_FORMATS)}")
    rate_limit_consume(scope, operation=Operation.EXPORT_MEMORIES)
    views: list[MemoryView] = []
    after: tuple[str, str] | None = None
    try:
        while True:
            page = engine_memories_page(scope, after=after, limit=EXPORT_PAGE_SIZE)
            views += [memory_view(item) for item in page]
            if progress:
                progress(len(views), 0)
            if len(page) < EXPORT_PAGE_SIZE:
                break
            after = (page[-1].created_at or "", page[-1].id)
    except EngineError as exc:
        raise backend_unavailable() from exc
    histories = memory_histories(scope, memory_ids=[v.id for v in views])
    records = [
        ExportRecord(
            id=v.id,
            text=v.memory,
            pinned=v.pinned,
            metadata=v.metadata,
            source=v.source,
            client_app=v.client_app,
            created_at=v.created_at,
            updated_at=v.updated_at,
            history=histories.get(v.id, []),
        )
        for v in views
    ]
    exported_at = datetime.now(UTC).isoformat()
    if file_format == "jsonl":
        content = export_jsonl(records, exported_at=exported_at)
    else:
        content = export_markdown(records, exported_at=exported_at, username=call.actor_username or "you")
    with transaction.atomic():
        call_succeeded(
            scope,
            call=call,
            operation=Operation.EXPORT_MEMORIES,
            memory_ids=[r.id for r in records],
            detail={"format": file_format, "memories": len(records)},
        )
    return MemoryExport(content=content, format=file_format, count=len(records))


@dataclass(frozen=True)
class ImportResult:
    imported: int
    duplicates: int
    ids: list[str]

    def as_dict(self) -> dict[str, Any]:
        return {"imported": self.imported, "duplicates": self.duplicates, "ids": self.ids}


def memory_import_file(
    scope: MemoryScope, *, data: bytes, source: str, call: CallContext, progress: Progress | None = None
) -> ImportResult:
    """Parse and validate the whole file first (a malformed or truncated one is refused
    whole, nothing written), then import it."""
    items = import_items_parse(
        data=data, source=source, max_bytes=settings.IMPORT_MAX_BYTES, max_memories=settings.IMPORT_MAX_MEMORIES
    )
    return memory_import(scope, items=items, source=source, call=call, progress=progress)


def memory_import(
    scope: MemoryScope,
    *,
    items: list[ImportItem],
    source: str,
    call: CallContext,
    progress: Progress | None = None,
) -> ImportResult:
    """Write validated items into the scope's memories, keeping their times and history.
    Idempotent: a text the user already has (the same dedupe hash as `remember`) is
    skipped, so importing a file twice adds nothing. Each memory's hash commits right
    after the engine stored it: if the engine fails midway, importing the same file
    again completes the import without duplicates."""
    if len(items) > settings.IMPORT_MAX_MEMORIES:
        raise ServiceError(ErrorCode.PAYLOAD_TOO_LARGE, f"at most {settings.IMPORT_MAX_MEMORIES} memories per import")
    rate_limit_consume(scope, operation=Operation.IMPORT_MEMORIES)
    created: list[str] = []
    duplicates = 0
    with _engine_errors(), _attributed(call):
        for n, item in enumerate(items, start=1):
            digest = content_sha256(item.text)
            with advisory_lock(f"remember:{scope.engine_user_id}:{digest}"):
                known = ContentHash.objects.filter(engine_user_id=scope.engine_user_id, sha256=digest).first()
                if known is not None and _still_owned(scope, str(known.memory_id)):
                    duplicates += 1
                else:
                    if known is not None:
                        known.delete()  # the memory went away behind the hash's back
                    memory_id = engine_import_text(
                        scope,
                        text=item.text,
                        metadata={
                            **item.metadata,
                            "pinned": item.pinned,
                            "source": item.source,
                            "client_app": item.client_app or scope.client_app,
                        },
                        created_at=item.created_at,
                        updated_at=item.updated_at,
                        versions=item.versions,
                    )
                    ContentHash.objects.create(engine_user_id=scope.engine_user_id, sha256=digest, memory_id=memory_id)
                    created.append(memory_id)
            if progress:
                progress(n, len(items))
    with transaction.atomic():
        call_succeeded(
            scope,
            call=call,
            operation=Operation.IMPORT_MEMORIES,
            memory_ids=created,
            detail={"source": source, "memories": len(items), "imported": len(created), "duplicates": duplicates},
        )
    return ImportResult(imported=len(created), duplicates=duplicates, ids=created)


def _still_owned(scope: MemoryScope, memory_id: str) -> bool:
    existing = engine_get(memory_id)
    return existing is not None and existing.user_id == scope.engine_user_id
