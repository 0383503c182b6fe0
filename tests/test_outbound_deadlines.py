"""Every outbound call has a TOTAL deadline, not only a per-read one (review 19).

The server here is real, on 127.0.0.1: it answers with its headers (or drips them), then
drips the body one byte every half second, which no per-read timeout ever ends. Each call
must end within about its timeout with its usual coded error. A watchdog stops the server
after STOP_AFTER_S, so that without the fix a test fails on the time instead of hanging."""

from __future__ import annotations

import ssl
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from core.errors import ErrorCode, ServiceError
from core.http_deadline import ResponseTooLarge, deadline_client
from core.scope import CallContext
from memories.auth import Principal
from memories.operations import operation_execute
from tests.conftest import internal_call
from tests.fakes import DripServer, dripped

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]

DRIP_S = 0.5
STOP_AFTER_S = 15.0
SLACK_S = 1.5  # the coarse bound: the timeout plus this, never a claim about speed
OK_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000000\r\n\r\n"


def Drip(*, head: bytes = OK_HEAD, drip_head: bool = False, wrap: Callable[[Any], Any] | None = None) -> DripServer:
    """Sends `head` (at once, or a byte every DRIP_S with drip_head), then a body byte
    every DRIP_S until stopped (after STOP_AFTER_S at the latest)."""

    def pieces() -> list[tuple[bytes, float]]:
        first = dripped(head, DRIP_S) if drip_head else [(head, 0.0)]
        return first + dripped(b" " * 10_000, DRIP_S)

    return DripServer(pieces, wrap=wrap, stop_after_s=STOP_AFTER_S)


@pytest.fixture
def drip():
    server = Drip()
    yield server
    server.stop()


def timed(work: Callable[[], Any]) -> tuple[Any, float]:
    """(the result or the exception raised, seconds taken)."""
    started = time.monotonic()
    try:
        outcome = work()
    except Exception as exc:  # noqa: BLE001 - the test asserts on it
        outcome = exc
    return outcome, time.monotonic() - started


def run(user, name: str, **arguments: Any) -> Any:
    return operation_execute(Principal(user=user, method="api_key"), name, arguments, call=CallContext(channel="mcp"))


# --- the shared helper ------------------------------------------------------------------
@pytest.mark.parametrize("drip_head", [False, True], ids=["body", "headers"])
def test_deadline_client_ends_a_dripped_answer_at_its_total_deadline(drip_head):
    server = Drip(drip_head=drip_head)
    try:
        with deadline_client(total_s=1.0, max_bytes=None) as client:
            outcome, elapsed = timed(lambda: client.post(f"{server.url}/x", json={}))
    finally:
        server.stop()
    assert isinstance(outcome, httpx.TimeoutException), outcome
    assert elapsed < 1.0 + SLACK_S


def test_deadline_client_stops_at_its_byte_cap(drip):
    with deadline_client(total_s=30.0, max_bytes=3) as client:
        outcome, elapsed = timed(lambda: client.post(f"{drip.url}/x", json={}))
    assert isinstance(outcome, ResponseTooLarge), outcome
    assert isinstance(outcome, httpx.HTTPError)  # callers' existing `except httpx.HTTPError` covers it
    assert elapsed < 2 * DRIP_S * 3 + SLACK_S


# --- engine LLM (OpenAI SDK / Gemini SDK, built by mem0) ----------------------------------
@pytest.fixture
def fresh_engine():
    from memories import engine

    engine.engine_close()
    yield engine
    engine.engine_close()


def test_ingest_llm_ends_at_llm_timeout_as_backend_unavailable(drip, settings, alice_scope, fresh_engine):
    from memories.services import memory_ingest

    settings.LLM_BASE_URL = f"{drip.url}/v1"
    settings.LLM_MODEL = "m"
    settings.LLM_API_KEY = "k"
    settings.LLM_TIMEOUT_S = 2.0
    settings.LLM_MAX_RETRIES = 0
    fresh_engine.engine_warm_up()  # the local embedder's first load is not the LLM's time
    outcome, elapsed = timed(
        lambda: memory_ingest(alice_scope, messages=[{"role": "user", "content": "I like tea."}], call=internal_call())
    )
    assert isinstance(outcome, ServiceError), outcome
    assert outcome.code == ErrorCode.BACKEND_UNAVAILABLE
    assert elapsed < 2.0 + SLACK_S


