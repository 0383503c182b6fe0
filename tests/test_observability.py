"""Metrics (/metrics, summed across processes) and structured logs (one request id per
call, equal to the audit row's; no memory text or key in any log line)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from audit.models import AuditEvent
from billing.models import UsageEvent
from core.logs import AccessLogFilter, JsonFormatter, RequestIdFilter, TextFormatter, scrub_secrets
from core.request_ids import request_id_bound, request_id_claim
from memsite.models import ErasureLedger
from tests.conftest import McpCaller, free_port, service_env, wait_for
from tests.environment import ROOT

pytestmark = pytest.mark.django_db(transaction=True)


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of an exposition."""
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def value(found: dict, name: str, **labels: str) -> float:
    return found.get((name, tuple(sorted(labels.items()))), 0.0)


# --- request ids and log formats (in-process) --------------------------------------------
def _record(message: str, *args) -> logging.LogRecord:
    return logging.LogRecord("memories.test", logging.INFO, __file__, 1, message, args, None)


def test_log_lines_carry_the_bound_request_id_as_text_and_json():
    with request_id_bound(client_request_id="client-42") as bound:
        record = _record("did %s", "something")
        RequestIdFilter().filter(record)
    text = TextFormatter().format(record)
    assert f"[rid={bound.request_id}] [memories.test] did something" in text
    assert text.startswith("[") and "[INFO]" in text
    entry = json.loads(JsonFormatter().format(record))
    assert entry["request_id"] == bound.request_id
    assert entry["client_request_id"] == "client-42"
    assert entry["message"] == "did something" and entry["level"] == "INFO" and entry["logger"] == "memories.test"
    # Outside a request: a dash, not a stale id.
    outside = _record("idle")
    RequestIdFilter().filter(outside)
    assert "[rid=-]" in TextFormatter().format(outside)


def test_only_the_first_call_of_a_request_takes_its_id_and_unsafe_client_ids_are_dropped():
    with request_id_bound(client_request_id="bad id\nwith newline") as bound:
        assert bound.client_request_id == ""
        assert request_id_claim() == bound.request_id
        second = request_id_claim()
        assert second != bound.request_id  # usage events need unique request ids
    assert request_id_claim() not in ("", bound.request_id)


def test_secrets_and_query_strings_are_scrubbed_from_log_lines():
    assert "s3cr3t" not in scrub_secrets("Authorization: Bearer s3cr3t.token")
    assert "abcdef" not in scrub_secrets("key msk_AbC123_abcdef used")
    assert "hunter2" not in scrub_secrets("GET /x?token=hunter2&a=1")
    # OAuth tokens and codes, an upstream chat key, and a token response a library echoes.
    for secret in ("mso_at_Zx9Kq", "mso_rt_Zx9Kq", "mso_ac_Zx9Kq", "sk-proj-0123456789abcdefXYZ"):
        assert secret[-5:] not in scrub_secrets(f"oauth said {secret} here"), secret
    echoed = scrub_secrets('{"access_token": "opaque-1", "client_secret":"opaque-2", "scope": "memory"}')
    assert "opaque" not in echoed and '"scope": "memory"' in echoed
    escaped = scrub_secrets('{"refresh_token": "ab\\"cd-tail", "n": 1}')  # an escaped quote inside
    assert "tail" not in escaped and '"n": 1' in escaped
    assert "opaque" not in scrub_secrets("{'access_token': 'opaque-3', 'expires_in': 3600}")  # a Python repr
    assert scrub_secrets("my_mso_counter") == "my_mso_counter"  # inside a name: not a token
    record = logging.LogRecord(
        "uvicorn.access",
        logging.INFO,
        __file__,
        1,
        '%s - "%s %s HTTP/%s" %d',
        ("127.0.0.1:5000", "GET", "/?q=my+private+words", "1.1", 200),
        None,
    )
    AccessLogFilter().filter(record)
    RequestIdFilter().filter(record)
    assert "private" not in record.getMessage()
    assert '"GET /?[query] HTTP/1.1" 200' in record.getMessage()


