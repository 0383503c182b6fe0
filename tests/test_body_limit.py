"""No request body over REQUEST_BODY_MAX_BYTES is read (memsite/body_limit.py): Django
spools a body to disk whole before authentication runs, so an anonymous huge POST would
be written out in full before its 401. Driven through the web process's whole ASGI app."""

from __future__ import annotations

import asyncio
import json

import pytest

from audit.models import AuditEvent, AuthFailureWindow

pytestmark = [pytest.mark.django_db(transaction=True)]


def post(
    path: str, chunks: list[bytes], *, headers: list[tuple[bytes, bytes]], host: bytes = b"localhost"
) -> tuple[int, bytes, int]:
    """POST `chunks` as separate body messages: the status, the body, and how many
    chunks the app read."""
    from memsite.asgi import build_application

    async def main() -> tuple[int, bytes, int]:
        app = build_application()
        pending = list(chunks)
        read = 0
        status: list[int] = []
        body: list[bytes] = []

        async def receive() -> dict:
            nonlocal read
            if not pending:
                await asyncio.Event().wait()  # the client waits for its answer
            read += 1
            chunk = pending.pop(0)
            return {"type": "http.request", "body": chunk, "more_body": bool(pending)}

        async def send(message: dict) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            elif message["type"] == "http.response.body":
                body.append(message.get("body", b""))

        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
            "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
            "headers": [(b"host", host), *headers], "client": ("127.0.0.1", 40000),
            "server": ("localhost", 80),
        }  # fmt: skip
        await asyncio.wait_for(app(scope, receive, send), timeout=60)
        return status[0], b"".join(body), read

    return asyncio.run(main())


def rows() -> tuple[int, int]:
    return AuditEvent.objects.count(), AuthFailureWindow.objects.count()


def test_a_declared_length_over_the_cap_is_refused_before_a_byte_is_read(settings):
    settings.REQUEST_BODY_MAX_BYTES = 64 * 1024
    before = rows()
    status, body, read = post(
        "/v1/memories",
        [b"x" * 1024],
        headers=[(b"content-length", str(10**10).encode()), (b"authorization", b"Bearer x")],
    )
    assert status == 413 and read == 0
    assert json.loads(body)["error"]["code"] == "payload_too_large"
    assert rows() == before  # no app ran: no 401 counted, no audit row


def test_a_body_without_a_length_stops_being_read_at_the_cap(settings):
    settings.REQUEST_BODY_MAX_BYTES = 64 * 1024
    chunks = [b"y" * 16 * 1024] * 100  # 1.6 MB in 16 KiB messages, no Content-Length
    status, body, read = post("/v1/memories/import", chunks, headers=[(b"authorization", b"Bearer x")])
    assert status == 413 and json.loads(body)["error"]["code"] == "payload_too_large"
    assert read <= 5  # the fifth message passed 64 KiB: nothing after it was read
    status, page, read = post("/data/import/", chunks, headers=[(b"content-type", b"application/octet-stream")])
    assert status == 413 and b"Request too large" in page and read <= 5


def test_a_body_under_the_cap_reaches_its_app(settings, alice_key):
    settings.REQUEST_BODY_MAX_BYTES = 64 * 1024
    memory = json.dumps({"memory": "Alice waters the ferns on Sundays"}).encode()
    status, body, _ = post(
        "/v1/memories",
        [memory[:10], memory[10:]],
        headers=[
            (b"authorization", f"Bearer {alice_key}".encode()),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(memory)).encode()),
        ],
    )
    assert status in (200, 201), body
    assert json.loads(body)["duplicate"] is False


def test_a_chunked_body_reaches_its_app_whole(settings, alice_key):
    """A body sent chunked (no Content-Length: Node's fetch with a stream, curl -T -) is
    read whole: Django alone reads a body without a length as empty."""
    settings.REQUEST_BODY_MAX_BYTES = 64 * 1024
    memory = json.dumps({"memory": "Alice repots the basil every spring"}).encode()
    headers = [
        (b"authorization", f"Bearer {alice_key}".encode()),
        (b"content-type", b"application/json"),
        (b"transfer-encoding", b"chunked"),
    ]
    status, body, _ = post("/v1/memories", [memory[:10], memory[10:20], memory[20:]], headers=headers)
    assert status in (200, 201), body
    assert json.loads(body)["duplicate"] is False
    status, body, _ = post("/v1/memories", [memory, b""], headers=headers)
    assert status in (200, 201), body
    assert json.loads(body)["duplicate"] is True  # the same text, read whole again


def test_a_chunked_body_over_the_cap_is_refused(settings):
    settings.REQUEST_BODY_MAX_BYTES = 64 * 1024
    chunks = [b"y" * 16 * 1024] * 100
    headers = [(b"authorization", b"Bearer x"), (b"transfer-encoding", b"chunked")]
    before = rows()
    status, body, read = post("/v1/memories", chunks, headers=headers)
    assert status == 413 and json.loads(body)["error"]["code"] == "payload_too_large"
    assert read <= 5
    assert rows() == before  # refused before any app ran


def test_a_chunked_body_to_mcp_is_left_to_its_gate(settings):
    """The MCP gate checks the host and the bearer before it reads any body, with its own
    cap: an unauthenticated chunked POST is refused without a chunk read."""
    settings.REQUEST_BODY_MAX_BYTES = 64 * 1024 * 1024
    chunks = [b"z" * 16 * 1024] * 200
    status, _, read = post(
        "/engines/memory/mcp",
        chunks,
        headers=[(b"content-type", b"application/json"), (b"transfer-encoding", b"chunked")],
    )
    assert status == 401 and read == 0


def test_a_foreign_host_is_refused_before_its_body_is_read_or_weighed(settings):
    """A Host not in ALLOWED_HOSTS with a body over the cap got 413 before any surface
    checked the host, and a chunked one to a Django path was read (spooled) first. The
    host's refusal comes first now, whatever the body, and not a chunk of it is read: the
    OAuth endpoints, MCP and Django's JSON surfaces answer 421 in their shape, a page
    Django's 400 page. An allowed host keeps its 413."""
    settings.REQUEST_BODY_MAX_BYTES = 64 * 1024
    declared = [(b"content-length", str(10**10).encode()), (b"content-type", b"application/json")]
    chunked = [(b"transfer-encoding", b"chunked"), (b"content-type", b"application/json")]
    chunks = [b"y" * 16 * 1024] * 100
    before = rows()
    for path, headers in [
        ("/oauth/token", declared), ("/oauth/register", chunked), ("/engines/memory/mcp", declared),
        ("/v1/memories", declared), ("/v1/memories", chunked), ("/.well-known/oauth-authorization-server", chunked),
    ]:  # fmt: skip
        status, body, read = post(path, chunks, headers=headers, host=b"evil.example")
        assert (status, read) == (421, 0), (path, status, read, body[:200])
        assert b"ALLOWED_HOSTS" in body and b"evil.example" not in body, path
    for path, headers in [("/data/import/", chunked), ("/accounts/login/", declared)]:
        status, page, read = post(path, chunks, headers=headers, host=b"evil.example")
        assert (status, read) == (400, 0), (path, status, read)
        assert b"Request too large" not in page, path
    assert rows() == before
    status, body, read = post("/oauth/token", chunks, headers=declared)
    assert (status, read) == (413, 0) and json.loads(body)["error"]["code"] == "payload_too_large"
