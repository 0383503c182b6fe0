"""Facts from a turn, with their tier (seed 002's L1 daily, L2 weekly, long-term).

Without an LLM (the default) a rule-based extractor keeps the user's first-person
statements that read as durable facts or preferences. With `MCP_MEMORY_HEURISTIC_ENABLED`
the configured OpenAI-compatible model extracts them (chat completions, JSON answer)."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Any

import httpx
from django.conf import settings

from core.errors import ErrorCode, ServiceError
from core.http_deadline import deadline_client
from core.inputs import text_problem
from memories.text_hash import content_sha256
from memories.turns.items import item_role, item_text

logger = logging.getLogger(__name__)

TIER_L1 = "l1"
TIER_L2 = "l2"
TIER_LONG = "long_term"
TIERS = (TIER_L1, TIER_L2, TIER_LONG)
FACT_MAX_CHARS = 500
# Facts after_turn stores carry these tags: what maintenance, the tree and the UI select on.
FACT_TAG = "turn-fact"
FACTS_PER_TURN_MAX = 20

_SENTENCE = re.compile(r"(?<=[.!?])\s+|\n+")
_FIRST_PERSON = re.compile(r"\b(i|i'm|i've|i'd|my|mine|we|our|me)\b", re.IGNORECASE)
_DURABLE = re.compile(
    r"\b(prefer|prefers|like|likes|love|loves|hate|hates|dislike|use|uses|using|work|works|working|live|lives|"
    r"name|called|am|is|are|was|always|never|usually|want|need|allergic|favorite|favourite|remember|born|"
    r"speak|moved|have|has|plan|planning|meeting|deadline|going)\b",
    re.IGNORECASE,
)
_QUESTION = re.compile(r"\?\s*$")
_L1 = re.compile(r"\b(today|tonight|this (morning|afternoon|evening)|right now|at the moment|currently)\b", re.I)
_L2 = re.compile(r"\b(this week|next week|tomorrow|this weekend|these days|for now|until (monday|friday))\b", re.I)


def tier_tag(tier: str) -> str:
    return f"tier:{tier}"


def project_tag(project: str) -> str:
    return f"project:{project}"


PROJECT_TAG_PREFIX = project_tag("")


def project_tags(tags: tuple[str, ...] | list[str]) -> frozenset[str]:
    """The `project:` tags of a memory; none means user-wide (recalled in every project)."""
    return frozenset(tag for tag in tags if tag.startswith(PROJECT_TAG_PREFIX))


def tags_made_durable(tags: tuple[str, ...]) -> tuple[str, ...]:
    """`tags` with a short tier (L1, L2) turned long-term: for a fact that must not expire
    (remembered on purpose, pinned, edited by its owner)."""
    short = {tier_tag(TIER_L1), tier_tag(TIER_L2)}
    return tuple(dict.fromkeys(tier_tag(TIER_LONG) if tag in short else tag for tag in tags))


@dataclass(frozen=True)
class Fact:
    text: str
    tier: str
    shortened: bool = False  # cut to FACT_MAX_CHARS


@dataclass(frozen=True)
class Extraction:
    """The facts after_turn stores, and what it left out: the result and the audit row
    say so (the turn's items stay whole in the session log either way)."""

    facts: list[Fact]
    over_limit: int = 0  # storable facts past FACTS_PER_TURN_MAX
    unstorable: int = 0  # facts holding characters a memory's text may not hold

    @property
    def shortened(self) -> int:
        return sum(1 for fact in self.facts if fact.shortened)

    def report(self) -> dict[str, int]:
        """The non-zero counts, for the audit row."""
        counts = {"over_limit": self.over_limit, "unstorable": self.unstorable, "shortened": self.shortened}
        return {name: count for name, count in counts.items() if count}


def fact_of(text: str, *, tier: str | None = None) -> Fact:
    """A fact of `text` with its whitespace folded, cut to FACT_MAX_CHARS (and saying so)."""
    folded = " ".join(text.split())
    kept = folded[:FACT_MAX_CHARS]
    return Fact(text=kept, tier=tier if tier in TIERS else fact_tier(kept), shortened=len(kept) < len(folded))


def fact_tier(text: str) -> str:
    """Short-lived statements expire (L1 a day, L2 a week); the rest is long-term."""
    if _L1.search(text):
        return TIER_L1
    if _L2.search(text):
        return TIER_L2
    return TIER_LONG


def facts_heuristic(items: list[dict[str, Any]]) -> list[Fact]:
    """The user's first-person, non-question sentences that state something durable."""
    facts: list[Fact] = []
    seen: set[str] = set()
    for item in items:
        if item_role(item) != "user":
            continue
        for sentence in _SENTENCE.split(item_text(item)):
            sentence = " ".join(sentence.split())
            if len(sentence) < 8 or _QUESTION.search(sentence):
                continue
            if not (_FIRST_PERSON.search(sentence) and _DURABLE.search(sentence)):
                continue
            fact = fact_of(sentence)
            if fact.text.casefold() in seen:
                continue
            seen.add(fact.text.casefold())
            facts.append(fact)
    return facts


_PROMPT = (
    "Extract durable facts about the user from this conversation turn. Answer with JSON only: "
    '{"memory": [{"text": "<one fact>", "tier": "l1" | "l2" | "long_term"}]}. '
    "l1: true only today; l2: true this week; long_term: preferences, identity, lasting facts. "
    "Empty list when nothing is worth keeping."
)


def heuristic_llm_enabled() -> bool:
    return bool(
        settings.MCP_MEMORY_HEURISTIC_ENABLED and (settings.MCP_MEMORY_HEURISTIC_BASE_URL or settings.LLM_BASE_URL)
    )


def _endpoint() -> str:
    """The chat completions URL for the configured base URL. Seed 002 §9.3 documents a
    provider root, a `/v1` base and an explicit `/v1/responses` endpoint; we speak chat
    completions (docs/architecture.md), so an explicit responses endpoint names its
    sibling `.../chat/completions` rather than gaining a second path after it."""
    base = (settings.MCP_MEMORY_HEURISTIC_BASE_URL or settings.LLM_BASE_URL or "").rstrip("/")
    if base.endswith("/chat/completions"):
        return base
    if base.endswith("/responses"):
        return base.removesuffix("/responses") + "/chat/completions"
    return f"{base}/chat/completions" if base.endswith("/v1") else f"{base}/v1/chat/completions"


# MCP_MEMORY_HEURISTIC_MAX_OUTPUT_TOKENS tokens in a JSON envelope; far more is not an answer.
_LLM_MAX_RESPONSE_BYTES = 1024 * 1024


def llm_complete(*, system: str, user: str) -> str:
    """One chat completion from the configured model; `llm_unavailable` on any failure.
    A slow call: never inside a database transaction."""
    key = settings.MCP_MEMORY_HEURISTIC_API_KEY or settings.LLM_API_KEY or ""
    model = settings.MCP_MEMORY_HEURISTIC_MODEL if settings.MCP_MEMORY_HEURISTIC_BASE_URL else settings.LLM_MODEL
    try:
        # The timeout bounds the whole request: a model server that drips its answer
        # would otherwise hold memory_after_turn (and its worker thread) for ever.
        with deadline_client(
            total_s=settings.MCP_MEMORY_HEURISTIC_TIMEOUT_MS / 1000, max_bytes=_LLM_MAX_RESPONSE_BYTES
        ) as client:
            response = client.post(
                _endpoint(),
                headers={"Authorization": f"Bearer {key}"} if key else {},
                json={
                    "model": model or settings.MCP_MEMORY_HEURISTIC_MODEL,
                    "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
                    "max_tokens": settings.MCP_MEMORY_HEURISTIC_MAX_OUTPUT_TOKENS,
                },
            )
        response.raise_for_status()
        return str(response.json()["choices"][0]["message"]["content"] or "")
    except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError):
        raise ServiceError(
            ErrorCode.LLM_UNAVAILABLE, "The fact-extraction model is unavailable; retry later."
        ) from None


