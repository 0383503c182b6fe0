"""The chat proxy against bad input and odd upstreams: every call is a coded answer in
OpenAI's error shape (never a 500 or Django's HTML), leaves exactly one audit row, is
billed only when it succeeded, and never stores half a turn.

Upstreams here are scripted raw HTTP servers on 127.0.0.1 (an answer that is not JSON,
a stream cut off or stalled, NUL in the answer...); nothing touches the internet."""

from __future__ import annotations

import contextlib
import json
import threading
import time
import weakref
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import openai
import pytest

from audit.models import AuditEvent
from billing.models import UsageEvent
from core.choices import Operation
from memories.models import SessionEvent
from memories.services import api_key_issue
from proxy import views
from proxy.models import ProxyTurn, TokenConfig
from proxy.services import token_config_save
from tests.conftest import internal_call, serve_in_thread, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]


# --- servers -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def proxy_url(django_db_setup):  # noqa: ARG001 - the server uses the test database
    # A fresh app (factory): the module-level one's MCP lifespan may run only once per
    # process, and tests/test_proxy.py serves that one.
    yield from serve_in_thread("memsite.asgi:build_application", factory=True)


class ScriptedUpstream:
    """Answers /v1/chat/completions with whatever `script(handler, payload)` writes:
    raw status line, headers and bytes (HTTP/1.0, so closing ends the body)."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.script: Callable[[BaseHTTPRequestHandler, dict], None] | None = None
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_message(self, *args):
                pass

            def do_POST(self):  # noqa: N802 - http.server API
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                payload = json.loads(raw)
                fake.requests.append(payload)
                assert fake.script is not None
                # the proxy may give up first (a timeout test)
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    fake.script(self, payload)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"


@pytest.fixture(scope="module")
def scripted_server():
    server = ScriptedUpstream()
    yield server
    server.httpd.shutdown()
    server.httpd.server_close()


@pytest.fixture
def scripted(scripted_server, settings):
    scripted_server.requests.clear()
    scripted_server.script = None
    settings.CHAT_UPSTREAM_BASE_URL = scripted_server.url
    settings.CHAT_UPSTREAM_API_KEY = "upstream-secret"
    return scripted_server


def whole(status: int, body: bytes, *, content_type: str = "application/json", headers: dict | None = None):
    def script(handler, payload):  # noqa: ARG001
        handler.send_response(status)
        handler.send_header("Content-Type", content_type)
        for name, value in (headers or {}).items():
            handler.send_header(name, value)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    return script


def sse(*events: bytes, stall: float = 0.0):
    """An SSE answer of these raw events, then (after `stall` seconds) the close."""

    def script(handler, payload):  # noqa: ARG001
        handler.send_response(200)
        handler.send_header("Content-Type", "text/event-stream")
        handler.end_headers()
        for event in events:
            handler.wfile.write(event)
            handler.wfile.flush()
        if stall:
            time.sleep(stall)

    return script


def chunk(delta: dict, finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    body = {"id": "c", "object": "chat.completion.chunk", "choices": [choice]}
    return f"data: {json.dumps(body)}\n\n".encode()


def completion(message) -> bytes:
    return json.dumps({"id": "c", "object": "chat.completion", "choices": [{"index": 0, "message": message}]}).encode()


# --- helpers -------------------------------------------------------------------------
def post(url: str, key: str, body, **headers: str) -> httpx.Response:
    """The body as given: bytes, or JSON with ASCII escapes (so NUL and lone surrogates
    arrive as \\u0000 / \\ud800, as a client would send them)."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        f"{url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json", **headers},
        content=content,
        timeout=30,
    )


def stream_body(url: str, key: str, body: dict) -> tuple[int, bytes]:
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, json=body, timeout=30
    ) as response:
        return response.status_code, b"".join(response.iter_raw())


def chat_rows():
    return AuditEvent.objects.filter(operation=Operation.CHAT_COMPLETION)


def usage_count() -> int:
    return UsageEvent.objects.filter(operation=Operation.CHAT_COMPLETION).count()


def assert_failed_and_nothing_stored(code: str) -> None:
    """One audit row (error, the code), no usage event, no turn, no session item."""
    rows = list(chat_rows())
    assert len(rows) == 1, [(r.outcome, r.error_code) for r in rows]
    assert rows[0].outcome == AuditEvent.Outcome.ERROR
    assert rows[0].error_code == code
    assert usage_count() == 0
    assert ProxyTurn.objects.count() == 0
    assert SessionEvent.objects.count() == 0


