"""Seed 003's toolkit (issue 14): short/long-term memories, recall ranking, the semantic
cache, decisions, web search, health and erasure. Writes and billed/audited reads, each
rate limited and recorded like the seven memory tools (`call_succeeded` in the
transaction of the call's own writes; failures are audited by the dispatcher).

Memories are ordinary engine rows: tier (`stm`/`ltm`), enrichment status, summary and
conversation id are metadata keys this module owns; short-term ones expire through the
memory model's `expires_at` (hidden at once, purged by `memories.purge_due`)."""

from __future__ import annotations

import json
import logging
import time
import unicodedata
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import transaction
from django.db.models import Q
from django.utils import timezone
from pgvector.django import CosineDistance

from audit.services import audit_failure, audit_record, audit_text, subject_content_erase
from core.batched import rows_delete_in_batches
from core.choices import Channel, Operation
from core.errors import ErrorCode, ServiceError, backend_unavailable
from core.locks import advisory_lock_try, advisory_xact_lock
from core.scope import CallContext, MemoryScope
from core.snapshots import read_only_snapshot
from memories import schemas
from memories.call_record import call_succeeded
from memories.engine import (
    ENRICHMENT_CLAIM_KEY,
    ENRICHMENT_KEY,
    FILTER_EXCLUDED,
    TIER_KEY,
    EngineError,
    EngineMemory,
    MemoryAttrs,
    attrs_containment,
    embedder_spec_active,
    engine_delete_user_rows,
    engine_embed_query,
    engine_embed_text,
    engine_enrichment_apply,
    engine_health_counts,
    engine_insert_text,
    engine_lock_owned,
    engine_metadata_merge,
    engine_purge_messages,
    engine_rows_with_metadata,
    engine_timestamp,
    engine_vector_cache_clear,
    hybrid_search,
)
from memories.models import ContentHash, IngestIntent
from memories.rate_limits import rate_limit_consume, rate_limit_consume_audited
from memories.services import (
    CANDIDATE_CONTAINMENT,
    STM_LINK_KEY,
    STORE_MEMORY_SOURCE,
    _attributed,
    _engine_errors,
    _hash_owner_memory,
    _live,
    _pairs,
    _system_metadata,
    _text_insert_claimed,
    _text_lock_key,
    _turn_fact_owned,
    content_sha256,
    erasure_lock_key,
    ingest_intents_supersede,
    memory_delete,
    memory_delete_dry_run,
    user_write_locks,
)
from memories.sessions import session_data_erase
from memories.toolkit import enrichment
from memories.toolkit.models import CacheEntry, Decision
from memories.toolkit.selectors import cache_entry_list, decision_list
from memories.toolkit.tasks import enrich_memories as enrich_memories_task
from memories.toolkit.websearch import WebSearchUnavailable, web_search_provider
from memories.turns.extraction import FACT_TAG

HUMAN_ROLES = frozenset({"human", "user"})
LTM_MIN_CHARS = 30  # seed 003: human messages longer than this become long-term candidates
SOURCE = STORE_MEMORY_SOURCE
# A candidate whose enrichment failed this often is marked `failed` (not pending forever).
ENRICHMENT_MAX_ATTEMPTS = 3
ENRICHMENT_ATTEMPTS_KEY = schemas.ENRICHMENT_ATTEMPTS_KEY
# How long a claimed candidate is kept from other workers while its LLM call runs: past
# the LLM client's worst case (its timeout, with retries), so a slow call is not made
# twice; a crashed worker's candidates are taken again once it lapses.
ENRICHMENT_CLAIM_LEASE_S = 30 * 60
# The pending sweep runs one at a time (this key) over at most this many candidates.
ENRICHMENT_SWEEP_LOCK_KEY = "toolkit:enrich_pending"
ENRICHMENT_SWEEP_LIMIT = 500
logger = logging.getLogger(__name__)


def _user_label(scope: MemoryScope, *, call: CallContext) -> str:
    """Seed 003's `user_id` in results: the name of the user whose data the call touched
    (never an argument). That is the caller, unless a service account acts for a subject
    (or staff or a job acts for the user): then the subject's name, looked up by the scope."""
    if call.actor_user_id is not None and call.actor_user_id == scope.user_pk and call.actor_username:
        return call.actor_username
    user_model = get_user_model()
    username = (
        user_model._default_manager.filter(pk=scope.user_pk).values_list(user_model.USERNAME_FIELD, flat=True).first()
    )
    return str(username) if username is not None else ""


