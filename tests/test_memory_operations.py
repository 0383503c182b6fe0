"""remember's dedupe, update/delete under concurrency, clear_all, list paging, search decay."""

import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.db import connections

from core.errors import ErrorCode, ServiceError
from memories import engine
from memories.engine.retrieval import hybrid_search
from memories.models import ContentHash
from memories.services import (
    memory_clear_all,
    memory_delete,
    memory_list,
    memory_remember,
    memory_search,
    memory_update,
)
from tests.conftest import age_memory, internal_call
from tests.engine_helpers import engine_history, memory_gone

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]


def _codes(fn) -> str | None:
    try:
        fn()
    except ServiceError as exc:
        return exc.code.value
    return None


# --- remember -------------------------------------------------------------------------------
def test_remember_twice_stores_once(alice_scope):
    first = memory_remember(alice_scope, memory="I take my coffee black", call=internal_call())
    second = memory_remember(alice_scope, memory="  i take my   COFFEE black ", call=internal_call())
    assert (first.duplicate, second.duplicate) == (False, True)
    assert second.id == first.id
    assert len(memory_list(alice_scope, call=internal_call()).memories) == 1


def test_remember_after_the_memory_vanished_behind_the_hash(alice_scope):
    first = memory_remember(alice_scope, memory="My bike is a green Brompton", call=internal_call())
    engine.engine_delete(first.id)  # gone from the engine, hash row left behind
    again = memory_remember(alice_scope, memory="My bike is a green Brompton", call=internal_call())
    assert again.duplicate is False and again.id != first.id
    assert engine.engine_get(again.id).text == "My bike is a green Brompton"
    assert list(ContentHash.objects.values_list("memory_id", flat=True)) == [uuid.UUID(again.id)]


def test_concurrent_identical_remembers_store_one(alice_scope):
    with ThreadPoolExecutor(8) as pool:
        results = list(
            pool.map(
                lambda _: _in_thread(memory_remember, alice_scope, memory="Same fact", call=internal_call()), range(8)
            )
        )
    assert len({r.id for r in results}) == 1
    assert sum(not r.duplicate for r in results) == 1


def test_delete_then_remember_again(alice_scope):
    first = memory_remember(alice_scope, memory="I am learning Finnish", call=internal_call())
    memory_delete(alice_scope, memory_id=first.id, call=internal_call())
    assert memory_remember(alice_scope, memory="I am learning Finnish", call=internal_call()).duplicate is False


