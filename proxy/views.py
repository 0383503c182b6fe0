"""HTTP edges of the chat proxy: `POST /v1/chat/completions` (async: the upstream's
answer streams through as it arrives) and the staff admin API `/v1/admin/tokens`.
Thin: the work is in proxy.services / proxy.selectors / proxy.messages."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import weakref
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.db import close_old_connections
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.http.response import HttpResponseBase
from django.views.decorators.csrf import csrf_exempt

from core.calls import call_context_from_request
from core.choices import Channel
from core.db_errors import PROGRAM_LIMIT_MESSAGE, is_backend_unavailable, is_program_limit_exceeded
from core.errors import ErrorCode, ServiceError
from core.inputs import InputError, json_loads_safe, text_problem
from core.request_ids import request_bound, request_id_bound
from core.scope import CallContext
from memories.auth import authenticate_bearer
from memories.cursors import CursorError, position_decode, position_encode
from memories.models import ApiKey
from memories.schemas import PAGE_SIZE_DEFAULT, PAGE_SIZE_MAX
from proxy import selectors, services
from proxy.errors import (
    ERROR_HEADER,
    ProxyError,
    backend_unavailable,
    client_gone,
    internal_error,
    memory_unavailable,
    recording_failed,
    request_too_large,
    upstream_address_refused,
    upstream_answer_too_large,
    upstream_error,
    upstream_timeout,
    upstream_unreachable,
)
from proxy.messages import (
    Answer,
    chat_body_parse,
    completion_message,
    history_messages,
    last_user_text,
    messages_enrich,
    turn_items,
)
from proxy.templates import memory_block_render
from proxy.upstream_network import public_only_transport, upstream_address_is_refused

logger = logging.getLogger(__name__)

SESSION_HEADER = "X-Session-Id"
# Not forwarded either way: connection-level, or recomputed by the server that sends.
HOP_HEADERS = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "trailers",
    "transfer-encoding",
    "upgrade",
    "content-length",
    "date",
    "server",
}
# Not relayed from the upstream either: they would speak for our host (cookies, HSTS,
# alternative services) or forge our own error header (X-Memsite-*).
# Content-Encoding: the body is read decoded (aiter_bytes), so an upstream that compresses
# although we asked for identity still gives a parsable answer, relayed as plain bytes.
UPSTREAM_ONLY_HEADERS = {"set-cookie", "set-cookie2", "strict-transport-security", "alt-svc", "content-encoding"}
OWN_HEADER_PREFIX = "x-memsite-"


_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[bool, httpx.AsyncClient]] = (
    weakref.WeakKeyDictionary()
)
_background: set[asyncio.Task] = set()


def _upstream_client(*, public_only: bool) -> httpx.AsyncClient:
    """Pooled clients per event loop (no TLS context or connection set-up per call): one
    for the deployment's own upstream, one that connects to public addresses only, for
    an upstream a key's owner chose (proxy/upstream_network.py).
    Their timeout bounds each read only; `_forward` puts a deadline on the whole answer."""
    loop = asyncio.get_running_loop()
    clients = _clients.setdefault(loop, {})
    client = clients.get(public_only)
    if client is None:
        timeout = httpx.Timeout(settings.PROXY_UPSTREAM_TIMEOUT_S, connect=settings.PROXY_UPSTREAM_CONNECT_TIMEOUT_S)
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=50)
        transport = public_only_transport(limits=limits) if public_only else None
        client = clients[public_only] = httpx.AsyncClient(
            timeout=timeout, limits=limits, trust_env=False, transport=transport
        )
    return client


def _in_thread(fn: Any, *args: Any, **kwargs: Any) -> Any:
    close_old_connections()
    try:
        return fn(*args, **kwargs)
    finally:
        close_old_connections()


_executor: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def _proxy_executor() -> ThreadPoolExecutor:
    """The proxy's own threads for its blocking steps (auth, memory search, recording).
    The event loop's default executor is shared with the MCP toolsets and OAuth: a slow
    memory search or database under chat load would queue their calls behind ours."""
    global _executor
    if _executor is None:
        with _executor_lock:
            if _executor is None:
                size = settings.PROXY_THREADS
                _executor = ThreadPoolExecutor(max_workers=size, thread_name_prefix="proxy")
    return _executor


async def _thread(fn: Any, *args: Any, **kwargs: Any) -> Any:
    return await sync_to_async(_in_thread, thread_sensitive=False, executor=_proxy_executor())(fn, *args, **kwargs)


def _error_response(error: ProxyError) -> JsonResponse:
    response = JsonResponse(error.as_body(), status=error.status)
    response[ERROR_HEADER] = error.code
    if error.retry_after_s:
        response["Retry-After"] = str(error.retry_after_s)
    return response


def _error_event(error: ProxyError) -> bytes:
    """How a stream whose 200 is already sent reports a failure: an OpenAI-style error
    event (the official clients raise it), and no [DONE]."""
    return b"data: " + json.dumps(error.as_body()).encode() + b"\n\n"


def _relayed_headers(headers: httpx.Headers) -> dict[str, str]:
    return {
        name: value
        for name, value in headers.items()
        if (lower := name.lower()) not in HOP_HEADERS
        and lower not in UPSTREAM_ONLY_HEADERS
        and not lower.startswith(OWN_HEADER_PREFIX)
    }


def _prepare(
    authorization: str | None, raw_body: bytes | None, session_header: str | None, subject: str | None, holder: dict
) -> tuple:
    """Auth and config (401), permissions and subject (403/404, audited under the caller's
    own scope), body (413/422), then the rate limit (429)."""
    caller = services.chat_caller_authenticate(authorization=authorization)
    holder["caller"] = caller
    caller = services.chat_caller_authorize(caller, subject=subject)
    holder["caller"] = caller
    if raw_body is None:
        raise request_too_large(f"The request body exceeds {settings.DATA_UPLOAD_MAX_MEMORY_SIZE} bytes.")
    body, messages = chat_body_parse(raw_body)
    session_id = services.session_id_clean(session_header, caller=caller)
    services.chat_rate_limit_consume(caller)
    return caller, body, messages, session_id


@csrf_exempt
async def chat_completions(request: HttpRequest) -> HttpResponseBase:
    if request.method != "POST":
        return _method_not_allowed("POST")
    call = call_context_from_request(request, channel=Channel.PROXY)
    holder: dict[str, Any] = {}
    try:
        raw_body: bytes | None = request.body
    except RequestDataTooBig:
        raw_body = None  # refused (413) once the caller is known, so the refusal is audited
    try:
        caller, body, messages, session_id = await _thread(
            _prepare,
            request.headers.get("Authorization"),
            raw_body,
            request.headers.get(SESSION_HEADER),
            request.headers.get("X-Memory-Subject"),
            holder,
        )
        call = services.chat_call_context(call, caller=caller)
        # The session history and the memory search run side by side.
        history_task = asyncio.ensure_future(_thread(services.chat_history_load, caller, session_id=session_id))
        try:
            memories = await asyncio.wait_for(
                _thread(
                    selectors.chat_memories_find,
                    caller.scope,
                    query=last_user_text(messages),
                    limit=caller.config.memory_limit,
                ),
                timeout=settings.PROXY_MEMORY_SEARCH_TIMEOUT_S,
            )
        except TimeoutError:
            raise memory_unavailable("Memory retrieval timed out; the request was not forwarded.") from None
        finally:
            history_items = await history_task
        block = memory_block_render([m.memory for m in memories]) if memories else None
        enriched = messages_enrich(
            messages, memory_block=block, history=history_messages(history_items, repeated=turn_items(messages))
        )
        # A stored extra_body never overrides the client (nor, from rows saved before the
        # check, sets `stream`: the client's flag decides how the answer is read).
        extra = {
            k: v for k, v in caller.config.extra_body.items() if k not in body and k not in services.EXTRA_BODY_RESERVED
        }
        payload = {**extra, **body, "messages": enriched}
        return await _forward(
            caller,
            holder=holder,
            call=call,
            payload=payload,
            body=body,
            messages=messages,
            session_id=session_id,
            memory_ids=[m.id for m in memories],
            history_items=len(history_items),
        )
    except ProxyError as error:
        logger.info("chat call refused: %s %s", error.status, error.code)
        await _thread(
            services.chat_call_failed,
            holder.get("caller"),
            call=call,
            error=error,
            credential_presented=bool(request.headers.get("Authorization")),
        )
        return _error_response(error)
    except Exception as exc:
        # Django's handler500 would answer its HTML page (a lost database, another JSON
        # shape): the proxy answers in its own, with no text of the exception (it may quote
        # a secret or the prompt), audited once, never billed. Once `_finish` started, it
        # recorded the call.
        unexpected = _unexpected_error(exc, what="chat call")
        if not _finish_started(holder):
            await _thread(
                services.chat_call_failed,
                holder.get("caller"),
                call=call,
                error=unexpected,
                credential_presented=bool(request.headers.get("Authorization")),
            )
        return _error_response(unexpected)
    except asyncio.CancelledError:
        # Django cancels the view when the client disconnects. Before the answer went out
        # (an SDK timeout, a user who gave up), nothing else records the call: it leaves
        # its failure row (not billed, no turn). Once `_finish` started, or the stream was
        # handed over (`relay` records itself), that is the call's record.
        if "caller" in holder and not _finish_started(holder):
            logger.info("chat call abandoned by its client before the answer")
            await asyncio.shield(_thread(services.chat_call_failed, holder["caller"], call=call, error=client_gone()))
        raise


async def _forward(
    caller: services.ChatCaller,
    *,
    holder: dict[str, Any],
    call: CallContext,
    payload: dict[str, Any],
    body: dict[str, Any],
    messages: list[dict[str, Any]],
    session_id: str,
    memory_ids: list[str],
    history_items: int,
) -> HttpResponseBase:
    """The upstream's answer, relayed. An error status passes through unchanged. A 200
    that is not a usable answer is not relayed as a success: whole, it becomes a 502
    `upstream_error` (504 `upstream_timeout`); streamed, the 200 is already out, so the
    stream ends with an error event instead of [DONE]. Either way the call is audited as
    failed, not billed, and no turn is stored (`_finish`). An answer that misses its
    deadline (PROXY_UPSTREAM_TIMEOUT_S read whole; streamed, that long without an event
    or PROXY_STREAM_MAX_S in all) is one of those: `upstream_timeout`."""
    stream = bool(body.get("stream"))
    headers = {"Content-Type": "application/json", "Accept-Encoding": "identity"}
    if caller.config.api_key:
        headers["Authorization"] = f"Bearer {caller.config.api_key}"
    client = _upstream_client(public_only=caller.config.source == "key")
    loop = asyncio.get_running_loop()
    started = loop.time()
    # PROXY_UPSTREAM_TIMEOUT_S is the deadline for the upstream's headers and, read whole,
    # its entire answer: httpx's timeout bounds each read only, so an upstream (a key's
    # owner picks their own) trickling a byte at a time would hold the call and a pooled
    # connection for as long as it liked.
    deadline = started + settings.PROXY_UPSTREAM_TIMEOUT_S
    try:
        request = client.build_request(
            "POST", caller.config.completions_url, content=json.dumps(payload).encode(), headers=headers
        )
        async with asyncio.timeout_at(deadline):
            upstream = await client.send(request, stream=True)
    except TimeoutError:
        logger.warning("chat upstream sent no answer in time")
        raise upstream_timeout() from None
    except (httpx.HTTPError, httpx.InvalidURL, ValueError) as exc:  # ValueError: a header httpx cannot encode
        if upstream_address_is_refused(exc):
            logger.warning("chat upstream refused: not a public address")
            raise upstream_address_refused() from None
        logger.warning("chat upstream unreachable")
        raise upstream_unreachable() from None
    answer = Answer(max_bytes=settings.PROXY_MAX_ANSWER_BYTES)
    finish = {
        "call": call,
        "session_id": session_id,
        "status": upstream.status_code,
        "stream": stream,
        "model": body.get("model"),
        "request_messages": messages,
        "memory_ids": memory_ids,
        "history_items": history_items,
    }
    out_headers = _relayed_headers(upstream.headers)
    ok = 200 <= upstream.status_code < 300
    # An upstream that answers a stream request with one JSON completion is read whole.
    whole = upstream.headers.get("content-type", "").lower().startswith("application/json")
    if not (stream and ok) or whole:
        failure: ProxyError | None = None
        raw = b""
        try:
            async with asyncio.timeout_at(deadline):
                raw = await _read_whole(upstream, limit=settings.PROXY_MAX_ANSWER_BYTES)
            if ok:
                answer.take_message(completion_message(raw))
        except (TimeoutError, httpx.TimeoutException):
            failure = upstream_timeout()
        except httpx.HTTPError:
            failure = upstream_error("The upstream LLM's answer broke off before it was complete.")
        except ProxyError as unusable:
            failure = unusable
        finally:
            await upstream.aclose()
        holder[_FINISH_STARTED] = True
        if failure is not None:
            # Audited here with the upstream's status (not by the caller's generic path).
            logger.warning("chat upstream answer unusable (%s)", failure.code)
            await asyncio.shield(_finish(caller, answer, finish, failure=failure))
            return _error_response(failure)
        if not await asyncio.shield(_finish(caller, answer, finish)):
            return _error_response(recording_failed())
        response = HttpResponse(raw, status=upstream.status_code)
        for name, value in out_headers.items():
            response[name] = value
        return response

    # A stream may take long, but not for ever: PROXY_UPSTREAM_TIMEOUT_S without a whole
    # event (bytes that never complete one count as silence) or PROXY_STREAM_MAX_S in all
    # ends it as timed out (`upstream_timeout`, recorded like any cut-off stream).
    idle_s = settings.PROXY_UPSTREAM_TIMEOUT_S
    stream_max_s = settings.PROXY_STREAM_MAX_S
    stream_end = started + stream_max_s

    async def relay() -> AsyncIterator[bytes]:
        failure: ProxyError | None = None
        client_left = True
        chunks = upstream.aiter_bytes()
        last_event = loop.time()
        try:
            try:
                while True:
                    # Only the read is timed: a timeout around the `yield` would fire in
                    # the response's sending code, while the client reads slowly.
                    try:
                        async with asyncio.timeout_at(min(last_event + idle_s, stream_end)):
                            chunk = await anext(chunks)
                    except StopAsyncIteration:
                        break
                    try:
                        events = answer.feed(chunk)
                    except ProxyError as too_large:
                        failure = too_large
                        break
                    if events:
                        yield events
                        last_event = loop.time()
                if failure is None:  # not cut off as too large: the stream ended
                    rest = answer.close()
                    if answer.errored:
                        failure = upstream_error("The upstream LLM reported an error in its stream.")
                    elif not answer.complete:
                        failure = upstream_error("The upstream LLM's stream ended before the answer was complete.")
                    # The last event may lack its blank line; the upstream's own error event
                    # is relayed too. A cut-off fragment is not.
                    if rest.strip() and (failure is None or answer.errored):
                        yield rest.rstrip(b"\r\n") + b"\n\n"
            except (TimeoutError, httpx.TimeoutException):
                if not answer.done:
                    failure = upstream_timeout()
                    if loop.time() >= stream_end:
                        failure = ProxyError(
                            failure.status,
                            failure.code,
                            f"The upstream LLM's stream took longer than {stream_max_s:g} s; it was cut off.",
                        )
            except httpx.HTTPError:
                if not answer.done:
                    failure = upstream_error("The upstream LLM's stream broke off before the answer was complete.")
            except Exception as exc:
                # Our own code failed mid-stream (the 200 is out): the stream ends as a
                # broken one does, with an error event and no [DONE], recorded as failed
                # (not billed, no turn): what was relayed is not known to be whole.
                failure = _unexpected_error(exc, what="chat stream")
            if failure is not None:
                logger.warning("chat upstream stream failed (%s)", failure.code)
                if not answer.errored:
                    yield _error_event(failure)
            client_left = False
        finally:
            await upstream.aclose()
            # Recorded after the last byte (or when the client left: what it saw is the turn;
            # if it saw no answer, e.g. it timed out while a reasoning model thought, it
            # gave up on the call: `client_gone`, not billed, no turn, as before a 200).
            if client_left and failure is None and answer.as_message() is None:
                failure = client_gone()
            stopped = client_left and failure is None
            await asyncio.shield(_finish(caller, answer, finish, failure=failure, stopped_by_client=stopped))

    holder[_FINISH_STARTED] = True  # from here `relay` records the call, whatever happens
    streaming = StreamingHttpResponse(relay(), status=upstream.status_code)
    for name, value in out_headers.items():
        streaming[name] = value
    return streaming


async def _read_whole(upstream: httpx.Response, *, limit: int) -> bytes:
    """The whole body, up to `limit` bytes (PROXY_MAX_ANSWER_BYTES): past it, 502
    `upstream_answer_too_large` instead of holding whatever an upstream sends."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in upstream.aiter_bytes():
        size += len(chunk)
        if size > limit:
            raise upstream_answer_too_large(f"The upstream LLM's answer exceeds {limit} bytes.")
        chunks.append(chunk)
    return b"".join(chunks)


