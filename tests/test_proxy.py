"""The chat proxy (issue 15, seed 004): the official `openai` client against our
/v1/chat/completions, served by uvicorn in this process, forwarding to a fake
OpenAI-compatible upstream on 127.0.0.1."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from billing.models import UsageEvent
from core.choices import Operation
from memories.services import api_key_issue, memory_remember
from proxy import selectors
from proxy.models import ProxyTurn, TokenConfig
from proxy.services import proxy_turn_extract, token_config_save
from tests.conftest import free_port, internal_call, serve_in_thread, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]


@pytest.fixture(scope="module")
def proxy_url(django_db_setup):  # noqa: ARG001 - the server uses the test database
    """uvicorn serving memsite.asgi in a thread of this process (settings and monkeypatches
    apply). A fresh app (factory): an app's MCP lifespan runs once, and under pytest-xdist's
    work stealing this module's tests may come to one worker in two rounds."""
    yield from serve_in_thread("memsite.asgi:build_application", factory=True, lifespan="on")


def client(url: str, key: str, **headers: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, default_headers=headers or None)


def chat_events() -> int:
    return UsageEvent.objects.filter(operation=Operation.CHAT_COMPLETION).count()


def system_of(request: dict) -> str:
    return request["json"]["messages"][0]["content"]


# --- acceptance 1: pass-through, injection, history -----------------------------------
def test_non_streaming_answer_arrives_unchanged_with_memories_and_fields(proxy_url, upstream, alice_scope, alice_key):
    memory_remember(alice_scope, memory="Alice's cat is named Miso", call=internal_call())
    raw = httpx.post(
        f"{proxy_url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {alice_key}"},
        json={
            "model": "gpt-test",
            "temperature": 0.25,
            "top_p": 0.5,
            "metadata": {"app": "x"},
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is my cat called?"},
            ],
        },
    )
    assert raw.status_code == 200
    assert raw.content == json.dumps(upstream.completion({"model": "gpt-test"})).encode()
    assert raw.headers["x-upstream"] == "fake"
    sent = upstream.requests[-1]
    assert sent["headers"]["authorization"] == "Bearer upstream-secret"
    assert {k: v for k, v in sent["json"].items() if k != "messages"} == {
        "model": "gpt-test",
        "temperature": 0.25,
        "top_p": 0.5,
        "metadata": {"app": "x"},
    }
    assert system_of(sent).startswith("Be brief.\n\n## What you remember about the user")
    assert "- Alice's cat is named Miso" in system_of(sent)
    assert sent["json"]["messages"][1:] == [{"role": "user", "content": "What is my cat called?"}]

    answer = client(proxy_url, alice_key).chat.completions.create(
        model="gpt-test", messages=[{"role": "user", "content": "hi"}]
    )
    assert answer.choices[0].message.content == "Hello from upstream."
    assert chat_events() == 2


def _scope(user):
    from core.scope import MemoryScope

    return MemoryScope.for_user(user)


