"""Hybrid retrieval: exact identifiers come first, paraphrases still work, the fusion
obeys its weights."""

import json

import pytest

from eval.harness import PARAPHRASE
from memories.engine import attrs_containment
from memories.engine.retrieval import coverage_gate, fuse, fuse_scores, hybrid_search, lexical_scores
from memories.services import memory_delete, memory_remember, memory_search
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


@pytest.fixture(params=["score", "rrf"])
def fusion(request, settings):
    settings.SEARCH_FUSION = request.param
    return request.param


@pytest.mark.parametrize("shape", sorted(IDENTIFIERS))
def test_an_exact_identifier_returns_its_memory_first(alice_scope, shape, fusion):
    for text in DISTRACTORS:
        memory_remember(alice_scope, memory=text, call=internal_call())
    ids = {
        name: memory_remember(alice_scope, memory=text, call=internal_call()).id
        for name, (_, text) in IDENTIFIERS.items()
    }
    identifier, _ = IDENTIFIERS[shape]
    results = memory_search(alice_scope, query=identifier, top_k=5, call=internal_call())
    assert results[0].id == ids[shape], [r.memory for r in results]


def test_paraphrases_are_found_by_the_vector_side(alice_scope, fusion):
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


def test_score_fusion_adds_weighted_coverage_to_the_cosine():
    vector = [("a", 0.60), ("b", 0.50)]
    # (id, bm25, coverage, cosine): "b" covers the whole query, "c" was found only lexically.
    lexical = [("b", 7.0, 1.0, 0.50), ("c", 3.0, 0.25, 0.20)]
    fused = dict(fuse_scores(vector, lexical, coverage_weight=1.0))
    assert fused == pytest.approx({"a": 0.60, "b": 1.50, "c": 0.45})
    assert [i for i, _ in fuse_scores(vector, lexical, coverage_weight=0.0)] == ["a", "b", "c"]
    assert [i for i, _ in fuse_scores([], lexical, coverage_weight=1.0)] == ["b", "c"]


def test_coverage_counts_as_far_as_the_memory_is_related_to_the_query():
    assert coverage_gate(0.02, unrelated=0.05, related=0.25) == 0.0
    assert coverage_gate(0.15, unrelated=0.05, related=0.25) == pytest.approx(0.5)
    assert coverage_gate(0.60, unrelated=0.05, related=0.25) == 1.0
    assert coverage_gate(None, unrelated=0.05, related=0.25) == 1.0  # the vector side was off
    assert coverage_gate(0.10, unrelated=0.10, related=0.10) == 0.0  # a step when both are equal
    vector = [("fact", 0.40), ("shares-a-word", 0.01)]
    lexical = [("shares-a-word", 5.0, 0.50, 0.01), ("fact", 1.0, 0.10, 0.40)]
    ungated = dict(fuse_scores(vector, lexical, coverage_weight=1.0))
    assert max(ungated, key=ungated.get) == "shares-a-word"
    gated = dict(fuse_scores(vector, lexical, coverage_weight=1.0, gate=(0.05, 0.25)))
    assert gated == pytest.approx({"fact": 0.50, "shares-a-word": 0.01})


def test_words_shared_without_the_meaning_weigh_less_than_under_rank_fusion(alice_scope, settings):
    """Rank fusion gave BM25's first hits a fixed bonus, however weak their match; score
    fusion gives a memory sharing one word of the question only that word's share."""
    target = memory_remember(alice_scope, memory="My abuela is turning 95 in November.", call=internal_call()).id
    for text in [
        "My old laptop still boots, slowly.",
        "Autumn leaves block the gutter every year.",
        "The old bakery on the corner sells rye bread.",
        *DISTRACTORS,
    ]:
        memory_remember(alice_scope, memory=text, call=internal_call())

    def rank(fusion: str) -> int:
        settings.SEARCH_FUSION = fusion
        found = [m.id for m in hybrid_search(alice_scope, query="How old will my grandma be this autumn?", limit=13)]
        return found.index(target)

    assert rank("score") <= 1
    assert rank("score") < rank("rrf")


