"""A request body read whole in front of an ASGI app, then handed to the app again.

Gates that must look at the body before a framework does (the MCP toolsets' JSON-RPC
checks, the OAuth endpoints' text checks) read it here and pass the app a `receive` that
replays the same messages, so the app reads the request as if nobody had."""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

Receive = Callable[[], Awaitable[dict[str, Any]]]


async def asgi_body_buffered(receive: Receive, *, max_bytes: int | None = None) -> tuple[bytes, Receive] | None:
    """(the whole body, a receive that replays it), or None once the body passes
    `max_bytes` (what was read of it is dropped)."""
    messages: list[dict[str, Any]] = []
    body = bytearray()
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            break
        body += message.get("body", b"")
        if max_bytes is not None and len(body) > max_bytes:
            return None
        if not message.get("more_body", False):
            break
    pending = deque(messages)

    async def replay() -> dict[str, Any]:
        return pending.popleft() if pending else await receive()

    return bytes(body), replay
