"""Which embedder the engine uses, per process, as the database says (issue 17).

The vectors in the engine's table were made by one embedder; queries and new rows must
use the same one. `manage.py reembed` switches it online: every process reads the
active embedder from `EmbedderState` (no row: the configured EMBEDDER), cached for
`ACTIVE_TTL_S`, so a switch takes effect everywhere without a restart. A call that
raced the switch (query embedded with the old embedder, table already on the new one)
fails with a dimension mismatch; `embedder_spec_refresh` drops the cache so its retry
uses the new one."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any

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


def embedder_for(spec: EmbedderSpec) -> Any:
    """An embedder making `spec`'s vectors (mem0's interface: embed, embed_batch); one
    instance per process and spec. The configured one is mem0's own."""
    from memories.engine.mem0_adapter import _embedder_instrument, get_memory

    if spec == embedder_spec_configured():
        return get_memory().embedding_model
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
