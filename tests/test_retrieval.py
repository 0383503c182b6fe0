"""Hybrid retrieval: exact identifiers come first, paraphrases still work, the fusion
obeys its weights."""

import pytest

from memories.engine.retrieval import fuse
from memories.services import memory_remember, memory_search
from tests.conftest import internal_call

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]

IDENTIFIERS = {
    "error code": ("ERR_CONN_4417", "The production database keeps failing with ERR_CONN_4417 at night."),
    "ticket": ("PROJ-8812", "Ticket PROJ-8812 tracks the flaky Safari login test."),
    "hex commit": ("9f3e2ab", "Commit 9f3e2ab introduced the worker memory leak."),
    "ip address": ("10.20.30.41", "The staging box answers on 10.20.30.41 behind the VPN."),
    "dotted topic": ("orders.v3.created", "Order events are published to orders.v3.created."),
    "serial": ("C02XK1Z3JG5H", "My laptop serial number is C02XK1Z3JG5H."),
    "function": ("retry_failed_charges", "retry_failed_charges() re-runs payments that bounced."),
    "header": ("X-RateLimit-Remaining", "Clients read X-RateLimit-Remaining to slow down."),
}
DISTRACTORS = [
    "The production database runs PostgreSQL 16 in Frankfurt.",
    "The login page was redesigned in March.",
    "Our staging environment is reset every Monday.",
    "The worker processes run on two cores each.",
    "Payments are retried three times before we email the customer.",
    "Order confirmation emails are sent within a minute.",
    "The laptop battery lasts about nine hours.",
    "Rate limits are documented in the API guide.",
    "Errors in the connection pool are logged to Sentry.",
    "Safari users reported slow page loads last week.",
]


@pytest.mark.parametrize("shape", sorted(IDENTIFIERS))
def test_an_exact_identifier_returns_its_memory_first(alice_scope, shape):
    for text in DISTRACTORS:
        memory_remember(alice_scope, memory=text, call=internal_call())
    ids = {
        name: memory_remember(alice_scope, memory=text, call=internal_call()).id
        for name, (_, text) in IDENTIFIERS.items()
    }
    identifier, _ = IDENTIFIERS[shape]
    results = memory_search(alice_scope, query=identifier, top_k=5, call=internal_call())
    assert results[0].id == ids[shape], [r.memory for r in results]


def test_paraphrases_are_found_by_the_vector_side(alice_scope):
    target = memory_remember(alice_scope, memory="I am allergic to penicillin.", call=internal_call()).id
    for text in DISTRACTORS:
        memory_remember(alice_scope, memory=text, call=internal_call())
    results = memory_search(alice_scope, query="Which antibiotics must I avoid?", top_k=3, call=internal_call())
    assert target in [r.id for r in results]


def test_fusion_weights():
    vector, lexical = ["a", "b", "c"], ["c", "d"]
    assert [i for i, _ in fuse([(vector, 1.0), (lexical, 1.0)], k=10)][:1] == ["c"]
    assert [i for i, _ in fuse([(vector, 10.0), (lexical, 1.0)], k=10)][:1] == ["a"]
    assert [i for i, _ in fuse([(vector, 0.0), (lexical, 1.0)], k=10)][:2] == ["c", "d"]