# --- store_memory / enrichment --------------------------------------------------------------
def toolkit_memory_store(
    scope: MemoryScope, *, conversation_id: str, messages: list[dict[str, str]], call: CallContext
) -> dict[str, Any]:
    """One short-term memory per message (expiring after STM_TTL_HOURS); human messages
    over 30 characters also become long-term candidates (`enrichment_status: pending`),
    enriched by a background task after commit. A candidate whose text the user already
    has as a memory is not made again (the one dedupe rule); when that memory is a turn
    fact it is kept as `remember` keeps one (`_turn_fact_owned`: the owner's, and made
    durable if it expires), named on the audit row (its memory ids; `made_durable` for
    the expiring ones). Embeddings are computed before the transaction; all rows, hashes,
    the usage event and audit row commit together."""
    rate_limit_consume(scope, operation=Operation.STORE_MEMORY)
    embedded = {}
    with _engine_errors():
        for message in messages:
            text = message["content"].strip()
            if text not in embedded:
                embedded[text] = engine_embed_text(text)
    stm_expires = engine_timestamp(datetime.now(UTC) + timedelta(hours=settings.STM_TTL_HOURS))
    stm_ids: list[str] = []
    ltm_ids: list[str] = []
    facts_kept: list[str] = []  # turn facts holding a message's text (each once)
    made_durable: list[str] = []  # those of them that were expiring
    candidates = {
        content_sha256(m["content"].strip())
        for m in messages
        if m["role"] in HUMAN_ROLES and len(m["content"].strip()) > LTM_MIN_CHARS
    }
    with _engine_errors(), transaction.atomic():
        # Also with no candidate: the short-term rows are the user's rows too.
        user_write_locks(scope, *(_text_lock_key(scope, digest) for digest in candidates))
        for message in messages:
            text = message["content"].strip()
            base = {"conversation_id": conversation_id, "message_role": message["role"]}
            with _attributed(call):
                stm_id = engine_insert_text(
                    scope,
                    embedded=embedded[text],
                    metadata=_system_metadata(scope, source=SOURCE, pinned=False, metadata={**base, TIER_KEY: "stm"}),
                    attrs=MemoryAttrs(session_id=conversation_id[:128], expires_at=stm_expires),
                )
            stm_ids.append(stm_id)
            if message["role"] not in HUMAN_ROLES or len(text) <= LTM_MIN_CHARS:
                continue
            digest = content_sha256(text)
            holder = _hash_owner_memory(scope, digest=digest)
            if holder is not None:
                # The user has the text: no candidate. When a turn fact holds it, the fact
                # is the message's long-term copy now, kept as `remember` keeps it: made
                # durable if it expires (memory_after_turn's L1 facts go in a day, and
                # nothing long-term of the message would be left), the owner's either way.
                if FACT_TAG in holder.attrs.tags and holder.id not in facts_kept:
                    facts_kept.append(holder.id)
                    if _turn_fact_owned(holder, durable=True, call=call) is not None:
                        made_durable.append(holder.id)
                continue
            candidate = {**base, TIER_KEY: "ltm", ENRICHMENT_KEY: "pending", STM_LINK_KEY: stm_id}
            with _attributed(call):
                ltm_id = _text_insert_claimed(
                    scope,
                    digest=digest,
                    embedded=embedded[text],
                    metadata=_system_metadata(scope, source=SOURCE, pinned=False, metadata=candidate),
                    attrs=MemoryAttrs(session_id=conversation_id[:128]),
                )
            if ltm_id is None:  # an import stored the text meanwhile: the user has it, as above
                continue
            ltm_ids.append(ltm_id)
        call_succeeded(
            scope,
            call=call,
            operation=Operation.STORE_MEMORY,
            memory_ids=stm_ids + ltm_ids + facts_kept,
            after={"messages": [audit_text(m["content"]) for m in messages]},
            detail={
                "conversation_id": conversation_id,
                "stm": len(stm_ids),
                "ltm_candidates": len(ltm_ids),
                **({"made_durable": made_durable} if made_durable else {}),
            },
        )
        if ltm_ids:
            transaction.on_commit(lambda: _enrichment_enqueue(ltm_ids))
    return {"stm_ids": stm_ids, "count": len(stm_ids)}


def _enrichment_enqueue(memory_ids: list[str]) -> None:
    """After commit: the call is stored, billed and audited, so a broker that is down must
    not turn it into an error (the client would store it all again). The candidates stay
    pending and the `toolkit.enrich_pending` sweep enriches them. Only the error's type is
    logged: a broker's message can carry its URL."""
    try:
        enrich_memories_task.delay(memory_ids)
    except Exception as exc:
        logger.warning(
            "enrichment of %d candidate(s) not queued (%s); the pending sweep will take them",
            len(memory_ids),
            type(exc).__name__,
        )


def toolkit_pending_sweep() -> int:
    """The `toolkit.enrich_pending` sweep (for candidates whose task was lost). Beat starts
    one every 5 minutes whatever the last one is doing, and the claim leases would give each
    one other candidates, so with a slow LLM they would fill every worker slot and hold up all
    other tasks: one runs at a time (a second returns 0 at once), and it stops claiming after
    ENRICHMENT_SWEEP_BUDGET_S. Unclaimed candidates stay pending for the next sweep."""
    with advisory_lock_try(ENRICHMENT_SWEEP_LOCK_KEY) as acquired:
        if not acquired:
            logger.info("enrichment sweep skipped: another one is running")
            return 0
        return toolkit_candidates_enrich(limit=ENRICHMENT_SWEEP_LIMIT, budget_s=settings.ENRICHMENT_SWEEP_BUDGET_S)


def toolkit_candidates_enrich(
    *, memory_ids: list[str] | None = None, limit: int = 100, budget_s: float | None = None
) -> int:
    """Enrich pending long-term candidates (these ids, or the oldest `limit` of anyone's):
    summary, importance, tags and type, by the LLM when configured, heuristics otherwise
    (and when the LLM fails). Marks them `completed`.

    No transaction or row lock is held during the LLM call (up to its timeout: the user's
    own edit, delete or wipe of that memory must not wait for it, nor a connection stay
    taken). Each candidate goes in three steps: a short transaction claims it
    (`_candidate_claim`: SKIP LOCKED, plus a lease on its row, an engine key and not
    metadata, that keeps other workers off while the LLM runs and lapses if this one
    crashes); the LLM is called with no transaction open; a second short transaction
    applies the result only if the row is still this claim's pending candidate with the
    same owner and text (`_candidate_enrich`). A candidate that fails is counted on its
    row and skipped for the rest of the run (`_candidate_failed`). Returns how many were
    enriched.

    A run's time is bounded: after ENRICHMENT_LLM_BREAKER_FAILURES LLM failures in a row
    its other candidates get the heuristics without an LLM call (`enrichment.llm_breaker`),
    and with `budget_s` it claims no new candidate once that has passed (at least one per
    run, so a backlog always moves); the rest stay pending, unclaimed."""
    done = 0
    tried: list[str] = []  # this run's rows, enriched or not: each is taken at most once
    call = CallContext(channel=Channel.INTERNAL, actor_username="system:enrich")
    deadline = time.monotonic() + budget_s if budget_s is not None else None
    with enrichment.llm_breaker(settings.ENRICHMENT_LLM_BREAKER_FAILURES):
        while len(tried) < limit:
            if deadline is not None and tried and time.monotonic() >= deadline:
                break
            claimed = _candidate_claim(memory_ids=memory_ids, exclude_ids=tried, call=call)
            if claimed is None:
                break
            item, claim = claimed
            tried.append(item.id)
            if claim is not None and _candidate_enrich(item, claim=claim, call=call):
                done += 1
    return done


def _is_candidate(item: EngineMemory) -> bool:
    return all(item.metadata.get(key) == value for key, value in CANDIDATE_CONTAINMENT.items())


