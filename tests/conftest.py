from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.db import connection

from core.scope import CallContext, MemoryScope
from tests.environment import ROOT, TEST_DATABASE
from tests.fakes import FakeGemini, FakeOIDC


def internal_call() -> CallContext:
    """A fresh call context (own request id) for tests that call services directly."""
    return CallContext(channel="internal")


@pytest.fixture(scope="session", autouse=True)
def _test_database_ready(django_db_setup, django_db_blocker):  # noqa: PT004
    """Let test isolation TRUNCATE the append-only audit tables (the triggers still
    refuse UPDATE and DELETE), and close the engine before the test DB is dropped."""
    with django_db_blocker.unblock():
        with connection.cursor() as cursor:
            cursor.execute(f"ALTER DATABASE {connection.settings_dict['NAME']} SET memsite.audit_allow_truncate = 'on'")
        connection.close()
        connection.close_pool()
    yield
    from kombu.transport.sqlalchemy import Channel

    from memories.engine import engine_close
    from memsite.celery import app

    engine_close()
    app.pool.force_close_all()
    for sqla_engine, _ in list(Channel._engines.values()):
        sqla_engine.dispose()
    Channel._engines.clear()


@pytest.fixture(autouse=True)
def _no_remembered_vectors():
    """Every test embeds from scratch: what an earlier test embedded in this worker must
    not change what it measures (embedding counts, a slow fake embedder)."""
    from memories.engine.embedders import embed_caches_clear

    embed_caches_clear()


@pytest.fixture
def alice(django_user_model):
    return django_user_model.objects.create_user("alice", "alice@example.com", "alice-password-1")


@pytest.fixture
def bob(django_user_model):
    return django_user_model.objects.create_user("bob", "bob@example.com", "bob-password-1")


@pytest.fixture
def alice_scope(alice) -> MemoryScope:
    return MemoryScope.for_user(alice)


@pytest.fixture
def bob_scope(bob) -> MemoryScope:
    return MemoryScope.for_user(bob)


def _engine_tables_empty() -> None:
    from django.conf import settings

    with connection.cursor() as cursor:
        for table in (settings.MEMORY_COLLECTION, f"{settings.MEMORY_COLLECTION}_entities"):
            cursor.execute(f'DELETE FROM "{table}"')  # noqa: S608 - our own table names


@pytest.fixture
def clean_vectors(request):
    """Engine rows are written through mem0's own pool, outside test transactions, so a
    test that did not clean up leaves them behind. A transactional test starts from an
    empty table too, whatever ran before it on this worker (inside a test transaction
    the delete would hold row locks mem0's own connections could wait on)."""
    transactional = "transactional_db" in request.fixturenames or any(
        marker.kwargs.get("transaction") for marker in request.node.iter_markers("django_db")
    )
    if transactional:
        _engine_tables_empty()
    yield
    _engine_tables_empty()


