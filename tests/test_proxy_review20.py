"""Review 20: the chat proxy's session id limit, a long pasted prompt (and what a statement
over a database limit answers), delegated calls in the audit trail (refusals, extraction),
the proxy's conversation logs on the Sessions page, and Clear all against the proxy's
queued turns and logs."""

from __future__ import annotations

import json
import sys

import httpx
import pytest
from django.db import connection
from django.test import RequestFactory

from audit.models import AuditEvent
from core.choices import Operation, Role
from core.scope import CallContext, MemoryScope
from memories import sessions
from memories.models import SessionEvent, SessionState
from memories.services import api_key_issue, memory_clear_all, memory_list
from memories.tenancy import tenant_create, tenant_user_create
from memsite.unavailable import is_backend_unavailable, is_program_limit_exceeded, server_error
from proxy import services
from proxy.models import ProxyTurn
from tests.conftest import internal_call, serve_in_thread

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]


@pytest.fixture(scope="module")
def proxy_url(django_db_setup):  # noqa: ARG001
    yield from serve_in_thread("memsite.asgi:build_application", factory=True)


def chat(url: str, key: str, content: str, **headers: str) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {key}", **headers},
        json={"model": "m", "messages": [{"role": "user", "content": content}]},
        timeout=120,
    )


def chat_audit() -> list[tuple[str, str]]:
    return list(AuditEvent.objects.filter(operation=Operation.CHAT_COMPLETION).values_list("outcome", "error_code"))


def finish_turn(caller: services.ChatCaller, *, session_id: str, text: str) -> int | None:
    """One answered chat call recorded as the view records it (no upstream needed)."""
    call = services.chat_call_context(CallContext(channel="proxy"), caller=caller)
    return services.chat_call_finish(
        caller,
        call=call,
        session_id=session_id,
        status=200,
        stream=False,
        model="m",
        request_messages=[{"role": "user", "content": text}],
        answer={"role": "assistant", "content": "Noted."},
        memory_ids=[],
        history_items=0,
    )


def clear_all(scope: MemoryScope) -> None:
    """The user's Clear all. Until memories.services.memory_clear_all runs the clear-all
    hooks itself (one line, in its transaction), the test runs them after it: idempotent."""
    memory_clear_all(scope, confirm=True, call=internal_call())
    sessions.session_data_clear_all(scope)


# --- 1. X-Session-Id: at most what the session log holds -------------------------------------
@pytest.mark.parametrize("length", [128, 129, 200])
def test_a_session_id_is_refused_before_the_upstream_unless_it_can_be_recorded(proxy_url, upstream, alice_key, length):
    session = "s" * length
    response = chat(proxy_url, alice_key, "hi", **{"X-Session-Id": session})
    if length <= 128:
        assert response.status_code == 200, response.text
        assert SessionEvent.objects.filter(session_id=session).exists()
        assert chat_audit() == [("ok", "")]
    else:
        assert response.status_code == 422
        assert response.json()["error"]["code"] == "invalid_session_id"
        assert "128" in response.json()["error"]["message"]
        assert upstream.requests == []
        assert [outcome for outcome, _ in chat_audit()] == ["error"]


def test_the_session_id_limit_is_the_session_logs_column():
    column = SessionEvent._meta.get_field("session_id").max_length
    assert services.MAX_SESSION_ID_CHARS == column == SessionState._meta.get_field("session_id").max_length


def test_a_streamed_call_with_a_too_long_session_id_is_refused_up_front(proxy_url, upstream, alice_key):
    with httpx.stream(
        "POST",
        f"{proxy_url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {alice_key}", "X-Session-Id": "s" * 150},
        json={"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]},
        timeout=30,
    ) as response:
        status = response.status_code
        response.read()
    assert status == 422
    assert upstream.requests == []
    assert [outcome for outcome, _ in chat_audit()] == ["error"]


# --- 2. a long pasted prompt; a statement over a database limit --------------------------------
def test_a_long_pasted_prompt_is_answered_with_a_bounded_memory_search(proxy_url, upstream, alice_key):
    text = " ".join(f"w{i:x}q" for i in range(180_000))  # ~1.6 MB of distinct words: a tsvector over 1 MB
    response = chat(proxy_url, alice_key, text)
    assert response.status_code == 200, response.text[:300]
    assert len(upstream.requests) == 1
    assert chat_audit() == [("ok", "")]


def _program_limit_error() -> BaseException:
    text = " ".join(f"w{i:x}q" for i in range(180_000))
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT to_tsvector('english', %s)", [text])
    except Exception as exc:  # noqa: BLE001 - the error under test
        return exc
    raise AssertionError("to_tsvector of 1.6 MB of distinct words did not fail")


def test_a_statement_over_a_database_limit_is_no_outage_but_a_coded_413():
    error = _program_limit_error()
    assert is_program_limit_exceeded(error)
    assert not is_backend_unavailable(error)
    request = RequestFactory().get("/v1/memories")
    try:
        raise error
    except Exception:  # noqa: BLE001 - handler500 runs inside the except
        assert sys.exc_info()[1] is error
        response = server_error(request)
    assert response.status_code == 413
    assert json.loads(response.content)["error"]["code"] == "payload_too_large"
    assert "Retry-After" not in response


# --- 3. a refusal of a delegated call names the service that made it ---------------------------
def _acme():
    tenant_create(name="acme")
    ann = tenant_user_create(tenant="acme", username="ann")
    bot = tenant_user_create(tenant="acme", username="acme-bot")
    key = api_key_issue(user=bot, name="bot", role=Role.TENANT_ADMIN)[1]
    return ann, bot, key