def facts_llm(items: list[dict[str, Any]]) -> list[Fact]:
    transcript = "\n".join(f"{item_role(item)}: {item_text(item)}" for item in items if item_text(item))
    answer = llm_complete(system=_PROMPT, user=transcript)
    answer = answer.strip().removeprefix("```json").removeprefix("```").removesuffix("```").strip()
    try:
        data = json.loads(answer)
    except ValueError:
        raise ServiceError(ErrorCode.LLM_UNAVAILABLE, "The fact-extraction model gave no JSON; retry later.") from None
    entries = data.get("memory") or data.get("facts") or [] if isinstance(data, dict) else []
    facts: list[Fact] = []
    for entry in entries if isinstance(entries, list) else []:
        text = entry.get("text") if isinstance(entry, dict) else entry
        if not isinstance(text, str) or not text.strip():
            continue
        tier = entry.get("tier") if isinstance(entry, dict) else None
        facts.append(fact_of(text, tier=tier))
    return facts


def facts_distinct(facts: list[Fact]) -> list[Fact]:
    """`facts` with each text once, by the dedupe rule's key (`content_sha256`: one memory
    per text), in the order first said. A text said with several tiers keeps the most
    durable (what storing them one after another makes of the one memory: a restated
    fact is never shortened, `_fact_restated_attrs`)."""
    kept: dict[str, Fact] = {}
    for fact in facts:
        key = content_sha256(fact.text)
        first = kept.setdefault(key, fact)
        if TIERS.index(fact.tier) > TIERS.index(first.tier):
            kept[key] = Fact(text=first.text, tier=fact.tier, shortened=first.shortened)
    return list(kept.values())


def facts_extract(items: list[dict[str, Any]]) -> Extraction:
    """The turn's distinct facts (the configured model's, else the rules'; `facts_distinct`),
    at most FACTS_PER_TURN_MAX of them. A fact holding a character a memory's text may not hold (a
    NUL or lone surrogate in the model's answer, a terminal escape in a tool output the
    rules quoted) is left out: failing the turn over it would fail every retry too. Both
    are counted, never logged with their text."""
    found = facts_llm(items) if heuristic_llm_enabled() else facts_heuristic(items)
    # Checked before hashing: a lone surrogate has no UTF-8 form to hash.
    unstorable = {fact.text for fact in found if text_problem(fact.text) is not None}
    storable = facts_distinct([fact for fact in found if fact.text not in unstorable])
    extraction = Extraction(
        facts=storable[:FACTS_PER_TURN_MAX],
        over_limit=max(0, len(storable) - FACTS_PER_TURN_MAX),
        unstorable=len(unstorable),
    )
    if extraction.unstorable or extraction.over_limit:
        logger.warning(
            "fact extraction: left out %d unstorable facts and %d past the per-turn limit",
            extraction.unstorable,
            extraction.over_limit,
        )
    return extraction