def assert_refused(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    assert response.headers["x-memsite-error"] == code
    error = response.json()["error"]
    assert error["code"] == code and error["message"]


def wait_recorded(count: int = 1) -> None:
    # a streamed call is recorded after its last byte: just after the client saw it
    wait_for(lambda: chat_rows().count() >= count, timeout=10, what="the streamed call's audit row")
    time.sleep(0.2)


def stored_items() -> list[dict]:
    return list(SessionEvent.objects.order_by("id").values_list("item", flat=True))


USER = [{"role": "user", "content": "hi"}]


# --- defects 1 and 2: an odd or non-JSON 200 is a 502, audited, not billed or stored --
@pytest.mark.parametrize(
    "body",
    [
        completion("hi"),  # message is a string
        completion({"content": "x", "tool_calls": [{"id": "a", "function": "oops"}]}),
        completion({"content": 5}),
        json.dumps({"choices": []}).encode(),
        json.dumps([1, 2]).encode(),
        b"<html>oops not json",
        b"[" * 100_000,  # deep enough to make json.loads raise RecursionError
    ],
    ids=["message-string", "function-string", "content-number", "no-choices", "not-object", "html", "deep"],
)
def test_an_unusable_200_is_a_502_upstream_error(proxy_url, scripted, alice_key, body):
    scripted.script = whole(200, body)
    response = post(proxy_url, alice_key, {"model": "m", "messages": USER})
    assert_refused(response, 502, "upstream_error")
    assert_failed_and_nothing_stored("upstream_error")
    row = chat_rows().get()
    assert row.detail["upstream_status"] == 200  # the audit row still says what the upstream did


def test_an_unusable_200_through_the_openai_client(proxy_url, scripted, alice_key):
    scripted.script = whole(200, b"<html>oops not json", content_type="text/html")
    chat = openai.OpenAI(base_url=f"{proxy_url}/v1", api_key=alice_key, max_retries=0)
    with pytest.raises(openai.APIStatusError) as caught:
        chat.chat.completions.create(model="m", messages=USER)
    assert caught.value.status_code == 502


def test_a_json_answer_to_a_stream_request_is_checked_like_a_whole_one(proxy_url, scripted, alice_key):
    scripted.script = whole(200, completion("hi"))
    response = post(proxy_url, alice_key, {"model": "m", "stream": True, "messages": USER})
    assert_refused(response, 502, "upstream_error")
    assert_failed_and_nothing_stored("upstream_error")


def test_odd_stream_chunks_are_skipped_and_the_stream_goes_on(proxy_url, scripted, alice_key):
    events = [
        chunk({"role": "assistant", "content": ""}),
        chunk({"tool_calls": [{"index": "abc", "id": "x", "function": {"name": "f"}}]}),
        chunk({"tool_calls": [{"index": 0, "id": 5, "function": {"name": 7, "arguments": "{}"}}]}),
        chunk({"tool_calls": "nope"}),
        b'data: {"choices": [{"delta": "text"}]}\n\n',
        b"data: " + b"[" * 5000 + b"\n\n",
        b"data: not json\n\n",
        chunk({"content": "fine"}),
        chunk({}, finish="stop"),
        b"data: [DONE]\n\n",
    ]
    scripted.script = sse(*events)
    status, body = stream_body(proxy_url, alice_key, {"model": "m", "stream": True, "messages": USER})
    assert status == 200
    assert body == b"".join(events)  # relayed unchanged, to the end
    wait_recorded()
    assert chat_rows().get().outcome == AuditEvent.Outcome.OK and usage_count() == 1
    items = stored_items()
    assert {"type": "message", "role": "assistant", "content": "fine"} in items
    # the one tool-call piece that could be placed (index 0; its non-string id and name left out)
    assert [i for i in items if i["type"] == "function_call"] == [
        {"type": "function_call", "call_id": "", "name": "", "arguments": "{}"}
    ]


# --- defect 3: a stream cut off or stalled ends with an error event -------------------
def test_a_stream_cut_off_ends_with_an_error_event_and_is_not_recorded_as_a_turn(proxy_url, scripted, alice_key):
    first = chunk({"role": "assistant", "content": "Hel"})
    scripted.script = sse(first, b'data: {"choices": [{"delta": {"content": "lo wo')  # then closes
    status, body = stream_body(proxy_url, alice_key, {"model": "m", "stream": True, "messages": USER})
    assert status == 200
    assert body.startswith(first)
    assert b"[DONE]" not in body and b'"content": "lo wo' not in body  # no half event relayed
    last = json.loads(body[len(first) :].removeprefix(b"data: "))
    assert last["error"]["code"] == "upstream_error"
    wait_recorded()
    assert_failed_and_nothing_stored("upstream_error")


def test_a_cut_off_stream_raises_in_the_openai_client(proxy_url, scripted, alice_key):
    scripted.script = sse(chunk({"role": "assistant", "content": "Hel"}))
    chat = openai.OpenAI(base_url=f"{proxy_url}/v1", api_key=alice_key, max_retries=0)
    stream = chat.chat.completions.create(model="m", stream=True, messages=USER)
    with pytest.raises(openai.APIError):
        list(stream)
    wait_recorded()
    assert_failed_and_nothing_stored("upstream_error")


@pytest.fixture
def short_timeout(settings, monkeypatch):
    """The pooled upstream client is built per event loop with the timeout of that
    moment: a fresh pool picks up the short one."""
    settings.PROXY_UPSTREAM_TIMEOUT_S = 0.5
    monkeypatch.setattr(views, "_clients", weakref.WeakKeyDictionary())


@pytest.mark.usefixtures("short_timeout")
def test_a_stalled_stream_ends_with_a_timeout_event(proxy_url, scripted, alice_key):
    first = chunk({"role": "assistant", "content": "Hel"})
    scripted.script = sse(first, stall=2.0)
    status, body = stream_body(proxy_url, alice_key, {"model": "m", "stream": True, "messages": USER})
    assert status == 200 and body.startswith(first) and b"[DONE]" not in body
    assert json.loads(body[len(first) :].removeprefix(b"data: "))["error"]["code"] == "upstream_timeout"
    wait_recorded()
    assert_failed_and_nothing_stored("upstream_timeout")


@pytest.mark.usefixtures("short_timeout")
def test_a_stalled_whole_answer_is_a_504(proxy_url, scripted, alice_key):
    def script(handler, payload):  # noqa: ARG001
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.end_headers()
        handler.wfile.write(b'{"choices": [')
        handler.wfile.flush()
        time.sleep(2.0)

    scripted.script = script
    response = post(proxy_url, alice_key, {"model": "m", "messages": USER})
    assert_refused(response, 504, "upstream_timeout")
    assert_failed_and_nothing_stored("upstream_timeout")


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_before_the_answer_leaves_a_failed_row_and_no_bill(proxy_url, scripted, alice_key, stream):
    """An SDK timeout while the upstream still thinks: Django cancels the view on the
    disconnect, and the call was recorded nowhere (rate limited, upstream paid, no row)."""

    def script(handler, payload):  # noqa: ARG001
        time.sleep(2.0)  # the client gives up first; what is written then goes nowhere
        try:
            handler.send_response(200)
            handler.end_headers()
        except OSError:
            pass

    scripted.script = script
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{proxy_url}/v1/chat/completions",
            headers={"Authorization": f"Bearer {alice_key}"},
            json={"model": "m", "stream": stream, "messages": USER},
            timeout=httpx.Timeout(30, read=0.5),
        )
    wait_recorded()
    assert_failed_and_nothing_stored("client_gone")