def _candidate_claim(
    *, memory_ids: list[str] | None, exclude_ids: list[str], call: CallContext
) -> tuple[EngineMemory, dict[str, str] | None] | None:
    """The oldest unclaimed pending candidate, with this run's lease on it (None: nothing
    left). Its own short transaction: the row lock only keeps two workers from claiming it
    at once; the lease keeps them apart after commit. A candidate of no known user is
    failed here (claim None): no retry can enrich it, and it must not stay pending."""
    with _engine_errors(), transaction.atomic():
        rows = engine_rows_with_metadata(
            containment=CANDIDATE_CONTAINMENT,
            memory_ids=memory_ids,
            exclude_ids=exclude_ids,
            unclaimed=True,
            limit=1,
        )
        if not rows:
            return None
        item = rows[0]
        if MemoryScope.from_engine_user_id(item.user_id) is None:
            _candidate_failed(item, scope=None, call=call, reason="unknown_owner", final=True)
            return item, None
        until = engine_timestamp(datetime.now(UTC) + timedelta(seconds=ENRICHMENT_CLAIM_LEASE_S))
        claim = {"until": until, "token": uuid.uuid4().hex}
        engine_metadata_merge(memory_id=item.id, metadata={ENRICHMENT_CLAIM_KEY: claim})
    return item, claim


def _candidate_enrich(item: EngineMemory, *, claim: dict[str, str], call: CallContext) -> bool:
    """Enrich one claimed candidate: the LLM with no transaction open, then one short
    transaction that re-locks the row and writes the result and its audit row, or counts
    the failure. When the row is no longer what was claimed (deleted, trashed, wiped, its
    text edited, enriched or claimed by another worker after the lease lapsed) nothing is
    written and it is no failure: the user's change wins. True when enriched."""
    scope = MemoryScope.from_engine_user_id(item.user_id)
    if scope is None:  # checked at the claim; the owner's account went meanwhile
        return False
    try:
        result: enrichment.Enrichment | None = enrichment.enrich_text(item.text)
        reason = ""
    except Exception as exc:  # a poisoned candidate must never block the others
        result, reason = None, type(exc).__name__
    with _engine_errors(), transaction.atomic():
        current = engine_lock_owned(scope, memory_id=item.id)
        if (
            current is None
            or not _live(current, scope)
            or not _is_candidate(current)
            or current.enrichment_claim != claim
        ):
            return False
        if current.text != item.text:
            # Edited during the call: this result describes the old text. Give the lease
            # back so the next sweep enriches the new text instead of waiting for it to lapse.
            engine_metadata_merge(memory_id=item.id, metadata={}, drop=(ENRICHMENT_CLAIM_KEY,))
            return False
        if result is not None:
            try:
                # A savepoint: a write the database refuses undoes this candidate's changes only,
                # and the failure is recorded in the same (still usable) transaction.
                with transaction.atomic():
                    _candidate_apply(scope, item=current, claimed=item, result=result, call=call)
                return True
            except Exception as exc:  # as above: counted, never blocking the others
                reason = type(exc).__name__
        _candidate_failed(current, scope=scope, call=call, reason=reason, final=False)
    return False


def _candidate_apply(
    scope: MemoryScope,
    *,
    item: EngineMemory,
    claimed: EngineMemory,
    result: enrichment.Enrichment,
    call: CallContext,
) -> None:
    """`item` is the re-locked row, `claimed` the row as the claim read it. A field the user
    set during the LLM call (it differs from the claimed one) is the user's and stays; the
    enrichment fills only the fields nobody touched meanwhile."""
    now, then = item.attrs, claimed.attrs
    attrs = replace(
        now,
        memory_type=result.memory_type if now.memory_type == then.memory_type else now.memory_type,
        tags=tuple(result.tags) if now.tags == then.tags else now.tags,
        importance=result.importance if now.importance == then.importance else now.importance,
    )
    # Outside the user's metadata budget (schemas.ENRICHMENT_METADATA_KEYS): the enrichment
    # adds them to a memory whose owner may already use every key, and its export must import.
    engine_enrichment_apply(scope, memory_id=item.id, metadata=result.metadata(), attrs=attrs)
    audit_record(
        scope,
        call=call,
        operation=Operation.ENRICH_MEMORY,
        memory_ids=[item.id],
        detail={"method": result.method, "memory_type": attrs.memory_type, "importance": attrs.importance},
    )


def _candidate_failed(
    item: EngineMemory, *, scope: MemoryScope | None, call: CallContext, reason: str, final: bool
) -> None:
    """Count the failed attempt on the row (`enrichment_attempts`, `enrichment_error`: the
    error's type, never its text, which can quote the data) and audit it. Past
    ENRICHMENT_MAX_ATTEMPTS, or when no retry can help, the row becomes `failed` (counted by
    memory_health) instead of pending forever; before that, the next sweep tries it again."""
    previous = item.metadata.get(ENRICHMENT_ATTEMPTS_KEY)
    attempts = (previous if isinstance(previous, int) else 0) + 1
    final = final or attempts >= ENRICHMENT_MAX_ATTEMPTS
    metadata: dict[str, Any] = {ENRICHMENT_ATTEMPTS_KEY: attempts, schemas.ENRICHMENT_ERROR_KEY: reason[:100]}
    if final:
        metadata[ENRICHMENT_KEY] = "failed"
    # The lease goes with the attempt: the next sweep may try it again at once.
    engine_metadata_merge(memory_id=item.id, metadata=metadata, drop=(ENRICHMENT_CLAIM_KEY,))
    audit_failure(
        scope,
        call=call,
        operation=Operation.ENRICH_MEMORY,
        error=ServiceError(ErrorCode.BACKEND_UNAVAILABLE, f"enrichment failed ({reason[:100]}), attempt {attempts}"),
        memory_id=item.id,
    )
    outcome = ": marked failed" if final else ""
    logger.warning("enrichment of memory %s failed (%s), attempt %d%s", item.id, reason, attempts, outcome)


# --- recall_memory / hybrid_search ----------------------------------------------------------
def _tier_of(item: EngineMemory) -> str:
    # As the tier filter reads it: other surfaces' memories (no tier, or a `tier` key of
    # the owner's own) are long-term.
    return "stm" if item.metadata.get(TIER_KEY) == "stm" else "ltm"


def _search_tiers(
    scope: MemoryScope,
    *,
    tier: Sequence[str] | None,
    memory_type: str | None,
    tags: list[str] | None,
    limit: int,
    **kwargs: Any,
) -> list[EngineMemory]:
    """The best `limit` memories of the wanted tiers. Short-term ones carry their tier;
    long-term ones are also every memory made elsewhere (no tier at all), so `["ltm"]`
    is "not short-term" rather than "tier is ltm"."""
    filters: dict[str, Any] = attrs_containment(memory_type=memory_type, tags=tags)
    tiers = set(tier or ("stm", "ltm"))
    if tiers == {"stm"}:
        filters[TIER_KEY] = "stm"
    elif tiers == {"ltm"}:
        filters[FILTER_EXCLUDED] = {TIER_KEY: "stm"}
    return _search(scope, limit=limit, filters=filters or None, **kwargs)