def _in_thread(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    finally:
        connections.close_all()


# --- update / delete --------------------------------------------------------------------
def test_twenty_concurrent_updates(alice_scope):
    memory_id = memory_remember(
        alice_scope, memory="Version zero", pinned=True, metadata={"topic": "t"}, call=internal_call()
    ).id
    texts = [f"Version {i}" for i in range(1, 21)]
    start = threading.Barrier(20)

    def update(text):
        start.wait()
        return _codes(
            lambda: _in_thread(memory_update, alice_scope, memory_id=memory_id, memory=text, call=internal_call())
        )

    with ThreadPoolExecutor(20) as pool:
        errors = list(pool.map(update, texts))

    assert set(errors) <= {None, "conflict"}
    final = engine.engine_get(memory_id)
    assert final.text in texts
    assert final.metadata["pinned"] is True and final.metadata["topic"] == "t"
    updates = engine_history(memory_id)
    assert len([h for h in updates if h["event"] == "UPDATE"]) == errors.count(None)


def test_concurrent_delete_and_update_never_resurrects(alice_scope):
    for round_ in range(5):
        memory_id = memory_remember(alice_scope, memory=f"Ephemeral fact {round_}", call=internal_call()).id
        start = threading.Barrier(2)

        def delete(memory_id=memory_id, start=start):
            start.wait()
            return _codes(lambda: _in_thread(memory_delete, alice_scope, memory_id=memory_id, call=internal_call()))

        def update(memory_id=memory_id, start=start):
            start.wait()
            return _codes(
                lambda: _in_thread(
                    memory_update, alice_scope, memory_id=memory_id, memory="Revived?", call=internal_call()
                )
            )

        with ThreadPoolExecutor(2) as pool:
            deleted, updated = pool.submit(delete), pool.submit(update)
            delete_code, update_code = deleted.result(), updated.result()

        assert delete_code is None
        assert update_code in (None, "not_found")
        assert memory_gone(memory_id)


def test_update_merges_metadata_and_pin(alice_scope):
    memory_id = memory_remember(
        alice_scope, memory="I run on Tuesdays", metadata={"a": 1, "b": "x"}, call=internal_call()
    ).id
    view = memory_update(alice_scope, memory_id=memory_id, metadata={"b": "y", "c": True}, call=internal_call())
    assert view.metadata == {"a": 1, "b": "y", "c": True} and view.pinned is False
    view = memory_update(alice_scope, memory_id=memory_id, pinned=True, call=internal_call())
    assert view.pinned is True and view.metadata == {"a": 1, "b": "y", "c": True}
    view = memory_update(alice_scope, memory_id=memory_id, memory="I run on Thursdays", call=internal_call())
    assert (view.memory, view.pinned, view.metadata) == ("I run on Thursdays", True, {"a": 1, "b": "y", "c": True})
    # The hash follows the text: the new text dedupes, the old one is free again.
    assert memory_remember(alice_scope, memory="I run on Thursdays", call=internal_call()).duplicate is True
    assert memory_remember(alice_scope, memory="I run on Tuesdays", call=internal_call()).duplicate is False


def test_update_and_delete_of_missing_ids(alice_scope):
    missing = str(uuid.uuid4())
    assert (
        _codes(lambda: memory_update(alice_scope, memory_id=missing, memory="x", call=internal_call())) == "not_found"
    )
    assert _codes(lambda: memory_delete(alice_scope, memory_id=missing, call=internal_call())) == "not_found"


# --- list -------------------------------------------------------------------------------
def test_paging_reaches_every_memory_exactly_once(alice_scope, bob_scope):
    ids = {memory_remember(alice_scope, memory=f"Fact number {i}", call=internal_call()).id for i in range(23)}
    memory_remember(bob_scope, memory="Bob's own fact", call=internal_call())
    seen, cursor, pages = [], None, 0
    while True:
        page = memory_list(alice_scope, cursor=cursor, page_size=5, call=internal_call())
        seen += [m.id for m in page.memories]
        pages += 1
        if pages == 2:  # a memory added mid-way lands on a later page, nothing repeats
            ids.add(memory_remember(alice_scope, memory="Added while paging", call=internal_call()).id)
        if not page.next_cursor:
            break
        cursor = page.next_cursor
    assert len(seen) == len(set(seen)) == len(ids)
    assert set(seen) == ids


def test_list_filters_and_bad_cursor(alice_scope):
    pinned = memory_remember(alice_scope, memory="Pinned fact", pinned=True, call=internal_call()).id
    memory_remember(alice_scope, memory="Loose fact", metadata={"topic": "misc"}, call=internal_call())
    assert [m.id for m in memory_list(alice_scope, filters={"pinned": True}, call=internal_call()).memories] == [pinned]
    assert [m.memory for m in memory_list(alice_scope, filters={"topic": "misc"}, call=internal_call()).memories] == [
        "Loose fact"
    ]
    assert _codes(lambda: memory_list(alice_scope, cursor="garbage!!", call=internal_call())) == "invalid_argument"


# --- search -----------------------------------------------------------------------------
def test_recency_decay_and_pinned_results(alice_scope):
    old = memory_remember(alice_scope, memory="My favourite food is ramen", call=internal_call()).id
    new = memory_remember(alice_scope, memory="My favourite food is pho", call=internal_call()).id
    age_memory(old, 120)  # four half-lives: 0.5 + 0.5/16 of its score (the floor keeps half)
    results = memory_search(alice_scope, query="What is my favourite food?", top_k=2, call=internal_call())
    assert [r.id for r in results] == [new, old]
    raw = {r.id: r.score for r in hybrid_search(alice_scope, query="What is my favourite food?", limit=6)}
    assert results[1].score == pytest.approx(raw[old] * (0.5 + 0.5 / 16), rel=1e-3)

    memory_update(alice_scope, memory_id=old, pinned=True, call=internal_call())
    age_memory(old, 120)
    results = memory_search(alice_scope, query="favourite food ramen", top_k=2, call=internal_call())
    assert results[0].id == old and results[0].pinned is True
    raw = hybrid_search(alice_scope, query="favourite food ramen", limit=6)
    assert results[0].score == pytest.approx(next(r.score for r in raw if r.id == old), abs=1e-6)


def test_search_filters(alice_scope):
    memory_remember(alice_scope, memory="Work laptop is a ThinkPad", metadata={"area": "work"}, call=internal_call())
    home = memory_remember(
        alice_scope, memory="Home laptop is a MacBook", metadata={"area": "home"}, call=internal_call()
    ).id
    results = memory_search(alice_scope, query="laptop", top_k=5, filters={"area": "home"}, call=internal_call())
    assert [r.id for r in results] == [home]


# --- clear all ------------------------------------------------------------------------------
def test_clear_all_needs_confirmation_and_is_limited(alice_scope):
    memory_remember(alice_scope, memory="Something to clear", call=internal_call())
    assert _codes(lambda: memory_clear_all(alice_scope, confirm=False, call=internal_call())) == "confirmation_required"
    assert len(memory_list(alice_scope, call=internal_call()).memories) == 1
    assert memory_clear_all(alice_scope, confirm=True, call=internal_call()) == 1
    for _ in range(4):
        memory_clear_all(alice_scope, confirm=True, call=internal_call())
    with pytest.raises(ServiceError) as excinfo:
        memory_clear_all(alice_scope, confirm=True, call=internal_call())
    assert excinfo.value.code == ErrorCode.RATE_LIMITED
    assert 0 < excinfo.value.retry_after_s <= 3600
    assert memory_list(alice_scope, call=internal_call()).memories == []
    assert ContentHash.objects.count() == 0