def test_coverage_is_the_idf_weighted_share_of_the_query_terms(alice_scope):
    both = memory_remember(alice_scope, memory="Ticket PROJ-8812 is the Safari login bug.", call=internal_call()).id
    one = memory_remember(alice_scope, memory="Safari is slow on old Macs.", call=internal_call()).id
    for text in DISTRACTORS:
        memory_remember(alice_scope, memory=text, call=internal_call())
    rows = {row[0]: row for row in lexical_scores(alice_scope, "PROJ-8812 Safari", limit=10)}
    assert rows[both][2] == pytest.approx(1.0)
    assert 0 < rows[one][2] < 0.5  # "safari" is in three memories, the ticket in one: it carries less
    assert rows[both][3] is None  # no vector given, no similarity computed


def test_hybrid_search_scores_are_cosine_plus_coverage(alice_scope, settings):
    settings.SEARCH_NEIGHBOUR_WEIGHT = 0.0  # fusion alone (neighbour context: below)
    target = memory_remember(alice_scope, memory="My flight confirmation code is QX7PLM.", call=internal_call()).id
    for text in DISTRACTORS:
        memory_remember(alice_scope, memory=text, call=internal_call())
    results = hybrid_search(alice_scope, query="QX7PLM", limit=5)
    assert results[0].id == target
    assert 1.0 < results[0].score <= 2.0  # full coverage plus a cosine
    assert all(r.score < 1.0 for r in results[1:])  # no query term: cosine only


def test_score_fusion_never_returns_another_users_memory(alice_scope, bob_scope, fusion):
    memory_remember(bob_scope, memory="Bob's locker code is ZX-99172.", call=internal_call())
    mine = memory_remember(alice_scope, memory="My locker is on the second floor.", call=internal_call()).id
    results = memory_search(alice_scope, query="locker code ZX-99172", top_k=5, call=internal_call())
    assert [r.id for r in results] == [mine]
    assert lexical_scores(alice_scope, "ZX-99172", limit=5) == []


def test_score_fusion_keeps_filters(alice_scope, fusion):
    work = memory_remember(
        alice_scope, memory="Deploy key rotation is ticket OPS-311.", metadata={"area": "work"}, call=internal_call()
    ).id
    memory_remember(
        alice_scope, memory="OPS-311 is also my gym locker number.", metadata={"area": "home"}, call=internal_call()
    )
    results = memory_search(alice_scope, query="OPS-311", top_k=5, filters={"area": "work"}, call=internal_call())
    assert [r.id for r in results] == [work]


def test_bm25_beside_the_embedder_scores_exactly_like_one_after_the_other(alice_scope, bob_scope, settings):
    """SEARCH_LEXICAL_CONCURRENT runs the BM25 side on another connection while the query is
    embedded; its memories get their cosine by id there once the query is embedded. Same ids, same
    scores as the sequential path, with candidates so few that BM25 finds some the vector
    side did not; the other user's matching memory never shows."""
    settings.SEARCH_CANDIDATES = 2
    memory_remember(bob_scope, memory="Bob's Safari login test is flaky too.", call=internal_call())
    for text in DISTRACTORS:
        memory_remember(alice_scope, memory=text, call=internal_call())
    runs = {}
    for concurrent in (False, True):
        settings.SEARCH_LEXICAL_CONCURRENT = concurrent
        runs[concurrent] = [
            [(r.id, round(r.score, 9)) for r in hybrid_search(alice_scope, query=query, limit=6)]
            for query in ("flaky Safari login test", "database errors at night", "laptop battery life")
        ]
    assert runs[True] == runs[False]
    first = runs[True][0]
    assert len(first) > settings.SEARCH_CANDIDATES  # BM25-only memories made it in, with their cosine
    assert all(score < 2.0 for _, score in first)


def test_a_filtered_bm25_counts_its_statistics_over_the_matching_rows_only(alice_scope, bob_scope):
    """A field-filtered BM25 (one read of the matching rows for both the statistics and
    the matching) scores exactly like an unfiltered BM25 over a user who holds only those
    rows: corpus size, mean length and term frequencies are the filtered rows'."""
    tagged = [text for i, text in enumerate(DISTRACTORS) if i % 2 == 0]
    for text in DISTRACTORS:
        fields = {"memory_type": "project"} if text in tagged else None
        memory_remember(alice_scope, memory=text, fields=fields, call=internal_call())
    for text in tagged:
        memory_remember(bob_scope, memory=text, call=internal_call())
    for query in ("production database errors", "laptop battery and Safari", "payments retried on Monday"):
        filtered = lexical_scores(alice_scope, query, limit=10, filters=attrs_containment(memory_type="project"))
        alone = lexical_scores(bob_scope, query, limit=10)
        assert filtered and len(filtered) == len(alone), query
        for ours, expected in zip(filtered, alone, strict=True):
            assert ours[1] == pytest.approx(expected[1], rel=1e-9) and ours[2] == pytest.approx(expected[2], rel=1e-9)


