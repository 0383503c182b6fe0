"""mem0's ingest across `manage.py reembed`'s switch: the facts it embeds after its LLM
call are stored with the table's embedder, and a process that served ingests keeps
embedding with the table's embedder after a later switch."""

from __future__ import annotations

import threading

import pytest

from memories.engine import embedders, engine_embed_text
from memories.reembed import embedder_reembed, embedder_target
from memories.services import memory_ingest, memory_remember
from tests.conftest import InThread, internal_call
from tests.test_engine_rest_review20 import TURN, _cos, _stored_vector

# `llm` rebuilds the engine around this test's settings (and again after): with the fake
# Gemini's key set, Gemini is the ingest's model too, so its queue answers.
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors", "llm")]

GEMINI_SAME_DIMS = {"name": "gemini", "dims": 384}  # the silent case: the old vectors would fit


def test_an_ingest_racing_the_switch_stores_the_new_models_vectors(alice_scope, fake_gemini, monkeypatch):
    """The ingest embeds its fact with the old model (local:384) and is held; the
    re-embedding runs to its switch (gemini:384); then mem0 inserts the fact."""
    monkeypatch.setitem(embedders._cache, "embedders", {})
    memory_remember(alice_scope, memory="Alice's hobby is sailing", call=internal_call())
    fact = "Alice keeps bees on her roof"
    fake_gemini.queue_facts(fact)
    embedded, go = threading.Event(), threading.Event()
    captured = {}
    original = embedders.ActiveEmbedder.embed_batch

    def held(self, texts, memory_action="add"):
        vectors = original(self, texts, memory_action)
        if memory_action == "add" and not embedded.is_set():
            captured["old"] = vectors[0]
            embedded.set()
            assert go.wait(120)
        return vectors

    monkeypatch.setattr(embedders.ActiveEmbedder, "embed_batch", held)
    ingesting = InThread(lambda: memory_ingest(alice_scope, messages=TURN, call=internal_call()))
    try:
        assert embedded.wait(60)
        assert embedder_reembed(target=embedder_target(**GEMINI_SAME_DIMS), batch=16).active == "gemini:384"
    finally:
        go.set()
    added = ingesting.result()
    assert [a["memory"] for a in added] == [fact]
    stored = _stored_vector(added[0]["id"])
    expected = engine_embed_text(fact)
    assert expected.spec.label == "gemini:384"
    assert _cos(stored, captured["old"]) < 0.99
    assert _cos(stored, expected.vector) > 0.99, "the row holds the old embedder's vector"


def test_after_an_ingest_and_two_switches_writes_use_the_tables_embedder(alice_scope, fake_gemini, monkeypatch):
    """The engine once pointed mem0's embedder at the active one at each ingest, and answered
    the configured spec with it: switched to Gemini, an ingest, switched back to the
    configured local model, and this process embedded with Gemini as if it were local."""
    monkeypatch.setitem(embedders._cache, "embedders", {})
    text = "Alice's hobby is knitting"
    local_vector = engine_embed_text(text).vector
    memory_remember(alice_scope, memory="Alice's hobby is sailing", call=internal_call())
    assert embedder_reembed(target=embedder_target(**GEMINI_SAME_DIMS), batch=16).active == "gemini:384"
    fake_gemini.queue_facts("Alice keeps bees on her roof")
    assert memory_ingest(alice_scope, messages=TURN, call=internal_call())
    assert embedder_reembed(target=embedder_target(name="local", dims=384), batch=16).active == "local:384"
    stored = _stored_vector(memory_remember(alice_scope, memory=text, call=internal_call()).id)
    assert _cos(stored, local_vector) > 0.99, "a local-labelled row holds another model's vector"
