"""Review 19: the chat proxy's deadlines against an upstream that trickles its answer
(a real server on 127.0.0.1), the extraction attempt that outlives its deadline, and the
proxy's own thread pool."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from audit.models import AuditEvent
from billing.models import UsageEvent
from core.choices import Operation
from memories.models import IngestIntent
from proxy import selectors
from proxy.models import ProxyTurn
from proxy.services import proxy_turn_extract
from tests.conftest import serve_in_thread, wait_for
from tests.fakes import DripServer, dripped

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]

DRIP_S = 0.5
DEADLINE_S = 2.0
CHUNK = json.dumps({
    "id": "c1", "object": "chat.completion.chunk", "created": 0, "model": "m",
    "choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None}],
}).encode()  # fmt: skip


def Drip(mode: str) -> DripServer:
    """An upstream on 127.0.0.1 that never finishes an answer (bounded at 60 s):
    - "json": JSON headers at once, then one body byte every DRIP_S;
    - "headers": the status line and headers one byte every DRIP_S;
    - "sse_bytes": SSE headers, then one byte every DRIP_S that never makes an event;
    - "sse_events": SSE headers, then a whole content chunk every 0.3 s, never [DONE]."""

    def pieces():
        if mode == "headers":
            yield from dripped(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}", DRIP_S
            )
            return
        if mode == "json":
            yield b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000000\r\n\r\n", 0
        else:
            yield b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n", 0
        while True:
            if mode == "sse_events":
                yield b"data: " + CHUNK + b"\n\n", 0.3
            else:
                yield b" ", DRIP_S

    return DripServer(pieces)


@pytest.fixture
def drip_factory(settings):
    servers: list[Drip] = []

    def make(mode: str) -> Drip:
        server = Drip(mode)
        servers.append(server)
        settings.CHAT_UPSTREAM_BASE_URL = server.url
        settings.CHAT_UPSTREAM_API_KEY = "x"
        settings.PROXY_UPSTREAM_TIMEOUT_S = DEADLINE_S
        return server

    yield make
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def proxy_url(django_db_setup):  # noqa: ARG001 - the server uses the test database
    # Its own app (factory): an MCP lifespan runs once per app, and test_proxy.py has one.
    yield from serve_in_thread("memsite.asgi:build_application", factory=True, lifespan="on")


def _timed(work, *, limit: float):
    """work() on a thread, waited for at most `limit` s (without the fix it would hang).
    That is the only upper bound the tests put on the time: the upstreams here never finish,
    so the error code shows which deadline fired; a tighter bound (deadline + 1.5 s) failed
    on a loaded CI machine that took 5 s to answer a 2 s deadline."""
    box: dict = {}

    def target():
        started = time.monotonic()
        try:
            box["result"] = work()
        except Exception as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc
        box["elapsed"] = time.monotonic() - started

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(limit)
    assert not thread.is_alive(), f"the call was still pending after {limit} s"
    return box


def _nothing_billed_and_audited_as(code: str) -> None:
    wait_for(
        lambda: AuditEvent.objects.filter(operation=Operation.CHAT_COMPLETION, error_code=code).count() == 1,
        timeout=5,
        what="the failure's audit row",
    )
    assert not UsageEvent.objects.filter(operation=Operation.CHAT_COMPLETION).exists()
    assert not AuditEvent.objects.filter(operation=Operation.CHAT_COMPLETION, outcome="ok").exists()
    assert not ProxyTurn.objects.exists()


def _post(url: str, key: str, *, stream: bool = False) -> httpx.Response:
    body = {"model": "m", "stream": stream, "messages": [{"role": "user", "content": "hi"}]}
    return httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, json=body, timeout=60)


# --- 1. the upstream's answer has a deadline ----------------------------------------------
@pytest.mark.parametrize(("mode", "stream"), [("json", False), ("json", True), ("headers", False)])
def test_a_trickled_answer_read_whole_ends_at_the_total_deadline(proxy_url, alice_key, drip_factory, mode, stream):
    drip = drip_factory(mode)
    box = _timed(lambda: _post(proxy_url, alice_key, stream=stream), limit=DEADLINE_S + 6)
    response = box["result"]
    assert response.status_code == 504
    assert response.headers["X-Memsite-Error"] == "upstream_timeout"
    assert response.json()["error"]["code"] == "upstream_timeout"
    assert box["elapsed"] >= DEADLINE_S - 0.1  # at most `limit`: see _timed
    # No answer at all is audited as our refusals are (as `upstream_unreachable`).
    _nothing_billed_and_audited_as("backend_unavailable" if mode == "headers" else "upstream_timeout")
    wait_for(lambda: drip.open == 0, timeout=5, what="the upstream connection closed")


def test_the_openai_client_gets_the_timeout_error(proxy_url, alice_key, drip_factory):
    drip_factory("json")
    chat = openai.OpenAI(base_url=f"{proxy_url}/v1", api_key=alice_key, max_retries=0, timeout=60)
    box = _timed(
        lambda: chat.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}]),
        limit=DEADLINE_S + 6,
    )
    error = box["error"]
    assert isinstance(error, openai.APIStatusError) and error.status_code == 504
    assert error.code == "upstream_timeout"
    assert box["elapsed"] >= DEADLINE_S - 0.1
    _nothing_billed_and_audited_as("upstream_timeout")


def _stream_through_openai(url: str, key: str) -> dict:
    chat = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)
    got: list[str] = []
    try:
        for chunk in chat.chat.completions.create(model="m", stream=True, messages=[{"role": "user", "content": "x"}]):
            got.extend(c.delta.content or "" for c in chunk.choices)
    except openai.APIError as error:
        return {"text": "".join(got), "error": error}
    return {"text": "".join(got), "error": None}


def test_a_stream_without_events_ends_after_the_idle_limit(proxy_url, alice_key, drip_factory):
    drip = drip_factory("sse_bytes")
    box = _timed(lambda: _stream_through_openai(proxy_url, alice_key), limit=DEADLINE_S + 6)
    error = box["result"]["error"]
    assert error is not None and error.code == "upstream_timeout"
    assert box["result"]["text"] == ""
    assert box["elapsed"] >= DEADLINE_S - 0.1
    _nothing_billed_and_audited_as("upstream_timeout")
    wait_for(lambda: drip.open == 0, timeout=5, what="the upstream connection closed")


def test_a_stream_that_never_ends_is_cut_at_its_maximum_duration(proxy_url, alice_key, drip_factory, settings):
    drip = drip_factory("sse_events")
    settings.PROXY_STREAM_MAX_S = 3.0  # events keep coming every 0.3 s: never idle
    box = _timed(lambda: _stream_through_openai(proxy_url, alice_key), limit=settings.PROXY_STREAM_MAX_S + 6)
    error = box["result"]["error"]
    assert error is not None and error.code == "upstream_timeout"
    assert "longer than 3 s" in error.message
    assert box["result"]["text"].startswith("xxx")  # the events before the cut were relayed
    assert box["elapsed"] >= settings.PROXY_STREAM_MAX_S - 0.5
    # A cut stream is an unusable answer: audited as failed, not billed, no turn stored.
    _nothing_billed_and_audited_as("upstream_timeout")
    wait_for(lambda: drip.open == 0, timeout=5, what="the upstream connection closed")


# --- 3. the proxy's own threads ------------------------------------------------------------
def test_the_proxy_runs_its_blocking_steps_on_its_own_threads(proxy_url, upstream, alice_key, monkeypatch):
    seen: list[str] = []
    real = selectors.chat_memories_find

    def recording(*args, **kwargs):
        seen.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(selectors, "chat_memories_find", recording)
    response = _post(proxy_url, alice_key)
    assert response.status_code == 200
    assert seen and seen[0].startswith("proxy"), seen


# --- 2. an extraction attempt that outlives its deadline -----------------------------------
@pytest.fixture
def turn(alice, alice_scope):
    return ProxyTurn.objects.create(
        request_id="turn-review19",
        user=alice,
        tenant=alice_scope.tenant,
        client_app="",
        session_id="s",
        messages=[{"role": "user", "content": "My sister is called Ingrid."}, {"role": "assistant", "content": "Ok."}],
    )


def _extract_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "proxy-extract"]


@pytest.fixture
def slow_llm(llm, settings):
    settings.PROXY_MEMORY_STORE_TIMEOUT_S = 0.5
    llm.queue_facts("User's sister is called Ingrid")
    yield llm
    llm.release()
    for thread in _extract_threads():  # nothing may write after the test's database is flushed
        thread.join(30)


def _state(turn: ProxyTurn) -> ProxyTurn:
    turn.refresh_from_db()
    return turn


def test_an_overrunning_extraction_is_not_raced_by_a_retry(turn, slow_llm):
    slow_llm.hold()
    assert proxy_turn_extract(turn_pk=turn.pk) == "failed"
    slow_llm.wait_held()
    assert _state(turn).state == ProxyTurn.State.PENDING and turn.last_error == "timeout"
    # the thread left behind does not hold up the worker's shutdown
    assert _extract_threads() and all(t.daemon for t in _extract_threads())
    # the sweep comes back while the first ingest still runs: no second one starts
    assert proxy_turn_extract(turn_pk=turn.pk) == "in_flight"
    assert IngestIntent.objects.count() == 1 and _state(turn).attempts == 1
    slow_llm.release()
    wait_for(lambda: not _extract_threads(), timeout=30, what="the late ingest")
    assert IngestIntent.objects.get().state == IngestIntent.State.DONE
    assert proxy_turn_extract(turn_pk=turn.pk) == "done"
    assert _state(turn).state == ProxyTurn.State.DONE and turn.messages == []
    assert IngestIntent.objects.count() == 1  # extracted once


def test_a_late_completion_of_the_last_attempt_does_not_store_for_a_failed_turn(turn, slow_llm, settings):
    settings.PROXY_EXTRACTION_RETRY_FOR_S = 0  # its first failure is past the retry window
    slow_llm.hold()
    assert proxy_turn_extract(turn_pk=turn.pk) == "failed"
    slow_llm.wait_held()
    # the last attempt overran, but its ingest is recorded and will finish: not failed yet
    assert _state(turn).state == ProxyTurn.State.PENDING
    slow_llm.release()
    wait_for(lambda: not _extract_threads(), timeout=30, what="the late ingest")
    assert proxy_turn_extract(turn_pk=turn.pk) == "done"
    assert _state(turn).state == ProxyTurn.State.DONE
    audited = AuditEvent.objects.filter(operation=Operation.INGEST, outcome="ok").get()
    assert audited.memory_ids  # what was stored belongs to a turn marked done


def test_a_late_start_stores_nothing_once_a_later_attempt_took_over(turn, slow_llm, monkeypatch):
    import proxy.services as proxy_services

    real = proxy_services.memory_ingest
    first_gate = threading.Event()
    calls: list[int] = []

    first_done = threading.Event()

    def ingest(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            return real(*args, **kwargs)
        first_gate.wait(30)  # attempt 1 stalls before it records its intent
        try:
            return real(*args, **kwargs)
        finally:
            first_done.set()

    monkeypatch.setattr(proxy_services, "memory_ingest", ingest)
    assert proxy_turn_extract(turn_pk=turn.pk) == "failed"
    assert not IngestIntent.objects.exists()
    slow_llm.hold()
    assert proxy_turn_extract(turn_pk=turn.pk) == "failed"  # attempt 2 overruns in the LLM
    slow_llm.wait_held()
    first_gate.set()  # attempt 1 goes on: the turn waits for attempt 2 now
    wait_for(lambda: first_done.is_set() or IngestIntent.objects.count() > 1, timeout=30, what="attempt 1")
    assert IngestIntent.objects.count() == 1  # attempt 1 recorded no ingest of its own
    slow_llm.release()
    wait_for(lambda: not _extract_threads(), timeout=30, what="attempt 2")
    assert proxy_turn_extract(turn_pk=turn.pk) == "done"
    assert IngestIntent.objects.count() == 1