_FINISH_STARTED = "finish_started"


def _finish_started(holder: dict[str, Any]) -> bool:
    return bool(holder.get(_FINISH_STARTED))


async def _finish(
    caller: services.ChatCaller,
    answer: Answer,
    finish: dict[str, Any],
    *,
    failure: ProxyError | None = None,
    stopped_by_client: bool = False,
) -> bool:
    """Record the call; False if that failed (logged, and a failure audit row attempted,
    so the call is never silently gone)."""
    bound = request_bound()
    rid = finish["call"].request_id
    # The stream ends after the request's middleware returned: bind its id again.
    with request_id_bound(rid, claimable=False) if bound is None else _noop():
        try:
            turn_pk = await _thread(
                services.chat_call_finish,
                caller,
                answer=answer.as_message(),
                failure=failure,
                stopped_by_client=stopped_by_client,
                **finish,
            )
        except Exception:
            logger.exception("could not record the chat call")
            error = failure or recording_failed()
            await _thread(services.chat_call_failed, caller, call=finish["call"], error=error)
            return False
    if turn_pk is not None:
        task = asyncio.get_running_loop().create_task(_thread(services.proxy_turn_enqueue, turn_pk=turn_pk))
        _background.add(task)
        task.add_done_callback(_background.discard)
    return True


