"""Request ids at the HTTP edges, and `/metrics`.

- `RequestIdMiddleware` (Django: REST, web UI, admin) and `RequestIdASGIMiddleware`
  (around each MCP app) bind one request id per request (`core.request_ids`), return it
  as `X-Request-Id`, and count 401 answers (`memsite_unauthenticated_requests_total`).
- `metrics_view` serves every process's samples (prometheus-client multi-process mode
  when `PROMETHEUS_MULTIPROC_DIR` is set) plus gauges read from the database at scrape
  time: usage outbox depth and oldest pending age, chat turns waiting for or given up by
  memory extraction, audit export lag, broker queue length. Access: `Authorization:
  Bearer $METRICS_TOKEN` when METRICS_TOKEN is set, otherwise loopback clients only.
- `multiproc_dir_prepare` / `multiproc_process_dead` are used by the launcher.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import secrets
import time
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.conf import settings
from django.db import connection
from django.http import HttpRequest, HttpResponse
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from core.metrics import unauthenticated_record
from core.request_ids import REQUEST_ID_HEADER, BoundRequest, request_bound, request_id_bound

logger = logging.getLogger(__name__)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


# --- request ids at the edges -------------------------------------------------------
def _channel_of(path: str) -> str:
    if path.startswith("/v1/"):
        return "rest"
    if path.startswith("/admin/"):
        return "admin"
    if path.startswith("/metrics"):
        return "metrics"
    return "ui"


class RequestIdMiddleware:
    """First in MIDDLEWARE: every log line of the request carries its id."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Any) -> None:
        self.get_response = get_response
        if iscoroutinefunction(get_response):
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest) -> Any:
        if iscoroutinefunction(self):
            return self._acall(request)
        with self._bound(request) as bound:
            response = self.get_response(request)
            return self._finish(request, response, bound.request_id)

    async def _acall(self, request: HttpRequest) -> Any:
        with self._bound(request) as bound:
            response = await self.get_response(request)
            return self._finish(request, response, bound.request_id)

    @staticmethod
    def _bound(request: HttpRequest) -> AbstractContextManager[BoundRequest]:
        """The id `RequestIdBoundASGI` bound in front of Django (the web process), else a
        new binding (Django's test client, which has no ASGI layer)."""
        bound = request_bound()
        if bound is not None:
            return nullcontext(bound)
        return request_id_bound(client_request_id=request.headers.get(REQUEST_ID_HEADER, ""))

    @staticmethod
    def _finish(request: HttpRequest, response: HttpResponse, request_id: str) -> HttpResponse:
        response[REQUEST_ID_HEADER] = request_id
        if response.status_code == 401:
            unauthenticated_record(channel=_channel_of(request.path))
        return response


def _client_request_id(scope: dict[str, Any]) -> str:
    for name, value in scope.get("headers") or ():
        if name.lower() == b"x-request-id":
            return value.decode("latin-1")
    return ""