def age_memory(memory_id: str, days: int) -> None:
    """Make a memory look `days` old (created and last updated then)."""
    from datetime import UTC, datetime, timedelta

    stamp = (datetime.now(UTC) - timedelta(days=days)).isoformat()
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE memories SET payload = payload"
            " || jsonb_build_object('created_at', %s::text, 'updated_at', %s::text) WHERE id = %s",
            [stamp, stamp, memory_id],
        )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(predicate, *, timeout: float, interval: float = 0.2, what="condition"):
    """Poll `predicate` until truthy. `what` may be a callable, evaluated on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what() if callable(what) else what}")
        time.sleep(interval)


def serve_in_thread(app: str, *, factory: bool = False, lifespan: str = "auto"):
    """uvicorn serving `app` (an import path) in a thread of this process, so settings
    and monkeypatches apply: yields its base URL, and stops it after."""
    import uvicorn

    port = free_port()
    config = uvicorn.Config(app, factory=factory, host="127.0.0.1", port=port, log_level="warning", lifespan=lifespan)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, timeout=60, what="server in a thread")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)


def service_env(**overrides: str) -> dict[str, str]:
    """Environment for a Python subprocess of ours, sharing the test database."""
    env = dict(os.environ)
    env["DATABASE_NAME"] = TEST_DATABASE
    env.update(overrides)
    return env


class InThread:
    """Run `work` on a thread of its own (its own database connection), as another request
    or worker would; `result()` joins it and re-raises what it raised."""

    def __init__(self, work: Callable[[], Any]) -> None:
        self.value: Any = None
        self.error: BaseException | None = None

        def target() -> None:
            try:
                self.value = work()
            except BaseException as exc:  # handed to the test's thread by result()
                self.error = exc
            finally:
                connection.close()

        self.thread = threading.Thread(target=target, daemon=True)
        self.thread.start()

    def done(self) -> bool:
        return not self.thread.is_alive()

    def result(self, timeout: float = 60) -> Any:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the call on the other thread did not finish"
        if self.error is not None:
            raise self.error
        return self.value


class WorkerProcess:
    def __init__(self, log_path: Path, env: dict[str, str]):
        self.log_path = log_path
        self.env = env
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115
        self.process = subprocess.Popen(
            [
                sys.executable, "-m", "celery", "-A", "memsite", "worker", "--loglevel", "INFO",
                "--concurrency", "1", "--without-gossip", "--without-mingle", "--without-heartbeat",
                "--hostname", f"test-{os.getpid()}@%h",
            ],
            cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        log.close()

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process and self.process.poll() is None:
            os.killpg(self.process.pid, sig)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@pytest.fixture
def celery_worker_process(transactional_db, tmp_path):  # noqa: ARG001 - needs the test DB
    worker = WorkerProcess(tmp_path / "worker.log", service_env())
    worker.start()
    yield worker
    worker.stop()


@pytest.fixture
def billing_worker(transactional_db, tmp_path, fake_gateway):  # noqa: ARG001
    """A worker delivering to the fake gateway, with fast retries. Not started yet."""
    worker = WorkerProcess(tmp_path / "billing-worker.log", service_env(**billing_env(fake_gateway)))
    yield worker
    worker.stop()


# --- live server, MCP client, fakes ---------------------------------------------------
@pytest.fixture(scope="session")
def fake_llm():
    from tests.fakes import FakeOpenAI

    server = FakeOpenAI().start()
    yield server
    server.stop()


@pytest.fixture
def llm(settings):
    """A fake OpenAI-compatible LLM of this test's own, configured as the engine's LLM
    (the engine is rebuilt around it, and again after)."""
    from memories import engine
    from tests.fakes import FakeOpenAI

    engine.engine_close()
    fake = FakeOpenAI().start()
    settings.LLM_BASE_URL = f"{fake.url}/v1"
    settings.LLM_MODEL = "local-model"
    settings.LLM_API_KEY = "fake-key"
    yield fake
    fake.stop()
    engine.engine_close()


@pytest.fixture(scope="module")
def upstream_server():
    from tests.fakes import FakeChatUpstream

    server = FakeChatUpstream().start()
    yield server
    server.stop()


@pytest.fixture
def upstream(upstream_server, settings):
    """The chat proxy's default upstream: a fake on 127.0.0.1, reset around the test."""
    upstream_server.reset()
    settings.CHAT_UPSTREAM_BASE_URL = upstream_server.url
    settings.CHAT_UPSTREAM_API_KEY = "upstream-secret"
    yield upstream_server
    upstream_server.reset()


@pytest.fixture(scope="session")
def fake_gateway_server():
    from tests.fakes import FakeGateway

    server = FakeGateway().start()
    yield server
    server.stop()


@pytest.fixture
def fake_gateway(fake_gateway_server):
    fake_gateway_server.reset()
    yield fake_gateway_server
    fake_gateway_server.reset()


GATEWAY_KEY = "test-usage-ingest-key"


def billing_env(gateway) -> dict[str, str]:
    return {
        "PAYMENT_GATEWAY_URL": f"{gateway.url}/usage",
        "USAGE_INGEST_API_KEY": GATEWAY_KEY,
        "USAGE_RETRY_BASE_S": "0.1",
        "USAGE_RETRY_MAX_S": "0.5",
        "USAGE_DELIVERY_TIMEOUT_S": "1",
        "USAGE_CLAIM_LEASE_S": "3",
    }