def test_streaming_answer_and_tool_calls_arrive_unchanged(proxy_url, upstream, alice_key):
    upstream.reply = "one two three"
    with httpx.stream(
        "POST",
        f"{proxy_url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {alice_key}"},
        json={"model": "m", "stream": True, "messages": [{"role": "user", "content": "count"}]},
    ) as response:
        body = b"".join(response.iter_raw())
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/event-stream"
    assert body == b"".join(upstream.stream_chunks({"model": "m"}))

    stream = client(proxy_url, alice_key).chat.completions.create(
        model="m", stream=True, messages=[{"role": "user", "content": "count"}]
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "one two three"

    upstream.tool_call = {"name": "get_weather", "arguments": '{"city": "Berlin"}'}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    whole = client(proxy_url, alice_key).chat.completions.create(
        model="m", tools=tools, messages=[{"role": "user", "content": "weather?"}]
    )
    assert whole.choices[0].message.tool_calls[0].function.arguments == '{"city": "Berlin"}'
    assert upstream.requests[-1]["json"]["tools"] == tools
    pieces = client(proxy_url, alice_key).chat.completions.create(
        model="m", tools=tools, stream=True, messages=[{"role": "user", "content": "weather?"}]
    )
    arguments = "".join(
        c.choices[0].delta.tool_calls[0].function.arguments or ""
        for c in pieces
        if c.choices and c.choices[0].delta.tool_calls
    )
    assert arguments == '{"city": "Berlin"}'
    # a streamed call is recorded after its last byte went out: just after the client saw it
    wait_for(lambda: chat_events() == 4 and ProxyTurn.objects.count() == 4, timeout=5, what="records")


def test_second_call_sees_the_first_turn_and_tool_calls_are_kept(proxy_url, upstream, alice_key):
    chat = client(proxy_url, alice_key, **{"X-Session-Id": "s1"})
    upstream.tool_call = {"name": "lookup", "arguments": "{}"}
    chat.chat.completions.create(model="m", messages=[{"role": "user", "content": "My flight is LH123."}])
    upstream.tool_call = None
    chat.chat.completions.create(
        model="m",
        messages=[
            {"role": "system", "content": "sys"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "on time", "reasoning_content": "x"},
        ],
    )  # fmt: skip
    sent = upstream.requests[-1]["json"]["messages"]
    assert sent[0] == {"role": "system", "content": "sys"}
    # history right after the system message: the first turn, its tool call kept (once:
    # the request repeats it, answered; the fake upstream refuses an unanswered call)
    assert sent[1] == {"role": "user", "content": "My flight is LH123."}
    assert sent[2]["tool_calls"][0]["id"] == "call_1"
    assert [m["role"] for m in sent] == ["system", "user", "assistant", "tool"]
    # a third call: the session now holds the tool output and the answer, no duplicates
    chat.chat.completions.create(model="m", messages=[{"role": "user", "content": "and?"}])
    history = upstream.requests[-1]["json"]["messages"]
    roles = [m["role"] for m in history]
    assert roles == ["user", "assistant", "tool", "assistant", "user"]
    assert history[2] == {"role": "tool", "tool_call_id": "call_1", "content": "on time"}
    # another session of the same key does not see it
    other = client(proxy_url, alice_key, **{"X-Session-Id": "s2"})
    other.chat.completions.create(model="m", messages=[{"role": "user", "content": "hello"}])
    assert upstream.requests[-1]["json"]["messages"] == [{"role": "user", "content": "hello"}]


def test_a_client_resending_the_whole_conversation_with_a_tool_output_is_forwarded_once(proxy_url, upstream, alice_key):
    chat = client(proxy_url, alice_key, **{"X-Session-Id": "resend"})
    question = {"role": "user", "content": "Weather in Berlin?"}
    upstream.tool_call = {"name": "get_weather", "arguments": '{"city": "Berlin"}'}
    first = chat.chat.completions.create(model="m", messages=[question])
    call = first.choices[0].message.model_dump(exclude_none=True)
    upstream.tool_call = None
    output = {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
    chat.chat.completions.create(model="m", messages=[question, call, output])  # no 400 from the upstream
    sent = upstream.requests[-1]["json"]["messages"]
    assert [m["role"] for m in sent] == ["user", "assistant", "tool"]
    # the client sends only its new message: the stored conversation, every call answered
    chat.chat.completions.create(model="m", messages=[{"role": "user", "content": "Thanks"}])
    roles = [m["role"] for m in upstream.requests[-1]["json"]["messages"]]
    assert roles == ["user", "assistant", "tool", "assistant", "user"]


def test_a_tool_call_without_its_output_is_not_replayed():
    from proxy.messages import history_messages, messages_enrich

    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    items = [
        {"type": "message", "role": "user", "content": "q"},
        {"type": "message", "role": "assistant", "content": "Let me look."},
        call,  # a stream stopped mid tool call: the call alone
        {"type": "message", "role": "user", "content": "never mind"},
        {"type": "function_call_output", "call_id": "c9", "output": "orphan"},
    ]
    request = [{"role": "user", "content": "next"}]
    sent = messages_enrich(request, memory_block=None, history=history_messages(items))
    assert sent == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "Let me look."},
        {"role": "user", "content": "never mind"},
        {"role": "user", "content": "next"},
    ]
    # a call the request answers right after the history is kept
    answer = {"role": "tool", "tool_call_id": "c1", "content": "done"}
    sent = messages_enrich([answer], memory_block=None, history=history_messages(items[:3]))
    assert sent[-2]["tool_calls"][0]["id"] == "c1" and sent[-1] == answer