def test_a_client_that_leaves_mid_stream_keeps_what_it_saw_as_the_turn(proxy_url, scripted, alice_key):
    """Like a user stopping a generation: the partial answer is the turn (recorded once,
    billed, flagged), not an upstream failure."""
    first = chunk({"role": "assistant", "content": "Hel"})
    scripted.script = sse(first, stall=3.0)
    with httpx.stream(
        "POST",
        f"{proxy_url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {alice_key}"},
        json={"model": "m", "stream": True, "messages": USER},
        timeout=30,
    ) as response:
        assert next(response.iter_raw()) == first
    wait_recorded()
    row = chat_rows().get()
    assert row.outcome == AuditEvent.Outcome.OK and row.detail["stopped_by_client"] is True
    assert usage_count() == 1 and stored_items()[-1]["content"] == "Hel"


def test_an_error_event_from_the_upstream_is_relayed_and_the_call_not_billed(proxy_url, scripted, alice_key):
    events = [chunk({"role": "assistant", "content": "Hel"}), b'data: {"error": {"message": "overloaded"}}\n\n']
    scripted.script = sse(*events)
    status, body = stream_body(proxy_url, alice_key, {"model": "m", "stream": True, "messages": USER})
    assert status == 200 and body == b"".join(events)  # the upstream's own error, no second one
    wait_recorded()
    assert_failed_and_nothing_stored("upstream_error")


def test_a_stream_ending_without_the_last_blank_line_is_whole(proxy_url, scripted, alice_key):
    events = [chunk({"role": "assistant", "content": "Hello"}), chunk({}, finish="stop"), b"data: [DONE]\n"]
    scripted.script = sse(*events)
    status, body = stream_body(proxy_url, alice_key, {"model": "m", "stream": True, "messages": USER})
    assert status == 200 and body.endswith(b"data: [DONE]\n\n")
    wait_recorded()
    assert chat_rows().get().outcome == AuditEvent.Outcome.OK and usage_count() == 1
    assert ProxyTurn.objects.count() == 1


def test_a_stream_with_a_finish_reason_but_no_done_is_whole(proxy_url, scripted, alice_key):
    scripted.script = sse(chunk({"role": "assistant", "content": "Hello"}), chunk({}, finish="stop"))
    status, body = stream_body(proxy_url, alice_key, {"model": "m", "stream": True, "messages": USER})
    assert status == 200 and b"error" not in body
    wait_recorded()
    assert chat_rows().get().outcome == AuditEvent.Outcome.OK and usage_count() == 1


