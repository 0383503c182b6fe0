"""Enrichment of a long-term candidate: summary, importance, tags and type. Heuristics
always work (no LLM, no network); the LLM is only a refinement when one is configured
and its answer parses."""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

from memories.engine import ENRICHMENT_KEY, engine_llm_json, llm_configured
from memories.schemas import ENRICHED_BY_KEY, SUMMARY_KEY, TAG_MAX_CHARS, system_tag, tag_storable

logger = logging.getLogger(__name__)

SUMMARY_MAX_CHARS = 200
_SURROGATE = re.compile("[\ud800-\udfff]")
_CONTROL = re.compile("[\x01-\x08\x0b\x0c\x0e-\x1f\x7f]")
_ANY_CONTROL = re.compile("[\x00-\x1f]")
MAX_TAGS = 5
_WORD = re.compile(r"[A-Za-z][A-Za-z0-9+#.-]{2,}")
_STOP = frozenset(
    [
        "about",
        "above",
        "after",
        "again",
        "against",
        "all",
        "also",
        "and",
        "any",
        "are",
        "because",
        "been",
        "before",
        "being",
        "below",
        "between",
        "both",
        "but",
        "can",
        "could",
        "did",
        "does",
        "doing",
        "down",
        "during",
        "each",
        "few",
        "for",
        "from",
        "further",
        "had",
        "has",
        "have",
        "having",
        "her",
        "here",
        "hers",
        "herself",
        "him",
        "himself",
        "his",
        "how",
        "into",
        "its",
        "itself",
        "just",
        "let",
        "like",
        "more",
        "most",
        "much",
        "must",
        "myself",
        "nor",
        "not",
        "now",
        "off",
        "once",
        "only",
        "other",
        "our",
        "ours",
        "out",
        "over",
        "own",
        "really",
        "same",
        "she",
        "should",
        "some",
        "such",
        "than",
        "that",
        "the",
        "their",
        "theirs",
        "them",
        "then",
        "there",
        "these",
        "they",
        "this",
        "those",
        "through",
        "too",
        "under",
        "until",
        "very",
        "was",
        "were",
        "what",
        "when",
        "where",
        "which",
        "while",
        "who",
        "whom",
        "why",
        "will",
        "with",
        "would",
        "you",
        "your",
        "yours",
        "yourself",
        "want",
        "wants",
        "need",
        "needs",
        "know",
        "think",
        "thing",
        "things",
        "make",
        "made",
        "get",
        "got",
        "going",
        "use",
        "used",
        "using",
        "one",
        "two",
        "please",
        "thanks",
        "thank",
        "okay",
        "yes",
        "sure",
    ]
)
_IMPORTANT = ("always", "never", "important", "must", "remember", "don't", "do not", "allergic", "deadline")
_PREFERENCE = ("prefer", "like", "love", "hate", "favorite", "favourite", "dislike", "rather")
_FEEDBACK = ("don't", "do not", "stop", "instead", "should", "please", "wrong", "too ")
_PROJECT = ("project", "deadline", "release", "repo", "repository", "sprint", "deploy", "milestone", "ticket", "bug")
_REFERENCE = ("http://", "https://", "www.", "docs", "documentation", "link", "see ")


@dataclass(frozen=True)
class Enrichment:
    summary: str
    importance: float
    tags: list[str]
    memory_type: str
    method: str  # "heuristic" or "llm"

    def metadata(self) -> dict[str, str]:
        """What the enrichment writes into the memory's metadata besides its fields
        (outside the owner's metadata budget: schemas.ENRICHMENT_METADATA_KEYS)."""
        return {ENRICHMENT_KEY: "completed", SUMMARY_KEY: self.summary, ENRICHED_BY_KEY: self.method}


def storable_text(text: str) -> str:
    """The LLM's text as the database can store it: PostgreSQL's jsonb refuses NUL and
    lone surrogates (`unsupported Unicode escape sequence`), and one such answer would
    otherwise fail the candidate's write on every attempt. NUL is dropped, a lone
    surrogate becomes U+FFFD; other control characters become spaces."""
    text = _SURROGATE.sub("\ufffd", text.replace("\x00", ""))
    return _CONTROL.sub(" ", text).strip()


def _summary(text: str) -> str:
    first = re.split(r"(?<=[.!?])\s+", " ".join(text.split()), maxsplit=1)[0]
    return first if len(first) <= SUMMARY_MAX_CHARS else first[: SUMMARY_MAX_CHARS - 1].rstrip() + "…"


def _memory_type(lower: str) -> str:
    if any(marker in lower for marker in _REFERENCE):
        return "reference"
    if any(marker in lower for marker in _PROJECT):
        return "project"
    if any(marker in lower for marker in _FEEDBACK):
        return "feedback"
    return "user"


def _importance(lower: str, length: int) -> float:
    score = 0.4
    score += 0.1 * sum(marker in lower for marker in _IMPORTANT)
    score += 0.1 if any(marker in lower for marker in _PREFERENCE) else 0.0
    score += 0.1 if length > 120 else 0.0
    return round(min(1.0, score), 2)