@pytest.fixture(scope="session")
def memsite_server_process(django_db_setup, fake_llm, fake_gateway_server, tmp_path_factory):  # noqa: ARG001
    """uvicorn serving memsite.asgi on the test database, with fakes of the LLM and the gateway."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("live") / "web.log"
    env = service_env(
        LLM_BASE_URL=f"{fake_llm.url}/v1",
        LLM_MODEL="fake-model",
        LLM_API_KEY="fake-key",
        **billing_env(fake_gateway_server),
    )
    log = open(log_path, "ab")  # noqa: SIM115
    process = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "memsite.asgi:application", "--host", "127.0.0.1", "--port", str(port)],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    log.close()
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"live server exited:\n{log_path.read_text()}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return True
        except OSError:
            return False

    wait_for(up, timeout=60, what="live server")
    yield {"url": url, "log": log_path}
    os.killpg(process.pid, signal.SIGTERM)
    process.wait(30)


@pytest.fixture
def memsite_server(memsite_server_process, transactional_db, clean_vectors):  # noqa: ARG001
    return memsite_server_process["url"]


@pytest.fixture
def alice_key(alice) -> str:
    from memories.services import api_key_issue

    return api_key_issue(user=alice, name="alice-agent")[1]


@pytest.fixture
def bob_key(bob) -> str:
    from memories.services import api_key_issue

    return api_key_issue(user=bob, name="bob-agent")[1]


class McpCaller:
    """The official SDK client against the live server; one session per call."""

    def __init__(self, url: str, token: str | None, mode: str = "legacy"):
        self.url = f"{url}/engines/memory/mcp"
        self.token = token
        self.mode = mode
        self.statuses: list[int] = []

    async def _record(self, response) -> None:
        self.statuses.append(response.status_code)

    async def _session(self, work):
        import httpx2
        from mcp import Client
        from mcp.client.streamable_http import streamable_http_client

        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        hooks = {"response": [self._record]}
        async with httpx2.AsyncClient(headers=headers, timeout=60, event_hooks=hooks) as http:
            transport = streamable_http_client(self.url, http_client=http)
            async with Client(transport, mode=self.mode) as client:
                return await work(client)

    def run(self, work):
        import asyncio

        try:
            return asyncio.run(self._session(work))
        except BaseExceptionGroup as group:  # anyio task groups wrap what the client raised
            while isinstance(group, BaseExceptionGroup) and len(group.exceptions) == 1:
                group = group.exceptions[0]
            raise group from None

    def call(self, name: str, arguments: dict):
        return self.run(lambda client: client.call_tool(name, arguments))

    def ok(self, name: str, arguments: dict) -> dict:
        result = self.call(name, arguments)
        assert not result.is_error, result.structured_content
        return result.structured_content

    def error(self, name: str, arguments: dict) -> dict:
        """The error of a tool error result: in the text only (no structuredContent, which
        clients check against the tool's outputSchema)."""
        result = self.call(name, arguments)
        assert result.is_error, result.structured_content
        assert result.structured_content is None
        return json.loads(result.content[0].text)["error"]


@pytest.fixture
def mcp_as(memsite_server):
    return lambda token, mode="legacy": McpCaller(memsite_server, token, mode)


@pytest.fixture
def api_client():
    from rest_framework.test import APIClient

    def make(token: str | None = None) -> APIClient:
        client = APIClient()
        if token:
            client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
        return client

    return make


@pytest.fixture
def no_broker_backlog():
    """Drop the delivery tasks a test's many successful calls queued (the live server
    enqueues them; no worker runs here), so later worker tests do not wait behind them."""
    yield
    with connection.cursor() as cursor:
        cursor.execute("SELECT to_regclass('kombu_message') IS NOT NULL")
        if cursor.fetchone()[0]:
            cursor.execute("DELETE FROM kombu_message WHERE visible")


@pytest.fixture
def oidc(settings):
    from memories import oidc as oidc_module

    provider = FakeOIDC().start()
    settings.OIDC_ISSUER = provider.issuer
    settings.OIDC_AUDIENCE = "memsite"
    settings.OIDC_JWKS_URL = None  # discovered from the issuer
    oidc_module._jwks_client.cache_clear()
    oidc_module._discovered_jwks_url.cache_clear()
    yield provider
    provider.stop()
    oidc_module._jwks_client.cache_clear()
    oidc_module._discovered_jwks_url.cache_clear()


@pytest.fixture
def fake_gemini(settings, monkeypatch):
    from memories.engine.embedders import embedder_instances_clear

    fake = FakeGemini().start()
    monkeypatch.setenv("GOOGLE_GEMINI_BASE_URL", fake.url)
    settings.GOOGLE_API_KEY = "fake-gemini-key"
    embedder_instances_clear()  # none made for an earlier test's fake (stopped; its port is gone)
    yield fake
    fake.stop()
    embedder_instances_clear()
    # Put the table back as every other test expects it (384-d, no shadow column).
    from memories.engine import engine_reembed_abort
    from memories.engine.embedders import embedder_spec_refresh
    from memories.models import EmbedderState

    engine_reembed_abort()
    with connection.cursor() as cursor:
        for table in ("memories", "memories_entities"):
            cursor.execute(f'DELETE FROM "{table}"')  # noqa: S608 - our own table names
            cursor.execute(f'ALTER TABLE "{table}" ALTER COLUMN vector TYPE vector(384)')
    EmbedderState.objects.all().delete()
    embedder_spec_refresh()


def asgi_get(
    path: str, *, cookie: str = "", authorization: str = "", produced: list[str]
) -> tuple[int, bytes, list[int]]:
    """GET through the web process's ASGI application (signed in with a session cookie or
    a bearer key): the status, the body, and how many lines had been produced when each
    body message went out."""
    headers = [*([(b"cookie", cookie.encode())] if cookie else [])]
    headers += [(b"authorization", authorization.encode())] if authorization else []
    return _asgi_request("GET", path, headers=headers, produced=produced)


def asgi_post(path: str, form: dict[str, str], *, session: str, produced: list[str]) -> tuple[int, bytes, list[int]]:
    """A form POST (a web UI download) the same way, signed in with a session cookie and
    carrying the CSRF token as the page's form does."""
    from urllib.parse import urlencode

    token = "t" * 32  # a CSRF secret as the cookie holds it; the form may send it as is
    headers = [
        (b"cookie", f"sessionid={session}; csrftoken={token}".encode()),
        (b"content-type", b"application/x-www-form-urlencoded"),
    ]
    body = urlencode({**form, "csrfmiddlewaretoken": token}).encode()
    return _asgi_request("POST", path, headers=headers, body=body, produced=produced)


def _asgi_request(
    method: str, path: str, *, headers: list[tuple[bytes, bytes]], produced: list[str], body: bytes = b""
) -> tuple[int, bytes, list[int]]:
    from memsite.asgi import build_application

    async def main() -> tuple[int, bytes, list[int]]:
        app = build_application()
        started: list[int] = []
        chunks: list[bytes] = []
        sent_at: list[int] = []
        requested = False

        async def receive() -> dict:
            nonlocal requested
            if not requested:
                requested = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()  # the client stays until the response ends
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            if message["type"] == "http.response.start":
                started.append(message["status"])
            elif message["type"] == "http.response.body" and message.get("body"):
                sent_at.append(len(produced))
                chunks.append(message["body"])

        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "path": path.partition("?")[0],
            "raw_path": path.partition("?")[0].encode(),
            "query_string": path.partition("?")[2].encode(),
            "root_path": "",
            "headers": [(b"host", b"localhost"), *headers],
            "client": ("127.0.0.1", 40000),
            "server": ("localhost", 80),
        }
        await app(scope, receive, send)
        return started[0], b"".join(chunks), sent_at

    return asyncio.run(main())