class _noop:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: Any) -> None:
        return None


# --- admin API: /v1/admin/tokens (staff credentials only) ------------------------------
def _method_not_allowed(allowed: str) -> JsonResponse:
    response = _error_response(ProxyError(405, "method_not_allowed", f"Use {allowed.replace(', ', ' or ')}."))
    response["Allow"] = allowed
    return response


def _admin_principal(request: HttpRequest, *, call: CallContext):
    """The caller, authorized for the request's method (services.token_config_admin_authorize:
    a staff account, the key's permission and the staff account's model permission)."""
    authorization = request.headers.get("Authorization")
    principal = authenticate_bearer(authorization)
    if principal is None:
        services.token_admin_unauthenticated(call=call, credential_presented=bool(authorization))
        raise ProxyError(401, "invalid_api_key", "A valid bearer token is required.")
    services.token_config_admin_authorize(principal, method=request.method or "", call=call)
    return principal


def _json_body(request: HttpRequest) -> dict[str, Any]:
    """No RecursionError, NaN or NUL gets past this (core.inputs): 413/422, never a 500."""
    try:
        data = json_loads_safe(request.body or b"{}")
    except RequestDataTooBig:
        raise request_too_large() from None
    except InputError as exc:
        if exc.too_large:
            raise request_too_large(f"The body is too large: {exc.message}.") from None
        raise ProxyError(422, "invalid_body", f"The body is not acceptable JSON: {exc.message}.") from None
    if not isinstance(data, dict):
        raise ProxyError(422, "invalid_body", "The body must be a JSON object.")
    return data


