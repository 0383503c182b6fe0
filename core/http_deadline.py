"""Outbound HTTP with a total deadline and a byte cap.

httpx's timeouts bound each network operation, not the call: a server that sends its
headers and then one body byte every half second (every read well inside the timeout)
holds a call for as long as it likes, and so does one that drips its headers or its TLS
handshake. Here the whole exchange is bounded instead: inside `outbound_deadline`, and for
each request sent through a deadline transport, every connect, TLS handshake, read and
write waits at most until the deadline, then fails as a timeout of its stack (so callers'
existing `except httpx.TimeoutException` / SDK timeout paths handle it).

The deadline lives in a thread-local: a sync request does all of its I/O on the thread
that sends it or reads its body, and the body wrapper re-enters the deadline on every
chunk, whichever thread reads it.

Two HTTP stacks run in this process: httpx (our own calls) and httpx2 (the OpenAI and
Google SDKs, which mem0 builds); each has its transport here. Both reach the socket
through httpcore's network backend, which is where the deadline is applied.

Name lookups are bounded too (`addresses_resolved`): getaddrinfo takes no timeout, and the
system resolver's own retries last many seconds, so a lookup runs on a thread of its own
and the caller stops waiting at its deadline.
"""

from __future__ import annotations

import ipaddress
import queue
import socket
import ssl
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpcore
import httpcore2
import httpx
import httpx2

_local = threading.local()
# Writes go out in pieces so that a peer that reads slowly meets the deadline between
# them (the backend's own loop gives each `send` the whole timeout).
_WRITE_CHUNK = 64 * 1024


class ResponseTooLarge(httpx.ReadError):
    """The body passed its byte cap; what was read is dropped."""


def _deadline_now() -> float | None:
    deadline: float | None = getattr(_local, "deadline", None)
    return deadline


@contextmanager
def outbound_deadline(seconds: float) -> Iterator[float]:
    """Every outbound operation on this thread inside the block ends by `seconds` from
    now (nested blocks keep the earlier deadline). Yields the deadline (monotonic)."""
    previous = _deadline_now()
    deadline = time.monotonic() + seconds
    if previous is not None:
        deadline = min(previous, deadline)
    _local.deadline = deadline
    try:
        yield deadline
    finally:
        _local.deadline = previous


@contextmanager
def _deadline_entered(deadline: float) -> Iterator[None]:
    previous = _deadline_now()
    _local.deadline = deadline if previous is None else min(previous, deadline)
    try:
        yield
    finally:
        _local.deadline = previous


def deadline_remaining(timeout: float | None, *, expired: type[Exception] = TimeoutError) -> float | None:
    """`timeout` shortened to what is left of this thread's deadline; raises `expired`
    once the deadline has passed. Without a deadline, `timeout` unchanged."""
    deadline = _deadline_now()
    if deadline is None:
        return timeout
    left = deadline - time.monotonic()
    if left <= 0:
        raise expired("the outbound call's total deadline passed")
    return left if timeout is None else min(timeout, left)