def test_an_embedding_failure_beside_bm25_fails_the_search_and_frees_the_worker(alice_scope, monkeypatch):
    """The BM25 worker waits for the query vector to look up its candidates' cosines; when
    the embedder fails, the search fails with the engine's error instead of waiting forever,
    and the next search finds the worker free."""
    import threading

    from memories.engine import EngineError, retrieval

    for text in DISTRACTORS:
        memory_remember(alice_scope, memory=text, call=internal_call())

    def failing(query: str) -> list[float]:
        raise EngineError("embedder down")

    monkeypatch.setattr(retrieval, "engine_embed_query", failing)
    outcome: list[object] = []

    def search() -> None:
        try:
            hybrid_search(alice_scope, query="laptop battery", limit=3)
        except EngineError as exc:
            outcome.append(exc)

    worker = threading.Thread(target=search)
    worker.start()
    worker.join(20)
    assert not worker.is_alive() and len(outcome) == 1
    monkeypatch.undo()  # the embedder back
    assert hybrid_search(alice_scope, query="laptop battery", limit=3)


# --- Neighbour context (SEARCH_NEIGHBOUR_*) ------------------------------------------------
CONVERSATION = [
    "We adopted a puppy from the shelter last weekend.",
    "His name is Biscuit and he is a beagle.",
    "The kids walk him before school.",
]


def _scores(scope, query: str, **kwargs) -> dict[str, float]:
    return {r.id: r.score for r in hybrid_search(scope, query=query, limit=10, **kwargs)}


def test_a_memory_gains_a_share_of_its_best_neighbours_score(alice_scope, bob_scope, settings):
    """Each candidate gains SEARCH_NEIGHBOUR_WEIGHT x the better score of the user's memories
    stored just before and after it; bob's memory stored in between is nobody's neighbour."""
    first = memory_remember(alice_scope, memory=CONVERSATION[0], call=internal_call()).id
    memory_remember(bob_scope, memory="Bob's puppy Biscuit chews shoes.", call=internal_call())
    middle = memory_remember(alice_scope, memory=CONVERSATION[1], call=internal_call()).id
    last = memory_remember(alice_scope, memory=CONVERSATION[2], call=internal_call()).id
    query = "What is the name of the dog we adopted?"
    settings.SEARCH_NEIGHBOUR_WEIGHT = 0.0
    alone = _scores(alice_scope, query)
    settings.SEARCH_NEIGHBOUR_WEIGHT = 0.3
    together = _scores(alice_scope, query)
    assert set(together) == {first, middle, last}  # never bob's
    assert together[middle] == pytest.approx(alone[middle] + 0.3 * max(alone[first], alone[last]))
    assert together[first] == pytest.approx(alone[first] + 0.3 * alone[middle])  # bob's is not its neighbour
    assert together[last] == pytest.approx(alone[last] + 0.3 * alone[middle])


def test_neighbours_share_agent_and_session_and_are_close_in_time(alice_scope, settings):
    query = "What is the name of the dog we adopted?"
    first = memory_remember(alice_scope, memory=CONVERSATION[0], call=internal_call()).id
    other = memory_remember(alice_scope, memory=CONVERSATION[1], fields={"session_id": "s-2"}, call=internal_call()).id
    last = memory_remember(alice_scope, memory=CONVERSATION[2], call=internal_call()).id
    settings.SEARCH_NEIGHBOUR_WEIGHT = 0.0
    alone = _scores(alice_scope, query)
    settings.SEARCH_NEIGHBOUR_WEIGHT = 0.3
    together = _scores(alice_scope, query)
    assert together[other] == pytest.approx(alone[other])  # another session: no neighbours
    assert together[first] == pytest.approx(alone[first])  # its next memory is the other session's
    assert together[last] == pytest.approx(alone[last])

    settings.SEARCH_NEIGHBOUR_WINDOW_S = 0  # stored microseconds apart: too far
    memory_remember(alice_scope, memory="Biscuit sleeps in the laundry room.", call=internal_call())
    assert _scores(alice_scope, query)[last] == pytest.approx(alone[last])