@pytest.fixture
def rebuilt_engine():
    from memories import engine

    engine.engine_close()
    yield
    engine.engine_close()


@pytest.mark.usefixtures("rebuilt_engine")
def test_a_fact_from_call_1_is_injected_in_call_5_of_a_new_session(proxy_url, upstream, alice_key, settings, fake_llm):
    settings.LLM_BASE_URL = f"{fake_llm.url}/v1"
    settings.LLM_MODEL = "fake-model"
    settings.LLM_API_KEY = "fake-key"
    fake_llm.queue_facts("User's sister is called Ingrid")
    chat = client(proxy_url, alice_key, **{"X-Session-Id": "first"})
    chat.chat.completions.create(model="m", messages=[{"role": "user", "content": "My sister is called Ingrid."}])
    turn = ProxyTurn.objects.get()
    assert proxy_turn_extract(turn_pk=turn.pk) == "done"  # what the worker runs after commit
    turn.refresh_from_db()
    assert turn.state == ProxyTurn.State.DONE and turn.messages == []
    for n in range(2, 5):
        chat.chat.completions.create(model="m", messages=[{"role": "user", "content": f"small talk {n}"}])
    fresh = client(proxy_url, alice_key, **{"X-Session-Id": "second"})
    fresh.chat.completions.create(model="m", messages=[{"role": "user", "content": "What is my sister called?"}])
    sent = upstream.requests[-1]["json"]["messages"]
    assert "User's sister is called Ingrid" in sent[0]["content"]
    assert [m["role"] for m in sent] == ["system", "user"]  # a new session: no history


def test_extraction_failure_is_logged_and_never_fails_the_call(proxy_url, upstream, alice_key, settings, caplog):
    settings.LLM_BASE_URL = None  # no extraction LLM
    answer = client(proxy_url, alice_key).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}]
    )
    assert answer.choices[0].message.content == "Hello from upstream."
    turn = ProxyTurn.objects.get()
    assert proxy_turn_extract(turn_pk=turn.pk) == "failed"
    turn.refresh_from_db()
    assert turn.state == ProxyTurn.State.FAILED
    assert "memory extraction for turn" in caplog.text


# --- acceptance 2: streaming really streams -------------------------------------------
def test_the_first_chunk_is_relayed_before_the_upstream_sends_the_rest(proxy_url, upstream, alice_key):
    """Streaming really streams: the upstream holds every chunk after its first until the
    client has that first chunk. A proxy that buffered the answer would hand the client
    nothing until the upstream gave up waiting (10 s) and finished. How fast the first
    chunk comes is measured in bench/, not asserted here."""
    upstream.reply = "a b c d e"
    upstream.hold_after_first = threading.Event()
    chat = client(proxy_url, alice_key)
    stream = chat.chat.completions.create(model="m", stream=True, messages=[{"role": "user", "content": "go"}])
    first = next(iter(stream))
    upstream.hold_after_first.set()
    rest = list(stream)
    assert upstream.released_by_client is True
    assert first.choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in rest if c.choices) == "a b c d e"
    wait_for(lambda: chat_events() == 1, timeout=5, what="the streamed call's record")