def test_rest_call_returns_its_request_id_which_is_the_audit_rows_and_the_usage_events(api_client, alice_key):
    response = api_client(alice_key).post(
        "/v1/memories", {"memory": "alice likes tea"}, format="json", HTTP_X_REQUEST_ID="trace-abc.1"
    )
    assert response.status_code == 201
    request_id = response["X-Request-Id"]
    assert request_id != "trace-abc.1"  # ours: it is the billing idempotency key
    assert AuditEvent.objects.get(operation="remember").request_id == request_id
    assert str(UsageEvent.objects.get(operation="remember").request_id) == request_id
    # Every response has one, errors included.
    unauthenticated = api_client().get("/v1/memories")
    assert unauthenticated.status_code == 401 and unauthenticated["X-Request-Id"]


# --- /metrics access (in-process) ----------------------------------------------------------
def test_metrics_are_served_to_loopback_only_without_a_token(client, settings):
    settings.METRICS_TOKEN = None
    assert client.get("/metrics", REMOTE_ADDR="203.0.113.9").status_code == 403
    assert client.get("/metrics", REMOTE_ADDR="10.0.0.5").status_code == 403
    for loopback in ("127.0.0.1", "::1"):
        response = client.get("/metrics", REMOTE_ADDR=loopback)
        assert response.status_code == 200
        assert "memsite_usage_outbox_pending" in response.content.decode()


def test_metrics_need_the_bearer_token_when_one_is_set(client, settings):
    settings.METRICS_TOKEN = "scrape-token-123"
    assert client.get("/metrics", REMOTE_ADDR="127.0.0.1").status_code == 401
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer wrong", REMOTE_ADDR="127.0.0.1").status_code == 401
    ok = client.get("/metrics", HTTP_AUTHORIZATION="Bearer scrape-token-123", REMOTE_ADDR="203.0.113.9")
    assert ok.status_code == 200
    assert "memsite_calls_total" in ok.content.decode() or "memsite_calls" in ok.content.decode()


def test_calls_rate_limits_and_outbox_are_counted_in_process(client, api_client, alice_key, bob_key, settings):
    settings.METRICS_TOKEN = None
    settings.RATE_LIMITS = {**settings.RATE_LIMITS, "search_memory": (1, 60)}

    def scrape() -> dict:
        return samples(client.get("/metrics", REMOTE_ADDR="127.0.0.1").content.decode())

    before = scrape()
    alice = api_client(alice_key)
    memory_id = alice.post("/v1/memories", {"memory": "alice's cat is Tom"}, format="json").json()["id"]
    assert api_client(bob_key).delete(f"/v1/memories/{memory_id}").status_code == 404
    assert alice.post("/v1/memories/search", {"query": "cat"}, format="json").status_code == 200
    assert alice.post("/v1/memories/search", {"query": "cat"}, format="json").status_code == 429
    after = scrape()

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    calls = "memsite_calls_total"
    assert delta(calls, operation="remember", channel="rest", outcome="ok", code="") == 1
    assert delta(calls, operation="delete_memory", channel="rest", outcome="denied", code="not_found") == 1
    assert delta(calls, operation="search_memory", channel="rest", outcome="ok", code="") == 1
    assert delta(calls, operation="search_memory", channel="rest", outcome="error", code="rate_limited") == 1
    assert delta("memsite_rate_limit_rejections_total", operation="search_memory") == 1
    assert delta("memsite_call_duration_seconds_count", operation="remember", channel="rest") == 1
    assert delta("memsite_engine_duration_seconds_count", action="add", outcome="ok") == 1
    assert delta("memsite_embed_duration_seconds_count", embedder="local", kind="one") >= 2  # memory + query
    assert value(after, "memsite_usage_outbox_pending") == 2  # remember + one search (no gateway here)
    assert value(after, "memsite_usage_outbox_oldest_pending_seconds") >= 0
    assert value(after, "memsite_audit_unexported_rows") >= 4
    assert value(after, "memsite_scrape_database_ok") == 1


