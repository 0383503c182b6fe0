"""Session 32 on the chat proxy's `POST /v1/chat/completions`: an exception no layer
answered is answered in the proxy's OpenAI error shape (before the stream starts, a JSON
500 `internal_error`, a lost database 503 `backend_unavailable`; once the 200 is out, an
error event as for a stream that broke off), with one audit row, no usage event and no
text of the exception anywhere."""

from __future__ import annotations

import json

import django.db
import httpx
import pytest

from audit.models import AuditEvent
from billing.models import UsageEvent
from core.choices import Operation
from proxy import services as proxy_services
from proxy.messages import Answer
from proxy.models import ProxyTurn
from tests.conftest import serve_in_thread, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]

SECRET_TEXT = "sk-live-do-not-show-1234"


@pytest.fixture(scope="module")
def proxy_url(django_db_setup):  # noqa: ARG001 - the server uses the test database
    yield from serve_in_thread("memsite.asgi:build_application", factory=True, lifespan="on")


def chat(url: str, key: str, *, stream: bool) -> httpx.Response:
    body = {"model": "m", "stream": stream, "messages": [{"role": "user", "content": "hello"}]}
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, json=body
    ) as response:
        response.read()
    return response


def chat_rows() -> list[tuple]:
    rows = AuditEvent.objects.filter(operation=Operation.CHAT_COMPLETION).order_by("id")
    return list(rows.values_list("subject_user_id", "outcome", "error_code"))


def assert_proxy_error(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    assert response.headers["x-memsite-error"] == code
    error = response.json()["error"]
    assert error["code"] == code and error["type"] == "memsite_error"
    assert SECRET_TEXT not in response.text and "Traceback" not in response.text


def test_an_unexpected_failure_before_the_answer_is_a_json_500_audited_once(
    proxy_url, upstream, alice, alice_key, monkeypatch, caplog
):
    """It was Django's HTML "Server Error (500)" page, with no audit row. Now: 500
    `internal_error` in the proxy's shape, streamed or not, one error row under the
    caller, no usage event, the exception's text in neither the answer, the row nor the log."""

    def broken(*args, **kwargs):
        raise RuntimeError(f"cannot load {SECRET_TEXT}")

    monkeypatch.setattr(proxy_services, "chat_history_load", broken)
    assert_proxy_error(chat(proxy_url, alice_key, stream=False), 500, "internal_error")
    assert_proxy_error(chat(proxy_url, alice_key, stream=True), 500, "internal_error")

    error = AuditEvent.Outcome.ERROR
    assert chat_rows() == [(alice.pk, error, "backend_unavailable")] * 2
    assert upstream.requests == []
    assert UsageEvent.objects.filter(operation=Operation.CHAT_COMPLETION).count() == 0
    assert SECRET_TEXT not in str(list(AuditEvent.objects.values_list("detail", flat=True)))
    assert SECRET_TEXT not in caplog.text


def test_a_lost_database_before_the_answer_is_a_coded_503(proxy_url, upstream, alice, alice_key, monkeypatch):
    def lost(**kwargs):
        raise django.db.OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(proxy_services, "chat_rate_limit_consume", lambda caller: lost())
    response = chat(proxy_url, alice_key, stream=False)
    assert_proxy_error(response, 503, "backend_unavailable")
    assert response.headers["retry-after"] == "5"
    assert chat_rows() == [(alice.pk, AuditEvent.Outcome.ERROR, "backend_unavailable")]
    assert upstream.requests == []


def test_an_unexpected_failure_mid_stream_ends_it_with_an_error_event_not_billed(
    proxy_url, upstream, alice, alice_key, monkeypatch, caplog
):
    """Once the 200 is out, the stream ends as one that broke off does: an error event
    (`internal_error`), no [DONE], one error row, not billed, no turn. It was recorded as
    a call its client stopped: billed, a half turn stored."""
    upstream.reply = "one two three"
    feed = Answer.feed

    def feed_then_break(self, chunk):
        feed(self, chunk)  # the answer so far is collected, as a client that left leaves it
        raise RuntimeError(f"cannot parse {SECRET_TEXT}")

    monkeypatch.setattr(Answer, "feed", feed_then_break)
    response = chat(proxy_url, alice_key, stream=True)
    assert response.status_code == 200
    assert b"[DONE]" not in response.content and SECRET_TEXT not in response.text
    (event,) = [e for e in response.text.split("\n\n") if e.strip()]
    assert json.loads(event.removeprefix("data: "))["error"]["code"] == "internal_error"

    wait_for(lambda: chat_rows() != [], timeout=5, what="the audit row")
    assert chat_rows() == [(alice.pk, AuditEvent.Outcome.ERROR, "internal_error")]
    assert UsageEvent.objects.filter(operation=Operation.CHAT_COMPLETION).count() == 0
    assert ProxyTurn.objects.count() == 0
    assert SECRET_TEXT not in str(list(AuditEvent.objects.values_list("detail", flat=True)))
    assert SECRET_TEXT not in caplog.text