# --- defect 4: what the upstream sends never loses the recorded turn -------------------
def test_nul_in_a_whole_answer_is_relayed_unchanged_and_stored_replaced(proxy_url, scripted, alice_key):
    body = completion(
        {
            "role": "assistant",
            "content": "ans\u0000wer \ud800",
            "tool_calls": [{"id": "c\u0000", "type": "function", "function": {"name": "f", "arguments": "\u0000"}}],
        }
    )
    scripted.script = whole(200, body)
    response = post(proxy_url, alice_key, {"model": "m", "messages": USER})
    assert response.status_code == 200 and response.content == body
    row = chat_rows().get()
    assert row.outcome == AuditEvent.Outcome.OK and usage_count() == 1
    items = stored_items()
    assert items[1] == {"type": "message", "role": "assistant", "content": "ans\ufffdwer \ufffd"}
    assert items[2]["call_id"] == "c\ufffd" and items[2]["arguments"] == "\ufffd"
    assert ProxyTurn.objects.get().messages[-1]["content"] == "ans\ufffdwer \ufffd"


def test_nul_in_a_streamed_answer_is_stored_replaced(proxy_url, scripted, alice_key):
    events = [chunk({"role": "assistant", "content": "ans\u0000"}), chunk({"content": "wer"}, "stop")]
    events.append(b"data: [DONE]\n\n")
    scripted.script = sse(*events)
    status, body = stream_body(proxy_url, alice_key, {"model": "m", "stream": True, "messages": USER})
    assert status == 200 and body == b"".join(events)
    wait_recorded()
    assert chat_rows().get().outcome == AuditEvent.Outcome.OK and usage_count() == 1
    assert stored_items()[-1]["content"] == "ans\ufffdwer"


@pytest.mark.parametrize(
    "body",
    [
        {"model": "m\u0000", "messages": USER},
        {"model": 5, "messages": USER},
        # The client's own text (a relayed answer's NUL is replaced: see below).
        {
            "model": "m",
            "messages": [{"role": "user", "content": "a\u0000b"}, {"role": "assistant", "content": "ok"}, *USER],
        },
        {
            "model": "m",
            "messages": [
                *USER,
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": "x"}]},
                {"role": "tool", "tool_call_id": "c", "content": "r"},
            ],
        },
        {
            "model": "m",
            "messages": [
                *USER,
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": {"name": 5}}]},
                {"role": "tool", "tool_call_id": "c", "content": "r"},
            ],
        },
        {"model": "m", "messages": [{"role": "function", "content": "r"}, *USER]},
        {"model": "m", "messages": USER, "metadata": {"k\u0000": 1}},
        {"model": "m", "messages": USER, "max_tokens": "abc"},
        {"model": "m", "messages": USER, "max_tokens": True},
        {"model": "m", "messages": USER, "max_completion_tokens": 0},
    ],
    ids=[
        "nul-model",
        "model-number",
        "nul-earlier-user",
        "function-string",
        "function-name-number",
        "function-role-no-name",
        "nul-key",
        "max-tokens-string",
        "max-tokens-bool",
        "max-completion-tokens-zero",
    ],
)
def test_a_request_the_turn_could_not_be_stored_from_is_refused_up_front(proxy_url, scripted, alice_key, body):
    scripted.script = whole(200, completion({"role": "assistant", "content": "never"}))
    response = post(proxy_url, alice_key, body)
    assert_refused(response, 422, "invalid_messages")
    assert "\u0000" not in response.text and "\\u0000" not in response.text  # names where, not what
    assert scripted.requests == []
    assert_failed_and_nothing_stored("invalid_argument")


# --- defects 5 and 8: NUL or a lone surrogate in the user's message --------------------
@pytest.mark.parametrize(
    "content",
    [
        "hi\u0000there",
        [{"type": "text", "text": "hi\u0000there"}],
        "a\ud800b",
        [{"type": "text", "text": "a\udfffb"}],
    ],
    ids=["nul", "nul-in-part", "surrogate", "surrogate-in-part"],
)
def test_nul_or_a_lone_surrogate_in_the_user_message_is_a_422(proxy_url, scripted, alice_key, content):
    response = post(proxy_url, alice_key, {"model": "m", "messages": [{"role": "user", "content": content}]})
    assert_refused(response, 422, "invalid_messages")
    assert scripted.requests == []
    assert_failed_and_nothing_stored("invalid_argument")


def test_other_control_characters_pass_through(proxy_url, upstream, alice_key):
    """Terminal output in a tool result carries escapes: the proxy stays transparent."""
    messages = [
        {"role": "user", "content": "run it"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "sh", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "\x1b[31mred\x1b[0m\x0c"},
        {"role": "user", "content": "and \x1b?"},
    ]  # fmt: skip
    response = post(proxy_url, alice_key, {"model": "m", "messages": messages})
    assert response.status_code == 200, response.text
    assert upstream.requests[-1]["json"]["messages"][-2]["content"] == "\x1b[31mred\x1b[0m\x0c"
    assert chat_rows().get().outcome == AuditEvent.Outcome.OK and usage_count() == 1


# --- defects 6 and 7: deep JSON, oversized bodies ---------------------------------------
@pytest.mark.parametrize(
    "raw",
    [b"[" * 100_000, b'{"messages": ' + b"[" * 100 + b"]" * 100 + b"}", b'{"messages": [NaN]}', b"\xff\xfe"],
    ids=["deep", "deep-closed", "nan", "not-utf8"],
)
def test_unparsable_bodies_are_a_422(proxy_url, scripted, alice_key, raw):
    response = post(proxy_url, alice_key, raw)
    assert_refused(response, 422, "invalid_messages")
    assert scripted.requests == []
    assert_failed_and_nothing_stored("invalid_argument")