def _metadata_text(item: EngineMemory, key: str) -> str | None:
    """One of the toolkit's metadata keys (summary, enrichment status, conversation id) as
    the output schemas type it, `str | None`. The toolkit writes them as strings, but
    remember, update_memory and an import may set the same keys to any JSON value, and one
    such value made the client refuse the whole (already billed) result. A value that is
    not a string is not the toolkit's, so it is reported as absent: converting it ("7",
    "False") would pass it off as a summary or enrichment status the toolkit never made."""
    value = item.metadata.get(key)
    return value if isinstance(value, str) else None


def _memory_dict(item: EngineMemory, *, user: str) -> dict[str, Any]:
    return {
        "_id": item.id,
        "user_id": user,
        "tier": _tier_of(item),
        "content": item.text,
        "summary": _metadata_text(item, schemas.SUMMARY_KEY),
        "importance": item.attrs.importance,
        "created_at": item.created_at,
        "memory_type": item.attrs.memory_type,
        "tags": list(item.attrs.tags),
    }


def _recency(item: EngineMemory, now: datetime) -> float:
    try:
        created = datetime.fromisoformat(item.created_at or "")
    except ValueError:
        return 0.0
    if created.tzinfo is None:
        created = created.replace(tzinfo=UTC)
    hours = max(0.0, (now - created).total_seconds() / 3600)
    return 0.5 ** (hours / settings.RECALL_RECENCY_HALF_LIFE_HOURS)


def _limit(limit: int) -> int:
    return min(limit, settings.MAX_RESULTS_PER_QUERY)


def _search(scope: MemoryScope, **kwargs: Any) -> list[EngineMemory]:
    try:
        return hybrid_search(scope, **kwargs)
    except EngineError as exc:
        raise backend_unavailable() from exc


def _pair_key(scope: MemoryScope, item: EngineMemory, by_id: dict[str, EngineMemory]) -> str:
    """The id `item` is ranked under: a long-term candidate under the id of its short-term
    row when that row is among the candidates, every other row under its own. Only a real
    store_memory pair counts (`_pairs`): `stm_id` is metadata any surface may set, and two
    unrelated memories that both say `{"stm_id": "a"}` (or 1 and "1") are two results."""
    linked = item.metadata.get(STM_LINK_KEY)
    other = by_id.get(linked) if isinstance(linked, str) else None
    return other.id if other is not None and _pairs(scope, item, other) else item.id


def toolkit_memory_recall(
    scope: MemoryScope,
    *,
    query: str,
    memory_type: str | None = None,
    tags: list[str] | None = None,
    limit: int = 10,
    tier: Sequence[str] | None = None,
    call: CallContext,
) -> dict[str, Any]:
    """Rank the user's live memories by a*recency + b*importance + c*relevance (weights:
    RECALL_WEIGHT_*; relevance is the hybrid retrieval's score divided by the best
    candidate's, recency halves every RECALL_RECENCY_HALF_LIFE_HOURS). A short-term
    memory and the long-term candidate made from it count once (the higher score). The
    access counters are folded in later from this call's audit row (memory_recalls_fold)."""
    rate_limit_consume(scope, operation=Operation.RECALL_MEMORY)
    limit = _limit(limit)
    candidates = _search_tiers(
        scope,
        tier=tier,
        memory_type=memory_type,
        tags=tags,
        query=query,
        limit=min(200, limit * settings.SEARCH_CANDIDATE_FACTOR * 2),
    )
    now = datetime.now(UTC)
    best = max((c.score or 0.0 for c in candidates), default=0.0)
    a, b, c = settings.RECALL_WEIGHT_RECENCY, settings.RECALL_WEIGHT_IMPORTANCE, settings.RECALL_WEIGHT_RELEVANCE
    by_id = {item.id: item for item in candidates}
    by_pair: dict[str, tuple[float, EngineMemory]] = {}
    for item in candidates:
        relevance = max(0.0, (item.score or 0.0) / best) if best > 0 else 0.0
        score = a * _recency(item, now) + b * item.attrs.importance + c * relevance
        pair = _pair_key(scope, item, by_id)
        if pair not in by_pair or score > by_pair[pair][0]:
            by_pair[pair] = (score, item)
    ranked = sorted(by_pair.values(), key=lambda pair: (-pair[0], pair[1].id))[:limit]
    user = _user_label(scope, call=call)
    results = [
        {
            **_memory_dict(item, user=user),
            "access_count": item.access_count,
            "last_accessed": item.last_recalled_at,
            "enrichment_status": _metadata_text(item, ENRICHMENT_KEY),
            "conversation_id": _metadata_text(item, "conversation_id"),
            "final_score": round(score, 6),
        }
        for score, item in ranked
    ]
    with transaction.atomic():
        call_succeeded(
            scope,
            call=call,
            operation=Operation.RECALL_MEMORY,
            memory_ids=[r["_id"] for r in results],
            detail={
                "query": audit_text(query),
                "limit": limit,
                "filters": {"memory_type": memory_type, "tags": tags or [], "tier": list(tier or [])},
                "results": len(results),
            },
        )
    return {"results": results, "count": len(results)}


def toolkit_hybrid_search(
    scope: MemoryScope,
    *,
    query: str,
    memory_type: str | None = None,
    tags: list[str] | None = None,
    limit: int = 10,
    tier: Sequence[str] | None = None,
    vector_weight: float | None = None,
    text_weight: float | None = None,
    call: CallContext,
) -> dict[str, Any]:
    """Our hybrid retrieval with weighted reciprocal rank fusion of the vector and
    full-text rankings (weights: arguments, else RRF_VECTOR_WEIGHT / RRF_TEXT_WEIGHT)."""
    vector_weight = settings.RRF_VECTOR_WEIGHT if vector_weight is None else vector_weight
    text_weight = settings.RRF_TEXT_WEIGHT if text_weight is None else text_weight
    if vector_weight == 0 and text_weight == 0:
        # Before the rate limit: a refused call must change nothing but its audit row.
        raise ServiceError(ErrorCode.INVALID_ARGUMENT, "vector_weight and text_weight cannot both be 0")
    rate_limit_consume(scope, operation=Operation.HYBRID_SEARCH)
    limit = _limit(limit)
    found = _search_tiers(
        scope,
        tier=tier,
        memory_type=memory_type,
        tags=tags,
        query=query,
        limit=limit,
        fusion="rrf",
        vector_weight=vector_weight,
        lexical_weight=text_weight,
        rrf_k=settings.RRF_K,
    )
    user = _user_label(scope, call=call)
    results = [{**_memory_dict(item, user=user), "rrf_score": round(item.score or 0.0, 6)} for item in found]
    with transaction.atomic():
        call_succeeded(
            scope,
            call=call,
            operation=Operation.HYBRID_SEARCH,
            memory_ids=[r["_id"] for r in results],
            detail={
                "query": audit_text(query),
                "limit": limit,
                "weights": {"vector": vector_weight, "text": text_weight},
                "results": len(results),
            },
        )
    return {"results": results, "count": len(results)}


