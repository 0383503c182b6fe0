import time

from django.conf import settings
from django.http import JsonResponse
from django.views.decorators.http import require_GET

from memories.engine import EngineError, engine_ping, engine_reembed_progress
from memsite.dbinfo import DatabaseInfo, database_info, vector_search_plan
from memsite.models import WorkerHeartbeat
from memsite.unavailable import RETRY_AFTER_S


def _check_database() -> tuple[DatabaseInfo | None, str | None]:
    try:
        return database_info(), None  # one round trip: reachable, and which versions
    except Exception as exc:
        # The type only: a driver's message can quote the statement's data.
        return None, type(exc).__name__


def _check_engine() -> str | None:
    try:
        engine_ping()
    except EngineError as exc:
        return str(exc)
    return None


def _last_worker_heartbeat() -> str | None:
    try:
        seen = WorkerHeartbeat.objects.order_by("-seen_at").values_list("seen_at", flat=True).first()
    except Exception:
        return None
    return seen.isoformat() if seen else None


@require_GET
def healthz(request):  # noqa: ARG001 - view signature
    started = time.perf_counter()
    failures = {}
    info, error = _check_database()
    if error:
        failures["database"] = error
    elif error := _check_engine():
        failures["engine"] = error
    body = {
        "status": "ok" if not failures else "unavailable",
        "database": "ok" if "database" not in failures else "failing",
        "engine": "ok" if not failures else ("failing" if "engine" in failures else "unknown"),
        "worker_last_seen": None if failures else _last_worker_heartbeat(),
        "postgres": info.server_version if info else None,
        "pgvector": info.pgvector_version if info else None,
        "vector_search_plan": vector_search_plan(info),
        "vector_index_min_rows": settings.SEARCH_INDEX_MIN_ROWS,
        "embedder": None,
        "elapsed_ms": round((time.perf_counter() - started) * 1000, 1),
    }
    if not failures:
        # Which embedder made the vectors, and a re-embedding's progress (manage.py reembed).
        progress = engine_reembed_progress()
        body["embedder"] = progress.active
        if progress.target:
            body["reembed"] = progress.as_dict()
        body["elapsed_ms"] = round((time.perf_counter() - started) * 1000, 1)
    if failures:
        body["failing"] = sorted(failures)
        body["errors"] = failures
    response = JsonResponse(body, status=200 if not failures else 503)
    if failures:
        response["Retry-After"] = str(RETRY_AFTER_S)
    return response
