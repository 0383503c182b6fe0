"""A database that cannot be reached answers 503 backend_unavailable + Retry-After, never 500;
database error text stays out of the logs; the capabilities of the connected server are known."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

import psycopg
import pytest
from django.db import connection
from django.test import Client

from memsite.dbinfo import database_info, pgvector_version, vector_search_plan
from memsite.logfilters import WITHHELD, RedactDatabaseErrors
from memsite.unavailable import RETRY_AFTER_S, BackendUnavailableMiddleware

pytestmark = pytest.mark.django_db(transaction=True)


@contextlib.contextmanager
def database_unreachable():
    real_name = connection.settings_dict["NAME"]
    connection.close()
    connection.close_pool()
    connection.settings_dict["NAME"] = "memsite_database_that_does_not_exist"
    try:
        yield
    finally:
        connection.close()
        connection.close_pool()
        connection.settings_dict["NAME"] = real_name


def test_rest_answers_503_with_retry_after(alice_key):
    client = Client(raise_request_exception=False)
    with database_unreachable():
        response = client.get("/v1/memories", HTTP_AUTHORIZATION=f"Bearer {alice_key}")
    assert response.status_code == 503
    assert response["Retry-After"] == str(RETRY_AFTER_S)
    assert response.json()["error"]["code"] == "backend_unavailable"


def test_web_ui_answers_a_plain_503_page(alice):
    client = Client(raise_request_exception=False)
    client.force_login(alice)
    with database_unreachable():
        response = client.get("/", HTTP_ACCEPT="text/html")
    assert response.status_code == 503
    assert response["Retry-After"] == str(RETRY_AFTER_S)
    assert response["Content-Type"].startswith("text/html")
    assert b"Temporarily unavailable" in response.content


def test_healthz_503_has_retry_after_and_versions(client):
    with database_unreachable():
        response = client.get("/healthz")
    assert response.status_code == 503
    assert response["Retry-After"] == str(RETRY_AFTER_S)
    body = client.get("/healthz").json()
    assert body["status"] == "ok"
    assert body["postgres"] == database_info().server_version
    assert body["pgvector"] == pgvector_version()
    # Exact scans for small users, HNSW with iterative scans for large ones, where supported.
    assert body["vector_search_plan"] == ("adaptive" if database_info().iterative_index_scans else "exact")


def test_database_capabilities():
    info = database_info()
    assert info.server_version_num >= 160000
    assert info.pgvector_version
    if not __import__("os").environ.get("DATABASE_URL"):  # the embedded server
        assert info.server_version.startswith("18.")
        assert info.iterative_index_scans and info.halfvec
    # SEARCH_INDEX_MIN_ROWS keeps its default: exact below it, the index with iterative scans above
    assert vector_search_plan(info) == ("adaptive" if info.iterative_index_scans else "exact")


def test_asgi_wrapper_turns_a_lost_database_into_503():
    async def failing_app(scope, receive, send):
        raise psycopg.OperationalError("connection refused")

    async def answering_503(scope, receive, send):
        await send({"type": "http.response.start", "status": 503, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def run(app):
        sent = []

        async def send(message):
            sent.append(message)

        async def receive():
            return {"type": "http.request", "body": b""}

        await BackendUnavailableMiddleware(app)({"type": "http", "path": "/engines/memory/mcp"}, receive, send)
        return sent

    sent = asyncio.run(run(failing_app))
    assert sent[0]["status"] == 503
    assert (b"retry-after", str(RETRY_AFTER_S).encode()) in sent[0]["headers"]
    assert json.loads(sent[1]["body"])["error"]["code"] == "backend_unavailable"
    sent = asyncio.run(run(answering_503))
    assert (b"retry-after", str(RETRY_AFTER_S).encode()) in sent[0]["headers"]

    async def other_error(scope, receive, send):
        raise ValueError("not a database problem")

    with pytest.raises(ValueError):
        asyncio.run(run(other_error))


def test_database_error_text_is_withheld_from_logs():
    secret = "alice's diary entry"
    with connection.cursor() as cursor:
        try:
            cursor.execute("SELECT %s::jsonb", [f'{{"memory": "{secret}"'])
        except Exception as exc:  # noqa: BLE001 - the driver error whose text quotes the data
            error = exc
    assert secret in str(error)
    try:
        raise RuntimeError("wrapped") from error
    except RuntimeError:
        record = logging.getLogger("test").makeRecord(
            "test", logging.ERROR, __file__, 1, "failed: %s", (error,), exc_info=__import__("sys").exc_info()
        )
    assert RedactDatabaseErrors().filter(record)
    text = logging.Formatter("%(message)s").format(record)
    assert secret not in text
    assert WITHHELD in text and "RuntimeError: wrapped" in text


def test_live_server_recovers_after_its_connections_are_killed(memsite_server, alice_key):
    """What an external Postgres restart or failover does to a running web process: every
    connection it holds (Django's pool, mem0's pool, the broker's) is cut. The next calls
    succeed (pools check on checkout) or at worst answer a coded 503, never a 500."""
    import httpx

    headers = {"Authorization": f"Bearer {alice_key}"}
    with httpx.Client(base_url=memsite_server, headers=headers, timeout=30) as http:
        assert http.post("/v1/memories", json={"memory": "Alice keeps bees."}).status_code == 201
        assert http.post("/v1/memories/search", json={"query": "bees"}).status_code == 200
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
            assert cursor.fetchone()[0] > 0
        statuses = []
        for i in range(6):
            response = http.post("/v1/memories", json={"memory": f"Alice's hive number {i} is blue."})
            statuses.append(response.status_code)
            if response.status_code == 503:
                assert response.headers["Retry-After"] and response.json()["error"]["code"] == "backend_unavailable"
            response = http.post("/v1/memories/search", json={"query": "hive"})
            statuses.append(response.status_code)
        assert set(statuses) <= {200, 201, 503}, statuses
        assert statuses[-4:] == [201, 200, 201, 200], statuses


def test_pooled_connections_are_checked_by_polling_their_socket():
    """The pool's checkout check (memsite.postgresql) skips the round trip for an idle,
    healthy connection and still notices one the server has cut: it is replaced."""
    from memsite.postgresql.base import pooled_connection_check

    connection.close()
    pool = connection.pool
    assert pool is not None and pool._check is pooled_connection_check
    held = pool.getconn()
    try:
        pooled_connection_check(held)  # idle and healthy: passes
        with connection.cursor() as cursor:  # another pooled connection cuts this one
            cursor.execute("SELECT pg_terminate_backend(%s)", [held.info.backend_pid])
        for _ in range(50):  # the server's FATAL message reaches the socket
            try:
                pooled_connection_check(held)
            except psycopg.OperationalError:
                break
            time.sleep(0.02)
        else:
            pytest.fail("a terminated connection passed the checkout check")
    finally:
        pool.putconn(held)
    connection.close()
    with connection.cursor() as cursor:  # what the pool hands out next works
        cursor.execute("SELECT 1")
        assert cursor.fetchone() == (1,)
