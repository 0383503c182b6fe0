import numpy as np
import pytest

from memories.engine import embedder


@pytest.fixture(scope="module")
def minilm():
    return embedder.MiniLMEmbedder()


def test_vectors_are_normalised_and_384_dims(minilm):
    vectors = minilm.encode(["hello world", "a much longer sentence " * 100])
    assert vectors.shape == (2, 384)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-4)


def test_paraphrases_are_closer_than_unrelated_text(minilm):
    a, b, c = minilm.encode(["The cat sat on the mat", "A cat was sitting on a rug", "Quarterly revenue grew"])
    assert float(a @ b) > float(a @ c) + 0.3


def test_batch_and_single_agree(minilm):
    single = minilm.embed("Otis is a corgi")
    batch = minilm.embed_batch(["Otis is a corgi", "something else entirely"])[0]
    assert np.allclose(single, batch, atol=1e-5)


def test_tampered_files_are_refused(tmp_path, monkeypatch):
    fake = tmp_path / "model.onnx"
    fake.write_bytes(b"not the model")
    monkeypatch.setattr(embedder, "_model_path", lambda: fake)
    with pytest.raises(embedder.EmbedderAssetError, match="sha256"):
        embedder.MiniLMEmbedder()


def _fp32_reference_session():
    """The pinned model as published: int8 weights widened to fp32 at load."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    return onnxruntime.InferenceSession(str(embedder._model_path()), sess_options=options)


def test_int8_kernels_follow_the_published_model(minilm, monkeypatch):
    texts = [
        "what did my friend Tom do about the piano lessons?",
        "I'm vegan and I cook for my sister on Sundays",
        "Where did we go skiing last winter?",
        "a much longer sentence about quarterly planning " * 20,
    ]
    fast = minilm.encode(texts)
    monkeypatch.setattr(minilm, "_session", _fp32_reference_session())
    published = minilm.encode(texts)
    assert (fast * published).sum(axis=1).min() >= 0.9995


def test_every_weight_product_is_moved_and_a_different_model_refused():
    rewritten = embedder._with_int8_matmuls(embedder._model_path().read_bytes())
    assert rewritten.count(b"MatMulNBits") == embedder.INT8_WEIGHT_PRODUCTS
    with pytest.raises(embedder.EmbedderAssetError, match="0 int8 weight products"):
        embedder._with_int8_matmuls(rewritten)


def _counted(minilm):
    calls: list[str] = []

    def embed(text, memory_action=None):
        calls.append(text)
        return minilm.embed(text, memory_action)

    return embed, calls


def test_a_repeated_text_is_embedded_once_and_each_caller_gets_its_own_list(minilm):
    from memories.engine.embedders import embed_cached

    embed, calls = _counted(minilm)
    cached = embed_cached(embed, size=8)
    first = cached("Otis is a corgi", "search")
    first[0] = 99.0  # a caller's edit stays in its own list
    again = cached("Otis is a corgi", "search")
    assert calls == ["Otis is a corgi"]
    assert np.allclose(again, minilm.embed("Otis is a corgi"), atol=1e-6) and again[0] != 99.0
    cached("Otis is a corgi", "add")  # another action is another vector (Gemini's task types)
    assert calls == ["Otis is a corgi"] * 2


def test_the_least_recently_used_vector_goes_first_and_size_zero_keeps_none(minilm):
    from memories.engine.embedders import embed_cached, embed_caches_clear

    embed, calls = _counted(minilm)
    cached = embed_cached(embed, size=2)
    cached("a")
    cached("b")
    cached("a")  # "b" is now the oldest
    cached("c")
    cached("a")
    assert calls == ["a", "b", "c"]
    cached("b")
    assert calls == ["a", "b", "c", "b"]
    embed_caches_clear()
    cached("a")
    assert calls[-1] == "a"
    assert embed_cached(embed, size=0) is embed


def test_no_vector_is_kept_longer_than_its_ttl_even_unasked(minilm):
    """The bound on how long a vector of an erased text stays in a process: expired ones
    are not served, and the next call (of any text) sweeps them all out."""
    from memories.engine.embedders import _vector_caches, embed_cached

    now = [1000.0]
    embed, calls = _counted(minilm)
    cached = embed_cached(embed, size=8, ttl_s=60, clock=lambda: now[0])
    (cache,) = [c for c in _vector_caches if c.clock() == 1000.0 and c.ttl_s == 60]
    cached("erased later")
    cached("kept")
    now[0] += 30
    cached("kept")  # a hit does not make it younger
    cached("fresh")
    assert calls == ["erased later", "kept", "fresh"]
    now[0] += 31  # "erased later" and "kept" are 61 s old, "fresh" 31 s
    cached("fresh")  # a hit, and the sweep of everything expired
    assert calls == ["erased later", "kept", "fresh"] and len(cache.vectors) == 1
    cached("kept")
    assert calls[-1] == "kept"
    assert embed_cached(embed, size=8, ttl_s=0) is embed


def test_an_idle_process_drops_expired_vectors_too(minilm, monkeypatch):
    """No call after the erasure: the cache's own sweeper drops them, then stops."""
    import time

    from memories.engine.embedders import _VectorCache, embed_cached

    monkeypatch.setattr(_VectorCache, "IDLE_SWEEP_S", 0.05)
    now = [5000.0]
    embed, _ = _counted(minilm)
    cached = embed_cached(embed, size=8, ttl_s=60, clock=lambda: now[0])
    cached("erased later")
    (cache,) = [c for c in _vector_caches_now() if c.clock() == 5000.0]
    sweeper = cache.sweeper
    assert sweeper is not None and sweeper.is_alive() and len(cache.vectors) == 1
    now[0] += 61  # expired; nothing embeds in this process any more
    deadline = time.monotonic() + 10
    while (cache.vectors or sweeper.is_alive()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not cache.vectors and not sweeper.is_alive() and cache.sweeper is None


def _vector_caches_now() -> list:
    from memories.engine.embedders import _vector_caches

    return list(_vector_caches)


@pytest.mark.django_db
def test_the_engines_embedder_runs_once_for_a_repeated_query(settings):
    """Through the instrumented engine embedder: a repeat is neither embedded nor timed."""
    from prometheus_client import REGISTRY

    from memories.engine import engine_embed_query

    def embedded() -> float:
        labels = {"embedder": "local", "kind": "one"}
        return REGISTRY.get_sample_value("memsite_embed_duration_seconds_count", labels) or 0.0

    before = embedded()
    first = engine_embed_query("where does Otis sleep?")
    assert engine_embed_query("where does Otis sleep?") == first
    assert embedded() - before == 1
