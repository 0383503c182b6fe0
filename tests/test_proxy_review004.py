"""Review of seed 004 (the chat proxy): every new message of a turn reaches extraction,
the upstream sees the conversation once (a message said twice, a conversation longer
than the dedupe window), and a request's leading developer message is its instructions."""

from __future__ import annotations

import httpx
import pytest

from audit.models import AuditEvent
from core.choices import Operation
from memories.models import SessionEvent
from memories.schemas import INGEST_MAX_MESSAGES
from memories.services import memory_remember
from proxy.messages import messages_enrich
from proxy.models import ProxyTurn
from tests.conftest import internal_call, serve_in_thread

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]


@pytest.fixture(scope="module")
def proxy_url(django_db_setup):  # noqa: ARG001 - the server uses the test database
    yield from serve_in_thread("memsite.asgi:build_application", factory=True, lifespan="on")


def post(url: str, key: str, messages: list[dict], session: str) -> str:
    response = httpx.post(
        f"{url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {key}", "X-Session-Id": session},
        json={"model": "m", "messages": messages},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def log_of(session: str) -> list:
    items = SessionEvent.objects.filter(session_id=session).order_by("id").values_list("item", flat=True)
    return [(item["role"], item["content"]) for item in items]


def chat_detail() -> dict:
    return AuditEvent.objects.filter(operation=Operation.CHAT_COMPLETION).latest("id").detail


# --- 1. extraction gets the turn's new messages, not its last two -----------------------
def test_every_new_message_of_a_turn_reaches_extraction(proxy_url, upstream, alice_key):
    messages = [
        {"role": "user", "content": "I live in Paris."},
        {"role": "user", "content": "I am allergic to peanuts."},
        {"role": "user", "content": "Suggest a dinner."},
    ]
    post(proxy_url, alice_key, messages, "batch")
    turn = ProxyTurn.objects.get()
    assert turn.messages == [*messages, {"role": "assistant", "content": "Hello from upstream."}]


def test_a_first_call_carrying_earlier_history_hands_all_of_it_to_extraction(proxy_url, upstream, alice_key):
    earlier = [
        {"role": "user", "content": "I live in Paris."},
        {"role": "assistant", "content": "Noted."},
        {"role": "user", "content": "Suggest a dinner."},
    ]
    post(proxy_url, alice_key, earlier, "migrated")
    assert ProxyTurn.objects.get().messages == [*earlier, {"role": "assistant", "content": "Hello from upstream."}]
    # The next call resends it all: only what is new is extracted (and stored).
    upstream.reply = "Try the bistro."
    conversation = [*earlier, {"role": "assistant", "content": "Hello from upstream."}]
    post(proxy_url, alice_key, [*conversation, {"role": "user", "content": "I am vegetarian."}], "migrated")
    assert ProxyTurn.objects.order_by("id").last().messages == [
        {"role": "user", "content": "I am vegetarian."},
        {"role": "assistant", "content": "Try the bistro."},
    ]


def test_a_turn_past_what_extraction_takes_keeps_the_newest_and_says_so(proxy_url, upstream, alice_key):
    messages = [{"role": "user", "content": f"Fact number {n}."} for n in range(INGEST_MAX_MESSAGES + 10)]
    post(proxy_url, alice_key, messages, "long-turn")
    turn = ProxyTurn.objects.get()
    assert len(turn.messages) == INGEST_MAX_MESSAGES
    assert turn.messages[-2:] == [messages[-1], {"role": "assistant", "content": "Hello from upstream."}]
    detail = chat_detail()
    assert detail["extraction_messages_left_out"] == 11  # in the session log, not extracted
    assert detail["session_items_stored"] == len(messages) + 1


# --- 2. the upstream sees the conversation once ----------------------------------------
def test_a_repeated_user_message_does_not_replay_the_conversation(proxy_url, upstream, alice_key):
    """A client resending the whole conversation where the user said "continue" twice:
    the log skipped the second one as a duplicate, its tail no longer matched the request,
    and the history was injected again (the client's 7 messages became 11)."""
    conversation: list[dict] = []
    for n, text in enumerate(["Plan my trip", "continue", "continue", "thanks"]):
        upstream.reply = f"Answer {n}"
        conversation.append({"role": "user", "content": text})
        answer = post(proxy_url, alice_key, conversation, "repeat")
        assert upstream.requests[-1]["json"]["messages"] == conversation
        conversation.append({"role": "assistant", "content": answer})
    assert log_of("repeat") == [(m["role"], m["content"]) for m in conversation]
    # A client that then sends only its new message gets the whole conversation as history.
    post(proxy_url, alice_key, [{"role": "user", "content": "one more"}], "repeat")
    assert upstream.requests[-1]["json"]["messages"] == [*conversation, {"role": "user", "content": "one more"}]