def _key_or_404(key_id: Any, target: dict[str, Any], *, retired_too: bool = False) -> ApiKey:
    """The live key `key_id` names (a revoked or expired one, which never authenticates
    again, is 404 as an unknown one); kept in `target`, so a refusal from here on is
    audited under its owner. `retired_too` (DELETE): a revoked or expired key too, so that
    its settings, the encrypted upstream key among them, can be removed."""
    api_key = (
        selectors.token_admin_key(key_id=key_id, retired_too=retired_too)
        # A NUL would reach the database as a DataError: no key has one.
        if isinstance(key_id, str) and not text_problem(key_id)
        else None
    )
    if api_key is None:
        raise ProxyError(404, "not_found", "No such token.")
    target["api_key"] = api_key
    return api_key


def _unexpected_error(exc: Exception, *, what: str = "admin token call") -> ProxyError:
    """What an exception no layer below answered becomes (logged by type only when it is
    a known condition; with its traceback, messages withheld by core.log_safety, otherwise).
    `what`: the call, as the log names it."""
    if is_program_limit_exceeded(exc):  # the request's size: a retry fails the same way
        logger.warning("%s: statement over a database limit (%s)", what, type(exc).__name__)
        return request_too_large(PROGRAM_LIMIT_MESSAGE)
    if is_backend_unavailable(exc):
        logger.warning("%s: database unavailable (%s)", what, type(exc).__name__)
        return backend_unavailable()
    logger.exception("%s failed unexpectedly", what)
    return internal_error()


