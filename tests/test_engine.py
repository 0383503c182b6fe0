"""The engine: real mem0 `Memory`, real pgvector, the offline MiniLM embedder."""

import pytest
from django.conf import settings
from django.db import connection

from audit.models import MemoryHistory
from memories import engine
from memories.engine.history_store import PostgresHistoryStore
from memories.models import EngineMessage
from tests.engine_helpers import engine_history, engine_search

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]

FACTS = [
    "I am allergic to peanuts and carry an epipen",
    "My daughter Mia starts school in September",
    "The production database runs PostgreSQL 16 on Hetzner",
    "I prefer window seats on long flights",
    "Our team standup is at 9:30 every weekday",
    "My favourite band is Radiohead",
    "The wifi password at the cabin is on the fridge",
    "I am training for the Lisbon marathon in October",
]


def test_remember_then_search_returns_the_stored_text_first(alice_scope):
    ids = {engine.engine_add_text(alice_scope, text=fact): fact for fact in FACTS}
    for memory_id, fact in ids.items():
        results = engine_search(alice_scope, query=fact, top_k=5)
        assert results, fact
        assert results[0].id == memory_id
        assert results[0].text == fact
        assert results[0].user_id == alice_scope.engine_user_id


def test_search_is_partitioned_by_user(alice_scope, bob_scope):
    engine.engine_add_text(alice_scope, text="Alice keeps bees on the roof")
    assert engine_search(bob_scope, query="Alice keeps bees on the roof", top_k=5) == []


def test_update_keeps_metadata_and_history_lives_in_postgres(alice_scope):
    memory_id = engine.engine_add_text(alice_scope, text="I drive a red Fiat", metadata={"pinned": True, "source": "t"})
    engine.engine_update(memory_id, text="I drive a blue Volvo", metadata=None)

    stored = engine.engine_get(memory_id)
    assert stored.text == "I drive a blue Volvo"
    assert stored.metadata == {"pinned": True, "source": "t"}

    events = list(
        MemoryHistory.objects.filter(memory_id=memory_id).order_by("recorded_at").values_list("event", "new_memory")
    )
    assert events == [("ADD", "I drive a red Fiat"), ("UPDATE", "I drive a blue Volvo")]

    engine.engine_delete(memory_id)
    assert engine.engine_get(memory_id) is None
    assert [h["event"] for h in engine_history(memory_id)] == ["ADD", "UPDATE", "DELETE"]


def test_raw_messages_are_kept_per_scope_and_purged_with_the_user(alice_scope, bob_scope):
    store = PostgresHistoryStore()
    alice_session = f"user_id={alice_scope.engine_user_id}"
    for i in range(12):
        store.save_messages([{"role": "user", "content": f"alice says {i}"}], alice_session)
    store.save_messages([{"role": "user", "content": "bob says hi"}], f"user_id={bob_scope.engine_user_id}")

    last = store.get_last_messages(alice_session)
    assert [m["content"] for m in last] == [f"alice says {i}" for i in range(2, 12)]

    engine.engine_add_text(alice_scope, text="Alice likes tea")
    engine.engine_purge_user(alice_scope)

    assert store.get_last_messages(alice_session) == []
    assert EngineMessage.objects.filter(user_id=bob_scope.engine_user_id).count() == 1
    assert engine_search(alice_scope, query="Alice likes tea", top_k=5) == []


def test_vector_table_is_exact_scan_with_a_user_index():
    with connection.cursor() as cursor:
        cursor.execute("SELECT indexname, indexdef FROM pg_indexes WHERE tablename = %s", [settings.MEMORY_COLLECTION])
        indexes = dict(cursor.fetchall())
    # One vector index, ours (the adaptive plan's index path for large users); none of mem0's.
    vector_indexes = {name for name, d in indexes.items() if "hnsw" in d or "ivfflat" in d}
    assert vector_indexes == {f"{settings.MEMORY_COLLECTION}_vector_hnsw_idx"}, indexes
    assert any("(payload ->> 'user_id'::text)" in d and "btree" in d for d in indexes.values()), indexes