def _who(row: AuditEvent) -> tuple:
    return row.subject_user_id, row.actor_user_id, row.actor_username, row.actor_role


def test_a_refused_delegated_chat_call_is_audited_as_the_service(client, settings):
    settings.CHAT_UPSTREAM_BASE_URL = "http://127.0.0.1:9/v1"
    ann, bot, key = _acme()
    response = client.post(
        "/v1/chat/completions",
        data=json.dumps({"messages": "not a list"}),
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {key}",
        HTTP_X_MEMORY_SUBJECT="acme/ann",
    )
    assert response.status_code == 422
    (row,) = AuditEvent.objects.filter(operation=Operation.CHAT_COMPLETION)
    assert row.outcome == "error"
    assert _who(row) == (ann.pk, bot.pk, "acme-bot", "tenant_admin")


# --- 4. the extraction of a delegated chat call is the service's write ------------------------
def test_the_extraction_of_a_delegated_chat_call_names_the_service(llm, settings):
    settings.CHAT_UPSTREAM_BASE_URL = "http://127.0.0.1:9/v1"
    ann, bot, key = _acme()
    caller = services.chat_caller_authenticate(authorization=f"Bearer {key}")
    caller = services.chat_caller_authorize(caller, subject="acme/ann")
    turn_pk = finish_turn(caller, session_id="s1", text="I keep bees on my roof.")
    assert turn_pk is not None
    llm.queue_facts("Ann keeps bees on her roof")
    assert services.proxy_turn_extract(turn_pk=turn_pk) == "done"
    chat_row = AuditEvent.objects.get(operation=Operation.CHAT_COMPLETION)
    ingest_row = AuditEvent.objects.get(operation=Operation.INGEST)
    assert ingest_row.memory_ids, "the extraction stored a memory"
    assert _who(chat_row) == _who(ingest_row) == (ann.pk, bot.pk, "acme-bot", "tenant_admin")
    assert ingest_row.actor_auth == chat_row.actor_auth == "api_key"
    # The service's own key, carried by the queued turn to the later extraction.
    assert ingest_row.actor_credential == chat_row.actor_credential == f"key:{caller.api_key.key_id}"


# --- 5. the proxy's conversation logs are listed, maintained and cleared ----------------------
def test_the_proxys_conversation_log_is_listed_on_the_sessions_page(proxy_url, upstream, alice, alice_key, client):
    assert chat(proxy_url, alice_key, "My therapist is Dr Zorbanek").status_code == 200
    key_id = services.chat_caller_authenticate(authorization=f"Bearer {alice_key}").api_key.key_id
    scope = MemoryScope.for_user(alice)
    state = SessionState.objects.get(engine_user_id=scope.engine_user_id, project="", session_id=f"key:{key_id}")
    first_active = state.last_active_at
    assert chat(proxy_url, alice_key, "And my dentist is Dr Quill").status_code == 200
    state.refresh_from_db()
    assert state.last_active_at > first_active  # touched by each writer of the log: maintained nightly
    assert SessionState.objects.count() == 1
    client.force_login(alice)
    assert f"key:{key_id}" in client.get("/sessions/").content.decode()


def test_clear_all_deletes_the_proxys_conversation_logs(proxy_url, upstream, alice, alice_key):
    assert chat(proxy_url, alice_key, "My therapist is Dr Zorbanek", **{"X-Session-Id": "named"}).status_code == 200
    assert chat(proxy_url, alice_key, "My bank PIN is 4321").status_code == 200
    scope = MemoryScope.for_user(alice)
    # A turn tool's session of the same user is not the proxy's: it stays.
    sessions.session_events_append(
        scope, session_id="s-agent", project="p", items=[{"type": "message", "role": "user", "content": "agent"}]
    )
    clear_all(scope)
    left = SessionEvent.objects.filter(engine_user_id=scope.engine_user_id)
    assert list(left.values_list("session_id", flat=True)) == ["s-agent"]
    assert chat(proxy_url, alice_key, "hello again").status_code == 200
    replayed = json.dumps(upstream.requests[-1]["json"]["messages"])
    assert "Zorbanek" not in replayed and "4321" not in replayed


# --- 6. Clear all stops a queued chat turn from re-learning ------------------------------------
def test_clear_all_closes_the_queued_chat_turns(alice, llm, settings):
    settings.CHAT_UPSTREAM_BASE_URL = "http://127.0.0.1:9/v1"
    key = api_key_issue(user=alice, name="chat")[1]
    caller = services.chat_caller_authenticate(authorization=f"Bearer {key}")
    turn_pk = finish_turn(caller, session_id="s1", text="My sister is called Ingrid.")
    assert turn_pk is not None
    scope = MemoryScope.for_user(alice)
    clear_all(scope)
    turn = ProxyTurn.objects.get(pk=turn_pk)
    assert (turn.state, turn.messages, turn.last_error) == ("failed", [], services.CLEARED_REASON)
    llm.queue_facts("User's sister is called Ingrid")
    assert services.proxy_turn_extract(turn_pk=turn_pk) == "skipped"  # the worker gets to it later
    assert memory_list(scope, call=internal_call()).memories == []
    # A turn recorded after the clear is extracted as usual.
    later = finish_turn(caller, session_id="s1", text="I moved to Oslo.")
    llm.queue_facts("User moved to Oslo")
    assert services.proxy_turn_extract(turn_pk=later) == "done"