def test_a_trashed_neighbour_counts_for_nothing_and_filtered_searches_keep_their_scores(alice_scope, settings):
    query = "What is the name of the dog we adopted?"
    ids = [memory_remember(alice_scope, memory=text, call=internal_call()).id for text in CONVERSATION]
    memory_delete(alice_scope, memory_id=ids[0], call=internal_call())  # to the trash
    settings.SEARCH_NEIGHBOUR_WEIGHT = 0.0
    alone = _scores(alice_scope, query)
    settings.SEARCH_NEIGHBOUR_WEIGHT = 0.3
    together = _scores(alice_scope, query)
    assert ids[0] not in together
    assert together[ids[1]] == pytest.approx(alone[ids[1]] + 0.3 * alone[ids[2]])

    filtered = _scores(alice_scope, query, filters=attrs_containment(memory_type="user"))
    assert filtered == {i: pytest.approx(alone[i]) for i in ids[1:]}


def test_neighbour_probes_read_one_row_each_from_the_paging_index(alice_scope):
    """Each probe reads the row next to a memory in the (owner, created_at, id) index. It
    once read every row of a user the table's statistics did not know yet (estimated at one
    row, so the planner took the one-column owner index and sorted): 600 ms a search at
    10,000 memories. That index is gone (migration 0020); the paging index serves the owner."""
    from django.conf import settings
    from django.db import connection, transaction

    from memories.engine import engine_embed_query
    from memories.engine.retrieval import _neighbours

    ids = [memory_remember(alice_scope, memory=text, call=internal_call()).id for text in CONVERSATION]
    statements = []

    def record(execute, sql, params, many, context):
        statements.append((sql, params))
        return execute(sql, params, many, context)

    with connection.execute_wrapper(record):
        found, _ = _neighbours(alice_scope, ids, engine_embed_query("the dog"))
    assert set(found) == set(ids)
    table = settings.MEMORY_COLLECTION
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SELECT indexname FROM pg_indexes WHERE tablename = %s", [table])
        assert f"{table}_user_id_idx" not in {row[0] for row in cursor.fetchall()}
        # The table is tiny here: sequential scans priced out, and sorting too, since a
        # user's few rows found through the index and sorted cost what the index's own order
        # does (a coin toss that autovacuum's statistics decide). A Sort then shows only
        # where the paging index cannot give the probe its row.
        cursor.execute("SET LOCAL enable_seqscan = off")
        cursor.execute("SET LOCAL enable_sort = off")

        sql, params = statements[-1]
        cursor.execute("EXPLAIN " + sql, params)
        plan = "\n".join(row[0] for row in cursor.fetchall())
        transaction.set_rollback(True)
    assert f"{table}_user_created_idx" in plan and "Sort" not in plan, plan


def test_a_memory_sharing_a_word_but_not_the_meaning_does_not_outrank_the_paraphrase(alice_scope, settings):
    """One person of the eval's paraphrase set: their ten facts among the set's distractors,
    which share words with the questions but answer none. "work" is in two distractors
    unrelated in meaning ("Friday deploys are banned at work.", cosine 0.11), not in the
    answer; without the gate both outranked it."""
    settings.SEARCH_FUSION = "score"
    settings.RATE_LIMITS = {**settings.RATE_LIMITS, "remember": (0, 60)}  # 106 memories in a row
    rows = [json.loads(line) for line in PARAPHRASE.read_text().splitlines() if line.strip()]
    facts = {
        row["query"]: memory_remember(alice_scope, memory=row["memory"], call=internal_call()).id
        for row in rows
        if row.get("user") == "femi" and row.get("query")
    }
    for row in rows:
        if not row.get("query"):
            memory_remember(alice_scope, memory=row["memory"], call=internal_call())
    query = "Where in the hospital do I work at the moment?"
    found = memory_search(alice_scope, query=query, top_k=5, call=internal_call())
    assert facts[query] in [r.id for r in found]