def test_web_ui_calls_outside_the_dispatcher_are_counted(client, alice, alice_scope, settings):
    """Downloads, decision and cache deletes and key changes call their services directly
    (streamed, or with the web's own answers); they are counted and timed like the UI's
    dispatched calls: a refusal under its code, a download left unread (even before its
    first line) as client_gone."""
    from django.test import Client
    from django.urls import reverse

    from memories.toolkit.services import toolkit_decision_store
    from tests.conftest import internal_call

    settings.METRICS_TOKEN = None
    scrape = lambda: samples(client.get("/metrics", REMOTE_ADDR="127.0.0.1").content.decode())  # noqa: E731
    before = scrape()
    web = Client()
    web.force_login(alice)
    toolkit_decision_store(alice_scope, key="db", value="postgres", call=internal_call())

    download = web.post(reverse("web-data-export"), {"format": "jsonl"})
    assert b'"count": 0' in b"".join(download.streaming_content)
    download.close()
    assert web.post(reverse("web-data-export"), {"format": "pdf"}).status_code == 302
    left = web.post(reverse("web-data-export"), {"format": "markdown"})
    next(iter(left.streaming_content))  # the title line, then the client goes away
    left.close()
    web.post(reverse("web-data-export"), {"format": "jsonl"}).close()  # gone before any line
    logs = web.post(reverse("web-data-export-session-logs"))
    b"".join(logs.streaming_content)
    logs.close()
    toolkit_data = web.post(reverse("web-data-export-decisions-and-cache"))
    assert b'"key": "db"' in b"".join(toolkit_data.streaming_content)
    toolkit_data.close()
    assert web.post(reverse("web-decision-delete"), {"key": "db"}).status_code == 302
    assert web.post(reverse("web-cache-clear")).status_code == 302
    after = scrape()

    def delta(operation: str, outcome: str = "ok", code: str = "") -> float:
        labels = {"operation": operation, "channel": "ui", "outcome": outcome, "code": code}
        return value(after, "memsite_calls_total", **labels) - value(before, "memsite_calls_total", **labels)

    assert delta("export_memories") == 1
    assert delta("export_memories", "error", "invalid_argument") == 1
    assert delta("export_memories", "error", "client_gone") == 2
    assert delta("export_memories", "error", "unexpected") == 0
    assert delta("export_session_logs") == 1
    assert delta("export_decisions_and_cache") == 1
    assert delta("delete_decision") == 1
    assert delta("delete_cache_entry") == 1


def test_a_web_key_revocation_answered_not_found_counts_as_an_error(client, alice, bob, settings):
    """The page answers 404 for a key that is unknown, someone else's or revoked already;
    the call metrics count each as the not_found it is, not as a revocation."""
    from django.test import Client

    from memories.services import api_key_issue

    settings.METRICS_TOKEN = None
    scrape = lambda: samples(client.get("/metrics", REMOTE_ADDR="127.0.0.1").content.decode())  # noqa: E731
    key = api_key_issue(user=alice, name="laptop")[0]
    as_alice, as_bob = Client(), Client()
    as_alice.force_login(alice)
    as_bob.force_login(bob)
    before = scrape()
    assert as_bob.post(f"/keys/{key.key_id}/revoke/").status_code == 404
    assert as_alice.post("/keys/no-such-key/revoke/").status_code == 404
    assert as_alice.post(f"/keys/{key.key_id}/revoke/").status_code == 302
    assert as_alice.post(f"/keys/{key.key_id}/revoke/").status_code == 404
    after = scrape()

    def delta(outcome: str, code: str = "") -> float:
        labels = {"operation": "api_key_revoke", "channel": "ui", "outcome": outcome, "code": code}
        return value(after, "memsite_calls_total", **labels) - value(before, "memsite_calls_total", **labels)

    assert delta("ok") == 1
    assert delta("error", "not_found") == 3


def test_the_seed_002_turn_metrics_are_registered(client, settings):
    settings.METRICS_TOKEN = None
    text = client.get("/metrics", REMOTE_ADDR="127.0.0.1").content.decode()
    for name in (
        "mcp_memory_before_turn",
        "mcp_memory_after_turn",
        "mcp_memory_after_turn_duration_ms",
        "mcp_memory_maintenance",
        "mcp_memory_compaction",
        "mcp_memory_fact_write",
        "mcp_memory_idempotency_conflicts",
    ):
        assert f"# TYPE {name}" in text, name  # counters are exposed as <name>_total


