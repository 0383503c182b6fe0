"""The turn lifecycle's writes and billed reads (issue 13, seed 002 §4, §7, §10).

- `turn_before`: recalled facts (the hybrid search, one memory block shared with
  `memory_prefetch`) + the session's summary and recent items + the current input, with
  older context compacted into a summary past `compact_threshold x max_input_tok`.
- `turn_after`: exactly once per (user, project, session, turn_id); the same id with
  other items is refused (`conflict`). A guard row, with the items' hash, is
  committed as `processing` before the slow work (extraction, embeddings); one transaction,
  under the session's advisory lock, then appends the events, stores the facts (with the
  dedupe rule), marks the guard `done` and writes the audit row and usage event.
- `turn_maintenance_run`: compaction, tier retention, summaries, consolidation; each step
  one transaction, so a run killed mid-way is simply run again; a step that deletes or
  trashes memories writes its own audit row in it, so nothing done goes unrecorded.

Turn content reaches audit rows only as hashes and lengths (`items_digest`)."""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import OperationalError, transaction
from django.db.models import Exists, Max, OuterRef
from django.utils import timezone

from audit.models import AuditEvent, MemoryHistory
from audit.services import audit_record, history_content_erase
from core.choices import MemoryType, Operation
from core.errors import ErrorCode, ServiceError, backend_unavailable
from core.locks import advisory_xact_lock, lock_busy
from core.metrics import turn_compaction_record, turn_fact_write_record, turn_idempotency_conflict_record
from core.scope import CallContext, MemoryScope
from memories.call_record import call_succeeded
from memories.engine import (
    EmbeddedText,
    EngineError,
    EngineMemory,
    MemoryAttrs,
    attrs_containment,
    engine_delete_row,
    engine_embed_text,
    engine_expired_owned,
    engine_lock_owned_many,
    engine_memory_of,
    engine_rows_owned,
    engine_timestamp,
    engine_trash,
    engine_update_row,
    hybrid_search,
)
from memories.models import ContentHash, SessionArchive, SessionEvent, SessionState, TurnGuard, TurnPending
from memories.rate_limits import rate_limit_consume
from memories.schemas import TAGS_MAX
from memories.selectors import decayed_score, memory_view
from memories.services import (  # the one dedupe rule and history attribution of memories/services.py
    _attributed,
    _hash_owner_memory,
    _system_metadata,
    _text_insert_claimed,
    _text_lock_key,
    _turn_fact_durable_attrs,
    content_sha256,
    user_write_locks,
)
from memories.sessions import session_events_append, session_events_recent, session_item_hash
from memories.turns.extraction import (
    FACT_TAG,
    TIER_L1,
    TIER_L2,
    TIERS,
    Fact,
    facts_extract,
    heuristic_llm_enabled,
    llm_complete,
    project_tag,
    project_tags,
    tier_tag,
)
from memories.turns.items import (
    item_role,
    item_text,
    items_digest,
    items_token_count,
    message,
    turn_content_sha256,
)
from memories.turns.selectors import fact_counts_by_tier, memory_tree

logger = logging.getLogger(__name__)

MEMORY_BLOCK_HEADER = "Relevant notes from memory (may be outdated; prefer what the user says now):"
SUMMARY_HEADER = "Summary of earlier conversation in this session:"
SUMMARY_LINE_CHARS = 160
ARCHIVE_CHUNK = 200
CONSOLIDATE_MAX_FACTS = 500
NEAR_DUPLICATE_JACCARD = 0.85
DEADLOCK_DETECTED = "40P01"  # Postgres's SQLSTATE for a transaction it aborted to end a deadlock


def _now() -> datetime:
    """The clock of this module (tests move it to time-travel past retention)."""
    return timezone.now()


def _facts_written_record(tiers: dict[str, int]) -> None:
    for tier, count in tiers.items():
        if count:
            turn_fact_write_record(tier=tier, count=count)


def _busy(message: str) -> ServiceError:
    return lock_busy(message)


_USER_BUSY = "Your memory is being changed by another call (e.g. a clear-all or an erasure); retry."


@contextmanager
def _lock_wait(message: str) -> Iterator[None]:
    """Around a lock wait of the lifecycle: one that times out answers `resource_busy`,
    retryable with `retry_after_s` (seed 002 §7.3, as `core.locks` answers every lock wait),
    here worded for what the lifecycle waited for. `conflict` stays for what a retry
    cannot fix (a reused turn id)."""
    try:
        yield
    except ServiceError as error:
        if error.code != ErrorCode.RESOURCE_BUSY:
            raise
        raise _busy(message) from None


def _user_locks(scope: MemoryScope, *keys: str, timeout_s: float | None = None, message: str = _USER_BUSY) -> None:
    """`user_write_locks` (the first lock of each of the lifecycle's transactions), a
    timed-out wait answered as `resource_busy` (`_lock_wait`)."""
    with _lock_wait(message):
        user_write_locks(scope, *keys, timeout_s=timeout_s)


def _session_lock(scope: MemoryScope, *, project: str, session_id: str) -> None:
    """Serialise after_turn and maintenance of one session (inside their transaction, as
    its first lock): with the user's erasure lock shared, so an erasure under way makes
    them wait and cannot miss the events, facts and archives they write."""
    _user_locks(
        scope,
        f"session:{scope.engine_user_id}:{project}:{session_id}",
        timeout_s=settings.MCP_MEMORY_SESSION_LOCK_TIMEOUT_S,
        # The wait covers the session and the user's erasure lock (one call): say both.
        message="This session or your memory is being updated by another call (e.g. an erasure); retry.",
    )


def _session_touch(scope: MemoryScope, *, project: str, session_id: str) -> None:
    state, created = SessionState.objects.get_or_create(
        engine_user_id=scope.engine_user_id, project=project, session_id=session_id
    )
    if not created:
        SessionState.objects.filter(pk=state.pk).update(last_active_at=timezone.now())


# --- the memory block (before_turn and prefetch) -------------------------------------------------
@dataclass(frozen=True)
class MemoryBlock:
    facts: list[EngineMemory]
    scores: list[float]

    @property
    def ids(self) -> list[str]:
        return [fact.id for fact in self.facts]

    def text(self, count: int | None = None) -> str:
        facts = self.facts if count is None else self.facts[:count]
        if not facts:
            return ""
        return "\n".join([MEMORY_BLOCK_HEADER, *(f"- {fact.text}" for fact in facts)])


