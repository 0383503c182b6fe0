"""The request id of the call being served, for every log line of that call.

The HTTP entry points (ASGI wrappers around the MCP and OAuth apps and in front of
Django's handlers for REST, UI and admin; Django's middleware when there is no ASGI
layer, as in its test client) and Celery task runs bind one id per request; the log filter in `core.logs`
stamps it on every record, and the first `CallContext` built during the request takes
it (`request_id_claim`), so the audit row, the usage event, the `X-Request-Id` response
header and the logs all carry the same id.

The id is always ours (a uuid4): it is also the billing idempotency key, unique per
usage event, so a client must not choose it (a reused id would make a call fail or the
gateway drop it as a duplicate). A client's own `X-Request-Id`, if it is a safe short
token, is kept beside it as `client_request_id` for correlation in the logs.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar, Token
from dataclasses import dataclass

REQUEST_ID_HEADER = "X-Request-Id"
# Letters, digits and a few separators, at most 64 characters: safe in a log line, a
# header and a JSON document as they are.
_SAFE_TOKEN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")


@dataclass
class BoundRequest:
    request_id: str
    client_request_id: str = ""
    # Whether a CallContext may take this id: only the first call of an HTTP request
    # does (usage events need unique ids); task runs never lend theirs (a retry reruns
    # with the same task id).
    claimable: bool = True


_current: ContextVar[BoundRequest | None] = ContextVar("memsite_request", default=None)


def request_id_new() -> str:
    return str(uuid.uuid4())


def request_id_safe_token(value: str | None) -> str:
    """`value` if it is a safe short token, else ''."""
    if value and _SAFE_TOKEN.fullmatch(value):
        return value
    return ""


def request_id_current() -> str:
    """The bound request id, or '' outside a request or task run."""
    bound = _current.get()
    return bound.request_id if bound else ""


def request_bound() -> BoundRequest | None:
    return _current.get()


@contextmanager
def request_id_bound(
    request_id: str | None = None, *, client_request_id: str = "", claimable: bool = True
) -> Iterator[BoundRequest]:
    """Bind a request id (a new one unless given) for the duration of the block."""
    bound = BoundRequest(request_id or request_id_new(), request_id_safe_token(client_request_id), claimable)
    token = _current.set(bound)
    try:
        yield bound
    finally:
        _current.reset(token)


def request_id_bind(request_id: str, *, claimable: bool = False) -> Token[BoundRequest | None]:
    """For hooks that cannot wrap a block (Celery's task_prerun/task_postrun signals)."""
    return _current.set(BoundRequest(request_id, "", claimable))


def request_id_unbind(token: Token[BoundRequest | None]) -> None:
    _current.reset(token)


def request_id_claim() -> str:
    """The id for a new CallContext: the bound request's id for the first call of an
    HTTP request, a fresh one otherwise."""
    bound = _current.get()
    if bound is None or not bound.claimable:
        return request_id_new()
    bound.claimable = False
    return bound.request_id