# --- two web processes on one database --------------------------------------------------------
class WebProcess:
    def __init__(self, log_path: Path, env: dict[str, str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        log = open(log_path, "ab")  # noqa: SIM115
        self.process = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "memsite.asgi:application", "--host", "127.0.0.1",
             "--port", str(self.port)],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        log.close()

    def up(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"web process exited:\n{self.log_path.read_text()}")
        try:
            return httpx.get(f"{self.url}/healthz", timeout=2).status_code in (200, 503)
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


@pytest.fixture
def two_web_processes(tmp_path):
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    env = service_env(
        PROMETHEUS_MULTIPROC_DIR=str(metrics_dir),
        LOG_FORMAT="json",
        LOG_LEVEL="INFO",
        RATE_LIMIT_LIST_MEMORY="3/minute",
    )
    env.pop("METRICS_TOKEN", None)
    processes = [WebProcess(tmp_path / f"web-{i}.log", env) for i in range(2)]
    try:
        for process in processes:
            wait_for(process.up, timeout=120, what="web process")
        yield processes
    finally:
        for process in processes:
            process.stop()


@pytest.mark.slow
def test_two_web_processes_mixed_load_metrics_and_logs(two_web_processes, alice_key, bob_key):
    a, b = two_web_processes
    texts = [f"alice private fact number {i} about quokka-{i}" for i in range(5)]
    # MCP: 3 memories through A, 2 through B.
    ids = [McpCaller(server.url, alice_key).ok("remember", {"memory": text})["id"] for server, text in
           zip([a, a, a, b, b], texts, strict=True)]  # fmt: skip
    # REST: searches on B, bob's delete of alice's memory on A (answered as not found).
    for _ in range(2):
        response = httpx.post(
            f"{b.url}/v1/memories/search",
            json={"query": "quokka-3"},
            headers={"Authorization": f"Bearer {alice_key}"},
        )
        assert response.status_code == 200 and response.headers["X-Request-Id"]
    gone = httpx.delete(f"{a.url}/v1/memories/{ids[0]}", headers={"Authorization": f"Bearer {bob_key}"})
    assert gone.status_code == 404
    # A limit of 3 list calls a minute, counted in Postgres across both processes. Windows
    # are aligned to the minute: five calls straddling its edge would be counted in two.
    if time.time() % 60 > 50:
        time.sleep(60.5 - time.time() % 60)
    statuses = [
        httpx.get(f"{server.url}/v1/memories", headers={"Authorization": f"Bearer {alice_key}"}).status_code
        for server in (a, b, a, b, a)
    ]
    assert sorted(statuses) == [200, 200, 200, 429, 429]
    # Unauthenticated: MCP on both, REST on B.
    for server in (a, b):
        assert httpx.post(f"{server.url}/engines/memory/mcp", json={}).status_code == 401
    assert httpx.get(f"{b.url}/v1/memories").status_code == 401

    # Either process answers with the sums over both.
    for server in (a, b):
        response = httpx.get(f"{server.url}/metrics")
        assert response.status_code == 200
        found = samples(response.text)
        calls = "memsite_calls_total"
        assert value(found, calls, operation="remember", channel="mcp", outcome="ok", code="") == 5
        assert value(found, calls, operation="search_memory", channel="rest", outcome="ok", code="") == 2
        assert value(found, calls, operation="delete_memory", channel="rest", outcome="denied", code="not_found") == 1
        assert value(found, calls, operation="list_memory", channel="rest", outcome="ok", code="") == 3
        assert value(found, calls, operation="list_memory", channel="rest", outcome="error", code="rate_limited") == 2
        assert value(found, "memsite_rate_limit_rejections_total", operation="list_memory") == 2
        assert value(found, "memsite_call_duration_seconds_count", operation="remember", channel="mcp") == 5
        assert value(found, "memsite_unauthenticated_requests_total", channel="mcp") == 2
        assert value(found, "memsite_unauthenticated_requests_total", channel="rest") == 1
        assert value(found, "memsite_engine_duration_seconds_count", action="add", outcome="ok") == 5
        assert value(found, "memsite_usage_outbox_pending") == 10  # 5 remember + 2 search + 3 list; no worker
        assert value(found, "memsite_broker_queue_messages", queue="celery") >= 1  # delivery tasks waiting
        assert value(found, "memsite_scrape_database_ok") == 1

    # A non-loopback client (uvicorn takes the client from X-Forwarded-For set by a local proxy) is refused.
    assert httpx.get(f"{a.url}/metrics", headers={"X-Forwarded-For": "203.0.113.9"}).status_code == 403

    for server in (a, b):
        server.stop()
    lines = [line for server in (a, b) for line in server.log_path.read_text(errors="replace").splitlines()]
    entries = []
    for line in lines:
        try:
            entries.append(json.loads(line))
        except ValueError:
            continue
    assert entries, "no JSON log lines"
    # Every MCP call's audit row has log lines carrying its request id (the access line at least).
    # (The 401s leave one sampled `authenticate` row per ip and minute: not a call.)
    mcp_rows = list(AuditEvent.objects.filter(channel="mcp").exclude(operation="authenticate"))
    assert len(mcp_rows) == 5
    for row in mcp_rows:
        own = [e for e in entries if e.get("request_id") == row.request_id]
        assert any("POST /engines/memory/mcp" in e["message"] for e in own), row.request_id
        assert any(e["logger"] == "memsite.calls" and "remember" in e["message"] for e in own), row.request_id
    # No log line holds a memory text, a search query or a key (nor a key's secret part).
    everything = "\n".join(lines)
    # A key is msk_<key id>_<secret>, and the secret itself may hold "_" (URL-safe base64):
    # splitting at the last "_" once left a one-letter "secret" ("E") that every log holds.
    secrets = [key.removeprefix("msk_").partition("_")[2] for key in (alice_key, bob_key)]
    for secret in [*texts, "quokka", alice_key, bob_key, *secrets]:
        assert secret not in everything, secret


def test_web_ui_responses_and_task_runs_carry_a_request_id(client, alice):
    from django.urls import reverse

    from core.request_ids import request_id_current
    from memsite.celery import _bind_task_request_id, _unbind_task_request_id

    client.force_login(alice)
    response = client.get(reverse("web-memories"))
    assert response.status_code == 200 and response["X-Request-Id"]
    _bind_task_request_id(task_id="task-123")
    assert request_id_current() == "task-123"
    assert request_id_claim() != "task-123"  # a retried task must not reuse it for a usage event
    _unbind_task_request_id(task_id="task-123")
    assert request_id_current() == ""


def test_the_erasure_ledger_backlog_is_a_gauge_and_an_admin_page(client, admin_client, alice, bob, settings):
    """An erasure whose ledger record has not reached the backups yet is one a restore
    would not redo: operators see the backlog in /metrics, support in the admin."""
    settings.METRICS_TOKEN = None
    now = timezone.now()
    ErasureLedger.objects.create(
        id=uuid.uuid4(), user_pk=alice.pk, engine_user_id=f"t:{alice.pk}", erased_at=now - timedelta(minutes=20)
    )
    ErasureLedger.objects.create(
        id=uuid.uuid4(), user_pk=bob.pk, engine_user_id=f"t:{bob.pk}", erased_at=now, state="written", written_at=now
    )
    found = samples(client.get("/metrics", REMOTE_ADDR="127.0.0.1").content.decode())
    assert value(found, "memsite_erasure_ledger_pending") == 1
    assert value(found, "memsite_erasure_ledger_oldest_pending_seconds") >= 20 * 60

    listing = admin_client.get("/admin/memsite/erasureledger/?state__exact=pending")
    assert listing.status_code == 200
    assert listing.context["cl"].result_count == 1
    for term in ("abc", "1" * 40, "-1"):  # not an id: no match, never a 500
        assert admin_client.get("/admin/memsite/erasureledger/", {"q": term}).context["cl"].result_count == 0
    row = ErasureLedger.objects.get(user_pk=alice.pk)
    detail = admin_client.get(f"/admin/memsite/erasureledger/{row.pk}/change/")
    assert detail.status_code == 200 and b'name="_save"' not in detail.content
    assert admin_client.post(f"/admin/memsite/erasureledger/{row.pk}/delete/", {"post": "yes"}).status_code == 403
    assert ErasureLedger.objects.count() == 2


def test_open_ingest_calls_are_a_gauge(client, alice, settings):
    """An ingest left open past the lease is one the reconciler has not closed (a user's
    lock held, no beat): operators see how many are open and the oldest one's age."""
    from memories.models import IngestIntent

    settings.METRICS_TOKEN = None
    now = timezone.now()
    for request_id, age, state in (("r-old", 30, "open"), ("r-new", 0, "open"), ("r-done", 60, "done")):
        IngestIntent.objects.create(
            request_id=request_id,
            engine_user_id=f"t:{alice.pk}",
            scope={},
            call={},
            state=state,
            created_at=now - timedelta(minutes=age),
        )
    found = samples(client.get("/metrics", REMOTE_ADDR="127.0.0.1").content.decode())
    assert value(found, "memsite_ingest_intents_open") == 2
    assert 30 * 60 <= value(found, "memsite_ingest_intents_oldest_open_seconds") < 31 * 60


def test_django_and_access_log_lines_carry_the_answers_request_id(alice_key):
    """Django logs a 4xx, and the server its access line, after the middleware chain has
    returned: the id is bound in front of Django's handlers, so those lines carry the id
    the response answered with (REST on its thread pool, the web UI on Django's handler)."""
    import asyncio

    from memsite.asgi import build_application

    seen: list[tuple[str, str]] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            RequestIdFilter().filter(record)
            seen.append((record.name, record.request_id))

    async def call(app, path: str, body: bytes) -> str:
        headers: list = []
        sent = False

        async def receive() -> dict:
            nonlocal sent
            if sent:
                await asyncio.Event().wait()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers.extend(message["headers"])
                # Where the server writes its access line.
                logging.getLogger("uvicorn.access").info("access %s", message["status"])

        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
            "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
            "headers": [
                (b"host", b"localhost"), (b"authorization", f"Bearer {alice_key}".encode()),
                (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            ],
            "client": ("127.0.0.1", 40000), "server": ("localhost", 80),
        }  # fmt: skip
        await asyncio.wait_for(app(scope, receive, send), timeout=60)
        return {name.lower(): value for name, value in headers}[b"x-request-id"].decode()

    async def main() -> list[str]:
        app = build_application()
        return [await call(app, "/v1/memories", b"{}"), await call(app, "/no-such-page/", b"")]

    keep = Keep()
    loggers = [logging.getLogger("django.request"), logging.getLogger("uvicorn.access")]
    for logger in loggers:
        logger.addHandler(keep)
    try:
        rest_id, web_id = asyncio.run(main())
    finally:
        for logger in loggers:
            logger.removeHandler(keep)
    assert ("django.request", rest_id) in seen and ("uvicorn.access", rest_id) in seen
    assert ("django.request", web_id) in seen and ("uvicorn.access", web_id) in seen
    assert all(request_id != "-" for _, request_id in seen)


def test_an_oauth_client_failing_authentication_is_not_counted_as_mcp():
    """/oauth/token with an unknown client answers 401 invalid_client: an OAuth client's
    failure, counted under `oauth`, not as an agent failing MCP authentication."""
    import asyncio

    import httpx2
    from prometheus_client import REGISTRY

    from memsite.asgi import build_application

    def count(channel: str) -> float:
        return REGISTRY.get_sample_value("memsite_unauthenticated_requests_total", {"channel": channel}) or 0.0

    async def main() -> httpx2.Response:
        transport = httpx2.ASGITransport(app=build_application())
        async with httpx2.AsyncClient(transport=transport, base_url="http://testserver", timeout=60) as http:
            form = {
                "grant_type": "authorization_code",
                "code": "mso_ac_x",
                "client_id": "nobody",
                "code_verifier": "v" * 43,
            }
            return await http.post("/oauth/token", data=form)

    before = {channel: count(channel) for channel in ("mcp", "oauth")}
    response = asyncio.run(main())
    assert response.status_code == 401 and response.json()["error"] == "invalid_client"
    assert count("mcp") == before["mcp"]
    assert count("oauth") == before["oauth"] + 1