def memory_block_build(
    scope: MemoryScope,
    *,
    query: str,
    limit: int,
    project: str = "",
    agent_id: str | None = None,
    session_id: str | None = None,
) -> MemoryBlock:
    """The `limit` best live memories for `query` (hybrid retrieval, then age decay), as
    the notes block both before_turn and prefetch inject. A project narrows to its own
    facts and the user-wide ones (no `project:` tag); other projects' stay out. An
    agent or session (seed 001's narrower scope) keeps to that agent's or session's."""
    query = query.strip()[-2000:]
    if not query or limit <= 0:
        return MemoryBlock(facts=[], scores=[])
    pool = min(100, limit * settings.SEARCH_CANDIDATE_FACTOR)
    narrowed = attrs_containment(agent_id=agent_id, session_id=session_id)
    try:
        candidates = hybrid_search(scope, query=query, limit=pool, filters=narrowed or None)
        if project:
            own = project_tag(project)
            allowed = [c for c in candidates if not project_tags(c.attrs.tags) or own in c.attrs.tags]
            if len(allowed) < len(candidates):
                # Other projects' facts took places in the pool: the project's own search
                # fills in what they crowded out (user-wide ones rarely are: few and broad).
                seen = {c.id for c in allowed}
                own_only = attrs_containment(tags=[own], agent_id=agent_id, session_id=session_id)
                own_hits = hybrid_search(scope, query=query, limit=pool, filters=own_only)
                allowed += [c for c in own_hits if c.id not in seen]
            candidates = allowed
    except EngineError as exc:
        raise backend_unavailable() from exc
    now = datetime.now(UTC)
    ranked = sorted(((decayed_score(c, now=now), c) for c in candidates), key=lambda pair: pair[0], reverse=True)
    top = ranked[:limit]
    return MemoryBlock(facts=[c for _, c in top], scores=[round(s, 6) for s, _ in top])


def _query_of(items: list[dict[str, Any]]) -> str:
    """What to recall for: the user's words in the current input (else all its text);
    blank items add nothing."""
    texts = [(item_role(item), item_text(item)) for item in items]
    texts = [(role, text) for role, text in texts if text.strip()]
    user = [text for role, text in texts if role == "user"]
    return "\n".join(user or [text for _, text in texts])


# --- before_turn -----------------------------------------------------------------------------------
def _summary_deterministic(items: list[dict[str, Any]], *, max_chars: int) -> str:
    lines = []
    for item in items:
        text = " ".join(item_text(item).split())
        if text:
            cut = text if len(text) <= SUMMARY_LINE_CHARS else text[: SUMMARY_LINE_CHARS - 1] + "…"
            lines.append(f"- {item_role(item)}: {cut}")
    body = "\n".join(lines)
    return body if len(body) <= max_chars else "…" + body[-(max_chars - 1) :]


def context_summary(items: list[dict[str, Any]], *, max_chars: int) -> str:
    """Older context in a few lines: the configured LLM when LLM extraction is enabled
    (falling back to the deterministic digest if it fails), else the deterministic one."""
    if heuristic_llm_enabled():
        transcript = "\n".join(f"{item_role(i)}: {item_text(i)}" for i in items if item_text(i))
        try:
            summary = llm_complete(
                system=f"Summarise this conversation in at most {max_chars} characters. Plain text.", user=transcript
            ).strip()
            if summary:
                return summary[:max_chars]
        except ServiceError:
            logger.warning("context summary: the LLM failed; using the deterministic summary")
    return _summary_deterministic(items, max_chars=max_chars)


def turn_input_assemble(
    *,
    current_input: list[dict[str, Any]],
    context: list[dict[str, Any]],
    block: MemoryBlock,
    session_summary: str,
    base_instructions: str,
    max_input_tok: int,
) -> tuple[list[dict[str, Any]], int, int]:
    """(input_items, compacted context count, facts shown): instructions, memory block,
    summary, recent context, current input. Past the budget, the oldest context items are
    folded into the summary, then facts and the summary give way; the current input never.
    The facts shown are the block's first ones, counted here rather than read back from
    the text (a fact's own text may hold a line that looks like another fact)."""
    budget = int(settings.MCP_MEMORY_COMPACT_THRESHOLD * max_input_tok)
    head = [message("system", base_instructions)] if base_instructions else []
    facts_shown = len(block.facts)
    kept = list(context)
    folded: list[dict[str, Any]] = []

    def build(summary_text: str) -> list[dict[str, Any]]:
        items = list(head)
        if facts_shown:
            items.append(message("developer", block.text(facts_shown)))
        if summary_text:
            items.append(message("developer", f"{SUMMARY_HEADER}\n{summary_text}"))
        return [*items, *kept, *current_input]

    summary = session_summary
    items = build(summary)
    if items_token_count(items) <= budget:
        return items, 0, facts_shown
    # Fold the oldest context into the summary until the rest fits.
    fixed = items_token_count(build("")) - items_token_count(kept)
    while kept and fixed + items_token_count(kept) + 64 > budget:
        folded.append(kept.pop(0))
    summary_chars = max(200, min(4000, (budget - fixed - items_token_count(kept)) * 4 - 200))
    if folded:
        previous = f"{session_summary}\n" if session_summary else ""
        summary = context_summary(folded, max_chars=summary_chars)
        summary = (previous + summary)[-summary_chars:]
    items = build(summary)
    while items_token_count(items) > budget and facts_shown:
        facts_shown -= 1
        items = build(summary)
    if items_token_count(items) > budget and summary:
        summary = ""
        items = build(summary)
    return items, len(folded), facts_shown


def turn_before(
    scope: MemoryScope,
    *,
    project: str,
    session_id: str,
    turn_id: str,
    current_input: list[dict[str, Any]],
    base_instructions: str,
    max_input_tok: int,
    call: CallContext,
    operation: Operation = Operation.MEMORY_BEFORE_TURN,
    keep_input_as: str = "",
) -> dict[str, Any]:
    """`operation`: the tool the caller called (memory_run_turn does this too): its rate
    limit, usage event and audit row, the same name a failure is audited under.
    `keep_input_as`: run_turn's token, under which the current input is kept (in the
    transaction of the audit row) for the after_turn that commits it."""
    rate_limit_consume(scope, operation=operation)
    block = memory_block_build(
        scope, query=_query_of(current_input), limit=settings.MCP_MEMORY_RECALL_FACTS_LIMIT, project=project
    )
    context = session_events_recent(
        scope, session_id=session_id, project=project, limit=settings.MCP_MEMORY_RECENT_CONTEXT_ITEMS
    )
    state = SessionState.objects.filter(
        engine_user_id=scope.engine_user_id, project=project, session_id=session_id
    ).first()
    items, compacted, facts_shown = turn_input_assemble(
        current_input=current_input,
        context=context,
        block=block,
        session_summary=state.context_summary if state else "",
        base_instructions=base_instructions,
        max_input_tok=max_input_tok,
    )
    recall_ids = block.ids[:facts_shown]
    count = items_token_count(items)
    with transaction.atomic():
        if keep_input_as:
            _turn_pending_keep(scope, project=project, session_id=session_id, token=keep_input_as, items=current_input)
        call_succeeded(
            scope,
            call=call,
            operation=operation,
            memory_ids=recall_ids,
            detail={
                "project": project,
                "session_id": session_id,
                "turn_id": turn_id,
                "current_input": items_digest(current_input),
                "context_items": len(context),
                "compacted_items": compacted,
                "context_token_count": count,
            },
        )
    return {"input_items": items, "recall_fact_ids": recall_ids, "context_token_count": count}


# --- after_turn ------------------------------------------------------------------------------------
def _injected(item: dict[str, Any]) -> bool:
    """An item before_turn made itself: the memory block or the summary (developer
    messages under our own headers). Notes about the conversation, never part of it."""
    content = item.get("content")
    return (
        item.get("type", "message") == "message"
        and item.get("role") == "developer"
        and isinstance(content, str)
        and content.startswith((f"{MEMORY_BLOCK_HEADER}\n", f"{SUMMARY_HEADER}\n"))
    )