# --- name lookups --------------------------------------------------------------------------
def addresses_resolved(host: str, port: int, *, expired: type[Exception] = TimeoutError) -> list[str]:
    """The addresses of `host` in the resolver's order (an address literal as it is),
    looked up within this thread's deadline; without one, as getaddrinfo does. Raises
    getaddrinfo's OSError, or `expired` once the deadline passes. A lookup that outlives
    its caller finishes on its own daemon thread, which then ends."""
    try:
        return [str(ipaddress.ip_address(host.strip("[]")))]
    except ValueError:
        pass
    remaining = deadline_remaining(None, expired=expired)
    if remaining is None:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    else:
        answer: queue.SimpleQueue[Any] = queue.SimpleQueue()

        def lookup() -> None:
            try:
                answer.put(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
            except BaseException as exc:  # handed to the waiting caller
                answer.put(exc)

        threading.Thread(target=lookup, name="memsite-name-lookup", daemon=True).start()
        try:
            outcome = answer.get(timeout=remaining)
        except queue.Empty:
            raise expired("the name lookup outlasted the outbound call's total deadline") from None
        if isinstance(outcome, BaseException):
            raise outcome
        infos = outcome
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


# --- httpcore network backend ------------------------------------------------------------
@dataclass(frozen=True)
class _Timeouts:
    connect: type[Exception]
    read: type[Exception]
    write: type[Exception]
    connect_failed: type[Exception]


_HTTPCORE = _Timeouts(httpcore.ConnectTimeout, httpcore.ReadTimeout, httpcore.WriteTimeout, httpcore.ConnectError)
_HTTPCORE2 = _Timeouts(httpcore2.ConnectTimeout, httpcore2.ReadTimeout, httpcore2.WriteTimeout, httpcore2.ConnectError)


class _DeadlineStream:
    """A network stream whose every wait ends by the thread's deadline. Duck-typed: the
    same for httpcore and httpcore2 (their stream interfaces are identical)."""

    def __init__(self, inner: Any, timeouts: _Timeouts) -> None:
        self._inner = inner
        self._timeouts = timeouts

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        data: bytes = self._inner.read(max_bytes, deadline_remaining(timeout, expired=self._timeouts.read))
        return data

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        for start in range(0, len(buffer), _WRITE_CHUNK):
            chunk = buffer[start : start + _WRITE_CHUNK]
            self._inner.write(chunk, deadline_remaining(timeout, expired=self._timeouts.write))

    def close(self) -> None:
        self._inner.close()

    def start_tls(
        self, ssl_context: ssl.SSLContext, server_hostname: str | None = None, timeout: float | None = None
    ) -> _DeadlineStream:
        remaining = deadline_remaining(timeout, expired=self._timeouts.connect)
        return _DeadlineStream(self._inner.start_tls(ssl_context, server_hostname, remaining), self._timeouts)

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _DeadlineBackend:
    def __init__(self, inner: Any, timeouts: _Timeouts) -> None:
        self._inner = inner
        self._timeouts = timeouts

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> _DeadlineStream:
        """Each of the host's addresses in turn, as socket.create_connection tries them, with
        the name looked up within the deadline. TLS still names the host (httpcore passes
        it to start_tls), so certificates are checked against the name, not the address."""
        remaining = deadline_remaining(timeout, expired=self._timeouts.connect)
        if _deadline_now() is None:
            addresses = [host]  # no deadline: the inner backend looks the name up itself
        else:
            try:
                addresses = addresses_resolved(host, port, expired=self._timeouts.connect)
            except OSError as error:
                raise self._timeouts.connect_failed(str(error)) from error
        failure: Exception | None = None
        for address in addresses:
            try:
                stream = self._inner.connect_tcp(
                    address, port, timeout=remaining, local_address=local_address, socket_options=socket_options
                )
            except self._timeouts.connect_failed as error:  # the next address, as create_connection does
                failure = error
                remaining = deadline_remaining(timeout, expired=self._timeouts.connect)
                continue
            return _DeadlineStream(stream, self._timeouts)
        raise failure or self._timeouts.connect_failed(f"{host} has no address")

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> _DeadlineStream:
        remaining = deadline_remaining(timeout, expired=self._timeouts.connect)
        stream = self._inner.connect_unix_socket(path, timeout=remaining, socket_options=socket_options)
        return _DeadlineStream(stream, self._timeouts)

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


def _pool_bounded(pool: Any, timeouts: _Timeouts) -> None:
    # httpx builds its httpcore pool itself and takes no network backend, so the pool's
    # backend is wrapped after the fact (the same attribute in httpcore and httpcore2).
    pool._network_backend = _DeadlineBackend(pool._network_backend, timeouts)


# --- response bodies -------------------------------------------------------------------
def _bounded_chunks(
    inner: Iterable[bytes], *, deadline: float, max_bytes: int | None, too_large: type[Exception]
) -> Iterator[bytes]:
    chunks = iter(inner)
    received = 0
    while True:
        # Entered per chunk, not across the `yield`: the reader may be another thread.
        with _deadline_entered(deadline):
            chunk = next(chunks, None)
        if chunk is None:
            return
        received += len(chunk)
        if max_bytes is not None and received > max_bytes:
            raise too_large(f"the response is larger than {max_bytes} bytes")
        yield chunk


class _HttpxBody(httpx.SyncByteStream):
    def __init__(self, inner: httpx.SyncByteStream, *, deadline: float, max_bytes: int | None) -> None:
        self._inner = inner
        self._deadline = deadline
        self._max_bytes = max_bytes

    def __iter__(self) -> Iterator[bytes]:
        return _bounded_chunks(
            self._inner, deadline=self._deadline, max_bytes=self._max_bytes, too_large=ResponseTooLarge
        )

    def close(self) -> None:
        self._inner.close()


class _Httpx2Body(httpx2.SyncByteStream):
    def __init__(self, inner: httpx2.SyncByteStream, *, deadline: float, max_bytes: int | None) -> None:
        self._inner = inner
        self._deadline = deadline
        self._max_bytes = max_bytes

    def __iter__(self) -> Iterator[bytes]:
        return _bounded_chunks(
            self._inner, deadline=self._deadline, max_bytes=self._max_bytes, too_large=httpx2.ReadError
        )

    def close(self) -> None:
        self._inner.close()


# --- transports --------------------------------------------------------------------------
class DeadlineTransport(httpx.HTTPTransport):
    """httpx transport: each request (connect, send, headers, body) ends within `total_s`,
    and its body within `max_bytes` (ResponseTooLarge). Environment proxies are not used
    (a custom transport turns them off in httpx.Client)."""

    def __init__(self, *, total_s: float, max_bytes: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._total_s = total_s
        self._max_bytes = max_bytes
        _pool_bounded(self._pool, _HTTPCORE)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        deadline = time.monotonic() + self._total_s
        with _deadline_entered(deadline):
            response = super().handle_request(request)
        assert isinstance(response.stream, httpx.SyncByteStream)
        response.stream = _HttpxBody(response.stream, deadline=deadline, max_bytes=self._max_bytes)
        return response


class Httpx2DeadlineTransport(httpx2.HTTPTransport):
    """The same for httpx2, the stack of the OpenAI and Google SDKs (pass it as their
    client's transport). Each request, so each SDK retry, has its own `total_s`."""

    def __init__(self, *, total_s: float, max_bytes: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._total_s = total_s
        self._max_bytes = max_bytes
        _pool_bounded(self._pool, _HTTPCORE2)

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        deadline = time.monotonic() + self._total_s
        with _deadline_entered(deadline):
            response = super().handle_request(request)
        assert isinstance(response.stream, httpx2.SyncByteStream)
        response.stream = _Httpx2Body(response.stream, deadline=deadline, max_bytes=self._max_bytes)
        return response


def deadline_client(*, total_s: float, max_bytes: int | None) -> httpx.Client:
    """A client whose every request ends within `total_s` in all (a timeout otherwise)
    and reads at most `max_bytes` of body (ResponseTooLarge otherwise). Redirects are not
    followed. Use it as a context manager."""
    return httpx.Client(transport=DeadlineTransport(total_s=total_s, max_bytes=max_bytes), timeout=total_s)


def response_head(response: httpx.Response, *, max_bytes: int) -> bytes:
    """The first `max_bytes` of a streamed response's body; the rest is never read (for
    quoting an error answer without waiting for, or holding, all of it)."""
    head = b""
    for chunk in response.iter_bytes():
        head += chunk
        if len(head) >= max_bytes:
            break
    return head[:max_bytes]


# --- plain sockets (http.client) --------------------------------------------------------
class DeadlineSSLSocket(ssl.SSLSocket):
    """An SSL socket whose every wait ends by the thread's deadline (`outbound_deadline`):
    http.client reads a header line or a body in many reads, each given the socket's whole
    timeout. Use as `context.sslsocket_class`; a passed deadline raises TimeoutError."""

    def _clamp(self) -> None:
        remaining = deadline_remaining(None)
        if remaining is not None:
            self.settimeout(remaining)

    def do_handshake(self, block: bool = False) -> None:
        self._clamp()
        super().do_handshake(block)

    def read(self, len: int = 1024, buffer: Any = None) -> Any:  # noqa: A002 - ssl.SSLSocket's name
        self._clamp()
        return super().read(len, buffer)

    def send(self, data: Any, flags: int = 0) -> int:
        self._clamp()
        return super().send(data, flags)