# --- acceptance 3: the error table ----------------------------------------------------
def test_401_missing_invalid_token_and_invalid_config(proxy_url, upstream, alice_key, alice):
    with pytest.raises(openai.AuthenticationError):
        client(proxy_url, "msk_nope_nope").chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}]
        )
    assert httpx.post(f"{proxy_url}/v1/chat/completions", json={"messages": []}).status_code == 401
    # a stored configuration that no longer decrypts invalidates the token
    api_key = alice.api_keys.get()
    TokenConfig.objects.create(api_key=api_key, upstream_base_url=upstream.url, upstream_api_key_encrypted="garbage")
    with pytest.raises(openai.AuthenticationError) as caught:
        client(proxy_url, alice_key).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert caught.value.response.headers["x-memsite-error"] == "invalid_api_key"
    assert upstream.requests == [] and chat_events() == 0


def test_401_when_no_upstream_is_configured(proxy_url, upstream, alice_key, settings):
    settings.CHAT_UPSTREAM_BASE_URL = ""
    with pytest.raises(openai.AuthenticationError):
        client(proxy_url, alice_key).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])


@pytest.mark.parametrize(
    "body",
    [
        {"model": "m", "messages": []},
        {"model": "m"},
        {"model": "m", "messages": [{"role": "tool", "content": "42"}]},
        {"model": "m", "messages": [{"role": "wizard", "content": "x"}]},
        {"model": "m", "messages": ["hello"]},
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": "yes"},
    ],
)
def test_422_bad_messages(proxy_url, upstream, alice_key, body):
    response = httpx.post(
        f"{proxy_url}/v1/chat/completions", headers={"Authorization": f"Bearer {alice_key}"}, json=body
    )
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "invalid_messages"
    assert upstream.requests == [] and chat_events() == 0


def test_422_through_the_openai_client(proxy_url, upstream, alice_key):
    with pytest.raises(openai.UnprocessableEntityError):
        client(proxy_url, alice_key).chat.completions.create(model="m", messages=[{"role": "tool", "content": "1"}])


@pytest.mark.parametrize("status", [400, 429, 500])
def test_upstream_http_errors_pass_through_unchanged(proxy_url, upstream, alice_key, status):
    upstream.error = (status, {"error": {"message": f"upstream says {status}", "type": "upstream"}})
    for stream in (False, True):
        response = httpx.post(
            f"{proxy_url}/v1/chat/completions",
            headers={"Authorization": f"Bearer {alice_key}"},
            json={"model": "m", "stream": stream, "messages": [{"role": "user", "content": "x"}]},
        )
        assert response.status_code == status
        assert response.json() == {"error": {"message": f"upstream says {status}", "type": "upstream"}}
        assert response.headers["x-upstream"] == "fake"
        assert "x-memsite-error" not in response.headers
        if status == 429:
            assert response.headers["retry-after"] == "7"
    assert chat_events() == 0
    assert ProxyTurn.objects.count() == 0


def test_502_when_the_upstream_is_unreachable(proxy_url, upstream, alice_key, settings):
    settings.CHAT_UPSTREAM_BASE_URL = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(openai.APIStatusError) as caught:
        client(proxy_url, alice_key).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert caught.value.status_code == 502
    assert caught.value.response.headers["x-memsite-error"] == "upstream_unreachable"
    assert chat_events() == 0


def test_502_when_memory_search_fails_or_times_out(proxy_url, upstream, alice_key, settings, monkeypatch):
    settings.PROXY_MEMORY_SEARCH_TIMEOUT_S = 0.2

    def slow(*args, **kwargs):
        time.sleep(1)
        return []

    monkeypatch.setattr(selectors, "chat_memories_find", slow)
    with pytest.raises(openai.APIStatusError) as caught:
        client(proxy_url, alice_key).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert caught.value.status_code == 502
    assert caught.value.response.headers["x-memsite-error"] == "memory_unavailable"

    from proxy.errors import memory_unavailable

    def broken(*args, **kwargs):
        raise memory_unavailable()

    monkeypatch.setattr(selectors, "chat_memories_find", broken)
    with pytest.raises(openai.APIStatusError) as caught:
        client(proxy_url, alice_key).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert caught.value.status_code == 502
    assert upstream.requests == [] and chat_events() == 0
    from audit.models import AuditEvent

    rows = AuditEvent.objects.filter(operation=Operation.CHAT_COMPLETION)
    assert rows.count() == 2 and {r.outcome for r in rows} == {"error"}