def test_a_body_over_the_upload_limit_is_a_413_in_the_openai_shape(proxy_url, scripted, alice_key, settings):
    text = "x" * (settings.DATA_UPLOAD_MAX_MEMORY_SIZE + 500_000)
    big = {"model": "m", "messages": [{"role": "user", "content": text}]}
    response = post(proxy_url, alice_key, big)
    assert_refused(response, 413, "request_too_large")
    assert scripted.requests == []
    assert_failed_and_nothing_stored("payload_too_large")
    # without a key it is the usual 401 (auth comes first), in the same shape
    anonymous = httpx.post(f"{proxy_url}/v1/chat/completions", content=json.dumps(big).encode(), timeout=30)
    assert_refused(anonymous, 401, "invalid_api_key")


# --- smaller suspicions: extra_body cannot set stream, upstream headers filtered -------
def test_extra_body_cannot_set_stream_or_messages(alice):
    from core.errors import ServiceError

    api_key, _ = api_key_issue(user=alice, name="cfg")
    for extra in ({"stream": True}, {"messages": []}):
        with pytest.raises(ServiceError):
            token_config_save(
                api_key=api_key,
                fields={"upstream_base_url": "http://127.0.0.1:9", "upstream_api_key": "k", "extra_body": extra},
                partial=False,
                call=internal_call(),
            )
    assert TokenConfig.objects.count() == 0


def test_a_stored_stream_in_extra_body_is_not_forwarded(proxy_url, upstream, alice, alice_key):
    from proxy.crypto import secret_encrypt

    TokenConfig.objects.create(
        api_key=alice.api_keys.get(),
        upstream_base_url=upstream.url,
        upstream_api_key_encrypted=secret_encrypt("k"),
        extra_body={"stream": True, "seed": 3},
    )  # saved before the check existed
    response = post(proxy_url, alice_key, {"model": "m", "messages": USER})
    assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"]
    sent = upstream.requests[-1]["json"]
    assert "stream" not in sent and sent["seed"] == 3
    assert usage_count() == 1


def test_upstream_cookies_and_our_own_error_header_are_not_relayed(proxy_url, scripted, alice_key):
    headers = {"X-Memsite-Error": "forged", "Set-Cookie": "sessionid=evil; Path=/", "X-Upstream-Id": "u1"}
    scripted.script = whole(200, completion({"role": "assistant", "content": "ok"}), headers=headers)
    response = post(proxy_url, alice_key, {"model": "m", "messages": USER})
    assert response.status_code == 200
    assert "x-memsite-error" not in response.headers and "set-cookie" not in response.headers
    assert response.headers["x-upstream-id"] == "u1"
    scripted.script = whole(500, b'{"error": {"message": "boom"}}', headers=headers)
    response = post(proxy_url, alice_key, {"model": "m", "messages": USER})
    assert response.status_code == 500 and "x-memsite-error" not in response.headers


def test_a_compressed_answer_is_read_and_relayed_decoded(proxy_url, scripted, alice_key):
    """We ask for identity; an upstream that gzips anyway still gives a stored turn."""
    import gzip

    body = completion({"role": "assistant", "content": "zipped"})
    scripted.script = whole(200, gzip.compress(body), headers={"Content-Encoding": "gzip"})
    response = post(proxy_url, alice_key, {"model": "m", "messages": USER})
    assert response.status_code == 200 and response.content == body
    assert "content-encoding" not in response.headers
    assert usage_count() == 1 and stored_items()[-1]["content"] == "zipped"


# --- recording never fails silently ------------------------------------------------------
def test_a_recording_failure_withholds_the_answer_and_is_audited(proxy_url, upstream, alice_key, monkeypatch):
    from proxy import services

    def broken(*args, **kwargs):
        raise RuntimeError("database went away")

    monkeypatch.setattr(services, "chat_call_finish", broken)
    response = post(proxy_url, alice_key, {"model": "m", "messages": USER})
    assert_refused(response, 503, "recording_failed")
    assert "database" not in response.text
    assert_failed_and_nothing_stored("backend_unavailable")


# --- defect 9: the admin API ---------------------------------------------------------------
@pytest.fixture
def staff_key(alice, alice_key):
    alice.is_staff = True
    alice.is_superuser = True  # every TokenConfig permission (tests/test_proxy_admin_access.py)
    alice.save()
    return alice_key