def test_llm_retries_are_bounded_by_llm_max_retries(drip, settings, fresh_engine):
    settings.LLM_BASE_URL = f"{drip.url}/v1"
    settings.LLM_MODEL = "m"
    settings.LLM_TIMEOUT_S = 1.0
    settings.LLM_MAX_RETRIES = 1
    fresh_engine.engine_warm_up()
    outcome, elapsed = timed(lambda: fresh_engine.engine_llm_json("answer {}"))
    assert isinstance(outcome, fresh_engine.EngineError), outcome
    assert drip.connections == 2  # one try and one retry, not the SDK's default two retries
    assert elapsed < 2 * 1.0 + 2 + SLACK_S  # two deadlines and the SDK's backoff (under 2 s)


def test_gemini_llm_ends_at_llm_timeout(drip, settings, monkeypatch, fresh_engine):
    monkeypatch.setenv("GOOGLE_GEMINI_BASE_URL", drip.url)
    settings.GOOGLE_API_KEY = "g"
    settings.LLM_TIMEOUT_S = 2.0
    settings.LLM_MAX_RETRIES = 0
    fresh_engine.engine_warm_up()
    outcome, elapsed = timed(lambda: fresh_engine.engine_llm_json("answer {}"))
    assert isinstance(outcome, fresh_engine.EngineError), outcome
    assert elapsed < 2.0 + SLACK_S
    assert drip.connections == 1


def test_gemini_embedder_ends_at_embedder_timeout(drip, settings, monkeypatch, fresh_engine):
    monkeypatch.setenv("GOOGLE_GEMINI_BASE_URL", drip.url)
    settings.GOOGLE_API_KEY = "g"
    settings.EMBEDDER = "gemini"
    settings.EMBEDDING_DIMS = settings.GEMINI_EMBEDDING_DIMS
    settings.EMBEDDER_TIMEOUT_S = 2.0
    # Built first (mem0's engine, the Gemini client; it calls nothing remote), so the timed
    # call is the request alone: under CI load the build took 1.7 s more (seen at 3.74 s).
    fresh_engine.engine_warm_up()
    outcome, elapsed = timed(lambda: fresh_engine.engine_embed_query("where do I live?"))
    assert isinstance(outcome, fresh_engine.EngineError), outcome
    assert elapsed < 2.0 + SLACK_S
    assert drip.connections == 1  # no retry


# --- search_web ----------------------------------------------------------------------------
def test_search_web_ends_at_web_search_timeout(drip, settings, alice):
    settings.TAVILY_API_KEY = "t"
    settings.TAVILY_ENDPOINT = f"{drip.url}/search"
    settings.WEB_SEARCH_TIMEOUT_S = 2.0
    outcome, elapsed = timed(lambda: run(alice, "search_web", query="weather"))
    assert isinstance(outcome, ServiceError), outcome
    assert outcome.code == ErrorCode.WEB_SEARCH_UNAVAILABLE
    assert elapsed < 2.0 + SLACK_S


# --- memory_after_turn's LLM extraction ----------------------------------------------------
def test_after_turn_llm_extraction_ends_at_its_timeout(drip, settings, alice):
    settings.MCP_MEMORY_HEURISTIC_ENABLED = True
    settings.MCP_MEMORY_HEURISTIC_BASE_URL = f"{drip.url}/v1"
    settings.MCP_MEMORY_HEURISTIC_TIMEOUT_MS = 2000
    item = {"type": "message", "role": "user", "content": "I always use Helix as my editor."}
    outcome, elapsed = timed(
        lambda: run(alice, "memory_after_turn", session_id="s", turn_id="t", input_items=[item], output_items=[])
    )
    assert isinstance(outcome, ServiceError), outcome
    assert outcome.code == ErrorCode.LLM_UNAVAILABLE
    assert elapsed < 2.0 + SLACK_S


# --- billing delivery ------------------------------------------------------------------------
@pytest.fixture
def one_event(settings, alice_scope):
    from billing.models import UsageEvent
    from memories.services import memory_remember

    settings.USAGE_DELIVERY_TIMEOUT_S = 1.0
    settings.USAGE_CLAIM_LEASE_S = 5
    memory_remember(alice_scope, memory="billed once", call=internal_call())
    assert UsageEvent.objects.count() == 1
    return UsageEvent.objects.get()


def test_billing_accepted_but_dripped_answer_is_delivered_once(settings, one_event):
    from billing.models import UsageEvent
    from billing.services import usage_events_deliver

    server = Drip()  # 200 at once, then a body that never ends
    settings.PAYMENT_GATEWAY_URL = f"{server.url}/events"
    try:
        report, elapsed = timed(usage_events_deliver)
        assert elapsed < 1.0 + SLACK_S
        assert report.delivered == 1, report
        assert usage_events_deliver().delivered == 0  # a second worker finds nothing to send
    finally:
        server.stop()
    assert server.connections == 1  # sent once
    assert UsageEvent.objects.get().status == UsageEvent.Status.DELIVERED