# --- acceptance 4: usage events and tenancy -------------------------------------------
def test_memories_injected_into_a_chat_count_as_accesses(proxy_url, upstream, alice_scope, bob_scope, alice_key):
    from memories.selectors import memory_get_owned, memory_view
    from memories.services import memory_recalls_fold

    cat = memory_remember(alice_scope, memory="Alice's cat is named Miso", call=internal_call()).id
    bobs = memory_remember(bob_scope, memory="Bob's cat is named Tom", call=internal_call()).id
    client(proxy_url, alice_key).chat.completions.create(
        model="gpt-test", messages=[{"role": "user", "content": "What is my cat called?"}]
    )
    assert "- Alice's cat is named Miso" in system_of(upstream.requests[-1])
    memory_recalls_fold(settle_seconds=0)
    accesses = [
        memory_view(memory_get_owned(s, memory_id=i)).access_count for s, i in ((alice_scope, cat), (bob_scope, bobs))
    ]
    assert accesses == [1, 0]


def test_one_usage_event_and_one_audit_row_per_call_content_hashed(proxy_url, upstream, alice_key):
    from audit.models import AuditEvent

    chat = client(proxy_url, alice_key)
    chat.chat.completions.create(model="m", messages=[{"role": "user", "content": "secret plan"}])
    response = chat.chat.completions.with_raw_response.create(model="m", messages=[{"role": "user", "content": "b"}])
    request_id = response.headers["x-request-id"]
    events = UsageEvent.objects.filter(operation=Operation.CHAT_COMPLETION)
    assert events.count() == 2 and request_id in {str(e.request_id) for e in events}
    rows = AuditEvent.objects.filter(operation=Operation.CHAT_COMPLETION)
    assert rows.count() == 2 and {r.outcome for r in rows} == {"ok"}
    row = rows.get(request_id=request_id)
    assert row.channel == "proxy" and row.detail["upstream_status"] == 200
    assert "secret plan" not in json.dumps([r.detail for r in rows])


def test_tenancy_one_users_token_never_injects_or_stores_anothers(proxy_url, upstream, alice, alice_key, bob_key):
    memory_remember(_scope(alice), memory="Alice's PIN hint is the blue door", call=internal_call())
    bob = client(proxy_url, bob_key, **{"X-Session-Id": "shared-name"})
    bob.chat.completions.create(model="m", messages=[{"role": "user", "content": "What is the PIN hint? blue door"}])
    sent = upstream.requests[-1]["json"]["messages"]
    assert "blue door" not in sent[0]["content"] or sent[0]["role"] == "user"
    assert all("Alice" not in json.dumps(m) for m in sent)
    alice_chat = client(proxy_url, alice_key, **{"X-Session-Id": "shared-name"})
    alice_chat.chat.completions.create(model="m", messages=[{"role": "user", "content": "hello"}])
    sent = upstream.requests[-1]["json"]["messages"]
    assert all("PIN hint?" not in json.dumps(m) for m in sent)  # bob's turn is not in alice's session
    assert ProxyTurn.objects.filter(user=alice).count() == 1


def test_rate_limit_applies_per_user(proxy_url, upstream, alice_key, bob_key, settings):
    settings.RATE_LIMITS = {**settings.RATE_LIMITS, Operation.CHAT_COMPLETION: (2, 60)}
    chat = client(proxy_url, alice_key)
    for _ in range(2):
        chat.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.RateLimitError) as caught:
        chat.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert caught.value.response.headers["x-memsite-error"] == "rate_limited"
    client(proxy_url, bob_key).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert chat_events() == 3