@pytest.mark.parametrize(
    "fields",
    [
        {"key_id": "a\u0000"},
        {"memory_prompt": "a\u0000"},
        {"upstream_base_url": "http://x\u0000y"},
        {"extra_body": {"a": "\u0000"}},
        {"memory_llm": {"k\u0000": 1}},
        {"upstream_api_key": "sk\u0000"},
    ],
    ids=["key-id", "prompt", "url", "extra-body", "memory-llm", "api-key"],
)
def test_admin_api_refuses_nul_with_a_422(proxy_url, staff_key, bob, fields):
    bob_key_id = api_key_issue(user=bob)[0].key_id
    body = {"key_id": bob_key_id, "upstream_base_url": "http://127.0.0.1:9", "upstream_api_key": "sk", **fields}
    response = httpx.post(
        f"{proxy_url}/v1/admin/tokens",
        headers={"Authorization": f"Bearer {staff_key}", "Content-Type": "application/json"},
        content=json.dumps(body).encode(),
    )
    assert response.status_code == 422, response.text
    assert response.headers["x-memsite-error"] == "invalid_body"
    assert TokenConfig.objects.count() == 0


@pytest.mark.parametrize(
    "fields",
    [
        {"upstream_base_url": "http://x y/"},
        {"upstream_base_url": "http://[::1"},
        {"upstream_api_key": "sk-\u00e9"},
        {"extra_body": {"stream": False}},
    ],
    ids=["url-space", "url-invalid", "api-key-not-ascii", "extra-stream"],
)
def test_admin_api_refuses_values_that_would_fail_later(proxy_url, staff_key, bob, fields):
    bob_key_id = api_key_issue(user=bob)[0].key_id
    body = {"key_id": bob_key_id, "upstream_base_url": "http://127.0.0.1:9", "upstream_api_key": "sk", **fields}
    response = httpx.post(f"{proxy_url}/v1/admin/tokens", headers={"Authorization": f"Bearer {staff_key}"}, json=body)
    assert response.status_code == 422, response.text
    assert response.headers["x-memsite-error"] == "invalid_argument"
    assert TokenConfig.objects.count() == 0


def test_admin_api_deep_json_nul_path_and_oversized_body(proxy_url, staff_key, settings):
    url = f"{proxy_url}/v1/admin/tokens"
    auth = {"Authorization": f"Bearer {staff_key}"}
    deep = httpx.post(url, headers=auth, content=b"[" * 100_000)
    assert deep.status_code == 422 and deep.json()["error"]["code"] == "invalid_body"
    for method in ("GET", "PATCH", "DELETE"):
        missing = httpx.request(method, f"{url}/a%00b", headers=auth, json={})
        assert missing.status_code == 404, (method, missing.text)
        assert missing.json()["error"]["code"] == "not_found"
    big = httpx.post(url, headers=auth, content=b'{"x": "' + b"y" * (settings.DATA_UPLOAD_MAX_MEMORY_SIZE + 10) + b'"}')
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    assert TokenConfig.objects.count() == 0


# --- defect 10: the web page ------------------------------------------------------------------
WEB_FORM = {
    "upstream_base_url": "http://127.0.0.1:9",
    "upstream_api_key": "sk-alice",
    "memory_limit": "3",
    "session_window_size": "10",
    "extra_body": "{}",
    "memory_llm": "{}",
    "memory_prompt": "",
}
BAD_FORMS = [
    {"memory_prompt": "p\x00"},
    {"extra_body": '{"a": "\\u0000"}'},
    {"extra_body": "[" * 50_000},
    {"extra_body": '{"stream": true}'},
    {"memory_llm": '{"a": NaN}'},
    {"upstream_base_url": "http://x\x00y"},
    {"upstream_api_key": "sk\x00"},
    {"memory_limit": "\u00b2"},
    {"memory_limit": "9" * 5000},
]
BAD_FORM_IDS = ["prompt", "extra-nul", "extra-deep", "extra-stream", "nan", "url", "api-key", "superscript", "huge"]


@pytest.mark.parametrize("fields", BAD_FORMS, ids=BAD_FORM_IDS)
def test_web_config_page_answers_bad_values_with_a_400_page(client, alice, fields):
    from django.urls import reverse

    key_row, _ = api_key_issue(user=alice, name="a")
    client.force_login(alice)
    response = client.post(reverse("proxy-key-config", args=[key_row.key_id]), {**WEB_FORM, **fields})
    assert response.status_code == 400
    assert TokenConfig.objects.count() == 0


@pytest.mark.parametrize("fields", BAD_FORMS, ids=BAD_FORM_IDS)
def test_web_config_view_itself_names_the_field(rf, alice, fields):
    """The view on its own (whatever the middleware in front of it checks): the page
    again, 400, with a message naming the field and not echoing the value."""
    from django.contrib.messages.storage.fallback import FallbackStorage
    from django.contrib.sessions.backends.db import SessionStore

    from proxy import web

    key_row, _ = api_key_issue(user=alice, name="a")
    request = rf.post(f"/keys/{key_row.key_id}/chat/", {**WEB_FORM, **fields})
    request.user = alice
    request.session = SessionStore()
    request._messages = FallbackStorage(request)
    response = web.key_chat_config(request, key_row.key_id)
    assert response.status_code == 400
    flashed = [str(m) for m in request._messages]
    assert len(flashed) == 1 and next(iter(fields)) in flashed[0]
    assert "\x00" not in flashed[0]
    assert TokenConfig.objects.count() == 0