# --- the semantic cache ---------------------------------------------------------------------
def _embed_query(text: str) -> tuple[str, list[float]]:
    """The query's vector and the label of the embedder that made it ("" when a switch of
    embedders raced the call and which one made it is unsure: such a vector is stored as
    unknown and compared with nothing, so no two embedders' vectors ever meet)."""
    spec = embedder_spec_active()
    try:
        vector = engine_embed_query(text)
    except EngineError as exc:
        raise backend_unavailable() from exc
    if len(vector) != spec.dims or embedder_spec_active() != spec:
        return "", vector
    return spec.label, vector


def toolkit_cache_check(
    scope: MemoryScope, *, query: str, similarity_threshold: float | None = None, call: CallContext
) -> dict[str, Any]:
    """The most similar live cached query of the user: a hit at or above the threshold
    (cosine similarity of the query embeddings; CACHE_SIMILARITY_THRESHOLD by default)."""
    rate_limit_consume(scope, operation=Operation.CHECK_CACHE)
    threshold = settings.CACHE_SIMILARITY_THRESHOLD if similarity_threshold is None else similarity_threshold
    embedder, vector = _embed_query(query)
    # Only rows of the embedder that made this vector: another one's (or an unknown one's)
    # would be compared across models, or fail on their other dimension.
    nearest = (
        CacheEntry.objects.filter(user_id=scope.user_pk, expires_at__gt=timezone.now(), embedder=embedder)
        .annotate(distance=CosineDistance("embedding", vector))
        .order_by("distance", "-created_at")
        .first()
        if embedder
        else None
    )
    score = None if nearest is None else round(1.0 - float(nearest.distance), 6)
    hit = nearest is not None and score is not None and score >= threshold
    with transaction.atomic():
        call_succeeded(
            scope,
            call=call,
            operation=Operation.CHECK_CACHE,
            detail={
                "query": audit_text(query),
                "hit": hit,
                "score": score,
                "threshold": threshold,
                "cache_id": str(nearest.id) if hit and nearest else None,
            },
        )
    if not hit or nearest is None:
        return {"cache_hit": False}
    return {"cache_hit": True, "query": nearest.query, "response": nearest.response, "score": score}


def toolkit_cache_store(scope: MemoryScope, *, query: str, response: str, call: CallContext) -> dict[str, Any]:
    """Cache a query/response pair for CACHE_TTL_SECONDS (expired rows are hidden at
    once and deleted by `toolkit.cache_purge_expired`). The user keeps at most
    CACHE_MAX_ENTRIES_PER_USER entries: beyond it, those that expire first go (expired
    ones before live ones; never the entry just stored), counted on the audit row as
    `evicted`."""
    rate_limit_consume(scope, operation=Operation.STORE_CACHE)
    embedder, vector = _embed_query(query)
    with transaction.atomic():
        # The user's stores one at a time (a short transaction: the embedding is made
        # before it), so two of them cannot both keep the cap's last place.
        user_write_locks(scope, f"cache:{scope.user_pk}")
        entry = CacheEntry.objects.create(
            user_id=scope.user_pk,
            query=query,
            response=response,
            embedding=vector,
            embedder=embedder,
            expires_at=timezone.now() + timedelta(seconds=settings.CACHE_TTL_SECONDS),
        )
        evicted = _cache_evicted(scope, stored=entry)
        call_succeeded(
            scope,
            call=call,
            operation=Operation.STORE_CACHE,
            after={"query": audit_text(query), "response": audit_text(response)},
            detail={
                "cache_id": str(entry.id),
                "ttl_s": settings.CACHE_TTL_SECONDS,
                **({"evicted": evicted} if evicted else {}),
            },
        )
    return {"cache_id": str(entry.id)}


def _cache_evicted(scope: MemoryScope, *, stored: CacheEntry) -> int:
    """Delete the user's entries beyond CACHE_MAX_ENTRIES_PER_USER, those that expire
    first (the (user, expires_at) index read backwards, from the last to expire); how
    many. Only ever the scope's own rows, and never `stored`, the entry this store made:
    it is what the caller was just answered (and billed for), and an older entry may
    expire after it (CACHE_TTL_SECONDS lowered since, or this process's clock behind),
    which evicted the new one and left check_cache to miss it. Among the others, the one
    that can be served for the shortest time more is the least useful (an expired one
    not at all): the cache counts no hits, and with one TTL that is the oldest."""
    others = CacheEntry.objects.filter(user_id=scope.user_pk).exclude(id=stored.id)
    keep = settings.CACHE_MAX_ENTRIES_PER_USER - 1  # and `stored`
    beyond = others.order_by("-expires_at", "-id").values("id")[keep:]
    return others.filter(id__in=beyond).delete()[0]


def _caseless(text: str) -> str:
    """Unicode's canonical caseless form (D145, NFD(casefold(NFD(text)))), composed again:
    "ÉCOLE" and "école" (precomposed or not), "STRASSE" and "straße" are the same text,
    and "cafe" is no substring of "café" (its accent a separate mark in NFD)."""
    return unicodedata.normalize("NFC", unicodedata.normalize("NFD", text).casefold())


def _cache_ids_matching(scope: MemoryScope, pattern: str) -> list[uuid.UUID]:
    """The user's cached entries whose query contains `pattern`, ignoring case. Compared
    here, not by the database: its C locale folds ASCII letters only (`icontains` missed
    "ÉCOLE" for "école"). The set is bounded by CACHE_MAX_ENTRIES_PER_USER (store_cache
    evicts beyond it; its rate limit alone left it unbounded when off or raised); the
    queries (at most QUERY_MAX_CHARS each) are streamed, only the matching ids kept."""
    wanted = _caseless(pattern)
    rows = CacheEntry.objects.filter(user_id=scope.user_pk).values_list("id", "query")
    return [entry_id for entry_id, query in rows.iterator(chunk_size=1000) if wanted in _caseless(query)]