def test_billing_post_with_dripped_headers_ends_inside_its_lease(settings, one_event):
    from billing.models import UsageEvent
    from billing.services import usage_events_deliver

    server = Drip(drip_head=True)  # the answer's status line itself arrives a byte at a time
    settings.PAYMENT_GATEWAY_URL = f"{server.url}/events"
    try:
        report, elapsed = timed(usage_events_deliver)
        assert elapsed < 1.0 + SLACK_S  # USAGE_DELIVERY_TIMEOUT_S in all, far inside the 5 s lease
        assert (report.retrying, report.errors) == (1, ["timeout"]), report
        # Settled by its own worker before its lease ended: nobody else sends it meanwhile.
        assert usage_events_deliver().delivered == 0
    finally:
        server.stop()
    assert server.connections == 1
    event = UsageEvent.objects.get()
    assert (event.status, event.claim_token, event.attempts) == (UsageEvent.Status.PENDING, None, 1)


# --- OAuth client metadata document (unauthenticated) ---------------------------------------
@pytest.mark.parametrize("drip_head", [False, True], ids=["body", "headers"])
def test_cimd_fetch_ends_at_its_timeout(settings, tmp_path, drip_head):
    from oauth.cimd import MetadataDocumentError, metadata_document_fetch
    from tests.oauth_helpers import tls_files

    ca, cert, key = tls_files(tmp_path)
    settings.OAUTH_CIMD_ALLOW_LOOPBACK = True
    settings.OAUTH_CIMD_CA_FILE = str(ca)
    settings.OAUTH_CIMD_TIMEOUT_S = 1.0
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(str(cert), str(key))
    server = Drip(drip_head=drip_head, wrap=lambda conn: context.wrap_socket(conn, server_side=True))
    try:
        outcome, elapsed = timed(lambda: metadata_document_fetch(f"https://127.0.0.1:{server.port}/client.json"))
    finally:
        server.stop()
    assert isinstance(outcome, MetadataDocumentError), outcome
    assert str(outcome) == "client_id metadata document could not be fetched"
    assert elapsed < 1.0 + SLACK_S


# --- name lookups (getaddrinfo takes no timeout) ---------------------------------------------
@pytest.fixture
def resolver(monkeypatch):
    """The system resolver, answering `names` itself: a name mapped to None never answers
    (a resolver retrying a dead server), one mapped to addresses answers with them. Every
    other name goes to the real lookup. The boundary mocked is DNS, nothing of ours."""
    import socket
    import threading

    real = socket.getaddrinfo
    names: dict[str, list[str] | None] = {}
    never = threading.Event()

    def getaddrinfo(host, port, *args, **kwargs):
        if host not in names:
            return real(host, port, *args, **kwargs)
        addresses = names[host]
        if addresses is None:
            never.wait(STOP_AFTER_S)
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, port)) for address in addresses]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    yield names
    never.set()


def test_a_name_lookup_that_never_answers_ends_at_the_total_deadline(resolver):
    resolver["stuck.example"] = None
    with deadline_client(total_s=1.0, max_bytes=None) as client:
        outcome, elapsed = timed(lambda: client.get("http://stuck.example:8080/"))
    assert isinstance(outcome, httpx.ConnectTimeout), outcome
    assert elapsed < 1.0 + SLACK_S


def test_each_address_of_a_name_is_tried_in_turn_and_the_host_is_kept(resolver):
    """127.0.0.2 refuses (the server listens on 127.0.0.1 only); the next address answers,
    asked for the name, not the address."""
    from tests.fakes import FakeOpenAI

    server = FakeOpenAI().start()
    port = server.url.rsplit(":", 1)[1]
    resolver["two.example"] = ["127.0.0.2", "127.0.0.1"]
    resolver["none.example"] = ["127.0.0.2"]
    try:
        with deadline_client(total_s=5.0, max_bytes=None) as client:
            answered = client.post(f"http://two.example:{port}/v1/chat/completions", json={"messages": []})
            refused, _ = timed(lambda: client.post(f"http://none.example:{port}/v1/chat/completions", json={}))
    finally:
        server.stop()
    assert answered.status_code == 200
    assert server.requests[-1]["headers"]["host"] == f"two.example:{port}"
    assert isinstance(refused, httpx.ConnectError), refused


def test_cimd_name_lookup_ends_at_the_fetch_timeout(settings, resolver):
    from oauth.cimd import MetadataDocumentError, metadata_document_fetch

    settings.OAUTH_CIMD_TIMEOUT_S = 1.0
    resolver["stuck.example"] = None
    outcome, elapsed = timed(lambda: metadata_document_fetch("https://stuck.example/client.json"))
    assert isinstance(outcome, MetadataDocumentError), outcome
    assert str(outcome) == "client_id metadata document host does not resolve"
    assert elapsed < 1.0 + SLACK_S