class RequestIdBoundASGI:
    """Binds the request id around Django's ASGI handlers, so that the lines logged after
    the middleware chain returns carry it too: Django's `django.request` line for a 4xx or
    5xx, and the server's access line (written when the response starts). The header and
    the 401 count stay with `RequestIdMiddleware`, which takes this binding."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        with request_id_bound(client_request_id=_client_request_id(scope)):
            await self.app(scope, receive, send)


class RequestIdASGIMiddleware:
    """The same for an ASGI app (the MCP toolsets and the OAuth endpoints, which Django
    never sees), with the response header and the 401 count."""

    def __init__(self, app: Any, *, channel: str = "mcp") -> None:
        self.app = app
        self.channel = channel

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        with request_id_bound(client_request_id=_client_request_id(scope)) as bound:
            header = (REQUEST_ID_HEADER.lower().encode(), bound.request_id.encode())

            async def send_with_id(message: dict[str, Any]) -> None:
                if message["type"] == "http.response.start":
                    message = {**message, "headers": [*message.get("headers", []), header]}
                    if message.get("status") == 401:
                        unauthenticated_record(channel=self.channel)
                await send(message)

            await self.app(scope, receive, send_with_id)


# --- /metrics -------------------------------------------------------------------------
def _loopback(address: str | None) -> bool:
    try:
        return address is not None and ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def _authorised(request: HttpRequest) -> HttpResponse | None:
    """None if the scrape may proceed, else the refusal."""
    token = settings.METRICS_TOKEN
    if token:
        given = request.headers.get("Authorization", "")
        scheme, _, value = given.partition(" ")
        if scheme.lower() == "bearer" and secrets.compare_digest(value.strip().encode(), token.encode()):
            return None
        response = HttpResponse(
            "metrics need the bearer token (METRICS_TOKEN)\n", status=401, content_type="text/plain"
        )
        response["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return response
    if _loopback(request.META.get("REMOTE_ADDR")):
        return None
    return HttpResponse(
        "metrics are served to loopback clients only (set METRICS_TOKEN to scrape remotely)\n",
        status=403,
        content_type="text/plain",
    )


class DatabaseCollector(Collector):
    """Gauges read at scrape time with a few indexed queries."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        started = time.perf_counter()
        try:
            yield from self._outbox()
            yield from self._erasure_ledger()
            yield from self._proxy_turns()
            yield from self._ingest_intents()
            yield from self._audit_export()
            yield from self._broker()
            ok = 1.0
        except Exception as exc:  # a scrape must still answer (with the failure visible)
            logger.warning("metrics: database gauges failed (%s)", type(exc).__name__)
            ok = 0.0
        yield GaugeMetricFamily("memsite_scrape_database_ok", "1 if the database gauges could be read.", value=ok)
        yield GaugeMetricFamily(
            "memsite_scrape_database_seconds", "Time to read the database gauges.", value=time.perf_counter() - started
        )

    def _pending(self, *, table: str, status: str, since: str, waiting: str = "pending") -> tuple[int, float]:
        """An outbox's pending rows: how many, and the oldest one's age in seconds (0 when
        none). Each outbox has an index leading with its state (partial on the pending rows,
        or on (state, time)), so the rows it has dealt with (most of the table) are not read."""
        with connection.cursor() as cursor:
            cursor.execute(
                f"SELECT count(*), coalesce(extract(epoch FROM now() - min({since})), 0) "  # noqa: S608
                f"FROM {table} WHERE {status} = %s",
                [waiting],
            )
            pending, oldest = cursor.fetchone()
        return pending, float(oldest)

    def _outbox(self) -> Iterable[GaugeMetricFamily]:
        from billing.models import UsageEvent

        table = UsageEvent._meta.db_table
        pending, oldest = self._pending(table=table, status="status", since="created_at")
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT count(*) FROM {table} WHERE status = 'failed'")  # noqa: S608
            failed = cursor.fetchone()[0]
        yield GaugeMetricFamily(
            "memsite_usage_outbox_pending", "Usage events not yet delivered to the gateway.", value=pending
        )
        yield GaugeMetricFamily(
            "memsite_usage_outbox_oldest_pending_seconds",
            "Age of the oldest undelivered usage event (0 when none).",
            value=oldest,
        )
        yield GaugeMetricFamily(
            "memsite_usage_outbox_failed", "Usage events the gateway refused (need a person).", value=failed
        )

    def _erasure_ledger(self) -> Iterable[GaugeMetricFamily]:
        from memsite.models import ErasureLedger

        pending, oldest = self._pending(table=ErasureLedger._meta.db_table, status="state", since="erased_at")
        yield GaugeMetricFamily(
            "memsite_erasure_ledger_pending",
            "Erasures whose ledger record is not on the backup target yet (a restore would not redo them).",
            value=pending,
        )
        yield GaugeMetricFamily(
            "memsite_erasure_ledger_oldest_pending_seconds",
            "Age of the oldest erasure whose ledger record is not written yet (0 when none).",
            value=oldest,
        )

    def _proxy_turns(self) -> Iterable[GaugeMetricFamily]:
        from proxy.models import ProxyTurn

        table = ProxyTurn._meta.db_table
        pending, oldest = self._pending(table=table, status="state", since="created_at")
        with connection.cursor() as cursor:
            # Given up with their messages kept (a clear-all blanks them): a re-queue can
            # still extract them. The partial proxy_turn_failed finds the failed rows.
            cursor.execute(
                f"SELECT count(*) FROM {table} WHERE state = 'failed' AND messages <> '[]'::jsonb"  # noqa: S608
            )
            failed = cursor.fetchone()[0]
        yield GaugeMetricFamily(
            "memsite_proxy_turns_pending", "Chat turns waiting for memory extraction (retries included).", value=pending
        )
        yield GaugeMetricFamily(
            "memsite_proxy_turns_oldest_pending_seconds",
            "Age of the oldest chat turn waiting for memory extraction (0 when none).",
            value=oldest,
        )
        yield GaugeMetricFamily(
            "memsite_proxy_turns_failed",
            "Chat turns whose memory extraction was given up (need a person: admin re-queue).",
            value=failed,
        )

    def _ingest_intents(self) -> Iterable[GaugeMetricFamily]:
        from memories.models import IngestIntent

        table = IngestIntent._meta.db_table
        opened, oldest = self._pending(
            table=table, status="state", since="created_at", waiting=IngestIntent.State.OPEN.value
        )
        yield GaugeMetricFamily(
            "memsite_ingest_intents_open",
            "Ingest calls in flight or left open by a crash (the reconciler closes those past the lease).",
            value=opened,
        )
        # Above INGEST_INTENT_LEASE_S plus a few minutes: the reconciler is not closing one
        # (a user's lock held by a long import or erasure, or the beat not running).
        yield GaugeMetricFamily(
            "memsite_ingest_intents_oldest_open_seconds",
            "Age of the oldest open ingest call (0 when none).",
            value=oldest,
        )

    def _audit_export(self) -> Iterable[GaugeMetricFamily]:
        from audit.models import AuditEvent, AuditExportBatch

        events, batches = AuditEvent._meta.db_table, AuditExportBatch._meta.db_table
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT coalesce(max(last_id), 0) FROM {batches}")  # noqa: S608
            watermark = cursor.fetchone()[0]
            # Ids are a sequence: max(id) - watermark is exact but for ids skipped by
            # rolled-back transactions (an upper bound), and costs one index probe.
            cursor.execute(f"SELECT coalesce(max(id), 0) FROM {events}")  # noqa: S608
            newest = cursor.fetchone()[0]
            cursor.execute(
                f"SELECT extract(epoch FROM now() - occurred_at) FROM {events} "  # noqa: S608
                "WHERE id > %s ORDER BY id LIMIT 1",
                [watermark],
            )
            row = cursor.fetchone()
        yield GaugeMetricFamily(
            "memsite_audit_unexported_rows",
            "Audit rows written after the export watermark (upper bound: ids skipped by rollbacks count).",
            value=max(0, newest - watermark),
        )
        yield GaugeMetricFamily(
            "memsite_audit_export_lag_seconds",
            "Age of the oldest audit row not yet exported (0 when all are).",
            value=float(row[0]) if row else 0.0,
        )

    def _broker(self) -> Iterable[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "memsite_broker_queue_messages", "Messages waiting in the Celery broker, by queue.", labels=["queue"]
        )
        for queue, size in broker_queue_sizes().items():
            family.add_metric([queue], size)
        yield family