def test_web_config_page_with_a_nul_key_id(client, rf, alice):
    from django.http import Http404

    from proxy import web

    client.force_login(alice)
    response = client.get("/keys/a%00/chat/")
    assert response.status_code in (400, 404)  # the middleware may refuse it first
    request = rf.get("/keys/a%00/chat/")
    request.user = alice
    with pytest.raises(Http404):
        web.key_chat_config(request, "a\x00")


# --- a key's own upstream reaches public addresses only (server-side request forgery) ----
NON_PUBLIC_UPSTREAMS = [
    "http://127.0.0.1:9",
    "http://10.0.0.1",
    "http://192.168.1.1:8080",
    "http://169.254.169.254",  # cloud metadata
    "http://[::1]:9",
    "http://[::ffff:10.0.0.1]",
    "http://localhost:9",
]


def test_a_key_upstream_at_a_non_public_address_is_refused_on_save(alice, settings):
    from core.errors import ErrorCode, ServiceError

    settings.PROXY_KEY_UPSTREAM_ALLOW_LOOPBACK = False
    api_key, _ = api_key_issue(user=alice, name="cfg")

    def save(url: str) -> None:
        token_config_save(
            api_key=api_key,
            fields={"upstream_base_url": url, "upstream_api_key": "k"},
            partial=False,
            call=internal_call(),
        )

    for url in NON_PUBLIC_UPSTREAMS:
        with pytest.raises(ServiceError) as refused:
            save(url)
        assert refused.value.code == ErrorCode.INVALID_ARGUMENT and "public address" in refused.value.message, url
    assert TokenConfig.objects.count() == 0
    save("https://llm.example.com")  # a name: checked where the connection is made
    assert TokenConfig.objects.count() == 1


def test_a_key_upstream_resolving_to_a_non_public_address_is_never_connected(
    proxy_url, upstream, alice, alice_key, settings
):
    from urllib.parse import urlsplit

    from proxy.crypto import secret_encrypt

    # Saved while loopback was allowed (or a name whose DNS answer changed since).
    TokenConfig.objects.create(
        api_key=alice.api_keys.get(),
        upstream_base_url=f"http://localhost:{urlsplit(upstream.url).port}",
        upstream_api_key_encrypted=secret_encrypt("k"),
    )
    settings.PROXY_KEY_UPSTREAM_ALLOW_LOOPBACK = False
    response = post(proxy_url, alice_key, {"model": "m", "messages": USER})
    assert_refused(response, 502, "upstream_address_refused")
    assert upstream.requests == []  # resolved, refused, never connected
    assert_failed_and_nothing_stored("backend_unavailable")  # audited as every 502 of ours
    # The deployment's own upstream (the operator's setting) is not restricted.
    TokenConfig.objects.all().delete()
    assert post(proxy_url, alice_key, {"model": "m", "messages": USER}).status_code == 200


# --- a large answer or SSE event: linear to read, and capped --------------------------
def test_an_event_without_its_blank_line_is_searched_once_not_per_chunk(monkeypatch):
    """Each chunk's new bytes are searched for the separator, not the whole buffer again
    (that was quadratic, on the event loop: one large event froze the process)."""
    from proxy import messages

    scanned: list[int] = []
    original = messages._event_end

    def counting(buffer, start=0):
        scanned.append(len(buffer) - start)
        return original(buffer, start) if start else original(buffer)

    monkeypatch.setattr(messages, "_event_end", counting)
    answer = messages.Answer()
    piece = b"data: " + b"x" * 994
    for _ in range(1000):  # 1,000,000 bytes, under the 1 MiB event cap
        assert answer.feed(piece) == b""
    assert sum(scanned) <= 1000 * (len(piece) + 3)
    assert answer.feed(b"\n\n").startswith(b"data: xxx")  # the event still arrives whole


def test_one_sse_event_over_a_mib_is_refused_as_too_large():
    from proxy.errors import ProxyError
    from proxy.messages import MAX_EVENT_BYTES, Answer

    answer = Answer()
    answer.feed(b"data: " + b"x" * (MAX_EVENT_BYTES - 10))
    with pytest.raises(ProxyError) as refused:
        answer.feed(b"x" * 100)
    assert refused.value.code == "upstream_answer_too_large" and refused.value.status == 502


def test_a_streamed_answer_over_the_limit_ends_with_an_error_event_and_no_bill(
    proxy_url, scripted, alice_key, settings
):
    settings.PROXY_MAX_ANSWER_BYTES = 4096
    pieces = [chunk({"content": "word " * 20}) for _ in range(100)]  # 10,000 characters, small events
    scripted.script = sse(*pieces, chunk({}, "stop"), b"data: [DONE]\n\n")
    status, body = stream_body(proxy_url, alice_key, {"model": "m", "stream": True, "messages": USER})
    assert status == 200 and b"[DONE]" not in body and body.count(b"word") < 100 * 20
    last = json.loads(body.rstrip(b"\n").rsplit(b"\n\n", 1)[-1].removeprefix(b"data: "))
    assert last["error"]["code"] == "upstream_answer_too_large" and last["error"]["message"]
    wait_recorded()
    assert_failed_and_nothing_stored("upstream_answer_too_large")