# --- per-token configuration ----------------------------------------------------------
def test_per_key_config_encrypted_extra_body_and_window(proxy_url, upstream, alice, alice_key):
    api_key = alice.api_keys.get()
    token_config_save(
        api_key=api_key,
        fields={
            "upstream_base_url": upstream.url,
            "upstream_api_key": "per-key-secret",
            "extra_body": {"seed": 7, "temperature": 1.0},
            "session_window_size": 2,
            "memory_limit": 1,
        },
        partial=False,
        call=internal_call(),
    )
    row = TokenConfig.objects.get()
    assert "per-key-secret" not in row.upstream_api_key_encrypted
    chat = client(proxy_url, alice_key)
    for n in range(3):
        chat.chat.completions.create(model="m", temperature=0.1, messages=[{"role": "user", "content": f"m{n}"}])
    sent = upstream.requests[-1]
    assert sent["headers"]["authorization"] == "Bearer per-key-secret"
    assert sent["json"]["seed"] == 7 and sent["json"]["temperature"] == 0.1  # the client's field wins
    assert len(sent["json"]["messages"]) == 3  # window of 2 + the new message


@pytest.mark.parametrize(
    "fields",
    [
        {"upstream_base_url": "", "upstream_api_key": "k"},
        {"upstream_base_url": "http://x", "upstream_api_key": ""},
        {"upstream_base_url": "http://x", "upstream_api_key": "k", "memory_limit": 0},
        {"upstream_base_url": "http://x", "upstream_api_key": "k", "session_window_size": 0},
        {"upstream_base_url": "http://x", "upstream_api_key": "k", "extra_body": "[1]"},
        {"upstream_base_url": "ftp://x", "upstream_api_key": "k"},
        {"upstream_base_url": "http://x"},
    ],
)
def test_config_validated_on_save(alice, fields):
    from core.errors import ServiceError

    api_key, _ = api_key_issue(user=alice)
    with pytest.raises(ServiceError):
        token_config_save(api_key=api_key, fields=fields, partial=False, call=internal_call())
    assert TokenConfig.objects.count() == 0


def test_two_creates_of_one_keys_configuration_give_one_row_and_one_conflict(alice, monkeypatch):
    """Both saw no configuration and both inserted: the second met the unique constraint,
    a 500. The key's row is locked first, so the second waits and then answers conflict."""
    import threading

    from core.errors import ServiceError
    from proxy import services as proxy_services
    from tests.conftest import InThread

    api_key, _ = api_key_issue(user=alice)
    fields = {"upstream_base_url": "http://127.0.0.1:9", "upstream_api_key": "sk-alice"}
    validate, reached, go = proxy_services._config_validate, threading.Event(), threading.Event()

    def first_held(*args, **kwargs):  # the first save waits inside its transaction
        if not reached.is_set():
            reached.set()
            assert go.wait(60)
        return validate(*args, **kwargs)

    monkeypatch.setattr(proxy_services, "_config_validate", first_held)

    def create():
        try:
            token_config_save(
                api_key=api_key, fields=dict(fields), partial=False, call=internal_call(), must_create=True
            )
            return "created"
        except ServiceError as exc:
            return exc.code

    first = InThread(create)
    assert reached.wait(30)
    second = InThread(create)
    time.sleep(0.5)  # the second is waiting for the key's lock
    go.set()
    assert sorted([first.result(), second.result()]) == ["conflict", "created"]
    assert TokenConfig.objects.count() == 1