def toolkit_cache_invalidate(
    scope: MemoryScope, *, pattern: str | None = None, invalidate_all: bool = False, call: CallContext
) -> dict[str, Any]:
    """Delete the user's cached entries: all, or those whose query contains `pattern`
    (case-insensitive for every script, not only ASCII; a substring, no regular expressions)."""
    if not invalidate_all and not pattern:
        raise ServiceError(ErrorCode.INVALID_ARGUMENT, "give pattern, or invalidate_all: true")
    rate_limit_consume(scope, operation=Operation.CACHE_INVALIDATE)
    with transaction.atomic():
        entries = CacheEntry.objects.filter(user_id=scope.user_pk)
        if not invalidate_all:
            entries = entries.filter(id__in=_cache_ids_matching(scope, pattern or ""))
        now = timezone.now()
        # Expired entries are gone for every reader already: they go too, uncounted.
        deleted, _ = entries.filter(expires_at__gt=now).delete()
        entries.filter(expires_at__lte=now).delete()
        call_succeeded(
            scope,
            call=call,
            operation=Operation.CACHE_INVALIDATE,
            detail={"pattern": audit_text(pattern), "all": invalidate_all, "deleted": deleted},
        )
    return {"user_id": _user_label(scope, call=call), "deleted_count": deleted}


def toolkit_cache_entry_delete(scope: MemoryScope, *, entry_id: str, call: CallContext) -> bool:
    """A person deleting one of their cached answers in the web UI (audited, not billed).
    Another user's id, an expired entry's and a malformed one are all "no such entry"."""
    try:
        entry_uuid = uuid.UUID(entry_id)
    except (ValueError, TypeError, AttributeError):
        return False
    with transaction.atomic():
        deleted, _ = CacheEntry.objects.filter(
            user_id=scope.user_pk, id=entry_uuid, expires_at__gt=timezone.now()
        ).delete()
        audit_record(
            scope,
            call=call,
            operation=Operation.DELETE_CACHE_ENTRY,
            detail={"cache_id": str(entry_uuid), "deleted": bool(deleted)},
        )
    return bool(deleted)


def toolkit_cache_entries_clear(scope: MemoryScope, *, call: CallContext) -> int:
    """A person deleting all of their cached answers in the web UI (audited, not billed);
    how many live ones there were. Expired ones go too, uncounted, as in cache_invalidate."""
    with transaction.atomic():
        entries = CacheEntry.objects.filter(user_id=scope.user_pk)
        now = timezone.now()
        deleted, _ = entries.filter(expires_at__gt=now).delete()
        entries.filter(expires_at__lte=now).delete()
        audit_record(scope, call=call, operation=Operation.DELETE_CACHE_ENTRY, detail={"all": True, "deleted": deleted})
    return deleted


def toolkit_cache_user_drop(scope: MemoryScope) -> int:
    """All of the user's cached answers, in the caller's transaction (registered with
    memories.sessions): on clear-all, and when one of the user's memories is deleted or its
    text changes. An answer was worked out from the memories, does not say from which, and
    a cache hit would hand the cleared or forgotten fact back. Undoing the change does not
    restore them: a cache fills again."""
    return CacheEntry.objects.filter(user_id=scope.user_pk).delete()[0]


# Expired cache entries deleted per statement by `toolkit_expired_purge`: short transactions.
EXPIRED_PURGE_BATCH = 5000


def toolkit_expired_purge(*, now: datetime | None = None) -> dict[str, int]:
    """The periodic purge of expired cache entries and decisions (hidden already), each in
    batches, soonest expired first from their index (decisions: decision_expires): a
    backlog after the beat was down (decisions are capped per user, not in all) is never
    one statement holding every row it deletes."""
    now = now or timezone.now()
    expired = CacheEntry.objects.filter(expires_at__lte=now)
    cache = rows_delete_in_batches(expired, order_by="expires_at", batch_size=EXPIRED_PURGE_BATCH)
    expired_decisions = Decision.objects.filter(expires_at__lte=now)
    decisions = rows_delete_in_batches(expired_decisions, order_by="expires_at", batch_size=EXPIRED_PURGE_BATCH)
    return {"cache": cache, "decisions": decisions}


# --- decisions ------------------------------------------------------------------------------
def _iso(when: datetime) -> str:
    return when.astimezone(UTC).isoformat()


def decision_as_dict(decision: Decision, *, user: str) -> dict[str, Any]:
    return {
        "key": decision.key,
        "value": decision.value,
        "user_id": user,
        "created_at": _iso(decision.created_at),
        "updated_at": _iso(decision.updated_at),
        "expires_at": _iso(decision.expires_at) if decision.expires_at else None,
    }


def toolkit_decision_store(
    scope: MemoryScope, *, key: str, value: str, ttl_days: int | None = None, call: CallContext
) -> dict[str, Any]:
    """Upsert by (user, key): `created` for a new key (or one whose decision had
    expired), `updated` otherwise. `ttl_days` sets the expiry; omitted, none. A new key
    beyond DECISION_MAX_PER_USER is refused (`_decision_room`); an update never is."""
    rate_limit_consume(scope, operation=Operation.STORE_DECISION)
    with transaction.atomic():
        # The user's stores one at a time (a lock per key let two new keys both take the
        # cap's last place); they are short, few and rate limited.
        user_write_locks(scope, f"decision:{scope.user_pk}")
        existing = Decision.objects.select_for_update().filter(user_id=scope.user_pk, key=key).first()
        # The time is read once the key is ours: a store that held it while this one waited
        # wrote a later time, which an earlier reading would have moved back.
        now = timezone.now()
        expires_at = now + timedelta(days=ttl_days) if ttl_days else None
        before = None
        if existing is not None and (existing.expires_at is None or existing.expires_at > now):
            before = {"value": audit_text(existing.value)}
            existing.value, existing.updated_at, existing.expires_at = value, now, expires_at
            existing.save(update_fields=["value", "updated_at", "expires_at"])
            action = "updated"
        else:
            if existing is not None:
                existing.delete()  # expired: as if it were gone
            _decision_room(scope, now=now)
            Decision.objects.create(
                user_id=scope.user_pk, key=key, value=value, created_at=now, updated_at=now, expires_at=expires_at
            )
            action = "created"
        call_succeeded(
            scope,
            call=call,
            operation=Operation.STORE_DECISION,
            before=before,
            after={"value": audit_text(value)},
            detail={"key": key, "action": action, "ttl_days": ttl_days},
        )
    return {"key": key, "action": action, "user_id": _user_label(scope, call=call)}


