"""Which embedder the engine uses, per process, as the database says (issue 17).

The vectors in the engine's table were made by one embedder; queries and new rows must
use the same one. `manage.py reembed` switches it online: every process reads the
active embedder from `EmbedderState` (no row: the configured EMBEDDER), cached for
`ACTIVE_TTL_S`, so a switch takes effect everywhere without a restart. A call that
raced the switch (query embedded with the old embedder, table already on the new one)
fails with a dimension mismatch; `embedder_spec_refresh` drops the cache so its retry
uses the new one."""

from __future__ import annotations

import hashlib
import os
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
from django.conf import settings

ACTIVE_TTL_S = 1.0


@dataclass(frozen=True)
class EmbedderSpec:
    name: str  # local | gemini
    dims: int

    @property
    def label(self) -> str:
        return f"{self.name}:{self.dims}"

    @property
    def normalised(self) -> bool:
        """MiniLM vectors are unit length: inner product (<#>) ranks like cosine, faster."""
        return self.name == "local"


def embedder_spec_configured() -> EmbedderSpec:
    return EmbedderSpec(settings.EMBEDDER, int(settings.EMBEDDING_DIMS))


_lock = threading.Lock()
_cache: dict[str, Any] = {"pid": None, "spec": None, "at": 0.0, "embedders": {}}


def _fresh() -> None:
    if _cache["pid"] != os.getpid():  # after a fork: nothing inherited
        _cache.update(pid=os.getpid(), spec=None, at=0.0, embedders={})


def embedder_spec_active() -> EmbedderSpec:
    """The embedder whose vectors the table holds now: the database's record (cached for
    ACTIVE_TTL_S) or, with none, the configured one (read afresh: settings may change)."""
    from memories.models import EmbedderState

    with _lock:
        _fresh()
        cached = _cache["at"] and time.monotonic() - _cache["at"] < ACTIVE_TTL_S
        recorded: EmbedderSpec | None = _cache["spec"]
    if not cached:
        row = EmbedderState.objects.filter(pk=1).values_list("name", "dims").first()
        recorded = EmbedderSpec(row[0], int(row[1])) if row else None
        with _lock:
            _cache.update(spec=recorded, at=time.monotonic())
    return recorded or embedder_spec_configured()


def embedder_spec_refresh() -> None:
    with _lock:
        _cache.update(spec=None, at=0.0)


def embedder_instances_clear() -> None:
    """Forget the embedders made for specs other than the configured one, so the next call
    makes them again from the current settings (their clients keep the endpoint and key
    they were made with: tests start a fake Gemini on a new port each time)."""
    with _lock:
        _cache["embedders"].clear()


def embedder_for(spec: EmbedderSpec) -> Any:
    """An embedder making `spec`'s vectors (mem0's interface: embed, embed_batch); one
    instance per process and spec. The configured one is mem0's own."""
    from memories.engine.mem0_adapter import _embedder_instrument, get_memory

    if spec == embedder_spec_configured():
        return get_memory().embedding_model.configured
    with _lock:
        _fresh()
        embedder = _cache["embedders"].get(spec)
    if embedder is not None:
        return embedder
    if spec.name == "local":
        from memories.engine.embedder import MiniLMEmbedder

        embedder = MiniLMEmbedder()
    else:
        get_memory()  # sets mem0's environment (telemetry off) before mem0 is imported
        from mem0.configs.embeddings.base import BaseEmbedderConfig
        from mem0.embeddings.gemini import GoogleGenAIEmbedding

        from memories.engine.mem0_adapter import gemini_client_bounded

        embedder = GoogleGenAIEmbedding(
            BaseEmbedderConfig(
                model=settings.GEMINI_EMBEDDING_MODEL, api_key=settings.GOOGLE_API_KEY, embedding_dims=spec.dims
            )
        )
        embedder.client = gemini_client_bounded(total_s=settings.EMBEDDER_TIMEOUT_S, retries=0)
    _embedder_instrument(embedder, name=spec.name)
    with _lock:
        _cache["embedders"][spec] = embedder
    return embedder


def embedder_active() -> Any:
    return embedder_for(embedder_spec_active())


# The specs that made this thread's "add" vectors since its last mem0 insert.
_added_with = threading.local()


def added_specs_take() -> set[EmbedderSpec]:
    """The embedders that made the vectors mem0 is about to insert on this thread (and
    forget them): `writes.mem0_inserts_checked` compares them with the table's."""
    specs: set[EmbedderSpec] = getattr(_added_with, "specs", None) or set()
    _added_with.specs = set()
    return specs


def _added_spec_note(spec: EmbedderSpec, memory_action: str | None) -> None:
    if memory_action in ("add", "update"):
        specs = getattr(_added_with, "specs", None)
        if specs is None:
            specs = _added_with.specs = set()
        specs.add(spec)


class ActiveEmbedder:
    """What mem0 calls as `Memory.embedding_model` (its ingest; `engine_add_text`): the
    embedder of the table's vectors now, asked at each call, so the process's one shared
    `Memory` never holds a per-call choice (threads would race on it, and it would outlive
    the next switch). Each "add" embedding notes its spec on this thread for the insert
    that follows, which checks it under the table's write lock
    (`writes.mem0_inserts_checked`): an ingest embeds its facts after its LLM call,
    seconds after it began."""

    def __init__(self, configured: Any) -> None:
        self.configured = configured  # mem0's own embedder, for the configured spec

    @property
    def config(self) -> Any:
        return self.configured.config

    def embed(self, text: str, memory_action: str | None = None) -> list[float]:
        spec = embedder_spec_active()
        _added_spec_note(spec, memory_action)
        return cast(list[float], embedder_for(spec).embed(text, memory_action))

    def embed_batch(self, texts: list[str], memory_action: str = "add") -> list[list[float]]:
        spec = embedder_spec_active()
        _added_spec_note(spec, memory_action)
        return embed_batch_with(embedder_for(spec), texts, memory_action)