def _admin(allowed: str):
    """`allowed`: the route's methods, as its `Allow` header lists them. Another method
    is 405 before anything else is read. After authorization, every refusal (404, 409,
    413, 422) leaves its audit row, as the 401 and 403 do (services.token_admin_refused)."""

    def wrap(handler):
        @csrf_exempt
        def view(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            if request.method not in allowed.split(", "):
                return _method_not_allowed(allowed)
            principal = None
            target: dict[str, Any] = {}
            call = call_context_from_request(request, channel=Channel.REST)
            try:
                principal = _admin_principal(request, call=call)
                # Its audit rows name the credential used (`key:<key id>`, never the secret)
                # beside the staff account, as every API call's rows name theirs.
                call = principal.call_attributed(call)
                return handler(request, principal, call, target, *args, **kwargs)
            except ProxyError as error:
                # A 403 is audited where it is decided (token_config_admin_authorize).
                if principal is not None and error.status != 403:
                    services.token_admin_refused(
                        principal, call=call, error=error.as_service_error(), api_key=target.get("api_key")
                    )
                return _error_response(error)
            except ServiceError as error:
                if principal is not None:
                    services.token_admin_refused(principal, call=call, error=error, api_key=target.get("api_key"))
                status = 409 if error.code == ErrorCode.CONFLICT else 422  # seed 004: bad fields are 422
                return _error_response(ProxyError(status, error.code.value, error.message))
            except Exception as exc:
                # Django's handler500 would answer an HTML page (or, for a lost database,
                # another JSON shape): this API answers in its own shape, with no text of
                # the exception (it may quote a secret or a stored value), and audited.
                unexpected = _unexpected_error(exc)
                if principal is not None:
                    services.token_admin_refused(
                        principal, call=call, error=unexpected.as_service_error(), api_key=target.get("api_key")
                    )
                return _error_response(unexpected)

        return view

    return wrap


_DIGITS = re.compile(r"[0-9]{1,9}")  # ASCII only: "²".isdigit() is true and int("²") fails
_LIST_PARAMETERS = frozenset({"cursor", "page_size"})


def _list_cursor_context(staff_user: Any) -> str:
    # A cursor is sealed for the list and the staff account it was issued to.
    return f"proxy-admin-tokens:{staff_user.pk}"


def _list_paging(request: HttpRequest, *, staff_user: Any) -> tuple[int | None, int]:
    """`(after_id, page_size)` from the list's query string, paged as /v1/memories is:
    `page_size` 1-PAGE_SIZE_MAX (default PAGE_SIZE_DEFAULT), `cursor` the previous page's
    `next_cursor`. Anything else (an unknown or repeated parameter, a size out of range, a
    cursor this server did not issue to this staff account) is `invalid_argument` (422)."""
    query = request.GET
    unknown = set(query) - _LIST_PARAMETERS
    if unknown:
        raise ServiceError(ErrorCode.INVALID_ARGUMENT, f"unexpected query parameter {sorted(unknown)[0][:40]!r}")
    for name in query:
        if len(query.getlist(name)) > 1:
            raise ServiceError(ErrorCode.INVALID_ARGUMENT, f"query parameter {name!r} given more than once")
    page_size = PAGE_SIZE_DEFAULT
    if "page_size" in query:
        raw = query["page_size"]
        if not _DIGITS.fullmatch(raw) or not 1 <= int(raw) <= PAGE_SIZE_MAX:
            raise ServiceError(ErrorCode.INVALID_ARGUMENT, f"page_size must be an integer from 1 to {PAGE_SIZE_MAX}.")
        page_size = int(raw)
    after_id = None
    if "cursor" in query:
        try:
            (position,) = position_decode(query["cursor"], kinds=["int"], bound_to=_list_cursor_context(staff_user))
        except CursorError as exc:
            raise ServiceError(ErrorCode.INVALID_ARGUMENT, str(exc)) from None
        assert isinstance(position, int)  # kind "int": position_decode checked it
        after_id = position
    return after_id, page_size


@_admin("GET, POST")
def admin_tokens(request: HttpRequest, principal, call: CallContext, target: dict[str, Any]) -> HttpResponse:
    if request.method == "GET":
        after_id, page_size = _list_paging(request, staff_user=principal.user)
        rows, more = services.token_configs_admin_list(
            call=call, staff_user=principal.user, after_id=after_id, limit=page_size
        )
        next_cursor = (
            position_encode([rows[-1].pk], bound_to=_list_cursor_context(principal.user)) if more and rows else None
        )
        return JsonResponse({"tokens": [selectors.token_config_view(row) for row in rows], "next_cursor": next_cursor})
    data = _json_body(request)
    api_key = _key_or_404(data.pop("key_id", None), target)
    row = services.token_config_save(
        api_key=api_key, fields=data, partial=False, call=call, staff_user=principal.user, must_create=True
    )
    return JsonResponse(selectors.token_config_view(row), status=201)


@_admin("GET, PUT, PATCH, DELETE")
def admin_token(
    request: HttpRequest, principal, call: CallContext, target: dict[str, Any], key_id: str
) -> HttpResponse:
    api_key = _key_or_404(key_id, target, retired_too=request.method == "DELETE")
    if request.method == "GET":
        row = services.token_config_admin_get(api_key=api_key, call=call, staff_user=principal.user)
        if row is None:
            raise ProxyError(404, "not_found", "This token has no configuration.")
        return JsonResponse(selectors.token_config_view(row))
    if request.method in ("PUT", "PATCH"):
        partial = request.method == "PATCH"
        exists = selectors.token_config_of_key(api_key=api_key) is not None
        if partial and not exists:
            raise ProxyError(404, "not_found", "This token has no configuration.")
        if not exists:  # PUT creates it: the staff account needs `add` too
            services.token_config_admin_authorize(principal, method="PUT", call=call, creates=True)
        row = services.token_config_save(
            api_key=api_key, fields=_json_body(request), partial=partial, call=call, staff_user=principal.user
        )
        return JsonResponse(selectors.token_config_view(row))
    if request.method == "DELETE":
        if not services.token_config_delete(api_key=api_key, call=call, staff_user=principal.user):
            raise ProxyError(404, "not_found", "This token has no configuration.")
        return HttpResponse(status=204)
    raise AssertionError(request.method)  # _admin answered any other method