def _decision_room(scope: MemoryScope, *, now: datetime) -> None:
    """Refuse a new decision when the user has DECISION_MAX_PER_USER already (their rows,
    expired ones the purge has not deleted yet included: the bound is on what is kept).
    At the cap the expired ones go first: gone for every reader already, they must not
    take a live one's place, nor refuse a store the user cannot make room for. In the
    store's transaction, under the user's decision lock (a refusal undoes it all).

    Without waiting for a row: an expired one another transaction holds is being deleted
    by it (the periodic purge; the user's stores take the decision lock, an erasure the
    erasure lock), so it is skipped and not counted. Waiting for it deadlocked: the purge's
    one DELETE over every user's expired decisions, holding one of them, waited for the
    expired decision this store had deleted to make its key new again."""
    cap = settings.DECISION_MAX_PER_USER
    own = Decision.objects.filter(user_id=scope.user_pk)
    if own[:cap].count() < cap:
        return
    expired = own.filter(expires_at__lte=now).select_for_update(skip_locked=True)
    Decision.objects.filter(pk__in=list(expired.values_list("pk", flat=True))).delete()
    if own.exclude(expires_at__lte=now)[:cap].count() < cap:
        return
    raise ServiceError(
        ErrorCode.PAYLOAD_TOO_LARGE,
        f"You have {cap} decisions, the most one account keeps; delete one to store a new key "
        "(a key you have can still be updated). Nothing was changed.",
        details={"limit": cap},
    )


def toolkit_decision_recall(scope: MemoryScope, *, key: str, call: CallContext) -> dict[str, Any]:
    """The user's live decision for `key`, or `found: false` (missing or expired)."""
    rate_limit_consume(scope, operation=Operation.RECALL_DECISION)
    decision = Decision.objects.filter(user_id=scope.user_pk, key=key).first()
    if decision is not None and decision.expires_at is not None and decision.expires_at <= timezone.now():
        decision = None
    with transaction.atomic():
        call_succeeded(
            scope, call=call, operation=Operation.RECALL_DECISION, detail={"key": key, "found": decision is not None}
        )
    if decision is None:
        return {"key": key, "found": False}
    user = _user_label(scope, call=call)
    return {"key": key, "found": True, "decision": decision_as_dict(decision, user=user)}


def toolkit_decision_delete(scope: MemoryScope, *, key: str, call: CallContext) -> bool:
    """A person deleting one of their decisions in the web UI (audited, not billed).
    Another user's key and an expired decision's are "no such decision", as everywhere
    else an expired decision is gone (the purge deletes it)."""
    live = Q(expires_at__isnull=True) | Q(expires_at__gt=timezone.now())
    with transaction.atomic():
        deleted, _ = Decision.objects.filter(live, user_id=scope.user_pk, key=key).delete()
        audit_record(
            scope, call=call, operation=Operation.DELETE_DECISION, detail={"key": key, "deleted": bool(deleted)}
        )
    return bool(deleted)


AGENT_DATA_FORMAT = "memsite.decisions_and_cache"
# Rows read per fetch from the export's server-side cursors: a decision is at most ~8,000
# characters, a cached answer ~34,000, so one chunk holds a few million at the most.
EXPORT_DECISIONS_CHUNK = 500
EXPORT_CACHED_ANSWERS_CHUNK = 100


def toolkit_data_export(scope: MemoryScope, *, call: CallContext) -> Iterator[str]:
    """Everything the toolkit keeps about the person besides memories: their live
    decisions and cached answers, as one JSON document streamed in pieces (the web UI's
    "Your data" download; the memory export covers memories), the bytes `json.dumps`
    with `indent=1` would give for the whole document. Audited with the counts before
    the first piece (a refusal too), rate limited, not billed, as session_logs_export.
    The document is read in one snapshot from its first piece to its last, a chunk of
    rows at a time, so the rows held stay bounded however many the user keeps (up to
    CACHE_MAX_ENTRIES_PER_USER and DECISION_MAX_PER_USER). A download cut short is not
    valid JSON. (The audit row's counts are from the call's start.)"""
    rate_limit_consume_audited(scope, operation=Operation.EXPORT_DECISIONS_AND_CACHE, call=call)
    user = _user_label(scope, call=call)
    decisions = decision_list(scope)
    cached = cache_entry_list(scope)
    counts = {"decisions": decisions.count(), "cached_answers": cached.count()}
    with transaction.atomic():
        audit_record(scope, call=call, operation=Operation.EXPORT_DECISIONS_AND_CACHE, detail=counts)

    def cached_as_dict(entry: CacheEntry) -> dict[str, Any]:
        return {
            "id": str(entry.id),
            "query": entry.query,
            "response": entry.response,
            "created_at": _iso(entry.created_at),
            "expires_at": _iso(entry.expires_at),
        }

    def pieces() -> Iterator[str]:
        with read_only_snapshot():
            yield from snapshot_pieces()

    def snapshot_pieces() -> Iterator[str]:
        # The snapshot is taken by the block's first statement: one here, so that the file
        # is the data as of its first piece (the head is yielded before any row is read).
        decisions.exists()
        head = {"format": AGENT_DATA_FORMAT, "version": 1, "exported_at": timezone.now().astimezone(UTC).isoformat()}
        yield _json_indented(head)[:-2] + ",\n"  # the object left open after its last field
        yield ' "decisions": '
        yield from _json_array_pieces(
            decision_as_dict(d, user=user) for d in decisions.iterator(chunk_size=EXPORT_DECISIONS_CHUNK)
        )
        yield ',\n "cached_answers": '
        yield from _json_array_pieces(
            cached_as_dict(entry) for entry in cached.iterator(chunk_size=EXPORT_CACHED_ANSWERS_CHUNK)
        )
        yield "\n}"

    return pieces()


def _json_indented(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, indent=1)


def _json_array_pieces(items: Iterator[dict[str, Any]]) -> Iterator[str]:
    """A JSON array one item a piece, as a member of a top-level object (two levels in)
    with `indent=1`. An encoded string holds no raw newline, so each line can be indented."""
    first = True
    for item in items:
        yield ("[\n  " if first else ",\n  ") + _json_indented(item).replace("\n", "\n  ")
        first = False
    yield "[]" if first else "\n ]"