def test_ingest_without_llm_is_refused_before_the_engine_runs(alice_scope):
    with pytest.raises(engine.LlmUnavailable):
        engine.engine_ingest(alice_scope, messages=[{"role": "user", "content": "I moved to Oslo"}])
    assert engine_search(alice_scope, query="Oslo", top_k=5) == []


def test_engine_failures_become_engine_error(alice_scope):
    with pytest.raises(engine.EngineError):
        engine.engine_get("not-a-uuid")


def test_ping():
    engine.engine_ping()


def test_memories_are_stored_without_mem0s_keyword_lemmas_which_nothing_reads(alice_scope):
    """mem0's lemmas served its own keyword search, which the engine never runs (hybrid
    search reads the `fts` column): new rows skip them, an update drops an older row's
    copy, and their index is gone."""
    from memories.services import memory_remember, memory_search, memory_update
    from tests.conftest import internal_call

    table = settings.MEMORY_COLLECTION
    with connection.cursor() as cursor:
        cursor.execute("SELECT indexdef FROM pg_indexes WHERE tablename = %s", [table])
        assert not [d for (d,) in cursor.fetchall() if "text_lemmatized" in d]
    memory_id = memory_remember(alice_scope, memory="I am training for the Lisbon marathon", call=internal_call()).id
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT payload ? 'text_lemmatized' FROM {table} WHERE id = %s", [memory_id])  # noqa: S608
        assert cursor.fetchone() == (False,)
        # A row stored before migration 0022 carries them.
        cursor.execute(
            f'UPDATE {table} SET payload = payload || \'{{"text_lemmatized": "train lisbon marathon"}}\' WHERE id = %s',  # noqa: S608
            [memory_id],
        )
    memory_update(alice_scope, memory_id=memory_id, memory="I am training for the Porto marathon", call=internal_call())
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT payload ? 'text_lemmatized', payload->>'data' FROM {table} WHERE id = %s", [memory_id])  # noqa: S608
        assert cursor.fetchone() == (False, "I am training for the Porto marathon")
    found = memory_search(alice_scope, query="Porto marathon", top_k=1, call=internal_call())
    assert [m.id for m in found] == [memory_id]


def test_a_written_vector_literal_is_short_for_float4s_and_stores_the_same_vector():
    """The write path's vector text: 9 digits per float when every float is a float4
    already (the embedder's), repr otherwise; Postgres stores the same float4s either way."""
    import numpy

    from memories.engine.vector_schema import vector_text_stored as _vector_literal

    rng = numpy.random.default_rng(19)
    float4s = rng.standard_normal(384).astype(numpy.float32)
    as_embedded = (float4s / numpy.linalg.norm(float4s)).tolist()  # doubles holding float4s
    float8s = rng.standard_normal(384).tolist()  # e.g. a remote embedder's JSON floats
    short, full = _vector_literal(as_embedded), _vector_literal(float8s)
    assert all(len(x.lstrip("-").replace(".", "").split("e")[0].lstrip("0")) <= 9 for x in short[1:-1].split(","))
    assert full == "[" + ",".join(repr(x) for x in float8s) + "]"
    with connection.cursor() as cursor:
        for vector, literal in ((as_embedded, short), (float8s, full)):
            reference = "[" + ",".join(repr(x) for x in vector) + "]"
            cursor.execute("SELECT %s::vector::text = %s::vector::text", [literal, reference])
            assert cursor.fetchone()[0]
        cursor.execute("SELECT %s::vector::text", [short])
        stored = numpy.array(cursor.fetchone()[0].strip("[]").split(","), dtype=numpy.float32)
    assert (stored == numpy.asarray(as_embedded, dtype=numpy.float32)).all()
