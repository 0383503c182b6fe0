"""Session 32: two chat calls on one proxy session that overlap. Each call reads the
session log's last items to decide what of its request is new (`_turn_new_items`,
`conversation_overlap`) and then appends its turn; two calls that both read the log
before either committed stored the same request items twice. Recording a call takes the
session's lock (`session:<user>::<session id>`, the turn tools' key) in its transaction,
after the upstream answered: the second call waits for the first's commit, then reads
the log it left."""

from __future__ import annotations

import threading

import pytest
from django.db import connection

from core.scope import CallContext
from memories.sessions import session_events_recent
from proxy import services as proxy_services
from tests.conftest import InThread, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]


def advisory_lock_awaited() -> bool:
    """Another transaction of this test database waits for an advisory lock (the second
    call, serialised); pg_locks covers the whole cluster, other workers' databases too."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        )
        return bool(cursor.fetchone()[0])


def test_overlapping_calls_on_one_session_store_the_request_once(alice_key, settings, monkeypatch):
    settings.CHAT_UPSTREAM_BASE_URL = "https://upstream.example"
    caller = proxy_services.chat_caller_authenticate(authorization=f"Bearer {alice_key}")
    real_read = proxy_services.session_item_hashes_recent
    first_read, second_read = threading.Event(), threading.Event()
    reads: list[int] = []
    reads_lock = threading.Lock()

    def read(scope, **kwargs):
        hashes = real_read(scope, **kwargs)
        with reads_lock:
            first = not reads
            reads.append(len(hashes))
        if first:
            first_read.set()
            # Hold the first call's transaction open until the second call has read the
            # log too (the race) or waits for the first one's lock (serialised).
            wait_for(lambda: second_read.is_set() or advisory_lock_awaited(), timeout=60, what="the second call")
        else:
            second_read.set()
        return hashes

    monkeypatch.setattr(proxy_services, "session_item_hashes_recent", read)
    request = [{"role": "user", "content": "I moved to Lisbon last spring."}]

    def finish(answer: str):
        return lambda: proxy_services.chat_call_finish(
            caller,
            call=CallContext(channel="proxy"),
            session_id="trip",
            status=200,
            stream=False,
            model="m",
            request_messages=request,
            answer={"role": "assistant", "content": answer},
            memory_ids=[],
            history_items=0,
        )

    one = InThread(finish("Lisbon is lovely."))
    first_read.wait(60)
    two = InThread(finish("How do you like Lisbon?"))
    one.result()
    two.result()

    log = session_events_recent(caller.scope, session_id="trip", limit=10)
    said = [item["content"] for item in log if item.get("role") == "user"]
    assert said == ["I moved to Lisbon last spring."], log
    assert [item["content"] for item in log if item.get("role") == "assistant"] == [
        "Lisbon is lovely.",
        "How do you like Lisbon?",
    ]
    assert reads == [0, 2]  # the second call read the log the first one left