# --- search_web -----------------------------------------------------------------------------
WEB_UNAVAILABLE = "Web search service unavailable: Tavily API key not configured"


def toolkit_web_search(scope: MemoryScope, *, query: str, call: CallContext) -> dict[str, Any]:
    """Search the web through the configured provider (Tavily). Off without a key (seed
    003's error). The results are returned, never stored as memories."""
    provider = web_search_provider()
    if provider is None:
        raise ServiceError(ErrorCode.WEB_SEARCH_UNAVAILABLE, WEB_UNAVAILABLE)
    rate_limit_consume(scope, operation=Operation.SEARCH_WEB)
    try:
        found = provider.search(query, max_results=settings.WEB_SEARCH_MAX_RESULTS)
    except WebSearchUnavailable as exc:
        raise ServiceError(ErrorCode.WEB_SEARCH_UNAVAILABLE, f"Web search service unavailable: {exc}") from None
    # Cleaned as the enrichment cleans an LLM's text: a lone surrogate in a provider's title
    # (a cut emoji) made the MCP response unencodable, for a call already billed.
    results = [{field: enrichment.storable_text(text) for field, text in result.items()} for result in found]
    with transaction.atomic():
        call_succeeded(
            scope,
            call=call,
            operation=Operation.SEARCH_WEB,
            detail={"query": audit_text(query), "provider": provider.name, "results": len(results)},
        )
    return {"results": results, "query": query}


# --- delete_memory (seed 003) ----------------------------------------------------------------
def toolkit_memory_delete(scope: MemoryScope, *, memory_id: str, dry_run: bool, call: CallContext) -> dict[str, Any]:
    """delete_memory by id: the memory and its twin of the same stored message go to the
    trash together (`memory_delete`, which every surface's delete uses). Another user's
    id answers `not_found` like a missing one. `dry_run` counts them and changes nothing."""
    if not dry_run:
        return {"deleted_count": len(memory_delete(scope, memory_id=memory_id, call=call)), "dry_run": False}
    return {"deleted_count": len(memory_delete_dry_run(scope, memory_id=memory_id, call=call)), "dry_run": True}


# --- memory_health / wipe_user_data ---------------------------------------------------------
def toolkit_memory_health(scope: MemoryScope, *, call: CallContext) -> dict[str, Any]:
    rate_limit_consume(scope, operation=Operation.MEMORY_HEALTH)
    counts = engine_health_counts(scope, enriched_source=SOURCE)
    now = timezone.now()
    cache = CacheEntry.objects.filter(user_id=scope.user_pk, expires_at__gt=now).count()
    decisions = Decision.objects.filter(user_id=scope.user_pk).exclude(expires_at__lte=now).count()
    with transaction.atomic():
        call_succeeded(scope, call=call, operation=Operation.MEMORY_HEALTH, detail={"total": counts["total"]})
    return {
        "user_id": _user_label(scope, call=call),
        "total_memories": counts["total"],
        "tier_stats": {"stm": 0, "ltm": 0, **counts["tiers"]},
        "enrichment_stats": {"pending": 0, "completed": 0, **counts["enrichment"]},
        "type_stats": counts["types"],
        "trash": counts["trash"],
        "cache_entries": cache,
        "decisions": decisions,
    }


WIPE_CONFIRM = "wipe_user_data requires confirm=true. This will permanently delete ALL user data."


def toolkit_user_data_wipe(scope: MemoryScope, *, confirm: bool, call: CallContext, operation: str = "") -> dict:
    """Erase everything of the user: memories (trash included), cache, decisions, mem0's
    raw messages and dedupe hashes, the session log (events, summaries, archives, turn
    guards), chat turns awaiting extraction, closed ingest intents, and the version
    history of every memory the user owned (also ones deleted long ago), in one
    transaction with the audit row and usage event. The audit rows stay (append-only,
    with actor, time, operation and ids) but their content snapshots are crypto-shredded:
    `audit_deleted` counts the rows made unreadable."""
    if confirm is not True:
        raise ServiceError(ErrorCode.CONFIRMATION_REQUIRED, WIPE_CONFIRM)
    operation = operation or Operation.WIPE_USER_DATA
    if operation == Operation.WIPE_USER_DATA:
        rate_limit_consume(scope, operation=Operation.WIPE_USER_DATA)
    with _engine_errors(), transaction.atomic():
        advisory_xact_lock(erasure_lock_key(scope))
        with _attributed(call):
            memory_ids = engine_delete_user_rows(scope)
        engine_purge_messages(scope)
        ContentHash.objects.filter(engine_user_id=scope.engine_user_id).delete()
        cache, _ = CacheEntry.objects.filter(user_id=scope.user_pk).delete()
        decisions, _ = Decision.objects.filter(user_id=scope.user_pk).delete()
        sessions = session_data_erase(scope)
        # Closed ingest intents (the chat proxy leaves one per extracted turn). An open one
        # is a call in flight or cut short: it holds no content and is what completes that
        # call's audit row (the call itself, or the reconciler), so it stays.
        intents, _ = (
            IngestIntent.objects.filter(engine_user_id=scope.engine_user_id)
            .exclude(state=IngestIntent.State.OPEN)
            .delete()
        )
        # ...but is marked: its completion deletes what mem0 stores for it after this commit.
        ingest_intents_supersede(scope, call=call, erased=True)
        erased = subject_content_erase(
            subject_user_id=scope.user_pk, engine_user_id=scope.engine_user_id, memory_ids=memory_ids
        )
        counts = {
            "memories": len(memory_ids),
            "cache": cache,
            "decisions": decisions,
            "audit": erased["audit_rows_shredded"],
            "history": erased["history_rows_deleted"],
            "session_items": sessions,
            "ingest_intents": intents,
        }
        if operation == Operation.WIPE_USER_DATA:
            call_succeeded(scope, call=call, operation=operation, memory_ids=memory_ids, detail=counts)
        else:
            audit_record(scope, call=call, operation=operation, memory_ids=memory_ids, detail=counts)
        # This process's recent vectors (of any user: which are this one's is not known from
        # digests) go once the erasure holds; other processes' expire (EMBEDDER_CACHE_TTL_S).
        transaction.on_commit(engine_vector_cache_clear)
    return {
        "user_id": _user_label(scope, call=call),
        "memories_deleted": len(memory_ids),
        "cache_deleted": cache,
        "audit_deleted": erased["audit_rows_shredded"],
        "decisions_deleted": decisions,
    }