def test_admin_api_staff_only_crud_and_secret_never_shown(proxy_url, alice, bob, alice_key, bob_key):
    alice.is_staff = True
    alice.is_superuser = True  # every TokenConfig permission (tests/test_proxy_admin_access.py)
    alice.save()
    bob_key_id = bob.api_keys.get().key_id
    url = f"{proxy_url}/v1/admin/tokens"
    staff = {"Authorization": f"Bearer {alice_key}"}
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, headers={"Authorization": f"Bearer {bob_key}"}).status_code == 403
    body = {"key_id": bob_key_id, "upstream_base_url": "http://127.0.0.1:9", "upstream_api_key": "sk-bob"}
    created = httpx.post(url, headers=staff, json=body)
    assert created.status_code == 201, created.text
    assert "sk-bob" not in created.text and created.json()["upstream_api_key_set"] is True
    assert httpx.post(url, headers=staff, json={**body, "key_id": "nope"}).status_code == 404
    assert httpx.get(f"{url}/nope", headers=staff).status_code == 404
    assert httpx.patch(f"{url}/{bob_key_id}", headers=staff, json={"memory_limit": 0}).status_code == 422
    patched = httpx.patch(f"{url}/{bob_key_id}", headers=staff, json={"memory_limit": 9})
    assert patched.json()["memory_limit"] == 9
    # PUT replaces the whole configuration: what it leaves out is back to its default.
    whole = {k: v for k, v in body.items() if k != "key_id"}
    put = httpx.put(f"{url}/{bob_key_id}", headers=staff, json={**whole, "memory_prompt": "Known: {memories}"})
    assert put.status_code == 200 and put.json()["memory_limit"] == 5 and put.json()["memory_prompt"]
    replaced = httpx.put(f"{url}/{bob_key_id}", headers=staff, json=whole).json()
    assert replaced["memory_prompt"] == "" and replaced["memory_limit"] == 5
    listed = httpx.get(url, headers=staff).json()["tokens"]
    assert [t["key_id"] for t in listed] == [bob_key_id] and "sk-bob" not in json.dumps(listed)
    assert httpx.delete(f"{url}/{bob_key_id}", headers=staff).status_code == 204
    assert httpx.delete(f"{url}/{bob_key_id}", headers=staff).status_code == 404
    # bob's key (no own config, default unset) is back to 401 on the proxy
    assert httpx.post(f"{proxy_url}/v1/chat/completions", headers={"Authorization": f"Bearer {bob_key}"},
                      json={"messages": [{"role": "user", "content": "x"}]}).status_code in (200, 401)  # fmt: skip


def test_missing_template_fails_the_system_check(settings, tmp_path):
    from proxy.checks import memory_template_check

    settings.PROXY_MEMORY_TEMPLATE_PATH = tmp_path / "missing.md"
    errors = memory_template_check()
    assert [e.id for e in errors] == ["proxy.E001"] and "missing" in errors[0].msg
    (tmp_path / "bad.md").write_text("no placeholder")
    settings.PROXY_MEMORY_TEMPLATE_PATH = tmp_path / "bad.md"
    assert "{memories}" in memory_template_check()[0].msg
    settings.PROXY_MEMORY_TEMPLATE_PATH = tmp_path / "good.md"
    (tmp_path / "good.md").write_text("Memories:\n{memories}")
    assert memory_template_check() == []
    from proxy.templates import memory_template_load

    memory_template_load.cache_clear()


def test_api_key_page_section_saves_own_keys_only(client, alice, bob):
    from django.urls import reverse

    alice_key_row, _ = api_key_issue(user=alice, name="a")
    bob_key_row, _ = api_key_issue(user=bob, name="b")
    client.force_login(alice)
    assert "Chat proxy settings" in client.get(reverse("web-keys")).content.decode()
    url = reverse("proxy-key-config", args=[alice_key_row.key_id])
    form = {
        "upstream_base_url": "http://127.0.0.1:9",
        "upstream_api_key": "sk-alice",
        "memory_limit": "3",
        "session_window_size": "10",
        "extra_body": '{"seed": 1}',
        "memory_llm": "{}",
        "memory_prompt": "",
    }
    assert client.post(url, {**form, "memory_limit": "0"}).status_code == 400
    assert client.post(url, form).status_code == 302
    page = client.get(url).content.decode()
    assert "sk-alice" not in page and "http://127.0.0.1:9" in page
    assert client.post(url, {**form, "upstream_api_key": ""}).status_code == 302  # blank keeps the key
    config = selectors.token_config_effective(api_key=alice_key_row)
    assert config.api_key == "sk-alice" and config.memory_limit == 3 and config.extra_body == {"seed": 1}
    # bob's key id behaves like a missing one
    assert client.get(reverse("proxy-key-config", args=[bob_key_row.key_id])).status_code == 404
    assert client.post(reverse("proxy-key-config", args=[bob_key_row.key_id]), form).status_code == 404
    assert not TokenConfig.objects.filter(api_key=bob_key_row).exists()
    assert client.post(url, {"delete": "1"}).status_code == 302
    assert not TokenConfig.objects.exists()