def test_a_stream_counts_its_answer_not_its_framing(proxy_url, scripted, alice_key, settings):
    """logprobs make a chunk ~2 KB a token: the cap is on the answer held, not the wire."""
    settings.PROXY_MAX_ANSWER_BYTES = 4096
    top = [{"token": "w", "logprob": -0.1}] * 20
    choice = {"index": 0, "delta": {"content": "word "}, "finish_reason": None}
    choice["logprobs"] = {"content": [{"token": "w", "logprob": -0.1, "top_logprobs": top}]}
    event = f"data: {json.dumps({'id': 'c', 'object': 'chat.completion.chunk', 'choices': [choice]})}\n\n"
    pieces = [event.encode()] * 100
    scripted.script = sse(*pieces, chunk({}, "stop"), b"data: [DONE]\n\n")
    status, body = stream_body(proxy_url, alice_key, {"model": "m", "stream": True, "messages": USER})
    assert status == 200 and b"[DONE]" in body and len(body) > 4 * 4096
    wait_recorded()
    assert chat_rows().get().outcome == AuditEvent.Outcome.OK and usage_count() == 1
    assert stored_items()[-1]["content"] == "word " * 100


def test_a_whole_answer_over_the_limit_is_a_502_and_no_bill(proxy_url, scripted, alice_key, settings):
    settings.PROXY_MAX_ANSWER_BYTES = 4096
    scripted.script = whole(200, completion({"role": "assistant", "content": "x" * 10_000}))
    response = post(proxy_url, alice_key, {"model": "m", "messages": USER})
    assert_refused(response, 502, "upstream_answer_too_large")
    assert "upstream-secret" not in response.text
    assert_failed_and_nothing_stored("upstream_answer_too_large")


# --- a stream the client left before anything was relayed ----------------------------
@pytest.mark.parametrize("first", [b"", b": keep-alive\n\n"])
def test_a_client_that_leaves_a_stream_before_any_answer_is_not_billed(proxy_url, scripted, alice_key, first):
    """A reasoning model thinking (headers, then nothing or keep-alive comments): the
    client's timeout is not a stopped answer. Audited client_gone, not billed, no turn
    (an SDK's automatic retries would each have been billed)."""
    scripted.script = sse(*([first] if first else []), stall=3.0)
    with (
        pytest.raises(httpx.ReadTimeout) if not first else contextlib.nullcontext(),
        httpx.stream(
            "POST",
            f"{proxy_url}/v1/chat/completions",
            headers={"Authorization": f"Bearer {alice_key}"},
            json={"model": "m", "stream": True, "messages": USER},
            timeout=httpx.Timeout(30, read=0.5),
        ) as response,
    ):
        assert response.status_code == 200
        assert next(response.iter_raw()) == first
    wait_recorded()
    assert_failed_and_nothing_stored("client_gone")


def test_with_several_choices_only_the_first_is_the_stored_answer():
    from proxy.messages import Answer

    def piece(index: int, content: str | None, finish: str | None = None) -> bytes:
        delta = {"content": content} if content is not None else {}
        body = {"choices": [{"index": index, "delta": delta, "finish_reason": finish}]}
        return f"data: {json.dumps(body)}\n\n".encode()

    answer = Answer()
    for event in (piece(0, "Yes"), piece(1, "No"), piece(0, " indeed"), piece(1, " way"), piece(1, None, "stop")):
        answer.feed(event)
    assert not answer.finished  # choice 1's finish is not the stored answer's
    answer.feed(piece(0, None, "stop"))
    assert answer.finished and answer.as_message() == {"role": "assistant", "content": "Yes indeed"}


def test_a_relayed_answer_or_tool_output_with_nul_is_forwarded_replaced(proxy_url, upstream, alice_key):
    """The upstream answered with a NUL (relayed unchanged to the client), and a tool read
    a binary file: the next request resends both. Refused, the conversation was locked for
    good (422 on every later call); they are forwarded with U+FFFD, as they are stored."""
    messages = [
        {"role": "user", "content": "show the columns"},
        {"role": "assistant", "content": "col1\u0000col2", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "cat", "arguments": '{"p": "a\ud800"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "ELF\u0000\u0001"}]},
        {"role": "user", "content": "thanks"},
    ]  # fmt: skip
    response = post(proxy_url, alice_key, {"model": "m", "messages": messages})
    assert response.status_code == 200, response.text
    sent = upstream.requests[-1]["json"]["messages"]
    assert [m["content"] for m in sent if m["role"] == "assistant"][-1] == "col1\ufffdcol2"
    assert sent[-2]["content"] == [{"type": "text", "text": "ELF\ufffd\u0001"}]
    assert "\\ufffd" in json.dumps(sent) and "\\u0000" not in json.dumps(sent)
    assert chat_rows().get().outcome == AuditEvent.Outcome.OK and usage_count() == 1
