"""The enrichment sweep must not hold the worker's two slots for hours while the LLM is slow
or down (billing delivery, turn extraction, erasure would wait behind it): a run stops
calling a failing LLM after ENRICHMENT_LLM_BREAKER_FAILURES failures in a row (the rest
get the heuristics, as after any LLM failure), one sweep runs at a time, and a sweep stops
claiming candidates after ENRICHMENT_SWEEP_BUDGET_S. Nothing is lost: what a sweep does not
take stays pending, unclaimed, for the next. LLM calls are counted, never timed."""

from __future__ import annotations

import pytest

from audit.models import AuditEvent
from memories.toolkit.services import toolkit_candidates_enrich
from memories.toolkit.tasks import enrich_pending
from tests.conftest import InThread
from tests.test_enrichment_lock import CLAIM, enrich_rows, held_llm, payload_of, store_candidate  # noqa: F401 - held_llm is a fixture

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]

TEXTS = [
    "I always prefer dark mode interfaces in every editor I use",
    "I always keep the spare keys in the left drawer of the desk",
    "Bob always wants the release notes before every deploy",
    "Bob prefers tea over coffee in the mornings at the office",
    "My sister's birthday is on the twelfth of March every year",
    "I am allergic to peanuts, so never suggest recipes with them",
]
ANSWER = {"summary": "A fact", "importance": 0.7, "tags": ["fact"], "memory_type": "user"}


@pytest.fixture
def no_llm_retries(settings):
    """One request per LLM call, so the fake's requests count the calls."""
    settings.LLM_MAX_RETRIES = 0
    settings.ENRICHMENT_LLM_BREAKER_FAILURES = 3


def assert_enriched_by(memory_ids: list[str], method: str) -> None:
    for memory_id in memory_ids:
        payload = payload_of(memory_id)
        assert (payload["enrichment_status"], payload["enriched_by"]) == ("completed", method)
        assert CLAIM not in payload and "enrichment_attempts" not in payload
        assert enrich_rows(memory_id).get().outcome == AuditEvent.Outcome.OK


def assert_pending_unclaimed(memory_ids: list[str]) -> None:
    for memory_id in memory_ids:
        payload = payload_of(memory_id)
        assert payload["enrichment_status"] == "pending" and CLAIM not in payload
        assert "enrichment_attempts" not in payload and not enrich_rows(memory_id).exists()


# --- the circuit breaker -----------------------------------------------------------------------
def test_a_sweep_with_the_llm_down_stops_calling_it_and_enriches_the_rest_by_heuristics(alice, llm, no_llm_retries):
    ids = [store_candidate(alice, text) for text in TEXTS]
    llm.fail_next = 100  # down for good
    assert enrich_pending() == len(ids)
    assert len(llm.prompts()) == 3  # the breaker's failures, then no more calls
    assert_enriched_by(ids, "heuristic")  # as the fallback after any LLM failure marks them


def test_a_sweep_with_the_llm_timing_out_stops_calling_it(alice, held_llm, settings, no_llm_retries):  # noqa: F811
    settings.LLM_TIMEOUT_S = 0.2  # every held call times out
    ids = [store_candidate(alice, text) for text in TEXTS]
    assert toolkit_candidates_enrich() == len(ids)  # the breaker holds for any run, not only the sweep
    assert len(held_llm.prompts()) == 3
    assert_enriched_by(ids, "heuristic")


def test_the_breaker_counts_failures_in_a_row_only(alice, llm, no_llm_retries):
    ids = [store_candidate(alice, text) for text in TEXTS[:5]]
    llm.fail_next = 2
    for _ in range(3):
        llm.queue_answer(ANSWER)
    assert enrich_pending() == len(ids)
    assert len(llm.prompts()) == len(ids)  # two failures, then answers: the LLM is asked each time
    assert_enriched_by(ids[:2], "heuristic")
    assert_enriched_by(ids[2:], "llm")


# --- one sweep at a time -----------------------------------------------------------------------
def test_a_second_sweep_while_one_runs_does_nothing(alice, bob, held_llm):  # noqa: F811
    first_id = store_candidate(alice, TEXTS[0])
    second_id = store_candidate(bob, TEXTS[2])
    held_llm.queue_answer(ANSWER)
    held_llm.queue_answer(ANSWER)
    first = InThread(enrich_pending)
    held_llm.wait_held()  # the first sweep is in its LLM call
    second = InThread(enrich_pending)
    assert second.result(timeout=15) == 0  # returns at once instead of taking the other candidate
    assert len(held_llm.prompts()) == 1
    assert_pending_unclaimed([second_id])
    held_llm.release()
    assert first.result() == 2
    assert_enriched_by([first_id, second_id], "llm")
    # The first sweep let go of the lock: the next one runs.
    third_id = store_candidate(alice, TEXTS[1])
    held_llm.queue_answer(ANSWER)
    assert enrich_pending() == 1
    assert_enriched_by([third_id], "llm")


# --- the time budget ---------------------------------------------------------------------------
def test_a_sweep_past_its_time_budget_leaves_the_rest_pending_for_the_next(alice, settings):
    settings.ENRICHMENT_SWEEP_BUDGET_S = 0  # spent as soon as the first candidate is done
    ids = [store_candidate(alice, text) for text in TEXTS[:3]]
    assert enrich_pending() == 1  # a sweep always takes one: a backlog keeps moving
    assert_enriched_by(ids[:1], "heuristic")
    assert_pending_unclaimed(ids[1:])
    assert enrich_pending() == 1
    assert enrich_pending() == 1
    assert_enriched_by(ids, "heuristic")
    assert enrich_pending() == 0
