"""The memory REST API through memsite.asgi.application in-process: its sync views run on
the REST thread pool (memsite/threaded_django.py), one thread hop per request, with the
same middleware as the rest of Django."""

import asyncio
import threading

import pytest
from django.core import signals

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_vectors")]

MISSING_ID = "6f1c3a52-0c1e-4c55-9d1c-8f0f5b1d2e3a"


def _requests(calls):
    """Send (method, path, token, json) requests to a fresh app, in order; the responses."""

    async def main():
        import httpx2

        from memsite.asgi import build_application

        transport = httpx2.ASGITransport(app=build_application())
        async with httpx2.AsyncClient(transport=transport, base_url="http://localhost", timeout=60) as http:
            responses = []
            for method, path, token, body in calls:
                headers = {"Authorization": f"Bearer {token}"} if token else {}
                responses.append(await http.request(method, path, headers=headers, json=body))
            return responses

    return asyncio.run(main())


@pytest.fixture
def request_threads():
    """The name of the thread each request started on."""
    names: list[str] = []

    def record(**kwargs):  # noqa: ARG001
        names.append(threading.current_thread().name)

    signals.request_started.connect(record, weak=False)
    yield names
    signals.request_started.disconnect(record)


def test_rest_calls_run_on_the_rest_threads_with_the_usual_middleware(alice_key, request_threads):
    created, found, health = _requests(
        [
            ("POST", "/v1/memories", alice_key, {"memory": "Alice keeps a sourdough starter"}),
            ("POST", "/v1/memories/search", alice_key, {"query": "sourdough", "top_k": 3}),
            ("GET", "/healthz", None, None),
        ]
    )
    assert created.status_code == 201, created.text
    assert found.status_code == 200 and found.json()["results"][0]["id"] == created.json()["id"]
    assert health.status_code == 200
    # Request ids, security headers: the same middleware chain, run synchronously.
    for response in (created, found):
        assert response.headers["x-request-id"]
        assert response.headers["x-content-type-options"] == "nosniff"
    assert request_threads[0].startswith("django-rest") and request_threads[1].startswith("django-rest")
    assert not request_threads[2].startswith("django-rest")  # everything else: Django's ASGI handler


def test_errors_and_other_users_ids_answer_as_before(alice_key, bob_key):
    # More requests than the pool has threads and connections: each request gives its
    # database connection back when it ends.
    created, *rest = _requests(
        [("POST", "/v1/memories", alice_key, {"memory": "Alice's locker code is 4417"})]
        + [("POST", "/v1/memories/search", alice_key, {"query": "locker"}) for _ in range(20)]
        + [
            ("DELETE", f"/v1/memories/{MISSING_ID}", bob_key, None),
            ("POST", "/v1/memories", None, {"memory": "no key"}),
            ("POST", "/v1/memories", alice_key, {"memory": 7}),
        ]
    )
    searches, (missing, no_key, bad_type) = rest[:20], rest[20:]
    assert all(r.status_code == 200 and len(r.json()["results"]) == 1 for r in searches)
    memory_id = created.json()["id"]
    bobs_delete, still_there = _requests(
        [
            ("DELETE", f"/v1/memories/{memory_id}", bob_key, None),
            ("POST", "/v1/memories/search", alice_key, {"query": "locker"}),
        ]
    )
    assert bobs_delete.status_code == missing.status_code == 404
    assert bobs_delete.json()["error"]["code"] == missing.json()["error"]["code"] == "not_found"
    assert [r["id"] for r in still_there.json()["results"]] == [memory_id]
    assert no_key.status_code == 401 and no_key.json()["error"]["code"] == "unauthenticated"
    assert "resource_metadata=" in no_key.headers["www-authenticate"]
    assert bad_type.status_code == 400 and bad_type.json()["error"]["code"] == "invalid_argument"