def broker_queue_sizes() -> dict[str, int]:
    """Waiting messages per queue: a count on kombu's SQLAlchemy tables (the default
    broker), or kombu's passive queue_declare otherwise (LLEN on Redis)."""
    if settings.CELERY_BROKER_URL.startswith("sqla+"):
        with connection.cursor() as cursor:
            cursor.execute("SELECT to_regclass('kombu_message') IS NOT NULL AND to_regclass('kombu_queue') IS NOT NULL")
            if not cursor.fetchone()[0]:
                return {}
            cursor.execute(
                "SELECT q.name, count(m.id) FROM kombu_queue q "
                "LEFT JOIN kombu_message m ON m.queue_id = q.id AND m.visible GROUP BY q.name"
            )
            return {name: count for name, count in cursor.fetchall()}
    from memsite.celery import app

    sizes: dict[str, int] = {}
    with app.connection_for_read() as conn:
        conn.ensure_connection(max_retries=1, timeout=2)
        channel = conn.default_channel
        for queue in app.amqp.queues:
            try:
                sizes[queue] = channel.queue_declare(queue=queue, passive=True).message_count
            except Exception:  # not declared yet: nothing waits in it
                sizes[queue] = 0
    return sizes


_database_collector = DatabaseCollector()


def metrics_text() -> bytes:
    """The exposition: all processes' samples (or this one's) and the database gauges."""
    if os.environ.get(MULTIPROC_ENV):
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        samples = generate_latest(registry)
    else:
        samples = generate_latest(REGISTRY)
    database = CollectorRegistry()
    database.register(_database_collector)
    return samples + generate_latest(database)


def metrics_view(request: HttpRequest) -> HttpResponse:
    if request.method != "GET":
        return HttpResponse(status=405, headers={"Allow": "GET"})
    refusal = _authorised(request)
    if refusal is not None:
        return refusal
    return HttpResponse(metrics_text(), content_type=CONTENT_TYPE_LATEST)


# --- multi-process files (launcher) ------------------------------------------------------
def multiproc_dir_prepare(path: Path) -> Path:
    """Create the directory and remove the previous run's sample files (their counters
    would otherwise be added to this run's)."""
    path.mkdir(parents=True, exist_ok=True)
    for stale in path.glob("*.db"):
        stale.unlink(missing_ok=True)
    return path


def multiproc_process_dead(pid: int) -> None:
    """A child exited: drop its live-gauge files (counters and histograms stay summed)."""
    if not os.environ.get(MULTIPROC_ENV):
        return
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid)
