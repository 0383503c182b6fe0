"""What the connected PostgreSQL can do for vector search, detected from the server.

Used by /healthz and by the engine's choice of search plan: pgvector 0.7 added `halfvec` and
binary quantisation, 0.8 iterative index scans (a filtered HNSW search that keeps scanning
instead of silently returning too few rows)."""

from __future__ import annotations

from dataclasses import dataclass

from django.conf import settings
from django.db import connections


def _version_tuple(version: str | None) -> tuple[int, ...]:
    if not version:
        return ()
    return tuple(int(part) for part in version.split(".") if part.isdigit())


@dataclass(frozen=True)
class DatabaseInfo:
    server_version: str  # e.g. "18.6"
    server_version_num: int  # e.g. 180006
    pgvector_version: str | None  # None when the extension is not installed in this database

    @property
    def halfvec(self) -> bool:
        return _version_tuple(self.pgvector_version) >= (0, 7, 0)

    @property
    def binary_quantization(self) -> bool:
        return _version_tuple(self.pgvector_version) >= (0, 7, 0)

    @property
    def iterative_index_scans(self) -> bool:
        return _version_tuple(self.pgvector_version) >= (0, 8, 0)

    def as_dict(self) -> dict:
        return {
            "postgres": self.server_version,
            "pgvector": self.pgvector_version,
            "halfvec": self.halfvec,
            "iterative_index_scans": self.iterative_index_scans,
        }


def database_info(*, using: str = "default") -> DatabaseInfo:
    """One round trip; not cached, because the server can be upgraded under a running process."""
    with connections[using].cursor() as cursor:
        cursor.execute(
            "SELECT current_setting('server_version'), current_setting('server_version_num')::int,"
            " (SELECT extversion FROM pg_extension WHERE extname = 'vector')"
        )
        version, version_num, pgvector = cursor.fetchone()
    # server_version may carry a distribution suffix ("16.4 (Debian 16.4-1.pgdg120+1)").
    return DatabaseInfo(server_version=version.split()[0], server_version_num=version_num, pgvector_version=pgvector)


def pgvector_version(*, using: str = "default") -> str | None:
    return database_info(using=using).pgvector_version


def vector_search_plan(info: DatabaseInfo | None) -> str | None:
    """How the engine searches vectors, by the rule of memories.engine.retrieval.vector_plan:
    "exact" (a scan of the user's rows) when SEARCH_INDEX_MIN_ROWS is 0 or the server has no
    iterative index scans (pgvector < 0.8); "adaptive" otherwise: exact below
    SEARCH_INDEX_MIN_ROWS rows, the HNSW index with iterative scans from there on. None while
    the database cannot say (unreachable). MEMORY_HNSW plays no part: it is passed to mem0,
    whose own search the engine does not use."""
    if info is None:
        return None
    if settings.SEARCH_INDEX_MIN_ROWS > 0 and info.iterative_index_scans:
        return "adaptive"
    return "exact"