def embed_batch_with(embedder: Any, texts: list[str], memory_action: str | None) -> list[list[float]]:
    """`texts` embedded by `embedder`: its batch call when it has one."""
    if hasattr(embedder, "embed_batch"):
        return cast(list[list[float]], embedder.embed_batch(texts, memory_action))
    return [cast(list[float], embedder.embed(text, memory_action)) for text in texts]


class _VectorCache:
    """The last `size` vectors by key, least recently used out first, none older than
    `ttl_s` (counted from when it was embedded): a vector of a text that has since been
    erased leaves this process's memory within that time, plus IDLE_SWEEP_S for a process
    that embeds nothing meanwhile (a daemon thread sweeps while the cache holds vectors)."""

    SWEEP_EVERY_S = 1.0
    IDLE_SWEEP_S = 60.0

    def __init__(self, size: int, *, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.size = size
        self.ttl_s = ttl_s
        self.clock = clock
        self.vectors: OrderedDict[tuple[bytes, str | None], tuple[float, np.ndarray]] = OrderedDict()
        self.lock = threading.Lock()
        self.swept_at = clock()
        self.sweeper: threading.Thread | None = None

    def _sweep(self, now: float) -> None:
        # At most once a second: a pass over the entries (~2048) is about a tenth of a millisecond.
        if now - self.swept_at < self.SWEEP_EVERY_S:
            return
        self.swept_at = now
        for key in [k for k, (stored_at, _) in self.vectors.items() if now - stored_at >= self.ttl_s]:
            del self.vectors[key]

    def get(self, key: tuple[bytes, str | None]) -> list[float] | None:
        now = self.clock()
        with self.lock:
            self._sweep(now)
            hit = self.vectors.get(key)
            if hit is None:
                return None
            if now - hit[0] >= self.ttl_s:
                del self.vectors[key]
                return None
            self.vectors.move_to_end(key)
        return cast(list[float], hit[1].tolist())

    def put(self, key: tuple[bytes, str | None], vector: list[float]) -> None:
        now = self.clock()
        with self.lock:
            self._sweep(now)
            self.vectors[key] = (now, np.asarray(vector, dtype=np.float32))
            self.vectors.move_to_end(key)
            if len(self.vectors) > self.size:
                self.vectors.popitem(last=False)
            if self.sweeper is None or not self.sweeper.is_alive():  # none yet, or not in this (forked) process
                self.sweeper = threading.Thread(
                    target=_idle_sweep, args=(weakref.ref(self),), name="memsite-vector-sweep", daemon=True
                )
                self.sweeper.start()

    def sweep_idle(self) -> bool:
        """Drop every expired vector now; whether any are left (the sweeper stops when none are)."""
        with self.lock:
            self.swept_at = float("-inf")
            self._sweep(self.clock())
            if not self.vectors:
                self.sweeper = None
            return bool(self.vectors)

    def clear(self) -> None:
        with self.lock:
            self.vectors.clear()


def _idle_sweep(cache_ref: weakref.ReferenceType[_VectorCache]) -> None:
    """Sweeps one cache every IDLE_SWEEP_S while it holds vectors; ends with the cache (a
    weak reference: an engine rebuilt drops it) or when it is empty (the next put starts
    another)."""
    while True:
        cache = cache_ref()
        if cache is None:
            return
        interval = cache.IDLE_SWEEP_S
        del cache
        time.sleep(interval)
        cache = cache_ref()
        if cache is None or not cache.sweep_idle():
            return
        del cache


# Weak: an engine rebuilt (after a fork, in tests) drops its embedder and that cache.
_vector_caches: weakref.WeakSet[_VectorCache] = weakref.WeakSet()


def embed_caches_clear() -> None:
    """Forget every vector this process keeps (an erasure does, for its own process; tests
    start from none)."""
    for cache in list(_vector_caches):
        cache.clear()


def embed_cached(
    embed: Callable[..., list[float]], *, size: int, ttl_s: float = 900.0, clock: Callable[[], float] = time.monotonic
) -> Callable[..., list[float]]:
    """`embed` (an embedder's one-text call) with its last `size` vectors kept in this
    process for at most `ttl_s` seconds. Agents ask the same things again (the turn
    prefetch, a cache check before a recall) and store the same lines in many users'
    memories; a repeat then costs a lookup instead of a model run or a paid Gemini request.
    Keys are digests, not the text; vectors are kept as float32 (what the vector column
    holds) and each caller gets its own list."""
    if size <= 0 or ttl_s <= 0:
        return embed
    cache = _VectorCache(size, ttl_s=ttl_s, clock=clock)
    _vector_caches.add(cache)

    def cached(text: str, memory_action: str | None = None) -> list[float]:
        # The action is part of the key: Gemini embeds queries and documents differently.
        key = (hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest(), memory_action)
        hit = cache.get(key)
        if hit is not None:
            return hit
        vector = embed(text, memory_action)
        cache.put(key, vector)
        return vector

    return cached