def elsewhere(change) -> None:
    """A change made by another request meanwhile: its own thread and connection."""
    from concurrent.futures import ThreadPoolExecutor

    from django.db import connection

    def run():
        try:
            change()
        finally:
            connection.close()

    with ThreadPoolExecutor(1) as pool:
        pool.submit(run).result()


def lines_counted(monkeypatch, module, name: str) -> list[str]:
    """Replace `module.name` (a service returning lines to stream) with one whose lines are
    also appended to the returned list as they are produced: a test can tell how many had
    been read when each part of the response went out."""
    produced: list[str] = []
    export = getattr(module, name)

    def counted(*args, **kwargs):
        lines = export(*args, **kwargs)

        def each():
            for line in lines:
                produced.append(line)
                yield line

        return each()

    monkeypatch.setattr(module, name, counted)
    return produced


def held_after(monkeypatch, module, name: str, *, wait_s: float = 120.0) -> tuple[threading.Event, threading.Event]:
    """Replace `module.name` with one that, once the original returns (a row lock taken, a
    text embedded), sets `reached` and waits for `go` before returning: the caller's
    transaction is held at that point while the test does something else."""
    reached, go = threading.Event(), threading.Event()
    original = getattr(module, name)

    def held(*args, **kwargs):
        result = original(*args, **kwargs)
        reached.set()
        assert go.wait(wait_s)
        return result

    monkeypatch.setattr(module, name, held)
    return reached, go