def _tags(text: str) -> list[str]:
    words = [w.lower().strip(".-") for w in _WORD.findall(text)]
    # A tag is at most TAG_MAX_CHARS, as every writer's tags are (an export must import):
    # a longer "word" (a hash, a kebab-case run) is no useful tag anyway.
    # Never a turn lifecycle tag ("turn-fact" is a word here), as for the LLM's tags.
    counts = Counter(w for w in words if w not in _STOP and 2 < len(w) <= TAG_MAX_CHARS and not system_tag(w))
    return [word for word, _ in counts.most_common(MAX_TAGS)]


def enrich_heuristic(text: str) -> Enrichment:
    lower = text.lower()
    return Enrichment(
        summary=_summary(text),
        importance=_importance(lower, len(text)),
        tags=_tags(text),
        memory_type=_memory_type(lower),
        method="heuristic",
    )


def _llm_tags(raw: object, *, fallback: list[str]) -> list[str]:
    """The LLM's tags: its list's non-empty strings, once each, in its order. Anything but a
    list is not an answer about tags (a string would otherwise be split into letters):
    the heuristic tags stand instead."""
    if not isinstance(raw, list):
        return fallback
    tags: list[str] = []
    for item in raw:
        tag = _llm_tag(item) if isinstance(item, str) else ""
        if tag and tag not in tags:
            tags.append(tag)
    return tags[:MAX_TAGS]


def _llm_tag(item: str) -> str:
    """One of the LLM's tags as a `Tag` ("" when it cannot be one). Tags hold no control
    characters, a tab or a newline either (they become spaces, runs of spaces one);
    lowercased before the cut, as a lowercase form can be longer ("İ" is two characters).
    Never one of the turn lifecycle's own tags (`turn-fact`, `tier:...`, `project:...`): the
    memory's text steers the LLM, and such a tag would make a toolkit memory a turn fact
    that consolidation may trash and retention delete."""
    tag = " ".join(_ANY_CONTROL.sub(" ", storable_text(item)).split()).lower()[:TAG_MAX_CHARS].strip()
    return tag if tag_storable(tag) and not system_tag(tag) else ""


class LlmBreaker:
    """One enrichment run's circuit breaker: after `threshold` LLM calls in a row failed
    (each up to (1 + LLM_MAX_RETRIES) x LLM_TIMEOUT_S when the LLM is down or slow), the
    rest of the run uses heuristics without calling it, so a run over a backlog does not
    hold a worker slot for a minute per candidate. Any answer closes it again."""

    def __init__(self, threshold: int) -> None:
        self.threshold = threshold
        self.failures = 0

    @property
    def open(self) -> bool:
        return self.failures >= self.threshold

    def failed(self) -> None:
        self.failures += 1
        if self.failures == self.threshold:
            logger.warning(
                "LLM enrichment failed %d times in a row; the rest of this run uses heuristics", self.failures
            )

    def answered(self) -> None:
        self.failures = 0


_run_breaker: ContextVar[LlmBreaker | None] = ContextVar("enrichment_llm_breaker", default=None)


@contextmanager
def llm_breaker(threshold: int) -> Iterator[LlmBreaker]:
    """Every enrich_text call inside this block (on this thread) shares one LlmBreaker."""
    breaker = LlmBreaker(threshold)
    token = _run_breaker.set(breaker)
    try:
        yield breaker
    finally:
        _run_breaker.reset(token)


def enrich_text(text: str) -> Enrichment:
    """Heuristics; with an LLM configured, its answer where it parses (else heuristics).
    Inside `llm_breaker`, heuristics without asking the LLM once the breaker is open."""
    heuristic = enrich_heuristic(text)
    breaker = _run_breaker.get()
    if not llm_configured() or (breaker is not None and breaker.open):
        return heuristic
    try:
        answer = engine_llm_json(
            "Summarise this memory about a user in one sentence, rate its long-term importance from 0 to 1, "
            "give up to 5 short lowercase tags and its type (user, feedback, project or reference). Answer JSON "
            '{"summary": str, "importance": float, "tags": [str], "memory_type": str}.\nMemory: ' + text
        )
    except Exception:  # the LLM is a refinement: never lose the enrichment over it
        logger.warning("LLM enrichment failed; heuristics used", exc_info=False)
        if breaker is not None:
            breaker.failed()
        return heuristic
    if breaker is not None:
        breaker.answered()
    try:
        memory_type = answer.get("memory_type")
        importance = float(answer.get("importance", -1))
        tags = _llm_tags(answer.get("tags"), fallback=heuristic.tags)
        summary = storable_text(str(answer.get("summary") or ""))[:SUMMARY_MAX_CHARS] or heuristic.summary
        if memory_type not in ("user", "feedback", "project", "reference") or not 0 <= importance <= 1:
            return heuristic
    except (TypeError, ValueError, AttributeError):
        return heuristic
    return Enrichment(summary=summary, importance=importance, tags=tags, memory_type=memory_type, method="llm")