def test_a_conversation_longer_than_the_dedupe_window_is_sent_once(proxy_url, upstream, alice, alice_key, settings):
    """The log's duplicate check looks back PROXY_DEDUPE_WINDOW items: a resent conversation
    longer than that had its oldest items appended again on every call."""
    settings.PROXY_DEDUPE_WINDOW = 4
    conversation: list[dict] = []
    for n in range(6):
        upstream.reply = f"Answer {n}"
        conversation.append({"role": "user", "content": f"Question {n}"})
        answer = post(proxy_url, alice_key, conversation, "long")
        assert upstream.requests[-1]["json"]["messages"] == conversation
        conversation.append({"role": "assistant", "content": answer})
    assert log_of("long") == [(m["role"], m["content"]) for m in conversation]


def test_a_client_sending_only_new_messages_still_gets_its_history(proxy_url, upstream, alice_key):
    sent = []
    for n, text in enumerate(["hello", "continue", "continue"]):
        upstream.reply = f"Answer {n}"
        post(proxy_url, alice_key, [{"role": "user", "content": text}], "new-only")
        sent.append(upstream.requests[-1]["json"]["messages"])
    assert [m["content"] for m in sent[1]] == ["hello", "Answer 0", "continue"]
    # A repeat the client sends alone is the seed's duplicate (a retry looks the same): the
    # log skips it, the upstream still gets it, once.
    assert [m["content"] for m in sent[2]] == ["hello", "Answer 0", "continue", "Answer 1", "continue"]


# --- 3. a leading developer message is the request's instructions ----------------------
def test_a_leading_developer_message_gets_the_memories_and_the_history_after_it(
    proxy_url, upstream, alice_key, alice_scope
):
    memory_remember(alice_scope, memory="Alice likes tea", call=internal_call())
    post(proxy_url, alice_key, [{"role": "user", "content": "first tea"}], "dev")
    request = [{"role": "developer", "content": "You are terse."}, {"role": "user", "content": "tea again?"}]
    post(proxy_url, alice_key, request, "dev")
    sent = upstream.requests[-1]["json"]["messages"]
    assert [m["role"] for m in sent] == ["developer", "user", "assistant", "user"]
    assert sent[0]["content"].startswith("You are terse.\n\n## What you remember about the user")
    assert "- Alice likes tea" in sent[0]["content"]
    assert [m["content"] for m in sent[1:]] == ["first tea", "Hello from upstream.", "tea again?"]


def test_history_goes_after_all_leading_instructions():
    history = [{"role": "user", "content": "earlier"}, {"role": "assistant", "content": "reply"}]
    request = [
        {"role": "system", "content": "sys"},
        {"role": "developer", "content": "dev"},
        {"role": "user", "content": "now"},
    ]
    sent = messages_enrich(request, memory_block="MEM", history=history)
    assert sent == [
        {"role": "system", "content": "sys\n\nMEM"},
        {"role": "developer", "content": "dev"},
        *history,
        {"role": "user", "content": "now"},
    ]
    # A system message further down is the client's, where it put it; the memories go first.
    late = [{"role": "user", "content": "now"}, {"role": "system", "content": "late"}]
    assert messages_enrich(late, memory_block="MEM", history=history) == [
        {"role": "system", "content": "MEM"},
        *history,
        *late,
    ]


# --- 4. the last two messages alone past what extraction takes ----------------------------
@pytest.mark.parametrize(
    ("question", "answer", "kept"), [(45_000, 20, (39_980, 20)), (30_000, 50_000, (20_000, 20_000))]
)
def test_a_turn_whose_last_two_messages_are_too_long_hands_extraction_what_fits(
    proxy_url, upstream, alice_key, llm, question, answer, kept
):
    """The last user message and the answer were always kept whole: a pasted document of
    45,000 characters went to extraction as it was (nothing refuses it on the way: the
    worker's ingest is no client call) and mem0's LLM was sent more than an `ingest` call
    may send. The pair now shares INGEST_MAX_TOTAL_CHARS (each at least half of it, what
    one leaves the other's), cut from their end and counted on the audit row."""
    from memories.schemas import INGEST_MAX_TOTAL_CHARS
    from proxy.services import proxy_turn_extract

    pasted = "The document says hello. " * (question // 25)
    upstream.reply = "Bonjour. " * (answer // 9) if answer > 20 else "Hello from upstream."
    messages = [{"role": "user", "content": "I live in Paris."}, {"role": "user", "content": pasted}]
    post(proxy_url, alice_key, messages, "pasted")

    turn = ProxyTurn.objects.get()
    assert [len(m["content"]) for m in turn.messages] == list(kept)
    assert sum(len(m["content"]) for m in turn.messages) <= INGEST_MAX_TOTAL_CHARS
    assert turn.messages[0]["content"] == pasted[: kept[0]]
    detail = chat_detail()
    assert detail["extraction_messages_left_out"] == 1  # "I live in Paris.": in the session log
    assert detail["extraction_messages_shortened"] == (1 if answer <= 20 else 2)
    assert detail["session_items_stored"] == 3
    llm.queue_facts("The user pasted a document")
    assert proxy_turn_extract(turn_pk=turn.pk) == "done"
    prompt = "\n".join(llm.prompts())
    assert pasted[: kept[0]] in prompt and pasted[: kept[0] + 25] not in prompt
