import time

from django.db import connection
from django.http import JsonResponse
from django.views.decorators.http import require_GET

from memories.engine import EngineError, engine_ping
from memsite.models import WorkerHeartbeat


def _check_database() -> str | None:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
    except Exception as exc:
        return type(exc).__name__
    return None


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
    if error := _check_database():
        failures["database"] = error
    elif error := _check_engine():
        failures["engine"] = error
    body = {
        "status": "ok" if not failures else "unavailable",
        "database": "ok" if "database" not in failures else "failing",
        "engine": "ok" if not failures else ("failing" if "engine" in failures else "unknown"),
        "worker_last_seen": None if failures else _last_worker_heartbeat(),
        "elapsed_ms": round((time.perf_counter() - started) * 1000, 1),
    }
    if failures:
        body["failing"] = sorted(failures)
        body["errors"] = failures
    return JsonResponse(body, status=200 if not failures else 503)