def turn_input_new(items: list[dict[str, Any]], *, recent: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What of after_turn's `input_items` is the turn's new input. after_turn expects the
    current input (what before_turn was given), but a client may send before_turn's
    prepared `input_items` back: instructions, the memory block, the summary and the
    replayed recent context, then the current input. Recognised, that is cut to the
    current input:

    - the memory block and the summary (`_injected`) are never stored;
    - the input is a prepared one when it held one of them, or when, past its leading
      system messages (before_turn's base instructions come first), its first items are
      the session log's last ones (`recent`: what before_turn replays), at least one item
      left after them (the current input is never empty). Then the leading system
      messages and that replay are cut.

    Anything else is stored as sent (a plain client's input is new items). Items are
    compared as the log's dedupe does (`session_item_hash`)."""
    kept = [item for item in items if not _injected(item)]
    head = 0
    while head < len(kept) and item_role(kept[head]) == "system":
        head += 1
    rest = kept[head:]
    sent = [session_item_hash(item) for item in rest]
    log = [session_item_hash(item) for item in recent]
    replayed = next(
        (k for k in range(min(len(rest) - 1, len(log)), 0, -1) if sent[:k] == log[len(log) - k :]),
        0,
    )
    if replayed or len(kept) < len(items):
        return rest[replayed:]
    return items


def _turn_id_reused() -> ServiceError:
    # No retry_after_s: the same call fails the same way. The message names no content.
    return ServiceError(
        ErrorCode.CONFLICT,
        "This turn_id was already sent in this session with different input_items or output_items; nothing "
        "from this call was stored. Send a new turn with a new turn_id, or retry with exactly the same items.",
        details={"reason": "turn_id_reused"},
    )


def _guard_content_check(guard: TurnGuard, *, content_sha256: str) -> None:
    """Refuse a call whose items are not those the guard's turn was claimed with: it is
    another turn under a reused id, and answering it as a duplicate would drop it unsaid.
    A guard from before the hash was kept has none and lets every call through.

    Not counted in `mcp_memory_idempotency_conflicts` (calls refused because the same turn
    is in progress, a sign of concurrent retries): this is a client error, counted under
    `mcp_memory_after_turn{status="conflict"}` and audited as a failure (not billed)."""
    if guard.content_sha256 and guard.content_sha256 != content_sha256:
        raise _turn_id_reused()


def _guard_claim(
    scope: MemoryScope, *, project: str, session_id: str, turn_id: str, content_sha256: str, owner: str
) -> TurnGuard:
    """The turn's guard row, committed. `done`: the turn is already stored. Ours: we
    process it (new, or a `processing` row past its lease taken over). Otherwise busy.
    Other items than the guard's are refused (`_guard_content_check`), except by a
    takeover: a `processing` row past its lease stored nothing, the taker's items count."""
    now = timezone.now()
    with transaction.atomic():
        _user_locks(scope)  # the guard row is the user's (an erasure deletes it)
        guard, created = TurnGuard.objects.select_for_update().get_or_create(
            engine_user_id=scope.engine_user_id,
            project=project,
            session_id=session_id,
            turn_id=turn_id,
            defaults={"owner": owner, "content_sha256": content_sha256, "updated_at": now},
        )
        if created:
            return guard
        lease_start = now - timedelta(seconds=settings.MCP_MEMORY_TURN_LEASE_S)
        if guard.state == TurnGuard.State.PROCESSING and guard.updated_at <= lease_start:
            # A crashed call's row: it stored nothing, so this call's items are the turn's.
            guard.owner, guard.content_sha256, guard.updated_at = owner, content_sha256, now
            guard.save(update_fields=["owner", "content_sha256", "updated_at"])
            return guard
        _guard_content_check(guard, content_sha256=content_sha256)
        if guard.state == TurnGuard.State.DONE:
            return guard
        turn_idempotency_conflict_record()  # seed 002: mcp_memory_idempotency_conflicts
        raise _busy("This turn is being processed by another call; retry.")


def _guard_release(guard: TurnGuard, *, owner: str) -> None:
    """A failed attempt lets the next retry in at once (a crash waits for the lease)."""
    try:
        TurnGuard.objects.filter(pk=guard.pk, owner=owner, state=TurnGuard.State.PROCESSING).delete()
    except Exception:  # the lease still frees it
        logger.warning("after_turn: could not release the turn guard")


def _tier_retention(tier: str) -> timedelta | None:
    """How long a fact of `tier` lives (None: long-term, for ever)."""
    if tier == TIER_L1:
        return timedelta(days=settings.MCP_MEMORY_L1_RETENTION_DAYS)
    if tier == TIER_L2:
        return timedelta(days=settings.MCP_MEMORY_L2_RETENTION_DAYS)
    return None


def _tier_expiry(tier: str, *, now: datetime) -> str | None:
    """When a fact of `tier` said at `now` expires (None: long-term, never)."""
    retention = _tier_retention(tier)
    return None if retention is None else engine_timestamp(now + retention)


def _fact_attrs(fact: Fact, *, project: str, session_id: str, now: datetime) -> MemoryAttrs:
    tags = [FACT_TAG, tier_tag(fact.tier)] + ([project_tag(project)] if project else [])
    return MemoryAttrs(
        memory_type=MemoryType.USER.value,
        tags=tuple(tags),
        session_id=session_id,
        expires_at=_tier_expiry(fact.tier, now=now),
        importance=0.5 if fact.tier not in (TIER_L1, TIER_L2) else 0.3,
        why_stored=f"extracted by after_turn ({fact.tier}) in session {session_id}"[:500],
    )


@dataclass(frozen=True)
class _FactsStored:
    """What `_facts_store` did: the fact ids (each once), how many of them per tier (what
    the audit row and `mcp_memory_fact_write` count: memories, not the model's lines), and
    the ids of existing facts that gained this project's tag or whose expiry was refreshed."""

    ids: list[str]
    tiers: dict[str, int]
    tagged: list[str]
    refreshed: list[str]


def _facts_store(
    scope: MemoryScope,
    *,
    facts: list[tuple[Fact, EmbeddedText]],
    project: str,
    session_id: str,
    turn_id: str,
    call: CallContext,
) -> _FactsStored:
    """Store the facts in the caller's transaction under the one dedupe rule: a text the
    user already has answers the existing memory's id (never a second copy), refreshed
    for this statement (`_fact_restated_attrs`)."""
    digests = [content_sha256(fact.text) for fact, _ in facts]
    if digests:
        with _lock_wait("One of this turn's facts is being written by another call; retry."):
            advisory_xact_lock(*(_text_lock_key(scope, digest) for digest in digests))
    ids: dict[str, str] = {}  # fact id -> the tier it was stored or restated as (the first)
    tagged: list[str] = []
    refreshed: list[str] = []
    now = _now()
    for (fact, embedded), digest in zip(facts, digests, strict=True):
        existing = _hash_owner_memory(scope, digest=digest)
        if existing is None:
            with _attributed(call):
                memory_id = _text_insert_claimed(
                    scope,
                    digest=digest,
                    embedded=embedded,
                    metadata=_system_metadata(
                        scope, source="after_turn", pinned=False, metadata={"turn_id": turn_id, "project": project}
                    ),
                    attrs=_fact_attrs(fact, project=project, session_id=session_id, now=now),
                )
            if memory_id is not None:
                ids.setdefault(memory_id, fact.tier)
                continue
            # An import stored the text meanwhile (it takes no text lock): as for a known text.
            existing = _hash_owner_memory(scope, digest=digest)
            if existing is None:  # and it went again: a race, not a conflict; the retry stores it
                raise _busy("The same text was stored and removed meanwhile; retry.")
        # The row is locked (the hash owner): one update, its history attributed to this call.
        project_tagged = _project_tag_added(existing.attrs.tags, project=project)
        said = existing.attrs if project_tagged is None else replace(existing.attrs, tags=project_tagged)
        attrs = _fact_restated_attrs(said, tier=fact.tier, now=now)
        if attrs != existing.attrs:
            with _attributed(call):
                engine_update_row(existing.id, embedded=None, metadata=None, attrs=attrs)
        if project_tagged is not None:
            tagged.append(existing.id)
        if attrs != said:
            refreshed.append(existing.id)
        ids.setdefault(existing.id, fact.tier)
    return _FactsStored(
        ids=list(ids),
        tiers={tier: sum(1 for stored in ids.values() if stored == tier) for tier in TIERS},
        tagged=list(dict.fromkeys(tagged)),
        refreshed=list(dict.fromkeys(refreshed)),
    )


def _project_tag_added(tags: tuple[str, ...], *, project: str) -> tuple[str, ...] | None:
    """The same fact said in another project is that project's too: the one memory (the
    dedupe rule) gains the project's tag, or that project's recall would never see it.
    A memory with no project tag is user-wide already (None: the tags stay).

    A memory holds at most TAGS_MAX tags, whoever set them (what `remember` and the import
    take): a fact whose tags are full becomes user-wide instead, its project tags removed,
    so it is recalled in every project, this one too (said in that many, it is the user's)."""
    if not project or not project_tags(tags) or project_tag(project) in tags:
        return None
    if len(tags) < TAGS_MAX:
        return (*tags, project_tag(project))
    return tuple(tag for tag in tags if tag not in project_tags(tags))


def _fact_restated_attrs(attrs: MemoryAttrs, *, tier: str, now: datetime) -> MemoryAttrs:
    """An expiring turn fact said again, as `tier` at `now`: refreshed, or retention would
    delete it on the first statement's schedule. Long-term makes it durable (as remember
    and pinning do); L1 or L2 extend its expiry to that tier's from now, and L2 promotes an
    L1 fact's tier. Its life is never shortened: a later expiry it has stays. A memory
    without an expiry (long-term, pinned, remembered) or that is no turn fact (remembered
    or imported with the owner's own fields) is left as it is."""
    current = attrs.expires_at
    if FACT_TAG not in attrs.tags or current is None:
        return attrs
    retention = _tier_retention(tier)
    if retention is None:
        return _turn_fact_durable_attrs(attrs) or attrs
    tags = attrs.tags
    if tier == TIER_L2:
        tags = tuple(dict.fromkeys(tier_tag(TIER_L2) if tag == tier_tag(TIER_L1) else tag for tag in tags))
    # engine_timestamp texts compare as the instants they are. A fact with more than half
    # of this tier's life left keeps its expiry: one repeated every turn would otherwise
    # write an update and a history row every turn.
    if tags == attrs.tags and current > engine_timestamp(now + retention / 2):
        return attrs
    return replace(attrs, tags=tags, expires_at=max(current, engine_timestamp(now + retention)))


def turn_after(
    scope: MemoryScope,
    *,
    project: str,
    session_id: str,
    turn_id: str,
    input_items: list[dict[str, Any]],
    output_items: list[dict[str, Any]],
    call: CallContext,
) -> dict[str, Any]:
    rate_limit_consume(scope, operation=Operation.MEMORY_AFTER_TURN)
    owner = call.request_id
    detail: dict[str, Any] = {
        "project": project,
        "session_id": session_id,
        "turn_id": turn_id,
        "input_items": items_digest(input_items),
        "output_items": items_digest(output_items),
    }
    # The hash of the items as sent: a retry sends the same, whatever was merged below.
    content = turn_content_sha256(input_items=input_items, output_items=output_items)
    pending = _turn_pending(scope, project=project, session_id=session_id, token=turn_id)
    if pending is None and not input_items and _run_turn_token(turn_id):
        _turn_token_check(scope, project=project, session_id=session_id, turn_id=turn_id)
    guard = _guard_claim(
        scope, project=project, session_id=session_id, turn_id=turn_id, content_sha256=content, owner=owner
    )
    if guard.state == TurnGuard.State.DONE:
        return _turn_duplicate(scope, guard=guard, detail=detail, call=call)
    try:
        recent = session_events_recent(
            scope, session_id=session_id, project=project, limit=settings.MCP_MEMORY_RECENT_CONTEXT_ITEMS
        )
        new_input = turn_input_new(input_items, recent=recent)
        skipped = len(input_items) - len(new_input)
        if pending is not None:
            new_input = _pending_merged(pending.items, new_input)
            detail["pending_input"] = items_digest(pending.items)
        if skipped:
            detail["input_items_skipped"] = skipped
        input_items = new_input
        extraction = facts_extract([*input_items, *output_items])  # slow: outside transactions
        try:
            embedded = [(fact, engine_embed_text(fact.text)) for fact in extraction.facts]
        except EngineError as exc:
            raise backend_unavailable() from exc
        with transaction.atomic():
            _session_lock(scope, project=project, session_id=session_id)
            current = TurnGuard.objects.select_for_update().filter(pk=guard.pk).first()
            if current is None:  # an erasure or a clear-all deleted the guard during the slow work
                # `conflict`, not `resource_busy`: no wait to retry after. What was said before
                # a clear-all must not come back after it, as a client's automatic retry would
                # store it; resending it is the user's choice (it is then a new turn).
                raise ServiceError(
                    ErrorCode.CONFLICT,
                    "Your memories were cleared or erased while this turn was processed; nothing was stored.",
                    details={"reason": "memories_cleared"},
                )
            # Taken over past our lease by a call with other items: theirs are the turn's.
            _guard_content_check(current, content_sha256=content)
            if current.state == TurnGuard.State.DONE:
                return _turn_duplicate(scope, guard=current, detail=detail, call=call)
            if current.owner != owner:
                turn_idempotency_conflict_record()  # seed 002: mcp_memory_idempotency_conflicts
                raise _busy("This turn is being processed by another call; retry.")
            # run_turn's kept input is consumed with the turn; gone meanwhile (the session's
            # events deleted, an erasure): its items are not the user's to store any more.
            if pending is not None and not TurnPending.objects.filter(pk=pending.pk).delete()[0]:
                raise ServiceError(
                    ErrorCode.CONFLICT,
                    "This turn's input, kept by memory_run_turn, was deleted while the turn was processed; "
                    "nothing was stored. Send the turn again with its input_items.",
                    details={"reason": "turn_input_deleted"},
                )
            stored = session_events_append(
                scope, session_id=session_id, project=project, turn_id=turn_id, items=[*input_items, *output_items]
            )
            try:
                written = _facts_store(
                    scope, facts=embedded, project=project, session_id=session_id, turn_id=turn_id, call=call
                )
            except EngineError as exc:
                raise backend_unavailable() from exc
            fact_ids, tiers = written.ids, written.tiers
            current.state, current.fact_ids, current.updated_at = TurnGuard.State.DONE, fact_ids, timezone.now()
            current.facts_left_out = extraction.over_limit + extraction.unstorable
            current.facts_shortened = extraction.shortened
            current.save(update_fields=["state", "fact_ids", "facts_left_out", "facts_shortened", "updated_at"])
            _session_touch(scope, project=project, session_id=session_id)
            transaction.on_commit(lambda: _facts_written_record(tiers))  # seed 002: mcp_memory_fact_write
            call_succeeded(
                scope,
                call=call,
                operation=Operation.MEMORY_AFTER_TURN,
                memory_ids=fact_ids,
                detail={
                    **detail,
                    "events_stored": stored,
                    "facts": tiers,
                    **({"facts_left_out": left_out} if (left_out := extraction.report()) else {}),
                    **({"project_tagged": written.tagged} if written.tagged else {}),
                    **({"facts_refreshed": written.refreshed} if written.refreshed else {}),
                },
            )
    except BaseException:
        _guard_release(guard, owner=owner)
        raise
    return {
        "ok": True,
        "duplicate": False,
        "fact_ids": fact_ids,
        "events_stored": stored,
        "input_items_skipped": skipped,
        "facts_left_out": current.facts_left_out,
        "facts_shortened": current.facts_shortened,
    }


def _turn_duplicate(scope: MemoryScope, *, guard: TurnGuard, detail: dict[str, Any], call: CallContext) -> dict:
    # A retry of a turn already done: its own audit row, and no usage event (the turn id is
    # the idempotency key; the first call was billed).
    with transaction.atomic():
        audit_record(
            scope,
            call=call,
            operation=Operation.MEMORY_AFTER_TURN,
            memory_ids=list(guard.fact_ids),
            detail={**detail, "duplicate": True},
        )
    return {
        "ok": True,
        "duplicate": True,
        "fact_ids": list(guard.fact_ids),
        "events_stored": 0,
        "input_items_skipped": 0,
        # The first call's counts, as its fact ids: a retry whose first answer was lost
        # still learns what that turn did not store.
        "facts_left_out": guard.facts_left_out,
        "facts_shortened": guard.facts_shortened,
    }


def turn_run(
    scope: MemoryScope,
    *,
    project: str,
    session_id: str,
    turn_id: str,
    current_input: list[dict[str, Any]],
    base_instructions: str,
    max_input_tok: int,
    call: CallContext,
) -> dict[str, Any]:
    """seed 002 §4.5: before_turn, plus the operation token to commit with: the turn id
    given, else a server-issued `rt-<32 hex>`. The current input is kept under the token
    (`TurnPending`), so memory_after_turn with the token and the output items alone
    commits the whole turn (exactly once, as any turn id)."""
    token = turn_id or f"{RUN_TURN_TOKEN_PREFIX}{uuid.uuid4().hex}"
    result = turn_before(
        scope,
        project=project,
        session_id=session_id,
        turn_id=token,
        current_input=current_input,
        base_instructions=base_instructions,
        max_input_tok=max_input_tok,
        call=call,
        operation=Operation.MEMORY_RUN_TURN,
        keep_input_as=token,
    )
    return {**result, "operation_token": token}


RUN_TURN_TOKEN_PREFIX = "rt-"  # noqa: S105 - an id's prefix, no secret
_RUN_TURN_TOKEN = re.compile(r"rt-[0-9a-f]{32}")


def _run_turn_token(turn_id: str) -> bool:
    """The form of a token run_turn issued itself (a client's own turn ids are accepted
    as they are: nothing tells them from a plain after_turn's)."""
    return _RUN_TURN_TOKEN.fullmatch(turn_id) is not None


def _pending_cutoff() -> datetime:
    return timezone.now() - timedelta(hours=settings.MCP_MEMORY_RUN_TURN_TOKEN_TTL_HOURS)


def _turn_pending_keep(
    scope: MemoryScope, *, project: str, session_id: str, token: str, items: list[dict[str, Any]]
) -> None:
    """Keep run_turn's current input under its token (in the caller's transaction), and
    prune the user's expired ones. A second run_turn with the same token replaces it
    (the latest prepared input is the one the client sent to its model)."""
    TurnPending.objects.filter(engine_user_id=scope.engine_user_id, created_at__lt=_pending_cutoff()).delete()
    TurnPending.objects.update_or_create(
        engine_user_id=scope.engine_user_id,
        project=project,
        session_id=session_id,
        token=token,
        defaults={"items": items, "created_at": timezone.now()},
    )


def _turn_pending(scope: MemoryScope, *, project: str, session_id: str, token: str) -> TurnPending | None:
    return TurnPending.objects.filter(
        engine_user_id=scope.engine_user_id,
        project=project,
        session_id=session_id,
        token=token,
        created_at__gte=_pending_cutoff(),
    ).first()


def _turn_token_check(scope: MemoryScope, *, project: str, session_id: str, turn_id: str) -> None:
    """A run_turn token this user's session does not hold (never issued, another user's,
    expired, or its session's events deleted), sent with output items only: the turn's
    input is not here, and storing the output alone would drop it unsaid. A retry of a
    turn already committed is no such call (it answers as the duplicate it is)."""
    done = TurnGuard.objects.filter(
        engine_user_id=scope.engine_user_id, project=project, session_id=session_id, turn_id=turn_id
    ).exists()
    if not done:
        raise ServiceError(
            ErrorCode.NOT_FOUND,
            "This operation_token is unknown or expired in this session; nothing was stored. Send the turn again "
            "with its input_items and output_items.",
            details={"reason": "operation_token_unknown"},
        )


def _pending_merged(pending: list[dict[str, Any]], sent: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """run_turn's input, then what the client sent as input beside it. A client that
    sends the same input again (alone, or followed by items of its own) has it stored once."""
    kept = [session_item_hash(item) for item in pending]
    if [session_item_hash(item) for item in sent[: len(pending)]] == kept:
        sent = sent[len(pending) :]
    return [*pending, *sent]


# --- maintenance -----------------------------------------------------------------------------------
def _sessions_of(scope: MemoryScope, *, project: str, session_id: str) -> list[str]:
    """The sessions to maintain: the one asked for, if the user has it (maintenance never
    creates a session), else all the user's sessions in the project."""
    states = SessionState.objects.filter(engine_user_id=scope.engine_user_id, project=project)
    if session_id:
        states = states.filter(session_id=session_id)
    return sorted(set(states.values_list("session_id", flat=True)))


def _compact(scope: MemoryScope, *, project: str, session_id: str, now: datetime) -> int:
    """Raw events older than compaction_min_age_hours become archive chunks. Each chunk
    is one transaction (archive created, events deleted): a kill loses nothing, and a
    re-run continues with what is left."""
    cutoff = now - timedelta(hours=settings.MCP_MEMORY_COMPACTION_MIN_AGE_HOURS)
    moved = 0
    while True:
        with transaction.atomic():
            _session_lock(scope, project=project, session_id=session_id)
            events = list(
                SessionEvent.objects.select_for_update()
                .filter(
                    engine_user_id=scope.engine_user_id,
                    project=project,
                    session_id=session_id,
                    created_at__lt=cutoff,
                )
                .order_by("id")[:ARCHIVE_CHUNK]
            )
            if not events:
                return moved
            items = [event.item for event in events]
            transaction.on_commit(turn_compaction_record)  # seed 002: mcp_memory_compaction
            SessionArchive.objects.create(
                engine_user_id=scope.engine_user_id,
                project=project,
                session_id=session_id,
                first_event_id=events[0].pk,
                last_event_id=events[-1].pk,
                items=items,
                digest=_summary_deterministic(items, max_chars=2000),
            )
            SessionEvent.objects.filter(pk__in=[event.pk for event in events]).delete()
            moved += len(events)


def _facts_of_project(project: str) -> dict[str, Any]:
    """The turn facts a maintenance call for `project` looks after: the project's own
    (seed 002 §8: operations are scoped by user and project). Without a project, all the
    user's, as the call without a project recalls them all; consolidation still never
    compares facts of different projects (`_consolidate`)."""
    return attrs_containment(tags=[FACT_TAG, project_tag(project)] if project else [FACT_TAG])


def _pinned(facts: list[EngineMemory]) -> set[str]:
    return {fact.id for fact in facts if fact.metadata.get("pinned") is True}


# The turn lifecycle's own calls: their history rows (a restated fact's refreshed expiry,
# tier or project tag) are not the owner's doing.
_LIFECYCLE_OPERATIONS = (Operation.MEMORY_AFTER_TURN, Operation.MEMORY_RUN_MAINTENANCE)


def _owner_kept(facts: list[EngineMemory]) -> set[str]:
    """The facts their owner made their own: pinned, or changed by one of the owner's calls
    since extracted (an UPDATE in the history written by no after_turn or maintenance call:
    text, fields or pin edited, or the fact remembered). Consolidation never trashes them. Told apart by the audit
    row of the call that wrote the history row (same request id, same transaction): a
    history row whose call has no audit row left counts as the owner's, so a fact is
    never trashed for want of a record."""
    pinned = _pinned(facts)
    others = [fact.id for fact in facts if fact.id not in pinned]
    if not others:
        return pinned
    lifecycle = AuditEvent.objects.filter(request_id=OuterRef("request_id"), operation__in=_LIFECYCLE_OPERATIONS)
    changed = (
        MemoryHistory.objects.filter(memory_id__in=others, event=MemoryHistory.Event.UPDATE)
        .exclude(Exists(lifecycle))
        .values_list("memory_id", flat=True)
    )
    return pinned | set(changed)


def _restored(facts: list[EngineMemory]) -> set[str]:
    """The facts their owner took back out of the trash (a RESTORE in the history): an
    undone consolidation (or delete) stays undone, so consolidation neither trashes them
    again nor trashes the copy kept in their stead."""
    ids = [fact.id for fact in facts]
    restored = MemoryHistory.objects.filter(memory_id__in=ids, event=MemoryHistory.Event.RESTORE)
    return set(restored.values_list("memory_id", flat=True))


def _step_audited(
    scope: MemoryScope, *, call: CallContext, step: str, memory_ids: list[str], detail: dict[str, Any]
) -> None:
    """The audit row of one maintenance step that deleted, trashed or changed memories,
    in that step's transaction: a call that fails later still leaves on record all it did."""
    audit_record(
        scope,
        call=call,
        operation=Operation.MEMORY_RUN_MAINTENANCE,
        memory_ids=memory_ids,
        detail={"step": step, **detail},
    )


def _retention_sweep(scope: MemoryScope, *, project: str, now: datetime, call: CallContext) -> list[str]:
    """Delete the project's expired turn facts (already invisible to every read since they
    expired), with their dedupe hashes, as the purge of expired memories does: pinned or
    not. A pinned fact kept is made durable when it is pinned (memory_update), and an
    expiry its owner set on it since is theirs: one that passed is never lifted here, or
    the memory would come back or go depending on which job ran first. Each batch is one
    transaction with its audit row. Returns the ids deleted."""
    deleted: list[str] = []
    while True:
        with transaction.atomic():
            # First, before any row lock: an erasure under way (which row-locks all the
            # user's memories in its own order) is waited for, never deadlocked with.
            _user_locks(scope)
            ids = engine_expired_owned(scope, at=now, containment=_facts_of_project(project), limit=200)
            if not ids:
                return deleted
            engine_lock_owned_many(scope, memory_ids=ids)  # a change racing this one waits
            with _attributed(call):
                for memory_id in ids:
                    engine_delete_row(memory_id, keep_text=False)
            # Deleted for good, as a purge: the history keeps the events, not the texts.
            history_content_erase(engine_user_id=scope.engine_user_id, memory_ids=ids)
            ContentHash.objects.filter(engine_user_id=scope.engine_user_id, memory_id__in=ids).delete()
            _step_audited(
                scope,
                call=call,
                step="retention",
                memory_ids=ids,
                detail={"project": project, "deleted": len(ids)},
            )
            deleted += ids


def _summary_refresh(scope: MemoryScope, *, project: str, session_id: str, now: datetime, force: bool) -> bool:
    # One transaction under the session lock: the summary is written from what it read,
    # and an erasure under way cannot miss the state row (nor its summary) it writes.
    with transaction.atomic():
        _session_lock(scope, project=project, session_id=session_id)
        return _summary_write(scope, project=project, session_id=session_id, now=now, force=force)


def _summary_write(scope: MemoryScope, *, project: str, session_id: str, now: datetime, force: bool) -> bool:
    state = SessionState.objects.filter(
        engine_user_id=scope.engine_user_id, project=project, session_id=session_id
    ).first()
    if state is None:  # gone since the run listed it (deleted by an erasure): never re-created here
        return False
    interval = timedelta(minutes=settings.MCP_MEMORY_SUMMARY_REFRESH_INTERVAL_MINUTES)
    if not force and state.summary_updated_at and state.summary_updated_at > now - interval:
        return False
    archives = SessionArchive.objects.filter(
        engine_user_id=scope.engine_user_id, project=project, session_id=session_id
    ).order_by("first_event_id")
    recent = session_events_recent(scope, session_id=session_id, project=project, limit=20)
    events = SessionEvent.objects.filter(engine_user_id=scope.engine_user_id, project=project, session_id=session_id)
    tiers = fact_counts_by_tier(scope, session_id=session_id)
    archived = sum(len(a.items) for a in archives)
    abstract = (
        f"Session {session_id}: {events.count()} recent events, {archived} archived; "
        f"facts L1 {tiers['l1']}, L2 {tiers['l2']}, long-term {tiers['long_term']}."
    )
    parts = [a.digest for a in archives.reverse()[:3]][::-1]
    overview = "\n".join(p for p in [*parts, _summary_deterministic(recent, max_chars=2000)] if p)[-4000:]
    # before_turn replays the last MCP_MEMORY_RECENT_CONTEXT_ITEMS events beside the
    # summary: its summary digests up to 20 events before those, never those again.
    window = settings.MCP_MEMORY_RECENT_CONTEXT_ITEMS
    older = list(events.order_by("-id").values_list("item", flat=True)[window : window + 20])[::-1]
    context = "\n".join(p for p in [*parts, _summary_deterministic(older, max_chars=2000)] if p)[-4000:]
    SessionState.objects.filter(pk=state.pk).update(
        abstract=abstract, overview=overview, context_summary=context, summary_updated_at=now
    )
    return True


_WORD = re.compile(r"\w+")
# Words whose presence or absence does not change what a fact says. Nothing else may
# differ between two facts merged as one: not a name ("Anna" / "Maria"), a number, a
# negation ("not", "don't" -> "don", "t") or any other content word, nor their order.
_FILLER_WORDS = frozenset(
    {"a", "an", "the", "and", "of", "to", "in", "on", "at", "that", "so"}  # articles, links
    | {"very", "really", "just", "also", "too", "quite", "actually"}  # intensifiers, fillers
)


@dataclass(frozen=True)
class _Words:
    """A fact's words, case folded, punctuation ignored: its content words in their order
    (what it says: "a flight to Rome from Berlin" is not "to Berlin from Rome") and the
    set of all its words."""

    content: tuple[str, ...]
    all: frozenset[str]


def _words(text: str) -> _Words:
    words = [word.casefold() for word in _WORD.findall(text)]
    return _Words(content=tuple(word for word in words if word not in _FILLER_WORDS), all=frozenset(words))


def _near_duplicate(words: _Words, other: _Words) -> bool:
    """The same fact twice: the same content words in the same order (only filler words
    differ), and the word sets overlap by Jaccard >= 0.85."""
    if not words.all or not other.all or words.content != other.content:
        return False
    return len(words.all & other.all) / len(words.all | other.all) >= NEAR_DUPLICATE_JACCARD


_Group = tuple[str, frozenset[str], str | None, str | None, str]


def _fact_group(fact: EngineMemory) -> _Group:
    """Facts are compared only within one tier, one exact set of projects, one session,
    one agent and one memory type: a fact merged into another of a different session
    would no longer be recalled in its own, and the owner set the agent and type."""
    attrs = fact.attrs
    tier = next((tag for tag in attrs.tags if tag.startswith("tier:")), "")
    return tier, project_tags(attrs.tags), attrs.session_id, attrs.agent_id, attrs.memory_type


def _consolidation_doomed(facts: list[EngineMemory]) -> dict[str, str]:
    """Which of `facts` (newest first) go, each with the fact it duplicates (the copy kept
    in its stead): a near-duplicate (`_near_duplicate`, same `_fact_group`) of a fact kept
    before it. The owner's facts (`_owner_kept`) are kept first; a restored one stays and
    is compared with no other fact."""
    owned = _owner_kept(facts)
    restored = _restored(facts) - owned
    # The owner's facts first (sorted is stable: newest first within each part).
    ordered = sorted(facts, key=lambda fact: fact.id not in owned)
    kept: list[tuple[str, _Group, _Words]] = []
    doomed: dict[str, str] = {}
    for fact in ordered:
        if fact.id in restored:  # stays, and is compared with no other fact
            continue
        group, words = _fact_group(fact), _words(fact.text)
        survivor = None
        if fact.id not in owned:
            survivor = next(
                (
                    other_id
                    for other_id, other_group, other_words in kept
                    if group == other_group and _near_duplicate(words, other_words)
                ),
                None,
            )
        if survivor is None:
            kept.append((fact.id, group, words))
        else:
            doomed[fact.id] = survivor
    return doomed


def _consolidate(scope: MemoryScope, *, project: str, now: datetime, call: CallContext) -> list[str]:
    """Near-duplicate turn facts of the project (`_consolidation_doomed`): the newest one
    stays, the older ones go to the trash (restorable). A fact the owner made theirs
    (`_owner_kept`) is never trashed, and a group holding one keeps it instead of the
    newest; one restored from the trash stays beside the others. One transaction with its
    audit row; a re-run finds none."""
    with transaction.atomic():
        # First, before any row lock (see `_retention_sweep`): the facts compared are
        # locked in id order, a clear-all or erasure locks all the user's rows in scan order.
        _user_locks(scope)
        rows = engine_rows_owned(scope, containment=_facts_of_project(project))
        rows = rows.order_by("-created")  # type: ignore[misc]
        facts = [engine_memory_of(row) for row in rows[:CONSOLIDATE_MAX_FACTS]]
        doomed = _consolidation_doomed(facts)
        if not doomed:
            return []
        # Locked, then decided again on the locked rows: the doomed facts and the copies
        # kept in their stead. An owner's edit committed since the read (a kept copy
        # rewritten, moved to another agent or session, deleted; a doomed fact pinned or
        # restored) is seen here, and a fact goes only if it still duplicates a kept copy
        # that stays live. Without waiting: a row another call holds is left out, and a
        # fact that is, or whose kept copy is, being changed stays until the next run.
        # Waiting deadlocked with a writer that holds one of the two rows and then locks
        # the other (an update of the kept copy to the doomed fact's text locks the holder
        # of that text), and the run answered resource_busy.
        locked = engine_lock_owned_many(scope, memory_ids=sorted({*doomed, *doomed.values()}), skip_locked=True)
        fact_tags = {FACT_TAG, project_tag(project)} if project else {FACT_TAG}  # `_facts_of_project`'s
        current = [
            locked[fact.id]
            for fact in facts
            if fact.id in locked
            and locked[fact.id].trash is None
            and not locked[fact.id].expired(now)
            and fact_tags <= set(locked[fact.id].attrs.tags)
        ]
        still = _consolidation_doomed(current)
        trash = [memory_id for memory_id in doomed if memory_id in still]
        with _attributed(call):
            moved = engine_trash(
                scope, memory_ids=trash, at=now, request_id=call.request_id, operation=Operation.MEMORY_RUN_MAINTENANCE
            )
        ContentHash.objects.filter(engine_user_id=scope.engine_user_id, memory_id__in=moved).delete()
        if moved:
            _step_audited(
                scope,
                call=call,
                step="consolidation",
                memory_ids=moved,
                detail={"project": project, "trashed": len(moved)},
            )
        return moved


def _guards_prune(scope: MemoryScope, *, project: str, session_id: str) -> int:
    """Keep the newest max_processed_turns done guards of the session (seed 002 §9)."""
    with transaction.atomic():
        _user_locks(scope)  # the guard rows are the user's (an erasure deletes them)
        done = TurnGuard.objects.filter(
            engine_user_id=scope.engine_user_id, project=project, session_id=session_id, state=TurnGuard.State.DONE
        )
        keep = list(
            done.order_by("-updated_at").values_list("pk", flat=True)[: settings.MCP_MEMORY_MAX_PROCESSED_TURNS]
        )
        deleted, _ = done.exclude(pk__in=keep).delete()
        return deleted


def _pending_prune(scope: MemoryScope, *, project: str) -> int:
    """Delete the project's run_turn inputs past their token's life (never committed; every
    read ignores them already). Any session's: run_turn alone creates no session to visit."""
    deleted, _ = TurnPending.objects.filter(
        engine_user_id=scope.engine_user_id, project=project, created_at__lt=_pending_cutoff()
    ).delete()
    return deleted


def turn_maintenance_run(
    scope: MemoryScope, *, project: str, session_id: str, call: CallContext, billed: bool = True
) -> dict[str, Any]:
    """Compaction, tier retention, summary refresh, consolidation for one session (or all
    the user's sessions in the project); retention and consolidation for the project's
    facts. Safe to re-run at any point: each step commits on its own, and the ones that
    delete or trash memories with their own audit row (the final row lists them all)."""
    if billed:
        rate_limit_consume(scope, operation=Operation.MEMORY_RUN_MAINTENANCE)
    now = _now()
    sessions = _sessions_of(scope, project=project, session_id=session_id)
    counters = {"compacted_events": 0, "summaries_refreshed": 0, "summaries_skipped": 0, "pruned_turn_guards": 0}
    try:
        for name in sessions:
            counters["compacted_events"] += _compact(scope, project=project, session_id=name, now=now)
            counters["pruned_turn_guards"] += _guards_prune(scope, project=project, session_id=name)
        _pending_prune(scope, project=project)
        expired = _retention_sweep(scope, project=project, now=now, call=call)
        consolidated = _consolidate(scope, project=project, now=now, call=call)
        for name in sessions:
            try:
                counters["summaries_refreshed"] += _summary_refresh(
                    scope, project=project, session_id=name, now=now, force=bool(counters["compacted_events"])
                )
            except ServiceError as error:
                if error.code != ErrorCode.RESOURCE_BUSY:
                    raise
                # A session busy with a turn keeps its summary until the next run; the
                # work above is done and stays done, so the call still succeeds.
                counters["summaries_skipped"] += 1
    except EngineError as exc:
        raise backend_unavailable() from exc
    except OperationalError as exc:
        # Every step takes the user's locks first, so this is rare (e.g. two runs' row
        # locks meeting a third writer's); the step rolled back, whatever committed stays.
        # A transient race, and maintenance is safe to re-run: `resource_busy`, retry.
        if getattr(exc.__cause__, "sqlstate", None) != DEADLOCK_DETECTED:
            raise
        raise _busy("Another change to your memories ran at the same time as this maintenance; retry.") from None
    result = {
        "ok": True,
        "sessions": len(sessions),
        **counters,
        "expired_facts": len(expired),
        "consolidated_facts": len(consolidated),
    }
    detail = {"project": project, "session_id": session_id, **result}
    memory_ids = [*expired, *consolidated]
    with transaction.atomic():
        if billed:
            call_succeeded(
                scope, call=call, operation=Operation.MEMORY_RUN_MAINTENANCE, memory_ids=memory_ids, detail=detail
            )
        else:  # the nightly job: audited, not billed
            audit_record(
                scope, call=call, operation=Operation.MEMORY_RUN_MAINTENANCE, memory_ids=memory_ids, detail=detail
            )
    return result


def turn_maintenance_nightly(*, active_days: int = 7) -> int:
    """Maintenance of every session active in the last `active_days` (beat, nightly)."""
    from core.choices import Channel

    since = timezone.now() - timedelta(days=active_days)
    done = 0
    pairs = (
        SessionState.objects.filter(last_active_at__gte=since)
        .values("engine_user_id", "project")
        .annotate(last=Max("last_active_at"))
    )
    for pair in pairs:
        scope = MemoryScope.from_engine_user_id(pair["engine_user_id"])
        if scope is None:
            continue
        try:
            turn_maintenance_run(
                scope, project=pair["project"], session_id="", call=CallContext(channel=Channel.INTERNAL), billed=False
            )
            done += 1
        except Exception as exc:  # noqa: BLE001 - one user's failure must not stop the others' runs
            # The kind only: an exception's text may quote a row (memory content).
            logger.warning(
                "nightly maintenance: one user's run failed (%s); the next night retries",
                exc.code.value if isinstance(exc, ServiceError) else type(exc).__name__,
            )
    return done


# --- introspection ----------------------------------------------------------------------------------
def turn_dir_list(
    scope: MemoryScope, *, project: str, session_id: str, path: str, depth: int, limit: int, call: CallContext
) -> dict[str, Any]:
    rate_limit_consume(scope, operation=Operation.MEMORY_LIST_DIR_WITH_ABSTRACT)
    entries = memory_tree(scope, project=project, session_id=session_id, path=path, depth=depth, limit=limit)
    with transaction.atomic():
        call_succeeded(
            scope,
            call=call,
            operation=Operation.MEMORY_LIST_DIR_WITH_ABSTRACT,
            detail={"project": project, "session_id": session_id, "path": path, "entries": len(entries)},
        )
    return {"summaries": entries}


# --- the session log as a person sees it ---------------------------------------------------------
def session_events_delete(scope: MemoryScope, *, project: str, session_id: str, call: CallContext) -> int:
    """Delete a session's raw events and archives (the facts stay: they are memories)."""
    with transaction.atomic():
        _session_lock(scope, project=project, session_id=session_id)
        owned = {"engine_user_id": scope.engine_user_id, "project": project, "session_id": session_id}
        events, _ = SessionEvent.objects.filter(**owned).delete()
        archives, _ = SessionArchive.objects.filter(**owned).delete()
        # run_turn's inputs not committed yet are this session's conversation too.
        TurnPending.objects.filter(**owned).delete()
        SessionState.objects.filter(**owned).update(
            abstract="", overview="", context_summary="", summary_updated_at=None
        )
        # A person tidying their data (like restore): audited, not billed.
        audit_record(
            scope,
            call=call,
            operation=Operation.DELETE_SESSION_EVENTS,
            detail={"project": project, "session_id": session_id, "events": events, "archives": archives},
        )
    return events


# --- prefetch (seed 001) -------------------------------------------------------------------------
def memory_prefetch(
    scope: MemoryScope,
    *,
    query: str,
    messages: list[dict[str, str]],
    limit: int | None,
    project: str,
    agent_id: str | None = None,
    session_id: str | None = None,
    call: CallContext,
) -> dict[str, Any]:
    rate_limit_consume(scope, operation=Operation.MEMORY_PREFETCH)
    items = [message(m["role"], m["content"]) for m in messages]
    text = query if query.strip() else _query_of(items)
    block = memory_block_build(
        scope,
        query=text,
        limit=limit or settings.MCP_MEMORY_SEARCH_LIMIT,
        project=project,
        agent_id=agent_id,
        session_id=session_id,
    )
    with transaction.atomic():
        call_succeeded(
            scope,
            call=call,
            operation=Operation.MEMORY_PREFETCH,
            memory_ids=block.ids,
            detail={"query": items_digest([message("user", text)]), "results": len(block.ids)},
        )
    return {
        "notes": block.text(),
        "memories": [memory_view(f, score=s).as_dict() for f, s in zip(block.facts, block.scores, strict=True)],
    }