def test_a_read_only_key_is_forbidden_and_changes_nothing(proxy_url, upstream, alice):
    """The proxy stores every turn (a write): a key without `write` (or without `read`,
    which injection needs) gets 403 `forbidden`, reaches no upstream and is not billed."""
    for permissions in (frozenset({"read"}), frozenset({"write"}), frozenset({"read", "delete"})):
        _, key = api_key_issue(user=alice, name=f"only-{'-'.join(sorted(permissions))}", permissions=permissions)
        with pytest.raises(openai.PermissionDeniedError) as caught:
            client(proxy_url, key).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        assert caught.value.response.headers["x-memsite-error"] == "forbidden"
    assert upstream.requests == [] and chat_events() == 0 and ProxyTurn.objects.count() == 0


def test_an_expired_key_gets_401(proxy_url, upstream, alice):
    from datetime import timedelta

    from django.utils import timezone

    api_key, key = api_key_issue(user=alice, name="soon-expired", expires_at=timezone.now() + timedelta(seconds=1))
    type(api_key).objects.filter(pk=api_key.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    with pytest.raises(openai.AuthenticationError):
        client(proxy_url, key).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert upstream.requests == [] and chat_events() == 0


def test_delegation_by_subject_header_follows_the_tenancy_rules(proxy_url, upstream, alice, alice_key, bob):
    """X-Memory-Subject is never ignored: a user key naming anyone else gets 403; a platform
    service key acts for the named user (injects and stores that user's memories, bills
    them, and the audit row names the service as actor); a tenant_admin of another tenant
    gets the same 404 as a user that does not exist."""
    from audit.models import AuditEvent
    from core.choices import Role
    from core.scope import user_tenant
    from memories.tenancy import tenant_create, tenant_user_create

    memory_remember(_scope(bob), memory="Bob keeps bees on the roof", call=internal_call())
    bob_name = f"{user_tenant(bob)}/{bob.get_username()}"
    with pytest.raises(openai.PermissionDeniedError) as caught:
        client(proxy_url, alice_key, **{"X-Memory-Subject": bob_name}).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "bees on the roof?"}]
        )
    assert caught.value.response.headers["x-memsite-error"] == "forbidden"
    assert upstream.requests == [] and chat_events() == 0
    assert AuditEvent.objects.filter(operation=Operation.CHAT_COMPLETION, outcome="denied").count() == 1

    tenant_create(name="acme")
    acme_admin = tenant_user_create(tenant="acme", username="acme-admin")
    _, admin_key = api_key_issue(user=acme_admin, name="acme-bot", role=Role.TENANT_ADMIN)
    answers = []
    for subject in (bob_name, f"{user_tenant(bob)}/ghost"):
        with pytest.raises(openai.NotFoundError) as caught:
            client(proxy_url, admin_key, **{"X-Memory-Subject": subject}).chat.completions.create(
                model="m", messages=[{"role": "user", "content": "x"}]
            )
        answers.append((caught.value.response.headers["x-memsite-error"], caught.value.response.json()))
    assert answers[0] == answers[1]
    assert upstream.requests == [] and chat_events() == 0

    ops = tenant_user_create(tenant=user_tenant(bob), username="ops")
    _, platform_key = api_key_issue(user=ops, name="support-bot", role=Role.PLATFORM)
    client(proxy_url, platform_key, **{"X-Memory-Subject": bob_name}).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Where are the bees kept?"}]
    )
    assert "Bob keeps bees on the roof" in system_of(upstream.requests[-1])
    assert UsageEvent.objects.get(operation=Operation.CHAT_COMPLETION).user_id == str(bob.pk)
    row = AuditEvent.objects.get(operation=Operation.CHAT_COMPLETION, outcome="ok")
    assert (row.subject_user_id, row.actor_username, row.actor_role) == (bob.pk, "ops", Role.PLATFORM)
    assert ProxyTurn.objects.filter(user=bob).count() == 1 and ProxyTurn.objects.filter(user=ops).count() == 0
